"""The naive baseline KIVI improves on: keys quantized per token, like values.

A key's outlier channels then share a scale with the ordinary channels of the same token, so the step size is set by
the outliers and the ordinary channels lose most of their precision. Same storage, residual and byte accounting as
:mod:`kvviz.methods.kivi`; only the key grouping differs.
"""

from kvviz.cache.spec import register
from kvviz.methods.kivi import BITS, GROUP, RESIDUAL, GroupQuantMethod


@register
class PerToken(GroupQuantMethod):
    name = "per_token"
    summary = "Baseline: keys and values both quantized per token in groups of channels (no outlier-channel handling)."
    params = (BITS, GROUP, RESIDUAL)
    keys_per_channel = False

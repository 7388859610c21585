"""The baseline: every token kept, in the model's dtype."""

from kvviz.cache.protocol import EvictionMethod
from kvviz.cache.spec import register


@register
class Full(EvictionMethod):
    name = "full"
    summary = "Keep every token at full precision: the reference every other method is compared with."

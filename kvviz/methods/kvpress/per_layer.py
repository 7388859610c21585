"""Per-layer budgets given by the user: one compression ratio per layer (kvpress's PerLayerCompressionPress).

``ratios`` lists ratios separated by ``/`` from the first layer to the last: as many as the model has layers, or
fewer, spread linearly over the layers (``0.2/0.8`` ramps from 0.2 in the first layer to 0.8 in the last; one value
applies to every layer). Within a layer every KV head keeps its top entries under the chosen kvpress scorer.
"""

from __future__ import annotations

import math

from kvviz.cache.spec import Param, SpecError, register
from kvviz.methods.kvpress.scorer import KVPressScorer, kept_count, press_param


def layer_ratio(ratios: tuple[float, ...], layer_idx: int, layers: int) -> float:
    """Layer ``layer_idx``'s ratio: its own value, or linear interpolation when fewer values than layers."""
    if len(ratios) == layers or len(ratios) == 1:
        return ratios[min(layer_idx, len(ratios) - 1)]
    where = layer_idx * (len(ratios) - 1) / max(1, layers - 1)
    low = math.floor(where)
    high = min(low + 1, len(ratios) - 1)
    return ratios[low] + (where - low) * (ratios[high] - ratios[low])


@register
class PerLayer(KVPressScorer):
    name = "per_layer"
    summary = ("User-given per-layer budgets: a compression ratio per layer ('/'-separated, interpolated when fewer "
               "than the layers); each layer keeps its top entries per KV head under a kvpress scorer.")
    ratio_param = "ratios"
    params = (
        press_param("kvpress scorer ranking the entries within a layer"),
        Param("ratios", str, "0.2/0.8", "share of the prompt removed per layer, first to last, '/'-separated",),
    )

    def validate(self) -> None:
        try:
            values = tuple(float(v) for v in self.ratios.split("/"))
        except ValueError:
            values = ()
        if not values or any(not 0 <= v <= 0.99 for v in values):
            raise SpecError(f"bad value in 'per_layer:ratios={self.ratios}': expected ratios in [0, 0.99] "
                            "separated by '/', e.g. 0.2/0.5/0.8")
        self.values_per_layer = values
        self.ratio = max(values)  # the press's own setting; the counts come from layer_kept

    def budget_for(self, prompt_length: int) -> None:
        return None  # one budget per layer: see layer_budget_for

    def layer_kept(self, length: int, layer_idx: int, layers: int) -> int:
        if len(self.values_per_layer) > layers:
            raise SpecError(f"per_layer gives {len(self.values_per_layer)} ratios; the model has {layers} layers")
        ratio = layer_ratio(self.values_per_layer, layer_idx, layers)
        return kept_count(length, ratio)

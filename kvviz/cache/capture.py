"""What a prefill records beyond its output: the capture configuration methods declare, and the attention modules'
inputs (kvpress scorers recompute queries from them). The attention function is :mod:`kvviz.cache.attention`, the
statistics it folds into are :mod:`kvviz.cache.stats`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch


@dataclass
class CaptureConfig:
    """What the statistics recorder keeps beyond the always-on O(N) statistics.

    ``matrices`` lists (layer, query head) pairs whose full attention matrix is kept, block-averaged down to at most
    ``matrix_size`` x ``matrix_size``. ``windows`` lists observation-window sizes for which the attention of the
    last ``w`` queries is summed per key (what SnapKV-style selection reads).
    """

    sink_tokens: int = 4
    matrices: list[tuple[int, int]] = field(default_factory=list)
    matrix_size: int = 256
    windows: tuple[int, ...] = ()
    layers: tuple[int, ...] | None = None  # None: every layer
    layer_inputs: bool = False  # keep each attention module's input (kvpress scorers recompute queries from it)
    all_queries: bool = True  # sink mass and attention received per key over every query; False: windows only,
    # so attention runs SDPA for all but the last max(windows) queries (what SnapKV-style selection needs)
    received_layers: tuple[int, ...] | None = None  # layers whose received attention per key is summed over every
    # query (None: all). It needs explicit attention; other layers run SDPA and get their sink mass through it.

    @property
    def window_rows(self) -> int:
        """Trailing queries the capture reads: all of them, or just the longest observation window."""
        return max(self.windows, default=0)

    def merged(self, other: CaptureConfig | None) -> CaptureConfig:
        """This capture widened to also record what ``other`` asks for, so one prefill serves both.

        Windows, matrices, layer inputs and every-query statistics are united; ``sink_tokens`` and ``matrix_size``
        stay this capture's (methods never set them; :meth:`covers` tells when they differ).
        """
        if other is None:
            return self
        received = [c.received_layers for c in (self, other) if c.all_queries]
        return replace(self, windows=tuple(sorted(set(self.windows) | set(other.windows))),
                       matrices=sorted(set(self.matrices) | set(other.matrices)), layers=None,
                       layer_inputs=self.layer_inputs or other.layer_inputs,
                       all_queries=self.all_queries or other.all_queries,
                       received_layers=None if None in received else tuple(sorted({i for r in received for i in r})))

    def covers(self, other: CaptureConfig | None) -> bool:
        """Whether a prefill recorded with this capture has everything ``other`` reads."""
        if other is None:
            return True
        if not (set(other.windows) <= set(self.windows) and set(other.matrices) <= set(self.matrices)
                and other.sink_tokens == self.sink_tokens and other.matrix_size == self.matrix_size
                and self.layer_inputs >= other.layer_inputs and self.all_queries >= other.all_queries):
            return False
        return (not other.all_queries or self.received_layers is None
                or (other.received_layers is not None and set(other.received_layers) <= set(self.received_layers)))

    @staticmethod
    def uniting(needs: Iterable[CaptureConfig | None]) -> CaptureConfig | None:
        """One capture covering every need (None when nothing is needed)."""
        united = None
        for need in needs:
            united = need if united is None else united.merged(need)
        return united


@dataclass
class LayerInputs:
    """What one attention module received at prefill: what kvpress's ``score(module, hidden_states, ...)`` reads."""

    module: torch.nn.Module
    hidden_states: torch.Tensor  # [B, N, hidden]
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None  # RoPE (cos, sin), each [B, N, D]
    rotary_emb: torch.nn.Module | None = None  # the model's rotary embedding (scorers that extrapolate positions)


@contextlib.contextmanager
def recording_layer_inputs(model: torch.nn.Module, into: dict[int, LayerInputs]):
    """Keep every attention module's input during the forwards inside this block (pre-hooks, removed after)."""
    hooks = []
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)

    def keep(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        into[module.layer_idx] = LayerInputs(module, hidden.detach(), kwargs.get("position_embeddings"), rotary)

    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "q_proj"):
            hooks.append(module.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        yield into
    finally:
        for hook in hooks:
            hook.remove()

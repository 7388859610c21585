"""Attention statistics of one prefill, folded block by block as the attention function computes them (O(N) memory
per layer and head; the block-averaged matrices are bounded by their size)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvviz.cache.capture import CaptureConfig, LayerInputs


@dataclass
class AttentionStats:
    """Per-layer, per-query-head statistics of one prefill. Tensors are on CPU, float32.

    key_attention[l]: [q_heads, N] attention received by each key, summed over queries (heavy-hitter score).
    sink_mass[l]: [q_heads, N] share of each query's attention on the first ``sink_tokens`` keys.
    window_attention[w][l]: [q_heads, N] attention from the last ``w`` queries, summed, per key.
    matrices[(l, h)]: [rows, cols] block-averaged attention matrix.
    layer_inputs[l]: the attention module, its input hidden states and rotary embeddings (when asked for).
    """

    num_tokens: int
    sink_tokens: int
    key_attention: dict[int, torch.Tensor] = field(default_factory=dict)
    sink_mass: dict[int, torch.Tensor] = field(default_factory=dict)
    window_attention: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    matrices: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    layer_inputs: dict[int, LayerInputs] = field(default_factory=dict)

    def sink_mass_per_layer(self) -> list[float]:
        """Mean share of attention that goes to the sink tokens, per layer (queries past the sinks only)."""
        return [float(self.sink_mass[layer][:, self.sink_tokens :].mean()) for layer in sorted(self.sink_mass)]

    def nbytes(self) -> int:
        tensors = [*self.key_attention.values(), *self.sink_mass.values(), *self.matrices.values()]
        tensors += [t for per_window in self.window_attention.values() for t in per_window.values()]
        tensors += [inputs.hidden_states for inputs in self.layer_inputs.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


class StatsRecorder:
    """An attention listener that folds each probability block into :class:`AttentionStats` (batch 0 only)."""

    partial_keys = True

    def __init__(self, config: CaptureConfig, num_tokens: int):
        """``num_tokens``: the prompt's length, which is both the queries and the keys of its prefill."""
        self.config = config
        self.stats = AttentionStats(num_tokens=num_tokens, sink_tokens=config.sink_tokens)
        self._matrix_counts: dict[tuple[int, int], torch.Tensor] = {}

    def wants(self, layer_idx: int) -> bool:
        return self.config.layers is None or layer_idx in self.config.layers

    def _explicit(self, layer_idx: int) -> bool:
        """Whether this layer needs every query's probabilities (a matrix, or received attention per key)."""
        config = self.config
        received = config.all_queries and (config.received_layers is None or layer_idx in config.received_layers)
        return received or any(layer == layer_idx for layer, _ in config.matrices)

    def query_rows(self, layer_idx: int, query_total: int) -> int:
        return query_total if self._explicit(layer_idx) else self.config.window_rows

    def sink_tokens_for(self, layer_idx: int) -> int:
        return self.config.sink_tokens if self.config.all_queries and not self._explicit(layer_idx) else 0

    def observe_sink_mass(self, layer_idx: int, mass: torch.Tensor) -> None:
        # a compact copy: ``mass`` is a strided view into the layer's whole attention output
        self.stats.sink_mass[layer_idx] = mass[0].detach().float().clone(memory_format=torch.contiguous_format)

    def observe(self, layer_idx: int, probs: torch.Tensor, query_start: int, query_total: int) -> None:
        """Fold a block into the statistics where it lies: on an accelerator the sums stay there and only the
        folded statistics move to the CPU, at :meth:`finish` (copying every block out cost 30 s per 4K prefill)."""
        probs = probs[0].detach().float()  # [H, block, K]
        heads, block, width = probs.shape
        device = probs.device
        stats = self.stats
        keys = max(width, stats.num_tokens)
        if self.config.all_queries:  # rows may be all queries, or just a window's when SDPA gave the sink mass
            if layer_idx not in stats.sink_mass:
                stats.sink_mass[layer_idx] = torch.zeros(heads, query_total, device=device)
            sinks = probs[:, :, : self.config.sink_tokens].sum(-1)
            stats.sink_mass[layer_idx][:, query_start : query_start + block] = sinks
            if self._explicit(layer_idx):
                if layer_idx not in stats.key_attention:
                    stats.key_attention[layer_idx] = torch.zeros(heads, keys, device=device)
                stats.key_attention[layer_idx][:, :width] += probs.sum(dim=1)
        for window in self.config.windows:
            first = max(query_start, query_total - window)
            if first < query_start + block:
                summed = probs[:, first - query_start :].sum(dim=1)
                per_layer = stats.window_attention.setdefault(window, {})
                per_layer.setdefault(layer_idx, torch.zeros(heads, keys, device=device))[:, :width] += summed
        for layer, head in self.config.matrices:
            if layer == layer_idx:
                self._fold_matrix((layer, head), probs[head], query_start, query_total, keys)

    def _fold_matrix(self, where: tuple[int, int], rows: torch.Tensor, start: int, total: int, keys: int) -> None:
        """Fold a slab of rows into at most ``matrix_size`` bins per side.

        Each cell is the attention mass a query bin puts on a key bin (summed over keys, averaged over queries),
        so every row still sums to one however far it is downsampled.
        """
        size, device = self.config.matrix_size, rows.device
        row_bins, col_bins = min(total, size), min(keys, size)
        width = rows.shape[1]  # may be fewer than ``keys``: the rest got no attention
        if where not in self.stats.matrices:
            self.stats.matrices[where] = torch.zeros(row_bins, col_bins, device=device)
            self._matrix_counts[where] = torch.zeros(row_bins, 1, device=device)
        row_index = torch.div(torch.arange(start, start + rows.shape[0], device=device) * row_bins, total,
                              rounding_mode="floor")
        col_index = torch.div(torch.arange(width, device=device) * col_bins, keys, rounding_mode="floor")
        by_col = torch.zeros(rows.shape[0], col_bins, device=device).index_add_(1, col_index, rows)  # O(block)
        self.stats.matrices[where].index_add_(0, row_index, by_col)
        self._matrix_counts[where].index_add_(0, row_index, torch.ones(rows.shape[0], 1, device=device))

    def finish(self) -> AttentionStats:
        """The statistics, on the CPU (readers index them freely)."""
        stats = self.stats
        for where, counts in self._matrix_counts.items():
            stats.matrices[where] = stats.matrices[where] / counts.clamp(min=1)
        self._matrix_counts.clear()
        for table in (stats.key_attention, stats.sink_mass, stats.matrices, *stats.window_attention.values()):
            for name, tensor in table.items():
                table[name] = tensor.cpu()
        return stats

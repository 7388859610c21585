"""Attention capture through transformers' AttentionInterface, without O(N^2) memory.

kvviz registers one attention function, ``"kvviz"``. With nobody listening it forwards to PyTorch's SDPA path. When
a listener is active (a statistics recorder for the Attention page and prefill-time selection, or a cache policy
that scores tokens at every decode step), it computes attention explicitly in query blocks, hands each block of
probabilities to the listeners, and drops it: memory stays O(layers * heads * N) plus one bounded block.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

ATTENTION_NAME = "kvviz"
BLOCK_BYTES = 128 * 2**20  # largest probability block materialised at once on accelerators
BLOCK_BYTES_CPU = 4 * 2**20  # on CPU: small blocks stay in cache and reuse freed memory
MIN_BLOCK_ROWS = 16  # floor on query rows per block, so very long contexts do not loop row by row


class AttentionListener(Protocol):
    """Receives blocks of attention probabilities ``[batch, q_heads, block_queries, keys]``.

    A listener with ``partial_keys = True`` accepts blocks covering only the first keys (the later ones got no
    attention from these queries), which saves padding them to full width. Optional, to keep attention on SDPA
    where it can: ``query_rows(layer, total)``, how many of the last queries it needs (default all), and
    ``sink_tokens_for(layer)`` with ``observe_sink_mass(layer, mass)``: each query's attention on the first k keys,
    ``[batch, q_heads, queries]``, which SDPA computes through one extra value channel.
    """

    def wants(self, layer_idx: int) -> bool: ...

    def observe(self, layer_idx: int, probs: torch.Tensor, query_start: int, query_total: int) -> None: ...


def rows_wanted(listener: AttentionListener, layer_idx: int, query_total: int) -> int:
    """How many of the last queries a listener needs (``query_rows``, when it declares one), else all of them."""
    query_rows = getattr(listener, "query_rows", None)
    return query_total if query_rows is None else min(query_total, query_rows(layer_idx, query_total))


def sinks_wanted(listener: AttentionListener, layer_idx: int) -> int:
    """How many first keys' attention mass per query a listener wants reported (``sink_tokens_for``), else 0."""
    sink_tokens_for = getattr(listener, "sink_tokens_for", None)
    return 0 if sink_tokens_for is None else sink_tokens_for(layer_idx)


_listeners: contextvars.ContextVar[tuple[AttentionListener, ...]] = contextvars.ContextVar(
    "kvviz_attention_listeners", default=()
)


@dataclass
class KeyPart:
    """Batch rows ``rows`` of a forward and the keys they attend over: ``keys``/``values`` [b, H_kv, T, D],
    ``hidden`` [b, H_kv, T] True on slots attention must skip (padding of heads that keep unequal counts, blocked
    entries) or None, and ``listener``: the row's own attention listener (a method scoring at decode time) or None."""

    rows: slice
    keys: torch.Tensor
    values: torch.Tensor
    hidden: torch.Tensor | None = None
    listener: AttentionListener | None = None


class KeySource(Protocol):
    """What a kvviz cache hands its attention, through the forward's ``key_source`` keyword (transformers passes
    a model call's extra keywords down to every attention call): per layer, the parts of the batch and their keys.

    A single cache answers one part, the keys transformers passes, with the slots to skip; a batch of caches
    (:mod:`kvviz.runtime.batch`) answers one part per row, each over its own keys, so no row is padded to another's
    length and the linear layers still run batched.
    """

    def key_parts(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> list[KeyPart]: ...


@contextlib.contextmanager
def listening(*listeners: AttentionListener):
    """Activate listeners for the forwards run inside this block (per thread: users do not see each other)."""
    token = _listeners.set(_listeners.get() + tuple(listeners))
    try:
        yield
    finally:
        _listeners.reset(token)


def _with_padding_mask(attention_mask: torch.Tensor | None, padding: torch.Tensor, q_heads: int,
                       q_len: int) -> torch.Tensor:
    """A per-query-head bool mask [B, H_q, q, T] (True = attend) that also hides ``padding`` [B, H_kv, T]."""
    batch, kv_heads, k_len = padding.shape
    allowed = (~padding).repeat_interleave(q_heads // kv_heads, dim=1).unsqueeze(2)  # [B, H_q, 1, T]
    if attention_mask is None:
        causal = torch.arange(k_len, device=padding.device) <= (
            torch.arange(q_len, device=padding.device).unsqueeze(1) + k_len - q_len)
        return allowed & causal
    if attention_mask.dtype == torch.bool:
        return allowed & attention_mask[..., :k_len]
    return allowed & (attention_mask[..., :k_len] == 0)


def _block_rows(row_bytes: int, q_len: int, device: torch.device) -> int:
    """Query rows per block: a few MB on CPU (fresh 100 MB blocks cost more in page faults than in arithmetic)."""
    budget = BLOCK_BYTES_CPU if device.type == "cpu" else BLOCK_BYTES
    return max(1, min(q_len, max(MIN_BLOCK_ROWS, budget // max(1, row_bytes))))


def _explicit_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    listeners: list[AttentionListener],
    first_query: int = 0,
) -> torch.Tensor:
    """Softmax attention in query blocks; GQA handled by grouping query heads over their shared KV head.

    kvviz caches are append-only, so a query never attends to keys stored after it: each block computes only the
    keys its last query can see (causal work, as SDPA does). Listeners that set ``partial_keys`` receive that
    narrower block; the others get it zero-padded to every key. Only queries from ``first_query`` on are computed
    (the output rows before it are left unset).
    """
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    pairs = batch * kv_heads
    grouped = (query * scaling).reshape(pairs, group, q_len, head_dim)  # scaling q is cheaper than scaling scores
    keys_t = key.reshape(pairs, k_len, head_dim).transpose(1, 2)  # [B*Hkv, D, K]
    value_dim = value.shape[-1]  # MLA models: values narrower than keys
    values = value.reshape(pairs, k_len, value_dim)
    block = _block_rows(batch * q_heads * k_len * 4, q_len, query.device)
    causal_offset = k_len - q_len  # query i sees keys up to causal_offset + i
    output = torch.empty(pairs, group, q_len, value_dim, dtype=query.dtype, device=query.device)
    padded: torch.Tensor | None = None
    for start in range(first_query, q_len, block):
        stop = min(q_len, start + block)
        rows, width = stop - start, min(k_len, causal_offset + stop)
        block_query = grouped[:, :, start:stop].reshape(pairs, group * rows, head_dim)
        scores = torch.bmm(block_query, keys_t[:, :, :width]).float()
        grid = scores.view(batch, kv_heads, group, rows, width)
        if attention_mask is not None:
            mask = attention_mask[:, :, start:stop, :width]
            mask = mask.view(batch, kv_heads, group, rows, width) if mask.shape[1] > 1 else mask.unsqueeze(1)
            if mask.dtype == torch.bool:
                grid.masked_fill_(~mask, float("-inf"))
            else:
                grid.add_(mask.float())
        elif rows > 1:  # only the block's last few columns can lie in a query's future
            edge = causal_offset + start + 1
            future = torch.arange(edge, width, device=query.device).unsqueeze(0) > (
                torch.arange(start, stop, device=query.device).unsqueeze(1) + causal_offset)
            grid[..., edge:].masked_fill_(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        mixed = torch.bmm(probs.to(value.dtype), values[:, :width])
        output[:, :, start:stop] = mixed.view(pairs, group, rows, value_dim)
        flat = probs.view(batch, q_heads, rows, width)
        for listener in listeners:
            if width == k_len or getattr(listener, "partial_keys", False):
                listener.observe(module.layer_idx, flat, start, q_len)
                continue
            if padded is None:
                padded = torch.zeros(batch, q_heads, block, k_len, device=query.device)
            padded[:, :, :rows, :width] = flat  # widths only grow, so the columns past them stay zero
            listener.observe(module.layer_idx, padded[:, :, :rows], start, q_len)
    return output.view(batch, q_heads, q_len, value_dim).transpose(1, 2).contiguous()


def _sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _sdpa_with_sink_mass(module, query, key, value, attention_mask, scaling, dropout, sinks: int, **kwargs):
    """SDPA's output plus each query's attention on the first ``sinks`` keys, ``[B, H_q, q]``, in one call.

    Values get an extra channel that is 1 on the first keys and 0 elsewhere, so that channel of the output is the
    attention mass those keys receive. Queries and keys get zero channels to keep one head size (their dot
    products do not change); padding to a multiple of 8 keeps the kernel on its fast path.
    """
    dim = query.shape[-1]
    extra = 8
    query = torch.nn.functional.pad(query, (0, extra))
    key = torch.nn.functional.pad(key, (0, extra))
    channel = torch.zeros(*value.shape[:-1], extra, dtype=value.dtype, device=value.device)
    channel[:, :, :sinks, 0] = 1
    output, _ = _sdpa(module, query, key, torch.cat([value, channel], dim=-1), attention_mask, scaling, dropout,
                      **kwargs)  # [B, q, H, D + extra]
    return output[..., :dim].contiguous(), output[..., dim].transpose(1, 2)


def kvviz_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                    key_source: KeySource | None = None, **kwargs):
    """The registered attention function: SDPA when nobody listens, explicit blocks otherwise; with a
    ``key_source`` (a kvviz cache passed with the model call), each part of the batch over its own keys.

    ``dropout`` comes sixth: importing kvpress wraps every registered attention function and passes it positionally.
    """
    layer_idx = getattr(module, "layer_idx", 0)
    listeners = [listener for listener in _listeners.get() if listener.wants(layer_idx)]
    if key_source is None:
        return _attend(module, query, key, value, attention_mask, scaling, dropout, listeners, **kwargs)
    parts = key_source.key_parts(layer_idx, key, value)
    if len(parts) == 1 and parts[0].rows == slice(None):  # one cache: transformers' mask, plus the skipped slots
        part = parts[0]
        if part.hidden is not None and part.hidden.shape[-1] == part.keys.shape[2]:
            attention_mask = _with_padding_mask(attention_mask, part.hidden.to(key.device), query.shape[1],
                                                query.shape[2])
        own = [part.listener] if part.listener is not None else []
        return _attend(module, query, part.keys, part.values, attention_mask, scaling, dropout, listeners + own,
                       **kwargs)
    outputs = []
    for part in parts:  # rows of one query each: a row sees all its keys, so only skipped slots need a mask
        rows = query[part.rows]
        mask = None if part.hidden is None else _with_padding_mask(None, part.hidden.to(key.device), rows.shape[1],
                                                                   rows.shape[2])
        own = [part.listener] if part.listener is not None else []
        outputs.append(_attend(module, rows, part.keys, part.values, mask, scaling, dropout, own, **kwargs)[0])
    return torch.cat(outputs), None


def _attend(module, query, key, value, attention_mask, scaling, dropout, listeners: list[AttentionListener],
            **kwargs):
    """Attention of ``query`` over ``key``/``value``: SDPA when nobody listens, else explicit where listened."""
    layer_idx = getattr(module, "layer_idx", 0)
    if not listeners:
        return _sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    q_len = query.shape[2]
    rows = max(rows_wanted(listener, layer_idx, q_len) for listener in listeners)
    if rows == q_len:
        return _explicit_attention(module, query, key, value, attention_mask, scaling, listeners), None
    # listeners want only the last queries (an observation window) and perhaps every query's sink mass: SDPA for
    # the output (with a sink channel), explicit rows for the window
    sinks = max(sinks_wanted(listener, layer_idx) for listener in listeners)
    if sinks:
        output, mass = _sdpa_with_sink_mass(module, query, key, value, attention_mask, scaling, dropout, sinks,
                                            **kwargs)
        for listener in listeners:
            if sinks_wanted(listener, layer_idx):
                listener.observe_sink_mass(layer_idx, mass)
    else:
        output, _ = _sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if rows:
        _explicit_attention(module, query, key, value, attention_mask, scaling, listeners, first_query=q_len - rows)
    return output, None


def install_attention(model: torch.nn.Module) -> None:
    """Register kvviz's attention (with SDPA's mask format) and switch the model to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, kvviz_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    model.set_attn_implementation(ATTENTION_NAME)


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


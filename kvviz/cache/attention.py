"""kvviz's attention function, registered through transformers' AttentionInterface, without O(N^2) memory.

kvviz registers one attention function, ``"kvviz"``. With nobody listening it forwards to PyTorch's SDPA path. When
a listener is given (a statistics recorder for the Attention page and prefill-time selection, or a cache policy
that scores tokens at every decode step), it computes attention explicitly in query blocks, hands each block of
probabilities to the listeners, and drops it: memory stays O(layers * heads * N) plus one bounded block. Whatever a
caller decides travels with the model call, as transformers passes a call's extra keywords down to every attention
call: the caller's ``listeners``, and what a kvviz cache adds (the slots to skip, a batch's rows over their own keys,
a method's own listener) as its ``key_source`` (:class:`KeySource`). What to record is :mod:`kvviz.cache.capture`;
the recorder that folds the blocks into statistics is :mod:`kvviz.cache.stats`.

What the model's attention module passes is honoured as its own attention would: ``sliding_window`` (a local layer's
queries see only the keys inside their window, in the masks kvviz builds for a batch of caches) and ``softcap``
(Gemma 2's logits soft-capped by tanh before the mask, which SDPA cannot do: such layers always run explicit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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


@dataclass
class KeyPart:
    """Batch rows ``rows`` of a forward and the keys they attend over: ``keys``/``values`` [b, H_kv, T, D],
    ``hidden`` [b, H_kv, T] True on slots attention must skip (padding of heads that keep unequal counts, blocked
    entries) or None, ``listener``: the row's own attention listener (a method scoring at decode time) or None, and
    ``queries``: how many of the forward's query positions are this row's (prompts of unequal lengths prefilled in
    one forward are padded at their end; the padding's outputs are zeros)."""

    rows: slice
    keys: torch.Tensor
    values: torch.Tensor
    hidden: torch.Tensor | None = None
    listener: AttentionListener | None = None
    queries: int | None = None  # this row's first queries in a right-padded batch of prompts; None: every query


class KeySource(Protocol):
    """What a kvviz cache hands its attention, through the forward's ``key_source`` keyword (transformers passes
    a model call's extra keywords down to every attention call): per layer, the parts of the batch and their keys.

    A single cache answers one part, the keys transformers passes, with the slots to skip; a batch of caches
    (:mod:`kvviz.runtime.batch`) answers one part per row, each over its own keys, so no row is padded to another's
    length and the linear layers still run batched.
    """

    def key_parts(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> list[KeyPart]: ...


def _with_padding_mask(attention_mask: torch.Tensor | None, padding: torch.Tensor, q_heads: int,
                       q_len: int, window: int | None = None) -> torch.Tensor:
    """A per-query-head bool mask [B, H_q, q, T] (True = attend) that also hides ``padding`` [B, H_kv, T]."""
    batch, kv_heads, k_len = padding.shape
    allowed = (~padding).repeat_interleave(q_heads // kv_heads, dim=1).unsqueeze(2)  # [B, H_q, 1, T]
    if attention_mask is None:
        return allowed & _causal(q_len, k_len, padding.device, window)
    if attention_mask.dtype == torch.bool:
        return allowed & attention_mask[..., :k_len]
    return allowed & (attention_mask[..., :k_len] == 0)


def _causal(q_len: int, k_len: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """[q, T] True where a query may attend: the queries are the last ``q_len`` tokens of the ``k_len`` keys, which
    sit at consecutive positions; with a ``window``, only the keys less than ``window`` positions back."""
    distance = torch.arange(q_len, device=device).unsqueeze(1) + k_len - q_len - torch.arange(k_len, device=device)
    return (distance >= 0) if window is None else (distance >= 0) & (distance < window)


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
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention in query blocks; GQA handled by grouping query heads over their shared KV head.

    kvviz caches are append-only, so a query never attends to keys stored after it: each block computes only the
    keys its last query can see (causal work, as SDPA does). Listeners that set ``partial_keys`` receive that
    narrower block; the others get it zero-padded to every key. Only queries from ``first_query`` on are computed
    (the output rows before it are left unset). ``softcap``: logits become ``softcap * tanh(logits / softcap)``
    before the mask (Gemma 2).
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
        if softcap:
            scores.div_(softcap).tanh_().mul_(softcap)
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
    """transformers' SDPA call, except masked grouped-query attention on a CPU: transformers then copies every KV
    head once per query head (CUDA's kernels need it), while the CPU kernel groups heads itself (18x faster over
    2K keys of 11 rows, a padded batch)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and query.device.type == "cpu" and key.shape[1] < query.shape[1]:
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask[..., : key.shape[-2]], dropout_p=dropout, scale=scaling,
            enable_gqa=True)
        return output.transpose(1, 2).contiguous(), None
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
                    key_source: KeySource | None = None, listeners: Sequence[AttentionListener] = (), **kwargs):
    """The registered attention function: SDPA when nobody listens, explicit blocks otherwise; with a
    ``key_source`` (a kvviz cache passed with the model call), each part of the batch over its own keys.
    ``listeners``: what the model call's caller hands every layer's attention probabilities to (the prefill's
    statistics recorder, a progress report).

    ``dropout`` comes sixth: importing kvpress wraps every registered attention function and passes it positionally.
    """
    layer_idx = getattr(module, "layer_idx", 0)
    listeners = [listener for listener in listeners if listener.wants(layer_idx)]
    window = kwargs.get("sliding_window")
    if key_source is None:
        return _attend(module, query, key, value, attention_mask, scaling, dropout, listeners, **kwargs)
    parts = key_source.key_parts(layer_idx, key, value)
    if len(parts) == 1 and parts[0].rows == slice(None):  # one cache: transformers' mask, plus the skipped slots
        part = parts[0]
        if part.hidden is not None and part.hidden.shape[-1] == part.keys.shape[2]:
            attention_mask = _with_padding_mask(attention_mask, part.hidden.to(key.device), query.shape[1],
                                                query.shape[2], window)
        own = [part.listener] if part.listener is not None else []
        return _attend(module, query, part.keys, part.values, attention_mask, scaling, dropout, listeners + own,
                       **kwargs)
    outputs = []
    for part in parts:  # each row over its own keys: its new queries are their last tokens
        rows = query[part.rows] if part.queries is None else query[part.rows, :, :part.queries]
        q_len, k_len = rows.shape[2], part.keys.shape[2]
        if part.hidden is not None:
            mask = _with_padding_mask(None, part.hidden.to(key.device), rows.shape[1], q_len, window)
        elif q_len > 1 and (q_len < k_len or (window is not None and window < k_len)):
            # SDPA's own causal mask aligns queries with the first keys and knows no window
            mask = _causal(q_len, k_len, key.device, window).view(1, 1, q_len, k_len)
        else:  # one query sees every key it is given (a local layer holds only its window)
            mask = None
        own = [part.listener] if part.listener is not None else []
        output = _attend(module, rows, part.keys, part.values, mask, scaling, dropout, own, **kwargs)[0]
        if q_len < query.shape[2]:
            output = torch.nn.functional.pad(output, (0, 0, 0, 0, 0, query.shape[2] - q_len))
        outputs.append(output)
    return torch.cat(outputs), None


def _attend(module, query, key, value, attention_mask, scaling, dropout, listeners: list[AttentionListener],
            **kwargs):
    """Attention of ``query`` over ``key``/``value``: SDPA when nobody listens, else explicit where listened (and
    always where logits are soft-capped, which SDPA cannot do)."""
    layer_idx = getattr(module, "layer_idx", 0)
    softcap = kwargs.get("softcap")
    if not listeners and not softcap:
        return _sdpa(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    q_len = query.shape[2]
    rows = max((rows_wanted(listener, layer_idx, q_len) for listener in listeners), default=q_len)
    if rows == q_len or softcap:
        return _explicit_attention(module, query, key, value, attention_mask, scaling, listeners,
                                   softcap=softcap), None
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

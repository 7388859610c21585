"""Protected spans: tokens no eviction method may drop (the Pitfalls paper's whitelisting), for every method at once.

Protection is applied where the cache applies a method's keep choice
(:meth:`kvviz.cache.kvcache.KVLayer.apply_keep`), so no method needs to know about it. The method chooses as usual,
over every cached entry (protected ones included); any protected entry it dropped is then put back.

How the budget counts protected tokens: they are kept on top of it. A head holds at most the method's budget plus
the protected tokens; a method that already chose some protected tokens holds fewer. When heads end up with
different counts (a per-head method kept different protected tokens), the shorter heads also keep their most
recently dropped entries, so every head holds the same count (the storage is one rectangle per layer). For a
comparison at equal memory, lower the method's budget by the number of protected tokens.
"""

from __future__ import annotations

import torch

from kvviz.cache.protocol import topk_keep
from kvviz.cache.storage import Keep, KeptRanges, as_keep


def protected_positions(spans: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Sorted unique absolute positions of ``[start, end)`` token spans."""
    positions = sorted({p for start, end in spans for p in range(start, end)})
    return torch.tensor(positions, dtype=torch.long)


def _ranges(mask: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """``[start, end)`` runs of True in a 1-D boolean mask."""
    padded = torch.nn.functional.pad(mask.to(torch.int8), (1, 1))
    edges = (padded[1:] - padded[:-1]).nonzero().flatten().tolist()
    return tuple(zip(edges[::2], edges[1::2], strict=True))


def with_protected(kept: torch.Tensor | Keep | None, positions: torch.Tensor,
                   protected: torch.Tensor) -> torch.Tensor | Keep | None:
    """A method's keep choice widened so no entry at a ``protected`` position is dropped.

    ``kept``: an index [B, H, n] (bare or a :class:`KeptIndex`) or ranges, or None (keep all). ``positions`` [B, H, T]:
    absolute positions of the cached entries, ascending per head. Returns the same kinds: ranges stay ranges when
    every head holds the same positions (positional policies keep their cheap path).
    """
    if kept is None:
        return None
    is_protected = torch.isin(positions, protected.to(positions.device))
    if not bool(is_protected.any()):
        return kept
    length = positions.shape[-1]
    if isinstance(kept, KeptRanges):
        if bool((is_protected == is_protected[:1, :1]).all()):
            mask = is_protected[0, 0].cpu().clone()
            for start, end in kept.spans:
                mask[start:end] = True
            return None if bool(mask.all()) else KeptRanges(_ranges(mask), kept.batch, kept.heads, kept.device)
    index = kept.index() if isinstance(kept, KeptRanges) else as_keep(kept).index
    keep = torch.zeros_like(is_protected).scatter_(-1, index.to(positions.device), True) | is_protected
    count = int(keep.sum(-1).max())
    recency = torch.arange(length, device=positions.device).expand(positions.shape)  # cache order is arrival order
    return topk_keep(recency, count, forced=keep)

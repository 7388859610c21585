"""Find where each row of a compressed KV cache came from in the full cache (same layer, same KV head).

A press that drops entries leaves bit-identical copies of the rows it kept, so most rows are found exactly by an
integer hash of their bits (sort + binary search: O(N log N) per head, no N x n distance matrix). Rows the press
changed (re-rotated or channel-pruned keys, merged values) fall back to the nearest full row, computed only for
those rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_HASH_WEIGHTS: dict[tuple[int, str], torch.Tensor] = {}


def _bit_view(rows: torch.Tensor) -> torch.Tensor:
    """The rows' raw bits as integers (float32 -> int32, 16-bit floats -> int16), widened to int64."""
    integer = {4: torch.int32, 2: torch.int16, 8: torch.int64}[rows.element_size()]
    return rows.contiguous().view(integer).long()


def row_hash(rows: torch.Tensor) -> torch.Tensor:
    """[..., D] rows -> [...] int64 hashes; equal rows hash equal, exactly (integer arithmetic only)."""
    bits = _bit_view(rows) & 0xFFFFFFFF
    key = (rows.shape[-1], str(rows.device))
    if key not in _HASH_WEIGHTS:
        generator = torch.Generator().manual_seed(1234)
        _HASH_WEIGHTS[key] = torch.randint(1, 2**16, (rows.shape[-1],), generator=generator).to(rows.device)
    return (bits * _HASH_WEIGHTS[key]).sum(-1)  # < 2^48 * D: no overflow for D <= 2^15


@dataclass
class RowMatch:
    """positions [B, H, n]: the full-cache row each compressed row matches; exact [B, H, n]: bit-identical rows;
    distance [B, H, n]: relative L2 distance to the matched row (0 where exact)."""

    positions: torch.Tensor
    exact: torch.Tensor
    distance: torch.Tensor

    @property
    def all_exact(self) -> bool:
        return bool(self.exact.all())

    def unique(self) -> bool:
        """True when no two compressed rows of a head claim the same full row."""
        ordered = self.positions.sort(dim=-1).values
        return not bool((ordered[..., 1:] == ordered[..., :-1]).any())


def match_rows(full: torch.Tensor, compressed: torch.Tensor) -> RowMatch:
    """Match compressed rows [B, H, n, D] to full rows [B, H, N, D] of the same batch and head."""
    full_hash, compressed_hash = row_hash(full), row_hash(compressed)
    ordered, order = full_hash.sort(dim=-1)
    slot = torch.searchsorted(ordered, compressed_hash).clamp(max=full.shape[2] - 1)
    positions = order.gather(-1, slot)
    candidate = full.gather(2, positions.unsqueeze(-1).expand_as(compressed))
    exact = (candidate == compressed).all(-1)
    distance = torch.zeros(exact.shape, dtype=torch.float32, device=full.device)
    if not bool(exact.all()):
        for batch, head in (~exact).any(-1).nonzero().tolist():
            missing = (~exact[batch, head]).nonzero().flatten()
            rows = compressed[batch, head, missing].float()
            gaps = torch.cdist(rows, full[batch, head].float())
            nearest, where = gaps.min(-1)
            positions[batch, head, missing] = where
            distance[batch, head, missing] = nearest / rows.norm(dim=-1).clamp(min=1e-12)
    return RowMatch(positions, exact, distance)


def match_rows_in_order(full: torch.Tensor, compressed: torch.Tensor, tolerance: float) -> RowMatch:
    """Match rows that may be ambiguous (equal content at several positions, as position-free keys of a repeated
    token are) knowing the compressed rows keep the full rows' order: each row takes the first full row within
    ``tolerance`` (relative distance) after the previous row's match; the nearest row where none is."""
    batch, heads, count = compressed.shape[:3]
    positions = torch.zeros(batch, heads, count, dtype=torch.long, device=full.device)
    distance = torch.zeros(batch, heads, count, dtype=torch.float32, device=full.device)
    for b in range(batch):
        for h in range(heads):
            rows = compressed[b, h].float()
            gaps = torch.cdist(rows, full[b, h].float()) / rows.norm(dim=-1, keepdim=True).clamp(min=1e-12)
            nearest, where = gaps.min(-1)
            positions[b, h], distance[b, h] = where, nearest
            if bool((where[1:] > where[:-1]).all()):
                continue  # the nearest rows are already in order: no ambiguity to resolve
            close = (gaps <= tolerance).cpu()
            previous = -1
            for row in range(count):
                after = close[row, previous + 1:].nonzero()
                if after.numel():
                    previous = previous + 1 + int(after[0])
                    positions[b, h, row], distance[b, h, row] = previous, gaps[row, previous]
    return RowMatch(positions, torch.zeros_like(positions, dtype=torch.bool), distance)

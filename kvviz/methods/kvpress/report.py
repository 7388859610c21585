"""What a press run natively did, mapped back for kvviz: the report the UI and the CLI print, and the mapped prefill
the method forks from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvviz.cache.spec import SpecError

MAX_KEY_DISTANCE = 1e-3  # relative distance above which a key the press changed is not called the same row


class NotMappable(SpecError):
    """A press whose result kvviz cannot map back to token positions; the message says why."""


@dataclass
class NativeReport:
    """What matching found, for the UI and the CLI.

    exact_rows / nearest_rows: compressed rows found bit-identical / by the nearest full row;
    max_distance: the largest relative key distance of a nearest match; rerotated: keys matched after undoing RoPE;
    channels_kept [layers, kv_heads]: key channels a channel-pruning press left non-zero (None when none pruned);
    merged_into: per layer, [kv_heads, N] the position each evicted token was folded into (-1: not merged), for
    presses that changed kept values; masked: the press masked entries in place (kvpress's head-wise trick);
    blocked_entries: masked entries kvviz holds, unattended, so a layer's heads share one length.
    """

    press: str
    prompt_tokens: int
    seconds: float
    exact_rows: int = 0
    nearest_rows: int = 0
    max_distance: float = 0.0
    rerotated: bool = False
    channels_kept: list[list[int]] | None = None
    merged_into: dict[int, torch.Tensor] = field(default_factory=dict)
    masked: bool = False
    blocked_entries: int = 0

    def merge_counts(self) -> tuple[int, int]:
        """(evicted entries folded into a survivor, survivors that received at least one), over layers and heads."""
        merged = received = 0
        for targets in self.merged_into.values():
            merged += int((targets >= 0).sum())
            received += sum(int(targets[head][targets[head] >= 0].unique().numel())
                            for head in range(targets.shape[0]))
        return merged, received

    def lines(self) -> list[str]:
        """What the press did besides dropping rows, one plain sentence each (the app and the CLI print these)."""
        found = [f"{self.exact_rows:,} bit-identical"] if self.exact_rows else []
        if self.nearest_rows:
            found.append(f"{self.nearest_rows:,} by the nearest key (at most {self.max_distance:.1e} apart)")
        lines = ["Kept rows matched to prompt tokens: " + (", ".join(found) or "none") + "."]
        if self.rerotated:
            lines.append("Keys re-rotated by the press to close the gaps: the rotation was undone before matching; "
                         "the cache holds the press's re-rotated keys.")
        if self.channels_kept is not None:
            flat = [c for layer in self.channels_kept for c in layer]
            spread = f"{min(flat)}" if min(flat) == max(flat) else f"{min(flat)}-{max(flat)}"
            lines.append(f"Key channels kept per KV head: {spread} (the press zeroed the rest); every token stays.")
        if self.masked:
            lines.append(f"Head-wise: kvpress masks entries in place; {self.blocked_entries:,} masked entries are "
                         "held blocked (never attended) so each layer's KV heads share one length.")
        if self.merged_into:
            merged, received = self.merge_counts()
            lines.append(f"{merged:,} evicted entries merged into {received:,} survivors in "
                         f"{len(self.merged_into)} layers (each to its most key-similar survivor).")
        if len(lines) == 1:
            lines.append("Plain eviction: the press dropped rows and changed none.")
        return lines

    def summary(self) -> str:
        return f"{self.press}: " + " ".join(self.lines())

    def to_json(self, with_details: bool = True) -> dict:
        """The report for ``--json``; ``with_details`` adds channels per layer x head and every merge."""
        merged, received = self.merge_counts()
        data: dict[str, Any] = {
            "press": self.press,
            "prompt_tokens": self.prompt_tokens,
            "press_seconds": round(self.seconds, 4),
            "rows_exact": self.exact_rows,
            "rows_nearest": self.nearest_rows,
            "max_key_distance": self.max_distance,
            "keys_rerotated": self.rerotated,
            "head_wise_masked": self.masked,
            "blocked_entries": self.blocked_entries,
            "merged_entries": merged,
            "merge_survivors": received,
            "summary": self.lines(),
        }
        if self.channels_kept is not None:
            flat = [c for layer in self.channels_kept for c in layer]
            data["channels_kept_min"], data["channels_kept_max"] = min(flat), max(flat)
            if with_details:
                data["channels_kept_per_head"] = self.channels_kept  # [layers][kv_heads]
        if with_details and self.merged_into:
            data["merges"] = {  # layer -> [kv_head, evicted token, survivor it was folded into]
                str(layer): [[head, token, int(targets[head, token])]
                             for head in range(targets.shape[0])
                             for token in (targets[head] >= 0).nonzero().flatten().tolist()]
                for layer, targets in self.merged_into.items()}
        return data


@dataclass
class NativePrefill:
    """The press's prefill mapped for kvviz: a dense cache of the full rows with the press's rows written where they
    came from, the kept index per layer, the prompt's last logits and the report."""

    cache: Any
    kept: list[torch.Tensor | None]
    blocked: list[torch.Tensor | None]
    last_logits: torch.Tensor
    report: NativeReport
    seconds: float

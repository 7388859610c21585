"""Comparing a method's output with the full cache's.

Free-running texts drift apart after their first different token, and from then on every comparison measures the
drift, not the method. So the numbers that describe a method are teacher-forced: the method is fed the full cache's
generated tokens, and at every step its next-token distribution is compared with full's at the same step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def first_divergence(reference: list[int], candidate: list[int]) -> int | None:
    """Index of the first generated token that differs (a length mismatch counts); None when identical."""
    for index, (a, b) in enumerate(zip(reference, candidate, strict=False)):
        if a != b:
            return index
    if len(reference) != len(candidate):
        return min(len(reference), len(candidate))
    return None


def token_agreement(reference: list[int], candidate: list[int]) -> float:
    """Share of the reference's positions where the candidate produced the same token."""
    if not reference:
        return 1.0 if not candidate else 0.0
    same = sum(a == b for a, b in zip(reference, candidate, strict=False))
    return same / max(len(reference), len(candidate))


def kl_per_step(reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> list[float]:
    """KL(reference ‖ candidate) in nats at each step, from per-step log-probabilities over the vocabulary.

    The direction weighs the tokens full found likely: a method is penalised for losing them, not for spreading a
    little mass elsewhere. Tiny negative values from rounding are clipped to 0.
    """
    steps = min(len(reference), len(candidate))
    if steps == 0:
        return []
    ref = torch.stack(reference[:steps]).float()
    cand = torch.stack(candidate[:steps]).float()
    kl = torch.nn.functional.kl_div(cand, ref, reduction="none", log_target=True).sum(dim=-1)
    return kl.clamp_min(0.0).tolist()


@dataclass
class ForcedComparison:
    """A method teacher-forced on full's tokens, judged step by step against full's distributions.

    ``agreement``: share of steps whose top-1 token equals full's top-1. ``first_divergence``: the first step where
    they differ (None when never). With greedy decoding this is also where the free-running texts first differ,
    because until then both saw the same inputs.
    """

    agreement: float
    kl_per_step: list[float]
    first_divergence: int | None

    @property
    def mean_kl(self) -> float | None:
        return sum(self.kl_per_step) / len(self.kl_per_step) if self.kl_per_step else None


def forced_comparison(reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> ForcedComparison:
    """Compare per-step log-probabilities of full (``reference``) and a method teacher-forced on full's tokens."""
    ref_top = [int(step.argmax()) for step in reference]
    cand_top = [int(step.argmax()) for step in candidate]
    return ForcedComparison(
        agreement=token_agreement(ref_top, cand_top),
        kl_per_step=kl_per_step(reference, candidate),
        first_divergence=first_divergence(ref_top, cand_top),
    )

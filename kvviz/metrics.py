"""Comparing a method's output with the full cache's."""

from __future__ import annotations


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

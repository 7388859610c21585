"""Runs of different users sharing forwards: which waiting prompts one shared prefill takes.

The engine (:mod:`kvviz.runtime.engine`) steps every admitted run's decode groups in one forward, and prefills the
prompts that runs wait on together: prompts nobody records the attention of (no capture for the page's statistics
or a method's selection: a listener belongs to its own prompt's forward) go through one forward, each row over its
own keys, padded at its end (:func:`kvviz.runtime.prefill.prefill_together`). A short prompt's forward on a CPU is
bound by reading the weights: eight 30-token prompts cost what four do alone (measured on the 2-core CPU). Each row
does exactly what it does alone, so every run's result equals the same run alone, token for token.
"""

from __future__ import annotations

from collections.abc import Sequence

PREFILL_TOKENS = 1024  # most prompt positions (padding included) one shared prefill feeds: on the CPU a forward of
# 30 tokens costs 87 ms and one of eight 30-token prompts 384 ms; past a few hundred tokens a forward is mostly bound
# by its arithmetic, yet 32 multikey items of ~250 tokens prefilled four to a forward took 10% less than two to a
# forward (11.9-16.9 s against 13.6-17.7 s, four interleaved repeats on the 2-core CPU). A larger cap gains a little
# more but holds other users' decode steps longer (a 1,024-position forward takes about 1.6 s there)


def prefill_share(lengths: Sequence[int], first: int = 0) -> list[int]:
    """The prompts (by index into ``lengths``) one shared forward takes: ``first`` (the one waiting longest) and
    then, shortest first, every other prompt that keeps the forward within :data:`PREFILL_TOKENS` positions (rows
    padded to the longest); the others wait for the next forward."""
    taken = [first]
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        longest = max(lengths[i] for i in [*taken, index])
        if index != first and longest * (len(taken) + 1) <= PREFILL_TOKENS:
            taken.append(index)
    return taken

"""What eviction bookkeeping (positions, selection, gather, ledger) adds to a decode step of ``full``, and kvviz's
``full`` step over transformers' own DynamicCache step (the floor).

Every step here is one row, unpadded: kvviz's one-row decode multiplies its row as it comes, and the floor runs inside
:func:`~kvviz.runtime.invariance.rows_as_they_come` too. The floor padded (as a batch's rows, the thread's default on
a CPU) is reported beside it, the baseline as it ran before."""

from __future__ import annotations

import contextlib
import statistics

import torch
from transformers import DynamicCache

from kvviz.bench.harness import BenchRun, Section, bench_section, timed
from kvviz.bench.workloads import decode_step, fit, prompt_tokens
from kvviz.comparison.session import PromptSession
from kvviz.methods import budget_spec
from kvviz.runtime.invariance import rows_as_they_come
from kvviz.runtime.models import LoadedModel

PADDING = "both one row unpadded: the floor runs its steps as kvviz's decode does (rows_as_they_come)"


def dynamic_cache_step(loaded: LoadedModel, ids: list[int], steps: int, padded: bool = False) -> float:
    """Median seconds of a one-token step of transformers' own DynamicCache after ``ids``: the floor for a step, its
    row multiplied as it comes like kvviz's decode (``padded``: as a batch's rows)."""
    device = loaded.device
    cache = DynamicCache()
    with torch.inference_mode(), contextlib.nullcontext() if padded else rows_as_they_come():
        loaded.model(input_ids=torch.tensor([ids], device=device), past_key_values=cache, use_cache=True,
                     logits_to_keep=1)
        token = torch.tensor([[5]], device=device)
        seconds = [timed(device, lambda: loaded.model(input_ids=token, past_key_values=cache, use_cache=True,
                                                      logits_to_keep=1))[0] for _ in range(steps)]
    return statistics.median(seconds)


@bench_section("bookkeeping")
def bookkeeping(run: BenchRun) -> Section:
    loaded, sizes = run.loaded, run.sizes
    section = Section("bookkeeping", "Eviction bookkeeping on a decode step of full")
    n = fit(loaded, sizes.bookkeeping_context)
    steps = sizes.decode_steps
    ids = prompt_tokens(loaded, n)
    session = PromptSession(loaded, ids)
    session.prefill(None)

    evicting = budget_spec("streaming_llm", n - 4, n) or budget_spec("window", n - 4, n)
    rerotating = None
    if evicting and "streaming" in evicting:
        evicting, rerotating = evicting + ",rerotate=0", evicting + ",rerotate=1"
    runs: dict[str, list[float]] = {"plain": [], "padded": [], "full": [], "evicting": [], "rerotating": []}
    for _ in range(max(3, sizes.repeats)):  # interleaved, so a slow spell of the machine hits every variant
        runs["plain"].append(dynamic_cache_step(loaded, ids, steps))
        runs["padded"].append(dynamic_cache_step(loaded, ids, steps, padded=True))
        runs["full"].append(decode_step(session, "full", steps)[0])
        if evicting:
            runs["evicting"].append(decode_step(session, evicting, steps)[0])
        if rerotating:
            runs["rerotating"].append(decode_step(session, rerotating, steps)[0])
    plain, padded, full = min(runs["plain"]), min(runs["padded"]), min(runs["full"])
    section.add("context_tokens", n)
    section.add("dynamic_cache_step_ms", plain * 1e3, "ms")
    section.add("kvviz_full_step_ms", full * 1e3, "ms")
    section.add("kvviz_full_vs_dynamic_cache", full / plain - 1, "overhead", "<= 0.15", note=PADDING)
    section.add("dynamic_cache_padded_step_ms", padded * 1e3, "ms",
                note="the floor with its row padded as a batch's rows (the baseline before it was made fair)")
    section.add("kvviz_full_vs_dynamic_cache_padded", full / padded - 1, "overhead")
    if evicting:
        evict = min(runs["evicting"])
        section.add("evicting_step_ms", evict * 1e3, "ms", note=f"{evicting}: one token evicted per step")
        section.add("eviction_bookkeeping_vs_full", evict / full - 1, "overhead", "<= 0.15")
    if rerotating:
        rerotate = min(runs["rerotating"])
        section.add("rerotating_step_ms", rerotate * 1e3, "ms", note=f"{rerotating}: the sinks re-rotated each step")
        section.add("eviction_with_rerotation_vs_full", rerotate / full - 1, "overhead", "<= 0.15")
    return section

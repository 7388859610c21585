"""Issue 3: what eviction bookkeeping (positions, selection, gather, ledger) adds to a decode step."""

from __future__ import annotations

import statistics

import torch

from kvviz.bench.harness import BenchRun, Section, bench_section, timed
from kvviz.bench.workloads import decode_step, fit, prompt_tokens
from kvviz.engine.session import PromptSession
from kvviz.methods import budget_spec


@bench_section("bookkeeping")
def bookkeeping(run: BenchRun) -> Section:
    loaded, sizes = run.loaded, run.sizes
    section = Section("bookkeeping", "Eviction bookkeeping on a decode step of full")
    n = fit(loaded, sizes.bookkeeping_context)
    steps = sizes.decode_steps
    session = PromptSession(loaded, prompt_tokens(loaded, n))
    session.prefill(None)
    device = loaded.device

    def plain_step() -> float:
        """transformers' own DynamicCache with the same prompt: the floor for a step."""
        from transformers import DynamicCache

        cache = DynamicCache()
        ids = torch.tensor([prompt_tokens(loaded, n)], device=device)
        with torch.inference_mode():
            loaded.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = torch.tensor([[5]], device=device)
            seconds = [timed(device, lambda: loaded.model(input_ids=token, past_key_values=cache, use_cache=True,
                                                          logits_to_keep=1))[0] for _ in range(steps)]
        return statistics.median(seconds)

    evicting = budget_spec("streaming_llm", n - 4, n) or budget_spec("window", n - 4, n)
    rerotating = None
    if evicting and "streaming" in evicting:
        evicting, rerotating = evicting + ",rerotate=0", evicting + ",rerotate=1"
    runs: dict[str, list[float]] = {"plain": [], "full": [], "evicting": [], "rerotating": []}
    for _ in range(max(3, sizes.repeats)):  # interleaved, so a slow spell of the machine hits every variant
        runs["plain"].append(plain_step())
        runs["full"].append(decode_step(session, "full", steps)[0])
        if evicting:
            runs["evicting"].append(decode_step(session, evicting, steps)[0])
        if rerotating:
            runs["rerotating"].append(decode_step(session, rerotating, steps)[0])
    plain, full = min(runs["plain"]), min(runs["full"])
    section.add("context_tokens", n)
    section.add("dynamic_cache_step_ms", plain * 1e3, "ms")
    section.add("kvviz_full_step_ms", full * 1e3, "ms")
    section.add("kvviz_full_vs_dynamic_cache", full / plain - 1, "overhead", "<= 0.15")
    if evicting:
        evict = min(runs["evicting"])
        section.add("evicting_step_ms", evict * 1e3, "ms", note=f"{evicting}: one token evicted per step")
        section.add("eviction_bookkeeping_vs_full", evict / full - 1, "overhead", "<= 0.15")
    if rerotating:
        rerotate = min(runs["rerotating"])
        section.add("rerotating_step_ms", rerotate * 1e3, "ms", note=f"{rerotating}: the sinks re-rotated each step")
        section.add("eviction_with_rerotation_vs_full", rerotate / full - 1, "overhead", "<= 0.15")
    return section

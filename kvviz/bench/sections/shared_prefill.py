"""N methods on one prompt: one prefill plus N decodes (forked caches) vs N independent sessions."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvviz.bench.harness import BenchRun, Section, bench_section, shared_measurement, sync, timed
from kvviz.bench.specs import comparison_specs
from kvviz.bench.workloads import fitted_prompt
from kvviz.comparison.results import MethodResult
from kvviz.comparison.session import PromptSession, capture_for
from kvviz.methods import parse_spec
from kvviz.planning.memory import ModelCard


@dataclass
class SharedForks:
    """The comparison run the shared way: one session's prefill, one fork per method (kv_bytes checks its bytes)."""

    prompt: int
    card: ModelCard
    specs: list[str]
    results: list[MethodResult]
    prefill_seconds: float
    seconds: float  # prefill plus every method's decode, wall clock


@shared_measurement
def shared_forks(run: BenchRun) -> SharedForks:
    loaded, sizes = run.loaded, run.sizes
    ids = fitted_prompt(loaded, sizes.compare_prompt)
    specs = comparison_specs(max(8, len(ids) // 4), len(ids))
    stacks = [parse_spec(s) for s in specs]
    run.log("  shared prefill + forks")
    session = PromptSession(loaded, ids)
    started = time.perf_counter()
    prefill = session.prefill(capture_for(stacks))
    results = [session.run(stack, sizes.compare_tokens)[0] for stack in stacks]
    sync(loaded.device)
    return SharedForks(len(ids), session.card, specs, results, prefill.seconds, time.perf_counter() - started)


@bench_section("shared_prefill")
def shared_prefill(run: BenchRun) -> Section:
    loaded, sizes = run.loaded, run.sizes
    section = Section("shared_prefill", "Comparison of N methods: shared prefill vs independent runs")
    ids = fitted_prompt(loaded, sizes.compare_prompt)
    n = len(ids)
    specs = comparison_specs(max(8, n // 4), n)
    independent_tokens, independent = [], 0.0
    for spec in specs:
        run.log(f"  independent run: {spec}")
        seconds, (result, _) = timed(loaded.device, lambda spec=spec: PromptSession(loaded, ids).run(
            spec, sizes.compare_tokens))
        independent += seconds
        independent_tokens.append(result.token_ids)
    shared = shared_forks(run)
    decodes = sum(r.seconds for r in shared.results)
    section.add("methods", len(specs), note=", ".join(specs))
    section.add("prompt_tokens", n)
    section.add("independent_seconds", independent, "s", note="each method its own session and prefill")
    section.add("shared_seconds", shared.seconds, "s", note="one session: prefill once, fork per method")
    section.add("shared_vs_independent", shared.seconds / independent, "x", "<= 0.5",
                note="both decode each method one row at a time, unpadded (kvviz's one-row decode both ways)")
    section.add("prefill_seconds", shared.prefill_seconds, "s")
    section.add("shared_vs_prefill_plus_decodes", shared.seconds / (shared.prefill_seconds + decodes), "x",
                note="~1: N methods cost one prefill plus N decodes")
    same = all(r.token_ids == t for r, t in zip(shared.results, independent_tokens, strict=True))
    section.add("same_tokens_as_independent", same, target="== True")
    return section

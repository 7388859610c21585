"""The trade-off sweep: six families at four budgets (24 configurations) on one prompt, one teacher-forced batch,
against the same 24 SPECs run through ``compare`` one after another; and whether every point equals its compare."""

from __future__ import annotations

import math

from kvviz.bench.harness import BenchRun, Section, bench_section, timed
from kvviz.bench.workloads import fit, prompt_tokens
from kvviz.engine.session import compare
from kvviz.methods import REGISTRY
from kvviz.studies.sweep import DEFAULT_BUDGETS, PromptWorkload, run_sweep

FAMILIES = ("snapkv", "streaming_llm", "h2o", "lowrank", "snapkv+kivi:bits=4,residual=0",
            "kvpress_native:press=knorm")


@bench_section("sweep")
def sweep(run: BenchRun) -> Section:
    loaded, sizes = run.loaded, run.sizes
    section = Section("sweep", "Trade-off sweep: 6 families x 4 budgets vs 24 compares one after another")
    families = [f for f in FAMILIES if f.split("+")[0].split(":")[0] in REGISTRY]
    budgets = list(DEFAULT_BUDGETS[: sizes.sweep_budgets])
    n = fit(loaded, sizes.sweep_prompt, sizes.sweep_tokens + 8)
    ids = prompt_tokens(loaded, n)
    run.log(f"  sweep of {len(families)} families x {len(budgets)} budgets on {n} tokens")
    sweep_seconds, report = timed(loaded.device, lambda: run_sweep(loaded, PromptWorkload(tuple(ids),
                                                                                        sizes.sweep_tokens),
                                                                   families, budgets))
    points = report.points[1:]
    run.log(f"    {sweep_seconds:.1f} s; now the same {len(points)} SPECs through compare, one after another")
    alone = []
    compares_seconds = 0.0
    for point in points:
        seconds, comparison = timed(loaded.device, lambda spec=point.spec: compare(loaded, ids, [spec],
                                                                                    sizes.sweep_tokens))
        compares_seconds += seconds
        alone.append(comparison)
    same = all(
        p.error is None and c.results[-1].error is None
        and p.agreement_with_full == c.results[-1].agreement_with_full
        and math.isclose(p.mean_kl, c.results[-1].mean_kl, rel_tol=1e-3, abs_tol=1e-5)
        and (p.kv_bytes == c.results[-1].kv_bytes or len(c.results[-1].token_ids) != len(c.results[0].token_ids))
        for p, c in zip(points, alone, strict=True))
    section.add("configurations", len(points), note=", ".join(families))
    section.add("prompt_tokens", n)
    section.add("teacher_forced_tokens", sizes.sweep_tokens)
    section.add("sweep_seconds", sweep_seconds, "s", "< 90")
    section.add("compares_seconds", compares_seconds, "s", note="each SPEC alone: prefill, full, its own decodes")
    section.add("sweep_vs_compares", sweep_seconds / compares_seconds, "x", "<= 0.5")
    section.add("same_as_compare", same, target="== True",
                note="agreement equal, KL within 1e-3, bytes equal where compare's tokens are as many as full's")
    section.add("frontier_points", sum(p.frontier for p in report.points))
    return section

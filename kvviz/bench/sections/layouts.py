"""What reporting serving layouts costs: every configuration's layout bytes (kvviz.cache.layouts), one pass over
its ledger each, against the 2K comparison that produced them (the shared prefill section's forks, computed here
when that section did not run)."""

from __future__ import annotations

import statistics
import time

from kvviz.bench.harness import BenchRun, Section, bench_section
from kvviz.bench.sections.shared_prefill import shared_forks
from kvviz.cache.layouts import DEFAULT_BLOCK_SIZE

REPEATS = 5  # the pass takes milliseconds: the median of a few runs steadies it on a busy machine


@bench_section("layouts")
def layouts(run: BenchRun) -> Section:
    section = Section("layouts", "Layout bytes of every configuration vs the comparison that measured them")
    forks = shared_forks(run)
    passes = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        held = [result.layout_bytes(DEFAULT_BLOCK_SIZE) for result in forks.results]
        passes.append(time.perf_counter() - started)
    seconds = statistics.median(passes)
    section.add("configurations", len(forks.results), note=", ".join(forks.specs))
    section.add("prompt_tokens", forks.prompt)
    section.add("layout_seconds", seconds, "s", note=f"median of {REPEATS}; every layout of every configuration, "
                f"blocks of {DEFAULT_BLOCK_SIZE}")
    section.add("compare_seconds", forks.seconds, "s", note="one prefill and every configuration's decode")
    section.add("layout_bytes_vs_compare", seconds / forks.seconds, "x", "<= 0.05",
                note="the layouts' pass over the ledgers as a share of the comparison's time")
    for result, layout in zip(forks.results, held, strict=True):
        if layout is not None and result.kv_bytes_full:
            section.add(f"{result.method}_paged_shared", layout.paged_shared / result.kv_bytes_full * 100,
                        "% of full", note=f"counted {layout.counted / result.kv_bytes_full:.1%}, compacted "
                        f"{layout.paged_shared_compacted / result.kv_bytes_full:.1%}, per head "
                        f"{layout.paged_per_head / result.kv_bytes_full:.1%}, dense per layer "
                        f"{layout.dense_per_layer / result.kv_bytes_full:.1%}")
    return section

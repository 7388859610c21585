"""Time of a lengths x depths needle grid per method."""

from __future__ import annotations

from kvviz.bench.harness import BenchRun, Section, bench_section
from kvviz.bench.specs import KIVI, eviction_specs
from kvviz.bench.workloads import fit
from kvviz.methods import REGISTRY
from kvviz.studies.needle import run_needle_grid


@bench_section("needle")
def needle(run: BenchRun) -> Section:
    loaded, sizes = run.loaded, run.sizes
    grid = f"{len(sizes.needle_lengths)}x{len(sizes.needle_depths)}"
    section = Section("needle", f"Needle grid {grid} per method")
    if loaded.tokenizer is None or not getattr(loaded.tokenizer, "chat_template", None):
        section.skipped = "needs a real tokenizer with a chat template (not a random model)"
        return section
    lengths = [fit(loaded, n) for n in sizes.needle_lengths]
    budget = max(8, min(lengths) // 4)
    specs = ["full", *eviction_specs(budget, min(lengths))]
    if "kivi" in REGISTRY:
        specs.append(KIVI)
    for spec in specs:
        run.log(f"  needle {spec}")
        report = run_needle_grid(loaded, [spec], lengths, list(sizes.needle_depths), max_new_tokens=sizes.needle_tokens)
        found = sum(c.found for c in report.cells)
        section.add(f"{spec}_seconds", report.seconds, "s", note=f"found {found}/{len(report.cells)}")
    return section

"""The benchmark suite (``python -m kvviz bench``): every performance figure of the issues, measured in one run.

Each section measures one capability and reports figures with their target and pass/fail. Timings on a shared
machine are noisy, so figures are ratios of two timings taken in the same run (ours vs a peer, on vs off), each
timing the best of a few repeats where it is cheap enough to repeat. A section whose needs are missing (a real
tokenizer, chromium) says so instead of failing.

Layout: ``harness`` (report, timing, memory, the section registry and ``run_bench``), ``workloads`` (random-weight
models, prompt ids, the decode-step timer), ``specs`` (the SPECs compared), ``browser`` (the served app and
chromium), ``sections/`` (one module per section).
"""

from kvviz.bench import sections as _sections  # noqa: F401  (registers every section)
from kvviz.bench.harness import (
    RUNNERS,
    SIZES,
    BenchReport,
    BenchRun,
    Figure,
    PeakMemory,
    Section,
    Sizes,
    bench_section,
    run_bench,
    shared_measurement,
    threads,
    with_lengths,
)
from kvviz.bench.specs import KIVI, batched_specs, comparison_specs, eviction_specs, evictions
from kvviz.bench.workloads import PRESETS, prompt_tokens, random_model

SECTIONS: tuple[str, ...] = tuple(RUNNERS)

__all__ = [
    "KIVI",
    "PRESETS",
    "RUNNERS",
    "SECTIONS",
    "SIZES",
    "BenchReport",
    "BenchRun",
    "Figure",
    "PeakMemory",
    "Section",
    "Sizes",
    "batched_specs",
    "bench_section",
    "comparison_specs",
    "eviction_specs",
    "evictions",
    "prompt_tokens",
    "random_model",
    "run_bench",
    "shared_measurement",
    "threads",
    "with_lengths",
]

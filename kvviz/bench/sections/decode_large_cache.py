"""Decode-step time of each eviction method at a fixed budget vs full, once the prompt is long."""

from __future__ import annotations

from dataclasses import dataclass

from kvviz.bench.harness import BenchRun, Section, bench_section, shared_measurement
from kvviz.bench.specs import eviction_specs
from kvviz.bench.workloads import decode_step, fit, prompt_tokens
from kvviz.comparison.session import PromptSession, capture_for
from kvviz.methods import parse_spec


@dataclass
class LongPromptDecode:
    """A session prefilled at the long decode prompt (with what the evictions need) and full's decode step there;
    the kivi section times its step against the same baseline."""

    session: PromptSession
    full_step: float  # median seconds per decode step of ``full``


@shared_measurement
def long_prompt_decode(run: BenchRun) -> LongPromptDecode:
    loaded, sizes = run.loaded, run.sizes
    n = fit(loaded, sizes.decode_prompt)
    session = PromptSession(loaded, prompt_tokens(loaded, n))
    run.log(f"  prefill {n} tokens")
    session.prefill(capture_for([parse_spec(s) for s in eviction_specs(sizes.decode_budget, n)]))
    return LongPromptDecode(session, decode_step(session, "full", sizes.decode_steps)[0])


@bench_section("decode_large_cache")
def decode_large_cache(run: BenchRun) -> Section:
    loaded, sizes = run.loaded, run.sizes
    section = Section("decode_large_cache", "Decode step with a large cache: eviction vs full")
    n = fit(loaded, sizes.decode_prompt)
    specs = eviction_specs(sizes.decode_budget, n)
    if not specs:
        section.skipped = "no eviction method is registered"
        return section
    baseline = long_prompt_decode(run)
    full = baseline.full_step
    section.add("prompt_tokens", n)
    section.add("full_step_ms", full * 1e3, "ms")
    for spec in specs:
        run.log(f"  decode {spec}")
        step, _ = decode_step(baseline.session, spec, sizes.decode_steps)
        section.add(f"{spec}_vs_full", step / full, "x", "< 1.0",
                    note=f"{step * 1e3:.1f} ms per step; both kvviz's one-row decode, unpadded")
    return section

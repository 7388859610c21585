"""KIVI 2-bit bytes vs full at a long prompt (measured vs theory) and its decode-step time, against the
decode_large_cache section's ``full`` step on the same session."""

from __future__ import annotations

from kvviz.bench.harness import BenchRun, Section, bench_section
from kvviz.bench.sections.decode_large_cache import long_prompt_decode
from kvviz.bench.specs import KIVI
from kvviz.bench.workloads import decode_step
from kvviz.methods import REGISTRY, parse_spec


@bench_section("kivi")
def kivi(run: BenchRun) -> Section:
    sizes = run.sizes
    section = Section("kivi", f"{KIVI} vs full")
    if "kivi" not in REGISTRY:
        section.skipped = "kivi is not registered"
        return section
    baseline = long_prompt_decode(run)
    session, full = baseline.session, baseline.full_step
    n = len(session.prompt_ids)
    step, cache = decode_step(session, KIVI, sizes.decode_steps)
    quant = parse_spec(KIVI).quantization
    card = session.card
    held = n + sizes.decode_steps
    measured = card.kv_bytes(held) / cache.nbytes().total
    element_bits = 8 * card.bytes_per_element
    theory = element_bits / quant.bits_per_element(card.head_dim)
    residual = min(held, quant.residual)
    with_residual = held * element_bits / ((held - residual) * quant.bits_per_element(card.head_dim)
                                           + residual * element_bits)
    section.add("prompt_tokens", n)
    section.add("compression_measured", measured, "x smaller than full")
    section.add("compression_theory", theory, "x", note=f"{element_bits} / {quant.bits_per_element(card.head_dim):g} "
                                                         "bits per element, residual ignored")
    section.add("compression_theory_with_residual", with_residual, "x",
                note=f"{residual} residual tokens at full precision")
    section.add("measured_vs_theory_with_residual", measured / with_residual, "x", note="1.0: bytes as predicted")
    section.add("decode_step_vs_full", step / full, "x",
                note=f"both kvviz's one-row decode, unpadded: {step * 1e3:.1f} ms vs {full * 1e3:.1f} ms")
    return section

"""Measured kv_bytes vs the formula at each method's budget (evictions) and bits (quantization), on the shared
prefill section's forks (computed here when that section did not run) plus the quantizers it left out."""

from __future__ import annotations

from kvviz.bench.harness import BenchRun, Section, bench_section
from kvviz.bench.sections.shared_prefill import shared_forks
from kvviz.bench.specs import KIVI, eviction_specs
from kvviz.bench.workloads import prompt_tokens
from kvviz.comparison.session import PromptSession
from kvviz.methods import parse_spec


@bench_section("kv_bytes")
def kv_bytes(run: BenchRun) -> Section:
    loaded, sizes = run.loaded, run.sizes
    section = Section("kv_bytes", "kv_bytes per method vs the memory formula")
    forks = shared_forks(run)
    prompt, card = forks.prompt, forks.card
    session = PromptSession(loaded, prompt_tokens(loaded, prompt))
    others = [*eviction_specs(max(8, prompt // 4), prompt), KIVI, "per_token:bits=4"]  # the methods forks left out
    extra = [s for s in others if s not in forks.specs]
    results = list(forks.results) + [session.run(s, sizes.compare_tokens)[0] for s in extra]
    worst = 0.0
    for result in results:
        stack = parse_spec(result.method)
        held = prompt + len(result.token_ids) - 1
        budgets = [stack.eviction.layer_budget_for(prompt, layer, card.layers) if stack.eviction is not None
                   else None for layer in range(card.layers)]
        budget = "all" if set(budgets) == {None} else "/".join(map(str, sorted(set(budgets))))
        quant = stack.quantization
        if quant is None:
            # Prefill-time methods hold their budget after compression (step 0); per-step ones at the end too.
            # Each layer holds the tokens so far, or its own budget when smaller.
            candidates = [(measured, sum(card.kv_bytes(min(tokens, b or tokens)) for b in budgets) / card.layers)
                          for measured, tokens in ((result.kv_bytes_per_step[0], prompt), (result.kv_bytes, held))]
            error = min(abs(m / p - 1) for m, p in candidates)
            section.add(f"{result.method}", error * 100, "% off", "<= 2",
                        note=f"measured {result.kv_bytes:,} B at the end, budget {budget}")
        else:
            breakdown = result.kv_breakdown
            residual_tokens = breakdown.full_precision / (card.kv_elements_per_token * card.bytes_per_element)
            quantized = held - residual_tokens
            predicted_codes = card.kv_elements_per_token * quantized * quant.bits / 8
            error = abs(breakdown.codes / predicted_codes - 1) if predicted_codes else 0.0
            meta_bits = quant.bits_per_element(card.head_dim) - quant.bits
            predicted_meta = card.kv_elements_per_token * quantized * meta_bits / 8
            section.add(f"{result.method}", error * 100, "% off", "<= 2",
                        note=f"codes {breakdown.codes:,} B for {quantized:g} quantized tokens at {quant.bits} bits; "
                             f"metadata {breakdown.metadata:,} B (formula {predicted_meta:,.0f} B); "
                             f"residual {breakdown.full_precision:,} B")
        worst = max(worst, error)
    section.add("worst", worst * 100, "% off", "<= 2")
    return section

"""Time of a streaming perplexity run per method (the policy applied token by token)."""

from __future__ import annotations

from kvviz.bench.harness import BenchRun, Section, bench_section
from kvviz.bench.specs import KIVI
from kvviz.bench.workloads import fitted_prompt
from kvviz.methods import REGISTRY, budget_spec
from kvviz.studies.perplexity import streaming_perplexity


@bench_section("perplexity")
def perplexity(run: BenchRun) -> Section:
    loaded, sizes = run.loaded, run.sizes
    section = Section("perplexity", f"Perplexity over {sizes.ppl_tokens} tokens per method")
    ids = fitted_prompt(loaded, sizes.ppl_tokens, 1)
    n = len(ids)
    budget = max(8, n // 8)
    specs = ["full", *[budget_spec(m, budget, n) for m in ("streaming_llm", "h2o") if m in REGISTRY]]
    if "kivi" in REGISTRY:
        specs.append(KIVI)
    for spec in specs:
        run.log(f"  perplexity {spec}")
        result = streaming_perplexity(loaded, ids, spec)
        section.add(f"{spec}_seconds", result.seconds, "s", note=f"ppl {result.ppl:.2f}, exact={result.exact}")
    return section

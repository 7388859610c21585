"""A preamble reused by a second question (time to first token, exactness) and the kept-set overlap of two
questions under query-aware and query-agnostic eviction."""

from __future__ import annotations

import torch

from kvviz.bench.harness import BenchRun, Section, bench_section
from kvviz.bench.workloads import fit, prompt_tokens
from kvviz.studies.prefix_reuse import run_turns
from kvviz.studies.prefix_sharing import compare_sharing


@bench_section("prefix")
def prefix(run: BenchRun) -> Section:
    loaded, sizes = run.loaded, run.sizes
    section = Section("prefix", "Prefix reuse: a shared preamble and a new question")
    question = sizes.prefix_question
    preamble = fit(loaded, sizes.prefix_preamble, headroom=64 + 2 * question)
    ids = prompt_tokens(loaded, preamble + 2 * question)
    preamble_ids, question_a, question_b = ids[:preamble], ids[preamble:preamble + question], ids[preamble + question:]
    run.log(f"  {preamble}-token preamble, two {question}-token questions, fresh and with reuse")
    report = run_turns(loaded, [preamble_ids + question_a, preamble_ids + question_b], repeats=sizes.repeats)
    second = report.turns[1]
    section.add("preamble_tokens", preamble)
    section.add("reused_tokens", second.lookup.reused_tokens, note=f"{second.lookup.hits} blocks of 16 hit")
    section.add("ttft_fresh_seconds", second.ttft_fresh, "s")
    section.add("ttft_reused_seconds", second.ttft_reused, "s")
    section.add("ttft_reuse_vs_fresh", second.ttft_reused / second.ttft_fresh, "x", "<= 0.3",
                note="both kvviz's prefill, padded alike")
    exact = "< 1e-3" if loaded.dtype == torch.float32 else ""
    section.add("max_logit_diff", second.max_logit_diff, target=exact, note=str(loaded.dtype).replace("torch.", ""))
    specs = [f"snapkv:budget={preamble // 4},window={max(8, question)}",
             f"streaming_llm:sinks=4,window={preamble // 4 - 4},rerotate=0",
             "kvpress:press=knorm,ratio=0.75"]
    run.log("  kept-set overlap between the two questions: " + ", ".join(specs))
    sharing = compare_sharing(loaded, preamble_ids, question_a, question_b, specs, sizes.compare_tokens)
    for row in sharing.rows:
        method = row.method.split(":")[0] if "press=" not in row.method else row.method.split(",")[0]
        name = f"jaccard:{method}:{row.mode}"
        target = "== 1.0" if row.mode == "query_agnostic" else ""
        section.add(name, row.jaccard, target=target,
                    note=f"min over layers {min(row.jaccard_per_layer):.3f}; "
                         f"{'shareable' if row.shareable else 'not shareable'}; B from A's cache: agreement "
                         f"{row.agreement_shared:.2f} (own {row.agreement_own:.2f}), KL {row.mean_kl_shared:.4f} "
                         f"(own {row.mean_kl_own:.4f})")
    return section

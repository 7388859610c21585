"""compare() of six configurations: every method in one batch (one forward per step for all) vs one method after
another, both after the same shared prefill; the runs alternate so a slow spell of the machine hits both."""

from __future__ import annotations

import torch

from kvviz.bench.harness import BenchRun, Section, bench_section, timed
from kvviz.bench.specs import batched_specs
from kvviz.bench.workloads import fit, prompt_tokens
from kvviz.engine.session import compare


@bench_section("batched_compare")
def batched_compare(run: BenchRun) -> Section:
    loaded, sizes = run.loaded, run.sizes
    section = Section("batched_compare", "Comparison of 6 configurations: batched vs sequential decode")
    n = fit(loaded, sizes.batched_prompt, sizes.batched_tokens + 8)
    ids = prompt_tokens(loaded, n)
    specs = batched_specs(max(8, n // 8), n)
    runs: dict[bool, list] = {False: [], True: []}
    for _ in range(max(1, sizes.repeats)):
        for batched in (False, True):
            run.log(f"  {'batched' if batched else 'sequential'} comparison of {len(specs)} configurations")
            runs[batched].append(timed(loaded.device, lambda batched=batched: compare(
                loaded, ids, specs, sizes.batched_tokens, batched=batched)))
            run.log(f"    {runs[batched][-1][0]:.1f} s")
    (sequential_seconds, sequential), (batched_seconds, batched) = (min(runs[b], key=lambda r: r[0])
                                                                  for b in (False, True))
    pairs = list(zip(batched.results, sequential.results, strict=True))
    full = sequential.by_method("full")
    section.add("configurations", len(specs), note=", ".join(specs))
    section.add("prompt_tokens", n)
    section.add("new_tokens", sizes.batched_tokens)
    section.add("sequential_seconds", sequential_seconds, "s", note=f"prefill {sequential.prefill_seconds:.2f} s")
    section.add("batched_seconds", batched_seconds, "s", note=f"prefill {batched.prefill_seconds:.2f} s")
    section.add("batched_vs_sequential", batched_seconds / sequential_seconds, "x", "<= 0.45")
    section.add("decode_batched_vs_sequential", (batched_seconds - batched.prefill_seconds)
                / max(1e-9, sequential_seconds - sequential.prefill_seconds), "x", note="prefill left out")
    section.add("teacher_forced", sum(r.token_ids != full.token_ids for r in sequential.results),
                note="configurations whose tokens part from full's (a second, teacher-forced decode)")
    section.add("same_tokens", all(b.token_ids == s.token_ids and b.error == s.error for b, s in pairs),
                target="== True")
    section.add("same_bytes_and_ledgers", all(
        b.kv_bytes_per_step == s.kv_bytes_per_step and b.kv_bytes_per_layer == s.kv_bytes_per_layer
        and (b.ledger is None) == (s.ledger is None)
        and (b.ledger is None or torch.equal(b.ledger.evicted_at, s.ledger.evicted_at)) for b, s in pairs),
        target="== True")
    section.add("largest_kl_difference", max((abs(x - y) for b, s in pairs for x, y in zip(
        b.kl_per_step, s.kl_per_step, strict=True)), default=0.0), "nats", note="teacher-forced KL, batched vs not")
    return section

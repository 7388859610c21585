"""compare() of six configurations: every method in one batch (one forward per step for all) vs one method after
another, both after the same shared prefill, interleaved and repeated so a slow spell of the machine hits both; and
the floor beside them: the model's own batched forward over rows of the same lengths (a transformers
``DynamicCache``, left-padded and masked), which is what batching costs without any method or bookkeeping."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvviz.bench.harness import BenchRun, Section, bench_section, interleaved, timed
from kvviz.bench.specs import batched_specs
from kvviz.bench.workloads import fitted_prompt
from kvviz.comparison.session import PromptSession, capture_for, compare
from kvviz.methods import parse_spec
from kvviz.runtime.models import LoadedModel


def row_lengths(loaded: LoadedModel, ids: list[int], specs: list[str]) -> list[int]:
    """Each configuration's cache length after its prompt is compressed: what the batch's first forward holds."""
    stacks = [parse_spec(spec) for spec in specs]  # batched_specs: full comes first, as compare() puts it
    session = PromptSession(loaded, ids)
    session.prefill(capture_for(stacks))
    return [session.fork(stack, ledger=False).get_seq_length() for stack in stacks]


def plain_batched_decode(loaded: LoadedModel, lengths: list[int], steps: int) -> float:
    """Seconds for ``steps`` one-token forwards of the model's own batched decode: a ``DynamicCache`` holding
    rows of ``lengths`` entries, left-padded to the longest, with the padding masked."""
    model, config, device = loaded.model, loaded.model.config, loaded.device
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rows, longest = len(lengths), max(lengths)
    cache = DynamicCache(config=config)
    with torch.inference_mode():
        for layer in range(config.num_hidden_layers):
            keys = torch.randn(rows, config.num_key_value_heads, longest, head_dim, dtype=loaded.dtype, device=device)
            cache.update(keys, keys.clone(), layer)
        mask = torch.tensor([[0] * (longest - n) + [1] * n for n in lengths], device=device)
        token = torch.zeros(rows, 1, dtype=torch.long, device=device)
        positions = torch.tensor(lengths, device=device).unsqueeze(1)

        def decode() -> None:
            nonlocal mask
            for step in range(steps):
                mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
                model(input_ids=token, attention_mask=mask, past_key_values=cache, position_ids=positions + step,
                      use_cache=True, logits_to_keep=1)

        return timed(device, decode)[0]


@bench_section("batched_compare")
def batched_compare(run: BenchRun) -> Section:
    loaded, sizes = run.loaded, run.sizes
    section = Section("batched_compare", "Comparison of 6 configurations: batched vs sequential decode, and the floor")
    ids = fitted_prompt(loaded, sizes.batched_prompt, sizes.batched_tokens + 8)
    n = len(ids)
    specs = batched_specs(max(8, n // 8), n)
    run.log(f"  {len(specs)} configurations, {n} prompt tokens, {sizes.batched_tokens} new, batched and sequential "
            f"in turns, {max(1, sizes.repeats)} times each")
    timings = interleaved(loaded.device, {
        name: (lambda batched=batched: compare(loaded, ids, specs, sizes.batched_tokens, batched=batched))
        for name, batched in (("sequential", False), ("batched", True))}, sizes.repeats, run.log)
    (sequential_time, sequential), (batched_time, batched) = timings["sequential"], timings["batched"]
    pairs = list(zip(batched.results, sequential.results, strict=True))
    full = sequential.by_method("full")
    twins = sum(r.token_ids != full.token_ids for r in sequential.results)
    lengths = row_lengths(loaded, ids, specs)
    lengths += sorted(lengths)[-twins:] if twins else []  # a twin holds what its row holds (the longest, at most)
    steps = max(1, sizes.batched_tokens - 1)
    floor = plain_batched_decode(loaded, lengths, steps)
    batched_decode = batched_time.median - batched.prefill_seconds
    section.add("configurations", len(specs), note=", ".join(specs))
    section.add("prompt_tokens", n)
    section.add("new_tokens", sizes.batched_tokens)
    section.add("sequential_seconds", sequential_time.median, "s",
                note=f"{sequential_time.note()}; prefill {sequential.prefill_seconds:.2f} s")
    section.add("batched_seconds", batched_time.median, "s",
                note=f"{batched_time.note()}; prefill {batched.prefill_seconds:.2f} s")
    target = "<= 0.5" if loaded.device == "cpu" else "<= 0.3"
    section.add("batched_vs_sequential", batched_time.median / sequential_time.median, "x", target,
                note="medians; the target: 0.5x on the 2-core CPU, 0.3x on a GPU. Each path as the app runs it: the "
                     "batch's rows padded to a batch-independent count on a CPU, sequential one row unpadded")
    section.add("decode_batched_vs_sequential", batched_decode
                / max(1e-9, sequential_time.median - sequential.prefill_seconds), "x", note="prefill left out")
    section.add("floor_seconds", floor, "s", note=f"the model's own batched decode, {steps} forwards of "
                f"{len(lengths)} rows of {min(lengths)}-{max(lengths)} entries (DynamicCache, padding masked; its "
                f"linear layers padded as the batched decode's)")
    section.add("batched_decode_vs_floor", batched_decode / max(1e-9, floor), "x",
                note="kvviz's batched decode (forks, methods and bookkeeping included) over the floor")
    section.add("teacher_forced", twins, note="configurations whose tokens part from full's (a second, teacher-forced "
                "decode)")
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

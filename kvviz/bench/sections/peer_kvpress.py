"""Our prefill compression vs kvpress's presses (forward hooks) on the same model and prompt."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvviz.bench.harness import BenchRun, Section, bench_section, timed
from kvviz.bench.workloads import fitted_prompt
from kvviz.comparison.session import PromptSession, capture_for
from kvviz.methods import REGISTRY, budget_spec, parse_spec


@bench_section("peer_kvpress")
def peer_kvpress(run: BenchRun) -> Section:
    loaded, sizes = run.loaded, run.sizes
    section = Section("peer_kvpress", "Prefill compression vs kvpress")
    pairs = [(name, press) for name, press in (("snapkv", "SnapKVPress"), ("streaming_llm", "StreamingLLMPress"))
             if name in REGISTRY]
    if not pairs:
        section.skipped = "needs our snapkv or streaming_llm"
        return section
    import kvpress  # here, not at the top: importing the bench (for its specs) stays quick

    ids = fitted_prompt(loaded, sizes.peer_prompt)
    n = len(ids)
    device = loaded.device
    keep = n // 2
    section.add("prompt_tokens", n)
    for name, press_name in pairs:
        sized = budget_spec(name, keep, n)  # bare ("snapkv") where the budget is the method's default
        extra = {"streaming_llm": "rerotate=0", "snapkv": "window=64,kernel=5,pool=avg"}[name]
        spec = f"{sized}{',' if ':' in sized else ':'}{extra}"
        stack = parse_spec(spec)
        press = getattr(kvpress, press_name)(compression_ratio=0.5)

        def ours(stack=stack) -> int:
            session = PromptSession(loaded, ids)
            session.prefill(capture_for([stack]))
            return len(session.fork(stack, ledger=False).layers[0].storage)

        def theirs(press=press) -> int:
            cache = DynamicCache()
            with torch.inference_mode(), press(loaded.model):
                loaded.model(input_ids=torch.tensor([ids], device=device), past_key_values=cache, use_cache=True,
                             logits_to_keep=1)
            return cache.get_seq_length()

        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        kept = {}
        for _ in range(sizes.repeats):
            for who, work in (("theirs", theirs), ("ours", ours)):
                seconds, kept[who] = timed(device, work)
                times[who].append(seconds)
        ratio = min(times["ours"]) / min(times["theirs"])
        section.add(f"{name}_vs_{press_name}", ratio, "x", "<= 1.2",
                    note=f"{min(times['ours']):.2f}s vs {min(times['theirs']):.2f}s; kept {kept['ours']} vs "
                         f"{kept['theirs']} of {n}; ours = prefill + statistics + fork with ledger off; both "
                         "prefills padded alike (a prompt's rows are never padded, its last row's lm_head is)")
    return section

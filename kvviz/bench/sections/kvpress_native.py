"""kvpress_native (the press in its own hooks, rows matched back, kvviz's cache and ledger built) vs a plain prefill
with the same press into a DynamicCache: what the mapping costs on top of the press."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvviz.bench.harness import BenchRun, Section, bench_section, timed
from kvviz.bench.workloads import fitted_prompt
from kvviz.comparison.session import PromptSession
from kvviz.methods import REGISTRY, parse_spec
from kvviz.methods.kvpress.fork import attention_modules


@bench_section("kvpress_native")
def kvpress_native(run: BenchRun) -> Section:
    loaded, sizes = run.loaded, run.sizes
    section = Section("kvpress_native", "kvpress presses run natively vs the same press alone")
    if "kvpress_native" not in REGISTRY:
        section.skipped = "needs the kvpress_native method"
        return section
    ids = fitted_prompt(loaded, sizes.peer_prompt)
    n = len(ids)
    section.add("prompt_tokens", n)
    repeats = max(3, sizes.repeats)  # best of 3 at least: run-against-run ratios swing with a loaded machine
    section.add("repeats", repeats)
    for press in ("snapkv", "knorm", "adakv"):
        spec = f"kvpress_native:press={press}"

        def native(spec=spec) -> float:
            """The native fork; returns the press's own forward inside it (snapshot hooks included)."""
            stack = parse_spec(spec)
            PromptSession(loaded, ids).fork(stack)
            return stack.eviction.report.seconds

        def plain(spec=spec) -> int:
            cache = DynamicCache(config=loaded.model.config)
            with torch.inference_mode(), parse_spec(spec).eviction.build_press(1)(loaded.model):
                loaded.model(input_ids=torch.tensor([ids], device=loaded.device), past_key_values=cache,
                             use_cache=True, logits_to_keep=1)
            return cache.get_seq_length()

        times: dict[str, list[float]] = {"native": [], "plain": []}
        in_run: list[float] = []  # native fork / the press's forward within the same run: no run-to-run noise
        for _ in range(repeats):
            for who, work in (("plain", plain), ("native", native)):
                seconds, result = timed(loaded.device, work)
                times[who].append(seconds)
                if who == "native":
                    in_run.append(seconds / result)
        ratio = min(times["native"]) / min(times["plain"])
        section.add(f"{press}_native_vs_press", ratio, "x", "<= 1.2",
                    note=f"best of {repeats}: {min(times['native']):.2f}s vs {min(times['plain']):.2f}s (plain "
                         f"{max(times['plain']):.2f}s at worst); native = press prefill + row matching + kvviz cache "
                         "and ledger; both prefills padded alike (a prompt's rows never, its last row's lm_head)")
        section.add(f"{press}_native_vs_own_forward", min(in_run), "x", "<= 1.2",
                    note="inside one native run: the whole fork over the press's forward in it (the snapshot hooks "
                         "counted in the forward); what matching and kvviz's cache and ledger add")
    for module in attention_modules(loaded.model):  # kvpress's own context leaves these on the model
        module._modules.pop("rotary_emb", None)
        module.__dict__.pop("masked_key_indices", None)
    return section

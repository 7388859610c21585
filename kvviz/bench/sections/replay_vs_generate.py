"""Tokens per second of kvviz's replay of ``full`` vs ``model.generate``, same prompt and length."""

from __future__ import annotations

import torch

from kvviz.bench.harness import BenchRun, Section, bench_section, timed
from kvviz.bench.workloads import fit, prompt_tokens
from kvviz.engine.session import PromptSession


@bench_section("replay_vs_generate")
def replay_vs_generate(run: BenchRun) -> Section:
    loaded, sizes = run.loaded, run.sizes
    section = Section("replay_vs_generate", "Replay of full vs model.generate")
    n = fit(loaded, sizes.generate_prompt, sizes.generate_tokens + 8)
    ids = prompt_tokens(loaded, n)
    tokens = sizes.generate_tokens
    device = loaded.device

    def generate():
        with torch.inference_mode():
            out = loaded.model.generate(torch.tensor([ids], device=device),
                                        attention_mask=torch.ones(1, n, dtype=torch.long, device=device),
                                        max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                        pad_token_id=0)
        return out[0, n:].tolist()

    def replay():
        session = PromptSession(loaded, ids)
        session.eos_ids = set()  # generate is told to run all the tokens too
        return session.run("full", tokens)[0].token_ids

    ours, theirs = [], []
    for _ in range(sizes.repeats):  # interleaved, so drift in machine load hits both alike
        theirs.append(timed(device, generate))
        ours.append(timed(device, replay))
    ours_seconds, theirs_seconds = min(t for t, _ in ours), min(t for t, _ in theirs)
    section.add("prompt_tokens", n)
    section.add("new_tokens", tokens)
    section.add("generate_tokens_per_s", tokens / theirs_seconds, "tok/s", note="prefill included on both sides")
    section.add("replay_tokens_per_s", tokens / ours_seconds, "tok/s")
    section.add("replay_vs_generate", theirs_seconds / ours_seconds, "x", ">= 0.9")
    section.add("same_tokens", ours[0][1] == theirs[0][1], target="== True")
    return section

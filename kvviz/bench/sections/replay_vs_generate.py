"""Tokens per second of kvviz's replay of ``full`` vs ``model.generate``, same prompt and length.

Both decode one row unpadded: kvviz's one-row decode multiplies its row as it comes, so ``generate`` runs inside
:func:`~kvviz.runtime.invariance.rows_as_they_come` too (on a CPU every linear layer pads a few rows otherwise, which
slows a one-row step: docs/performance.md, "Batched comparison"). ``generate`` padded is reported beside it, the
baseline as it ran before."""

from __future__ import annotations

import contextlib

import torch

from kvviz.bench.harness import BenchRun, Section, bench_section, timed
from kvviz.bench.workloads import fit, prompt_tokens
from kvviz.comparison.session import PromptSession
from kvviz.runtime.invariance import rows_as_they_come
from kvviz.runtime.models import LoadedModel

PADDING = "both unpadded: generate runs its one-row steps as kvviz's decode does (rows_as_they_come)"


def generate_tokens(loaded: LoadedModel, ids: list[int], tokens: int, padded: bool = False) -> list[int]:
    """``model.generate``'s greedy ``tokens`` after ``ids``, its rows multiplied as they come like kvviz's replay
    (``padded``: as a batch's rows, the thread's default on a CPU)."""
    device = loaded.device
    with torch.inference_mode(), contextlib.nullcontext() if padded else rows_as_they_come():
        out = loaded.model.generate(torch.tensor([ids], device=device),
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                                    max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@bench_section("replay_vs_generate")
def replay_vs_generate(run: BenchRun) -> Section:
    loaded, sizes = run.loaded, run.sizes
    section = Section("replay_vs_generate", "Replay of full vs model.generate")
    n = fit(loaded, sizes.generate_prompt, sizes.generate_tokens + 8)
    ids = prompt_tokens(loaded, n)
    tokens = sizes.generate_tokens
    device = loaded.device

    def generate(padded: bool = False):
        return generate_tokens(loaded, ids, tokens, padded)

    def replay():
        session = PromptSession(loaded, ids)
        session.eos_ids = set()  # generate is told to run all the tokens too
        return session.run("full", tokens)[0].token_ids

    ours, theirs, padded = [], [], []
    for _ in range(sizes.repeats):  # interleaved, so drift in machine load hits every variant alike
        theirs.append(timed(device, generate))
        ours.append(timed(device, replay))
        padded.append(timed(device, lambda: generate(padded=True)))
    ours_seconds, theirs_seconds = min(t for t, _ in ours), min(t for t, _ in theirs)
    padded_seconds = min(t for t, _ in padded)
    section.add("prompt_tokens", n)
    section.add("new_tokens", tokens)
    section.add("generate_tokens_per_s", tokens / theirs_seconds, "tok/s", note="prefill included on both sides")
    section.add("replay_tokens_per_s", tokens / ours_seconds, "tok/s")
    section.add("replay_vs_generate", theirs_seconds / ours_seconds, "x", ">= 0.9", note=PADDING)
    section.add("replay_vs_generate_padded", padded_seconds / ours_seconds, "x",
                note="generate with its one-row steps padded as a batch's rows (the baseline before it was made fair)")
    section.add("same_tokens", ours[0][1] == theirs[0][1] == padded[0][1], target="== True")
    return section

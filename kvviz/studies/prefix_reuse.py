"""The Prefix-reuse page's study: turns sharing a preamble through one prefix cache, timed fresh and with reuse; what a
one-byte edit of the preamble costs; prefill time and cache bytes against context length.

The prefix cache is :mod:`kvviz.runtime.prefix`, prefilling through it :mod:`kvviz.runtime.prefill`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from kvviz.runtime.admission import ALONE
from kvviz.runtime.jobs import Job, Stage, Steps, Turn
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.prefill import prefill_with_prefix
from kvviz.runtime.prefix import BLOCK_TOKENS, PrefixCache, PrefixLookup
from kvviz.runtime.progress import Progress

PREAMBLE_FILE = Path(__file__).resolve().parents[2] / "assets" / "prefix_preamble.txt"
DEFAULT_QUESTIONS = (
    "Can I take my bicycle and a kayak on the 14:00 sailing to the Rock, and what will that cost?",
    "I use a wheelchair and I am driving to Kilmory in August. How do I board?",
)
TIMESTAMP = "Current date and time: 2026-11-29 22:41:07 UTC."


def default_preamble() -> str:
    """A help-desk system prompt with few-shot examples in ChatML (about 1.1K SmolLM2 tokens)."""
    return PREAMBLE_FILE.read_text(encoding="utf-8")


def question_turn(preamble: str, question: str) -> str:
    """The text appended to ``preamble`` to ask ``question``: a ChatML user turn when the preamble is ChatML."""
    if "<|im_start|>" in preamble:
        return f"<|im_start|>user\n{question.strip()}<|im_end|>\n<|im_start|>assistant\n"
    return f"\nQuestion: {question.strip()}\nAnswer:"


def turn_ids(tokenizer, preamble: str, question: str) -> tuple[list[int], list[int]]:
    """Preamble and question tokenized apart, so every question's prompt starts with the very same preamble ids
    (tokenizing the joined text could merge tokens across the seam)."""
    return ([int(i) for i in tokenizer(preamble)["input_ids"]],
            [int(i) for i in tokenizer(question_turn(preamble, question))["input_ids"]])


def edit_preamble(preamble: str, edit: str, line: int) -> str:
    """The preamble with one byte-level change after its line ``line`` (0-based): ``timestamp`` inserts a date line,
    ``reorder`` swaps that line with the next one. Every block from the change on gets a new hash."""
    lines = preamble.split("\n")
    line = max(0, min(line, len(lines) - 2))
    if edit == "timestamp":
        lines.insert(line + 1, TIMESTAMP)
    elif edit == "reorder":
        lines[line], lines[line + 1] = lines[line + 1], lines[line]
    else:
        raise ValueError(f"unknown edit {edit!r}; choose timestamp or reorder")
    return "\n".join(lines)


@dataclass
class TurnResult:
    """One prompt of a conversation sharing a preamble: its block table, time to first token fresh and with reuse,
    and how far the reused logits are from the fresh ones."""

    label: str
    prompt_tokens: int
    lookup: PrefixLookup
    ttft_fresh: float
    ttft_reused: float
    max_logit_diff: float
    same_next_token: bool
    kv_bytes: int

    @property
    def speedup(self) -> float:
        return self.ttft_fresh / self.ttft_reused if self.ttft_reused > 0 else float("inf")


@dataclass
class ReuseReport:
    """Turns run through one fresh prefix cache, in order."""

    block_tokens: int
    turns: list[TurnResult] = field(default_factory=list)

    def to_rows(self) -> list[dict]:
        return [{"turn": t.label, "prompt_tokens": t.prompt_tokens, "hit_blocks": t.lookup.hits,
                 "miss_blocks": t.lookup.misses, "reused_tokens": t.lookup.reused_tokens,
                 "ttft_fresh_s": t.ttft_fresh, "ttft_reused_s": t.ttft_reused,
                 "max_logit_diff": t.max_logit_diff, "same_next_token": t.same_next_token} for t in self.turns]

    def block_tables(self) -> list[list[str]]:
        """Per turn, each block's status (hit, miss, recomputed, partial)."""
        return [[b.status for b in t.lookup.blocks] for t in self.turns]

    def lines(self) -> list[str]:
        """One line per turn: blocks hit, tokens reused, time to first token with and without reuse."""
        return [f"  {t.label[:48]!r}: {t.prompt_tokens} tokens, {t.lookup.hits}/{len(t.lookup.blocks)} blocks hit "
                f"({t.lookup.reused_tokens} tokens reused), TTFT {t.ttft_reused * 1000:.0f} ms vs "
                f"{t.ttft_fresh * 1000:.0f} ms fresh ({t.ttft_reused / t.ttft_fresh:.2f}x), "
                f"max |logit diff| {t.max_logit_diff:.2e}" for t in self.turns]


def run_turns(loaded: LoadedModel, prompts: list[list[int]], labels: list[str] | None = None,
              block_tokens: int = BLOCK_TOKENS, repeats: int = 1, progress: Progress | None = None) -> ReuseReport:
    """Run ``prompts`` in order through a new prefix cache (so the first one misses everywhere): each turn is timed
    fresh and with reuse (best of ``repeats``, alternated so a slow spell of a shared machine hits both) and its
    reused logits compared with the fresh ones. One job on the model's engine (:func:`turns_job`), whose result
    this waits for."""
    return loaded.engine.run(turns_job(loaded, prompts, labels, block_tokens, repeats), progress)


def turns_job(loaded: LoadedModel, prompts: list[list[int]], labels: list[str] | None = None,
              block_tokens: int = BLOCK_TOKENS, repeats: int = 1) -> Job[ReuseReport]:
    """:func:`run_turns` as a job: one turn per step (its timings taken within the step, alone on the model), the
    model given back between turns."""
    labels = labels or [f"turn {i + 1}" for i in range(len(prompts))]
    return Job(functools.partial(_turns_steps, loaded, prompts, labels, block_tokens, repeats), ALONE, "turns")


def _turns_steps(loaded: LoadedModel, prompts: list[list[int]], labels: list[str], block_tokens: int, repeats: int,
                 progress: Progress) -> Steps[ReuseReport]:
    prefix = PrefixCache(block_tokens=block_tokens, budget_bytes=2**62)
    report = ReuseReport(block_tokens)
    yield Stage.MEASURE
    # warm-up: the first forward pays one-off costs
    prefill_with_prefix(loaded.model, loaded.device, prompts[0][:block_tokens], None)
    for turn, (label, ids) in enumerate(zip(labels, prompts, strict=True)):
        if turn:
            yield Turn(ALONE)
        progress(turn / len(prompts), f"{label}: prefill fresh and with reuse")
        fresh_times, reused_times = [], []
        fresh = reused = None
        for _ in range(max(1, repeats)):  # repeats reuse the same blocks: nothing is stored until the turn ends
            fresh = prefill_with_prefix(loaded.model, loaded.device, ids, None)
            fresh_times.append(fresh.seconds)
            reused = prefill_with_prefix(loaded.model, loaded.device, ids, prefix, store=False)
            reused_times.append(reused.seconds)
        prefix.store(ids, reused.cache)
        diff = float((reused.last_logits.float() - fresh.last_logits.float()).abs().max())
        report.turns.append(TurnResult(label, len(ids), reused.lookup, min(fresh_times), min(reused_times), diff,
                                       int(reused.last_logits.argmax()) == int(fresh.last_logits.argmax()),
                                       fresh.cache.nbytes().total))
    progress(1.0, "done")
    return report


@dataclass
class LengthCost:
    """Measured prefill time and dense cache bytes at one prompt length."""

    tokens: int
    prefill_seconds: float
    kv_bytes: int


def context_cost(loaded: LoadedModel, token_ids: list[int], lengths: list[int],
                 progress: Progress | None = None) -> list[LengthCost]:
    """Prefill time and cache bytes for the first ``n`` tokens of ``token_ids`` (repeated when shorter) per length.
    One job on the model's engine (:func:`context_cost_job`), whose result this waits for."""
    return loaded.engine.run(context_cost_job(loaded, token_ids, lengths), progress)


def context_cost_job(loaded: LoadedModel, token_ids: list[int], lengths: list[int]) -> Job[list[LengthCost]]:
    """:func:`context_cost` as a job: one length per step, the model given back between lengths."""
    return Job(functools.partial(_context_cost_steps, loaded, list(token_ids), list(lengths)), ALONE, "context_cost")


def _context_cost_steps(loaded: LoadedModel, token_ids: list[int], lengths: list[int],
                        progress: Progress) -> Steps[list[LengthCost]]:
    costs = []
    for index, length in enumerate(lengths):
        yield Turn(ALONE) if index else Stage.MEASURE
        progress(index / len(lengths), f"prefill of {length} tokens")
        ids = (token_ids * (length // max(1, len(token_ids)) + 1))[:length]
        run = prefill_with_prefix(loaded.model, loaded.device, ids, None)
        costs.append(LengthCost(length, run.seconds, run.cache.nbytes().total))
    return costs

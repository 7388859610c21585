"""Needle retrieval: a 5-digit pass key hidden in filler text, and whether each method can still find it.

Averages hide the failure that matters: a method can keep perplexity flat and still drop the one token an answer
needs. Each cell of the grid hides a key at a depth in a haystack of a given length, asks for it, and reports both
the answer and, from the eviction ledger, whether the key's tokens were still cached and if not, when and where they
were evicted.

The haystack is kvviz's own seeded sentences (no third-party text). For a given seed and trial the key and the
sentence stream are fixed, so a shorter haystack is a prefix of a longer one and cells differ only in length and
depth. Two modes: ``query_aware`` compresses the prompt with the question in it; ``query_agnostic`` compresses the
context alone and feeds the question afterwards, as kvpress evaluates.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from kvviz.cache.ledger import KEPT, EvictionLedger
from kvviz.comparison.session import PromptError, PromptSession, capture_for
from kvviz.methods import MethodStack, parse_spec
from kvviz.runtime.admission import ALONE
from kvviz.runtime.jobs import Job, Stage, Steps, Turn
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.progress import Progress

MODES = ("query_aware", "query_agnostic")
INSTRUCTION = ("There is a pass key hidden inside a lot of irrelevant text. Find it and remember it. "
               "I will ask you for the pass key.")
QUESTION = "What is the pass key?"
PLAIN_ANSWER_PREFIX = " The pass key is"  # without a chat template the model continues this line

_SUBJECTS = ("The old mill", "A quiet river", "The village baker", "A red kite", "The morning train", "The orchard",
             "A tired mule", "The harbour", "The lamplighter", "A flock of geese", "The clock tower", "A fishing boat",
             "The school bell", "An old shepherd", "The north wind", "A grey cat", "The market", "The ferry")
_PREDICATES = ("turns slowly", "hums softly", "stays open", "waits patiently", "rests in the shade",
               "moves along the road", "shines in the sun", "grows quiet", "looks the same as ever", "smells of bread",
               "hardly changes", "draws a small crowd", "keeps its own pace", "sounds far away")
_TAILS = ("every spring", "after the rain", "near the square", "on most afternoons", "before the evening",
          "beside the hills", "in the first light", "when the tide is low", "all through the winter",
          "along the valley", "once the fog lifts", "at the end of the week")


@dataclass
class NeedlePrompt:
    """One haystack: the prompt's tokens, where the question starts, and where the key's tokens sit."""

    ids: list[int]
    question_start: int  # index in ids: context before it, the question (and turn end) from it on
    key: str
    needle_positions: list[int]  # the key's digit tokens (both mentions in the needle)
    context_start: int = 0  # index in ids of the user's text: before it the chat template's header and system turn


@dataclass
class NeedleCell:
    """One method on one haystack.

    ``survived``: every needle token was still cached in every layer and KV head at the end. ``evicted_step``: the
    earliest eviction of a needle token (0 = prefill compression, s = the s-th token fed after the prompt; in
    query-agnostic mode the question's tokens come first). ``evicted_layers``: layers that evicted any of them.
    """

    method: str
    length: int
    depth: float
    trial: int
    mode: str
    key: str
    answer: str
    found: bool
    prompt_tokens: int
    needle_positions: list[int]
    survived: bool
    evicted_step: int | None
    evicted_layers: list[int]


@dataclass
class NeedleReport:
    """Every cell of a grid, in run order; ``seconds`` is the wall time of the whole grid."""

    cells: list[NeedleCell]
    seconds: float = 0.0
    settings: dict = field(default_factory=dict)

    def to_frame(self):
        """One row per cell (pandas is imported here so the engine does not need it elsewhere)."""
        import pandas as pd

        columns = [f for f in NeedleCell.__dataclass_fields__]
        return pd.DataFrame([asdict(c) for c in self.cells], columns=columns)

    def summary(self) -> list[dict]:
        """Per method, length and depth: how many trials found the key and how many kept its tokens."""
        groups: dict[tuple, list[NeedleCell]] = {}
        for cell in self.cells:
            groups.setdefault((cell.method, cell.length, cell.depth), []).append(cell)
        return [
            {"method": method, "length": length, "depth": depth, "trials": len(cells),
             "found": sum(c.found for c in cells), "survived": sum(c.survived for c in cells)}
            for (method, length, depth), cells in groups.items()
        ]

    def to_json(self) -> dict:
        return {"settings": self.settings, "seconds": round(self.seconds, 3), "summary": self.summary(),
                "cells": [asdict(c) for c in self.cells]}

    def lines(self) -> list[str]:
        """The grid as text: per method, found/trials by depth (rows) and length (columns); * = key tokens evicted."""
        rows = {(r["method"], r["length"], r["depth"]): r for r in self.summary()}
        lengths, depths = self.settings["lengths"], self.settings["depths"]
        out = [f"needle grid ({self.settings['mode']}, {self.settings['trials']} trial(s)): found/trials; "
               f"* = the key's tokens were evicted in some trial; {self.seconds:.1f}s"]
        for method in self.settings["methods"]:
            out += ["", f"== {method}", "depth \\ length " + "".join(f"{length:>10}" for length in lengths)]
            for depth in depths:
                cells = [rows[(method, length, depth)] for length in lengths]
                marks = [f"{c['found']}/{c['trials']}{'*' if c['survived'] < c['trials'] else ' '}" for c in cells]
                out.append(f"{depth:<16g}" + "".join(f"{m:>10}" for m in marks))
        return out


def filler_sentences(rng: random.Random) -> Iterator[str]:
    """kvviz's own haystack: an endless stream of bland seeded sentences (shared with :mod:`kvviz.studies.tail`)."""
    while True:
        yield f"{rng.choice(_SUBJECTS)} {rng.choice(_PREDICATES)} {rng.choice(_TAILS)}."


def needle_text(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key."


def filler_for(tokenizer, base: str, length: int, stream, what: str) -> list[str]:
    """Sentences from ``stream`` estimated to bring the prompt ``base`` (rendered without filler) to ``length``
    tokens; the caller trims them until the whole rendered prompt fits (the per-sentence count is an estimate)."""
    budget = length - len(tokenizer(base, add_special_tokens=False)["input_ids"])
    if budget < 0:
        raise PromptError(f"length {length} is too short for the {what} prompt: it needs {length - budget} tokens")
    filler: list[str] = []
    while budget > 0:
        sentence = next(stream)
        budget -= len(tokenizer(" " + sentence, add_special_tokens=False)["input_ids"])
        filler.append(sentence)
    return filler


def build_needle_prompt(tokenizer, length: int, depth: float, seed: int = 0, trial: int = 0,
                        chat: bool = True) -> NeedlePrompt:
    """A prompt of at most ``length`` tokens with the key after ``depth`` (0..1) of the filler sentences."""
    if chat and not getattr(tokenizer, "chat_template", None):
        raise PromptError("this model has no chat template; run the needle test without chat")
    rng = random.Random(f"kvviz-needle:{seed}:{trial}")
    key = str(rng.randint(10000, 99999))
    stream = filler_sentences(rng)

    def render(filler: list[str]) -> tuple[str, int, int]:
        """The prompt text, the character where the question starts and the one where the user's text starts."""
        cut = round(depth * len(filler))
        context = " ".join([*filler[:cut], needle_text(key), *filler[cut:]])
        body = f"{INSTRUCTION}\n\n{context}\n\n"
        if chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": body + QUESTION}], tokenize=False,
                                                 add_generation_prompt=True)
            return text, text.index(body) + len(body), text.index(body)
        return body + QUESTION + PLAIN_ANSWER_PREFIX, len(body), 0

    filler = filler_for(tokenizer, render([])[0], length, stream, "needle")
    while True:  # the per-sentence count is an estimate; trim until the whole prompt fits
        text, question_char, context_char = render(filler)
        encoded = tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=True)  # a template has its BOS
        if len(encoded["input_ids"]) <= length or not filler:
            break
        filler.pop()
    offsets = encoded["offset_mapping"]
    needle = needle_text(key)
    needle_start = text.index(needle)
    spans = [(needle_start + i, needle_start + i + len(key)) for i in (needle.index(key), needle.rindex(key))]
    return NeedlePrompt(list(encoded["input_ids"]), first_token_at(offsets, question_char), key,
                        span_tokens(offsets, spans), first_token_at(offsets, context_char))


def span_tokens(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """Token indices whose characters (``offsets`` from the tokenizer) overlap any ``[start, end)`` character span."""
    return [t for t, (a, b) in enumerate(offsets) if any(a < end and b > start for start, end in spans)]


def first_token_at(offsets: list[tuple[int, int]], char: int) -> int:
    """Index of the first token starting at or after character ``char``."""
    return next(t for t, (a, _) in enumerate(offsets) if a >= char)


def needle_eviction(ledger: EvictionLedger | None, positions: list[int]) -> tuple[bool, int | None, list[int]]:
    """(survived, earliest eviction step, layers that evicted any needle token) from a method's ledger. A local
    layer's window sliding past the needle is the model's own attention, not an eviction: it does not count."""
    if ledger is None:
        return True, None, []
    steps = ledger.evicted_at[..., positions]  # [layers, kv_heads, needle tokens]
    evicted = (steps != KEPT) & ~ledger.slid_out()[..., positions]
    if not bool(evicted.any()):
        return True, None, []
    layers = evicted.flatten(1).any(dim=1).nonzero().flatten().tolist()
    return False, int(steps[evicted].min()), layers


def check_grid(study: str, mode: str, specs: list[str], lengths: list[int], depths: list[float],
               trials: int) -> None:
    """PromptError naming the first argument of a needle or tail grid that cannot run, before any model work."""
    if mode not in MODES:
        raise PromptError(f"unknown {study} mode {mode!r}; choose {' or '.join(MODES)}")
    if not specs or not lengths or not depths:
        raise PromptError(f"the {study} run needs at least one method, one length and one depth")
    if any(length < 1 for length in lengths):
        raise PromptError(f"{study} lengths must be positive token counts")
    if any(not 0.0 <= depth <= 1.0 for depth in depths):
        raise PromptError(f"{study} depths must lie between 0 and 1")
    if trials < 1:
        raise PromptError("trials must be at least 1")


def split_for_mode(ids: list[int], question_start: int, mode: str) -> tuple[list[int], list[int] | None]:
    """The tokens compressed at prefill and the ones fed after: all of the prompt with the question in it
    (``query_aware``), or the context alone with the question fed afterwards (``query_agnostic``, as kvpress
    evaluates)."""
    if mode == "query_agnostic":
        return ids[:question_start], ids[question_start:]
    return ids, None


def run_needle_grid(
    loaded: LoadedModel,
    specs: list[str],
    lengths: list[int],
    depths: list[float],
    trials: int = 1,
    seed: int = 0,
    chat: bool = True,
    mode: str = "query_aware",
    max_new_tokens: int = 16,
    progress: Progress | None = None,
) -> NeedleReport:
    """Run every method on every (trial, length, depth) haystack; one prefill per haystack is shared by all methods.

    Success means the key's digits appear in the greedy answer. PromptError or SpecError for bad arguments, before
    any model work. One job on the model's engine (:func:`needle_job`), whose result this waits for.
    """
    return loaded.engine.run(needle_job(loaded, specs, lengths, depths, trials, seed, chat, mode, max_new_tokens),
                             progress)


def needle_job(loaded: LoadedModel, specs: list[str], lengths: list[int], depths: list[float], trials: int = 1,
               seed: int = 0, chat: bool = True, mode: str = "query_aware",
               max_new_tokens: int = 16) -> Job[NeedleReport]:
    """:func:`run_needle_grid` as a job: the arguments checked here, then one haystack per step, each decoded
    alone, the model given back between haystacks so that other runs take their turns."""
    check_grid("needle", mode, specs, lengths, depths, trials)
    if max_new_tokens < 1:
        raise PromptError("max_new_tokens must be at least 1")
    stacks = [parse_spec(spec) for spec in specs]
    settings = {"model": loaded.name, "methods": [stack.label for stack in stacks], "lengths": lengths,
                "depths": depths, "trials": trials, "seed": seed, "chat": chat, "mode": mode,
                "max_new_tokens": max_new_tokens}
    return Job(functools.partial(_needle_steps, loaded, stacks, settings), ALONE, "needle")


def _needle_steps(loaded: LoadedModel, stacks: list[MethodStack], settings: dict,
                  progress: Progress) -> Steps[NeedleReport]:
    capture = capture_for(stacks)
    trials, mode = settings["trials"], settings["mode"]
    cases = [(trial, length, depth) for trial in range(trials) for length in settings["lengths"]
             for depth in settings["depths"]]
    started = time.perf_counter()
    cells: list[NeedleCell] = []
    for number, (trial, length, depth) in enumerate(cases):
        yield Turn(ALONE) if number else Stage.MEASURE
        prompt = build_needle_prompt(loaded.tokenizer, length, depth, settings["seed"], trial, settings["chat"])
        context, suffix = split_for_mode(prompt.ids, prompt.question_start, mode)
        session = PromptSession(loaded, context)
        session.prefill(capture)
        for index, stack in enumerate(stacks):
            progress((number + index / len(stacks)) / len(cases),
                     f"{stack.label}: length {length}, depth {depth:.0%}, trial {trial + 1} of {trials}")
            result, _ = session.run(stack, settings["max_new_tokens"], suffix_tokens=suffix)
            survived, step, layers = needle_eviction(result.ledger, prompt.needle_positions)
            cells.append(NeedleCell(stack.label, length, depth, trial, mode, prompt.key, result.text,
                                    prompt.key in result.text, len(prompt.ids), prompt.needle_positions,
                                    survived, step, layers))
    progress(1.0, "done")
    return NeedleReport(cells, time.perf_counter() - started, settings)

"""The tail risk: multi-key, multi-value and multi-hop retrieval and system-prompt instructions, per method.

A method can pass the single needle and still lose a distractor-laden key, one of several values, one hop of a
chain or one instruction of a system prompt. Each task family plants statements in kvviz's seeded filler
(:func:`kvviz.studies.needle.filler_sentences`) at chosen depths of a prompt of a chosen length, records every planted
span as token positions, asks a question, and scores the greedy answer exactly:

- ``needle``: the single pass key of :mod:`kvviz.studies.needle`, the reference the others are read against;
- ``multikey``: several similar keys, one asked for (the others are distractors, as in RULER's multi-key needle);
- ``multivalue``: one key with several values, all asked for (correct only when every value is given);
- ``vartrack``: a chain of k assignments (``A = 48213``, ``B = A``, ...) in reading order from the chosen depth,
  the last variable asked for; the answer starts ``Following the chain: <last> =`` so each hop is a copy;
- ``instructions``: three checkable instructions in the system prompt, a long user context and a question; each
  instruction is scored on its own.

Calibration: ``full`` runs every item first, and an item (for ``instructions``, an instruction) counts only where
the full cache gets it right, so a failure is the method's, not the model's; the report says how many were generated
and kept. Attribution: for every planted span, the eviction ledger says whether it was evicted, the earliest step
and the layers; a failure with nothing planted evicted under a quantized stack is marked as quantization's.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import asdict, dataclass, field

from kvviz.cache.ledger import KEPT
from kvviz.engine.session import PromptSession, capture_for
from kvviz.methods import parse_spec
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.replay import Progress
from kvviz.studies.needle import (
    MODES,
    build_needle_prompt,
    filler_for,
    filler_sentences,
    first_token_at,
    needle_eviction,
    span_tokens,
)

TASKS = ("needle", "multikey", "multivalue", "vartrack", "instructions")
PROTECT = ("system", "planted")  # what --protect can name: the system turn, or every planted span (an oracle)
MAX_HOPS = 4
KEYS = 4  # multikey: the asked key plus three distractors
VALUES = 3  # multivalue: values of the one key
NEW_TOKENS = {"needle": 16, "multikey": 16, "multivalue": 32, "vartrack": 32, "instructions": 40}

_KEY_NAMES = ("silver lantern", "copper kettle", "amber window", "violet ribbon", "granite bridge", "cedar chest",
              "ivory compass", "scarlet canoe", "olive notebook", "cobalt whistle", "marble fountain", "bronze anchor",
              "crimson kite", "jade teapot", "linen banner", "pewter bell")
_WORDS = ("banana", "harbor", "violin", "pepper", "glacier", "meadow", "rocket", "saddle", "tunnel", "walnut",
          "orchid", "puzzle")
_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"


@dataclass(frozen=True)
class Instruction:
    """One checkable instruction: its kind, its sentence in the system prompt, and the word or number it names."""

    kind: str
    text: str
    target: str = ""

    def check(self, answer: str) -> bool:
        """Exact check of an answer; an empty answer follows no instruction."""
        answer = answer.strip()
        words = re.findall(r"[A-Za-z0-9']+", answer)
        if not words:
            return False
        letters = [c for c in answer if c.isalpha()]
        if self.kind == "lowercase":
            return all(c.islower() for c in letters)
        if self.kind == "uppercase":
            return all(c.isupper() for c in letters)
        if self.kind == "start_word":
            return words[0].lower() == self.target
        if self.kind == "end_word":
            return words[-1].lower() == self.target
        if self.kind == "mention":
            return self.target in (w.lower() for w in words)
        if self.kind == "number":
            return self.target in words
        raise ValueError(f"unknown instruction kind {self.kind!r}")


def instruction_pool(rng: random.Random) -> list[Instruction]:
    """Three compatible instructions (never both letter cases, never two on the same word) drawn from the seed."""
    start, end, mention = rng.sample(_WORDS, 3)
    case = rng.choice(["lowercase", "uppercase"])
    number = str(rng.randint(100, 999))
    candidates = [
        Instruction(case, f"Write your whole answer in {'lowercase' if case == 'lowercase' else 'capital'} letters "
                          "only."),
        Instruction("start_word", f"Begin your answer with the word '{start}'.", start),
        Instruction("end_word", f"End your answer with the word '{end}'.", end),
        Instruction("mention", f"Mention the word '{mention}' in your answer.", mention),
        Instruction("number", f"Include the number {number} in your answer.", number),
    ]
    return rng.sample(candidates, 3)


@dataclass
class PlantedSpan:
    """A planted statement: what it is for (``role``), its text, and the prompt tokens that carry it."""

    label: str
    role: str  # target (the asked key), distractor, value, hop, instruction, pass key
    text: str
    positions: list[int]


@dataclass
class TailItem:
    """One generated prompt with what it plants and what a correct answer must hold."""

    item_id: str
    task: str
    hops: int  # vartrack: assignments in the chain; 0 for the other tasks
    length: int
    depth: float
    trial: int
    ids: list[int]
    question_start: int  # index in ids where the question (then the answer's scaffold) starts
    context_start: int  # index in ids where the user's text starts: before it the template header and system turn
    spans: list[PlantedSpan]
    expected: list[str]  # values the answer must contain (all of them); empty for instructions
    instructions: list[Instruction] = field(default_factory=list)
    answer_prefix: str = ""

    @property
    def label(self) -> str:
        return task_label(self.task, self.hops)

    def protect_spans(self, name: str) -> list[tuple[int, int]]:
        """Token spans ``[start, end)`` that ``--protect NAME`` marks."""
        if name == "system":
            return [(0, self.context_start)]
        if name == "planted":
            return [(p, p + 1) for span in self.spans for p in span.positions]
        raise ValueError(f"unknown protection {name!r}; choose {' or '.join(PROTECT)}")

    def score(self, answer: str) -> dict[str, bool]:
        """Exact checks, one per expected value or per instruction (keyed by what it checks)."""
        if self.instructions:
            return {f"{i + 1}:{inst.kind}": inst.check(answer) for i, inst in enumerate(self.instructions)}
        return {value: value in answer for value in self.expected}


def task_label(task: str, hops: int) -> str:
    return f"vartrack k={hops}" if task == "vartrack" else task


@dataclass
class _Plant:
    label: str
    role: str
    text: str
    depth: float | None  # None: a sentence of the system prompt


def _five_digits(rng: random.Random, count: int) -> list[str]:
    values: list[str] = []
    while len(values) < count:
        value = str(rng.randint(10000, 99999))
        if value not in values:
            values.append(value)
    return values


def _spread(depth: float, count: int) -> list[float]:
    """``count`` depths starting at ``depth`` and evenly spread around the context (wrapping past the end)."""
    return [round((depth + i / count) % 1.0, 4) for i in range(count)]


def _chain_depths(depth: float, count: int) -> list[float]:
    """``count`` depths in reading order from ``depth`` to the end (a chain read front to back)."""
    return [round(depth + i * (1.0 - depth) / count, 4) for i in range(count)]


def _layout(task: str, rng: random.Random, depth: float, hops: int):
    """What a task plants and asks: (system sentences, plants, preface, question, answer prefix, expected, instr.)."""
    if task == "multikey":
        names = rng.sample(_KEY_NAMES, KEYS)
        values = _five_digits(rng, KEYS)
        plants = [_Plant(f"key '{name}'" + (" (asked)" if i == 0 else " (distractor)"),
                         "target" if i == 0 else "distractor",
                         f"The special magic number for the {name} is {value}.", d)
                  for i, (name, value, d) in enumerate(zip(names, values, _spread(depth, KEYS), strict=True))]
        return ([], plants, "Special magic numbers for different objects are hidden in the text below. "
                "Remember them: I will ask for one.", f"What is the special magic number for the {names[0]}?",
                f"The special magic number for the {names[0]} is", [values[0]], [])
    if task == "multivalue":
        name = rng.choice(_KEY_NAMES)
        values = _five_digits(rng, VALUES)
        plants = [_Plant(f"value {i + 1}", "value", f"One of the special magic numbers for the {name} is {value}.", d)
                  for i, (value, d) in enumerate(zip(values, _spread(depth, VALUES), strict=True))]
        return ([], plants, f"Several special magic numbers for the {name} are hidden in the text below. Remember "
                "all of them.", f"What are all the special magic numbers for the {name}?",
                f"The special magic numbers for the {name} are", values, [])
    if task == "vartrack":
        names: list[str] = []
        while len(names) < hops:
            name = "".join(rng.choice(_LETTERS) for _ in range(3))
            if name not in names:
                names.append(name)
        value = _five_digits(rng, 1)[0]
        sources = [value, *names[:-1]]
        plants = [_Plant(f"hop {i + 1}: {name} = {source}", "hop", f"VAR {name} = {source}.", d)
                  for i, (name, source, d) in enumerate(zip(names, sources, _chain_depths(depth, hops), strict=True))]
        return ([], plants, "Variable assignments are hidden in the text below. A variable set to another variable "
                "copies its value.", f"Follow the chain of assignments: what is the value of VAR {names[-1]}?",
                f"Following the chain: VAR {names[-1]} =", [value], [])
    if task == "instructions":
        rules = instruction_pool(rng)
        system = [_Plant(f"instruction {i + 1}: {rule.kind}", "instruction", rule.text, None)
                  for i, rule in enumerate(rules)]
        return (system, [], "Read the text below.", "In one sentence, what is the text about?", "", [], rules)
    raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")


def build_item(tokenizer, task: str, length: int, depth: float, seed: int = 0, trial: int = 0,
               hops: int = 0) -> TailItem:
    """One prompt of at most ``length`` tokens for ``task``, deterministic in (task, hops, seed, trial).

    Filler comes from the same seeded stream as the needle, so a shorter prompt is a prefix of a longer one and
    items differ only in length and depth. ValueError when ``length`` cannot hold the task.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tail tasks need a chat model (the instructions live in its system turn)")
    if task == "needle":
        prompt = build_needle_prompt(tokenizer, length, depth, seed, trial, chat=True)
        span = PlantedSpan("pass key", "pass key", f"{prompt.key} ... {prompt.key}", prompt.needle_positions)
        return TailItem(f"needle:{length}:{depth:g}:{trial}", "needle", 0, length, depth, trial, prompt.ids,
                        prompt.question_start, prompt.context_start, [span], [prompt.key])
    if task == "vartrack" and not 1 <= hops <= MAX_HOPS:
        raise ValueError(f"vartrack hops must lie between 1 and {MAX_HOPS}")
    rng = random.Random(f"kvviz-tail:{task}:{hops}:{seed}:{trial}")
    system, plants, preface, question, answer_prefix, expected, rules = _layout(task, rng, depth, hops)
    stream = filler_sentences(random.Random(f"kvviz-tail-filler:{seed}:{trial}"))
    system_text = " ".join(["Follow these rules in every answer.", *(p.text for p in system)]) if system else None

    def render(filler: list[str]) -> tuple[str, list[tuple[_Plant, int]], int, int]:
        """The prompt text, each plant with its first character, and where the user's text and question start."""
        cuts = sorted(((round(p.depth * len(filler)), order, p) for order, p in enumerate(plants)),
                      key=lambda c: (c[0], c[1]))
        pieces: list[str | _Plant] = list(filler)
        for cut, _, plant in reversed(cuts):
            pieces.insert(cut, plant)
        context, located = "", []
        for piece in pieces:
            context += " " if context else ""
            if isinstance(piece, _Plant):
                located.append((piece, len(context)))
                context += piece.text
            else:
                context += piece
        body = f"{preface}\n\n{context}\n\n"
        messages = ([{"role": "system", "content": system_text}] if system_text else []) + [
            {"role": "user", "content": body + question}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + answer_prefix
        body_start = text.index(body)
        placed = [(plant, body_start + len(preface) + 2 + at) for plant, at in located]
        if system_text:
            system_start = text.index(system_text)
            placed += [(plant, system_start + system_text.index(plant.text)) for plant in system]
        return text, placed, body_start, body_start + len(body)

    filler = filler_for(tokenizer, render([])[0], length, stream, task)
    while True:  # the per-sentence count is an estimate; trim until the whole prompt fits
        text, placed, context_char, question_char = render(filler)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if len(encoded["input_ids"]) <= length or not filler:
            break
        filler.pop()
    offsets = encoded["offset_mapping"]
    spans = [PlantedSpan(plant.label, plant.role, plant.text, span_tokens(offsets, [(at, at + len(plant.text))]))
             for plant, at in sorted(placed, key=lambda p: p[1])]
    item_id = f"{task_label(task, hops)}:{length}:{depth:g}:{trial}"
    return TailItem(item_id, task, hops, length, depth, trial, list(encoded["input_ids"]),
                    first_token_at(offsets, question_char), first_token_at(offsets, context_char), spans, expected,
                    rules, answer_prefix)


@dataclass
class SpanFate:
    """What a method's cache did to one planted span: evicted from some layer and head or not, when, where."""

    label: str
    role: str
    evicted: bool
    evicted_step: int | None  # earliest eviction of any of its tokens (0 = prefill compression)
    evicted_layers: list[int]


@dataclass
class TailCell:
    """One method (with or without protection) on one calibrated item.

    ``checks``: each expected value or instruction with whether the answer met it (for ``instructions`` only the
    instructions the full cache followed). ``score``: the share of checks met for ``instructions``, else 1.0 when all
    are met. ``cause`` of a failure: ``evicted`` (a planted span the answer needed left the cache), ``quantization``
    (nothing planted was evicted and the stack quantizes), ``not evicted`` (the planted tokens all stayed: the
    method lost something else). ``evicted_share``: for failures, per prompt token the share of (layer, KV head)
    entries evicted by the end (what the page marks).
    """

    item_id: str
    task: str
    hops: int
    length: int
    depth: float
    trial: int
    mode: str
    method: str  # the SPEC's label, with " [protect NAME]" when protected
    spec: str
    protect: str
    answer: str
    checks: dict[str, bool]
    score: float
    correct: bool
    cause: str
    lost: list[str]  # labels of the planted spans evicted from some layer and KV head
    spans: list[SpanFate]
    prompt_tokens: int
    kv_bytes: int
    evicted_share: list[float] | None = None

    @property
    def label(self) -> str:
        return task_label(self.task, self.hops)


@dataclass
class TailReport:
    """Calibrated cells of every method on every item; ``calibration`` says what was generated and kept per task."""

    cells: list[TailCell]
    calibration: list[dict]
    items: list[TailItem]
    seconds: float = 0.0
    settings: dict = field(default_factory=dict)

    def to_frame(self):
        """One row per cell, with a ``task_label`` column (``vartrack k=2``) and the lost spans joined."""
        import pandas as pd

        rows = [asdict(c) | {"task_label": c.label} for c in self.cells]
        return pd.DataFrame(rows, columns=[*TailCell.__dataclass_fields__, "task_label"])

    def summary(self) -> list[dict]:
        """Per task (label) and method: items kept, accuracy (mean score), and how many failures had evictions."""
        groups: dict[tuple, list[TailCell]] = {}
        for cell in self.cells:
            groups.setdefault((cell.label, cell.method), []).append(cell)
        return [{"task": task, "method": method, "items": len(cells),
                 "accuracy": round(sum(c.score for c in cells) / len(cells), 4),
                 "failures": sum(not c.correct for c in cells),
                 "failures_evicted": sum(c.cause == "evicted" for c in cells)}
                for (task, method), cells in groups.items()]

    def to_json(self) -> dict:
        return {"settings": self.settings, "seconds": round(self.seconds, 3), "calibration": self.calibration,
                "summary": self.summary(), "cells": [asdict(c) for c in self.cells],
                "items": [asdict(i) for i in self.items]}


def span_fates(ledger, spans: list[PlantedSpan]) -> list[SpanFate]:
    """Each planted span's fate from a method's eviction ledger (None: nothing was ever evicted)."""
    fates = []
    for span in spans:
        survived, step, layers = needle_eviction(ledger, span.positions)
        fates.append(SpanFate(span.label, span.role, not survived, step, layers))
    return fates


def failure_cause(item: TailItem, checks: dict[str, bool], fates: list[SpanFate], quantized: bool) -> str:
    """Why a failed cell failed, from the spans its failed checks needed (see :class:`TailCell`)."""
    needed = {f.label for f in fates if f.role in ("target", "value", "hop", "pass key")}
    if item.instructions:
        failed = {int(key.split(":")[0]) for key, ok in checks.items() if not ok}
        needed = {f.label for f in fates if f.role == "instruction" and int(f.label.split()[1].rstrip(":")) in failed}
    if any(f.evicted for f in fates if f.label in needed):
        return "evicted"
    return "quantization" if quantized else "not evicted"


def _evicted_share(ledger, length: int) -> list[float]:
    table = ledger.evicted_at[..., :length]
    return [round(v, 3) for v in (table != KEPT).float().mean(dim=(0, 1)).tolist()]


def generate_items(tokenizer, tasks: list[str], lengths: list[int], depths: list[float], hops: list[int],
                   trials: int = 1, seed: int = 0) -> list[TailItem]:
    """Every item of a run, in order: task, hop count, trial, length, depth (``instructions`` ignores depth)."""
    items = []
    for task in tasks:
        for hop in hops if task == "vartrack" else [0]:
            for trial in range(trials):
                for length in lengths:
                    for depth in [0.0] if task == "instructions" else depths:
                        items.append(build_item(tokenizer, task, length, depth, seed, trial, hop))
    return items


def run_tail(
    loaded: LoadedModel,
    specs: list[str],
    tasks: list[str],
    lengths: list[int],
    depths: list[float],
    hops: list[int] | None = None,
    trials: int = 1,
    seed: int = 0,
    mode: str = "query_aware",
    protect: list[str] | None = None,
    progress: Progress | None = None,
) -> TailReport:
    """Calibrate every item on ``full``, then run every method (and, for each ``protect`` name, every eviction
    method again with those spans protected) on the items full got right.

    One prefill per item is shared by all methods. ValueError (SpecError included) for bad arguments, before any
    model work.
    """
    hops = list(hops or range(1, MAX_HOPS + 1))
    protect = list(protect or [])
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose {' or '.join(MODES)}")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"unknown task(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(TASKS)}")
    if not specs or not lengths or not depths:
        raise ValueError("the tail run needs at least one method, one length and one depth")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError("depths must lie between 0 and 1")
    if any(not 1 <= h <= MAX_HOPS for h in hops):
        raise ValueError(f"vartrack hops must lie between 1 and {MAX_HOPS}")
    if any(name not in PROTECT for name in protect):
        raise ValueError(f"unknown protection {', '.join(protect)}; choose from {', '.join(PROTECT)}")
    if trials < 1:
        raise ValueError("trials must be at least 1")
    stacks = [parse_spec(spec) for spec in specs]
    stacks = [parse_spec("full")] + [s for s in stacks if s.label != "full"]
    runs = [(stack, "") for stack in stacks]
    runs += [(stack, name) for name in protect for stack in stacks if stack.label != "full"
             and stack.eviction is not None]
    capture = capture_for(stacks)
    items = generate_items(loaded.tokenizer, tasks, lengths, depths, hops, trials, seed)
    agnostic = mode == "query_agnostic"
    started = time.perf_counter()
    cells: list[TailCell] = []
    kept: dict[str, list[int]] = {}  # task label -> [generated, kept] (instructions: counted per instruction)
    with loaded.lock:
        for number, item in enumerate(items):
            context = item.ids[: item.question_start] if agnostic else item.ids
            suffix = item.ids[item.question_start:] if agnostic else None
            session = PromptSession(loaded, context)
            session.prefill(capture)
            count = kept.setdefault(item.label, [0, 0])
            calibrated: set[str] | None = None
            for index, (stack, name) in enumerate(runs):
                if progress is not None:
                    progress((number + index / len(runs)) / len(items),
                             f"{item.label}, {item.length} tokens: {stack.label}{' protected' if name else ''}")
                result, _ = session.run(stack, NEW_TOKENS[item.task], suffix_tokens=suffix,
                                        protect=item.protect_spans(name) if name else None)
                checks = item.score(result.text)
                if calibrated is None:  # full runs first: it decides what counts
                    calibrated = {key for key, ok in checks.items() if ok} if item.instructions else (
                        set(checks) if all(checks.values()) else set())
                    count[0] += len(checks) if item.instructions else 1
                    count[1] += len(calibrated) if item.instructions else int(bool(calibrated))
                    if not calibrated:
                        break
                checks = {key: ok for key, ok in checks.items() if key in calibrated}
                correct = all(checks.values())
                score = sum(checks.values()) / len(checks) if item.instructions else float(correct)
                fates = span_fates(result.ledger, item.spans)
                cause = "" if correct else failure_cause(item, checks, fates, stack.quantization is not None)
                share = (_evicted_share(result.ledger, len(context))
                         if not correct and result.ledger is not None else None)
                cells.append(TailCell(
                    item.item_id, item.task, item.hops, item.length, item.depth, item.trial, mode,
                    stack.label + (f" [protect {name}]" if name else ""), stack.label, name, result.text, checks,
                    round(score, 4), correct, cause, [f.label for f in fates if f.evicted], fates, len(item.ids),
                    result.kv_bytes, share))
    if progress is not None:
        progress(1.0, "done")
    calibration = [{"task": label, "generated": g, "kept": k,
                    "unit": "instructions" if label == "instructions" else "items"} for label, (g, k) in kept.items()]
    settings = {"model": loaded.name, "methods": [s.label for s in stacks], "tasks": tasks, "lengths": lengths,
                "depths": depths, "hops": hops, "trials": trials, "seed": seed, "mode": mode, "protect": protect}
    return TailReport(cells, calibration, items, time.perf_counter() - started, settings)

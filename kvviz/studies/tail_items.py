"""The tail tasks' items: prompts of a chosen length that plant statements at chosen depths and say what a correct
answer holds (:mod:`kvviz.studies.tail` runs them; the task families are described there).

Every planted span is recorded as token positions, so the ledger can later say whether a method evicted it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvviz.comparison.session import PromptError
from kvviz.studies.needle import build_needle_prompt, filler_for, filler_sentences, first_token_at, span_tokens

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


def check_hops(hops: list[int]) -> None:
    """PromptError unless every vartrack chain length lies between 1 and :data:`MAX_HOPS`."""
    if any(not 1 <= h <= MAX_HOPS for h in hops):
        raise PromptError(f"vartrack hops must lie between 1 and {MAX_HOPS}")


def task_label(task: str, hops: int) -> str:
    return f"vartrack k={hops}" if task == "vartrack" else task


@dataclass
class Plant:
    """A statement a task plants: in the user's text at ``depth``, or in the system prompt (``depth`` None)."""

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


@dataclass
class TaskLayout:
    """What a task plants and asks: sentences of the system prompt, statements planted in the user's text, the text
    before them, the question, the start of the answer, the values a correct answer holds (all of them) and the
    instructions it must follow."""

    system: list[Plant]
    plants: list[Plant]
    preface: str
    question: str
    answer_prefix: str
    expected: list[str]
    instructions: list[Instruction]


def _layout(task: str, rng: random.Random, depth: float, hops: int) -> TaskLayout:
    """The layout of one ``task`` item drawn from ``rng``, planting from ``depth`` (``hops`` assignments for
    vartrack)."""
    if task == "multikey":
        names = rng.sample(_KEY_NAMES, KEYS)
        values = _five_digits(rng, KEYS)
        plants = [Plant(f"key '{name}'" + (" (asked)" if i == 0 else " (distractor)"),
                         "target" if i == 0 else "distractor",
                         f"The special magic number for the {name} is {value}.", d)
                  for i, (name, value, d) in enumerate(zip(names, values, _spread(depth, KEYS), strict=True))]
        return TaskLayout([], plants, "Special magic numbers for different objects are hidden in the text below. "
                          "Remember them: I will ask for one.", f"What is the special magic number for the {names[0]}?",
                          f"The special magic number for the {names[0]} is", [values[0]], [])
    if task == "multivalue":
        name = rng.choice(_KEY_NAMES)
        values = _five_digits(rng, VALUES)
        plants = [Plant(f"value {i + 1}", "value", f"One of the special magic numbers for the {name} is {value}.", d)
                  for i, (value, d) in enumerate(zip(values, _spread(depth, VALUES), strict=True))]
        return TaskLayout([], plants, f"Several special magic numbers for the {name} are hidden in the text below. "
                          "Remember all of them.", f"What are all the special magic numbers for the {name}?",
                          f"The special magic numbers for the {name} are", values, [])
    if task == "vartrack":
        names: list[str] = []
        while len(names) < hops:
            name = "".join(rng.choice(_LETTERS) for _ in range(3))
            if name not in names:
                names.append(name)
        value = _five_digits(rng, 1)[0]
        sources = [value, *names[:-1]]
        plants = [Plant(f"hop {i + 1}: {name} = {source}", "hop", f"VAR {name} = {source}.", d)
                  for i, (name, source, d) in enumerate(zip(names, sources, _chain_depths(depth, hops), strict=True))]
        return TaskLayout([], plants, "Variable assignments are hidden in the text below. A variable set to another "
                          "variable copies its value.",
                          f"Follow the chain of assignments: what is the value of VAR {names[-1]}?",
                          f"Following the chain: VAR {names[-1]} =", [value], [])
    if task == "instructions":
        rules = instruction_pool(rng)
        system = [Plant(f"instruction {i + 1}: {rule.kind}", "instruction", rule.text, None)
                  for i, rule in enumerate(rules)]
        return TaskLayout(system, [], "Read the text below.", "In one sentence, what is the text about?", "", [], rules)
    raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")


def build_item(tokenizer, task: str, length: int, depth: float, seed: int = 0, trial: int = 0,
               hops: int = 0) -> TailItem:
    """One prompt of at most ``length`` tokens for ``task``, deterministic in (task, hops, seed, trial).

    Filler comes from the same seeded stream as the needle, so a shorter prompt is a prefix of a longer one and
    items differ only in length and depth. PromptError when ``length`` cannot hold the task.
    """
    chat = bool(getattr(tokenizer, "chat_template", None))  # a base model reads the same turns as plain text
    if task == "needle":
        prompt = build_needle_prompt(tokenizer, length, depth, seed, trial, chat=chat)
        span = PlantedSpan("pass key", "pass key", f"{prompt.key} ... {prompt.key}", prompt.needle_positions)
        return TailItem(f"needle:{length}:{depth:g}:{trial}", "needle", 0, length, depth, trial, prompt.ids,
                        prompt.question_start, prompt.context_start, [span], [prompt.key])
    if task == "vartrack":
        check_hops([hops])
    rng = random.Random(f"kvviz-tail:{task}:{hops}:{seed}:{trial}")
    layout = _layout(task, rng, depth, hops)
    system, plants, preface, question = layout.system, layout.plants, layout.preface, layout.question
    stream = filler_sentences(random.Random(f"kvviz-tail-filler:{seed}:{trial}"))
    system_text = " ".join(["Follow these rules in every answer.", *(p.text for p in system)]) if system else None

    def render(filler: list[str]) -> tuple[str, list[tuple[Plant, int]], int, int]:
        """The prompt text, each plant with its first character, and where the user's text and question start."""
        cuts = sorted(((round(p.depth * len(filler)), order, p) for order, p in enumerate(plants)),
                      key=lambda c: (c[0], c[1]))
        pieces: list[str | Plant] = list(filler)
        for cut, _, plant in reversed(cuts):
            pieces.insert(cut, plant)
        context, located = "", []
        for piece in pieces:
            context += " " if context else ""
            if isinstance(piece, Plant):
                located.append((piece, len(context)))
                context += piece.text
            else:
                context += piece
        body = f"{preface}\n\n{context}\n\n"
        if chat:
            messages = ([{"role": "system", "content": system_text}] if system_text else []) + [
                {"role": "user", "content": body + question}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            text += layout.answer_prefix
        else:  # no template: the system's rules, the text, the question, and the answer's first words on a new line
            text = (f"{system_text}\n\n" if system_text else "") + body + question + "\n" + layout.answer_prefix
        body_start = text.index(body)
        placed = [(plant, body_start + len(preface) + 2 + at) for plant, at in located]
        if system_text:
            system_start = text.index(system_text)
            placed += [(plant, system_start + system_text.index(plant.text)) for plant in system]
        return text, placed, body_start, body_start + len(body)

    filler = filler_for(tokenizer, render([])[0], length, stream, task)
    while True:  # the per-sentence count is an estimate; trim until the whole prompt fits
        text, placed, context_char, question_char = render(filler)
        encoded = tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=True)  # a template has its BOS
        if len(encoded["input_ids"]) <= length or not filler:
            break
        filler.pop()
    offsets = encoded["offset_mapping"]
    spans = [PlantedSpan(plant.label, plant.role, plant.text, span_tokens(offsets, [(at, at + len(plant.text))]))
             for plant, at in sorted(placed, key=lambda p: p[1])]
    item_id = f"{task_label(task, hops)}:{length}:{depth:g}:{trial}"
    return TailItem(item_id, task, hops, length, depth, trial, list(encoded["input_ids"]),
                    first_token_at(offsets, question_char), first_token_at(offsets, context_char), spans,
                    layout.expected, layout.instructions, layout.answer_prefix)


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


def stream_items(tokenizer, task: str, length: int, indices: Sequence[int], seed: int = 0) -> list[TailItem]:
    """Items ``indices`` of ``task``'s endless stream under ``seed``: item i is its own trial (its own key, values and
    filler) at a depth drawn uniformly for it, and vartrack's item i has 1 or 2 hops at random. Each item depends on
    its index and the seed alone, never on how many are asked for, so a sweep can add items later and every
    configuration and run scores the same ones; drawn independently, the items are the independent units the
    sweep's tests assume."""
    items = []
    for index in indices:
        draw = random.Random(f"kvviz-stream:{task}:{seed}:{index}")
        depth = round(min(0.9999, max(0.0001, draw.random())), 4)
        items.append(build_item(tokenizer, task, length, depth, seed, index,
                                1 + draw.randrange(2) if task == "vartrack" else 0))
    return items


def item_from_id(tokenizer, item_id: str, seed: int = 0) -> TailItem:
    """The item named ``item_id`` (``task[ k=hops]:length:depth:trial``, as every item's ``item_id`` reads) under
    ``seed``, rebuilt exactly: how a sweep's item opens again on its own. PromptError for an id that names none."""
    try:
        label, length, depth, trial = item_id.rsplit(":", 3)
        task, _, hops = label.partition(" k=")
        item = build_item(tokenizer, task, int(length), float(depth), seed, int(trial), int(hops or 0))
    except (ValueError, KeyError) as error:
        if isinstance(error, PromptError):
            raise
        raise PromptError(f"'{item_id}' names no task item (expected task:length:depth:trial, such as "
                          "needle:512:0.25:0)") from None
    if item.item_id != item_id:
        raise PromptError(f"'{item_id}' names no task item; the nearest is '{item.item_id}'")
    return item

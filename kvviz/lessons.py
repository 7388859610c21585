"""The Lessons page's calibrated material: prompts, method settings and the answers the full cache gives.

Each live step runs one :class:`LessonRun`. The settings were measured on the default model (SmolLM2-135M-Instruct,
CPU, greedy): the full cache answers each question correctly within ``max_new_tokens`` (tests/test_lessons.py runs
every reference and checks ``expected``), and the other methods produce the contrast the step teaches. Another
model may answer differently; the page then says so instead of presenting a wrong reference as right.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlencode

from kvviz.comparison.session import encode_prompt
from kvviz.planning.memory import model_card
from kvviz.runs import AttentionRequest, CompareRequest, RunRequest
from kvviz.runtime.models import LoadedModel
from kvviz.studies.needle import NeedlePrompt, build_needle_prompt
from kvviz.studies.three_axes import budget_specs

STORY = (
    "Every autumn the village of Hallow Creek holds a pumpkin contest. This year the judges were a baker, a "
    "retired sailor and the school's music teacher. The baker liked the round orange pumpkins, the sailor liked "
    "the ones shaped like boats, and the music teacher liked a small white pumpkin that a girl named Ines had "
    "painted with musical notes. After a long argument the judges gave first prize to Ines."
)
QUESTION = "Who won first prize?"
NEEDLE_CODE = "7319"
NEEDLE = (f"Remember this: the locker code is {NEEDLE_CODE}. ",
          "What is the locker code? Answer with the number only.")
FILLER = ("The hallway was painted pale green and smelled of floor polish. Students walked past the trophy case "
          "on their way to class, talking about football and the weather. ")


@dataclass(frozen=True)
class LessonRun:
    """One step's live run: a prompt, the methods compared with the full cache, and the reference answer."""

    prompt: str
    specs: tuple[str, ...] = ("full",)
    max_new_tokens: int = 32
    chat: bool = True
    expected: str | None = None  # what the full cache's answer must contain for the step to make its point
    page: str = "Compare"  # where the link "same settings elsewhere" goes
    extra: dict = field(default_factory=dict)  # further URL settings for that page

    def token_ids(self, tokenizer) -> list[int]:
        return encode_prompt(tokenizer, self.prompt, chat=self.chat)

    def request(self, token_ids: list[int]) -> CompareRequest:
        """The comparison the step runs on the prompt's ``token_ids``."""
        return CompareRequest(tuple(token_ids), self.specs, self.max_new_tokens)

    def link(self) -> str:
        """The URL path and query that open ``page`` with this run's prompt and settings."""
        query = {"prompt": self.prompt, "chat": int(self.chat), **self.extra}
        if self.page == "Compare":
            query |= {"m": list(self.specs), "n": self.max_new_tokens}
        return f"{self.page}?{urlencode(query, doseq=True)}"


SINKS = 4  # steps 3 and 4: the first tokens, measured as sinks (step 4 leaves them out of its colour scale)
STORY_QUESTION = f"{STORY}\n\n{QUESTION}"
RUNS: dict[str, LessonRun] = {
    # Step 1: the full cache alone; its growth per step is the formula's slope.
    "cost": LessonRun(STORY_QUESTION, expected="Ines"),
    # Step 2: one lever of each kind at roughly a third of the bytes: SnapKV keeps 30% of the prompt's tokens,
    # KIVI keeps every token in 2 bits (keys per channel, values per token, groups of 32; no full-precision residual).
    "levers": LessonRun(STORY_QUESTION, ("full", "snapkv:budget=0.3", "kivi:residual=0"), expected="Ines"),
    # Step 3: the same 40-token budget without and with the 4 sink tokens.
    "sinks": LessonRun(STORY_QUESTION, ("full", "window:window=40", "streaming_llm:window=36"), expected="Ines"),
    # Step 4: attention on the story itself (no template, no question).
    "heavy": LessonRun(STORY, chat=False, page="Attention", extra={"sinks": SINKS}),
    # Step 5: a code near the start, filler, the question at the end; eviction at a fixed 32-token budget.
    "needle": LessonRun(NEEDLE[0] + FILLER * 6 + NEEDLE[1],
                        ("full", "streaming_llm:window=32", "snapkv:budget=32,window=16", "h2o:heavy=16,recent=16"),
                        max_new_tokens=16, expected=NEEDLE_CODE),
}
AXES_PROMPT_TOKENS, AXES_DEPTH, AXES_NEW_TOKENS = 384, 0.5, 12  # step 6: "The pass key is NNNNN"


def attention_request(loaded: LoadedModel, token_ids: list[int], every_layer: bool = False) -> AttentionRequest:
    """Steps 3 and 4: sink mass in every layer and the middle layer's attention (``every_layer``: the attention each
    token receives in every layer too, for the heavy hitters)."""
    return AttentionRequest(tuple(token_ids), model_card(loaded).layers // 2, SINKS, every_layer)


@dataclass(frozen=True)
class AxesRun:
    """Step 6: a pass-key prompt and one SPEC per axis (heads, latent, tokens, bits) at the same share of bytes."""

    prompt: NeedlePrompt
    axes: dict[str, str]

    def request(self) -> CompareRequest:
        return CompareRequest(tuple(self.prompt.ids), ("full", *self.axes.values()), AXES_NEW_TOKENS)


def axes_run(loaded: LoadedModel, share: float) -> AxesRun:
    return AxesRun(build_needle_prompt(loaded.tokenizer, AXES_PROMPT_TOKENS, AXES_DEPTH),
                   budget_specs(model_card(loaded), share))


def step_requests(loaded: LoadedModel, share: float = 1 / 3) -> dict[str, tuple[RunRequest, ...]]:
    """The engine runs behind each live step, in the page's order (step 6 at the share its slider starts at): what
    the page runs and stores, so the bench can time a step on any device without a browser."""
    def ids(key: str) -> list[int]:
        return RUNS[key].token_ids(loaded.tokenizer)

    return {
        "cost": (RUNS["cost"].request(ids("cost")),),
        "levers": (RUNS["levers"].request(ids("levers")),),
        "sinks": (attention_request(loaded, ids("sinks")), RUNS["sinks"].request(ids("sinks"))),
        "heavy": (attention_request(loaded, ids("heavy"), every_layer=True),),
        "needle": (RUNS["needle"].request(ids("needle")),),
        "axes": (axes_run(loaded, share).request(),),
    }


def span_of(tokenizer, token_ids: list[int], text: str) -> list[int]:
    """Positions of the shortest run of tokens whose decoded text contains ``text`` (e.g. the needle's digits)."""
    pieces = [tokenizer.decode([i]) for i in token_ids]
    for end in range(len(pieces)):
        if text in "".join(pieces[: end + 1]):
            start = end
            while text not in "".join(pieces[start: end + 1]):
                start -= 1
            return list(range(start, end + 1))
    return []


FUNCTION_WORDS = frozenset(
    "a an the of to in on at by for and or but with as is was were be been that this it its his her their he she they "
    "we you i who which what when where there then than so if not no from into".split())


def is_filler_token(token: str) -> bool:
    """Punctuation, whitespace or a function word: tokens that carry little of the story's content."""
    word = token.strip().lower()
    return not word or not any(ch.isalnum() for ch in word) or word in FUNCTION_WORDS

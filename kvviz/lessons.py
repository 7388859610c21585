"""The Lessons page's calibrated material: prompts, method settings and the answers the full cache gives.

Each live step runs one :class:`LessonRun`. The settings were measured on the default model (SmolLM2-135M-Instruct,
CPU, greedy): the full cache answers each question correctly within ``max_new_tokens`` (tests/test_lessons.py runs
every reference and checks ``expected``), and the other methods produce the contrast the step teaches. Another
model may answer differently; the page then says so instead of presenting a wrong reference as right.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlencode

from kvviz.comparison.results import Comparison
from kvviz.comparison.session import encode_prompt
from kvviz.planning.memory import ModelCard, model_card
from kvviz.planning.planner import Plan, kv_bytes_per_sequence
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
        return encode_prompt(tokenizer, self.prompt, chat=self.chat_on(tokenizer))

    def chat_on(self, tokenizer) -> bool:
        """The step's chat setting where the model has a chat template; a base model reads the prompt as plain
        text (what :data:`BASE_MODEL_NOTE` tells the class)."""
        return self.chat and bool(getattr(tokenizer, "chat_template", None))

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
BASE_MODEL_NOTE = (
    "This model is a base model: it has no chat template, so every step's prompt runs as plain text and the model "
    "continues it rather than answering a user turn. The steps were calibrated on SmolLM2-135M-Instruct: where the "
    "full cache does not give the calibrated answer here, the step says so, and its contrast may not show.")

# Step 7: one 2K-token pass-key prompt on each embedded model; full against one eviction at a fixed token budget,
# measured, then projected to a 32K context with the per-layer-type formula.
ARCH_PROMPT_TOKENS, ARCH_PROJECTED, ARCH_BUDGET, ARCH_NEW_TOKENS = 2048, 32768, 256, 8
ARCH_EVICTION = f"streaming_llm:sinks=4,window={ARCH_BUDGET - 4}"


@dataclass(frozen=True)
class ArchitectureRun:
    """Step 7 on one model: the pass-key prompt (plain text on a base model) and the comparison it runs."""

    prompt: NeedlePrompt

    def request(self) -> CompareRequest:
        return CompareRequest(tuple(self.prompt.ids), ("full", ARCH_EVICTION), ARCH_NEW_TOKENS)


def architecture_run(loaded: LoadedModel) -> ArchitectureRun:
    return ArchitectureRun(build_needle_prompt(loaded.tokenizer, ARCH_PROMPT_TOKENS, 0.5, chat=loaded.chat))


@dataclass(frozen=True)
class ArchitectureFacts:
    """What step 7 shows for one model: its attention and layer types, the bytes full and the eviction held on the
    2K prompt (measured, with the formula beside them), and both projected to 32K tokens by the formula."""

    model: str
    attention: str
    kv_heads: int
    q_heads: int
    layers: str
    tokens: int
    measured_full: int
    formula_full: int
    measured_evicted: int
    formula_evicted: int
    projected_full: int
    projected_evicted: int
    found_full: bool
    found_evicted: bool

    @property
    def saved_now(self) -> float:
        """How many times smaller the eviction's cache is than full's on the measured prompt."""
        return self.measured_full / max(1, self.measured_evicted)

    @property
    def saved_projected(self) -> float:
        return self.projected_full / max(1, self.projected_evicted)


def held_bytes(card: ModelCard, tokens: int, budget: int | None = None) -> int:
    """Bytes the model's cache holds after ``tokens`` tokens, every global layer keeping at most ``budget`` of them
    (None: all) and every local one its window: the formula per layer type, at the model's own element size."""
    return kv_bytes_per_sequence(card, Plan(context=tokens, budget=budget, kv_bits=8 * card.bytes_per_element))


def architecture_curves(card: ModelCard, facts: ArchitectureFacts
                        ) -> tuple[dict[str, tuple[list[int], list[int]]], dict[str, tuple[int, int]]]:
    """Step 7's figure for one model: full and the eviction against context by the formula (256 to 32K tokens), and
    what the run measured, each under ``<model> full`` and ``<model> streaming``."""
    contexts = [2**k for k in range(8, 16)]
    lines, measured = {}, {}
    for label, budget, held in (("full", None, facts.measured_full), ("streaming", ARCH_BUDGET,
                                                                     facts.measured_evicted)):
        lines[f"{facts.model} {label}"] = (contexts, [held_bytes(card, n, budget) for n in contexts])
        measured[f"{facts.model} {label}"] = (facts.tokens, held)
    return lines, measured


def architecture_facts(loaded: LoadedModel, run: ArchitectureRun, comparison: Comparison) -> ArchitectureFacts:
    card = model_card(loaded)
    full, evicted = comparison.results[0], comparison.results[1]
    tokens = full.total_tokens
    return ArchitectureFacts(
        loaded.name, card.attention, card.kv_heads, card.q_heads, card.layer_types.summary(), tokens,
        full.kv_bytes, held_bytes(card, tokens), evicted.kv_bytes, held_bytes(card, tokens, ARCH_BUDGET),
        held_bytes(card, ARCH_PROJECTED), held_bytes(card, ARCH_PROJECTED, ARCH_BUDGET),
        run.prompt.key in full.text, run.prompt.key in evicted.text)


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
        "architecture": (architecture_run(loaded).request(),),
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

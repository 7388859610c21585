"""Any kvpress ScorerPress as a kvviz method: kvpress scores the prompt's entries, kvviz selects and records.

kvpress compresses inside forward hooks and keeps no record of what it dropped. Here only a press's ``score``
function runs (on the prefill inputs kvviz captured), and the top-k selection goes through the cache, so the
ledger shows exactly which tokens each head lost. Press names map to kvpress classes; QFilter is left out because
its filters download from the Hugging Face hub per model.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvviz.cache.protocol import Decode, LayerView, Schedule, ScoringEviction
from kvviz.cache.spec import Param, SpecError, register

PRESSES: dict[str, str] = {
    "snapkv": "SnapKVPress",
    "knorm": "KnormPress",
    "tova": "TOVAPress",
    "expected_attention": "ExpectedAttentionPress",
    "keydiff": "KeyDiffPress",
    "streaming_llm": "StreamingLLMPress",
    "random": "RandomPress",
    "pyramidkv": "PyramidKVPress",
    "lagkv": "LagKVPress",
    "leverage": "LeverageScorePress",
    "cur": "CURPress",
}


class _AttentionModule:
    """The attention module as kvpress expects it after ``press(model)``: with the model's ``rotary_emb`` attached.

    A view rather than an assignment, so the model itself is left untouched.
    """

    def __init__(self, module: torch.nn.Module, rotary_emb: torch.nn.Module | None):
        self._module = module
        self.rotary_emb = rotary_emb

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def removed_share(tokens: int, prompt_length: int) -> str:
    """The compression ratio (share removed) that keeps ``tokens`` of a ``prompt_length``-token prompt, as a SPEC
    value."""
    return f"{max(0.0, 1 - tokens / prompt_length):.4f}"


def kept_count(length: int, ratio: float) -> int:
    """Entries of ``length`` each head keeps at compression ratio ``ratio``: kvpress's ``compute_n_kept`` (at least
    one), and everything at ratio 0, where kvpress's presses return the cache untouched."""
    return length if ratio == 0 else max(1, int(length * (1 - ratio)))


def press_param(help: str, default: str = "snapkv", choices: tuple[str, ...] = tuple(PRESSES)) -> Param:
    """The ``press`` parameter of every kvpress wrapper: the kvpress scorer that ranks the entries."""
    return Param("press", str, default, help, choices=choices)


def scorer_press(state: dict, name: str, **settings):
    """Layer state's kvpress scorer ``name``, built with ``settings`` on first use (kvpress imports slowly; some
    presses keep per-layer settings, so each layer has its own)."""
    if "press" not in state:
        import kvpress

        state["press"] = getattr(kvpress, PRESSES[name])(**settings)
    return state["press"]


@register
class KVPressScorer(ScoringEviction):
    name = "kvpress"
    summary = ("A kvpress ScorerPress (its own scoring function, its default settings) compresses the prompt once; "
               "kvviz keeps the top-scoring entries per KV head and records the rest in the ledger.")
    schedule = Schedule(Decode.NEVER, layer_inputs=True)
    ratio_param: ClassVar[str] = "ratio"  # the parameter holding the share removed (per_layer: ratios)
    params = (
        press_param("kvpress scorer"),
        Param("ratio", float, 0.5, "compression ratio: share of the prompt's entries removed", min=0, max=0.99),
    )

    def new_state(self, layer_idx: int):
        """Holds the layer's press (see :func:`scorer_press`)."""
        return {}

    def press_settings(self) -> dict:
        """What the kvpress scorer is built with (pyramidkv adds its window)."""
        return {"compression_ratio": self.ratio}

    def check_context(self, prompt_length: int) -> None:
        kept = kept_count(prompt_length, self.ratio)
        window = {"snapkv": 64, "pyramidkv": 64}.get(self.press)
        if window is not None and kept < prompt_length and prompt_length <= window:
            raise SpecError(f"kvpress {self.press} needs a prompt longer than its {window}-token window "
                            f"({prompt_length} tokens)")
        if self.press in ("streaming_llm", "lagkv", "cur", "expected_attention") and kept < prompt_length <= 4:
            raise SpecError(f"kvpress {self.press} keeps 4 sink tokens; the prompt has only {prompt_length}")
        if self.press == "streaming_llm" and kept < 5 < prompt_length:
            raise SpecError(f"kvpress streaming_llm at ratio {self.ratio:g} keeps {kept} tokens, fewer than its "
                            "4 sinks + 1")

    def keep_count(self, view: LayerView, stats=None) -> int:
        return self.layer_kept(view.positions.shape[-1], view.layer_idx, view.layers)

    def budget_for(self, prompt_length: int) -> int | None:
        """The uniform share (the mean of the layer-adaptive wrappers' budgets)."""
        return kept_count(prompt_length, self.ratio)

    def layer_budget_for(self, prompt_length: int, layer_idx: int, layers: int) -> int:
        return self.layer_kept(prompt_length, layer_idx, layers)

    @classmethod
    def at_budget(cls, tokens: int, prompt_length: int | None = None) -> KVPressScorer | None:
        """The ratio that keeps ``tokens`` of the prompt, scored by knorm (it reads no observation window, so any
        budget works); None without a prompt length."""
        if not prompt_length:
            return None
        return cls(press="knorm", **{cls.ratio_param: removed_share(tokens, prompt_length)})

    def layer_kept(self, length: int, layer_idx: int, layers: int) -> int:
        """Entries each head of layer ``layer_idx`` of ``layers`` keeps out of ``length``: the same in every layer
        here; the layer-adaptive wrappers (pyramidkv, per_layer) override it."""
        return kept_count(length, self.ratio)

    def prefill_scores(self, view: LayerView, stats) -> torch.Tensor:
        """The press's score of every cached entry, [B, H_kv, T] float32 (higher = keep); wrappers that spread
        budgets over heads or layers (adakv, pyramidkv) read it too."""
        inputs = None if stats is None else stats.layer_inputs.get(view.layer_idx)
        if inputs is None:
            raise SpecError("kvpress scorers need the prefill's layer inputs; run them through PromptSession")
        kwargs = {"position_embeddings": inputs.position_embeddings, "hidden_states": inputs.hidden_states}
        with torch.inference_mode():
            module = _AttentionModule(inputs.module, inputs.rotary_emb)
            press = scorer_press(view.state, self.press, **self.press_settings())
            scores = press.score(module, inputs.hidden_states, view.keys, view.values, None, kwargs)
        heads = view.positions.shape[1]
        if scores.shape[1] != heads:  # an architecture method stores fewer heads: a group's heads vote together
            scores = scores.float().unflatten(1, (heads, -1)).mean(2)
        return scores.float()

"""Which decoder layers attend globally and which over a sliding window, read from a transformers config, and the
architectures kvviz refuses because it cannot run them exactly as the model runs itself.

The config is the model's own truth, read the way transformers' ``DynamicCache(config=...)`` reads it: ``layer_types``
when the config lists them, else every layer sliding when ``sliding_window`` is set (Mistral, Phi-3) and global
otherwise. A *local* layer's query at position p attends to the keys at positions p - window + 1 ... p, so between
forwards it holds at most ``window - 1`` tokens (what ``DynamicSlidingWindowLayer`` keeps); a *global* layer holds
every token. :class:`LayerTypes` is that list of windows; the KV formula, the cache and the pages read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GLOBAL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


class UnsupportedArchitecture(ValueError):
    """A model whose attention or cache kvviz cannot reproduce exactly; the message names the feature."""


@dataclass(frozen=True)
class Refusal:
    """A feature kvviz refuses, how a config or a model shows it, and the model types known to have it."""

    feature: str
    why: str
    examples: tuple[str, ...]


# What kvviz refuses, checked before any weights load (the docs print this list: docs/architecture.md).
REFUSALS = (
    Refusal("chunked local attention", "a chunked layer attends within fixed blocks of tokens, not a window that "
            "slides with the query; kvviz's local layers slide", ("llama4",)),
    Refusal("linear or recurrent layers", "such layers keep a running state instead of keys and values; kvviz's "
            "cache holds only keys and values", ("qwen3_next", "minimax", "jamba", "falcon_h1", "lfm2")),
    Refusal("learned attention sinks", "each head adds a learned logit to its softmax, which kvviz's attention "
            "does not compute", ("gpt_oss",)),
    Refusal("KV shared across layers", "later layers reuse earlier layers' keys and values; kvviz caches every "
            "layer on its own", ("gemma3n",)),
    Refusal("bidirectional attention", "queries see later tokens too; kvviz replays causal decoding",
            ("gemma3 with use_bidirectional_attention",)),
    Refusal("attention outside transformers' AttentionInterface", "kvviz computes attention through that "
            "interface (its model class does not support attention backends)", ("bloom", "mpt", "falcon", "gptj")),
)
_BY_FEATURE = {refusal.feature: refusal for refusal in REFUSALS}
_RECURRENT_MODEL_TYPES = ("qwen3_next", "minimax", "jamba", "falcon_h1", "lfm2", "zamba", "zamba2", "bamba",
                          "granitemoehybrid", "mamba", "mamba2", "rwkv", "recurrent_gemma", "nemotron_h")


def _getter(config: Any) -> Callable[[str], Any]:
    if isinstance(config, dict):
        return lambda key: config.get(key)
    return lambda key: getattr(config, key, None)


def text_config(config: Any) -> Any:
    """The decoder's config: a multimodal config's ``text_config``, or the config itself."""
    get = _getter(config)
    text = get("text_config")
    return text if text is not None and get("num_hidden_layers") is None else config


@dataclass(frozen=True)
class LayerTypes:
    """Per decoder layer: the window of a local (sliding-window) layer, or None for a global one."""

    windows: tuple[int | None, ...]

    @classmethod
    def from_config(cls, config: Any) -> LayerTypes:
        """The layer types a transformers config (or a plain dict of its fields) declares."""
        config = text_config(config)
        get = _getter(config)
        layers = int(get("num_hidden_layers"))
        window = get("sliding_window")
        types = get("layer_types")
        pattern = get("sliding_window_pattern")  # a published Gemma 3 config.json: every n-th layer global
        if types is None and pattern:
            types = [GLOBAL_ATTENTION if (layer + 1) % int(pattern) == 0 else SLIDING_ATTENTION
                     for layer in range(layers)]
        if types is None:
            types = [SLIDING_ATTENTION if window is not None else GLOBAL_ATTENTION] * layers
        if window is None:  # a config listing sliding layers without a window slides nowhere (transformers' masks)
            return cls((None,) * layers)
        return cls(tuple(int(window) if kind == SLIDING_ATTENTION else None for kind in types))

    @classmethod
    def uniform(cls, layers: int) -> LayerTypes:
        """Every layer global (a Llama)."""
        return cls((None,) * layers)

    def __len__(self) -> int:
        return len(self.windows)

    @property
    def local_layers(self) -> int:
        return sum(window is not None for window in self.windows)

    @property
    def global_layers(self) -> int:
        return len(self.windows) - self.local_layers

    @property
    def has_local(self) -> bool:
        return self.local_layers > 0

    @property
    def window(self) -> int | None:
        """The local layers' window (one value in every model kvviz knows), or None without local layers."""
        return next((window for window in self.windows if window is not None), None)

    def held(self, layer_idx: int, tokens: int) -> int:
        """Tokens a layer holds between forwards after ``tokens`` tokens: all of them on a global layer, at most
        ``window - 1`` on a local one (the next query's window includes itself)."""
        window = self.windows[layer_idx]
        return tokens if window is None else min(tokens, window - 1)

    def held_total(self, tokens: int) -> int:
        """Tokens held over every layer (per KV head) after ``tokens`` tokens."""
        return sum(self.held(layer, tokens) for layer in range(len(self.windows)))

    def kind(self, layer_idx: int) -> str:
        """``local 512`` or ``global``: how pages and the ledger name a layer."""
        window = self.windows[layer_idx]
        return "global" if window is None else f"local {window}"

    def labels(self) -> list[str]:
        return [self.kind(layer) for layer in range(len(self.windows))]

    def listing(self) -> str:
        """Which layers are which, in runs: ``local (window 512): 0-4, 6-10, 12-16; global: 5, 11, 17``."""
        parts = []
        for kind in dict.fromkeys(self.labels()):
            layers = [layer for layer, name in enumerate(self.labels()) if name == kind]
            runs, start = [], layers[0]
            for previous, layer in zip(layers, [*layers[1:], None], strict=True):
                if layer != previous + 1:
                    runs.append(f"{start}-{previous}" if previous > start else f"{start}")
                    start = layer
            name = "global" if kind == "global" else f"local (window {kind.split()[1]})"
            parts.append(f"{name}: {', '.join(runs)}")
        return "; ".join(parts)

    def summary(self) -> str:
        """One line: ``15 local (window 512) + 3 global of 18 layers`` or ``30 global layers``."""
        if not self.has_local:
            return f"{len(self.windows)} global layers"
        if not self.global_layers:
            return f"{len(self.windows)} local layers (window {self.window})"
        return (f"{self.local_layers} local (window {self.window}) + {self.global_layers} global of "
                f"{len(self.windows)} layers")


def refusal_for(config: Any, model: Any = None) -> str | None:
    """Why kvviz cannot run this model exactly (the feature named first), or None when it can.

    The model's class (``model``'s, else the one transformers maps the config to) must route attention through
    transformers' AttentionInterface, which kvviz's attention is registered with.
    """
    config = text_config(config)
    get = _getter(config)
    model_type = str(get("model_type") or "")
    types = get("layer_types") or []
    other = sorted({kind for kind in types if kind not in (GLOBAL_ATTENTION, SLIDING_ATTENTION)})
    if "chunked_attention" in other or get("attention_chunk_size"):
        return _say("chunked local attention", model_type)
    if other or model_type in _RECURRENT_MODEL_TYPES:
        return _say("linear or recurrent layers", model_type, f"layer types {', '.join(other)}" if other else "")
    if model_type.startswith("gpt_oss"):
        return _say("learned attention sinks", model_type)
    if get("num_kv_shared_layers"):
        return _say("KV shared across layers", model_type)
    if get("use_bidirectional_attention"):
        return _say("bidirectional attention", model_type)
    model_class = type(model) if model is not None else _causal_lm_class(config)
    if model_class is not None and not getattr(model_class, "_supports_attention_backend", False):
        return _say("attention outside transformers' AttentionInterface", model_type)
    return None


def _causal_lm_class(config: Any) -> type | None:
    """The class transformers would build for a config object (None for a plain dict or an unknown config)."""
    if isinstance(config, dict):
        return None
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping.get(type(config), None)


def _say(feature: str, model_type: str, detail: str = "") -> str:
    refusal = _BY_FEATURE[feature]
    named = f"{model_type or 'this model'}" + (f" ({detail})" if detail else "")
    return f"kvviz cannot run {named} exactly: {feature}: {refusal.why}"


def check_supported(config: Any, model: Any = None) -> None:
    """Raise :class:`UnsupportedArchitecture` naming the feature when kvviz cannot run the model exactly."""
    reason = refusal_for(config, model)
    if reason is not None:
        raise UnsupportedArchitecture(reason)

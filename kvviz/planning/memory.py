"""KV-cache memory: the formula, model cards, and the architecture facts they rest on.

The formula is written per layer type (:mod:`kvviz.cache.layer_types`): a global layer holds every token, a local
(sliding-window) layer at most ``window - 1`` of them between forwards, as transformers' own cache holds them.

    KV_bytes = 2 (K and V) * kv_heads * head_dim * batch * bytes_per_element
               * (global_layers * seq_len + local_layers * min(seq_len, window - 1))

MLA models (DeepSeek-V2/V3) cache one compressed latent per token and layer instead of per-head K and V, so their
per-token size is (kv_lora_rank + qk_rope_head_dim) elements per layer. That is what an MLA kernel (vLLM, SGLang,
DeepSeek's own) holds. transformers' implementation does not: it decompresses the latent and caches per-head keys
(qk_nope_head_dim + qk_rope_head_dim) and values (v_head_dim), which the card reports as ``stored_elements_per_token``
and replay measures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kvviz.cache.layer_types import LayerTypes


def attention_kind(q_heads: int, kv_heads: int, is_mla: bool = False) -> str:
    if is_mla:
        return "MLA"
    if kv_heads == q_heads:
        return "MHA"
    if kv_heads == 1:
        return "MQA"
    return "GQA"


@dataclass
class ModelCard:
    """What a model's architecture means for its KV cache."""

    name: str
    architecture: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    attention: str  # MHA, GQA, MQA or MLA
    sliding_window_layers: int
    sliding_window: int | None
    context_length: int
    vocab_size: int
    dtype: str
    bytes_per_element: int
    weight_bytes: int
    kv_elements_per_token: int  # across all layers, K and V together
    mla_latent_dim: int | None = None
    stored_elements_per_token: int | None = None  # what transformers' cache holds, where it differs (MLA models)
    stored_key_dim: int | None = None  # per-head key and value widths transformers caches, where not head_dim (MLA)
    stored_value_dim: int | None = None
    windows: tuple[int | None, ...] = ()  # per layer: a local layer's window, None for a global one (empty: all)

    @property
    def layer_types(self) -> LayerTypes:
        return LayerTypes(self.windows or (None,) * self.layers)

    @property
    def cached_dims(self) -> tuple[int, int]:
        """Widths of one cached key and one cached value per head (MLA: keys nope + rope, values v_head_dim)."""
        return self.stored_key_dim or self.head_dim, self.stored_value_dim or self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token costs while every layer holds it (inside every window)."""
        return self.kv_elements_per_token * self.bytes_per_element

    @property
    def global_kv_bytes_per_token(self) -> int:
        """Bytes each token past the local layers' window adds: its global layers' share."""
        return self.kv_bytes_per_token * self.layer_types.global_layers // self.layers

    def held_tokens(self, seq_len: int) -> int:
        """Tokens held over all layers (per KV head) after ``seq_len`` tokens: every token on a global layer, at most
        ``window - 1`` on a local one."""
        return self.layer_types.held_total(seq_len)

    def stored_kv_bytes(self, seq_len: int, batch: int = 1) -> int:
        """Bytes transformers' own cache holds for these tokens (the full cache kvviz replays and measures)."""
        elements = self.stored_elements_per_token or self.kv_elements_per_token
        return int(elements // self.layers * self.held_tokens(seq_len) * batch * self.bytes_per_element)

    def kv_bytes(self, seq_len: int, batch: int = 1, bytes_per_element: float | None = None) -> int:
        """KV bytes for ``batch`` sequences of ``seq_len`` tokens (optionally at another element size)."""
        per_element = self.bytes_per_element if bytes_per_element is None else bytes_per_element
        return int(self.kv_elements_per_token // self.layers * self.held_tokens(seq_len) * batch * per_element)

    def formula_text(self, seq_len: int, batch: int = 1) -> str:
        """The formula with this model's numbers substituted, per layer type, as shown on the home page and by
        ``info``."""
        if self.attention == "MLA":
            text = (f"{self.layers} layers * {self.mla_latent_dim} latent * {seq_len} tokens * {batch} * "
                    f"{self.bytes_per_element} B = {self.kv_bytes(seq_len, batch):,} B")
            if self.stored_elements_per_token:
                text += (f"; transformers' cache stores {self.stored_kv_bytes(seq_len, batch):,} B "
                         "(per-head K and V, decompressed)")
            return text
        types = self.layer_types
        per_layer = f"{self.kv_heads} kv_heads * {self.head_dim} head_dim"
        tail = f" * {batch} batch * {self.bytes_per_element} B"
        terms = []
        if types.global_layers:
            terms.append(f"2 * {types.global_layers} {'global ' if types.has_local else ''}layers * {per_layer} * "
                         f"{seq_len} tokens{tail}")
        if types.has_local:
            terms.append(f"2 * {types.local_layers} local layers * {per_layer} * min({seq_len}, {types.window} - 1)"
                         f" tokens{tail}")
        return " + ".join(terms) + f" = {self.kv_bytes(seq_len, batch):,} B"

    def to_dict(self) -> dict:
        data = asdict(self)
        data["kv_bytes_per_token"] = self.kv_bytes_per_token
        data["layer_types"] = self.layer_types.summary()
        return data


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


def card_from_config(name: str, config, dtype: str = "bfloat16", weight_bytes: int = 0) -> ModelCard:
    """Build a card from a transformers config object or a plain dict of its fields."""
    get = (lambda key, default=None: config.get(key, default)) if isinstance(config, dict) else (
        lambda key, default=None: getattr(config, key, default))
    text = get("text_config")
    if text is not None and get("num_hidden_layers") is None:
        return card_from_config(name, text, dtype, weight_bytes)
    layers = int(get("num_hidden_layers"))
    q_heads = int(get("num_attention_heads"))
    kv_heads = int(get("num_key_value_heads") or q_heads)
    head_dim = int(get("head_dim") or get("hidden_size") // q_heads)
    latent = get("kv_lora_rank")
    is_mla = latent is not None
    types = LayerTypes.from_config(config)
    sliding_layers = types.local_layers
    stored = key_dim = value_dim = None
    if is_mla:
        latent_dim = int(latent) + int(get("qk_rope_head_dim") or 0)
        elements = layers * latent_dim
        key_dim = int(get("qk_nope_head_dim") or 0) + int(get("qk_rope_head_dim") or 0)
        value_dim = int(get("v_head_dim") or key_dim)
        stored = layers * kv_heads * (key_dim + value_dim)  # decompressed per-head K and V
    else:
        latent_dim = None
        elements = 2 * layers * kv_heads * head_dim
    return ModelCard(
        name=name,
        architecture=(get("architectures") or [get("model_type") or "unknown"])[0],
        layers=layers,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        attention=attention_kind(q_heads, kv_heads, is_mla),
        sliding_window_layers=sliding_layers,
        sliding_window=types.window,
        context_length=int(get("max_position_embeddings") or 0),
        vocab_size=int(get("vocab_size") or 0),
        dtype=dtype,
        bytes_per_element=_DTYPE_BYTES.get(dtype, 2),
        weight_bytes=weight_bytes,
        kv_elements_per_token=elements,
        mla_latent_dim=latent_dim,
        stored_elements_per_token=stored,
        stored_key_dim=key_dim,
        stored_value_dim=value_dim,
        windows=types.windows if types.has_local else (),
    )


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by parameters and buffers (tied weights counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def model_card(loaded) -> ModelCard:
    """The card of a loaded model (see :class:`kvviz.runtime.models.LoadedModel`)."""
    dtype = str(loaded.dtype).removeprefix("torch.")
    return card_from_config(loaded.name, loaded.config, dtype, model_weight_bytes(loaded.model))

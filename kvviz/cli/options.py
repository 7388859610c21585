"""The options several commands share, and reading them: the model to load, the output flags, files, numbers."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvviz.methods import parse_spec
from kvviz.runtime.cluster import ModelSource
from kvviz.runtime.embedded import EMBEDDED
from kvviz.runtime.models import DEFAULT_MODEL, WEIGHT_MODES, LoadedModel
from kvviz.runtime.settings import MODEL


class UsageError(Exception):
    """A user mistake reported as one line with exit code 2."""


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=MODEL.value(),
                        help=f"an embedded model ({', '.join(EMBEDDED)}; default {DEFAULT_MODEL}), a hub id or a "
                             "local folder (env KVVIZ_MODEL)")
    parser.add_argument("--device", default=None, help="auto (default; env KVVIZ_DEVICE), cpu, cuda, cuda:N or mps")
    parser.add_argument("--dtype", default=None, help="auto (bf16 on CUDA, fp32 elsewhere), float32, bfloat16, float16")
    parser.add_argument("--weights", default="auto", choices=WEIGHT_MODES,
                        help="bitsandbytes weight quantization: int8 or nf4 (default: model's dtype)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow model code from the hub to run (off unless given)")


def add_method_option(parser: argparse.ArgumentParser, meaning: str = "repeat for several (default: full)") -> None:
    """--method SPEC, repeatable (read by :func:`methods`); ``meaning`` is its help."""
    parser.add_argument("--method", action="append", metavar="SPEC", help=meaning)


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """--json and --quiet, shared by the commands that run the model and report results."""
    parser.add_argument("--json", metavar="OUT", help="write results as JSON to OUT ('-' for stdout)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def add_block_size_option(parser: argparse.ArgumentParser) -> None:
    """--block-size B: token slots per block of the paged layouts reported beside counted bytes."""
    from kvviz.cache.layouts import DEFAULT_BLOCK_SIZE

    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, metavar="B",
                        help=f"token slots per block of the paged layouts in layout_bytes (default "
                             f"{DEFAULT_BLOCK_SIZE}, vLLM's)")


def block_size(args: argparse.Namespace) -> int:
    """The --block-size given, or a one-line UsageError."""
    from kvviz.cache.layouts import check_block_size

    try:
        return check_block_size(args.block_size)
    except ValueError as error:
        raise UsageError(str(error)) from None


def load(args: argparse.Namespace) -> LoadedModel:
    """The model the model options name (tests replace this to run a command on a shared model)."""
    from kvviz.runtime.models import load_model

    return load_model(args.model, args.device, args.dtype, args.weights, args.trust_remote_code)


def model_source(args: argparse.Namespace) -> ModelSource:
    """How Ray workers load the model the model options name (each picks its own device unless --device says)."""
    return ModelSource(args.model, args.device, args.dtype, args.weights, args.trust_remote_code)


def read_text(path: str) -> str:
    """The UTF-8 text of a file the user named, or a one-line UsageError."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"no such file: {path}")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text") from None
    except OSError as error:
        raise UsageError(f"cannot read {path}: {error.strerror}") from None


def numbers(text: str, kind: type, option: str) -> list:
    """Comma-separated numbers from an option, or a one-line UsageError."""
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values:
        raise UsageError(f"bad {option} {text!r}: expected comma-separated {kind.__name__} values")
    return values


def methods(args: argparse.Namespace, default: list[str] | None = None) -> list[str]:
    """The --method SPECs (``default`` when none is given), each parsed now: a bad one fails before any loading."""
    specs = args.method or list(default or ["full"])
    for spec in specs:
        parse_spec(spec)
    return specs

"""``python -m kvviz``: the engine from a terminal, for scripts and benchmarks.

Every mistake a user can make (a bad SPEC, a missing file, an unknown model) ends with one line on stderr and
exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvviz.methods import REGISTRY, SpecError, parse_spec
from kvviz.models import DEFAULT_MODEL, WEIGHT_MODES, ModelError

USAGE_ERROR = 2


class UsageError(Exception):
    """A user mistake reported as one line with exit code 2."""


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=os.environ.get("KVVIZ_MODEL", DEFAULT_MODEL),
                        help=f"embedded default ({DEFAULT_MODEL}), a hub id or a local folder (env KVVIZ_MODEL)")
    parser.add_argument("--device", default=None, help="auto (default; env KVVIZ_DEVICE), cpu, cuda, cuda:N or mps")
    parser.add_argument("--dtype", default=None, help="auto (bf16 on CUDA, fp32 elsewhere), float32, bfloat16")
    parser.add_argument("--weights", default="auto", choices=WEIGHT_MODES,
                        help="bitsandbytes weight quantization: int8 or nf4 (default: model's dtype)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow model code from the hub to run (off unless given)")


def _load(args: argparse.Namespace):
    from kvviz.models import load_model

    return load_model(args.model, args.device, args.dtype, args.weights, args.trust_remote_code)


def _read_text(path: str) -> str:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"no such file: {path}")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text") from None


def _write_json(path: str | None, data: dict) -> None:
    text = json.dumps(data, indent=2)
    if path in (None, "-"):
        print(text)
    else:
        Path(path).write_text(text + "\n", encoding="utf-8")


def cmd_prepare(args: argparse.Namespace) -> int:
    """Convert the embedded default; optionally download hub models (the Docker build bakes them in)."""
    from kvviz.models import download_hub_model, prepare_default_model

    print(prepare_default_model())
    for model_id in filter(None, (m.strip() for m in args.hub_models.split(","))):
        print(download_hub_model(model_id))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """Print the effective deployment settings; exit 2 naming the variable when one is invalid."""
    from dataclasses import asdict

    from kvviz.config import Settings

    _write_json("-", asdict(Settings.from_env()))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from kvviz.memory import model_card

    loaded = _load(args)
    card = model_card(loaded)
    data = card.to_dict() | {"device": loaded.device, "weights": loaded.weights,
                             "kv_formula": card.formula_text(args.tokens)}
    if args.json:
        _write_json("-", data)
        return 0
    width = max(len(k) for k in data)
    for key, value in data.items():
        print(f"{key:<{width}}  {value}")
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    """List every registered method with its declared parameters (the docs are generated from the same data)."""
    for name in sorted(REGISTRY):
        method = REGISTRY[name]
        print(f"{name} ({method.kind}): {method.summary}")
        for param in method.params:
            print(f"    {param.name}={param.default}  [{param.describe_range()}]  {param.help}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from kvviz.session import compare, encode_prompt

    specs = args.method or ["full"]
    for spec in specs:
        parse_spec(spec)  # fail fast, before loading anything
    text = _read_text(args.prompt_file)
    loaded = _load(args)
    prompt_ids = encode_prompt(loaded.tokenizer, text, chat=args.chat)
    progress = _stderr_progress() if not args.quiet else None
    comparison = compare(loaded, prompt_ids, specs, args.max_new_tokens, progress=progress)
    if args.json:
        _write_json(args.json, comparison.to_json())
    if args.json != "-":
        _print_comparison(comparison)
    return 0


def _stderr_progress():
    def report(fraction: float, message: str) -> None:
        bar = "#" * int(fraction * 30)
        print(f"\r[{bar:<30}] {fraction:4.0%} {message[:60]:<60}", end="", file=sys.stderr, flush=True)
        if fraction >= 1:
            print(file=sys.stderr)

    return report


def _print_comparison(comparison) -> None:
    print(f"model {comparison.model} on {comparison.device}, prompt {comparison.prompt_tokens} tokens, "
          f"prefill {comparison.prefill_seconds:.2f}s")
    for result in comparison.results:
        if result.error:
            print(f"\n== {result.method}: FAILED: {result.error}")
            continue
        ratio = f"{result.compression:.2f}x smaller" if result.compression else ""
        agreement = "" if result.agreement_with_full is None else f", agreement {result.agreement_with_full:.2f}"
        print(f"\n== {result.method}: kv {result.kv_bytes:,} B vs full {result.kv_bytes_full:,} B {ratio}"
              f"{agreement}, {result.seconds:.2f}s")
        print(result.text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvviz", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    prepare = commands.add_parser("prepare", help="convert the embedded default model once (done by make run/test)")
    prepare.add_argument("--hub-models", default="", help="comma-separated hub ids to download as well")
    prepare.set_defaults(handler=cmd_prepare)

    config = commands.add_parser("config", help="print the deployment settings read from KVVIZ_* variables")
    config.set_defaults(handler=cmd_config)

    info = commands.add_parser("info", help="model card and KV formula")
    _add_model_options(info)
    info.add_argument("--tokens", type=int, default=4096, help="sequence length for the formula (default 4096)")
    info.add_argument("--json", action="store_true", help="print the card as JSON")
    info.set_defaults(handler=cmd_info)

    methods = commands.add_parser("methods", help="list methods and their parameters")
    methods.set_defaults(handler=cmd_methods)

    comp = commands.add_parser("compare", help="replay a prompt under several methods")
    _add_model_options(comp)
    comp.add_argument("--prompt-file", required=True, help="UTF-8 text file holding the prompt")
    comp.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    comp.add_argument("--method", action="append", metavar="SPEC",
                      help="name[:key=value,...][+name[:key=value,...]]; repeat for several (default: full)")
    comp.add_argument("--max-new-tokens", type=int, default=64)
    comp.add_argument("--json", metavar="OUT", help="write results as JSON to OUT ('-' for stdout)")
    comp.add_argument("--quiet", action="store_true", help="no progress bar")
    comp.set_defaults(handler=cmd_compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (SpecError, ModelError, UsageError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return USAGE_ERROR

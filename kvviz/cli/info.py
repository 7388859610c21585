"""``info``: the model card and its KV formula."""

from __future__ import annotations

import argparse

from kvviz.cli import options
from kvviz.cli.output import write_json


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("info", help="model card and KV formula")
    options.add_model_options(parser)
    parser.add_argument("--tokens", type=int, default=4096, help="sequence length for the formula (default 4096)")
    parser.add_argument("--json", action="store_true", help="print the card as JSON")
    return parser


def run(args: argparse.Namespace) -> int:
    from kvviz.planning.memory import model_card

    loaded = options.load(args)
    card = model_card(loaded)
    data = card.to_dict() | {"device": loaded.device, "weights": loaded.weights,
                             "kv_formula": card.formula_text(args.tokens)}
    if args.json:
        write_json("-", data)
        return 0
    width = max(len(k) for k in data)
    for key, value in data.items():
        print(f"{key:<{width}}  {value}")
    return 0

"""``axes``: one budget spent on heads, tokens or bits, each alone and then stacked, on a needle prompt."""

from __future__ import annotations

import argparse

from kvviz.cli import options
from kvviz.cli.options import UsageError
from kvviz.cli.output import progress_unless, write_json
from kvviz.methods import parse_spec


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("axes", help="one budget spent on heads, tokens or bits, alone and stacked")
    options.add_model_options(parser)
    parser.add_argument("--budget", type=float, action="append",
                        help="share of the full cache per axis (default 1/3; repeat for several budgets in one table)")
    options.add_method_option(parser, "SPECs instead of the budgets' (repeat)")
    parser.add_argument("--also", action="append", metavar="SPEC", help="SPECs added after the budgets' (repeat)")
    parser.add_argument("--length", type=int, default=512, help="needle prompt length in tokens (default 512)")
    parser.add_argument("--depth", type=float, default=0.5, help="needle depth in [0, 1] (default 0.5)")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    options.add_output_options(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from kvviz.planning.memory import model_card
    from kvviz.studies.three_axes import AxisRow, axes_specs, run_axes

    for spec in [*(args.method or []), *(args.also or [])]:
        parse_spec(spec)
    budgets = args.budget or [1 / 3]
    for budget in budgets:
        if not 0 < budget < 1:
            raise UsageError(f"bad --budget {budget}: a share of the full cache in (0, 1)")
    if args.method and args.also:
        raise UsageError("--also adds SPECs to the budgets' ones; with --method, list them all with --method")
    loaded = options.load(args)
    specs = args.method or axes_specs(model_card(loaded), budgets, args.also)
    rows, key = run_axes(loaded, specs, args.length, args.depth, args.max_new_tokens, progress_unless(args.quiet))
    if args.json:
        write_json(args.json, {"model": loaded.name, "device": loaded.device, "key": key, "length": args.length,
                               "depth": args.depth, "rows": [r.to_json() for r in rows]})
    if args.json != "-":
        print(f"{loaded.name} on {loaded.device}, needle prompt of {args.length} tokens (key {key} at depth "
              f"{args.depth:g}), {args.max_new_tokens} new tokens\n")
        print("\n".join([*AxisRow.MARKDOWN_HEADER, *(r.markdown_row() for r in rows)]))
    return 0

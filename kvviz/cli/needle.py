"""``needle``: a pass-key retrieval grid (lengths x depths) per method, with the ledger's view of the key's tokens."""

from __future__ import annotations

import argparse

from kvviz.cli import options
from kvviz.cli.output import progress_unless, write_json


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("needle", help="pass-key retrieval grid per method")
    options.add_model_options(parser)
    parser.add_argument("--lengths", default="512,1024,2048", help="prompt lengths in tokens (default 512,1024,2048)")
    parser.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths in [0, 1] (default 0.1,0.5,0.9)")
    parser.add_argument("--method", action="append", metavar="SPEC", help="repeat for several (default: full)")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="wrap the prompt in the chat template (default; --no-chat for plain text)")
    parser.add_argument("--trials", type=int, default=1, help="haystacks (keys) per cell (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", default="query_aware",
                        help="query_aware (question compressed with the context) or query_agnostic (asked after)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    options.add_output_options(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from kvviz.studies.needle import run_needle_grid

    specs = options.methods(args)
    lengths = options.numbers(args.lengths, int, "--lengths")
    depths = options.numbers(args.depths, float, "--depths")
    loaded = options.load(args)
    report = run_needle_grid(loaded, specs, lengths, depths, args.trials, args.seed, args.chat, args.mode,
                             args.max_new_tokens, progress_unless(args.quiet))
    if args.json:
        write_json(args.json, report.to_json())
    if args.json != "-":
        _print_needle(report, lengths, depths)
    return 0


def _print_needle(report, lengths: list[int], depths: list[float]) -> None:
    rows = {(r["method"], r["length"], r["depth"]): r for r in report.summary()}
    print(f"needle grid ({report.settings['mode']}, {report.settings['trials']} trial(s)): found/trials; "
          f"* = the key's tokens were evicted in some trial; {report.seconds:.1f}s")
    for method in report.settings["methods"]:
        print(f"\n== {method}")
        print("depth \\ length " + "".join(f"{length:>10}" for length in lengths))
        for depth in depths:
            cells = [rows[(method, length, depth)] for length in lengths]
            marks = [f"{c['found']}/{c['trials']}{'*' if c['survived'] < c['trials'] else ' '}" for c in cells]
            print(f"{depth:<16g}" + "".join(f"{m:>10}" for m in marks))

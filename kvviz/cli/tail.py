"""``tail``: the tail tasks per method: calibrated accuracy, and what the ledger says each failure lost."""

from __future__ import annotations

import argparse

from kvviz.cli import options
from kvviz.cli.options import UsageError
from kvviz.cli.output import emit_report, progress_unless


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("tail", help="multi-key, multi-value, multi-hop and instruction tasks per method")
    options.add_model_options(parser)
    parser.add_argument("--tasks", default="needle,multikey,multivalue,vartrack,instructions",
                        help="comma-separated: needle, multikey, multivalue, vartrack, instructions (default: all)")
    parser.add_argument("--lengths", default="256,512", help="prompt lengths in tokens (default 256,512)")
    parser.add_argument("--depths", default="0.25,0.75",
                        help="depths of the first planted statement (default 0.25,0.75)")
    parser.add_argument("--hops", default="1,2,3,4", help="vartrack chain lengths, 1 to 4 (default 1,2,3,4)")
    options.add_method_option(parser, "repeat for several (full always runs first)")
    parser.add_argument("--protect", action="append", choices=("system", "planted"),
                        help="also run every eviction method with these spans protected (repeatable)")
    parser.add_argument("--trials", type=int, default=1, help="items per cell (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", default="query_aware",
                        help="query_aware (question compressed with the context) or query_agnostic (asked after)")
    options.add_output_options(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from kvviz.runs import TailRequest
    from kvviz.studies.tail_items import TASKS

    specs = options.methods(args)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise UsageError(f"unknown task(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(TASKS)}")
    lengths = options.numbers(args.lengths, int, "--lengths")
    depths = options.numbers(args.depths, float, "--depths")
    hops = options.numbers(args.hops, int, "--hops")
    request = TailRequest(tuple(specs), tuple(tasks), tuple(lengths), tuple(depths), tuple(hops), args.mode,
                          tuple(args.protect or ()), args.trials, args.seed)
    report = request.run(options.load(args), progress_unless(args.quiet))
    emit_report(args, report)
    return 0

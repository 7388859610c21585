"""``needle``: a pass-key retrieval grid (lengths x depths) per method, with the ledger's view of the key's tokens."""

from __future__ import annotations

import argparse

from kvviz.cli import options
from kvviz.cli.output import emit_report, progress_unless


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("needle", help="pass-key retrieval grid per method")
    options.add_model_options(parser)
    parser.add_argument("--lengths", default="512,1024,2048", help="prompt lengths in tokens (default 512,1024,2048)")
    parser.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths in [0, 1] (default 0.1,0.5,0.9)")
    options.add_method_option(parser)
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
    from kvviz.runs import NeedleRequest

    specs = options.methods(args)
    lengths = options.numbers(args.lengths, int, "--lengths")
    depths = options.numbers(args.depths, float, "--depths")
    request = NeedleRequest(tuple(specs), tuple(lengths), tuple(depths), args.trials, args.mode, args.chat,
                            args.max_new_tokens, args.seed)
    report = request.run(options.load(args), progress_unless(args.quiet))
    emit_report(args, report)
    return 0

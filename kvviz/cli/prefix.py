"""``prefix``: prefix reuse: block hits and TTFT with and without reuse, and what eviction keeps of a preamble."""

from __future__ import annotations

import argparse

from kvviz.cli import options
from kvviz.cli.options import UsageError
from kvviz.cli.output import progress_unless, write_json
from kvviz.methods import parse_spec


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("prefix", help="prefix reuse: block hits, TTFT with and without reuse, kept sets")
    options.add_model_options(parser)
    parser.add_argument("--preamble-file", help="UTF-8 preamble shared by the questions (default: a help-desk "
                        "system prompt with few-shot examples, ChatML)")
    parser.add_argument("--question", action="append", help="repeat for each turn (default: two questions)")
    options.add_method_option(parser, "eviction SPEC for the kept-set overlap between the first two questions; repeat")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per cached block (default 16)")
    parser.add_argument("--repeats", type=int, default=1, help="time each prefill N times, keep the best")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="answer length for the quality cost")
    parser.add_argument("--no-sharing", action="store_true", help="skip the kept-set overlap")
    options.add_output_options(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """The turns through one prefix cache, then the kept-set overlap of the first two questions; with ``--json -``
    stdout holds the JSON alone."""
    from kvviz.runs import PrefixSharingRequest, PrefixTurnsRequest
    from kvviz.studies.prefix_reuse import DEFAULT_QUESTIONS, default_preamble, turn_ids
    from kvviz.studies.prefix_sharing import DEFAULT_METHODS

    preamble = options.read_text(args.preamble_file) if args.preamble_file else default_preamble()
    if not preamble.strip():
        raise UsageError("the preamble is empty")
    questions = args.question or list(DEFAULT_QUESTIONS)
    specs = args.method or list(DEFAULT_METHODS)
    for spec in specs:
        if parse_spec(spec).eviction is None:
            raise UsageError(f"--method {spec}: prefix sharing compares eviction methods")
    if args.block_tokens < 1:
        raise UsageError("--block-tokens must be at least 1")
    loaded = options.load(args)
    pieces = [turn_ids(loaded.tokenizer, preamble, q) for q in questions]
    preamble_ids = pieces[0][0]
    progress = progress_unless(args.quiet)
    turns = PrefixTurnsRequest(tuple(tuple(preamble_ids + q) for _, q in pieces), tuple(questions),
                               args.block_tokens, args.repeats).run(loaded, progress)
    sharing = None
    if len(questions) >= 2 and not args.no_sharing:
        sharing = PrefixSharingRequest(tuple(preamble_ids), tuple(pieces[0][1]), tuple(pieces[1][1]), tuple(specs),
                                       args.max_new_tokens).run(loaded, progress)
    if args.json != "-":
        print(f"preamble {len(preamble_ids)} tokens, blocks of {args.block_tokens}")
        print("\n".join(turns.lines() + (sharing.lines() if sharing is not None else [])))
    if args.json:
        write_json(args.json, {"model": loaded.name, "device": loaded.device, "block_tokens": args.block_tokens,
                               "preamble_tokens": len(preamble_ids), "turns": turns.to_rows(),
                               "block_tables": turns.block_tables(),
                               "sharing": [] if sharing is None else sharing.json_rows()})
    return 0

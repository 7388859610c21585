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
    parser.add_argument("--method", action="append", metavar="SPEC",
                        help="eviction SPEC for the kept-set overlap between the first two questions; repeat")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per cached block (default 16)")
    parser.add_argument("--repeats", type=int, default=1, help="time each prefill N times, keep the best")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="answer length for the quality cost")
    parser.add_argument("--no-sharing", action="store_true", help="skip the kept-set overlap")
    options.add_output_options(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from kvviz.runtime.prefix import DEFAULT_QUESTIONS, default_preamble, run_turns, turn_ids
    from kvviz.studies.prefix_sharing import DEFAULT_METHODS, compare_sharing

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
    turns = run_turns(loaded, [preamble_ids + q for _, q in pieces], labels=questions,
                      block_tokens=args.block_tokens, repeats=args.repeats, progress=progress)
    sharing = None
    if len(questions) >= 2 and not args.no_sharing:
        sharing = compare_sharing(loaded, preamble_ids, pieces[0][1], pieces[1][1], specs, args.max_new_tokens,
                                  progress=progress)
    print(f"preamble {len(preamble_ids)} tokens, blocks of {args.block_tokens}")
    for turn in turns.turns:
        print(f"  {turn.label[:48]!r}: {turn.prompt_tokens} tokens, {turn.lookup.hits}/{len(turn.lookup.blocks)} "
              f"blocks hit ({turn.lookup.reused_tokens} tokens reused), TTFT {turn.ttft_reused * 1000:.0f} ms vs "
              f"{turn.ttft_fresh * 1000:.0f} ms fresh ({turn.ttft_reused / turn.ttft_fresh:.2f}x), "
              f"max |logit diff| {turn.max_logit_diff:.2e}")
    if sharing is not None:
        print("kept preamble tokens, question A vs B (Jaccard, mean over layers; answering B from A's cache):")
        for row in sharing.rows:
            print(f"  {row.method:<44} {row.mode:<15} Jaccard {row.jaccard:.3f} "
                  f"{'shareable' if row.shareable else 'NOT shareable':<13} agreement own {row.agreement_own:.2f} "
                  f"shared {row.agreement_shared:.2f}, KL own {row.mean_kl_own:.4f} shared {row.mean_kl_shared:.4f}")
    if args.json:
        write_json(args.json, {
            "model": loaded.name, "device": loaded.device, "block_tokens": args.block_tokens,
            "preamble_tokens": len(preamble_ids), "turns": turns.to_rows(),
            "block_tables": [[b.status for b in t.lookup.blocks] for t in turns.turns],
            "sharing": [] if sharing is None else [row | {"jaccard_per_layer": r.jaccard_per_layer}
                                                   for row, r in zip(sharing.to_rows(), sharing.rows, strict=True)],
        })
    return 0

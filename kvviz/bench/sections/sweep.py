"""The trade-off sweep, measured as an engineer runs it.

- Task: the default families x four budgets on ``sweep_items`` items at ``sweep_task_length`` tokens (every
  configuration of a wave of items decoding in one batch), against the same points run as separate comparisons
  (``compare`` of one SPEC on one item, its own fresh prefill and full's decode included). The comparisons are
  timed on a sample of items, every SPEC on each (``sweep_sample_specs`` of them, evenly spaced, at the quick sizes),
  half before and half after the sweep, and extrapolated to every item; their outcomes must equal the sweep's.
- Play: the default families' streaming perplexity on a play, every configuration in one forward per token, against
  the same configurations streamed one after another (the path each one takes alone), in turns.

Both paths run under the same padding rules: a forward of several rows pads its linear layers to an agreeing row
count, a one-row loop does not (:mod:`kvviz.runtime.invariance`), as in the app.
"""

from __future__ import annotations

from kvviz.bench.harness import BenchRun, Section, Spread, bench_section, timed
from kvviz.comparison.session import compare
from kvviz.methods import REGISTRY, Sizing, SpecError
from kvviz.planning.memory import model_card
from kvviz.studies.perplexity import play_text, streaming_perplexities, streaming_perplexity
from kvviz.studies.sweep import DEFAULT_BUDGETS, DEFAULT_FAMILIES, plan, run_sweep
from kvviz.studies.tail_items import NEW_TOKENS, stream_items
from kvviz.studies.workloads import TaskWorkload, TextWorkload

TASK = "needle"
PLAY = "hamlet"


def planned_specs(loaded, families: list[str], length: int) -> list[str]:
    """The SPECs a sweep of ``families`` measures at ``length`` tokens (full not included), sized as it sizes them."""
    card = model_card(loaded)
    _, points = plan(families, list(DEFAULT_BUDGETS), Sizing(length, card.kv_heads, card.head_dim,
                                                             card.bytes_per_element))
    return [spec for _, _, spec in points]


@bench_section("sweep")
def sweep(run: BenchRun) -> Section:
    section = Section("sweep", f"Trade-off sweep: the default families x {len(DEFAULT_BUDGETS)} budgets on task items "
                               "and on a play, batched against one at a time")
    if run.loaded.tokenizer is None or not getattr(run.loaded.tokenizer, "chat_template", None):
        section.skipped = "needs a real tokenizer with a chat template (task items and plays are text)"
        return section
    families = [f for f in DEFAULT_FAMILIES if f.split("+")[0].split(":")[0] in REGISTRY]
    _task(run, section, families)
    _text(run, section, families)
    return section


def _task(run: BenchRun, section: Section, families: list[str]) -> None:
    loaded, sizes = run.loaded, run.sizes
    workload = TaskWorkload(TASK, sizes.sweep_task_length, sizes.sweep_items)
    items = stream_items(loaded.tokenizer, TASK, workload.length, range(workload.items))
    sample = items[:: max(1, len(items) // sizes.sweep_sample_items)][: sizes.sweep_sample_items]
    run.log(f"  task sweep: {len(families)} families on {workload.describe()}")

    def separately(chosen, specs) -> tuple[float, dict]:
        """Each SPEC on each chosen item as its own comparison: seconds, and the answers by (item, SPEC)."""
        answers, total = {}, 0.0
        for item in chosen:
            for spec in specs:
                seconds, comparison = timed(loaded.device, lambda i=item, s=spec: compare(
                    loaded, i.ids, [s], NEW_TOKENS[TASK], reuse_prefix=False))  # fresh, as the sweep prefills
                total += seconds
                answers[(item.item_id, spec)] = comparison.results[-1].text.strip()
        return total, answers

    specs = planned_specs(loaded, families, workload.length)
    step = max(1, len(specs) // sizes.sweep_sample_specs) if sizes.sweep_sample_specs else 1
    alone = specs[::step][: sizes.sweep_sample_specs or None]
    half = max(1, len(sample) // 2)
    before_seconds, before = separately(sample[:half], alone)
    sweep_seconds, report = timed(loaded.device, lambda: run_sweep(loaded, workload, families,
                                                                   list(DEFAULT_BUDGETS)))
    after_seconds, after = separately(sample[half:], alone)
    per_comparison = (before_seconds + after_seconds) / (len(sample) * len(alone))
    one_at_a_time = per_comparison * len(items) * len(specs)
    outcomes = {(o.item, p.spec): o.answer for p in report.points[1:] for o in p.outcomes}
    compared = {key: answer for key, answer in (before | after).items() if key in outcomes}
    differ = [f"{spec} on {item}: {outcomes[(item, spec)]!r} in the sweep, {answer!r} alone"
              for (item, spec), answer in compared.items() if outcomes[(item, spec)] != answer]
    run.log(f"    sweep {sweep_seconds:.1f} s; one at a time {one_at_a_time:.1f} s (from {len(sample)} items)")
    section.add("sweep_task_configurations", len(specs), note=", ".join(families))
    section.add("sweep_task_items", len(items), note=f"{TASK} at {workload.length} tokens; "
                                                     f"{report.notes[0] if report.notes else ''}")
    section.add("sweep_task_seconds", sweep_seconds, "s")
    section.add("sweep_task_one_at_a_time_seconds", one_at_a_time, "s",
                note=f"{per_comparison:.2f} s per comparison, timed on {len(alone)} of the {len(specs)} SPECs on "
                     f"{len(sample)} items (half before the sweep, half after) and extrapolated to every SPEC on "
                     f"{len(items)} items")
    section.add("sweep_task_vs_one_at_a_time", sweep_seconds / one_at_a_time, "x", "<= 0.35")
    section.add("sweep_task_same_as_compare", not differ, target="== True",
                note=f"the answers of {len(compared)} sampled (item, SPEC) pairs"
                     + (f"; {len(differ)} differ: {'; '.join(differ)}" if differ else ""))


def _text(run: BenchRun, section: Section, families: list[str]) -> None:
    loaded, sizes = run.loaded, run.sizes
    workload = TextWorkload(PLAY, sizes.sweep_play_tokens)
    ids = loaded.tokenizer(play_text(PLAY))["input_ids"][: workload.tokens]
    specs = ["full", *planned_specs(loaded, families, workload.tokens)]
    run.log(f"  play sweep: {len(specs)} configurations on {workload.describe()}")

    def sequential() -> int:
        streamed = 0
        for spec in specs:
            try:
                streaming_perplexity(loaded, ids, spec)
                streamed += 1
            except SpecError:
                continue
        return streamed

    batched_seconds, sequential_seconds = [], []
    streamed = 0
    for _ in range(sizes.repeats):  # in turns, so a slow spell of the machine hits both alike
        seconds, _ = timed(loaded.device, lambda: streaming_perplexities(loaded, ids, specs))
        batched_seconds.append(seconds)
        seconds, streamed = timed(loaded.device, sequential)
        sequential_seconds.append(seconds)
    sweep_seconds, report = timed(loaded.device, lambda: run_sweep(loaded, workload, families, list(DEFAULT_BUDGETS)))
    batched, one_by_one = Spread(batched_seconds), Spread(sequential_seconds)
    section.add("sweep_text_configurations", streamed,
                note=f"of {len(specs)}: the others compress a prompt once and cannot stream")
    section.add("sweep_text_seconds", sweep_seconds, "s", "< 120", note=f"the whole sweep, {workload.describe()}")
    section.add("sweep_text_batched_seconds", batched.median, "s", note=batched.note())
    section.add("sweep_text_sequential_seconds", one_by_one.median, "s", note=one_by_one.note())
    section.add("sweep_text_batched_vs_sequential", batched.median / one_by_one.median, "x", "<= 0.3")
    section.add("sweep_text_points", sum(p.perplexity is not None for p in report.points))

"""Trade-offs: every family of methods across its budgets, quality against memory with its uncertainty and its tail."""

import json

import streamlit as st

from kvviz.cache.layouts import BLOCK_SIZES, DEFAULT_BLOCK_SIZE, LABELS, MEANINGS
from kvviz.comparison.session import PromptError
from kvviz.lessons import STORY_QUESTION
from kvviz.methods import REGISTRY, SpecError
from kvviz.runs import SweepRequest
from kvviz.studies.frontier import MEASURES
from kvviz.studies.paired import DEFAULT_MARGIN
from kvviz.studies.perplexity import play_names
from kvviz.studies.power import DEFAULT_FULL_ACCURACY, plan
from kvviz.studies.sweep import DEFAULT_BUDGETS, DEFAULT_FAMILIES, check_sweep, read_family
from kvviz.studies.sweep_rounds import DEFAULT_MAX_ITEMS, DEFAULT_SECONDS, Adaptive
from kvviz.studies.tail_items import NEW_TOKENS
from kvviz.studies.verdicts import DEFAULT_TAIL_THRESHOLD, judged_report
from kvviz.studies.workloads import DEFAULT_ITEMS, SWEEP_TASKS, PromptWorkload, TaskWorkload, TextWorkload
from kvviz_app import plots
from kvviz_app.chrome import page_header, require_model, settings
from kvviz_app.inputs import chat_setting, prompt_set_input
from kvviz_app.results import run_button, run_pressed
from kvviz_app.tradeoffs import compare_link, families_from_link, item_link, sweep_cluster
from kvviz_app.url import Read, choice_setting, choices_setting, linked, number_setting, share_settings

DEFAULT_PROMPT = STORY_QUESTION  # calibrated: the full cache answers Ines (kvviz/lessons.py)
# The page's first run: three axis ideas (a position window, a query-aware selection, a quantizer) on multikey items
# of 256 tokens, adaptive: rounds until every point is decided, within a class's few minutes on a 2-core CPU; h2o and
# the stacks are one click away in the list.
PAGE_FAMILIES = ("streaming_llm", "snapkv", "kivi:residual=0")
PAGE_TASK, PAGE_LENGTH = "multikey", 256
BUDGET_CHOICES = (0.03125, 0.0625, 0.125, 0.25, 0.5, 0.75)
WORKLOADS = {"task": "A task: many items", "prompt": "Your prompts", "text": "A play"}
DESIGNS = {"adaptive": "Adaptive: rounds until decided", "fixed": "Fixed: every item once"}
LENGTHS = [256, 512, 1024]

page_header("Trade-offs", "Trade-offs: quality against memory",
            "Which configuration should you deploy at your memory budget, and what does it lose? Each family is "
            "one method (or stack) with one parameter left free, swept across the budgets. Every point runs on the "
            "same items as the full cache and is judged against it item by item: proven within the loss you accept "
            "(your margin), beyond it, worse, or inconclusive. An adaptive run gives the next items only to the "
            "points still undecided. The recommendation is a proof, never a best guess.",
            link_settings=("w", "m", "b", "n", "chat", "prompt", "task", "len", "items", "seed", "play", "tokens",
                           "margin", "tail", "block", "x", "design", "cap", "time", "assumed"))

loaded = require_model()
limits = settings()


@st.cache_data(show_spinner=False)
def family_choices() -> dict[str, str]:
    """SPEC -> what it sweeps: the default families, every registered method, and each kvpress press natively."""
    from kvviz.methods.kvpress.catalog import press_catalog

    names = [n for n in sorted(REGISTRY) if n != "full" and n != "kvpress_native"]
    specs = [*PAGE_FAMILIES, *DEFAULT_FAMILIES, *names, *(f"kvpress_native:press={p}" for p in sorted(press_catalog()))]
    choices = {}
    for spec in dict.fromkeys(specs):
        try:
            family = read_family(spec)
        except SpecError:
            continue  # a press that cannot run here (needs a download, or cannot be mapped)
        choices[spec] = "one point" if family.member is None else f"sweeps {', '.join(family.swept)}"
    return choices


with st.sidebar:
    st.subheader("Workload")
    workload_kind = choice_setting("Quality measured on", "w", list(WORKLOADS), "task", key="sweep_workload",
                                   widget=st.radio, format_func=WORKLOADS.get,
                                   help="A task: accuracy on many generated items the full cache gets right. Your "
                                        "prompts: accuracy where each has an answer, else agreement with full's "
                                        "continuation (teacher-forced). A play: streaming perplexity.")
    budgets = choices_setting("Budgets (share of the full cache)", "b", list(BUDGET_CHOICES), list(DEFAULT_BUDGETS),
                              key="sweep_budgets", cast=float,
                              format_func=lambda b: f"1/{round(1 / b)}" if round(1 / b) * b == 1 else f"{b:.0%}",
                              help="Evictions keep this share of the tokens, lowrank this share of the width; a "
                                   "quantizer's bit widths and merge_heads' head counts are their own budgets.")
    cap = limits.max_new_tokens
    max_new = number_setting("Tokens per prompt", "n", min(cap, 24), 1, cap, key="sweep_max_new",
                             disabled=workload_kind != "prompt")
    chat = chat_setting(loaded, True, key="sweep_chat", disabled=workload_kind != "prompt")
    seed = number_setting("Seed", "seed", 0, 0, 1_000_000, key="sweep_seed", disabled=workload_kind != "task",
                          help="Which items: the same seed gives the same items for every configuration and run.")
    block_size = choice_setting("Block size (token slots)", "block", BLOCK_SIZES, DEFAULT_BLOCK_SIZE,
                                key="sweep_block", cast=int, disabled=workload_kind == "text",
                                help="Of the paged layouts the x-axis can count memory in (vLLM's default is 16). "
                                     "A new size measures the sweep again.")
    st.subheader("Verdicts")
    margin = float(number_setting("Margin: the loss you accept (points)", "margin", DEFAULT_MARGIN, 0.5, 50.0,
                                  key="sweep_margin", step=0.5,
                                  help=f"Fixed before the run (default {DEFAULT_MARGIN:g}): a configuration is proven "
                                       "within the margin when its loss against full, item by item, is shown smaller "
                                       "than this, and an adaptive run stops each point on it. Changed after a run, "
                                       "it re-reads the run as exploratory."))
    design = choice_setting("Design", "design", list(DESIGNS), "adaptive", key="sweep_design", widget=st.radio,
                            format_func=DESIGNS.get, disabled=workload_kind == "text",
                            help="Adaptive: rounds of items, each given to full and the points still undecided, "
                                 "until every point is decided or a limit below is reached. Fixed: every item once, "
                                 "one look.")
    adaptive_off = workload_kind == "text" or design != "adaptive"
    cap_default = min(DEFAULT_MAX_ITEMS, limits.max_items)
    max_items = number_setting("Max items", "cap", cap_default, 1, limits.max_items, key="sweep_cap",
                               disabled=adaptive_off,
                               help=f"The adaptive run's cap on items (this server allows {limits.max_items}).")
    seconds = number_setting("Time budget (seconds)", "time", int(DEFAULT_SECONDS), 1, 3600, key="sweep_time",
                             disabled=adaptive_off,
                             help="No round starts that would likely end after this (the first always runs).")
    items = number_setting("Items (fixed design)", "items", min(DEFAULT_ITEMS, limits.max_items), 1,
                           limits.max_items, key="sweep_items", disabled=workload_kind != "task" or not adaptive_off,
                           help=f"Task items, each at its own random depth from the seed. This server allows up to "
                                f"{limits.max_items}.")
    threshold = float(number_setting("Tail: agreement below", "tail", DEFAULT_TAIL_THRESHOLD, 0.05, 1.0,
                                     key="sweep_tail", step=0.05, disabled=workload_kind != "prompt",
                                     help="A prompt set's tail: the share of prompts whose agreement with full "
                                          "falls below this."))

workload = None
prompt_text: str | None = None
task, task_length, play, play_tokens = PAGE_TASK, PAGE_LENGTH, "hamlet", 512
if workload_kind == "task":
    left, right = st.columns(2)
    with left:
        task = choice_setting("Task", "task", list(SWEEP_TASKS), PAGE_TASK, key="sweep_task")
    with right:
        task_length = choice_setting("Prompt length (tokens)", "len", LENGTHS, PAGE_LENGTH, key="sweep_task_length",
                                     widget=st.select_slider, cast=int)
    workload = TaskWorkload(task, int(task_length), int(items if adaptive_off else max_items), int(seed))
elif workload_kind == "prompt":
    lines = prompt_set_input("sweep", DEFAULT_PROMPT)
    if lines is not None:
        try:
            workload = PromptWorkload.encode(loaded.tokenizer, lines, chat, int(max_new))
            too_long = [p for p in workload.prompts if len(p.ids) > limits.max_prompt_tokens]
            if too_long:
                raise PromptError(f"{too_long[0].name} has {len(too_long[0].ids):,} tokens; this server allows "
                                  f"{limits.max_prompt_tokens:,}")
        except PromptError as error:
            workload = None
            st.error(f"{error}. Nothing runs until it is fixed.")
        if len(lines) == 1:
            prompt_text = lines[0].text
            st.caption("One prompt is a single example: its points have no interval. Upload a prompt set (several "
                       "files, or one .jsonl) for a curve to decide on.")
else:
    left, right = st.columns(2)
    try:
        plays = play_names()
    except LookupError as error:
        st.error(str(error))
        st.stop()
    with left:
        play = choice_setting("Play", "play", plays, "hamlet" if "hamlet" in plays else plays[0], key="sweep_play")
    with right:
        play_tokens = choice_setting("Tokens scored", "tokens", LENGTHS, 512, key="sweep_play_tokens",
                                     widget=st.select_slider, cast=int)
    workload = TextWorkload(play, int(play_tokens))

choices = family_choices()
linked_families, typed = families_from_link(list(choices), [f for f in PAGE_FAMILIES if f in choices])
families = linked("sweep_families", linked_families, lambda value: st.multiselect(
    "Families", list(choices), value, format_func=lambda spec: f"{spec} · {choices[spec]}", key="sweep_families",
    help="A method named without its budget is a family; one with every parameter fixed (fp8) is one point."))
extra = linked("sweep_extra", Read(typed), lambda value: st.text_input(
    "More families or fixed SPECs (separated by spaces)", value, key="sweep_extra",
    placeholder="h2o  snapkv+kivi:bits=4  lowrank+snapkv:budget=0.25"))
specs = list(dict.fromkeys([*families, *extra.split()]))
share_settings(w=workload_kind, m=specs, b=sorted(budgets), n=int(max_new), chat=chat, margin=margin, tail=threshold,
               design=design, cap=int(max_items), time=int(seconds),
               **({"task": task, "len": task_length, "items": int(items), "seed": int(seed)}
                  if workload_kind == "task" else {}),
               **({"play": play, "tokens": play_tokens} if workload_kind == "text" else {}), block=block_size)

problem, families_run = None, []
try:
    families_run = [f for f in check_sweep(specs, sorted(budgets), workload, limits.max_items) if f.member is not None]
except ValueError as error:
    problem = str(error)
    st.error(problem)
adaptive = None if adaptive_off else Adaptive(int(max_items), float(seconds))
asked = (None if problem is not None or workload is None
         else SweepRequest(workload, tuple(specs), tuple(sorted(budgets)), sweep_cluster(limits.ray_address),
                           block_size=int(block_size), margin=margin, adaptive=adaptive))
planned_items = (workload.items if isinstance(workload, TaskWorkload) else
                 len(workload.prompts) if isinstance(workload, PromptWorkload) else None)
if planned_items is not None and adaptive is not None:
    planned_items = min(planned_items, adaptive.max_items)
if planned_items is not None and problem is None:
    with st.expander("**What this run can decide**, before you run it: the power of its design, by simulation"):
        assumed = number_setting("Full's accuracy, assumed", "assumed", DEFAULT_FULL_ACCURACY, 0.5, 1.0,
                                 key="sweep_assumed", slider=True, step=0.05,
                                 help="The plan simulates this design many times with full right this often.")
        share_settings(assumed=assumed)
        planned = plan(planned_items, margin, max(1, len(families_run)), adaptive is not None, assumed)
        st.markdown(planned.sentence())
        st.caption(" ".join(f"{text[0].upper()}{text[1:]}." for text in planned.assumptions.values()))
if run_button("Run the sweep", "sweep_request", asked, disabled=asked is None):
    st.session_state["sweep_prompt"] = (prompt_text, chat)

request, report = run_pressed(
    loaded, "sweep_request", "Choose the workload, the families and the budgets, then press **Run the sweep**.",
    "Sizing every family…", current=asked)
count = len(report.points)
rounds = f" {report.rounds.describe().capitalize()}." if report.rounds is not None and report.item_cap else ""
st.success(f"{count} configuration{'s' if count != 1 else ''} on {report.workload} in {report.seconds:.1f} s.{rounds}")
if report.shard_run is not None:
    st.caption(f"Measured on the Ray cluster: {report.shard_run.describe()}.")
summary = st.container()  # written below, once the memory the compressions count is chosen

measure = report.main_measure
if len(report.frontiers) > 1:
    measure = st.radio("Quality measure", list(report.frontiers), format_func=lambda k: MEASURES[k].label,
                       horizontal=True, key="sweep_measure")
layout = "counted"
if any(p.layout_bytes for p in report.points):  # a play's streaming perplexity keeps no ledger: counted bytes only
    layout = choice_setting("Memory counted", "x", list(LABELS), "counted", key="sweep_layout",
                            widget=st.radio, format_func=LABELS.get, horizontal=True,
                            help="Counted: the bytes kvviz holds. The others: what a serving engine's layout would "
                                 f"hold for the same kept tokens, in blocks of {report.block_size} token slots.")
    share_settings(x=layout)
    st.caption(f"{LABELS[layout].capitalize()}: {MEANINGS[layout]}."
               + ("" if layout == "counted" else " Each point and its cliff move to what this layout would hold; "
                  "the frontier and the recommendation are found again on these bytes. The verdicts against full "
                  "do not depend on memory."))
if (report.margin, report.tail_threshold, report.layout) != (margin, threshold, layout):
    report = judged_report(report, margin, threshold, layout)
if report.margin != report.margin_fixed:
    st.warning(f"**Exploratory.** This run's margin was fixed at {report.margin_fixed:g} points; read at "
               f"{report.margin:g} after seeing its results, the verdicts below do not hold their 2.5%. Press "
               "**Run the sweep** to fix the new margin before the items.")
with summary:
    for line in report.summary:
        st.markdown(f"- {line}")
    if report.plan is not None:
        st.caption(f"Plan: {report.plan.sentence()}")
    for note in report.notes:
        st.caption(note)
    for name, rule in report.rules.items():
        st.caption(f"{name.replace('_', ' ').capitalize()}: {rule}.")
st.plotly_chart(plots.tradeoff_figure(report, measure), width="stretch")
if report.item_cap:
    st.plotly_chart(plots.allocation_figure(report), width="stretch")
    st.caption("An adaptive run gives each round's items to full and the points still undecided; a point stops at "
               "the look that decides it (within, beyond the margin, or worse than full), so its share goes to the "
               "others. Grey: still undecided when the run ended.")

prompt, prompt_chat = st.session_state.get("sweep_prompt", (None, True))
on_items = isinstance(request.workload, TaskWorkload)
compare_tokens = NEW_TOKENS[request.workload.task] if on_items else getattr(request.workload, "max_new_tokens", 24)
table = report.to_frame()
table["frontier"] = table["spec"].isin(report.frontiers[measure])
table["open"] = [item_link(spec, report.items[0]["id"], request.workload.seed, compare_tokens) if on_items
                 else compare_link(spec, prompt, prompt_chat, compare_tokens) for spec in table["spec"]]
for key in ("accuracy_ci", "agreement_ci", "tail_ci"):
    if key in table and table[key].notna().any():
        table[key] = [None if v is None else f"{v[0]:.0%} – {v[1]:.0%}" for v in table[key]]
judged = [p.paired_by_measure.get(measure) for p in report.points]
table["verdict"] = [None if j is None else j.verdict for j in judged]
table["versus_full"] = [None if j is None else j.interval_text() for j in judged]
table["lost"] = [None if j is None else j.lost for j in judged]
table["gained"] = [None if j is None else j.gained for j in judged]
table["p_adjusted"] = [None if j is None else j.margin_p_adjusted for j in judged]
in_layout = (f"{report.layout}_bytes", f"{report.layout}_compression")  # none for counted bytes
shown_columns = [c for c in ("spec", "family", "budget", "kv_bytes", "compression", *in_layout, *report.frontiers,
                             "accuracy_ci", "agreement_ci", "tail_ci", "items_scored", "stopped", "verdict",
                             "versus_full", "lost", "gained", "p_adjusted", "first_divergence", "frontier", "open",
                             "error")
                 if c in table and (table[c].notna().any() if c != "frontier" else True)]
if on_items:
    st.subheader("Every item, every budget")
    st.caption("Each family's outcome per item against full's (full's own column first): green right where full "
               "is right; lost items coloured by cause (red: a planted span it needed was evicted, hover for which "
               "and in how many layers; orange: nothing planted evicted under a quantizer; purple: everything "
               "planted kept); blue gained (right where full is wrong); grey wrong where full is wrong too; blank "
               "where an adaptive run had stopped the point.")
    families_run = [f.spec for f in report.families if any(p.family == f.spec and p.outcomes for p in report.points)]
    tabs = st.tabs(families_run) if families_run else []
    for tab, family in zip(tabs, families_run, strict=True):
        with tab:
            cells = plots.outcome_cells(report, family)
            st.plotly_chart(plots.outcome_grid(cells, family), width="stretch")
            failed = cells[~cells["outcome"].isin(["both_right", "both_wrong"])].copy()
            if failed.empty:
                st.caption("Nothing lost or gained: every item came out as full's did at every budget.")
                continue
            failed["open"] = [item_link(spec, item, request.workload.seed, compare_tokens)
                              for spec, item in zip(failed["spec"], failed["item"], strict=True)]
            st.dataframe(failed, hide_index=True, width="stretch", column_config={
                "open": st.column_config.LinkColumn("in Compare", display_text="open"),
                "outcome": st.column_config.TextColumn("cause")})

if isinstance(request.workload, PromptWorkload) and len(request.workload.prompts) > 1:
    st.subheader("Every prompt")
    st.caption("Each prompt's agreement with full under each configuration (teacher-forced): the mean above hides "
               "the prompts that fall apart. Sorted by the worst configuration's agreement.")
    per_prompt = plots.prompt_outcomes(report)
    st.dataframe(per_prompt, width="stretch",
                 column_config={c: st.column_config.ProgressColumn(c, min_value=0.0, max_value=1.0, format="percent")
                                for c in per_prompt.columns})

st.subheader("Every point")
st.dataframe(table[shown_columns], hide_index=True, width="stretch", column_config={
    "compression": st.column_config.NumberColumn("compression", format="%.2fx"),
    "kv_bytes": st.column_config.NumberColumn("KV bytes", format="%d"),
    in_layout[0]: st.column_config.NumberColumn(f"{LABELS[report.layout]}: bytes", format="%d"),
    in_layout[1]: st.column_config.NumberColumn(f"{LABELS[report.layout]}: compression", format="%.2fx"),
    "accuracy_ci": st.column_config.TextColumn("accuracy 95%"),
    "agreement_ci": st.column_config.TextColumn("agreement 95%"),
    "tail_ci": st.column_config.TextColumn("tail 95%"),
    "verdict": st.column_config.TextColumn("verdict", help=f"against full on the same items at a {margin:g}-point "
                                                           "margin: within margin, beyond margin, worse (within "
                                                           "margin unproven) or inconclusive"),
    "stopped": st.column_config.TextColumn("stopped", help="why an adaptive run stopped giving it items"),
    "versus_full": st.column_config.TextColumn("difference from full [95%, anytime-valid]"),
    "p_adjusted": st.column_config.NumberColumn("within-margin p (adjusted)", format="%.3g"),
    "open": st.column_config.LinkColumn("in Compare", display_text="open"),
    **{key: st.column_config.NumberColumn(MEASURES[key].label, format="%.3f") for key in report.frontiers},
})
st.caption("Open a point in Compare to see what it keeps and where its output parts from full's"
           + (" (on the sweep's first item; the grids above open every failure)." if on_items else "."))

left, right = st.columns(2)
left.download_button("Points as CSV", lambda: table.drop(columns=["open"]).to_csv(index=False), "kvviz-sweep.csv",
                     "text/csv", on_click="ignore")
right.download_button("Sweep as JSON", lambda: json.dumps(report.to_json(), indent=1), "kvviz-sweep.json",
                      "application/json", on_click="ignore")

"""Tail risk: multi-key, multi-value and multi-hop retrieval and system-prompt instructions, per method."""

import json

import pandas as pd
import streamlit as st

from kvviz.methods import budget_spec
from kvviz.runs import TailRequest
from kvviz.runtime.models import LoadedModel
from kvviz.studies.needle import MODES
from kvviz.studies.tail import TailReport
from kvviz.studies.tail_items import MAX_HOPS, PROTECT, TASKS
from kvviz_app import plots
from kvviz_app.chrome import page_header, require_model
from kvviz_app.inputs import token_texts
from kvviz_app.results import run_button, run_pressed
from kvviz_app.url import choice_setting, choices_setting, plural, share_settings
from kvviz_app.widgets import method_grid

LENGTHS = [192, 256, 384, 512, 1024, 2048]  # multikey and multivalue need more than 128 tokens
DEPTHS = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9]
MAX_CONFIGS = 4

page_header("Tail risk", "Tail risk: what the single needle does not show",
            "A method can find one pass key and still lose a distractor-laden key, one of several values, one hop of "
            "a chain or an instruction of the system prompt. Items are kept only where the full cache gets them "
            "right, so every failure below is the method's; the eviction ledger names the planted tokens it lost.",
            link_settings=("m", "task", "len", "depth", "hops", "mode", "protect"))

loaded = require_model()

with st.sidebar:
    st.subheader("Tasks")
    tasks = choices_setting("Task families", "task", list(TASKS), list(TASKS), key="tail_tasks")
    lengths = choices_setting("Prompt lengths (tokens)", "len", LENGTHS, [256], key="tail_lengths", cast=int)
    depths = choices_setting("Depth of the first planted statement", "depth", DEPTHS, [0.25], key="tail_depths",
                             cast=float, format_func=lambda d: f"{d:.0%}")
    hops = choices_setting("vartrack hops (k)", "hops", list(range(1, MAX_HOPS + 1)), [1, 2], key="tail_hops",
                           cast=int, help="A chain of k assignments; k=1 is a single needle.")
    mode = choice_setting("Mode", "mode", MODES, MODES[0], key="tail_mode", widget=st.radio,
                          help="query_aware compresses the prompt with the question in it; query_agnostic "
                               "compresses the context alone and asks afterwards.")
    protect = choices_setting("Also run each eviction method protecting", "protect", list(PROTECT), ["system"],
                              key="tail_protect", help="system: the system turn (the instructions); planted: every "
                              "planted statement (an oracle). Protected tokens are kept on top of the method's budget.")

st.caption("`full` always runs first: it decides which items count.")
grid = method_grid("tail", [s for s in (budget_spec("streaming_llm", 64), budget_spec("snapkv", 64)) if s],
                   MAX_CONFIGS, per_row=MAX_CONFIGS, noun="method")
valid = grid.valid
share_settings(m=grid.shared, task=tasks, len=sorted(lengths), depth=sorted(depths), hops=sorted(hops), mode=mode,
               protect=protect)
items = sum((len(hops) if t == "vartrack" else 1) * (1 if t == "instructions" else len(depths)) for t in tasks)
items *= len(lengths)
runs = 1 + len(valid) + len(protect) * sum(s != "full" for s in valid)
st.caption(f"{plural(items, 'prompt')} × up to {plural(runs, 'run')} each; on a CPU each run takes a few seconds, "
           "longer prompts more.")
chosen = bool(tasks and lengths and depths) and ("vartrack" not in tasks or hops)
if not chosen:
    st.warning("Choose at least one task, length and depth (and a hop count for vartrack).")
if grid.blocked():
    st.warning(grid.blocked())
ready = chosen and grid.ready
asked = TailRequest(tuple(valid), tuple(tasks), tuple(sorted(lengths)), tuple(sorted(depths)), tuple(sorted(hops)),
                    mode, tuple(protect))


def failure_view(loaded: LoadedModel, report: TailReport, frame: pd.DataFrame) -> None:
    """Every failed run, and for the one picked: its context with the planted statements it kept or lost."""
    st.subheader("Failures: what each one lost")
    failures = frame[~frame["correct"]]
    if failures.empty:
        st.caption("Every method got every kept item right.")
        return
    causes = failures["cause"].value_counts().to_dict()
    st.caption(f"{plural(len(failures), 'failed run')}: " + ", ".join(f"{n} {cause}" for cause, n in causes.items())
               + ". evicted: a planted statement the answer needed left the cache in some layer; not evicted: the "
                 "planted tokens all stayed, the method lost other context; quantization: nothing was evicted.")
    choices = {f"{row.method} · {row.item_id}": index for index, row in failures.iterrows()}
    chosen = st.selectbox("Failure", list(choices), key="tail_failure")
    cell = report.cells[choices[chosen]]
    item = next(i for i in report.items if i.item_id == cell.item_id)
    left, right = st.columns([3, 2])
    with left:
        tokens = token_texts(loaded.name, tuple(item.ids), loaded.tokenizer)
        st.html(plots.tail_context_html(tokens, cell.evicted_share, [(s.label, s.positions) for s in item.spans]))
        st.caption("Planted statements: green = kept in every layer and head, red = evicted (darker: more layers). "
                   "Other tokens fade the more they were evicted.")
    with right:
        st.markdown(f"**Answer** ({cell.method}): `{cell.answer.strip()}`")
        st.markdown("**Checks**: " + ", ".join(f"{k} {'met' if ok else 'missed'}" for k, ok in cell.checks.items()))
        st.dataframe(pd.DataFrame([{"span": f.label, "role": f.role, "evicted": f.evicted, "first step": f.evicted_step,
                                    "layers": len(f.evicted_layers)} for f in cell.spans]), hide_index=True,
                     width="stretch")
    st.dataframe(failures[["method", "task_label", "length", "depth", "answer", "cause", "lost"]], hide_index=True,
                 width="stretch")


@st.fragment
def results_section(loaded: LoadedModel, asked: TailRequest, ready: bool) -> None:
    """The run button and everything a report draws. A fragment: pressing Run, Cancel or picking a failure reruns
    this part alone, not the method boxes above it."""
    run_button("Run the tasks", "tail_request", asked, disabled=not ready)
    _, report = run_pressed(loaded, "tail_request", "Choose tasks and methods, then press **Run the tasks**.",
                            "Building prompts…", current=asked)

    calibration = pd.DataFrame(report.calibration)
    beyond = calibration[calibration["kept"] == 0]["task"].tolist()
    st.success(f"{plural(len(report.cells), 'calibrated run')} in {report.seconds:.1f} s. Kept (full right / "
               "generated): " + ", ".join(f"{r.task} {r.kept}/{r.generated}" for r in calibration.itertuples()))
    if beyond:
        st.warning(f"Beyond {loaded.name} at these settings (the full cache never got them right, so they are not "
                   f"scored): {', '.join(beyond)}. A larger model is needed for these.")
    if not report.cells:
        return
    frame = report.to_frame()
    summary = pd.DataFrame(report.summary())
    st.plotly_chart(plots.tail_heatmap(summary), width="stretch")
    if summary["task"].map(lambda t: t == "needle" or t.startswith("vartrack")).any():
        st.plotly_chart(plots.tail_contrast_figure(summary), width="stretch")

    failure_view(loaded, report, frame)

    left, right = st.columns(2)
    left.download_button("Runs as CSV", lambda: frame.drop(columns=["spans", "evicted_share"]).to_csv(index=False),
                         "kvviz-tail.csv", "text/csv", on_click="ignore")
    right.download_button("Report as JSON", lambda: json.dumps(report.to_json(), indent=1, default=str),
                          "kvviz-tail.json", "application/json", on_click="ignore")


results_section(loaded, asked, ready)

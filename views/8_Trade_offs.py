"""Trade-offs: every family of methods across its budgets, quality against memory, and the frontier."""

import json

import streamlit as st

from kvviz.lessons import STORY_QUESTION
from kvviz.methods import REGISTRY, SpecError
from kvviz.runs import SweepRequest
from kvviz.studies.frontier import MEASURES
from kvviz.studies.perplexity import play_names
from kvviz.studies.sweep import DEFAULT_BUDGETS, DEFAULT_FAMILIES, SWEEP_TASKS, check_sweep, read_family
from kvviz_app.chrome import page_header, require_model, settings
from kvviz_app.inputs import encode, prompt_input
from kvviz_app.queue import run_pressed
from kvviz_app.tradeoffs import compare_link, families_from_link, tradeoff_figure
from kvviz_app.url import Read, choice_setting, choices_setting, flag_setting, linked, number_setting, share_settings

DEFAULT_PROMPT = STORY_QUESTION  # calibrated: the full cache answers Ines (kvviz/lessons.py)
BUDGET_CHOICES = (0.03125, 0.0625, 0.125, 0.25, 0.5, 0.75)
WORKLOADS = {"prompt": "Your prompt", "task": "A task", "text": "A play"}
LENGTHS = [256, 512, 1024]

page_header("Trade-offs", "Trade-offs: quality against memory",
            "Which configuration should you deploy at your memory budget, and what does it lose? Each family is "
            "one method (or stack) with one parameter left free, swept across the budgets; every point is "
            "measured. The frontier marks the configurations nothing beats on both memory and quality.",
            link_settings=("w", "m", "b", "n", "chat", "prompt", "task", "len", "play", "tokens"))

loaded = require_model()


@st.cache_data(show_spinner=False)
def family_choices() -> dict[str, str]:
    """SPEC -> what it sweeps: the default families, every registered method, and each kvpress press natively."""
    from kvviz.methods.kvpress.catalog import press_catalog

    names = [n for n in sorted(REGISTRY) if n != "full" and n != "kvpress_native"]
    specs = [*DEFAULT_FAMILIES, *names, *(f"kvpress_native:press={p}" for p in sorted(press_catalog()))]
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
    workload = choice_setting("Quality measured on", "w", list(WORKLOADS), "prompt", key="sweep_workload",
                              widget=st.radio, format_func=WORKLOADS.get,
                              help="Your prompt: agreement with full's continuation (teacher-forced). A task: "
                                   "accuracy on items the full cache gets right. A play: streaming perplexity.")
    budgets = choices_setting("Budgets (share of the full cache)", "b", list(BUDGET_CHOICES), list(DEFAULT_BUDGETS),
                              key="sweep_budgets", cast=float,
                              format_func=lambda b: f"1/{round(1 / b)}" if round(1 / b) * b == 1 else f"{b:.0%}",
                              help="Evictions keep this share of the tokens, lowrank this share of the width; a "
                                   "quantizer's bit widths and merge_heads' head counts are their own budgets.")
    cap = settings().max_new_tokens
    max_new = number_setting("Teacher-forced tokens", "n", min(cap, 24), 1, cap, key="sweep_max_new",
                             disabled=workload != "prompt")
    chat = flag_setting("Chat template", "chat", True, key="sweep_chat", disabled=workload != "prompt")

prompt_text: str | None = None
ids: list[int] | None = None
task, task_length, play, play_tokens = SWEEP_TASKS[0], 512, "hamlet", 512
if workload == "prompt":
    prompt_text = prompt_input("sweep", DEFAULT_PROMPT)
    ids = encode(loaded, prompt_text, chat, int(max_new))
elif workload == "task":
    left, right = st.columns(2)
    with left:
        task = choice_setting("Task", "task", list(SWEEP_TASKS), SWEEP_TASKS[0], key="sweep_task")
    with right:
        task_length = choice_setting("Prompt length (tokens)", "len", LENGTHS, 512, key="sweep_task_length",
                                     widget=st.select_slider, cast=int)
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

choices = family_choices()
linked_families, typed = families_from_link(list(choices), [f for f in DEFAULT_FAMILIES if f in choices])
families = linked("sweep_families", linked_families, lambda value: st.multiselect(
    "Families", list(choices), value, format_func=lambda spec: f"{spec} · {choices[spec]}", key="sweep_families",
    help="A method named without its budget is a family; one with every parameter fixed (fp8) is one point."))
extra = linked("sweep_extra", Read(typed), lambda value: st.text_input(
    "More families or fixed SPECs (separated by spaces)", value, key="sweep_extra",
    placeholder="lowrank+snapkv:budget=0.25  merge_heads+kivi:bits=4"))
specs = list(dict.fromkeys([*families, *extra.split()]))
share_settings(w=workload, m=specs, b=sorted(budgets), n=int(max_new), chat=chat,
               **({"task": task, "len": task_length} if workload == "task" else {}),
               **({"play": play, "tokens": play_tokens} if workload == "text" else {}))

problem = None
try:
    check_sweep(specs, sorted(budgets))
except ValueError as error:
    problem = str(error)
    st.error(problem)
ready = problem is None and (workload != "prompt" or ids is not None)
if st.button("Run the sweep", type="primary", disabled=not ready):
    if workload == "prompt":
        request = SweepRequest.on_prompt(ids, specs, sorted(budgets), int(max_new))
    elif workload == "task":
        request = SweepRequest.on_task(task, specs, sorted(budgets), int(task_length))
    else:
        request = SweepRequest.on_play(play, int(play_tokens), specs, sorted(budgets))
    st.session_state["sweep_request"] = request
    st.session_state["sweep_prompt"] = prompt_text if workload == "prompt" else None

request, report = run_pressed(
    loaded, "sweep_request", "Choose the workload, the families and the budgets, then press **Run the sweep**.",
    "Sizing every family…")

count = len(report.points)
st.success(f"{count} configuration{'s' if count != 1 else ''} on {report.workload} in {report.seconds:.1f} s.")
for line in report.summary:
    st.markdown(f"- {line}")
for note in report.notes:
    st.caption(note)

measure = report.main_measure
if len(report.frontiers) > 1:
    measure = st.radio("Quality measure", list(report.frontiers), format_func=lambda k: MEASURES[k].label,
                       horizontal=True, key="sweep_measure")
st.plotly_chart(tradeoff_figure(report, measure), width="stretch")

prompt = st.session_state.get("sweep_prompt")
compare_tokens = getattr(request.workload, "max_new_tokens", 24)
table = report.to_frame()
table["frontier"] = table["spec"].isin(report.frontiers[measure])
table["open"] = [compare_link(spec, prompt, chat, compare_tokens) for spec in table["spec"]]
shown = [c for c in ("spec", "family", "budget", "kv_bytes", "compression", *report.frontiers, "first_divergence",
                     "frontier", "open", "error") if c in table and (c != "error" or table[c].notna().any())]
st.subheader("Every point")
st.dataframe(table[shown], hide_index=True, width="stretch", column_config={
    "compression": st.column_config.NumberColumn("compression", format="%.2fx"),
    "kv_bytes": st.column_config.NumberColumn("KV bytes", format="%d"),
    "open": st.column_config.LinkColumn("in Compare", display_text="open"),
    **{key: st.column_config.NumberColumn(MEASURES[key].label, format="%.3f") for key in report.frontiers},
})
st.caption("Open a point in Compare to see what it keeps and where its output parts from full's.")

left, right = st.columns(2)
left.download_button("Points as CSV", lambda: table.drop(columns=["open"]).to_csv(index=False), "kvviz-sweep.csv",
                     "text/csv", on_click="ignore")
right.download_button("Sweep as JSON", lambda: json.dumps(report.to_json(), indent=1), "kvviz-sweep.json",
                      "application/json", on_click="ignore")

"""Needle: can each method still retrieve a pass key hidden at a given depth in a prompt of a given length?"""

import json

import streamlit as st

from kvviz.methods import budget_spec
from kvviz.runs import NeedleRequest
from kvviz.studies.needle import MODES
from kvviz_app import plots
from kvviz_app.chrome import page_header, require_model
from kvviz_app.inputs import chat_setting
from kvviz_app.results import run_button, run_pressed
from kvviz_app.url import choice_setting, choices_setting, number_setting, plural, share_settings
from kvviz_app.widgets import method_grid

LENGTHS = [128, 256, 512, 1024, 2048, 4096]
DEPTHS = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]
MAX_CONFIGS = 4

page_header("Needle", "Needle in a haystack",
            "A 5-digit pass key is hidden in filler text at a chosen depth, and the model is asked for it. Each cell "
            "is one method on one haystack; the eviction ledger tells whether the key's tokens were still cached, and "
            "if not, when and in which layers they were dropped.",
            link_settings=("m", "len", "depth", "trials", "mode", "chat", "n"))

loaded = require_model()

with st.sidebar:
    st.subheader("Grid")
    lengths = choices_setting("Prompt lengths (tokens)", "len", LENGTHS, [128, 256], key="lengths", cast=int)
    depths = choices_setting("Needle depths", "depth", DEPTHS, [0.1, 0.5, 0.9], key="depths", cast=float,
                             format_func=lambda d: f"{d:.0%}")
    trials = number_setting("Trials per cell (different keys and filler)", "trials", 1, 1, 5, key="trials")
    mode = choice_setting("Mode", "mode", MODES, MODES[0], key="mode", widget=st.radio,
                          help="query_aware compresses the prompt with the question in it; query_agnostic compresses "
                               "the context alone and asks afterwards (a cache reused for many questions).")
    chat = chat_setting(loaded, True, key="chat")
    max_new = number_setting("Max new tokens", "n", 12, 4, 32, key="needle_n")

grid = method_grid("needle", [s for s in ("full", budget_spec("streaming_llm", 64), budget_spec("snapkv", 64)) if s],
                   MAX_CONFIGS, per_row=MAX_CONFIGS, noun="method")
valid = grid.valid
share_settings(m=grid.shared, len=sorted(lengths), depth=sorted(depths), trials=int(trials), mode=mode, chat=chat,
               n=int(max_new))
cells = len(lengths) * len(depths) * int(trials)
st.caption(f"{plural(cells, 'haystack')} × {plural(len(valid), 'method')} = {plural(cells * len(valid), 'run')}; on a "
           "CPU each takes a few seconds, longer prompts more.")
ready = bool(lengths and depths) and grid.ready
if not lengths or not depths:
    st.warning("Choose at least one length and one depth.")
if grid.blocked():
    st.warning(grid.blocked())
asked = NeedleRequest(tuple(valid), tuple(sorted(lengths)), tuple(sorted(depths)), int(trials), mode, chat,
                      int(max_new))
run_button("Run the grid", "needle_request", asked, disabled=not ready)
_, report = run_pressed(loaded, "needle_request", "Choose methods and a grid, then press **Run the grid**.",
                        "Building haystacks…", current=asked)
frame = report.to_frame()
found = frame.groupby("method", sort=False)["found"].mean()
st.success(f"{plural(len(frame), 'run')} in {report.seconds:.1f} s. Found: "
           + ", ".join(f"{method} {share:.0%}" for method, share in found.items()))
st.plotly_chart(plots.needle_heatmaps(frame), width="stretch")

st.subheader("Failures: where the needle went")
failures = frame[~frame["found"]]
if failures.empty:
    st.caption("Every method found every key.")
else:
    evicted = failures[~failures["survived"]]
    st.caption(f"{plural(len(failures), 'failed run')}; in {len(evicted)} of them the key's tokens had been evicted "
               "from at least one layer. A failure with the key still cached is the model's own mistake, not the "
               "cache's.")
    if not evicted.empty:
        st.plotly_chart(plots.needle_eviction_figure(evicted), width="stretch")
    shown = failures.assign(trial=failures["trial"] + 1)  # counted from 1, as the progress bar does
    st.dataframe(shown[["method", "length", "depth", "trial", "key", "answer", "survived", "evicted_step",
                        "evicted_layers"]], hide_index=True, width="stretch",
                 column_config={"depth": st.column_config.NumberColumn("depth", format="percent")})

left, right = st.columns(2)
left.download_button("Grid as CSV", lambda: frame.to_csv(index=False), "kvviz-needle.csv", "text/csv",
                     on_click="ignore")
right.download_button("Grid as JSON", lambda: json.dumps(report.to_json(), indent=1, default=str), "kvviz-needle.json",
                      "application/json", on_click="ignore")

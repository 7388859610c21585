"""Needle: can each method still retrieve a pass key hidden at a given depth in a prompt of a given length?"""

import json

import streamlit as st

from kvviz.methods import budget_spec
from kvviz.runs import NeedleRequest
from kvviz_app import plots
from kvviz_app.chrome import page_header, require_model
from kvviz_app.queue import run_request
from kvviz_app.url import index_of, query_choices, query_value, share_settings
from kvviz_app.widgets import method_configurator

LENGTHS = [128, 256, 512, 1024, 2048, 4096]
DEPTHS = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]
MAX_CONFIGS = 4

page_header("Needle", "Needle in a haystack",
            "A 5-digit pass key is hidden in filler text at a chosen depth, and the model is asked for it. Each cell "
            "is one method on one haystack; the eviction ledger tells whether the key's tokens were still cached, and "
            "if not, when and in which layers they were dropped.")

loaded = require_model()

with st.sidebar:
    st.subheader("Grid")
    lengths = st.multiselect("Prompt lengths (tokens)", LENGTHS, query_choices("len", [128, 256], LENGTHS, int),
                             key="lengths")
    depths = st.multiselect("Needle depths", DEPTHS, query_choices("depth", [0.1, 0.5, 0.9], DEPTHS, float),
                            format_func=lambda d: f"{d:.0%}", key="depths")
    trials = st.number_input("Trials per cell (different keys and filler)", 1, 5, query_value("trials", 1),
                             key="trials")
    modes = ["query_aware", "query_agnostic"]
    mode = st.radio("Mode", modes, index=index_of(modes, query_value("mode", "query_aware", str)), key="mode",
                    help="query_aware compresses the prompt with the question in it; query_agnostic compresses the "
                         "context alone and asks afterwards (a cache reused for many questions).")
    chat = st.toggle("Chat template", query_value("chat", True), key="chat")
    max_new = st.number_input("Max new tokens", 4, 32, query_value("n", 12), key="needle_n")
    count = st.number_input("Methods", 1, MAX_CONFIGS, min(MAX_CONFIGS, len(st.query_params.get_all("m")) or 3),
                            key="needle_configs")

url_specs = st.query_params.get_all("m") or [s for s in ("full", budget_spec("streaming_llm", 64),
                                                         budget_spec("snapkv", 64)) if s]
specs = []
columns = st.columns(MAX_CONFIGS)
for index in range(int(count)):
    with columns[index].container(border=True):
        specs.append(method_configurator(index, url_specs[index] if index < len(url_specs) else "full",
                                         prefix="needle"))
valid = list(dict.fromkeys(s for s in specs if s is not None))
share_settings(m=valid, len=sorted(lengths), depth=sorted(depths), trials=int(trials), mode=mode, chat=chat,
               n=int(max_new))
cells = len(lengths) * len(depths) * int(trials)
st.caption(f"{cells} haystacks × {len(valid)} methods = {cells * len(valid)} runs; on a CPU each takes a few "
           "seconds, longer prompts more.")
ready = bool(lengths and depths and valid) and None not in specs
if not lengths or not depths:
    st.warning("Choose at least one length and one depth.")
if st.button("Run the grid", type="primary", disabled=not ready):
    st.session_state["needle_request"] = NeedleRequest(tuple(valid), tuple(sorted(lengths)), tuple(sorted(depths)),
                                                       int(trials), mode, chat, int(max_new))

request = st.session_state.get("needle_request")
if request is None:
    st.info("Choose methods and a grid, then press **Run the grid**.")
    st.stop()
try:
    report = run_request(loaded, request, "Building haystacks…", request_key="needle_request")
except ValueError as error:
    st.error(str(error))
    st.stop()
frame = report.to_frame()
found = frame.groupby("method", sort=False)["found"].mean()
st.success(f"{len(frame)} runs in {report.seconds:.1f} s. Found: "
           + ", ".join(f"{method} {share:.0%}" for method, share in found.items()))
st.plotly_chart(plots.needle_heatmaps(frame), width="stretch")

st.subheader("Failures: where the needle went")
failures = frame[~frame["found"]]
if failures.empty:
    st.caption("Every method found every key.")
else:
    evicted = failures[~failures["survived"]]
    st.caption(f"{len(failures)} failed runs; in {len(evicted)} of them the key's tokens had been evicted from at "
               "least one layer. A failure with the key still cached is the model's own mistake, not the cache's.")
    if not evicted.empty:
        st.plotly_chart(plots.needle_eviction_figure(evicted), width="stretch")
    shown = failures.assign(trial=failures["trial"] + 1)  # counted from 1, as the progress bar does
    st.dataframe(shown[["method", "length", "depth", "trial", "key", "answer", "survived", "evicted_step",
                        "evicted_layers"]], hide_index=True, width="stretch",
                 column_config={"depth": st.column_config.NumberColumn("depth", format="percent")})

left, right = st.columns(2)
left.download_button("Grid as CSV", frame.to_csv(index=False), "kvviz-needle.csv", "text/csv")
right.download_button("Grid as JSON", json.dumps(report.to_json(), indent=1, default=str), "kvviz-needle.json",
                      "application/json")

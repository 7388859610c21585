"""Home: pick a model, read its card, see what its KV cache costs."""

import pandas as pd
import plotly.express as px
import streamlit as st

from kvviz.planning.memory import model_card
from kvviz.runtime.embedded import embedded
from kvviz_app.chrome import device_status, model_picker, page_header

page_header(
    None,
    "kvviz: see and measure KV-cache optimization",
    "Every generated token keeps its keys and values for every layer. kvviz runs a real model, shows which "
    "tokens attention relies on, and replays generation under eviction and quantization so you can see what "
    "each method saves and what it silently drops.",
)

loaded = model_picker()
if loaded is None:
    st.info("Choose a model in the sidebar.")
    st.stop()

card = model_card(loaded)
types = card.layer_types
embedded_model = embedded(loaded.name)
rows = {
    "architecture": card.architecture, "layers": types.summary(), "query heads": card.q_heads,
    "KV heads": card.kv_heads, "head dim": card.head_dim, "attention": card.attention, "context": card.context_length,
    "dtype": card.dtype, "weights": f"{card.weight_bytes / 2**20:,.1f} MiB",
    "KV per token": f"{card.kv_bytes_per_token / 2**10:,.1f} KiB" + (" inside the window" if types.has_local else ""),
}
if types.has_local:
    rows["KV per token past the window"] = (f"{card.global_kv_bytes_per_token / 2**10:,.1f} KiB "
                                            f"({types.global_layers} global layers)")
rows["chat template"] = "yes" if loaded.chat else "none (a base model: chat is off)"
if embedded_model is not None:
    rows["terms"] = embedded_model.terms
left, right = st.columns([3, 2])
with left:
    st.subheader("Model card")
    st.table(pd.DataFrame({"value": list(rows.values())}, index=list(rows)).astype(str))
    if types.has_local:
        st.caption(f"Layers {types.listing()}. A local layer attends to the last {types.window} tokens only, so it "
                   f"holds at most {types.window - 1} of them; a global layer holds every token.")
with right:
    st.subheader("Device")
    for key, value in device_status(loaded).items():
        st.metric(key, value)

st.subheader("The KV formula, live" + (", per layer type" if types.has_local else ""))
col_seq, col_batch = st.columns(2)
longest = max(256, card.context_length or 8192)
seq_len = col_seq.slider("Context length (tokens)", 128, longest, min(4096, longest), step=128, key="seq_len")
batch = col_batch.slider("Batch (concurrent sequences)", 1, 64, 1, key="batch")
st.code(card.formula_text(seq_len, batch), language="text")
kv = card.kv_bytes(seq_len, batch)
st.metric("KV cache", f"{kv / 2**20:,.1f} MiB", delta=f"{kv / max(1, card.weight_bytes):.1%} of the weights",
          delta_color="off", delta_arrow="off")
lengths = [2**k for k in range(7, 16) if 2**k <= longest]
frame = pd.DataFrame({"context": lengths, "KV cache (MiB)": [card.kv_bytes(n, batch) / 2**20 for n in lengths]})
figure = px.line(frame, x="context", y="KV cache (MiB)", markers=True,
                 title=f"KV cache grows linearly with context (batch {batch})" if not types.has_local else
                 f"KV cache with context (batch {batch}): past {types.window} tokens only the "
                 f"{types.global_layers} global layers grow")
figure.add_hline(y=card.weight_bytes / 2**20, line_dash="dot", annotation_text="weights")
st.plotly_chart(figure, width="stretch")

st.subheader("Explore")
PAGES = [
    ("views/1_Attention.py", "Attention", "Sinks, heavy hitters and per-head patterns on your prompt."),
    ("views/2_Compare.py", "Compare", "Up to six eviction × quantization setups against the full cache."),
    ("views/3_Needle.py", "Needle", "Which methods still find a pass key, and where they lost it."),
    ("views/4_Memory_planner.py", "Memory planner", "KV gigabytes and sequences per GPU for well-known models."),
    ("views/5_Lessons.py", "Lessons", "A step-by-step walkthrough for a class, run live."),
    ("views/6_Tail_risk.py", "Tail risk", "Multi-key, multi-hop and instruction tasks: what compression loses."),
    ("views/7_Prefix_reuse.py", "Prefix reuse", "A shared preamble reused block by block, and what breaks it."),
    ("views/8_Trade_offs.py", "Trade-offs", "Quality against memory, every method across its budgets: the frontier."),
]
columns = st.columns(4)
for index, (page, label, text) in enumerate(PAGES):
    with columns[index % 4].container(border=True):
        st.page_link(page, label=label, icon="➡️")
        st.caption(text)

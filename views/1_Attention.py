"""Attention: where a real model's attention goes on your prompt (sinks, heavy hitters, per-head patterns)."""

import streamlit as st

from kvviz.planning.memory import model_card
from kvviz.runs import MATRIX_SIZE, AttentionRequest
from kvviz_app import plots
from kvviz_app.chrome import page_header, require_model, settings
from kvviz_app.inputs import chat_setting, encode, prompt_input, token_texts
from kvviz_app.results import result_for
from kvviz_app.url import choice_setting, flag_setting, linked, number_setting, read_number, share_settings

DEFAULT_PROMPT = (
    "The committee met on Tuesday to decide where the new bridge should go. The engineers preferred the northern "
    "site because the riverbed there is solid granite. The mayor preferred the southern site because it is closer "
    "to the market. After two hours the committee chose the northern site, and the mayor agreed on one condition: "
    "a footpath to the market must be built first."
)

page_header("Attention", "Where attention goes",
            "One forward pass over the prompt with kvviz's attention capture: per layer and head, how much attention "
            f"lands on the first tokens (sinks), which tokens receive the most (heavy hitters), and what each head's "
            f"pattern looks like. Attention matrices are block-averaged to at most {MATRIX_SIZE} bins a side; prompts "
            f"over this server's limit ({settings().max_prompt_tokens:,} tokens) are refused unless you let the page "
            "cut their middle.", link_settings=("chat", "sinks", "layer", "head", "prompt", "scope", "hidesinks"))

loaded = require_model()
card = model_card(loaded)

with st.sidebar:
    st.subheader("Capture")
    chat = chat_setting(loaded, False, key="chat")
    sinks = number_setting("Sink tokens", "sinks", 4, 1, 16, key="sinks",
                           help="How many leading tokens count as attention sinks.")
    layer = number_setting("Layer", "layer", card.layers // 2, 0, card.layers - 1, key="layer", slider=True)
    head = linked("head", read_number("head", 0, 0, card.q_heads - 1), lambda value: st.selectbox(
        "Query head", list(range(card.q_heads)), index=value, key="head"))
share_settings(chat=chat, sinks=int(sinks), layer=layer, head=head)

text = prompt_input("attention", DEFAULT_PROMPT, height=120)
ids = encode(loaded, text, chat)
if ids is None:
    st.stop()
stats = result_for(loaded, AttentionRequest(tuple(ids), layer, int(sinks)), "Running the prompt…")

per_layer = stats.sink_mass_per_layer()
left, middle, right = st.columns(3)
left.metric("Prompt tokens", len(ids))
middle.metric(f"Attention on the first {sinks} tokens", f"{sum(per_layer) / len(per_layer):.0%}",
              help="Mean over layers, heads and queries after the sinks.")
right.metric(f"Layer {layer}", f"{per_layer[layer]:.0%}")
st.plotly_chart(plots.sink_mass_figure(per_layer, int(sinks)), width="stretch")

st.subheader(f"Layer {layer}, head {head}")
st.plotly_chart(plots.attention_heatmap(stats.matrices[(layer, head)], len(ids),
                                        f"Attention of layer {layer}, head {head}"), width="stretch")

st.subheader("Heavy hitters")
scope = choice_setting("Score", "scope", ["this layer", "mean over all layers"], "this layer", key="scope",
                       widget=st.radio, horizontal=True,
                       help="Attention each token receives per query that can see it, summed over heads. The mean "
                            "over all layers runs the prompt again with explicit attention in every layer (slower).")
hide_sinks = flag_setting(f"Leave the first {sinks} tokens out of the colour scale", "hidesinks", True,
                          key="hide_sinks")
share_settings(scope=scope, hidesinks=hide_sinks)
if scope == "this layer":
    scores = plots.received_attention(stats.key_attention[layer], int(sinks) if hide_sinks else 0)
else:
    every = result_for(loaded, AttentionRequest(tuple(ids), layer, int(sinks), every_layer=True),
                       "Summing attention over every layer…")
    scores = sum(plots.received_attention(every.key_attention[k], int(sinks) if hide_sinks else 0)
                 for k in every.key_attention) / len(every.key_attention)
tokens = token_texts(loaded.name, tuple(ids), loaded.tokenizer)
st.html(plots.token_shading_html(tokens, scores))
st.caption("Darker tokens receive more attention; hover a token for its position and score.")

st.subheader("Every head of this layer")
st.plotly_chart(plots.head_gallery({h: stats.matrices[(layer, h)] for h in range(card.q_heads)}, len(ids), layer),
                width="stretch")

"""Memory planner: KV gigabytes of well-known models, and how many sequences fit on a GPU next to the weights."""

import pandas as pd
import streamlit as st

from kvviz.cache.layouts import BLOCK_SIZES, DEFAULT_BLOCK_SIZE, LABELS, MEANINGS
from kvviz.methods import SpecError
from kvviz.planning.memory import model_card
from kvviz.planning.planner import (
    GB,
    Plan,
    attention_variants,
    load_catalog,
    make_plan,
    method_bits,
    project_layouts,
)
from kvviz.runs import CompareRequest
from kvviz.studies.needle import build_needle_prompt
from kvviz_app import plots
from kvviz_app.chrome import model_link_notice, model_picker, page_header
from kvviz_app.results import result_for
from kvviz_app.url import choice_setting, linked, number_setting, read_text, share_settings
from kvviz_app.widgets import methods_of

page_header("Memory planner", "Memory planner",
            "No model runs here: the numbers follow from each model's published shape. Architecture decides bytes "
            "per token (MHA, GQA, MQA, MLA); eviction caps the tokens kept; quantization shrinks the bits per "
            "element. The three multiply. GB = 10⁹ bytes.",
            link_settings=("model_config", "context", "batch", "gpu", "wbits", "util", "evict", "budget", "ratio",
                           "kvbits", "group", "residual", "qsource", "qspec", "layout", "block"))
model_link_notice()  # the sidebar's model runs only in the measured section below

catalog = load_catalog()
names = list(catalog.models)
gpus = list(catalog.gpus)

left, right = st.columns([1, 2])
with left:
    name = choice_setting("Model", "model_config", names, "Llama-3-8B", key="model_config")
    card = catalog.card(name)
    contexts = catalog.contexts(name)
    context = choice_setting("Context (tokens)", "context", contexts, 8192 if 8192 in contexts else contexts[-1],
                             key="context", widget=st.select_slider, cast=int,
                             help=f"Up to the {catalog.context(name):,} tokens {name} publishes. "
                             + catalog.models[name].get("context_note", ""))
    batch = number_setting("Concurrent sequences (batch)", "batch", 8, 1, 4096, key="batch")
    gpu = choice_setting("GPU", "gpu", gpus, "NVIDIA A100 (80 GB)", key="gpu")
    weight_bits = choice_setting("Weight bits", "wbits", [4, 8, 16], 16, key="wbits", widget=st.select_slider,
                                 cast=int)
    utilization = number_setting("Usable share of GPU memory", "util", 0.9, 0.5, 1.0, key="util", slider=True,
                                 step=0.05, help="The rest holds activations and the runtime (vLLM's default is 0.9).")

    st.markdown("**Eviction**")
    budget_kind = choice_setting("Budget", "evict", ["keep all", "tokens", "ratio"], "keep all", key="evict",
                                 widget=st.radio, horizontal=True)
    budget = None
    if budget_kind == "tokens":
        budget = float(number_setting("Tokens kept per sequence", "budget", 1024, 1, 1 << 20, key="budget_tokens"))
    elif budget_kind == "ratio":
        budget = number_setting("Share of the context kept", "ratio", 0.2, 0.01, 0.99, key="ratio", slider=True,
                                step=0.01)

    st.markdown("**Quantization**")
    quantizers = methods_of("quantization")
    source = choice_setting("Bits from", "qsource", ["generic", *(["a registered method"] if quantizers else [])],
                            "generic", key="qsource", widget=st.radio, horizontal=True)
    group, residual = 0, 0
    if source == "generic":
        bits = choice_setting("KV bits per element", "kvbits", [1, 2, 3, 4, 8, 16], 16, key="kvbits",
                              widget=st.select_slider, cast=int)
        if bits < 16:
            group = number_setting("Group size (elements per scale + zero point)", "group", 32, 8, 1024, key="group")
            residual = number_setting("Recent tokens kept at 16 bits (residual)", "residual", 0, 0, 1 << 16,
                                      key="residual")
    else:
        spec = linked("qspec", read_text("qspec", quantizers[0]), lambda value: st.text_input(
            "Quantization SPEC", value, key="qspec",
            help=f"One of: {', '.join(quantizers)}, with parameters, e.g. kivi:bits=2"))
        try:
            bits = method_bits(spec, card.head_dim)
            st.caption(f"{spec}: {bits:.2f} bits per element, metadata included")
        except (SpecError, NotImplementedError) as error:
            st.error(str(error) or "this method does not report its bits per element")
            bits = 16
share_settings(model_config=name, context=context, batch=int(batch), gpu=gpu, wbits=weight_bits, util=utilization,
               evict=budget_kind, kvbits=bits if source == "generic" else 16, qsource=source,
               **({"qspec": spec} if source != "generic" else {}),
               **({"group": int(group), "residual": int(residual)} if group else {}),
               **({"budget": int(budget)} if budget_kind == "tokens" else {}),
               **({"ratio": budget} if budget_kind == "ratio" else {}))

plan = Plan(context=int(context), batch=int(batch), budget=budget, kv_bits=float(bits), group_size=int(group),
            residual_tokens=int(residual), weight_bits=weight_bits, gpu_gb=catalog.gpus[gpu], utilization=utilization)
result = make_plan(card, catalog.models[name]["parameters"], plan)

with right:
    st.subheader(f"{name}: {card.attention}, {card.layers} layers, {card.kv_heads} KV heads × {card.head_dim}"
                 if card.attention != "MLA" else f"{name}: MLA, {card.layers} layers, latent {card.mla_latent_dim}")
    token_col, a, b = st.columns(3)
    c, d, _ = st.columns(3)
    token_col.metric("KV per token (16-bit)", f"{card.kv_bytes_per_token / 1e6:,.2f} MB",
                     help=f"{card.kv_bytes_per_token:,} bytes: 2 (K and V) × layers × KV heads × head_dim × 2 bytes"
                     if card.attention != "MLA" else f"{card.kv_bytes_per_token:,} bytes: layers × latent × 2 bytes")
    if card.layer_types.has_local:
        token_col.caption(f"{card.layer_types.summary()}: past {card.layer_types.window:,} tokens each token costs "
                          f"{card.global_kv_bytes_per_token / 1e6:,.3f} MB (global layers only), and eviction "
                          "budgets apply to the global layers.")
    a.metric(f"KV per sequence ({context:,} tokens)", f"{result.kv_bytes_per_sequence / GB:,.2f} GB",
             delta=f"{result.compression:,.1f}x smaller" if result.compression > 1.001 else None,
             delta_color="off", delta_arrow="off")
    b.metric(f"KV for {batch}", f"{result.kv_bytes_total / GB:,.1f} GB")
    c.metric("Weights", f"{result.weight_bytes / GB:,.1f} GB")
    d.metric("Sequences that fit", f"{result.max_sequences:,}")
    if result.weight_bytes > result.usable_bytes:
        st.error(f"The weights alone ({result.weight_bytes / GB:,.0f} GB) exceed the usable memory of one {gpu}: "
                 "this model needs several GPUs or fewer weight bits.")
    elif result.fits:
        st.success(f"{batch} sequences of {context:,} tokens fit; up to {result.max_sequences:,} would.")
    else:
        st.warning(f"{batch} sequences of {context:,} tokens do not fit; at most {result.max_sequences:,} do.")
    st.plotly_chart(plots.gpu_budget_figure(result.weight_bytes / GB, result.kv_bytes_total / GB,
                                            result.usable_bytes / GB, catalog.gpus[gpu]), width="stretch")
    per_token = {f"{k} (16-bit)": v for k, v in attention_variants(card).items()}
    per_token["this plan"] = result.kv_bytes_per_sequence / max(1, context)
    st.plotly_chart(plots.planner_context_figure(per_token, contexts, int(batch), catalog.gpus[gpu]),
                    width="stretch")
    st.caption("Architecture lines show what this model's layers would cache per token with every query head "
               "owning its K and V (MHA), with its own grouping, with one shared K/V head (MQA), and with a latent "
               "(MLA, DeepSeek). 'This plan' applies the eviction and quantization chosen on the left.")

st.subheader("All shipped models under this plan")
rows = []
for other in names:
    other_card = catalog.card(other)
    other_plan = Plan(**{**plan.__dict__, "context": min(int(context), max(catalog.context(other), 1))})
    outcome = make_plan(other_card, catalog.models[other]["parameters"], other_plan)
    rows.append({"model": other, "attention": other_card.attention, "published context": catalog.context(other),
                 "context planned": other_plan.context,
                 "KV bytes / token (16-bit)": other_card.kv_bytes_per_token,
                 "KV GB / sequence": round(outcome.kv_bytes_per_sequence / GB, 3),
                 "weights GB": round(outcome.weight_bytes / GB, 1), "sequences that fit": outcome.max_sequences})
st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")

with st.expander("Measured on the loaded model: each axis's formula next to the bytes a real run holds"):
    if st.toggle("Run the sidebar's model", key="planner_measure"):
        loaded = model_picker()
        if loaded is not None:
            loaded_card = model_card(loaded)
            configs = ["full", "merge_heads:kv_heads=1", "lowrank:rank=64", "kivi:bits=4,residual=0",
                       "lowrank:rank=64+kivi:bits=4,residual=0"]
            prompt = build_needle_prompt(loaded.tokenizer, 256, 0.5)
            comparison = result_for(loaded, CompareRequest(tuple(prompt.ids), tuple(configs), 1))
            done = [r for r in comparison.results if r.axis_factors is not None]
            per_token = {r.method: loaded_card.stored_kv_bytes(1) * r.axis_factors.architecture
                         * r.axis_factors.quantization for r in done}
            measured = {r.method: (len(prompt.ids), r.kv_bytes) for r in done}
            st.plotly_chart(plots.measured_vs_formula_figure(per_token, measured, 4 * len(prompt.ids)),
                            width="stretch")
            st.caption(f"{loaded.name} ({loaded_card.dtype}), one {len(prompt.ids)}-token prompt. Lines: full bytes "
                       "per token x the architecture factor x the quantizer's bits per element; ◆: bytes held.")

LAYOUT_CONFIGS = ("snapkv:budget=0.25", "streaming_llm:window=0.25", "adakv:ratio=0.75", "h2o:heavy=0.125,recent=0.125")
with st.expander(f"Serving layouts: a configuration measured on the loaded model, projected onto {name}"):
    st.caption("kvviz counts the tensors it holds; a serving engine frees a dropped token only when its cache layout "
               "can give the slot back. Run one configuration on a 1,024-token prompt and see how many sequences "
               f"of {context:,} tokens each layout would fit on one {gpu}.")
    config_col, block_col = st.columns(2)
    with config_col:
        spec = choice_setting("Configuration", "layout", LAYOUT_CONFIGS, LAYOUT_CONFIGS[0], key="planner_layout_spec")
    with block_col:
        block_size = choice_setting("Block size (token slots)", "block", BLOCK_SIZES, DEFAULT_BLOCK_SIZE,
                                    key="planner_block", cast=int)
    share_settings(layout=spec, block=block_size)
    if st.toggle("Run it on the sidebar's model", key="planner_layouts"):
        loaded = model_picker()
        if loaded is not None:
            prompt = build_needle_prompt(loaded.tokenizer, 1024, 0.5)
            comparison = result_for(loaded, CompareRequest(tuple(prompt.ids), ("full", spec), 1))
            layouts = comparison.layouts(block_size)
            if spec not in layouts or "full" not in layouts:
                st.error(next((r.error for r in comparison.results if r.error), "the run did not finish"))
            else:
                projected = project_layouts(card, catalog.models[name]["parameters"], plan,
                                            layouts[spec].to_json(), layouts["full"].counted)
                st.dataframe(pd.DataFrame([{
                    "layout": LABELS[p.layout], "share of full": f"{p.share_of_full:.1%}",
                    "KV GB / sequence": round(p.kv_bytes_per_sequence / GB, 3), "sequences that fit": p.max_sequences,
                    "meaning": MEANINGS[p.layout]} for p in projected]), hide_index=True, width="stretch")
                st.caption(f"A projection from the measured model: each layout's share of the full cache, measured "
                           f"on {loaded.name} ({len(prompt.ids):,} tokens, blocks of {block_size}), applied to "
                           f"{name}'s 16-bit cache at {context:,} tokens with {weight_bits}-bit weights. {name}'s "
                           "own heads would choose their own tokens; the eviction and bits set above do not apply.")

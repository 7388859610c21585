"""Compare: one prompt, up to six cache configurations, replayed against the full cache."""

import json

import pandas as pd
import streamlit as st

from kvviz.cache.layouts import BLOCK_SIZES, DEFAULT_BLOCK_SIZE, LABELS, MEANINGS
from kvviz.cache.protocol import OnLocal
from kvviz.comparison.results import Comparison
from kvviz.lessons import STORY_QUESTION
from kvviz.methods import REGISTRY, SpecError, parse_spec
from kvviz.planning.memory import model_card
from kvviz.runs import CompareRequest
from kvviz.runtime.models import LoadedModel
from kvviz_app import plots
from kvviz_app.chrome import page_header, require_model, settings
from kvviz_app.inputs import (
    chat_setting,
    encode,
    item_from_link,
    method_output,
    native_report,
    prompt_input,
    token_texts,
)
from kvviz_app.results import run_button, run_pressed
from kvviz_app.url import (
    choice_setting,
    linked,
    number_setting,
    plural,
    range_slider,
    read_choice,
    share_settings,
)
from kvviz_app.widgets import method_grid, methods_of

MAX_CONFIGS = 6
DEFAULT_PROMPT = STORY_QUESTION  # calibrated: the full cache answers Ines (kvviz/lessons.py, tests/test_lessons.py)

page_header("Compare", "Compare cache configurations",
            "The prompt runs through the model once; each configuration then generates from its own copy of the "
            "cache. `full` keeps everything and is the reference every other output is compared with.",
            link_settings=("m", "n", "chat", "prompt", "show", "kept", "layer", "item", "seed", "block"))

loaded = require_model()


DEFAULT_SPECS = ("full", "streaming_llm:window=0.25", "snapkv:budget=0.25,window=8", "kivi:residual=0")


def default_specs() -> list[str]:
    """full plus budgets relative to the prompt, so a first run on any prompt evicts and quantizes something:
    StreamingLLM and SnapKV keep a quarter of the prompt (SnapKV's 8-query window fits prompts from 36 tokens), KIVI
    stores every token in 2 bits (no fp16 residual). Methods this server does not register are left out."""
    specs = []
    for spec in DEFAULT_SPECS:
        try:
            specs.append(parse_spec(spec).label)
        except SpecError:
            continue
    return specs


cap = settings().max_new_tokens
with st.sidebar:
    st.subheader("Generation")
    max_new = number_setting("Max new tokens", "n", min(cap, 24), 1, cap, key="max_new")
    chat = chat_setting(loaded, True, key="chat",
                        help="Wrap the prompt as one user turn, as the instruct model expects.")

item = item_from_link(loaded)  # a Trade-offs sweep's item, opened here on its own
if item is not None:
    st.info(item[1])
    with st.expander("The item's prompt"):
        st.text(loaded.tokenizer.decode(item[0]))
text = None if item is not None else prompt_input("compare", DEFAULT_PROMPT)

st.subheader("Configurations")
st.caption(f"{len(methods_of('architecture'))} architecture, "
           f"{len([n for n in REGISTRY if REGISTRY[n].kind == 'eviction']) - 1} eviction and "
           f"{len(methods_of('quantization'))} quantization methods are registered; parameters come from each "
           "method's own declaration.")
types = model_card(loaded).layer_types
if types.has_local:
    within = sorted(n for n, cls in REGISTRY.items() if getattr(cls, "on_local_layers", None) is OnLocal.WITHIN_WINDOW)
    st.caption(f"This model: {types.summary()}. A local layer holds at most {types.window - 1} tokens whatever the "
               f"method; {', '.join(within)} narrow{'s' if len(within) == 1 else ''} it further, every other eviction "
               f"method evicts on the {types.global_layers} global layers only (`python -m kvviz methods` says which).")
grid = method_grid("cfg", default_specs(), MAX_CONFIGS, per_row=3)
valid = grid.valid
share_settings(m=grid.shared, n=int(max_new), chat=chat)
ids = item[0] if item is not None else encode(loaded, text, chat, int(max_new))
if grid.blocked():
    st.warning(grid.blocked())
asked = None if ids is None else CompareRequest(tuple(ids), tuple(valid), int(max_new))

DIAGNOSTICS = ("Memory", "Divergence", "Quantization error", "Kept tokens")
NO_DIAGNOSTIC = "none"
BLOCK_CHOICE = {"name": "block", "options": BLOCK_SIZES, "default": DEFAULT_BLOCK_SIZE, "cast": int}  # link's `block`


def layouts_view(comparison: Comparison) -> None:
    """What a serving engine's layouts would hold for the tokens each configuration kept, next to what kvviz counts."""
    st.markdown("**What a serving engine would free**")
    block_size = choice_setting("Block size (token slots per block)", **BLOCK_CHOICE, key="compare_block",
                                help="vLLM's default is 16.")
    share_settings(block=block_size)
    held = comparison.layouts(block_size)
    full = held.get("full")
    if full is None:
        st.caption("The full cache did not finish, so there is no reference to read the layouts against.")
        return
    st.plotly_chart(plots.layouts_figure({m: h.to_json() for m, h in held.items()},
                                         {m: h.freed(full) for m, h in held.items()}, LABELS, block_size),
                    width="stretch")
    st.caption("kvviz counts the tensors it holds; an engine frees a dropped token's memory only when its layout can "
               "give the slot back. " + " ".join(f"**{LABELS[name]}**: {MEANINGS[name]}." for name in MEANINGS))
    by_type = {r.method: r.layout_bytes_by_layer_type(block_size) for r in comparison.results if r.error is None}
    if any(by_type.values()):
        st.dataframe(pd.DataFrame([{"configuration": method, "layer type": kind} | {
            LABELS[name]: f"{value / 2**20:,.2f} MiB" for name, value in layouts.to_json().items()}
            for method, kinds in by_type.items() for kind, layouts in kinds.items()]), hide_index=True, width="stretch")
        st.caption("Per layer type, each type's blocks shared by its layers only (a block pool per attention type, as "
                   "vLLM's hybrid allocator keeps): local layers free the blocks their window passed, which one pool "
                   "for every layer keeps while a global layer holds the tokens.")


def memory_view(loaded: LoadedModel, comparison: Comparison, measured: list) -> None:
    """Where each configuration's bytes go, what each axis saved, what a serving layout would hold, and how the
    cache grew while decoding."""
    memory = pd.DataFrame([{
        "method": r.method, "codes": r.kv_breakdown.codes, "metadata": r.kv_breakdown.metadata,
        "full_precision": r.kv_breakdown.full_precision, "formula": r.kv_bytes_full,
    } for r in measured])
    if memory.empty:
        st.caption("No configuration finished, so there is no memory to show.")
        return
    card = model_card(loaded)
    st.plotly_chart(plots.memory_figure(memory, card.weight_bytes), width="stretch")
    st.plotly_chart(plots.axis_factors_figure({r.method: r.axis_factors.to_json() for r in measured
                                               if r.axis_factors is not None}), width="stretch")
    layouts_view(comparison)
    st.plotly_chart(plots.kv_growth_figure({r.method: r.kv_bytes_per_step for r in measured}), width="stretch")
    st.plotly_chart(plots.layer_bytes_figure({r.method: r.kv_bytes_per_layer for r in measured},
                                             card.layer_types.labels()), width="stretch")


def divergence_view(measured: list) -> None:
    """Each method's KL from full at every generated token, teacher-forced on full's tokens."""
    kl = {r.method: r.kl_per_step for r in measured if r.kl_per_step and r.method != "full"}
    if not kl:
        st.caption("No configuration besides full produced per-step KL in this run.")
        return
    st.plotly_chart(plots.kl_figure(kl), width="stretch")


def quantization_view(comparison: Comparison) -> None:
    """How far the quantized keys and values are from the originals, and why keys are quantized per channel."""
    report = comparison.quantization
    if report is None:
        st.caption("No configuration in this run quantizes the cache.")
        return
    st.plotly_chart(plots.reconstruction_figure({m: (e.key, e.value) for m, e in report.errors.items()}),
                    width="stretch")
    st.caption("Each method stores the prompt's keys and values; the lines show how far what attention reads is "
               "from the original, per layer. Tokens still in a full-precision residual count as exact.")
    ratios = report.key_channels.outlier_ratio
    worst = max(range(len(ratios)), key=ratios.__getitem__)
    st.plotly_chart(plots.key_channel_figure(report.key_channels.absmax), width="stretch")
    st.caption(f"Why keys are quantized per channel (KIVI): a few key channels are far larger than the rest. In layer "
               f"{worst} the largest channel is {ratios[worst]:.0f}x the median one. Quantized per token, such a "
               "channel sets the step for every channel of the token; quantized per channel, it gets its own scale.")


def kept_view(loaded: LoadedModel, comparison: Comparison, measured: list) -> None:
    """Which prompt tokens one method still caches in one layer after a chosen decode step."""
    with_ledger = [r for r in measured if r.ledger is not None and bool((r.ledger.evicted_at >= 0).any())]
    if not with_ledger:
        st.caption("Nothing was evicted in this run: every configuration kept the whole prompt.")
        return
    card = model_card(loaded)
    pick, layer_col, step_col = st.columns(3)
    names = [r.method for r in with_ledger]
    with pick:
        chosen = choice_setting("Method", "kept", names, names[0], key="kept_method")
    result = with_ledger[names.index(chosen)]
    with layer_col:
        layer = number_setting("Layer", "layer", 0, 0, card.layers - 1, key="kept_layer", slider=True)
    last_step = max(0, len(result.token_ids) - 1)
    with step_col:
        step = range_slider("After decode step (0 = right after prefill)", 0, last_step, last_step, key="kept_step")
    share_settings(kept=chosen, layer=layer)
    mask = result.ledger.kept_mask(step, comparison.prompt_tokens)[layer]
    prompt_tokens = token_texts(loaded.name, tuple(comparison.prompt_ids), loaded.tokenizer)
    fraction = plots.kept_fraction(mask)
    kind = card.layer_types.kind(layer)
    window = "" if kind == "global" else (f" A local layer (window {card.layer_types.window}) keeps at most the last "
                                          f"{card.layer_types.window - 1} tokens whatever the method: the model's own "
                                          "attention never reads further.")
    st.caption(f"{chosen}, layer {layer}, after step {step}: {fraction.mean():.0%} of prompt tokens cached (green: "
               f"every KV head kept it, amber: some, red: none). Layer {layer} is {kind}.{window}")
    st.html(plots.kept_map_html(prompt_tokens, fraction))
    st.plotly_chart(plots.kept_heatmap(mask, f"{layer} ({kind})", chosen), width="stretch")


def diagnostics_section(loaded: LoadedModel, comparison: Comparison) -> None:
    """One diagnostic at a time, the one the reader picks (none at first)."""
    # Diagnostics are drawn when a reader asks for one: drawing seven charts and a 2K-token map took the browser 2-3 s
    # on every visit (loading Plotly alone about 0.7 s), for readers who mostly look at the outputs and the table. Each
    # is one click away; a link names the one to open (``show``), and a link naming a kept-token setting opens that one.
    measured = [r for r in comparison.results if r.error is None]
    st.subheader("Diagnostics")
    read = read_choice("show", "Kept tokens" if "kept" in st.query_params else NO_DIAGNOSTIC,
                       (NO_DIAGNOSTIC, *DIAGNOSTICS))
    shown_view = linked("compare_show", read, lambda value: st.segmented_control(
        "Draw", DIAGNOSTICS, default=None if value == NO_DIAGNOSTIC else value, key="compare_show"))
    share_settings(show=shown_view or NO_DIAGNOSTIC)
    if shown_view is None:
        st.caption("Pick one to draw it: where each configuration's bytes go, its KL from full at every token, how far "
                   "quantized keys and values are from the originals, or which prompt tokens each layer kept.")
    elif shown_view == "Memory":
        memory_view(loaded, comparison, measured)
    elif shown_view == "Divergence":
        divergence_view(measured)
    elif shown_view == "Quantization error":
        quantization_view(comparison)
    else:
        kept_view(loaded, comparison, measured)


@st.fragment
def results_section(loaded: LoadedModel, asked: CompareRequest | None, ready: bool) -> None:
    """The run button and everything a result draws. A fragment: pressing Run, or picking a diagnostic, reruns this
    part alone, not the prompt and the configuration grid above it (their widgets were most of what a rerun sent)."""
    run_button("Run comparison", "compare_request", asked, disabled=asked is None or not ready)
    _, comparison = run_pressed(loaded, "compare_request", "Set up the configurations and press **Run comparison**.",
                                "Starting…", current=asked)
    results = comparison.results
    st.success(f"{plural(len(results), 'configuration')} on {comparison.prompt_tokens} prompt tokens "
               f"(prefill {comparison.prefill_seconds:.2f} s on {comparison.device}).")

    st.subheader("Outputs")
    st.caption("Red marks where an output first departs from the full cache's.")
    columns = st.columns(min(3, len(results)))
    for index, result in enumerate(results):
        with columns[index % len(columns)]:
            if method_output(loaded, result) and result.agreement_with_full is not None:
                st.caption(f"agreement with full {result.agreement_with_full:.0%} · "
                           f"first divergence {'none' if result.first_divergence is None else result.first_divergence}")

    table = pd.DataFrame([{
        "method": r.method,
        "agreement": r.agreement_with_full,
        "mean KL": r.mean_kl,
        "first divergence": r.first_divergence,
        "KV bytes": r.kv_bytes,
        "full KV bytes": r.kv_bytes_full,
        "compression": r.compression,
        "seconds": round(r.seconds, 3),
        "error": r.error or "",
    } for r in results])
    st.subheader("Quality and memory")
    st.dataframe(table, hide_index=True, width="stretch", column_config={
        "agreement": st.column_config.ProgressColumn("agreement", min_value=0.0, max_value=1.0, format="percent"),
        "compression": st.column_config.NumberColumn("compression", format="%.2fx"),
    })

    native = [r for r in results if r.native_report is not None or (r.error and r.method.startswith("kvpress_native"))]
    if native:
        st.subheader("What the kvpress presses did")
        st.caption("kvpress_native runs each press in kvpress's own hooks, then matches every row it left to the "
                   "prompt token it came from. Besides dropping rows, a press may change what it keeps:")
        for result in native:
            native_report(result)

    diagnostics_section(loaded, comparison)

    st.subheader("Download")
    block_size = read_choice(**BLOCK_CHOICE).value  # the Memory view's, via the link (shown or not)
    left, right = st.columns(2)
    left.download_button("Results as CSV", lambda: table.to_csv(index=False), "kvviz-compare.csv", "text/csv",
                         on_click="ignore")
    right.download_button("Results as JSON", lambda: json.dumps(comparison.to_json(block_size=block_size), indent=1),
                          "kvviz-compare.json", "application/json", on_click="ignore",
                          help=f"Every result, its eviction ledger and its serving layouts at blocks of {block_size} "
                               "token slots (the Memory diagnostic's block size).")


results_section(loaded, asked, grid.ready)

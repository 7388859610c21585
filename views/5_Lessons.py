"""Lessons: a guided walkthrough for a class, each step backed by a live run of the real model.

Each step is one function registered with :func:`step`; the material (prompts, settings, reference answers) lives
in kvviz/lessons.py, calibrated on the default model. Adding a step means adding one function here.
"""

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import streamlit as st

from kvviz import lessons
from kvviz.comparison.results import Comparison, MethodResult
from kvviz.lessons import NEEDLE_CODE, RUNS, SINKS, LessonRun, attention_request, axes_run, is_filler_token, span_of
from kvviz.planning.memory import ModelCard, model_card
from kvviz.runtime.embedded import EMBEDDED
from kvviz.runtime.models import LoadedModel, ModelError
from kvviz_app import plots
from kvviz_app.chrome import cached_model, page_header, require_model
from kvviz_app.inputs import encode, method_output, token_texts
from kvviz_app.results import result_for, stays_pressed
from kvviz_app.url import choice_setting, linked, read_number, share_settings


@dataclass(frozen=True)
class Step:
    """What a step draws with: the sidebar's model, its card, and the step's number (its button's key)."""

    loaded: LoadedModel
    card: ModelCard
    number: int

    def live(self, label: str) -> bool:
        """A button that starts this step's run; once pressed it stays on while the step is shown."""
        return stays_pressed(label, f"lesson_button_{self.number}")


STEPS: list[tuple[str, Callable[[Step], None]]] = []


def step(title: str) -> Callable[[Callable[[Step], None]], Callable[[Step], None]]:
    """Register a step (in order of definition) under ``title``."""
    def register(render: Callable[[Step], None]) -> Callable[[Step], None]:
        STEPS.append((title, render))
        return render
    return register


def notice(text: str) -> None:
    """What to notice in the run above."""
    st.info(f"**Notice:** {text}", icon="👀")


def open_elsewhere(run: LessonRun, label: str | None = None) -> None:
    """A link to the page that explores this step further, with the same prompt and settings."""
    st.markdown(f"[{label or f'Open this run in {run.page} →'}]({run.link()})")


def comparison_of(loaded: LoadedModel, run: LessonRun) -> Comparison | None:
    ids = encode(loaded, run.prompt, run.chat_on(loaded.tokenizer), run.max_new_tokens)
    return None if ids is None else result_for(loaded, run.request(ids))


def reference_check(run: LessonRun, full: MethodResult) -> bool:
    """Say whether the full cache gave the answer this step was calibrated on (it may not, on another model)."""
    if run.expected is None:
        return True
    if run.expected in full.text:
        st.success(f"Reference: the full cache answers **{run.expected}**, the right answer.")
        return True
    st.warning(f"On this model the full cache does not answer {run.expected!r}; the step was calibrated on the "
               "default model (SmolLM2-135M-Instruct), so its contrast may not show here.")
    return False


def run_and_show(loaded: LoadedModel, run: LessonRun) -> Comparison | None:
    """The step's run with its outputs side by side and whether full gave the calibrated answer; None when the
    prompt cannot run (the reason shown)."""
    comparison = comparison_of(loaded, run)
    if comparison is not None:
        outputs(loaded, comparison)
        reference_check(run, comparison.results[0])
    return comparison


def outputs(loaded: LoadedModel, comparison: Comparison) -> None:
    """Each method's output side by side with the divergence from full marked, then the numbers."""
    columns = st.columns(len(comparison.results))
    for column, result in zip(columns, comparison.results, strict=True):
        with column:
            method_output(loaded, result)
    st.dataframe(pd.DataFrame([{
        "method": r.method, "agreement with full": r.agreement_with_full, "first divergence": r.first_divergence,
        "KV bytes": r.kv_bytes, "compression": None if r.compression is None else round(r.compression, 2),
    } for r in comparison.results]), hide_index=True, width="stretch")


def answered(result: MethodResult, expected: str | None) -> str:
    return "answers correctly" if expected and expected in result.text else "loses the answer"


@step("1 · What the cache costs")
def cost(step: Step) -> None:
    loaded, card = step.loaded, step.card
    st.markdown(f"""
To write token *N*, the model attends over every earlier token. Recomputing their keys and values at every step
would cost more and more as the text grows, so the model stores them once: for each token, each of the
**{card.layers} layers** keeps a key and a value vector for each of its **{card.kv_heads} KV heads**. That store is
the KV cache. It never shrinks on its own: one more token, one more slice in every layer.

For this model one token costs **{card.kv_bytes_per_token:,} bytes**:
""")
    if card.layer_types.has_local:
        st.markdown(f"Not every layer keeps every token here: {card.layer_types.summary()}. A local layer holds "
                    f"at most {card.layer_types.window - 1} tokens, so past its window a token costs only the global "
                    f"layers' {card.global_kv_bytes_per_token:,} bytes (step 7). This prompt fits in the window.")
    st.code(card.formula_text(1), language="text")
    st.markdown("Press the button to answer a question about a short story and watch the cache grow by the same "
                "amount at every step: a straight line whose slope is the formula above.")
    run = RUNS["cost"]
    if step.live("Generate and measure"):
        comparison = comparison_of(loaded, run)
        if comparison is None:
            return
        result = comparison.results[0]
        st.caption(f"Question: {run.prompt.splitlines()[-1]}  ·  Answer: {result.text}")
        reference_check(run, result)
        st.plotly_chart(plots.kv_growth_figure({"full": result.kv_bytes_per_step}), width="stretch")
        st.metric("Measured at the end", f"{result.kv_bytes:,} B", delta=f"formula: {result.kv_bytes_full:,} B",
                  delta_color="off", delta_arrow="off")
        steps = len(result.kv_bytes_per_step)
        growth = (result.kv_bytes_per_step[-1] - result.kv_bytes_per_step[0]) / max(1, steps - 1)
        notice(f"the prompt's {comparison.prompt_tokens} tokens already cost "
               f"{result.kv_bytes_per_step[0]:,} bytes before the first answer token; each of the {steps - 1} "
               f"steps after adds {growth:,.0f} bytes, the formula's {card.kv_bytes_per_token:,}.")
        open_elsewhere(run)


@step("2 · Three ways to shrink it")
def levers(step: Step) -> None:
    loaded, card = step.loaded, step.card
    mha = 2 * card.layers * card.q_heads * card.head_dim * card.bytes_per_element
    st.markdown(f"""
Three independent levers shrink the cache, and their savings multiply:

- **Architecture** — fewer K/V vectors per token, decided before training. This model ({card.attention}) has
  {card.q_heads} query heads sharing {card.kv_heads} KV heads: it stores {card.kv_bytes_per_token:,} bytes per token
  where giving every query head its own K and V would take {mha:,}. The Memory planner page shows the same lever
  on large models, including DeepSeek's latent cache (MLA).
- **Eviction** — keep fewer tokens. SnapKV lets the prompt's last queries vote for the tokens worth keeping and
  drops the rest once, after the prompt. A paged serving engine (vLLM: blocks of 16 token slots shared by every
  layer and head) frees a block only when no layer and no head keeps any of its tokens, so it would keep almost
  every block of SnapKV's scattered choice; a window of recent tokens frees whole blocks.
- **Quantization** — keep every token but store each number in fewer bits, plus a little metadata to decode them.
  KIVI stores keys in groups along each channel and values in groups along each token (2 bits per number, one
  fp16 scale and zero point per group of 32).

The run below keeps the architecture fixed and compares one eviction and one quantization setting with the full
cache on the same question.
""")
    run = RUNS["levers"]
    if step.live("Compare the levers"):
        comparison = run_and_show(loaded, run)
        if comparison is None:
            return
        _, *others = comparison.results
        memory = pd.DataFrame([{"method": r.method, "codes": r.kv_breakdown.codes,
                                "metadata": r.kv_breakdown.metadata, "full_precision": r.kv_breakdown.full_precision,
                                "formula": r.kv_bytes_full} for r in comparison.results if r.error is None])
        st.plotly_chart(plots.memory_figure(memory, card.weight_bytes), width="stretch")
        notice("; ".join(f"**{r.method}** holds {r.kv_bytes:,} bytes ({r.compression or 0:.1f}x smaller than full) "
                         f"and {answered(r, run.expected)}" for r in others if r.error is None)
               + ". Smaller is not automatically worse, and similar savings can fail differently: read the answers.")
        layouts = comparison.layouts()
        if "full" in layouts:
            st.caption(" ".join(
                f"In a paged engine's shared blocks of 16, {method} would still hold "
                f"{held.paged_shared / layouts['full'].paged_shared:.0%} of full's blocks (it counts "
                f"{held.counted / layouts['full'].counted:.0%})." for method, held in layouts.items()
                if method != "full") + " Compare's memory diagnostic draws every layout.")
        open_elsewhere(run)


@step("3 · Attention sinks")
def sinks(step: Step) -> None:
    loaded = step.loaded
    st.markdown("""
Softmax forces every query to hand out a full unit of attention, even when nothing earlier is relevant. Trained
models learn to park that surplus on the very first tokens, which are visible to every query. Those tokens become
**attention sinks**: they carry little meaning, yet a large share of attention lands on them in almost every layer.

The consequence for eviction is blunt. A sliding window that drops the first tokens takes away the place where
attention rests, and the distribution over the remaining tokens changes everywhere at once. Keeping a handful of
sink tokens next to the window (the StreamingLLM recipe) avoids that.
""")
    run = RUNS["sinks"]
    if step.live("Measure the sinks"):
        ids = encode(loaded, run.prompt, run.chat_on(loaded.tokenizer))
        if ids is None:
            return
        stats = result_for(loaded, attention_request(loaded, ids), "Running the prompt…")
        per_layer = stats.sink_mass_per_layer()
        st.plotly_chart(plots.sink_mass_figure(per_layer, SINKS), width="stretch")
        share = sum(per_layer) / len(per_layer)
        st.metric(f"Attention on the first {SINKS} tokens (mean over layers)", f"{share:.0%}",
                  delta=f"they are {SINKS / len(ids):.0%} of the prompt", delta_color="off", delta_arrow="off")
        st.markdown("The same 40-token budget without sinks (`window`) and with 4 of them (`streaming_llm`):")
        comparison = run_and_show(loaded, run)
        if comparison is None:
            return
        _, window, streaming = comparison.results
        notice(f"the first {SINKS} of {len(ids)} tokens receive {share:.0%} of the attention. With the same 40 tokens "
               f"cached, the window without them {answered(window, run.expected)} "
               f"(agreement with full {window.agreement_with_full or 0:.0%}), the window with them "
               f"{answered(streaming, run.expected)} (agreement {streaming.agreement_with_full or 0:.0%}).")
        open_elsewhere(run)
        open_elsewhere(LessonRun(run.prompt, chat=run.chat, page="Attention", extra={"sinks": SINKS}),
                       "See where this prompt's attention goes in Attention →")


@step("4 · Heavy hitters")
def heavy(step: Step) -> None:
    loaded = step.loaded
    st.markdown("""
Attention is not spread evenly over the rest of the prompt either. A few tokens keep receiving far more attention
than their neighbours: these are **heavy hitters**. Score-based eviction methods keep the tokens with the most
accumulated attention (H2O), the ones the last few prompt tokens look at (SnapKV), or the ones the newest query
looks at (TOVA), and drop the rest. Which tokens those are is worth looking at before trusting them with a budget:
they are not always the words a reader would call important.

Below, every token of the story is shaded by the attention it receives per query, averaged over all layers; the
first four tokens (the sinks) are left out of the colour scale so the heavy hitters show.
""")
    run = RUNS["heavy"]
    if step.live("Find the heavy hitters"):
        ids = encode(loaded, run.prompt, run.chat_on(loaded.tokenizer))
        if ids is None:
            return
        stats = result_for(loaded, attention_request(loaded, ids, every_layer=True),
                           "Summing attention over every layer…")
        scores = sum(plots.received_attention(stats.key_attention[k], SINKS) for k in stats.key_attention)
        tokens = token_texts(loaded.name, tuple(ids), loaded.tokenizer)
        st.html(plots.token_shading_html(tokens, scores))
        ranked = sorted(range(SINKS, len(ids)), key=lambda i: -scores[i])
        top = ranked[:8]
        st.caption("Most attended (after the sinks): " + ", ".join(f"`{tokens[i].strip() or '↵'}` (#{i})"
                                                                   for i in top))
        filler = sum(is_filler_token(tokens[i]) for i in top)
        name = next((i for i in ranked if tokens[i].strip() == "Ines"), None)
        where = f"ranks {ranked.index(name) + 1} of {len(ranked)}" if name is not None else "is not a single token"
        notice(f"{filler} of the 8 most attended tokens are punctuation or function words: in this model such "
               f"tokens soak up attention, much like the sinks do. The winner's name, `Ines`, {where}. A method "
               "that keeps only heavy hitters keeps these tokens first; whether the content survives depends on "
               "what else fits in the budget.")
        open_elsewhere(run, "Explore per layer and head in Attention →")


@step("5 · The tail risk")
def tail(step: Step) -> None:
    loaded = step.loaded
    st.markdown("""
Averages hide the failure that matters. Most of an answer survives aggressive eviction: the grammar, the style, the
general topic. But a question often hinges on **one** token, and a method that guessed wrong about that token
answers confidently and wrongly. Nothing in the output says a token was dropped.

The prompt below hides a code near the start, buries it under filler and asks for it at the end. The full cache
is the reference; the eviction methods keep a fixed budget of 32 tokens. Compare the answers, not just the
agreement score. Quantization has its own version of this risk: fine on average, off on the one number that needed
precision.
""")
    run = RUNS["needle"]
    if step.live("Hide the needle"):
        comparison = run_and_show(loaded, run)
        if comparison is None:
            return
        _, *others = comparison.results
        ids = comparison.prompt_ids
        needle = span_of(loaded.tokenizer, ids, NEEDLE_CODE)
        tokens = token_texts(loaded.name, tuple(ids), loaded.tokenizer)
        where = (f"tokens {needle[0]}–{needle[-1]}" if len(needle) > 1 else f"token {needle[0]}") if needle else "?"
        st.caption(f"The prompt has {len(ids)} tokens; the code {NEEDLE_CODE} sits at {where} "
                   "(counted from 0, chat template included).")
        st.markdown("**Which prompt tokens each method kept** after the prompt (share of the layers × KV heads "
                    "that still cache each token: green all, amber some, red none):")
        for result in others:
            if result.ledger is None:
                continue
            mask = result.ledger.kept_mask(0, comparison.prompt_tokens)
            fraction = plots.kept_fraction(mask.reshape(-1, mask.shape[-1]))
            kept = [float(fraction[i]) for i in needle]
            st.markdown(f"`{result.method}` — the code's tokens are kept by "
                        + ", ".join(f"{share:.0%}" for share in kept) + " of layer-heads; it "
                        + answered(result, run.expected) + ".")
            st.html(plots.kept_map_html(tokens, fraction))
        notice("a method answers the code only while the code's tokens are still cached: check the colour of "
               f"tokens {where} above against each answer.")
        open_elsewhere(run)
        open_elsewhere(LessonRun(run.prompt, page="Needle",
                                 extra={"m": list(run.specs[:3]), "len": 256, "depth": [0.1, 0.5, 0.9]}),
                       "Try hidden keys at other depths and lengths in Needle →")


@step("6 · Three axes, one budget")
def three_axes(step: Step) -> None:
    """Step 6: one share of the full cache spent on heads, on a latent, on tokens or on bits, measured live."""
    loaded, card = step.loaded, step.card
    st.markdown("""
The families of step 2 are three independent knobs: **fewer KV heads** (or a low-rank latent, MLA's idea), **fewer
tokens** (eviction) and **fewer bits** (quantization). Their savings multiply: bytes = full × heads × tokens × bits.
So the interesting question is not which knob saves most, but which one costs least *for the same bytes*.

Below, each knob alone is set to hold the same share of the full cache. Heads are mean-pooled into fewer groups and
the latent is fitted on the prompt itself, with no retraining: real GQA and MLA models are trained that way, this
shows what converting a model after the fact costs. The prompt hides a pass key in filler; the model must say it.
""")
    share = choice_setting("Share of the full cache", "share", [0.25, 1 / 3, 0.5, 2 / 3], 1 / 3,
                           key="lesson_axes_share", widget=st.select_slider, cast=float,
                           format_func=lambda f: f"{f:.0%}")
    share_settings(share=share)
    run = axes_run(loaded, share)
    axes, prompt = run.axes, run.prompt
    st.caption(" · ".join(f"{axis}: `{spec}`" for axis, spec in axes.items()) + (
        " · this model has one KV head already (MQA): the heads axis has none left to merge" if card.kv_heads == 1
        else ""))
    if step.live("Spend the budget three ways"):
        comparison = result_for(loaded, run.request())
        outputs(loaded, comparison)
        label = {spec: axis for axis, spec in axes.items()}
        st.dataframe(pd.DataFrame([{
            "axis": label.get(r.method, "none"), "SPEC": r.method,
            "share of full": None if not r.kv_bytes_full else round(r.kv_bytes / r.kv_bytes_full, 3),
            "agreement with full": r.agreement_with_full, "mean KL": r.mean_kl,
            "pass key found": prompt.key in r.text,
        } for r in comparison.results if r.error is None]), hide_index=True, width="stretch")
        factors = {r.method: r.axis_factors.to_json() for r in comparison.results if r.axis_factors is not None}
        st.plotly_chart(plots.axis_factors_figure(factors), width="stretch")
        st.caption(f"The pass key is {prompt.key}. Bits are KIVI's (2, 4 or 8, whichever is nearest the share on "
                   f"this {card.dtype} model); the token budget is SnapKV's, a share of the prompt.")


@step("7 · One KV head and a window")
def architecture(step: Step) -> None:
    """Step 7: GQA on every layer (SmolLM2) against MQA with most layers on a window (Gemma 3), both measured."""
    st.markdown(f"""
Architecture sets the cache's size before any method runs. The two embedded models show it on one machine:
**SmolLM2-135M** has 30 global layers and **GQA**, 9 query heads sharing 3 KV heads; **Gemma 3 270M** has **MQA**,
4 query heads sharing 1 KV head, and 15 of its 18 layers are **local**: each attends to the last 512 tokens only, so
it never holds more than 511. Only its 3 global layers grow with the text.

Both read one {lessons.ARCH_PROMPT_TOKENS:,}-token pass-key prompt, with `full` and with `{lessons.ARCH_EVICTION}`
({lessons.ARCH_BUDGET} tokens per head on every global layer; local layers keep their window, as kvviz's methods
leave them). The formula, per layer type, then projects both to {lessons.ARCH_PROJECTED:,} tokens.
""")
    if step.live("Measure both models"):
        facts, lines, measured = [], {}, {}
        for name in EMBEDDED:
            try:
                loaded = step.loaded if name == step.loaded.name else cached_model(name)
            except ModelError as error:
                st.error(f"{name} cannot load here: {error}")
                return
            run = lessons.architecture_run(loaded)
            fact = lessons.architecture_facts(loaded, run, result_for(loaded, run.request(), f"{name}: the prompt…"))
            facts.append(fact)
            curves, points = lessons.architecture_curves(model_card(loaded), fact)
            lines, measured = lines | curves, measured | points
        st.dataframe(pd.DataFrame([{
            "model": f.model, "attention": f"{f.attention}: {f.kv_heads} KV of {f.q_heads} heads", "layers": f.layers,
            "tokens": f.tokens, "full (MiB)": round(f.measured_full / 2**20, 2),
            "formula": round(f.formula_full / 2**20, 2), "evicted (MiB)": round(f.measured_evicted / 2**20, 2),
            "eviction saves": f"{f.saved_now:.1f}x", "full at 32K": round(f.projected_full / 2**20),
            "evicted at 32K": round(f.projected_evicted / 2**20), "saves at 32K": f"{f.saved_projected:.0f}x",
            "key found (full, evicted)": f"{f.found_full}, {f.found_evicted}"} for f in facts]),
            hide_index=True, width="stretch")
        st.plotly_chart(plots.architecture_figure(lines, measured), width="stretch")
        small, gemma = facts
        notice(f"at about {lessons.ARCH_PROMPT_TOKENS:,} tokens Gemma's full cache is "
               f"{small.measured_full / gemma.measured_full:.1f}x smaller than SmolLM2's. Eviction to "
               f"{lessons.ARCH_BUDGET} tokens saves SmolLM2 {small.saved_now:.1f}x but Gemma only "
               f"{gemma.saved_now:.1f}x: 15 of its 18 layers held no more than 511 tokens anyway. At "
               f"{lessons.ARCH_PROJECTED:,} tokens the same eviction saves Gemma {gemma.saved_projected:.0f}x: its "
               "global layers are where a long context lives. SmolLM2's context is 8,192 tokens: its 32K figures "
               "are the formula only.")


page_header("Lessons", f"Lessons: KV caches in {len(STEPS)} steps",
            "A walkthrough for a class. Read a step, press its button, and the real model runs on this server; "
            "numbers and outputs are measured, not pre-recorded.", link_settings=("step", "share"))

loaded = require_model()
card = model_card(loaded)
if not loaded.chat:
    st.info(lessons.BASE_MODEL_NOTE, icon="ℹ️")
titles = [title for title, _ in STEPS]
chosen = linked("step", read_number("step", 1, 1, len(titles)), lambda number: st.radio(
    "Step", titles, index=number - 1, horizontal=True, key="step"))
number = titles.index(chosen) + 1
share_settings(step=number)
STEPS[number - 1][1](Step(loaded, card, number))

"""Lessons: a guided walkthrough for a class, each step backed by a live run of the real model."""

import pandas as pd
import streamlit as st

from kvviz import plots
from kvviz.memory import model_card
from ui import (
    attention_stats,
    budget_spec,
    encode,
    method_output,
    methods_of,
    page_header,
    query_value,
    require_model,
    run_comparison,
    share_settings,
    token_texts,
)

STEPS = ["1 · What the cache costs", "2 · Three ways to shrink it", "3 · Attention sinks", "4 · Heavy hitters",
         "5 · The tail risk"]
THREE_AXES_STEP = "6 · Three axes, one budget"
STEPS.append(THREE_AXES_STEP)
STORY = (
    "Every autumn the village of Hallow Creek holds a pumpkin contest. This year the judges were a baker, a "
    "retired sailor and the school's music teacher. The baker liked the round orange pumpkins, the sailor liked "
    "the ones shaped like boats, and the music teacher liked a small white pumpkin that a girl named Ines had "
    "painted with musical notes. After a long argument the judges gave first prize to Ines."
)
NEEDLE = ("Remember this: the locker code is 7319. ", "What is the locker code? Answer with the number only.")
FILLER = ("The hallway was painted pale green and smelled of floor polish. Students walked past the trophy case "
          "on their way to class, talking about football and the weather. ")

page_header("Lessons", "Lessons: KV caches in five steps",
            "A walkthrough for a class. Read a step, press its button, and the real model runs on this server; "
            "numbers and outputs are measured, not pre-recorded.")

loaded = require_model()
card = model_card(loaded)
wanted = query_value("step", 1)
step = st.radio("Step", STEPS, index=min(len(STEPS), max(1, wanted)) - 1, horizontal=True, key="step")
number = STEPS.index(step) + 1
share_settings(step=number)


def live(label: str) -> bool:
    """A button that starts this step's run; once pressed it stays on while the step is shown."""
    key = f"lesson_live_{number}"
    if st.button(label, type="primary", key=f"lesson_button_{number}"):
        st.session_state[key] = True
    return bool(st.session_state.get(key))


def outputs(comparison) -> None:
    """Each method's output side by side with the divergence from full marked, then the numbers."""
    columns = st.columns(len(comparison.results))
    for column, result in zip(columns, comparison.results, strict=True):
        with column:
            method_output(loaded, result)
    st.dataframe(pd.DataFrame([{
        "method": r.method, "agreement with full": r.agreement_with_full, "first divergence": r.first_divergence,
        "KV bytes": r.kv_bytes, "compression": None if r.compression is None else round(r.compression, 2),
    } for r in comparison.results]), hide_index=True, width="stretch")


if number == 1:
    st.markdown(f"""
To write token *N*, the model attends over every earlier token. Recomputing their keys and values at every step
would cost more and more as the text grows, so the model stores them once: for each token, each of the
**{card.layers} layers** keeps a key and a value vector for each of its **{card.kv_heads} KV heads**. That store is
the KV cache. It never shrinks on its own: one more token, one more slice in every layer.

For this model one token costs **{card.kv_bytes_per_token:,} bytes**:
""")
    st.code(card.formula_text(1), language="text")
    st.markdown("Press the button to generate a short answer and watch the cache grow by the same amount at "
                "every step: a straight line whose slope is the formula above.")
    if live("Generate and measure"):
        ids = encode(loaded, STORY + "\n\nWho won the pumpkin contest?", chat=True)
        if ids is not None:
            comparison = run_comparison(loaded, ids, ["full"], 16)
            result = comparison.results[0]
            st.plotly_chart(plots.kv_growth_figure({"full": result.kv_bytes_per_step}), width="stretch")
            st.metric("Measured at the end", f"{result.kv_bytes:,} B",
                      delta=f"formula: {result.kv_bytes_full:,} B", delta_color="off")
            st.caption(f"Answer: {result.text}")

elif number == 2:
    mha = 2 * card.layers * card.q_heads * card.head_dim * card.bytes_per_element
    st.markdown(f"""
Three independent levers shrink the cache, and their savings multiply:

- **Architecture** — fewer K/V vectors per token, decided before training. This model ({card.attention}) has
  {card.q_heads} query heads sharing {card.kv_heads} KV heads: it stores {card.kv_bytes_per_token:,} bytes per token
  where giving every query head its own K and V would take {mha:,}. The Memory planner page shows the same lever
  on large models, including DeepSeek's latent cache (MLA).
- **Eviction** — keep fewer tokens. A method guesses which entries future tokens will not need and drops them.
- **Quantization** — keep every token but store each number in fewer bits, plus a little metadata (a scale and a
  zero point per group) to decode them.

The run below keeps the architecture fixed and compares one eviction and one quantization method with the full
cache on the same prompt.
""")
    if live("Compare the levers"):
        specs = ["full"]
        eviction = next((s for s in (budget_spec(n, 48) for n in ("snapkv", "streaming_llm", "window",
                                                                   *methods_of("eviction")) if n != "full") if s),
                        None)
        specs += [eviction] if eviction else []
        quantizers = methods_of("quantization")
        specs += quantizers[:1]
        if len(specs) == 1:
            st.info("No eviction or quantization method is registered on this server yet; only the full cache runs.")
        ids = encode(loaded, STORY + "\n\nWho were the judges?", chat=True)
        if ids is not None:
            comparison = run_comparison(loaded, ids, specs, 16)
            outputs(comparison)
            memory = pd.DataFrame([{"method": r.method, "codes": r.kv_breakdown.codes,
                                    "metadata": r.kv_breakdown.metadata,
                                    "full_precision": r.kv_breakdown.full_precision, "formula": r.kv_bytes_full}
                                   for r in comparison.results if r.error is None])
            st.plotly_chart(plots.memory_figure(memory, card.weight_bytes), width="stretch")

elif number == 3:
    st.markdown("""
Softmax forces every query to hand out a full unit of attention, even when nothing earlier is relevant. Trained
models learn to park that surplus on the very first tokens, which are visible to every query. Those tokens become
**attention sinks**: they carry little meaning, yet a large share of attention lands on them in almost every layer.

The consequence for eviction is blunt. A sliding window that drops the first tokens takes away the place where
attention rests, and the distribution over the remaining tokens changes everywhere at once. Keeping a handful of
sink tokens next to the window (the StreamingLLM recipe) avoids that.
""")
    if live("Measure the sinks"):
        ids = encode(loaded, STORY, chat=False)
        if ids is not None:
            stats = attention_stats(loaded, ids, card.layers // 2, 4)
            per_layer = stats.sink_mass_per_layer()
            st.plotly_chart(plots.sink_mass_figure(per_layer, 4), width="stretch")
            st.metric("Attention on the first 4 tokens (mean over layers)", f"{sum(per_layer) / len(per_layer):.0%}",
                      delta=f"they are {4 / len(ids):.0%} of the prompt", delta_color="off")
            specs = [s for s in (budget_spec("window", 40), budget_spec("streaming_llm", 40)) if s]
            if specs:
                st.markdown("The same small budget with and without sinks:")
                outputs(run_comparison(loaded, encode(loaded, STORY + "\n\nWho won?", chat=True) or ids,
                                       ["full", *specs], 16))

elif number == 4:
    st.markdown("""
Attention is not spread evenly over the rest of the prompt either. A few tokens (names, numbers, the words a
question will ask about) receive far more attention than their neighbours, and they keep receiving it. These are
**heavy hitters**. Score-based eviction methods keep the tokens with the most accumulated attention (H2O), the
ones the last few prompt tokens look at (SnapKV), or the ones the newest query looks at (TOVA), and drop the rest.

Below, every token of the story is shaded by the attention it receives per query, averaged over all layers; the
first four tokens (the sinks) are left out of the colour scale so the heavy hitters show.
""")
    if live("Find the heavy hitters"):
        ids = encode(loaded, STORY, chat=False)
        if ids is not None:
            stats = attention_stats(loaded, ids, card.layers // 2, 4, every_layer=True)
            scores = sum(plots.received_attention(stats.key_attention[k], 4) for k in stats.key_attention)
            st.html(plots.token_shading_html(token_texts(loaded.name, tuple(ids), loaded.tokenizer), scores))
            ranked = sorted(range(4, len(ids)), key=lambda i: -scores[i])[:8]
            tokens = token_texts(loaded.name, tuple(ids), loaded.tokenizer)
            st.caption("Most attended (after the sinks): " + ", ".join(f"`{tokens[i].strip()}`" for i in ranked))

elif number == 5:
    st.markdown("""
Averages hide the failure that matters. Most of an answer survives aggressive eviction: the grammar, the style, the
general topic. But a question often hinges on **one** token, and a method that guessed wrong about that token
answers confidently and wrongly. Nothing in the output says a token was dropped.

The prompt below hides a code near the start, buries it under filler and asks for it at the end. The full cache
is the reference; the eviction methods keep a fixed budget. Compare the answers, not just the agreement score.
Quantization has its own version of this risk: fine on average, off on the one number that needed precision.
""")
    if live("Hide the needle"):
        prompt = NEEDLE[0] + FILLER * 6 + NEEDLE[1]
        ids = encode(loaded, prompt, chat=True)
        if ids is not None:
            specs = ["full"] + [s for s in (budget_spec("streaming_llm", 32), budget_spec("snapkv", 32, window=16),
                                            budget_spec("h2o", 32)) if s]
            if len(specs) == 1:
                st.info("No eviction method is registered on this server yet; only the full cache runs.")
            outputs(run_comparison(loaded, ids, specs, 8))
            st.caption(f"The prompt has {len(ids)} tokens; the code sits in the first dozen.")


def three_axes_step() -> None:
    """Step 6: one share of the full cache spent on heads, on a latent, on tokens or on bits, measured live."""
    from kvviz.needle import build_needle_prompt
    from kvviz.three_axes import budget_specs

    st.markdown("""
The families of step 2 are three independent knobs: **fewer KV heads** (or a low-rank latent, MLA's idea), **fewer
tokens** (eviction) and **fewer bits** (quantization). Their savings multiply: bytes = full × heads × tokens × bits.
So the interesting question is not which knob saves most, but which one costs least *for the same bytes*.

Below, each knob alone is set to hold the same share of the full cache. Heads are mean-pooled into fewer groups and
the latent is fitted on the prompt itself, with no retraining: real GQA and MLA models are trained that way, this
shows what converting a model after the fact costs. The prompt hides a pass key in filler; the model must say it.
""")
    share = st.select_slider("Share of the full cache", [0.25, 1 / 3, 0.5, 2 / 3], value=1 / 3,
                             format_func=lambda f: f"{f:.0%}", key="lesson_axes_share")
    axes = budget_specs(card, share)
    st.caption(" · ".join(f"{axis}: `{spec}`" for axis, spec in axes.items()))
    if live("Spend the budget three ways"):
        prompt = build_needle_prompt(loaded.tokenizer, 384, 0.5)
        comparison = run_comparison(loaded, prompt.ids, ["full", *axes.values()], 12)  # "The pass key is NNNNN"
        outputs(comparison)
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


if step == THREE_AXES_STEP:
    three_axes_step()

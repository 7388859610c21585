"""Prefix reuse: turns sharing a byte-stable preamble reuse its KV blocks; edits and query-aware eviction break it."""

from dataclasses import dataclass

import pandas as pd
import streamlit as st

from kvviz.methods import SpecError, parse_spec
from kvviz.runs import ContextCostRequest, PrefixSharingRequest, PrefixTurnsRequest
from kvviz.studies.prefix_reuse import (
    DEFAULT_QUESTIONS,
    default_preamble,
    edit_preamble,
    question_turn,
    turn_ids,
)
from kvviz.studies.prefix_sharing import DEFAULT_METHODS
from kvviz_app import plots
from kvviz_app.chrome import page_header, require_model
from kvviz_app.results import pressed, result_for, run_button, stays_pressed
from kvviz_app.url import (
    Read,
    choice_setting,
    choices_setting,
    linked,
    number_setting,
    plural,
    share_settings,
    shown,
)

LENGTHS = [128, 256, 512, 1024, 2048, 4096]
DEFAULT_LENGTHS = [256, 512, 1024, 2048]
EDITS = {"timestamp": "insert a timestamp line", "reorder": "swap two lines"}


@dataclass(frozen=True)
class PrefixRun:
    """What the page ran when its button was last pressed (the results below show this run, not later edits)."""

    preamble: str
    questions: tuple[str, ...]
    block_tokens: int
    edit: str
    edit_line: int
    max_new: int
    specs: tuple[str, ...]
    lengths: tuple[int, ...]


page_header("Prefix reuse", "Prefix reuse",
            "Serving engines with prefix caching (vLLM's block hashes, SGLang's radix tree) keep a prompt's KV in "
            "blocks keyed by a hash of the block's tokens and everything before it. A new prompt that starts with "
            "the same bytes reuses those blocks and prefills only the rest. kvviz does the same here, live.",
            link_settings=("block", "edit", "line", "n", "len", "m"))

loaded = require_model()

with st.sidebar:
    st.subheader("Prefix cache")
    block_tokens = number_setting("Tokens per block", "block", 16, 4, 64, key="prefix_block")
    st.subheader("Byte stability")
    edit = choice_setting("Edit to the preamble", "edit", list(EDITS), "timestamp", key="prefix_edit",
                          widget=st.radio, format_func=EDITS.get)
    edit_line = number_setting("After line", "line", 1, 0, 200, key="prefix_line",
                               help="0 is the first line of the preamble; later lines keep more blocks.")
    st.subheader("Eviction vs reuse")
    max_new = number_setting("Answer tokens compared", "n", 8, 2, 32, key="prefix_n")
    from_link = st.query_params.get_all("m")
    linked_specs = [spec for spec in from_link if spec.strip()]
    empty = None if len(linked_specs) == len(from_link) else (
        f"The link's {shown('m', '')} is empty; "
        + ("it is left out." if linked_specs else "using the default methods."))
    spec_text = linked("prefix_methods", Read("\n".join(linked_specs or DEFAULT_METHODS), empty),
                       lambda text: st.text_area("Eviction methods (one SPEC per line)", text, key="prefix_methods"))
    specs = [line.strip() for line in spec_text.splitlines() if line.strip()]
    spec_errors = []
    for spec in specs:
        try:
            if parse_spec(spec).eviction is None:
                raise SpecError(f"'{spec}' does not evict (quantization alone keeps every token)")
        except SpecError as error:
            spec_errors.append(str(error))
            st.error(str(error))
    st.subheader("Context as a cost")
    lengths = choices_setting("Prompt lengths (tokens)", "len", LENGTHS, DEFAULT_LENGTHS, key="prefix_lengths",
                              cast=int)
share_settings(block=int(block_tokens), edit=edit, line=int(edit_line), n=int(max_new), len=sorted(lengths), m=specs)

preamble = st.text_area("Shared preamble (system prompt and few-shot examples)", default_preamble(), height=220,
                        key="prefix_preamble")
question_text = st.text_area("Questions, one per turn (one per line; the first two are A and B below)",
                             "\n".join(DEFAULT_QUESTIONS), height=80, key="prefix_questions")
questions = [q.strip() for q in question_text.splitlines() if q.strip()]
if not preamble.strip() or not questions:
    st.warning("Enter a preamble and at least one question.")
else:
    with st.expander("How a question is appended"):
        st.code(question_turn(preamble, questions[0]), language=None)
if spec_errors:
    st.warning("An eviction method in the sidebar is invalid (the error is under it): nothing runs until it is fixed.")
chosen = PrefixRun(preamble, tuple(questions), int(block_tokens), edit, int(edit_line), int(max_new), tuple(specs),
                   tuple(sorted(lengths)))
run_button("Run prefix reuse", "prefix_request", chosen,
           disabled=not (preamble.strip() and questions) or bool(spec_errors))
run = pressed("prefix_request", "Set up the preamble, questions and methods, then press **Run prefix reuse**.", chosen)
preamble, questions, block_tokens = run.preamble, list(run.questions), run.block_tokens
edit, edit_line, max_new, specs, lengths = run.edit, run.edit_line, run.max_new, list(run.specs), list(run.lengths)

pieces = [turn_ids(loaded.tokenizer, preamble, q) for q in questions]
preamble_ids = pieces[0][0]
edited_ids = turn_ids(loaded.tokenizer, edit_preamble(preamble, edit, int(edit_line)), questions[-1])
prompts = [preamble_ids + q for _, q in pieces] + [edited_ids[0] + edited_ids[1]]
labels = [f"turn {i + 1}: {q[:32]}" for i, q in enumerate(questions)] + [f"edited preamble, turn {len(questions)}"]

report = result_for(loaded, PrefixTurnsRequest(tuple(map(tuple, prompts)), tuple(labels), int(block_tokens)),
                     "Prefilling each turn fresh and with reuse…", request_key="prefix_request")
turns = report.turns
shared, edited = turns[:-1], turns[-1]

st.subheader("Turns sharing a preamble")
reused = shared[1:]
largest = max((t.max_logit_diff for t in shared), default=0.0)
columns = st.columns(4)
columns[0].metric("Preamble", f"{len(preamble_ids):,} tokens", f"{len(preamble_ids) // int(block_tokens)} blocks",
                  delta_color="off")
if reused:
    last = reused[-1]
    columns[1].metric("Blocks reused (last turn)", f"{last.lookup.hits} / {len(last.lookup.blocks)}")
    columns[2].metric("Time to first token", f"{last.ttft_reused * 1000:.0f} ms",
                      f"{last.ttft_reused / last.ttft_fresh:.2f}x of {last.ttft_fresh * 1000:.0f} ms fresh",
                      delta_color="off")
columns[3].metric("Largest |logit difference|", f"{largest:.1e}", "reuse vs fresh prefill", delta_color="off")
st.plotly_chart(plots.block_table_figure([[b.status for b in t.lookup.blocks] for t in shared],
                                         [t.label for t in shared], int(block_tokens)), width="stretch")
st.plotly_chart(plots.ttft_figure([t.label for t in shared], [t.ttft_fresh for t in shared],
                                  [t.ttft_reused for t in shared]), width="stretch")
st.caption("The first turn finds an empty cache and prefills everything; every later turn reuses the preamble's whole "
           "blocks and feeds only its question (and the preamble's last part block). Logits after reuse match a "
           "fresh prefill to float rounding: the same keys and values, computed in a different order.")
st.dataframe(pd.DataFrame(report.to_rows()[:-1]), hide_index=True, width="stretch", key="prefix_turns_table")

st.subheader("Byte stability")
first_miss = edited.lookup.first_miss
stable = shared[-1]
st.markdown(f"The preamble with one edit ({EDITS[edit]} after line {int(edit_line)}), then the last question: "
            + (f"block **{first_miss}** is the first miss, and every block after it misses too (a block's hash "
               f"covers everything before it). **{edited.lookup.hits}** of {len(edited.lookup.blocks)} blocks "
               f"reused, against {stable.lookup.hits} with the preamble left alone."
               if first_miss is not None else "every block still hit."))
columns = st.columns(3)
columns[0].metric("Blocks reused after the edit", f"{edited.lookup.hits} / {len(edited.lookup.blocks)}")
columns[1].metric("Time to first token, edited", f"{edited.ttft_reused * 1000:.0f} ms",
                  f"{edited.ttft_reused / stable.ttft_reused:.1f}x the byte-stable turn's "
                  f"{stable.ttft_reused * 1000:.0f} ms", delta_color="off")
columns[2].metric("Prefill work added", f"{edited.prompt_tokens - edited.lookup.reused_tokens:,} tokens",
                  f"vs {stable.prompt_tokens - stable.lookup.reused_tokens:,} byte-stable", delta_color="off")
st.plotly_chart(plots.block_table_figure([[b.status for b in t.lookup.blocks] for t in (stable, edited)],
                                         ["byte-stable", "edited"], int(block_tokens)), width="stretch")
st.caption("Keep anything that changes per request (dates, user names, retrieved documents) after the stable part: "
           "an early timestamp makes every request a full prefill.")

st.subheader("Query-aware eviction vs reuse")
if len(pieces) < 2 or not specs:
    st.info("Add a second question and at least one eviction method to compare what eviction keeps for each.")
elif stays_pressed(f"Compress the preamble for A and B ({plural(len(specs) * 2, 'run')})", "prefix_sharing_button"):
    st.caption("The preamble is compressed for question A and for question B. Query-aware: the method sees the "
               "question (SnapKV votes with the question in its observation window). Query-agnostic: the preamble "
               "is compressed alone and the question fed afterwards (kvpress's query-agnostic setting). A prefix "
               "cache can share the compressed preamble only if both questions keep the same tokens.")
    sharing = result_for(loaded, PrefixSharingRequest(tuple(preamble_ids), tuple(pieces[0][1]), tuple(pieces[1][1]),
                                                       tuple(specs), int(max_new)),
                          "Compressing the preamble for two questions…", request_key="prefix_request")
    st.plotly_chart(plots.jaccard_figure([(f"{r.method} ({r.mode.replace('_', '-')})", r.jaccard_per_layer)
                                          for r in sharing.rows]), width="stretch")
    table = pd.DataFrame(sharing.to_rows()).rename(columns={
        "jaccard_mean": "Jaccard (mean)", "kept_per_head": "kept per head", "agreement_own": "agreement, own cache",
        "mean_kl_own": "KL, own cache", "agreement_shared": "agreement, A's cache", "mean_kl_shared": "KL, A's cache"})
    st.dataframe(table, hide_index=True, width="stretch", key="prefix_sharing_table")
    st.caption(f"Quality: question B answered ({int(max_new)} tokens, teacher-forced on the full cache's answer) "
               "from the preamble compressed for B itself and from the one compressed for A; agreement is the share "
               "of steps whose top token matches full's, KL is KL(full ‖ method) per step in nats.")

st.subheader("Context length as a cost")
if lengths and stays_pressed(f"Prefill {plural(len(lengths), 'length')}", "prefix_cost_button"):
    costs = result_for(loaded, ContextCostRequest(tuple(prompts[0]), tuple(sorted(lengths))),
                        "Prefilling each length…", request_key="prefix_request")
    st.plotly_chart(plots.context_cost_figure([c.tokens for c in costs], [c.prefill_seconds for c in costs],
                                              [c.kv_bytes for c in costs]), width="stretch")
    st.caption(f"Measured on {loaded.name} ({loaded.device}): each prompt is the preamble and first question, "
               "repeated or cut to the length. Cache bytes grow linearly with the context, prefill time at least "
               "linearly: every token a reused prefix saves is saved here.")

"""What users hand in and what they read back: prompts (typed or uploaded, length-checked) and outputs."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvviz.comparison.prompts import (
    PROMPT_SET_SUFFIX,
    TEXT_SUFFIXES,
    LengthCheck,
    PromptLine,
    decode_upload,
    prompt_limit,
    read_prompt_set,
    truncate_middle,
)
from kvviz.comparison.results import MethodResult
from kvviz.comparison.session import PromptError, encode_prompt
from kvviz.planning.memory import model_card
from kvviz.runtime.models import LoadedModel
from kvviz_app import plots
from kvviz_app.chrome import settings
from kvviz_app.url import flag_setting, linked, read_number, read_text


def chat_setting(loaded: LoadedModel, default: bool, *, key: str, **kwargs) -> bool:
    """The chat-template toggle (the link's ``chat``); for a model without a chat template (a base model such as
    Gemma 3 270M) off and disabled, with the reason under it."""
    if loaded.chat:
        return flag_setting("Chat template", "chat", default, key=key, **kwargs)
    st.toggle("Chat template", False, key=f"{key}_unavailable", disabled=True, help=loaded.chat_note)
    st.caption(loaded.chat_note)
    return False


def prompt_input(key: str, default: str, height: int = 160) -> str | None:
    """A prompt from a text box (started from the link's ``prompt``, else ``default``) or an uploaded .txt/.md file
    (size-limited).

    A rejected upload returns None (its error shown) rather than falling back to the text box: the page then runs
    nothing until the user removes or replaces the file.
    """
    limit = settings().max_upload_mb
    text = linked(f"{key}_text", read_text("prompt", default),
                  lambda value: st.text_area("Prompt", value, height=height, key=f"{key}_text"))
    upload = st.file_uploader(f"…or upload a .txt / .md file (up to {limit} MB)", type=["txt", "md"],
                              key=f"{key}_file")
    if upload is not None:
        try:
            text = decode_upload(upload.name, upload.getvalue(), limit * 2**20)
            st.caption(f"Using **{upload.name}** ({len(text):,} characters) instead of the text box.")
        except PromptError as error:
            st.error(f"{error}. Nothing runs until you remove or replace the file.")
            return None
    return text


def prompt_set_input(key: str, default: str) -> list[PromptLine] | None:
    """One typed prompt (with an optional expected answer), or a prompt set uploaded as several .txt/.md files or
    one .jsonl file of ``{"prompt": ..., "answer": ...}`` lines. A rejected upload returns None with its error (the
    file, and the line, at fault): nothing runs until the user fixes or removes it."""
    limit = settings().max_upload_mb
    text = linked(f"{key}_text", read_text("prompt", default),
                  lambda value: st.text_area("Prompt", value, height=140, key=f"{key}_text"))
    answer = st.text_input("Expected answer (optional)", key=f"{key}_answer",
                           help="With an answer the prompt is scored by accuracy (the answer appears in the "
                                "output), else by agreement with the full cache's continuation.")
    uploads = st.file_uploader(f"…or upload a prompt set: several .txt / .md files, or one .jsonl file with "
                               f'{{"prompt": ..., "answer": ...}} per line (up to {limit} MB each)',
                               type=[s.lstrip(".") for s in (*TEXT_SUFFIXES, PROMPT_SET_SUFFIX)],
                               accept_multiple_files=True, key=f"{key}_files")
    if uploads:
        try:
            lines = read_prompt_set([(u.name, u.getvalue()) for u in uploads], limit * 2**20)
        except PromptError as error:
            st.error(f"{error}. Nothing runs until you fix or remove the file.")
            return None
        st.caption(f"Using **{len(lines)} prompts** from {len(uploads)} file{'s' if len(uploads) > 1 else ''} "
                   "instead of the text box.")
        return lines
    if not text or not text.strip():
        st.error("The prompt is empty.")
        return None
    return [PromptLine("prompt", text, answer.strip() or None)]


def item_from_link(loaded: LoadedModel) -> tuple[list[int], str] | None:
    """The task item the link's ``item`` (and ``seed``) names, as a sweep scored it: its tokens and a line saying
    what it is; None without one (or, with its error shown, for an id that names no item)."""
    from kvviz.studies.tail_items import item_from_id

    raw = st.query_params.get("item")
    if not raw:
        return None
    seed = read_number("seed", 0, 0, 10**9).value
    try:
        item = item_from_id(loaded.tokenizer, raw, seed)
    except PromptError as error:
        st.error(f"{error}. Using the prompt below instead.")
        return None
    expected = ", ".join(item.expected) or "the system prompt's instructions"
    return item.ids, (f"Task item **{item.item_id}** (seed {seed}) as the Trade-offs sweep scored it: "
                      f"{len(item.ids)} tokens, expected {expected}.")


def encode(loaded: LoadedModel, text: str | None, chat: bool, max_new_tokens: int = 0) -> list[int] | None:
    """Token ids of the prompt, or None after showing why it cannot run (no prompt, empty, too long, no template).

    A prompt over the server's limit is refused unless the user asks to cut its middle (see
    :func:`kvviz.comparison.prompts.truncate_middle`); once they do, only what was cut is shown, no error.
    """
    if text is None:
        return None
    try:
        ids = encode_prompt(loaded.tokenizer, text, chat=chat)
    except PromptError as error:
        st.error(f"Cannot run this prompt: {error}.")
        return None
    check = LengthCheck(len(ids), prompt_limit(model_card(loaded).context_length, settings().max_prompt_tokens,
                                               max_new_tokens))
    if check.too_long:
        if not st.toggle(f"Cut the middle to fit {check.limit:,} tokens", key=f"truncate_{len(ids)}_{check.limit}",
                         help="Keeps the document's start and end (the question), cut before the chat template."):
            st.error(check.message)
            return None
        try:
            truncation = truncate_middle(loaded.tokenizer, text, chat, check.limit)
        except PromptError as error:
            st.error(f"Cannot run this prompt: {error}.")
            return None
        st.info(truncation.message)
        ids = truncation.token_ids
    return ids


@st.cache_data(show_spinner=False, max_entries=64)
def token_texts(model_name: str, ids: tuple[int, ...], _tokenizer, skip_special: bool = False) -> list[str]:
    """Each token decoded on its own, for text shaded token by token."""
    return [_tokenizer.decode([i], skip_special_tokens=skip_special) for i in ids]


def method_output(loaded: LoadedModel, result: MethodResult) -> bool:
    """One method's generated text with where it first departs from the full cache's marked in red; False (and the
    error shown) when the method failed."""
    st.markdown(f"**{result.method}**")
    if result.error:
        st.error(result.error)
        return False
    tokens = token_texts(loaded.name, tuple(result.token_ids), loaded.tokenizer, skip_special=True)
    st.html(plots.divergence_html(tokens, result.first_divergence))
    return True


def native_report(result: MethodResult) -> None:
    """What a kvpress press run natively did besides dropping rows (channels kept, merges, re-rotation, head-wise
    masking), or, when its result could not be mapped to prompt tokens, that nothing of it is drawn and why."""
    st.markdown(f"**{result.method}**")
    report = result.native_report
    if report is None:
        st.warning(f"Not shown: {result.error}. No ledger, kept map or bytes are drawn for this press: kvviz does not "
                   "guess what it kept.")
        return
    st.markdown("\n".join(f"- {line}" for line in report.lines()))
    if report.channels_kept is not None:
        with st.expander("Key channels kept per layer x KV head"):
            st.dataframe(pd.DataFrame(report.channels_kept, columns=[f"head {h}" for h in
                                                                      range(len(report.channels_kept[0]))])
                         .rename_axis("layer"), width="stretch")
    if report.merged_into:
        rows = []
        for layer, targets in report.merged_into.items():
            for head in range(targets.shape[0]):
                into = targets[head][targets[head] >= 0]
                if into.numel():
                    survivors, counts = into.unique(return_counts=True)
                    biggest = int(counts.argmax())
                    rows.append({"layer": layer, "KV head": head, "merged tokens": int(into.numel()),
                                 "into survivors": int(survivors.numel()),
                                 "largest merge": f"token {int(survivors[biggest])} <- {int(counts[biggest])} tokens"})
        with st.expander("Which tokens were merged into which survivor, per layer x KV head"):
            st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")

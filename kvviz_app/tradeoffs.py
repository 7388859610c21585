"""The Trade-offs page's links: a point (or one of its items) opened in Compare, and the families a link names.
The page's figures are :mod:`kvviz_app.plots.tradeoffs`."""

from __future__ import annotations

from urllib.parse import urlencode

import streamlit as st

from kvviz.runtime.cluster import ClusterConfig
from kvviz_app.url import Read, shown

LINKED_PROMPT_CHARS = 4000  # a longer prompt is left out of a link (browsers and proxies cut long addresses)


def compare_link(spec: str, prompt: str | None, chat: bool, max_new_tokens: int) -> str:
    """The Compare page with ``full`` and this SPEC (and the prompt, when the sweep ran on one short enough)."""
    query: dict[str, object] = {"m": ["full", spec] if spec != "full" else ["full"], "n": max_new_tokens}
    if prompt is not None and len(prompt) <= LINKED_PROMPT_CHARS:
        query |= {"prompt": prompt, "chat": int(chat)}
    return f"Compare?{urlencode(query, doseq=True)}"


def item_link(spec: str, item: str, seed: int, max_new_tokens: int) -> str:
    """The Compare page on one task item (rebuilt there from its id and seed) with ``full`` and this SPEC."""
    query = {"m": ["full", spec] if spec != "full" else ["full"], "n": max_new_tokens, "item": item, "seed": seed}
    return f"Compare?{urlencode(query, doseq=True)}"


def families_from_link(offered: list[str], default: list[str]) -> tuple[Read[list[str]], str]:
    """The link's repeated ``m``: the offered families for the multiselect, and every other SPEC, as given, for the
    text box beside it (where the sweep's own check names what is wrong with it). An empty value gets a notice."""
    raw = st.query_params.get_all("m")
    if not raw:
        return Read(default), ""
    listed = list(dict.fromkeys(v for v in raw if v in offered))
    typed = list(dict.fromkeys(v.strip() for v in raw if v not in offered and v.strip()))
    empty = any(not v.strip() for v in raw)
    notice = f"The link's {shown('m', '')} is empty; it is left out." if empty else None
    return Read(listed, notice), " ".join(typed)


# How long the server keeps its Ray workers (and their GPUs) after a sweep, for the next one: loading the model on
# every worker costs minutes, and a class's sweeps come in bursts; then the cluster has them back.
KEEP_WORKERS_SECONDS = 600.0


def sweep_cluster(ray_address: str) -> ClusterConfig | None:
    """Where the page's sweeps run: the Ray cluster ``KVVIZ_RAY_ADDRESS`` names (one worker per GPU, two shards
    each, kept :data:`KEEP_WORKERS_SECONDS` after a sweep), or None, this server, when it is empty."""
    return ClusterConfig(ray_address, keep_seconds=KEEP_WORKERS_SECONDS) if ray_address else None

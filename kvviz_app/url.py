"""Settings in the URL: read a page's settings from it and write them back, so a copied link shares them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import streamlit as st

T = TypeVar("T")


def query_value(name: str, default: T, cast: Callable[[str], T] | None = None) -> T:
    """A setting from the URL's query parameters, or ``default`` when absent or unreadable."""
    raw = st.query_params.get(name)
    if raw is None:
        return default
    convert = cast or type(default)
    try:
        if convert is bool:
            return raw.lower() in ("1", "true", "yes", "on")  # type: ignore[return-value]
        return convert(raw)
    except (TypeError, ValueError):
        return default


def share_settings(**values: object) -> None:
    """Write the page's settings into the URL so that copying it shares them (lists become repeated keys)."""
    for name, value in values.items():
        text = [str(v) for v in value] if isinstance(value, (list, tuple)) else str(int(value) if isinstance(
            value, bool) else value)
        current = st.query_params.get_all(name) if isinstance(text, list) else st.query_params.get(name)
        if current != text:
            st.query_params[name] = text


def index_of(options: Sequence[object], value: object) -> int:
    """Where ``value`` (often from the URL) sits among a widget's options; 0, the first option, when absent."""
    return list(options).index(value) if value in options else 0


def query_choices(name: str, default: list, options: Sequence[object], cast: Callable[[str], object]) -> list:
    """A multi-choice setting from the URL's repeated ``name`` keys, restricted to the offered options; ``default``
    when absent or unreadable."""
    try:
        values = [cast(v) for v in st.query_params.get_all(name)]
    except ValueError:
        values = []
    return [v for v in values if v in options] or default

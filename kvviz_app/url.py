"""Settings in the URL: every page reads its settings through here and writes them back, so a copied link shares them.

A link may be old, hand-edited or mistyped. A value a page cannot use as given is never replaced in silence: out of
range it is clamped, unreadable or unknown it falls back to the default, and a notice under the widget names what the
link asked for and what is used instead (it stays until the user changes that widget). A link setting the page does
not have gets a notice at the top of the page. Method SPECs are checked where they are configured
(:mod:`kvviz_app.widgets`): an invalid one shows the SPEC's own error and runs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import streamlit as st

T = TypeVar("T")
V = TypeVar("V")
NOTICES = "kvviz_link_notices"  # session state: widget key -> (notice, the value the widget started at)
SHOWN_CHARS = 48  # a value from the link is cut to this length in messages
LISTED = 8  # at most this many valid choices are named in a message
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
ICON = ":material/link:"


@dataclass(frozen=True)
class Read(Generic[T]):
    """A setting read from the link: the value the page uses and, when that is not what the link gave, why."""

    value: T
    notice: str | None = None


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 configuration``, ``3 configurations`` (``nouns`` for irregular plurals)."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"


def shown(name: str, raw: object) -> str:
    """``name=value`` as inline code, cut to a readable length and unable to break out of its code span."""
    text = f"{name}={raw}".replace("`", "'").replace("\n", " ").replace("\r", " ")
    return f"`{text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 1] + '…'}`"


def listing(options: Iterable[object]) -> str:
    """The valid choices as a message names them (as the link writes them): all, or the first few and how many more."""
    names = [str(o) for o in options]
    more = len(names) - LISTED
    return ", ".join(names[:LISTED]) + (f" and {more} more" if more > 0 else "")


def _last(name: str, raw: list[str]) -> tuple[str, str]:
    """The value a single-valued setting uses (the last given) and what to say when the link repeats it."""
    if len(raw) < 2:
        return raw[0], ""
    return raw[-1], (f"The link sets `{name}` {len(raw)} times ({', '.join(shown(name, v) for v in raw)}); "
                     "the last one counts. ")


def read_number(name: str, default: T, low: T | None = None, high: T | None = None,
                raw: list[str] | None = None) -> Read[T]:
    """A whole number (``default`` an int) or a real number from the link, clamped into ``[low, high]``."""
    raw = st.query_params.get_all(name) if raw is None else raw
    if not raw:
        return Read(default)
    text, lead = _last(name, raw)
    whole = isinstance(default, int)
    try:
        value = int(text.strip()) if whole else float(text.strip())
        if not math.isfinite(value):
            raise ValueError(text)
    except ValueError:
        return Read(default, f"{lead}The link's {shown(name, text)} is not {'a whole number' if whole else 'a number'}"
                             f"; using the default, {default}.")
    if low is not None and value < low:
        return Read(low, f"{lead}The link's {shown(name, text)} is below {low}, the least allowed; using {low}.")
    if high is not None and value > high:
        return Read(high, f"{lead}The link's {shown(name, text)} is over {high}, the most allowed here; using {high}.")
    return Read(value, lead.strip() or None)


def _cast(cast: Callable[[str], T], text: str) -> T | None:
    try:
        return cast(text.strip())
    except ValueError:
        return None


def read_choice(name: str, default: T, options: Sequence[T], cast: Callable[[str], T] = str,
                raw: list[str] | None = None, ordered: bool = False) -> Read[T]:
    """One of ``options`` from the link; anything else falls back to ``default`` with a notice naming the choices.
    ``ordered`` options (ascending numbers) clamp a value beyond either end to that end."""
    raw = st.query_params.get_all(name) if raw is None else raw
    if not raw:
        return Read(default)
    text, lead = _last(name, raw)
    value = _cast(cast, text)
    if value in options:
        return Read(value, lead.strip() or None)
    if ordered and value is not None and not value < options[0] and not value > options[-1]:
        pass  # inside the range but not offered: the default, below
    elif ordered and value is not None:
        end = options[0] if value < options[0] else options[-1]
        side = "below the least" if end == options[0] else "over the most"
        return Read(end, f"{lead}The link's {shown(name, text)} is {side} offered, {end}; using {end}.")
    return Read(default, f"{lead}The link's {shown(name, text)} is not one of {listing(options)}; "
                         f"using the default, {default}.")


def read_choices(name: str, default: list[T], options: Sequence[T], cast: Callable[[str], T] = str,
                 raw: list[str] | None = None) -> Read[list[T]]:
    """Several of ``options`` from the link's repeated ``name`` keys; values not offered are left out (a notice
    names them), and ``default`` is used when none is left."""
    raw = st.query_params.get_all(name) if raw is None else raw
    if not raw:
        return Read(default)
    values = [_cast(cast, text) for text in raw]
    kept = list(dict.fromkeys(v for v in values if v in options))
    dropped = [text for text, value in zip(raw, values, strict=True) if value not in options]
    if not dropped:
        return Read(kept, None if len(kept) == len(raw) else f"The link repeats a value of `{name}`; it counts once.")
    used = kept or default
    verb = "is" if len(dropped) == 1 else "are"
    return Read(used, f"The link's {', '.join(shown(name, t) for t in dropped)} {verb} not among "
                      f"{listing(options)}; using {', '.join(map(str, used)) or 'none'}"
                      f"{'' if kept else ' (the default)'}.")


def read_flag(name: str, default: bool, raw: list[str] | None = None) -> Read[bool]:
    """On or off from the link (1/0, true/false, yes/no, on/off)."""
    raw = st.query_params.get_all(name) if raw is None else raw
    if not raw:
        return Read(default)
    text, lead = _last(name, raw)
    if text.strip().lower() in TRUE + FALSE:
        return Read(text.strip().lower() in TRUE, lead.strip() or None)
    return Read(default, f"{lead}The link's {shown(name, text)} is not 1 or 0 (on or off); using the default, "
                         f"{'on' if default else 'off'}.")


def read_text(name: str, default: str) -> Read[str]:
    """Free text from the link (a prompt): used as given."""
    raw = st.query_params.get_all(name)
    if not raw:
        return Read(default)
    text, lead = _last(name, raw)
    return Read(text, lead.strip() or None)


def linked(key: str, read: Read[T], make: Callable[[T], V]) -> V:
    """Widget ``key`` built by ``make`` from a setting read from the link, with the read's notice under it as long
    as the widget still holds the value it started at (the link is read only when the widget is first built)."""
    first = key not in st.session_state
    value = make(read.value)
    notices = st.session_state.setdefault(NOTICES, {})
    if first:
        notices.pop(key, None)
        if read.notice:
            notices[key] = (read.notice, value)
    if key in notices:
        message, started = notices[key]
        if value == started:
            st.warning(message, icon=ICON)
        else:
            del notices[key]
    return value


def range_slider(label: str, low: T, high: T, value: T, *, key: str, **options) -> T:
    """A slider over ``[low, high]``; where the range holds one value (a one-token run, a one-layer model) the value
    shown in a disabled number input, since Streamlit refuses a slider whose min equals its max."""
    if high > low:
        return st.slider(label, low, high, value, key=key, **options)
    return st.number_input(label, low, high, low, key=key, disabled=True, **options)


def number_setting(label: str, name: str, default: T, low: T, high: T, *, key: str, slider: bool = False,
                   **options) -> T:
    """A number input (or slider) starting from the link's ``name``, clamped into ``[low, high]``."""
    widget = range_slider if slider else st.number_input
    return linked(key, read_number(name, default, low, high),
                  lambda value: widget(label, low, high, value, key=key, **options))


def choice_setting(label: str, name: str, options: Sequence[T], default: T, *, key: str,
                   widget: Callable = st.selectbox, cast: Callable[[str], T] = str, **kwargs) -> T:
    """A selectbox, radio or select slider starting from the link's ``name`` (one of ``options``)."""
    read = read_choice(name, default, options, cast, ordered=widget is st.select_slider)
    if widget is st.select_slider and len(options) < 2:
        widget = st.selectbox  # a select slider needs two ends (Streamlit's slider refuses min == max)
    if widget is st.select_slider:
        return linked(key, read, lambda value: widget(label, options, value=value, key=key, **kwargs))
    return linked(key, read, lambda value: widget(label, options, index=list(options).index(value), key=key,
                                                  **kwargs))


def choices_setting(label: str, name: str, options: Sequence[T], default: list[T], *, key: str,
                    cast: Callable[[str], T] = str, **kwargs) -> list[T]:
    """A multiselect starting from the link's repeated ``name`` keys."""
    read = read_choices(name, default, options, cast)
    return linked(key, read, lambda value: st.multiselect(label, options, value, key=key, **kwargs))


def flag_setting(label: str, name: str, default: bool, *, key: str, **kwargs) -> bool:
    """A toggle starting from the link's ``name``."""
    return linked(key, read_flag(name, default), lambda value: st.toggle(label, value, key=key, **kwargs))


def unknown_settings(known: Iterable[str]) -> None:
    """A notice naming the link's settings that this page does not have (a typo, or a link to another page)."""
    known = set(known)
    unknown = [name for name in st.query_params if name not in known]
    if unknown:
        names = ", ".join(shown(name, st.query_params.get(name, "")) for name in unknown)
        one = len(unknown) == 1
        st.warning(f"This page has no setting{'' if one else 's'} {names}; {'it is' if one else 'they are'} ignored. "
                   f"Its settings: {', '.join(sorted(known))}.", icon=ICON)


def share_settings(**values: object) -> None:
    """Write the page's settings into the URL so that copying it shares them (lists become repeated keys; a setting
    the link repeated is written once)."""
    for name, value in values.items():
        if isinstance(value, (list, tuple)):
            text = [str(v) for v in value]
        else:
            text = [str(int(value) if isinstance(value, bool) else value)]
        if st.query_params.get_all(name) != text:
            st.query_params[name] = text if isinstance(value, (list, tuple)) else text[0]

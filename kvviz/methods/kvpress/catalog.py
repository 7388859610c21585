"""Which kvpress presses kvviz offers by name: every press kvpress exports, plus the server's own.

The server's own presses are dotted paths the entry points pass in (:func:`configure_presses`, called with the
deployment settings by :func:`kvviz.comparison.startup.apply_settings`): nothing here reads the environment, so a test
or a script says which presses it offers by calling the same function. A path that cannot be loaded costs
only itself: every other press stays available and the problem is one line (``kvviz config`` refuses it).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvviz.cache.spec import SpecError

# Presses that need files this machine cannot reach, with the reason the coverage table prints.
NEEDS_DOWNLOAD: dict[str, str] = {
    "DuoAttentionPress": "downloads per-model head patterns (GitHub) or calibrates on a hub data set",
    "ExpectedAttentionStatsPress": "loads query statistics from the hub (or computes them on a hub data set)",
    "FastKVzipPress": "downloads trained gates from the hub (Jang-Hyun/Fast-KVzip)",
    "KVzapPress": "downloads its scoring model from the hub",
    "LUKVPress": "downloads per-model budget curves (GitHub)",
    "QFilterPress": "downloads per-model Q-filters from the hub",
    "RestoreKVPress": "downloads restore embeddings from the hub",
}


@dataclass(frozen=True)
class OwnPresses:
    """The server's own presses: dotted paths (``KVVIZ_PRESSES``) and whether they may be offered at all (in class
    mode only with ``KVVIZ_ALLOW_PRESSES=1``, since they are imported code)."""

    paths: tuple[str, ...] = ()
    allowed: bool = True


class _Configured:
    """What the entry point configured (none until it does): the one catalog setting of this process."""

    own = OwnPresses()


def configure_presses(paths: Sequence[str], allowed: bool) -> None:
    """Offer the presses at ``paths`` (``package.module.Class``) besides kvpress's, when ``allowed``. The entry points
    call it with ``Settings.presses`` and ``Settings.custom_presses_allowed``; loading waits for the first lookup."""
    _Configured.own = OwnPresses(tuple(paths), allowed)


def own_presses() -> OwnPresses:
    """The server's own presses as the entry point configured them."""
    return _Configured.own


def press_name(cls: type) -> str:
    """The SPEC name of a press class: its class name without ``Press``, lower case (SnapKVPress -> snapkv)."""
    name = cls.__name__
    return (name[: -len("Press")] if name.endswith("Press") and name != "Press" else name).lower()


def load_press_class(path: str) -> type:
    """Import ``package.module.Class`` (or ``package.module:Class``); SpecError in one line when that fails."""
    module_name, _, class_name = path.replace(":", ".").rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as error:
        raise SpecError(f"press '{path}' cannot be imported: {error}") from None
    import kvpress

    if not (isinstance(cls, type) and issubclass(cls, kvpress.BasePress) and dataclasses.is_dataclass(cls)):
        raise SpecError(f"'{path}' is not a kvpress press (a dataclass subclassing kvpress.BasePress)")
    return cls


@functools.cache
def _load_own(own: OwnPresses) -> tuple[tuple[tuple[str, type], ...], tuple[str, ...]]:
    """(name, class) of every loadable own press, and one line per path that cannot be loaded."""
    found: list[tuple[str, type]] = []
    problems: list[str] = []
    if not own.allowed:
        return (), ()
    for path in own.paths:
        try:
            cls = load_press_class(path)
        except SpecError as error:
            problems.append(f"KVVIZ_PRESSES: {error}")
            continue
        found.append((press_name(cls), cls))
    return tuple(found), tuple(problems)


def custom_press_problems() -> list[str]:
    """The configured own presses that cannot be offered, one line each (``kvviz config`` refuses them, and asking
    for a press that is not there says so)."""
    return list(_load_own(_Configured.own)[1])


def kvpress_classes() -> dict[str, type]:
    """Every press class kvpress exports (abstract bases left out), by SPEC name."""
    import kvpress

    abstract = {kvpress.BasePress, kvpress.ScorerPress}
    found = {}
    for export in kvpress.__all__:
        cls = getattr(kvpress, export)
        if isinstance(cls, type) and issubclass(cls, kvpress.BasePress) and cls not in abstract:
            found[press_name(cls)] = cls
    return found


def press_catalog() -> dict[str, type]:
    """kvpress's presses plus the configured own ones, by SPEC name."""
    return {**kvpress_classes(), **dict(_load_own(_Configured.own)[0])}


def not_mappable_reason(cls: type) -> str | None:
    """Why a press's result cannot be shown on kvviz's cache, or None when it can."""
    import kvpress

    if issubclass(cls, kvpress.FinchPress):
        return ("it needs the prompt split by a delimiter token (context, then question) that kvpress's pipeline "
                "inserts; kvviz's prompts carry none")
    if issubclass(cls, kvpress.DecodingPress):
        return ("it compresses while decoding, and kvviz decodes on its own cache (kvpress's hooks are not active "
                "then); PrefillDecodingPress runs its prefill part, kvviz's `decoding` reproduces DecodingPress and "
                "its h2o/tova evict while decoding")
    return None

"""A press's parameters read from its dataclass fields: the CLI, the app and the docs need no hand-written list.

Scalars become :class:`~kvviz.cache.spec.Param` with the field's default (kvpress's compression ratios of 0 become
:data:`DEFAULT_RATIO`, so a press shows an effect by default); a field holding a press becomes an inner press chosen
by name, a list of presses a '/'-separated list of names, a list of numbers one value per layer.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
import types
import typing
from dataclasses import dataclass
from typing import Any

from kvviz.cache.spec import Param
from kvviz.methods.kvpress.catalog import press_catalog, press_name

DEFAULT_RATIO = 0.5  # kvpress's ratios default to 0 (no compression); kvviz shows an effect by default


@dataclass(frozen=True)
class OptionalParam(Param):
    """A press field that may be None (``Optional[int]``): ``none`` in a SPEC."""

    def describe_range(self) -> str:
        return super().describe_range() + " or none"

    def parse(self, method: str, raw: Any) -> Any:
        if raw is None or str(raw).strip().lower() in ("none", ""):
            return None
        return super().parse(method, raw)


@dataclass(frozen=True)
class FieldKind:
    """How one dataclass field is set from a SPEC: a scalar, the name of an inner press, or a '/'-separated list."""

    name: str
    kind: str  # "scalar", "press", "presses", "floats"
    param: Param


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else functools.reduce(operator.or_, rest)), True
    return hint, False


def _is_press_type(hint: Any) -> bool:
    import kvpress

    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return any(isinstance(o, type) and issubclass(o, kvpress.BasePress) for o in options)


def _init_parameters(cls: type) -> list[tuple[str, Any, Any]]:
    """(name, type hint, default) of what the press's constructor takes: its dataclass fields, or the arguments of
    its own ``__init__`` (CriticalKVPress writes one)."""
    try:
        hints = typing.get_type_hints(cls.__init__)
    except (NameError, TypeError):
        hints = {}
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    found = []
    for name, parameter in list(inspect.signature(cls.__init__).parameters.items())[1:]:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) or name.startswith("_"):
            continue
        default = parameter.default if parameter.default is not parameter.empty else dataclasses.MISSING
        spec = fields.get(name)
        if spec is not None and spec.default_factory is not dataclasses.MISSING:
            default = spec.default_factory()
        found.append((name, hints.get(name, parameter.annotation), default))
    return found


def press_fields(cls: type) -> list[FieldKind]:
    """The settable fields of a press class, each with the Param the CLI and the app show for it.

    A decoding press inside another (PrefillDecodingPress's ``decoding_press``) is left unset: kvviz decodes on its
    own cache, where kvpress's decoding hooks do not run.
    """
    import kvpress

    kinds = []
    for name, raw_hint, default in _init_parameters(cls):
        hint, optional = _unwrap_optional(raw_hint)
        origin = typing.get_origin(hint)
        if _is_press_type(hint):
            if isinstance(hint, type) and issubclass(hint, kvpress.DecodingPress):
                continue
            inner = "snapkv" if default in (None, dataclasses.MISSING) else press_name(type(default))
            options = typing.get_args(hint) or (hint,)
            fitting = tuple(sorted(n for n, c in press_catalog().items() if issubclass(c, options)))
            kinds.append(FieldKind(name, "press", Param("inner", str, inner,
                                                        f"inner press by name ({_type_label(hint)})", choices=fitting)))
        elif origin is list and typing.get_args(hint) and _is_press_type(typing.get_args(hint)[0]):
            kinds.append(FieldKind(name, "presses", Param(
                name, str, "knorm/streamingllm", "inner presses by name, '/'-separated, applied in order")))
        elif origin is list and typing.get_args(hint) in ((float,), (int,)):
            kinds.append(FieldKind(name, "floats", Param(
                name, str, "", "'/'-separated, one per layer (empty: the inner press's ratio everywhere)")))
        elif origin is typing.Literal:
            choices = typing.get_args(hint)
            kinds.append(FieldKind(name, "scalar", Param(
                name, str, choices[0] if default is dataclasses.MISSING else default, name, choices=choices)))
        elif hint in (bool, int, float, str):
            if default is dataclasses.MISSING:
                continue  # a required scalar without a default: none of kvpress's presses has one
            if "compression_ratio" in name and default == 0:
                default = DEFAULT_RATIO
            limits = {"min": 0, "max": 0.99} if "compression_ratio" in name else {}
            kind = OptionalParam if optional or default is None else Param
            kinds.append(FieldKind(name, "scalar", kind(name, hint, default, f"{cls.__name__}.{name}", **limits)))
    return kinds


def _type_label(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint).replace("kvpress.presses.", ""))


def ratio_defaults(cls: type) -> dict[str, Any]:
    """The ratio fields of a press with their defaults (an inner press listed by name is built with these)."""
    return {f.name: f.param.default for f in press_fields(cls) if f.kind == "scalar" and "ratio" in f.name}

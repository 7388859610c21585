"""Method widgets built from the methods' own parameter declarations (the registry in kvviz.methods)."""

from __future__ import annotations

import streamlit as st

from kvviz.methods import REGISTRY, Budget, Param, SpecError, parse_spec
from kvviz_app.url import index_of


def methods_of(kind: str) -> list[str]:
    """Registered method names of one kind, ``full`` first."""
    return sorted((n for n, c in REGISTRY.items() if c.kind == kind), key=lambda n: (n != "full", n))


def _param_widget(param: Param, key: str, initial: object) -> object:
    """One widget built from a method's parameter declaration."""
    label, help_text = param.name, f"{param.help} ({param.describe_range()})"
    if param.choices is not None:
        options = list(param.choices)
        return st.selectbox(label, options, index=index_of(options, initial), key=key,
                            help=help_text)
    if param.type is bool:
        return st.checkbox(label, value=bool(initial), key=key, help=help_text)
    if param.type is int:
        return st.number_input(label, value=int(initial), min_value=None if param.min is None else int(param.min),
                               max_value=None if param.max is None else int(param.max), step=1, key=key,
                               help=help_text)
    if param.type is float:
        return st.number_input(label, value=float(initial), min_value=None if param.min is None else float(param.min),
                               max_value=None if param.max is None else float(param.max), key=key,
                               help=help_text, format="%.4f")
    return st.text_input(label, value=str(initial), key=key, help=help_text)


def _declared(name: str, values: dict[str, object]) -> tuple[Param, ...]:
    """The parameters of method ``name`` given the values chosen so far: its own ``params_for`` when the choices decide
    the rest (kvpress_native: the press chosen brings its fields), else its fixed declaration."""
    method = REGISTRY[name]
    params_for = getattr(method, "params_for", None)
    return method.params if params_for is None else params_for(values)


def _initial_values(spec: str) -> dict[str, object]:
    """Method names and parameter values a SPEC from the URL starts the widgets with."""
    try:
        stack = parse_spec(spec)
    except SpecError:
        return {}
    values: dict[str, object] = {}
    for method in stack.members():
        values[method.kind] = method.name
        for param in method.params:
            value = getattr(method, param.name)
            values[f"{method.name}.{param.name}"] = str(value) if isinstance(value, Budget) else value
    return values


def method_configurator(index: int, initial_spec: str, prefix: str = "cfg") -> str | None:
    """Architecture x eviction x quantization widgets for configuration ``index``; its SPEC or None (error shown)."""
    initial = _initial_values(initial_spec)
    chosen: list[str] = []
    for kind, none_label in (("architecture", "none"), ("eviction", "full"), ("quantization", "none")):
        options = methods_of(kind) if kind == "eviction" else [none_label, *methods_of(kind)]
        start = initial.get(kind, none_label)
        name = st.selectbox(kind.capitalize(), options, index=index_of(options, start),
                            key=f"{prefix}{index}_{kind}", help="\n\n".join(
                                f"**{n}**: {REGISTRY[n].summary}" for n in options if n in REGISTRY))
        if name == none_label:
            continue
        values: dict[str, object] = {}
        try:  # one widget at a time: a method's later parameters may depend on earlier choices (kvpress_native)
            while later := [p for p in _declared(name, values) if p.name not in values]:
                param = later[0]
                values[param.name] = _param_widget(param, f"{prefix}{index}_{name}_{param.name}",
                                                   initial.get(f"{name}.{param.name}", param.default))
        except SpecError as error:
            st.error(str(error))
            return None
        try:
            chosen.append(REGISTRY[name](**values).spec())
        except SpecError as error:
            st.error(str(error))
            return None
    typed = st.text_input("…or type a SPEC", key=f"{prefix}{index}_spec", placeholder="snapkv:budget=64+kivi:bits=2",
                          help="name[:key=value,...][+name[:key=value,...]]; overrides the widgets above")
    spec = typed.strip() or "+".join(chosen) or "full"
    try:
        return parse_spec(spec).label
    except SpecError as error:
        st.error(str(error))
        return None

"""Method widgets built from the methods' own parameter declarations (the registry in kvviz.methods), and the grid of
method configurations that Compare, Needle and Tail risk share: where SPECs from the link are checked, an invalid one
showing the SPEC's own error (as the CLI gives it) and running nothing until it is fixed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import streamlit as st

from kvviz.methods import REGISTRY, Budget, MethodStack, Param, SpecError, parse_spec
from kvviz_app.url import Read, linked, plural, shown

SPEC_KEY = "m"  # the URL key each configuration's SPEC travels under (repeated, in order)


def methods_of(kind: str) -> list[str]:
    """Registered method names of one kind, ``full`` first."""
    return sorted((n for n, c in REGISTRY.items() if c.kind == kind), key=lambda n: (n != "full", n))


def _param_widget(param: Param, key: str, initial: object) -> object:
    """One widget built from a method's parameter declaration."""
    label, help_text = param.name, f"{param.help} ({param.describe_range()})"
    if param.choices is not None:
        options = list(param.choices)
        return st.selectbox(label, options, index=options.index(initial) if initial in options else 0, key=key,
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


def _initial_values(stack: MethodStack) -> dict[str, object]:
    """Method names and parameter values a SPEC from the link starts the widgets with."""
    values: dict[str, object] = {}
    for method in stack.members():
        values[method.kind] = method.name
        for param in method.params:
            value = getattr(method, param.name)
            values[f"{method.name}.{param.name}"] = str(value) if isinstance(value, Budget) else value
    return values


def _widget_specs(index: int, initial: dict[str, object], prefix: str) -> list[str] | None:
    """Architecture x eviction x quantization widgets; the SPEC of each method chosen, or None (error shown)."""
    chosen: list[str] = []
    for kind, none_label in (("architecture", "none"), ("eviction", "full"), ("quantization", "none")):
        options = methods_of(kind) if kind == "eviction" else [none_label, *methods_of(kind)]
        start = initial.get(kind, none_label)
        name = st.selectbox(kind.capitalize(), options, index=options.index(start) if start in options else 0,
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
            chosen.append(REGISTRY[name](**values).spec())
        except SpecError as error:
            st.error(str(error))
            return None
    return chosen


def _label(spec: str | None) -> str | None:
    """A SPEC's canonical label, or None when there is none or it does not parse."""
    try:
        return None if spec is None else parse_spec(spec).label
    except SpecError:
        return None


def method_configurator(index: int, initial_spec: str, prefix: str = "cfg") -> str | None:
    """Architecture x eviction x quantization widgets for configuration ``index``, started from ``initial_spec`` (a
    SPEC from the link); its SPEC, or None while it is invalid (the error shown).

    A SPEC the widgets cannot start from (invalid, or one they would change) goes into the SPEC box as given, so the
    link's own value is what is shown, checked and run, never a default put in its place.
    """
    spec_key = f"{prefix}{index}_spec"
    first = spec_key not in st.session_state
    try:
        linked_stack: MethodStack | None = parse_spec(initial_spec)
    except SpecError:
        linked_stack = None
    chosen = _widget_specs(index, {} if linked_stack is None else _initial_values(linked_stack), prefix)
    from_widgets = None if chosen is None else "+".join(chosen) or "full"
    keep_as_given = first and (linked_stack is None or _label(from_widgets) != linked_stack.label)
    empty = None if initial_spec.strip() else (f"The link's {shown(SPEC_KEY, initial_spec)} is empty; this "
                                               f"configuration starts from {from_widgets or 'the choices above'}.")
    typed = linked(spec_key, Read(initial_spec if keep_as_given else "", empty), lambda value: st.text_input(
        "…or type a SPEC", value, key=spec_key, placeholder="snapkv:budget=64+kivi:bits=2",
        help="name[:key=value,...][+name[:key=value,...]]; overrides the widgets above"))
    spec = typed.strip() or from_widgets
    if spec is None:
        return None
    try:
        return parse_spec(spec).label
    except SpecError as error:
        st.error(str(error))
        if typed == initial_spec:  # an empty one never gets here: the widgets' SPEC runs instead
            st.caption("This SPEC came with the link. Fix it here, or clear the box to use the choices above.")
        return None


@dataclass
class MethodGrid:
    """The method configurations a page runs, as its user has set them up."""

    noun: str  # what the page calls one configuration ("configuration", "method")
    specs: list[str | None]  # per configuration its SPEC label, None while its SPEC is invalid
    shared: list[str]  # what each configuration puts in the link: its label, or its SPEC as typed while invalid

    @property
    def valid(self) -> list[str]:
        """The SPECs that run, each once, in order."""
        return list(dict.fromkeys(s for s in self.specs if s is not None))

    @property
    def invalid(self) -> list[int]:
        """Numbers (from 1) of the configurations whose SPEC is invalid."""
        return [index + 1 for index, spec in enumerate(self.specs) if spec is None]

    @property
    def ready(self) -> bool:
        return bool(self.valid) and not self.invalid

    def blocked(self) -> str | None:
        """Why the page's run button is disabled, when a configuration is invalid."""
        if not self.invalid:
            return None
        numbers = " and ".join(", ".join(map(str, self.invalid)).rsplit(", ", 1))
        if len(self.invalid) == 1:
            return (f"{self.noun.capitalize()} {numbers} has an invalid SPEC (the error is under it): nothing runs "
                    "until it is fixed, or its SPEC box cleared.")
        return (f"{self.noun.capitalize()}s {numbers} have invalid SPECs (the errors are under them): nothing runs "
                "until each is fixed, or its SPEC box cleared.")


def method_grid(prefix: str, defaults: Sequence[str], most: int, per_row: int,
                noun: str = "configuration") -> MethodGrid:
    """How many configurations (a number in the sidebar) and one bordered box each, ``per_row`` to a row, started
    from the link's repeated ``m`` SPECs (``defaults`` when the link has none). A link with more than ``most`` gets a
    notice naming those left out; a repeated SPEC runs once, and a caption says so."""
    from_link = st.query_params.get_all(SPEC_KEY)
    initial = from_link or list(defaults)
    dropped = from_link[most:]
    count_read = Read(min(most, len(initial)), None if not dropped else (
        f"The link gives {plural(len(from_link), noun)}; this page runs at most {most}, so "
        f"{', '.join(shown(SPEC_KEY, s) for s in dropped)} {'is' if len(dropped) == 1 else 'are'} left out."))
    with st.sidebar:
        count = linked(f"{prefix}_count", count_read, lambda value: int(st.number_input(
            f"{noun.capitalize()}s", 1, most, value, key=f"{prefix}_count")))
    specs: list[str | None] = []
    shared: list[str] = []
    columns = st.columns(per_row)
    for index in range(count):
        with columns[index % per_row].container(border=True):
            st.markdown(f"**{noun.capitalize()} {index + 1}**")
            spec = method_configurator(index, initial[index] if index < len(initial) else "full", prefix)
            if spec is not None and spec in specs:
                st.caption(f"The same as {noun} {specs.index(spec) + 1}: it runs once.")
            specs.append(spec)
            typed = st.session_state.get(f"{prefix}{index}_spec", "")
            shared.append(spec or typed or (initial[index] if index < len(initial) else "full"))
    return MethodGrid(noun, specs, shared)

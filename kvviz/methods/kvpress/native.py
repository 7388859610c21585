"""Any kvpress press, run by kvpress itself: its own hooks compress the prompt's cache, kvviz recovers what it kept.

kvpress keeps no record of what a press dropped. Here the press runs with its own context manager during a prefill
into a transformers ``DynamicCache``; a forward hook registered before the press's snapshots each layer's full keys
and values, and every row the press left is matched back to the full row it came from
(:mod:`kvviz.methods.kvpress.rowmatch`).
This gives a kept index per layer and KV head: kvviz's cache, ledger, bytes and decode see what the press kept.

Honest about presses that change entries: re-rotated keys (KeyRerotation, Finch) are matched after undoing the
rotation; zeroed key channels (ThinK) are reported as channels kept per head; presses whose values change (merging)
report which evicted token was folded into which survivor; anything that cannot be mapped raises
:class:`NotMappable` with the reason. The press's parameters are read from its dataclass fields, so the CLI, the
app and the docs need no hand-written list; wrappers take their inner press by name (``press=adakv,inner=snapkv``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import operator
import types
import typing
from dataclasses import dataclass
from typing import Any

import torch

from kvviz.cache.protocol import EvictionMethod, LayerView
from kvviz.cache.spec import Param, SpecError, register
from kvviz.methods.kvpress.report import NativePrefill, NativeReport, NotMappable
from kvviz.methods.kvpress.scorer import kept_count, removed_share

DEFAULT_RATIO = 0.5  # kvpress's ratios default to 0 (no compression); kvviz shows an effect by default

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


def press_name(cls: type) -> str:
    """The SPEC name of a press class: its class name without ``Press``, lower case (SnapKVPress -> snapkv)."""
    name = cls.__name__
    return (name[: -len("Press")] if name.endswith("Press") and name != "Press" else name).lower()


def _custom_presses() -> tuple[dict[str, type], list[str]]:
    """Presses named by the server setting ``KVVIZ_PRESSES`` (dotted paths), when the settings allow them, and one
    line per entry that cannot be loaded: a broken entry costs only itself, every other press stays available."""
    from kvviz.runtime.settings import Settings

    settings = Settings.from_env()
    found: dict[str, type] = {}
    problems: list[str] = []
    if not settings.custom_presses_allowed:
        return found, problems
    for path in settings.presses:
        try:
            cls = load_press_class(path)
        except SpecError as error:
            problems.append(f"KVVIZ_PRESSES: {error}")
            continue
        found[press_name(cls)] = cls
    return found, problems


def custom_press_problems() -> list[str]:
    """The server's ``KVVIZ_PRESSES`` entries that cannot be offered, one line each (``kvviz config`` refuses them,
    and asking for a press that is not there says so)."""
    return _custom_presses()[1]


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
    """kvpress's presses plus the server's own (``KVVIZ_PRESSES``), by SPEC name."""
    return {**kvpress_classes(), **_custom_presses()[0]}


# -- parameters from the press's dataclass fields ---------------------------------------------------------------


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


# -- the method -------------------------------------------------------------------------------------------------


@register
class KVPressNative(EvictionMethod):
    name = "kvpress_native"
    summary = ("Any kvpress press (or your own, via KVVIZ_PRESSES) run by kvpress itself during prefill; kvviz maps "
               "what the press left back to token positions per layer and KV head.")
    compresses_prompt_only = True
    params = (
        Param("press", str, "snapkv", "kvpress press by name (python -m kvviz methods --kvpress lists them)"),
    )
    own_prefill = True  # the press's hooks must run during the prompt's forward: kvviz's shared prefill cannot serve
    stacks_with_architecture = False
    why_not_with_architecture = "compresses the model's own cache inside kvpress's hooks, before any head merging"

    @classmethod
    def at_budget(cls, tokens: int, prompt_length: int | None = None) -> KVPressNative | None:
        """kvpress's knorm press at the compression ratio that keeps ``tokens`` of the prompt (it reads no
        observation window, so any budget works); None without a prompt length."""
        if not prompt_length:
            return None
        return cls(press="knorm", compression_ratio=removed_share(tokens, prompt_length))

    def budget_for(self, prompt_length: int) -> int | None:
        """A scorer press's uniform share; None for presses that keep other than the top share of every head."""
        import kvpress

        ratio = getattr(self, "compression_ratio", None)
        if ratio is None or not issubclass(self.press_class, kvpress.ScorerPress):
            return None
        return prompt_length if ratio == 0 else kept_count(prompt_length, ratio)

    def __init__(self, **values: Any):
        self.press_class, self.fields, self.inner_fields, self.params = self.declare(values)
        self._prefill: tuple[tuple[int, ...], NativePrefill] | None = None
        self.report: NativeReport | None = None
        super().__init__(**values)

    @classmethod
    def params_for(cls, values: dict[str, Any]) -> tuple[Param, ...]:
        """The parameters a SPEC with these ``press`` (and ``inner``) values takes: what the app draws widgets for,
        one at a time, since the press chosen decides the rest."""
        return cls.declare(values)[3]

    @staticmethod
    def declare(values: dict[str, Any]) -> tuple[type, list[FieldKind], list[FieldKind], tuple[Param, ...]]:
        """(press class, its fields, the inner press's scalar fields, every Param) for the press named in values."""
        catalog = press_catalog()
        name = str(values.get("press", "snapkv"))
        if name not in catalog:
            raise SpecError("; ".join([f"unknown kvpress press '{name}'; valid: {', '.join(sorted(catalog))}",
                                       *custom_press_problems()]))
        press_class = catalog[name]
        if press_class.__name__ in NEEDS_DOWNLOAD:
            raise SpecError(f"kvpress {name} {NEEDS_DOWNLOAD[press_class.__name__]}: not available offline")
        reason = not_mappable_reason(press_class)
        if reason:
            raise NotMappable(f"kvpress {name} cannot be shown: {reason}")
        fields = press_fields(press_class)
        own = [Param("press", str, "snapkv", "kvpress press by name", choices=tuple(sorted(catalog)))]
        own += [f.param for f in fields]
        inner_fields: list[FieldKind] = []
        single = [f for f in fields if f.kind == "press"]
        if single:
            inner_name = str(values.get("inner", single[0].param.default))
            if inner_name not in catalog:
                raise SpecError(f"unknown inner press '{inner_name}'; valid: {', '.join(sorted(catalog))}")
            taken = {p.name for p in own}
            for inner in press_fields(catalog[inner_name]):
                if inner.kind == "scalar":
                    renamed = inner.param.name if inner.param.name not in taken else f"inner_{inner.param.name}"
                    inner_fields.append(FieldKind(inner.name, "scalar", dataclasses.replace(inner.param, name=renamed)))
            own += [f.param for f in inner_fields]
        return press_class, fields, inner_fields, tuple(own)

    def validate(self) -> None:
        if getattr(self, "threshold", 0) is None:  # DMSPress: no default; it evicts tokens scoring below it
            raise SpecError(f"kvpress {press_name(self.press_class)} needs threshold=... (tokens scoring below it "
                            "are evicted; the scale depends on the inner press)")
        self.build_press(num_layers=1)  # the press's own __post_init__ checks (asserts) run now, as one line

    def build_press(self, num_layers: int):
        """A fresh press with this SPEC's values (inner presses built by name)."""
        catalog = press_catalog()
        kwargs: dict[str, Any] = {}
        for kind in self.fields:
            value = getattr(self, kind.param.name)
            if kind.kind == "scalar":
                kwargs[kind.name] = value
            elif kind.kind == "press":
                inner_class = catalog[value]
                inner_kwargs = {f.name: getattr(self, f.param.name) for f in self.inner_fields}
                kwargs[kind.name] = _construct(inner_class, inner_kwargs)
            elif kind.kind == "presses":
                names = [n for n in value.split("/") if n]
                unknown = [n for n in names if n not in catalog]
                if unknown or not names:
                    raise SpecError(f"bad inner presses '{value}'; valid: {', '.join(sorted(catalog))}")
                kwargs[kind.name] = [_construct(catalog[n], _ratio_defaults(catalog[n])) for n in names]
            elif kind.kind == "floats":
                ratio = getattr(self, "compression_ratio", DEFAULT_RATIO)
                try:
                    kwargs[kind.name] = [float(v) for v in value.split("/")] if value else [ratio] * num_layers
                except ValueError:
                    raise SpecError(f"bad value in '{self.name}:{kind.param.name}={value}': write 0.5/0.25/...") \
                        from None
        return _construct(self.press_class, kwargs)

    # -- kvviz's hooks: the session asks for our own prefill, the cache for what each layer keeps ----------------
    def run_prefill(self, session) -> NativePrefill:
        """Run the prompt with the press's hooks active (cached per prompt: a teacher-forced rerun reuses it)."""
        key = tuple(session.prompt_ids)
        if self._prefill is None or self._prefill[0] != key:
            from kvviz.methods.kvpress.fork import run_press_prefill

            press = self.build_press(session.num_layers)
            outcome = run_press_prefill(session.loaded, session.prompt_ids, press, press_name(self.press_class),
                                        session.rotate_keys)
            self._prefill = (key, outcome)
            self.report = outcome.report
        return self._prefill[1]

    def prefill_select(self, view: LayerView, stats: Any) -> torch.Tensor | None:
        if self._prefill is None:
            raise SpecError("kvpress_native runs its own prefill; fork it through PromptSession")
        kept = self._prefill[1].kept[view.layer_idx]
        return None if kept is None else kept.to(view.positions.device)

    def prefill_blocked(self, layer_idx: int) -> torch.Tensor | None:
        return None if self._prefill is None else self._prefill[1].blocked[layer_idx]


def _ratio_defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.param.default for f in press_fields(cls) if f.kind == "scalar" and "ratio" in f.name}


def _construct(cls: type, kwargs: dict[str, Any]):
    """Build a press; its own checks (asserts, ValueErrors) become one-line SpecErrors."""
    try:
        return cls(**kwargs)
    except (AssertionError, ValueError, TypeError) as error:
        raise SpecError(f"kvpress {press_name(cls)} refused these settings: {error or 'invalid settings'}") from None


def not_mappable_reason(cls: type) -> str | None:
    """Why a press's result cannot be shown on kvviz's cache, or None when it can."""
    import kvpress

    if issubclass(cls, kvpress.FinchPress):
        return ("it needs the prompt split by a delimiter token (context, then question) that kvpress's pipeline "
                "inserts; kvviz's prompts carry none")
    if issubclass(cls, kvpress.DecodingPress):
        return ("it compresses while decoding, and kvviz decodes on its own cache (kvpress's hooks are not active "
                "then); PrefillDecodingPress runs its prefill part, kvviz's h2o/tova evict while decoding")
    return None

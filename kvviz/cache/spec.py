"""The SPEC grammar, declared parameters and the registry of methods.

Every architecture, eviction or quantization method is one class in one file of :mod:`kvviz.methods`. It declares its
parameters once (:class:`Param`); the CLI parser, the app's widgets and the docs all read that declaration. A SPEC names
one method or a stack of them, at most one per axis: ``name[:key=value,key=value][+name[:key=value,...]]``, e.g.
``snapkv:budget=256+kivi:bits=2`` or ``lowrank:rank=96+snapkv:budget=256+kivi:bits=4``. The registry is filled by
importing :mod:`kvviz.methods`, which loads every method file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


class SpecError(ValueError):
    """A SPEC that cannot be used; the message is one line naming the valid choices."""


@dataclass(frozen=True)
class Budget:
    """A token budget: a count (``256``, written without a decimal point) or a ratio of a reference length (``0.25``,
    ``1.0`` = all of it, written with one). :meth:`read` applies that rule to what users type; :meth:`rule` says it,
    once for every method's budget parameters."""

    value: float
    ratio: bool | None = None  # None: decided by the value (below 1 is a ratio), for budgets built in code

    def __post_init__(self) -> None:
        if self.ratio is None:
            object.__setattr__(self, "ratio", self.value < 1)

    @classmethod
    def read(cls, raw: Any) -> Budget:
        """A budget from a SPEC value or a Python number: a decimal point (or a float) makes it a ratio."""
        if isinstance(raw, Budget):
            return raw
        if isinstance(raw, bool):
            raise ValueError("a budget is a number")
        text = str(raw).strip()
        is_ratio = isinstance(raw, float) or any(mark in text for mark in ".eE")
        value = float(text)
        if not math.isfinite(value) or value <= 0 or (is_ratio and value > 1) or (not is_ratio and value % 1):
            raise ValueError(f"budget {text}: expected {cls.rule()}")
        return cls(value, is_ratio)

    @staticmethod
    def rule(of: str = "the prompt") -> str:
        """How a budget is written, its ratio being one ``of`` a reference length."""
        return f"a token count without a decimal point (256) or a ratio of {of} with one (0.25; 1.0 = all of it)"

    @property
    def is_ratio(self) -> bool:
        return bool(self.ratio)

    def tokens(self, length: int) -> int:
        """Tokens this budget allows for a sequence of ``length`` tokens (at least one)."""
        if self.is_ratio:
            return max(1, math.ceil(self.value * length))
        return int(self.value)

    def __str__(self) -> str:
        if not self.is_ratio:
            return str(int(self.value))
        text = f"{self.value:g}"
        return text if any(mark in text for mark in ".e") else f"{text}.0"


@dataclass(frozen=True)
class Param:
    """One parameter of a method: its name, type, default, allowed range or choices, and help text. A
    :class:`Budget` parameter's help says what it counts; how it is written comes from :meth:`Budget.rule`, with
    ``ratio_of`` the length its ratio is one of."""

    name: str
    type: type
    default: Any
    help: str
    min: float | None = None
    max: float | None = None
    choices: tuple | None = None
    ratio_of: str = "the prompt"

    def describe_range(self) -> str:
        if self.choices is not None:
            return "|".join(str(c) for c in self.choices)
        if self.type is bool:
            return "0|1"
        if self.type is Budget:
            return f"{Budget.rule(self.ratio_of)}; a ratio lies in (0, 1]"
        low = "-inf" if self.min is None else f"{self.min:g}"
        high = "inf" if self.max is None else f"{self.max:g}"
        return f"{self.type.__name__} in [{low}, {high}]"

    def parse(self, method: str, raw: Any) -> Any:
        """Convert and check one value; raise SpecError with the valid range on failure."""
        where = f"{method}:{self.name}={raw}"
        try:
            if self.type is bool:
                if isinstance(raw, bool):
                    value = raw
                elif str(raw).lower() in ("1", "true", "yes", "on"):
                    value = True
                elif str(raw).lower() in ("0", "false", "no", "off"):
                    value = False
                else:
                    raise ValueError
            elif self.type is Budget:
                value = Budget.read(raw)
            elif self.type is int:
                as_float = float(raw)
                if not as_float.is_integer():
                    raise ValueError
                value = int(as_float)
            else:
                value = self.type(raw)
                if self.type is float and not math.isfinite(value):
                    raise ValueError
        except (TypeError, ValueError):
            raise SpecError(f"bad value in '{where}': expected {self.describe_range()}") from None
        if self.choices is not None and value not in self.choices:
            raise SpecError(f"bad value in '{where}': choose {self.describe_range()}")
        number = value.value if isinstance(value, Budget) else value
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            if (self.min is not None and number < self.min) or (self.max is not None and number > self.max):
                raise SpecError(f"bad value in '{where}': expected {self.describe_range()}")
        return value


@dataclass(frozen=True)
class Sizing:
    """What sizing a method to a share of the full cache needs to know: the prompt and the model's cache shape."""

    prompt_length: int
    kv_heads: int
    head_dim: int
    bytes_per_element: float


class Method:
    """Base of every method: a name, a kind, declared parameters, and validated values as attributes.

    ``given``: the parameters the SPEC wrote (the others took their defaults), which a sweep keeps fixed.
    """

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""  # one of KINDS
    summary: ClassVar[str] = ""
    params: ClassVar[tuple[Param, ...]] = ()

    def __init__(self, **values: Any):
        known = {p.name: p for p in self.params}
        for key in values:
            if key not in known:
                valid = ", ".join(known) or "none"
                raise SpecError(f"unknown parameter '{key}' for {self.name}; valid: {valid}")
        self.given = frozenset(values)
        for param in self.params:
            raw = values.get(param.name, param.default)
            setattr(self, param.name, param.parse(self.name, raw))
        self.validate()

    def validate(self) -> None:
        """Cross-parameter checks; raise SpecError with a one-line message."""

    def check_stack(self, stack: MethodStack) -> None:
        """Checks against the other member of a stack (e.g. re-rotation cannot touch quantized keys)."""

    def values(self) -> dict[str, Any]:
        return {p.name: getattr(self, p.name) for p in self.params}

    def changed_values(self) -> dict[str, Any]:
        """The parameters that differ from their defaults (what the canonical SPEC writes)."""
        return {p.name: getattr(self, p.name) for p in self.params
                if getattr(self, p.name) != p.parse(self.name, p.default)}

    def spec(self) -> str:
        """The canonical SPEC text: only parameters that differ from their defaults."""
        changed = [f"{name}={_format_value(value)}" for name, value in self.changed_values().items()]
        return self.name + (":" + ",".join(changed) if changed else "")

    @classmethod
    def swept_params(cls) -> tuple[str, ...]:
        """The parameters a sweep varies to size this method (its free parameter); () when it cannot be sized."""
        return ()

    @classmethod
    def sweep_points(cls, shares: Sequence[float], sizing: Sizing,
                     fixed: dict[str, Any]) -> list[tuple[float, Method]]:
        """This method at each budget, as (the share of full it was sized to, the method), keeping ``fixed`` values;
        [] when it cannot be sized. ``shares`` lie in (0, 1]; each method reads them along its own axis."""
        return []

    def __repr__(self) -> str:
        return f"<{self.spec()}>"


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


REGISTRY: dict[str, type[Method]] = {}
KINDS = ("architecture", "eviction", "quantization")  # the three axes, in SPEC order: fewer heads, tokens, bits


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make a method available to SPECs, the CLI, the app and the docs."""
    if not cls.name or cls.kind not in KINDS:
        raise TypeError(f"{cls.__name__} needs a name and a kind of {', '.join(map(repr, KINDS))}")
    REGISTRY[cls.name] = cls
    return cls


@dataclass
class MethodStack:
    """What one SPEC describes: at most one method per axis (architecture, eviction, quantization)."""

    eviction: Method | None = None
    quantization: Method | None = None
    architecture: Method | None = None

    @property
    def label(self) -> str:
        parts = [m.spec() for m in self.members()]
        return "+".join(parts) if parts else "full"

    def members(self) -> list[Method]:
        return [m for m in (self.architecture, self.eviction, self.quantization) if m is not None]


def parse_spec(spec: str) -> MethodStack:
    """Parse ``name[:k=v,...][+name[:k=v,...]...]`` into a :class:`MethodStack`; SpecError on any mistake."""
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError(f"empty method SPEC; valid methods: {', '.join(sorted(REGISTRY))}")
    stack = MethodStack()
    for part in spec.strip().split("+"):
        name, _, arguments = part.strip().partition(":")
        name = name.strip()
        if name not in REGISTRY:
            raise SpecError(f"unknown method '{name}'; valid: {', '.join(sorted(REGISTRY))}")
        values: dict[str, str] = {}
        for item in filter(None, (a.strip() for a in arguments.split(","))):
            key, sep, value = item.partition("=")
            if not sep or not key.strip() or not value.strip():
                raise SpecError(f"bad argument '{item}' in '{part}': write key=value")
            if key.strip() in values:
                raise SpecError(f"parameter '{key.strip()}' given twice in '{part}'")
            values[key.strip()] = value.strip()
        method = REGISTRY[name](**values)
        slot = method.kind
        if getattr(stack, slot) is not None:
            existing = getattr(stack, slot).name
            raise SpecError(f"'{spec}' stacks two {slot} methods ({existing}, {name}); use at most one per axis "
                            "(architecture+eviction+quantization)")
        setattr(stack, slot, method)
    for method in stack.members():
        method.check_stack(stack)
    return stack


def budget_spec(name: str, tokens: int, prompt_length: int | None = None, **overrides: Any) -> str | None:
    """The SPEC of eviction method ``name`` keeping about ``tokens`` entries per head (its ``at_budget``), with
    ``overrides`` applied; None when the method is not registered, cannot be sized so, or rejects the values."""
    method = REGISTRY.get(name)
    if method is None or method.kind != "eviction":
        return None
    try:
        sized = method.at_budget(tokens, prompt_length)
        if sized is None:
            return None
        return (type(sized)(**({p.name: getattr(sized, p.name) for p in sized.params} | overrides)).spec()
                if overrides else sized.spec())
    except SpecError:
        return None


def methods_markdown(registry: dict[str, type[Method]] | None = None) -> str:
    """Every registered method, by axis, with its summary and declared parameters (docs/methods.md carries it)."""
    registry = REGISTRY if registry is None else registry

    def cell(text: object) -> str:
        return str(text).replace("|", "\\|")

    lines: list[str] = []
    for kind in KINDS:
        for name in sorted(n for n, cls in registry.items() if cls.kind == kind):
            method = registry[name]
            lines += [f"### `{name}` ({kind})", "", method.summary, ""]
            local = getattr(method, "on_local_layers", None)  # an eviction method's declaration
            if local is not None and name != "full":
                lines += [f"On local (sliding-window) layers: {local.value}.", ""]
            if not method.params:
                lines += ["No parameters.", ""]
                continue
            lines += ["| parameter | default | values | meaning |", "|---|---|---|---|"]
            for param in method.params:
                values = f"budget (ratios of {param.ratio_of})" if param.type is Budget else param.describe_range()
                default = _format_value(param.parse(name, param.default))
                lines.append(f"| `{param.name}` | `{cell(default)}` | {cell(values)} | {cell(param.help)} |")
            lines.append("")
    return "\n".join(lines).rstrip("\n")

"""Any kvpress press, run by kvpress itself: its own hooks compress the prompt's cache, kvviz recovers what it kept.

kvpress keeps no record of what a press dropped. Here the press runs with its own context manager during a prefill
into a transformers ``DynamicCache``; a forward hook registered before the press's snapshots each layer's full keys
and values, and every row the press left is matched back to the full row it came from
(:mod:`kvviz.methods.kvpress.rowmatch`).
This gives a kept index per layer and KV head: kvviz's cache, ledger, bytes and decode see what the press kept.

Honest about presses that change entries: re-rotated keys (KeyRerotation, Finch) are matched after undoing the
rotation; zeroed key channels (ThinK) are reported as channels kept per head; presses whose values change (merging)
report which evicted token was folded into which survivor; anything that cannot be mapped raises
:class:`NotMappable` with the reason. The press's parameters are read from its dataclass fields
(:mod:`kvviz.methods.kvpress.fields`), so the CLI, the app and the docs need no hand-written list; wrappers take their
inner press by name (``press=adakv,inner=snapkv``). Which presses are offered by name, the server's own included, is
:mod:`kvviz.methods.kvpress.catalog`'s job.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvviz.cache.protocol import Decode, EvictionMethod, LayerView, Schedule
from kvviz.cache.spec import Param, SpecError, register
from kvviz.methods.kvpress.catalog import (
    NEEDS_DOWNLOAD,
    custom_press_problems,
    not_mappable_reason,
    press_catalog,
    press_name,
)
from kvviz.methods.kvpress.fields import DEFAULT_RATIO, FieldKind, press_fields, ratio_defaults
from kvviz.methods.kvpress.report import NativePrefill, NativeReport, NotMappable
from kvviz.methods.kvpress.scorer import kept_count, removed_share


@register
class KVPressNative(EvictionMethod):
    name = "kvpress_native"
    summary = ("Any kvpress press (or your own, via KVVIZ_PRESSES) run by kvpress itself during prefill; kvviz maps "
               "what the press left back to token positions per layer and KV head.")
    schedule = Schedule(Decode.NEVER, own_prefill=True)  # its hooks compress during the prompt's own forward
    params = (
        Param("press", str, "snapkv", "kvpress press by name (python -m kvviz methods --kvpress lists them)"),
    )
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
        return kept_count(prompt_length, ratio)

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
                kwargs[kind.name] = [_construct(catalog[n], ratio_defaults(catalog[n])) for n in names]
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
        types = session.card.layer_types
        if types.has_local:  # transformers' sliding layers hold only their window while kvpress compresses them
            raise SpecError(f"{self.name} cannot run on this model's local layers ({types.summary()}): kvpress "
                            "compresses transformers' sliding-window caches itself, which kvviz cannot map onto its "
                            "own; kvviz's methods evict on global layers only")
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


def _construct(cls: type, kwargs: dict[str, Any]):
    """Build a press; its own checks (asserts, ValueErrors) become one-line SpecErrors."""
    try:
        return cls(**kwargs)
    except (AssertionError, ValueError, TypeError) as error:
        raise SpecError(f"kvpress {press_name(cls)} refused these settings: {error or 'invalid settings'}") from None

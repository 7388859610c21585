"""Plain dataclasses every consumer reads: the CLI's JSON, the app's tables and charts, the tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvviz.cache.architecture import AxisFactors
from kvviz.cache.layouts import DEFAULT_BLOCK_SIZE, LayoutBytes, cache_layouts, layouts_by_layer_type
from kvviz.cache.ledger import EvictionLedger
from kvviz.cache.storage import StorageBytes
from kvviz.comparison.diagnostics import QuantizationReport

if TYPE_CHECKING:
    from kvviz.methods.kvpress.report import NativeReport


@dataclass
class MethodResult:
    """One method's replay of a prompt."""

    method: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    kv_bytes: int = 0  # measured at the end of generation
    kv_bytes_full: int = 0  # what the full cache holds for the same tokens
    kv_breakdown: StorageBytes = field(default_factory=StorageBytes)
    kv_bytes_per_step: list[int] = field(default_factory=list)
    kv_bytes_per_layer: list[int] = field(default_factory=list)
    seconds: float = 0.0
    agreement_with_full: float | None = None  # teacher-forced top-1 agreement (kvviz.comparison.metrics)
    first_divergence: int | None = None  # first step whose top-1 differs from full's, teacher-forced
    kl_per_step: list[float] = field(default_factory=list)  # KL(full || method) in nats, teacher-forced
    mean_kl: float | None = None
    ledger: EvictionLedger | None = None
    error: str | None = None
    axis_factors: AxisFactors | None = None  # full bytes x architecture x eviction x quantization (core.architecture)
    projection_bytes: int = 0  # an architecture method's fitted projections: weights, not cache
    native_report: NativeReport | None = None  # a kvpress press run natively: what it did besides dropping rows
    total_tokens: int = 0  # prompt plus tokens fed: what the ledger and the full cache cover

    def layout_bytes(self, block_size: int = DEFAULT_BLOCK_SIZE) -> LayoutBytes | None:
        """What a serving engine's layouts would hold for the tokens this cache kept (:mod:`kvviz.cache.layouts`);
        None for a failed run."""
        if self.error or not self.kv_bytes_per_layer:
            return None
        return cache_layouts(self.ledger, self.kv_bytes_per_layer, self.total_tokens, block_size)

    def layout_bytes_by_layer_type(self, block_size: int = DEFAULT_BLOCK_SIZE) -> dict[str, LayoutBytes]:
        """The layouts of each layer type (``global``, ``local W``) on a model with local layers; empty otherwise."""
        if self.error or not self.kv_bytes_per_layer:
            return {}
        return layouts_by_layer_type(self.ledger, self.kv_bytes_per_layer, self.total_tokens, block_size)

    @property
    def compression(self) -> float | None:
        """How many times smaller than the full cache (None when nothing was measured)."""
        return self.kv_bytes_full / self.kv_bytes if self.kv_bytes else None

    def to_json(self, with_ledger: bool = True, block_size: int = DEFAULT_BLOCK_SIZE) -> dict:
        layouts = self.layout_bytes(block_size)
        data = {
            "method": self.method,
            "text": self.text,
            "token_ids": self.token_ids,
            "kv_bytes": self.kv_bytes,
            "kv_bytes_full": self.kv_bytes_full,
            "kv_bytes_codes": self.kv_breakdown.codes,
            "kv_bytes_metadata": self.kv_breakdown.metadata,
            "kv_bytes_full_precision": self.kv_breakdown.full_precision,
            "layout_bytes": None if layouts is None else layouts.to_json(),
            "seconds": round(self.seconds, 4),
            "agreement_with_full": self.agreement_with_full,
            "first_divergence": self.first_divergence,
            "kl_per_step": [round(kl, 6) for kl in self.kl_per_step],
            "mean_kl": None if self.mean_kl is None else round(self.mean_kl, 6),
        }
        if self.error:
            data["error"] = self.error
        by_type = self.layout_bytes_by_layer_type(block_size)
        if by_type:
            data["layout_bytes_by_layer_type"] = {kind: layouts.to_json() for kind, layouts in by_type.items()}
        if self.axis_factors is not None:
            data["axis_factors"] = self.axis_factors.to_json()
            data["projection_bytes"] = self.projection_bytes
        if self.native_report is not None:
            data["kvpress_native"] = self.native_report.to_json(with_details=with_ledger)
        if with_ledger and self.ledger is not None:
            data["ledger"] = self.ledger.to_json(self.ledger.length)  # tokens fed: the last generated one never is
        return data


@dataclass
class Comparison:
    """Several methods replayed on one prompt after one shared prefill."""

    model: str
    device: str
    prompt_tokens: int
    prompt_ids: list[int]
    prefill_seconds: float
    results: list[MethodResult]
    quantization: QuantizationReport | None = None  # the quantizers' error on this prompt and key outlier channels

    def to_json(self, with_ledger: bool = True, block_size: int = DEFAULT_BLOCK_SIZE) -> dict:
        """``block_size``: token slots per block of the paged layouts each result's ``layout_bytes`` reports."""
        return {
            "model": self.model,
            "device": self.device,
            "prompt_tokens": self.prompt_tokens,
            "prefill_seconds": round(self.prefill_seconds, 4),
            "block_size": block_size,
            "results": [r.to_json(with_ledger, block_size) for r in self.results],
        }

    def layouts(self, block_size: int = DEFAULT_BLOCK_SIZE) -> dict[str, LayoutBytes]:
        """Each finished configuration's bytes under every serving layout (:mod:`kvviz.cache.layouts`)."""
        found = {r.method: r.layout_bytes(block_size) for r in self.results}
        return {method: layouts for method, layouts in found.items() if layouts is not None}

    def by_method(self, method: str) -> MethodResult:
        return next(r for r in self.results if r.method == method)

    def lines(self) -> list[str]:
        """The comparison as text: a header, then per method its bytes against full, agreement, time and answer."""
        out = [f"model {self.model} on {self.device}, prompt {self.prompt_tokens} tokens, "
               f"prefill {self.prefill_seconds:.2f}s"]
        for result in self.results:
            if result.error:
                out += ["", f"== {result.method}: FAILED: {result.error}"]
                continue
            ratio = f"{result.compression:.2f}x smaller" if result.compression else ""
            agreement = "" if result.agreement_with_full is None else f", agreement {result.agreement_with_full:.2f}"
            out += ["", f"== {result.method}: kv {result.kv_bytes:,} B vs full {result.kv_bytes_full:,} B {ratio}"
                        f"{agreement}, {result.seconds:.2f}s"]
            out += [f"   {line}" for line in (result.native_report.lines() if result.native_report is not None else [])]
            out.append(result.text)
        return out

    def to_markdown(self) -> str:
        """A header line, then one Markdown row per method: bytes, times smaller than full, teacher-forced quality."""
        rows = [f"model {self.model} on {self.device}, prompt {self.prompt_tokens} tokens", "",
                "| method | KV bytes | vs full | agreement | mean KL (nats) | first divergence |",
                "|---|---|---|---|---|---|"]
        for r in self.results:
            if r.error:
                rows.append(f"| `{r.method}` | failed: {r.error} | | | | |")
                continue
            agreement = "-" if r.agreement_with_full is None else f"{r.agreement_with_full:.2f}"
            kl = "-" if r.mean_kl is None else f"{r.mean_kl:.3f}"
            divergence = "-" if r.first_divergence is None else str(r.first_divergence)
            rows.append(f"| `{r.method}` | {r.kv_bytes / 2**20:.2f} MiB | {r.compression or 0:.2f}x | {agreement} | "
                        f"{kl} | {divergence} |")
        return "\n".join(rows)

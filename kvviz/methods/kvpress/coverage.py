"""Which kvpress presses kvviz shows, and how: ``python -m kvviz methods --kvpress``.

Status per press: ``runs natively`` (``kvpress_native:press=NAME``, kvpress's own hooks), ``needs files from the
hub`` (nothing to run offline), or ``not mappable`` (with the reason). ``kvviz's own`` names kvviz methods that
implement the same policy (its own code, or its ``kvpress`` adapter that borrows the press's ``score``).
tests/test_kvpress_native.py runs every press and checks it behaves as this table says.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvviz.methods.kvpress.catalog import NEEDS_DOWNLOAD, kvpress_classes, not_mappable_reason
from kvviz.methods.kvpress.fields import press_fields
from kvviz.methods.kvpress.scorer import PRESSES as ADAPTED

RUNS = "runs natively"
HUB = "needs files from the hub"
NOT_MAPPABLE = "not mappable"

# kvviz methods implementing the same policy with kvviz's own code (agreement as tests/methods measure it)
OWN: dict[str, str] = {
    "SnapKVPress": "snapkv",
    "StreamingLLMPress": "streaming_llm",
    "TOVAPress": "tova",
    "RandomPress": "random (its own seeding)",
    "ObservedAttentionPress": "h2o (accumulated attention, plus a recent window)",
    "AdaKVPress": "adakv (at least 99% of kvpress's kept entries per head)",
    "PyramidKVPress": "pyramidkv (the same per-layer counts; at least 99% of the kept entries)",
    "PerLayerCompressionPress": "per_layer",
    "DecodingPress": "decoding (exactly kvpress's kept entries)",
}
DECODING_OTHERS = "h2o, tova (evict while decoding)"  # the decoding presses kvviz's `decoding` does not reproduce

# what a native run does beyond dropping rows, for presses that do more
NOTES: dict[str, str] = {
    "AdaKVPress": "head-wise budgets: masked entries held blocked so each layer's heads share one length",
    "CriticalAdaKVPress": "head-wise budgets: masked entries held blocked so each layer's heads share one length",
    "DMSPress": "needs threshold=... (no default); head-wise: masked entries held blocked",
    "KVzipPress": "reads the model's tokenizer files (the embedded model has them); extra reconstruction forwards; "
                  "head-wise, masked entries held blocked",
    "KVgradPress": "as KVzip: the model's tokenizer files, extra forwards, head-wise masking",
    "KVComposePress": "structured=1 (its default); structured=0 leaves rows that match no prompt token: refused",
    "KeyRerotationPress": "keys re-rotated by the press: matched after undoing RoPE, in order",
    "ThinKPress": "prunes key channels, not tokens: shown as key channels kept per KV head",
    "MergingPress": "folds evicted values into survivors: reports which token was merged into which",
    "ObservedAttentionPress": "needs attention weights: its prefill runs with eager attention",
    "PrefillDecodingPress": "its prefilling press runs; a decoding press is not replayed",
    "PerLayerCompressionPress": "compression_ratios '/'-separated, one per layer",
    "ComposedPress": "inner presses '/'-separated, applied in order",
    "SimLayerKVPress": "lazy layers keep initial + recent tokens, others everything",
    "PyramidKVPress": "budgets shrink with depth",
}


@dataclass(frozen=True)
class CoverageRow:
    press: str  # SPEC name
    cls: str  # kvpress class
    status: str
    kvviz_own: str
    why: str
    params: str


def coverage() -> list[CoverageRow]:
    """One row per press kvpress exports, sorted by name."""
    import kvpress

    adapted = {cls: name for name, cls in ADAPTED.items()}
    rows = []
    for name, cls in sorted(kvpress_classes().items()):
        label = cls.__name__
        own = [m for m in (OWN.get(label), f"kvpress:press={adapted[label]}" if label in adapted else None) if m]
        if issubclass(cls, kvpress.DecodingPress) and label not in OWN:
            own = [DECODING_OTHERS]
        if label in NEEDS_DOWNLOAD:
            status, why = HUB, NEEDS_DOWNLOAD[label]
        elif not_mappable_reason(cls):
            status, why = NOT_MAPPABLE, not_mappable_reason(cls)
        else:
            status, why = RUNS, NOTES.get(label, "")
        params = ", ".join(f"{f.param.name}={f.param.default}" for f in press_fields(cls))
        rows.append(CoverageRow(name, label, status, "; ".join(own), why, params))
    return rows


def markdown_table(rows: list[CoverageRow]) -> str:
    lines = ["| press (`kvpress_native:press=`) | kvpress class | status here | kvviz's own | why / how |",
             "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| `{row.press}` | {row.cls} | {row.status} | {row.kvviz_own or '-'} | {row.why or '-'} |")
    counts = {s: sum(r.status == s for r in rows) for s in (RUNS, HUB, NOT_MAPPABLE)}
    lines.append("")
    lines.append(f"{len(rows)} presses: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".")
    return "\n".join(lines)

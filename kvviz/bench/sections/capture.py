"""Prefill with attention statistics vs without, and the statistics' memory, at doubling prompt lengths."""

from __future__ import annotations

from dataclasses import replace

from kvviz.bench.harness import BenchRun, PeakMemory, Section, bench_section, timed
from kvviz.bench.workloads import fit, prompt_tokens
from kvviz.cache.capture import CaptureConfig
from kvviz.comparison.session import PromptSession
from kvviz.methods import budget_spec
from kvviz.planning.memory import model_card


@bench_section("capture")
def capture(run: BenchRun) -> Section:
    loaded, sizes = run.loaded, run.sizes
    section = Section("capture", "Statistics capture: time and memory at doubling lengths")
    card = model_card(loaded)
    lengths = sorted({fit(loaded, n) for n in sizes.capture_lengths})
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
        run.log(f"  prefill {n} tokens, capture off and on")
        offs, ons = [], []
        for _ in range(max(1, sizes.repeats)):  # interleaved, so a slow spell of the machine hits both
            offs.append(timed(loaded.device, lambda ids=ids: PromptSession(loaded, ids).prefill(None))[0])
            with PeakMemory(loaded.device) as peak:
                session = PromptSession(loaded, ids)
                seconds, prefill = timed(loaded.device, lambda session=session: session.prefill(config))
            ons.append(seconds)
        off, on = min(offs), min(ons)
        stats_bytes.append(prefill.stats.nbytes())
        section.add(f"capture_vs_plain@{n}", on / off, "x", "<= 1.3",
                    note=f"{on:.2f}s vs {off:.2f}s; both kvviz's prefill, padded alike")
        everywhere, _ = timed(loaded.device, lambda ids=ids: PromptSession(loaded, ids).prefill(every_layer))
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
        run.log(f"  replay {spec} at {lengths[-1]} tokens")
        result, _ = session.run(spec, 4)
        section.add(f"replay_ok@{lengths[-1]}", bool(result.token_ids), target="== True", note=spec)
        if result.ledger is not None:
            # issue 3: "a few MB" (4 MiB) at 8K x 30 layers x 3 KV heads, scaled to this length and shape
            allowed = int(4 * 2**20 * (lengths[-1] * card.layers * card.kv_heads) / (8192 * 30 * 3))
            section.add(f"ledger_bytes@{lengths[-1]}x{card.layers}x{card.kv_heads}", result.ledger.nbytes(), "B",
                        f"<= {allowed}", note="4 MiB at 8K x 30 layers x 3 KV heads, scaled to this shape")
    return section

"""The Memory planner's figures: KV bytes against context, and what fits on a GPU."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from kvviz_app.plots.common import MiB


def measured_vs_formula_figure(per_token: dict[str, float], measured: dict[str, tuple[int, int]],
                               max_tokens: int) -> go.Figure:
    """Per configuration: the formula's bytes over context (line) and the bytes one run measured (◆, same colour).

    ``per_token``: configuration -> formula bytes per token; ``measured``: configuration -> (tokens, bytes held).
    """
    figure = go.Figure()
    tokens = np.array([0, max_tokens])
    for name, slope in per_token.items():
        line = figure.add_trace(go.Scatter(x=tokens, y=tokens * slope / MiB, mode="lines", name=name,
                                           hovertemplate=name + " formula: %{y:.2f} MiB at %{x} tokens<extra></extra>"))
        if name in measured:
            count, held = measured[name]
            figure.add_trace(go.Scatter(x=[count], y=[held / MiB], mode="markers", showlegend=False,
                                        marker=dict(symbol="diamond", size=12, color=line.data[-1].line.color),
                                        hovertemplate=name + " measured: %{y:.3f} MiB at %{x} tokens<extra></extra>"))
    figure.update_layout(title="Loaded model: formula (lines) vs measured (◆)", height=360, xaxis_title="tokens",
                         yaxis_title="KV MiB", legend=dict(orientation="h", y=-0.25), margin=dict(t=50, b=40))
    return figure


def planner_context_figure(card_bytes_per_token: dict[str, float], contexts: Sequence[int], batch: int,
                           gpu_gb: float | None = None) -> go.Figure:
    """KV GB against context length, one line per attention variant or scenario (bytes per token given)."""
    figure = go.Figure()
    for name, per_token in card_bytes_per_token.items():
        figure.add_trace(go.Scatter(x=list(contexts), y=[per_token * n * batch / 1e9 for n in contexts],
                                    mode="lines+markers", name=name))
    if gpu_gb:  # a trace, not add_hline: on a log axis the hline's annotation is placed at 10^y and blows the range
        figure.add_trace(go.Scatter(x=[min(contexts), max(contexts)], y=[gpu_gb, gpu_gb], mode="lines",
                                    name=f"GPU {gpu_gb:g} GB", line=dict(color="black", dash="dot")))
    # log-log: the variants differ by orders of magnitude and contexts double; every line stays straight (linear)
    figure.update_layout(title=f"KV cache for batch {batch}", xaxis_title="context (tokens)", xaxis_type="log",
                         yaxis_title="GB", yaxis_type="log", height=380, margin=dict(t=50, b=40, l=50, r=20))
    return figure


def gpu_budget_figure(weight_gb: float, kv_gb: float, usable_gb: float, gpu_gb: float) -> go.Figure:
    """One stacked bar: weights + KV against the usable and total GPU memory."""
    figure = go.Figure([
        go.Bar(y=["memory"], x=[weight_gb], name="weights", orientation="h", marker_color="#7f7f7f"),
        go.Bar(y=["memory"], x=[kv_gb], name="KV cache", orientation="h", marker_color="#2ca02c"),
    ])
    figure.add_vline(x=usable_gb, line_dash="dot", annotation_text="usable")
    figure.add_vline(x=gpu_gb, line_color="black", annotation_text="GPU")
    figure.update_layout(barmode="stack", height=200, xaxis_title="GB", margin=dict(t=30, b=40, l=60, r=20))
    return figure


def architecture_figure(lines: dict[str, tuple[Sequence[int], Sequence[int]]],
                        measured: dict[str, tuple[int, int]]) -> go.Figure:
    """KV bytes against context (log-log), one line per model and configuration from the formula per layer type,
    and what a run measured (◆) on the line of the same name. ``lines``: name -> (contexts, bytes);
    ``measured``: name -> (tokens, bytes held)."""
    figure = go.Figure()
    for name, (contexts, held) in lines.items():
        line = figure.add_trace(go.Scatter(x=list(contexts), y=[b / MiB for b in held], mode="lines", name=name,
                                           line=dict(dash="dot" if "streaming" in name else "solid"),
                                           hovertemplate=name + ": %{y:.1f} MiB at %{x:,} tokens<extra></extra>"))
        if name in measured:
            tokens, held_bytes = measured[name]
            figure.add_trace(go.Scatter(x=[tokens], y=[held_bytes / MiB], mode="markers", showlegend=False,
                                        marker=dict(symbol="diamond", size=12, color=line.data[-1].line.color),
                                        hovertemplate=name + " measured: %{y:.2f} MiB at %{x:,} tokens"
                                                             "<extra></extra>"))
    figure.update_layout(title="KV cache against context: formula per layer type (lines), measured (◆)",
                         xaxis_title="context (tokens)", xaxis_type="log", yaxis_title="KV MiB", yaxis_type="log",
                         height=420, legend=dict(orientation="h", y=-0.25), margin=dict(t=50, b=40, l=50, r=20))
    return figure

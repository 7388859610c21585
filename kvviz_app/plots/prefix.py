"""The Prefix reuse page's figures: block tables, time to first token, kept-set overlap, context cost."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvviz_app.plots.common import MiB

BLOCK_COLORS = {"hit": "#2ca02c", "recomputed": "#ff7f0e", "miss": "#d62728", "partial": "#c7c7c7"}


def block_table_figure(tables: Sequence[Sequence[str]], labels: Sequence[str], block_tokens: int) -> go.Figure:
    """One row per prompt, one cell per block: reused (hit), prefilled (miss), cached but fed again, or partial."""
    statuses = list(BLOCK_COLORS)
    width = max((len(t) for t in tables), default=0)
    z = [[statuses.index(s) if i < len(row) else None for i, s in enumerate(list(row) + [None] * (width - len(row)))]
         for row in tables]
    scale = []
    for index, status in enumerate(statuses):
        scale += [[index / len(statuses), BLOCK_COLORS[status]], [(index + 1) / len(statuses), BLOCK_COLORS[status]]]
    text = [[(s or "") for s in list(row) + [None] * (width - len(row))] for row in tables]
    figure = go.Figure(go.Heatmap(
        z=z, x=list(range(width)), y=[str(label)[:40] for label in labels], zmin=-0.5, zmax=len(statuses) - 0.5,
        colorscale=scale, showscale=False, xgap=1, ygap=3, customdata=text,
        hovertemplate=f"block %{{x}} (tokens %{{x}}×{block_tokens}…): %{{customdata}}<extra>%{{y}}</extra>"))
    for status, color in BLOCK_COLORS.items():  # a legend for the categorical colours
        figure.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=status,
                                    marker=dict(color=color, size=12, symbol="square")))
    figure.update_layout(title=f"Block table ({block_tokens} tokens per block): reused or prefilled",
                         xaxis_title="block", yaxis_autorange="reversed", height=120 + 50 * len(tables),
                         margin=dict(t=50, b=40, l=10, r=10), legend=dict(orientation="h", y=-0.35),
                         plot_bgcolor="white")
    return figure


def ttft_figure(labels: Sequence[str], fresh: Sequence[float], reused: Sequence[float]) -> go.Figure:
    """Time to first token per prompt, fresh prefill next to prefix reuse (milliseconds)."""
    names = [str(label)[:40] for label in labels]
    figure = go.Figure([
        go.Bar(name="fresh prefill", x=names, y=[s * 1000 for s in fresh], marker_color="#7f7f7f",
               hovertemplate="%{x}: %{y:.0f} ms<extra>fresh</extra>"),
        go.Bar(name="with prefix reuse", x=names, y=[s * 1000 for s in reused], marker_color="#2ca02c",
               hovertemplate="%{x}: %{y:.0f} ms<extra>reuse</extra>"),
    ])
    figure.update_layout(barmode="group", title="Time to first token (measured)", yaxis_title="ms", height=340,
                         margin=dict(t=50, b=40, l=50, r=20), legend=dict(orientation="h", y=1.12))
    return figure


def jaccard_figure(rows: Sequence[tuple[str, Sequence[float]]]) -> go.Figure:
    """Per layer, the Jaccard overlap of the preamble tokens kept for question A and for question B."""
    figure = go.Figure()
    for name, values in rows:
        figure.add_trace(go.Scatter(x=list(range(len(values))), y=list(values), mode="lines+markers", name=name,
                                    hovertemplate="layer %{x}: %{y:.3f}<extra>" + name + "</extra>"))
    figure.update_layout(title="Kept preamble tokens, question A vs B (Jaccard, mean over KV heads)",
                         xaxis_title="layer", yaxis_title="Jaccard", yaxis_range=[0, 1.05], height=380,
                         margin=dict(t=50, b=40, l=50, r=20), legend=dict(orientation="h", y=-0.25))
    return figure


def context_cost_figure(tokens: Sequence[int], seconds: Sequence[float], kv_bytes: Sequence[int]) -> go.Figure:
    """Measured prefill time and cache bytes against prompt length: context as a cost input."""
    figure = make_subplots(specs=[[{"secondary_y": True}]])
    figure.add_trace(go.Scatter(x=list(tokens), y=[s * 1000 for s in seconds], name="prefill time (ms)",
                                mode="lines+markers", marker_color="#1f77b4"), secondary_y=False)
    figure.add_trace(go.Scatter(x=list(tokens), y=[b / MiB for b in kv_bytes], name="KV cache (MiB)",
                                mode="lines+markers", marker_color="#d62728"), secondary_y=True)
    figure.update_layout(title="What a context costs: prefill time and cache memory vs prompt length", height=360,
                         margin=dict(t=50, b=40, l=50, r=50), legend=dict(orientation="h", y=1.12),
                         xaxis_title="prompt tokens")
    figure.update_yaxes(title_text="ms", secondary_y=False)
    figure.update_yaxes(title_text="MiB", secondary_y=True)
    return figure

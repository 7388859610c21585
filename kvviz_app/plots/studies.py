"""The Needle and Tail risk pages' figures: found per depth and length, accuracy per task and method."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvviz_app.plots.common import integer_ticks


def needle_heatmaps(frame: pd.DataFrame) -> go.Figure:
    """One heatmap per method: share of trials that found the needle, depth (x) by prompt length (y)."""
    methods = list(dict.fromkeys(frame["method"]))
    columns = min(3, max(1, len(methods)))
    rows = math.ceil(len(methods) / columns)
    figure = make_subplots(rows=rows, cols=columns, subplot_titles=methods, horizontal_spacing=0.08,
                           vertical_spacing=0.15)
    for index, method in enumerate(methods):
        grid = (frame[frame["method"] == method].assign(found=lambda f: f["found"].astype(float))
                .pivot_table(index="length", columns="depth", values="found", aggfunc="mean").sort_index())
        figure.add_trace(go.Heatmap(
            z=grid.values, x=[f"{d:.0%}" for d in grid.columns], y=[str(v) for v in grid.index], zmin=0, zmax=1,
            colorscale=[[0, "#d62728"], [0.5, "#ffbb00"], [1, "#2ca02c"]], showscale=index == 0,
            text=[[f"{v:.0%}" for v in row] for row in grid.values], texttemplate="%{text}",
            hovertemplate="depth %{x}, length %{y}: found %{z:.0%}<extra>" + method + "</extra>",
        ), row=index // columns + 1, col=index % columns + 1)
    figure.update_xaxes(title_text="needle depth", type="category")  # "10%" would otherwise be read as 10
    figure.update_yaxes(title_text="prompt tokens", type="category")
    figure.update_layout(title="Needle found (share of trials)", height=320 * rows + 60,
                         margin=dict(t=80, b=40, l=60, r=20))
    return figure


def needle_eviction_figure(failures: pd.DataFrame) -> go.Figure:
    """For failed trials: when the needle was evicted (0 = at prefill) and in how many layers."""
    data = failures.assign(step=failures["evicted_step"].fillna(-1),
                           layers=failures["evicted_layers"].map(_count_layers))
    figure = go.Figure()
    for method, group in data.groupby("method", sort=False):
        figure.add_trace(go.Scatter(
            x=group["depth"], y=group["step"], mode="markers", name=str(method),
            marker=dict(size=8 + group["layers"].clip(upper=30) / 2),
            customdata=np.stack([group["length"], group["layers"]], axis=-1),
            hovertemplate="depth %{x:.0%}, length %{customdata[0]}: evicted at step %{y} "
                          "in %{customdata[1]} layers<extra>" + str(method) + "</extra>",
        ))
    figure.update_layout(title="Failures: when the needle left the cache (−1: never evicted; 0: at prefill)",
                         xaxis_title="needle depth", xaxis_tickformat=".0%", yaxis_title="eviction step",
                         height=360, margin=dict(t=50, b=40, l=50, r=20))
    figure.update_yaxes(**integer_ticks(int(data["step"].max()) + 2 if len(data) else 1))
    return figure


def _count_layers(value) -> int:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return 0
    if isinstance(value, (list, tuple, np.ndarray)):
        return len(value)
    return int(value)


TAIL_ORDER = ("needle", "multikey", "multivalue", "vartrack k=1", "vartrack k=2", "vartrack k=3", "vartrack k=4",
              "instructions")


def _tail_columns(labels) -> list[str]:
    """Task labels in reading order: the single needle first, then harder tasks, hops in order."""
    present = list(dict.fromkeys(labels))
    return [t for t in TAIL_ORDER if t in present] + [t for t in present if t not in TAIL_ORDER]


def tail_heatmap(summary: pd.DataFrame) -> go.Figure:
    """Accuracy per method (rows) and task (columns) from a tail report's summary; the cell says accuracy (items)."""
    tasks = _tail_columns(summary["task"])
    methods = list(dict.fromkeys(summary["method"]))
    grid = summary.pivot_table(index="method", columns="task", values="accuracy").reindex(index=methods,
                                                                                         columns=tasks)
    counts = summary.pivot_table(index="method", columns="task", values="items").reindex(index=methods,
                                                                                        columns=tasks)
    text = [[("" if np.isnan(v) else f"{v:.0%} ({int(n)})") for v, n in zip(row, count, strict=True)]
            for row, count in zip(grid.values, counts.fillna(0).values, strict=True)]
    figure = go.Figure(go.Heatmap(
        z=grid.values, x=tasks, y=methods, zmin=0, zmax=1, text=text, texttemplate="%{text}",
        colorscale=[[0, "#d62728"], [0.5, "#ffbb00"], [1, "#2ca02c"]], colorbar=dict(title="accuracy"),
        hovertemplate="%{y} on %{x}: %{z:.0%}<extra></extra>"))
    figure.update_layout(title="Accuracy per task and method (items the full cache got right; count in brackets)",
                         xaxis_title="task", yaxis=dict(autorange="reversed", type="category"),
                         height=140 + 42 * len(methods), margin=dict(t=50, b=40, l=260, r=20))
    return figure


def tail_contrast_figure(summary: pd.DataFrame) -> go.Figure:
    """Per method, the single needle next to the chain of k hops: the same budget, one more copy to follow each."""
    tasks = [t for t in _tail_columns(summary["task"]) if t == "needle" or t.startswith("vartrack")]
    figure = go.Figure()
    colours = ["#1f77b4", "#9ecae1", "#6baed6", "#3182bd", "#08519c"]
    for index, task in enumerate(tasks):
        rows = summary[summary["task"] == task]
        figure.add_trace(go.Bar(x=rows["method"], y=rows["accuracy"], name=task,
                                marker_color="#2ca02c" if task == "needle" else colours[min(index, 4)],
                                customdata=rows["items"], texttemplate="%{y:.0%}", textposition="outside",
                                hovertemplate=task + ", %{x}: %{y:.0%} of %{customdata} items<extra></extra>"))
    figure.update_layout(title="Single needle vs multi-hop (vartrack k hops) at the same budget", barmode="group",
                         yaxis_title="accuracy", yaxis_tickformat=".0%", yaxis_range=[0, 1.15], height=380,
                         legend_title="task", margin=dict(t=50, b=40, l=50, r=20))
    return figure

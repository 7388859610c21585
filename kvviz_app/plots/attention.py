"""The Attention page's figures: sink mass, attention matrices, received attention, kept masks."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvviz_app.plots.common import as_array

HEATMAP_MAX = 256  # cells per side drawn in one heatmap


def downsample(matrix, size: int = HEATMAP_MAX) -> np.ndarray:
    """Block-average a 2-D matrix to at most ``size`` x ``size`` cells."""
    data = as_array(matrix)
    rows, cols = data.shape
    row_bins, col_bins = min(rows, size), min(cols, size)
    if (row_bins, col_bins) == (rows, cols):
        return data
    row_index = np.arange(rows) * row_bins // rows
    col_index = np.arange(cols) * col_bins // cols
    summed = np.zeros((row_bins, col_bins))
    np.add.at(summed, (row_index[:, None], col_index[None, :]), data)
    counts = np.zeros((row_bins, col_bins))
    np.add.at(counts, (row_index[:, None], col_index[None, :]), 1.0)
    return summed / np.maximum(counts, 1)


def _bin_positions(bins: int, tokens: int) -> np.ndarray:
    """The first token position each of ``bins`` equal bins over ``tokens`` covers."""
    return np.ceil(np.arange(bins) * tokens / bins).astype(int)


def sink_mass_figure(per_layer: Sequence[float], sink_tokens: int) -> go.Figure:
    """Bar chart: share of each layer's attention that lands on the first ``sink_tokens`` tokens."""
    values = [float(v) for v in per_layer]
    figure = go.Figure(go.Bar(x=list(range(len(values))), y=values, marker_color="#d62728",
                              hovertemplate="layer %{x}: %{y:.1%}<extra></extra>"))
    figure.update_layout(title=f"Attention on the first {sink_tokens} tokens, per layer (mean over heads and queries)",
                         xaxis_title="layer", yaxis_title="share of attention", yaxis_tickformat=".0%",
                         yaxis_range=[0, 1], height=340, margin=dict(t=50, b=40, l=50, r=20))
    return figure


def attention_heatmap(matrix, num_tokens: int, title: str, size: int = HEATMAP_MAX) -> go.Figure:
    """Heatmap of a (possibly block-averaged) attention matrix; axes in token positions.

    The colour scale stops at the 99th percentile so that a strong sink column does not wash out everything else.
    """
    data = downsample(matrix, size)
    rows, cols = data.shape
    top = float(np.quantile(data, 0.99)) if data.size else 1.0
    figure = go.Figure(go.Heatmap(
        z=data, x=_bin_positions(cols, num_tokens), y=_bin_positions(rows, num_tokens), colorscale="Viridis",
        zmin=0, zmax=max(top, 1e-9), colorbar=dict(title="attention"),
        hovertemplate="query %{y}, key %{x}: %{z:.3f}<extra></extra>",
    ))
    note = "" if rows == num_tokens else f" (downsampled {num_tokens} → {rows} bins)"
    figure.update_layout(title=title + note, xaxis_title="key position", yaxis_title="query position",
                         yaxis_autorange="reversed", height=480, margin=dict(t=50, b=40, l=50, r=20))
    return figure


def head_gallery(matrices: dict[int, object], num_tokens: int, layer: int, columns: int = 3,
                 size: int = 64) -> go.Figure:
    """A grid of small heatmaps, one per query head of a layer, each scaled to its own 99th percentile."""
    heads = sorted(matrices)
    rows = max(1, math.ceil(len(heads) / columns))
    figure = make_subplots(rows=rows, cols=columns, subplot_titles=[f"head {h}" for h in heads],
                           horizontal_spacing=0.04, vertical_spacing=0.08)
    for index, head in enumerate(heads):
        data = downsample(matrices[head], size)
        top = float(np.quantile(data, 0.99)) if data.size else 1.0
        figure.add_trace(go.Heatmap(z=data, colorscale="Viridis", zmin=0, zmax=max(top, 1e-9), showscale=False,
                                    hovertemplate=f"head {head}: %{{z:.3f}}<extra></extra>"),
                         row=index // columns + 1, col=index % columns + 1)
    figure.update_yaxes(autorange="reversed", showticklabels=False)
    figure.update_xaxes(showticklabels=False)
    figure.update_layout(title=f"Layer {layer}: every head's pattern ({num_tokens} tokens)", height=240 * rows + 60,
                         margin=dict(t=70, b=10, l=10, r=10))
    return figure


def received_attention(key_attention, skip: int = 0) -> np.ndarray:
    """Mean attention each token receives per query that could see it, summed over heads: [N].

    Key i is visible to N - i queries, so the raw column sums favour early tokens; dividing by that count lets a
    late heavy hitter stand out as much as an early one. ``skip`` leading tokens (sinks) are set to NaN so they do
    not dominate the colour scale.
    """
    data = as_array(key_attention)
    summed = data.sum(axis=0) if data.ndim == 2 else data
    length = summed.shape[0]
    scores = summed / (length - np.arange(length))
    if skip:
        scores[:skip] = np.nan
    return scores


def kept_fraction(kept_mask) -> np.ndarray:
    """[N] share of KV heads still caching each token, from a [kv_heads, N] boolean mask."""
    return as_array(kept_mask).mean(axis=0)


def kept_heatmap(kept_mask, layer: int | str, method: str) -> go.Figure:
    """KV heads x tokens: 1 where the token is still cached, 0 where it was evicted."""
    data = as_array(kept_mask)
    figure = go.Figure(go.Heatmap(z=data, colorscale=[[0, "#d62728"], [1, "#2ca02c"]], zmin=0, zmax=1,
                                  showscale=False, hovertemplate="KV head %{y}, token %{x}: %{z}<extra></extra>"))
    figure.update_layout(title=f"{method}: layer {layer}, kept (green) and evicted (red) per KV head",
                         xaxis_title="token position", yaxis_title="KV head", height=120 + 40 * data.shape[0],
                         margin=dict(t=50, b=40, l=50, r=20))
    return figure

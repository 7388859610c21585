"""The Compare page's figures: bytes per method and per axis, cache growth, KL, quantization error."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvviz_app.plots.common import MiB, integer_ticks


def memory_figure(frame: pd.DataFrame, weight_bytes: int) -> go.Figure:
    """Per method: measured KV bytes split into codes / metadata / full precision, the full-cache formula, weights.

    ``frame`` columns: method, codes, metadata, full_precision, formula (bytes).
    """
    figure = make_subplots(rows=1, cols=2, column_widths=[0.62, 0.38], subplot_titles=(
        "KV cache per method: measured (bars) vs full-cache formula (◆)", "Weights vs KV cache"))
    parts = (("full_precision", "full precision", "#1f77b4"), ("codes", "quantized codes", "#ff7f0e"),
             ("metadata", "scales / zero points", "#9467bd"))
    for column, label, colour in parts:
        figure.add_trace(go.Bar(x=frame["method"], y=frame[column] / MiB, name=label, marker_color=colour,
                                hovertemplate="%{x}: %{y:.3f} MiB<extra>" + label + "</extra>"), row=1, col=1)
    figure.add_trace(go.Scatter(x=frame["method"], y=frame["formula"] / MiB, mode="markers", name="formula (full)",
                                marker=dict(symbol="diamond", size=11, color="black")), row=1, col=1)
    total = frame[[p[0] for p in parts]].sum(axis=1) / MiB
    figure.add_trace(go.Bar(x=frame["method"], y=[weight_bytes / MiB] * len(frame), name="weights",
                            marker_color="#7f7f7f"), row=1, col=2)
    figure.add_trace(go.Bar(x=frame["method"], y=total, name="KV (measured)", marker_color="#2ca02c"), row=1, col=2)
    figure.update_layout(barmode="stack", height=420, legend=dict(orientation="h", y=-0.25),
                         margin=dict(t=50, b=40, l=50, r=20))
    figure.update_yaxes(title_text="MiB", row=1, col=1)
    figure.update_yaxes(title_text="MiB", row=1, col=2)
    return figure


def layer_bytes_figure(per_layer: dict[str, Sequence[int]], kinds: Sequence[str]) -> go.Figure:
    """KV bytes each layer holds at the end, one bar group per layer labelled with its type (``global`` or
    ``local W``), one colour per method: a local layer's bar stops at its window whatever the method."""
    labels = [f"{index} · {kind}" for index, kind in enumerate(kinds)]
    figure = go.Figure()
    for method, values in per_layer.items():
        figure.add_trace(go.Bar(x=labels, y=[v / MiB for v in values], name=method,
                                hovertemplate="layer %{x}: %{y:.3f} MiB<extra>" + method + "</extra>"))
    local = sum(kind != "global" for kind in kinds)
    title = "KV bytes per layer at the end" + (f" ({local} local layers hold at most their window; the global "
                                                "ones hold what the method keeps)" if local else "")
    figure.update_layout(title=title, barmode="group", height=380, yaxis_title="MiB", xaxis_title="layer · type",
                         legend=dict(orientation="h", y=-0.3), margin=dict(t=50, b=40, l=50, r=20))
    return figure


def axis_factors_figure(factors: dict[str, dict]) -> go.Figure:
    """Per method, the cache's bytes after each axis: full, x heads/latent, x tokens kept, x bits; ◆ = measured.

    ``factors``: method -> :meth:`kvviz.cache.architecture.AxisFactors.to_json`.
    """
    stages = ["full", "× architecture", "× eviction", "× quantization"]
    figure = go.Figure()
    for method, f in factors.items():
        running = [f["full_bytes"]]
        for axis in ("architecture", "eviction", "quantization"):
            running.append(running[-1] * f[axis])
        line = figure.add_trace(go.Scatter(
            x=stages, y=np.array(running) / MiB, mode="lines+markers", name=method,
            customdata=[1.0, f["architecture"], f["eviction"], f["quantization"]],
            hovertemplate=method + ": %{y:.3f} MiB (factor %{customdata:.3f})<extra></extra>"))
        colour = line.data[-1].line.color
        figure.add_trace(go.Scatter(x=[stages[-1]], y=[f["measured_bytes"] / MiB], mode="markers", showlegend=False,
                                    marker=dict(symbol="diamond", size=12, color=colour, line=dict(width=1)),
                                    hovertemplate=method + " measured: %{y:.3f} MiB<extra></extra>"))
    figure.update_layout(title="Three axes, one product: full bytes × heads × tokens × bits (◆ measured)",
                         height=380, yaxis_title="KV MiB", legend=dict(orientation="h", y=-0.2),
                         margin=dict(t=50, b=40, l=50, r=20))
    return figure


def kv_growth_figure(per_step: dict[str, Sequence[int]]) -> go.Figure:
    """KV bytes held after each decode step, one line per method."""
    figure = go.Figure()
    for method, values in per_step.items():
        figure.add_trace(go.Scatter(y=[v / MiB for v in values], mode="lines", name=method))
    figure.update_layout(title="KV cache size during generation", xaxis_title="decode step", yaxis_title="MiB",
                         height=340, margin=dict(t=50, b=40, l=50, r=20))
    figure.update_xaxes(**integer_ticks(max((len(v) for v in per_step.values()), default=1)))
    return figure


def kl_figure(per_step: dict[str, Sequence[float]]) -> go.Figure:
    """Teacher-forced KL(full || method) at each generated step, one line per method."""
    figure = go.Figure()
    for method, values in per_step.items():
        figure.add_trace(go.Scatter(y=list(values), mode="lines+markers", name=method))
    figure.update_layout(title="How far each method's next-token distribution is from full's (teacher-forced)",
                         xaxis_title="generated token", yaxis_title="KL (nats)", height=340,
                         margin=dict(t=50, b=40, l=50, r=20))
    figure.update_xaxes(**integer_ticks(max((len(v) for v in per_step.values()), default=1)))
    return figure


def reconstruction_figure(errors: dict[str, tuple[Sequence[float], Sequence[float]]]) -> go.Figure:
    """Relative reconstruction error of keys (solid) and values (dotted) per layer, one colour per method."""
    figure = go.Figure()
    colours = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
    for index, (method, (keys, values)) in enumerate(errors.items()):
        colour = colours[index % len(colours)]
        figure.add_trace(go.Scatter(y=list(keys), mode="lines", name=f"{method} keys", line=dict(color=colour)))
        figure.add_trace(go.Scatter(y=list(values), mode="lines", name=f"{method} values",
                                    line=dict(color=colour, dash="dot")))
    figure.update_layout(title="Quantization error on this prompt: ‖stored − original‖ / ‖original‖ per layer",
                         xaxis_title="layer", yaxis_title="relative error", yaxis_tickformat=".0%", height=360,
                         margin=dict(t=50, b=40, l=50, r=20))
    return figure


def key_channel_figure(absmax) -> go.Figure:
    """Largest |key| per channel (x: KV head · channel) in every layer (y): outlier channels show as bright stripes."""
    layers, heads, dim = absmax.shape
    figure = go.Figure(go.Heatmap(
        z=absmax.reshape(layers, heads * dim).tolist(), colorscale="Viridis", colorbar=dict(title="max |k|"),
        hovertemplate="layer %{y}, channel %{x}: max |k| %{z:.2f}<extra></extra>"))
    for head in range(1, heads):
        figure.add_vline(x=head * dim - 0.5, line=dict(color="white", width=1))
    figure.update_layout(title="Key magnitude per channel on this prompt (KV heads separated by white lines)",
                         xaxis_title="KV head × channel", yaxis_title="layer", height=360,
                         margin=dict(t=50, b=40, l=50, r=20))
    return figure


LAYOUT_COLOURS = ("#2ca02c", "#9467bd", "#d62728", "#ff7f0e", "#1f77b4")


def layouts_figure(held: dict[str, dict[str, int]], freed: dict[str, dict[str, float]], labels: dict[str, str],
                   block_size: int) -> go.Figure:
    """Per configuration, side by side: the bytes kvviz counts and what each serving layout would hold, each bar
    labelled with the share of the full cache (in the same layout) it frees.

    ``held``: method -> layout -> bytes; ``freed``: method -> layout -> share freed; ``labels``: layout -> name,
    in the order drawn."""
    figure = go.Figure()
    methods = list(held)
    for (layout, label), colour in zip(labels.items(), LAYOUT_COLOURS, strict=False):
        shares = [freed[m][layout] for m in methods]
        figure.add_trace(go.Bar(
            x=methods, y=[held[m][layout] / MiB for m in methods], name=label, marker_color=colour,
            text=[f"{share:.0%}" for share in shares], textposition="outside", customdata=shares,
            hovertemplate="%{x}: %{y:.3f} MiB, frees %{customdata:.1%} of full<extra>" + label + "</extra>"))
    figure.update_layout(barmode="group", height=440, legend=dict(orientation="h", y=-0.22),
                         title=f"What each layout would hold (blocks of {block_size} token slots); labels: the share "
                               "of full it frees", margin=dict(t=60, b=40, l=50, r=20), uniformtext_minsize=8)
    figure.update_yaxes(title_text="MiB")
    return figure

"""Figure builders for the app: Plotly figures and small HTML snippets, with no Streamlit import (unit-testable).

Every builder takes plain numbers (lists, numpy arrays, torch tensors, pandas frames) and returns a figure or an
HTML string; the pages only place them.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

HEATMAP_MAX = 256  # cells per side drawn in one heatmap
MiB = 2**20


def as_array(values) -> np.ndarray:
    """A float numpy array from a tensor, array or list."""
    if hasattr(values, "detach"):
        values = values.detach().float().cpu().numpy()
    return np.asarray(values, dtype=float)


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


def _style(text: str) -> str:
    """A token as HTML: escaped, with newlines shown as line breaks."""
    return html.escape(text).replace("\n", "↵<br>")


def token_shading_html(tokens: Sequence[str], scores: Sequence[float], rgb: str = "255,127,14") -> str:
    """The prompt with each token's background as strong as its score (scaled to the largest; NaN: grey outline)."""
    values = np.asarray(scores, dtype=float)
    finite = values[np.isfinite(values)]
    top = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    spans = []
    for position, (token, score) in enumerate(zip(tokens, values, strict=False)):
        if not np.isfinite(score):
            spans.append(f'<span title="#{position} sink (excluded)" style="outline:1px dashed #888">'
                         f"{_style(token)}</span>")
            continue
        alpha = min(1.0, score / top)
        spans.append(f'<span title="#{position}: {score:.4f}" style="background:rgba({rgb},{alpha:.2f})">'
                     f"{_style(token)}</span>")
    return _wrap("".join(spans))


def _wrap(inner: str) -> str:
    return ('<div style="font-family:monospace;white-space:pre-wrap;line-height:1.7;max-height:420px;'
            f'overflow-y:auto;border:1px solid #ddd;padding:8px;border-radius:6px">{inner}</div>')


def divergence_html(tokens: Sequence[str], first_divergence: int | None) -> str:
    """Generated text with everything from the first divergence from the full cache highlighted."""
    if first_divergence is None or first_divergence >= len(tokens):
        same, different = "".join(tokens), ""
    else:
        same, different = "".join(tokens[:first_divergence]), "".join(tokens[first_divergence:])
    marked = (f'<span title="differs from full from token {first_divergence}" '
              f'style="background:rgba(214,39,40,0.25);border-left:3px solid #d62728">{_style(different)}</span>'
              if different else "")
    if first_divergence is not None and not different:
        marked = '<span style="color:#d62728">[ended early]</span>'
    return _wrap(_style(same) + marked)


def kept_fraction(kept_mask) -> np.ndarray:
    """[N] share of KV heads still caching each token, from a [kv_heads, N] boolean mask."""
    return as_array(kept_mask).mean(axis=0)


def kept_map_html(tokens: Sequence[str], fraction: Sequence[float]) -> str:
    """The prompt coloured by how many KV heads kept each token: green all, red none, amber some."""
    spans = []
    for position, (token, share) in enumerate(zip(tokens, fraction, strict=False)):
        colour = "44,160,44" if share >= 1 else "214,39,40" if share <= 0 else "255,187,0"
        alpha = 0.35 if share >= 1 or share <= 0 else 0.5
        spans.append(f'<span title="#{position}: kept by {share:.0%} of KV heads" '
                     f'style="background:rgba({colour},{alpha})">{_style(token)}</span>')
    return _wrap("".join(spans))


def kept_heatmap(kept_mask, layer: int, method: str) -> go.Figure:
    """KV heads x tokens: 1 where the token is still cached, 0 where it was evicted."""
    data = as_array(kept_mask)
    figure = go.Figure(go.Heatmap(z=data, colorscale=[[0, "#d62728"], [1, "#2ca02c"]], zmin=0, zmax=1,
                                  showscale=False, hovertemplate="KV head %{y}, token %{x}: %{z}<extra></extra>"))
    figure.update_layout(title=f"{method}: layer {layer}, kept (green) and evicted (red) per KV head",
                         xaxis_title="token position", yaxis_title="KV head", height=120 + 40 * data.shape[0],
                         margin=dict(t=50, b=40, l=50, r=20))
    return figure


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


def integer_ticks(count: int, ticks: int = 10) -> dict:
    """Axis settings with whole-number ticks for an axis of ``count`` steps (no 0.5 ticks on a short run)."""
    return dict(tick0=0, dtick=max(1, math.ceil(count / ticks)), tickformat="d")
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


def tail_context_html(tokens: Sequence[str], evicted_share: Sequence[float] | None,
                      spans: Sequence[tuple[str, Sequence[int]]]) -> str:
    """The prompt with planted spans marked: green where every layer and head kept them, red (strength = share of
    layers x heads) where they were evicted; other tokens fade the more they were evicted."""
    share = np.zeros(len(tokens)) if evicted_share is None else np.asarray(evicted_share, dtype=float)
    planted = {p: label for label, positions in spans for p in positions}
    pieces = []
    for position, token in enumerate(tokens):
        lost = float(share[position]) if position < len(share) else 0.0
        if position in planted:
            style = (f"background:rgba(214,39,40,{0.35 + 0.6 * lost:.2f});font-weight:bold" if lost > 0
                     else "background:rgba(44,160,44,0.35)")
            title = f"#{position} {planted[position]}: evicted in {lost:.0%} of layers x heads"
        else:
            style = f"color:rgba(0,0,0,{1 - 0.75 * lost:.2f})" + (";text-decoration:line-through" if lost >= 1 else "")
            title = f"#{position}: evicted in {lost:.0%} of layers x heads"
        pieces.append(f'<span title="{html.escape(title)}" style="{style}">{_style(token)}</span>')
    return _wrap("".join(pieces))
# -- prefix reuse -------------------------------------------------------------------------------------------------
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

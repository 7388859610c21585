"""The Trade-offs page's chart and links: quality against compression, one line per family, the frontier on top."""

from __future__ import annotations

import math
from urllib.parse import urlencode

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from kvviz.studies.frontier import MEASURES
from kvviz.studies.sweep import SweepReport
from kvviz_app.url import Read, shown


def tradeoff_figure(report: SweepReport, measure_key: str) -> go.Figure:
    """Quality (``measure_key``) against how many times smaller than full, log scale; hover names each SPEC."""
    measure = MEASURES[measure_key]
    frame = pd.DataFrame([p.to_json() for p in report.points if p.error is None
                          and p.compression is not None and getattr(p, measure_key) is not None])
    figure = go.Figure()
    if frame.empty:
        return figure
    for family, rows in frame.groupby("family", sort=False):
        rows = rows.sort_values(["budget", "compression"])  # in the order of the swept parameter
        figure.add_trace(go.Scatter(
            x=rows["compression"], y=rows[measure_key], name=family, mode="lines+markers",
            customdata=rows[["spec", "kv_bytes"]].to_numpy(),
            hovertemplate=(f"<b>%{{customdata[0]}}</b><br>%{{x:.2f}}x smaller than full · "
                           f"%{{customdata[1]:,}} B<br>{measure.label} %{{y:.3g}}<extra></extra>")))
    frontier = frame[frame["spec"].isin(report.frontiers.get(measure_key, []))].sort_values("compression")
    figure.add_trace(go.Scatter(x=frontier["compression"], y=frontier[measure_key], name="frontier",
                                mode="lines+markers", hoverinfo="skip",  # translucent: the lines under it show
                                line={"color": "rgba(0, 0, 0, 0.3)", "width": 8},
                                marker={"size": 14, "color": "rgba(0, 0, 0, 0)",
                                        "line": {"color": "black", "width": 2}}))
    ticks = [2.0 ** k for k in range(0, 1 + math.ceil(math.log2(max(2.0, frame["compression"].max()))))]
    figure.update_xaxes(type="log", title="compression (times smaller than full, log scale)", tickvals=ticks,
                        ticktext=[f"{t:g}x" for t in ticks])
    figure.update_yaxes(title=measure.label + ("" if measure.higher_is_better else " (lower is better)"),
                        tickformat=".0%" if measure.percent else None)
    figure.update_layout(title=f"{measure.label.capitalize()} against memory: {report.workload}",
                         legend_title="family", hovermode="closest")
    return figure


def compare_link(spec: str, prompt: str | None, chat: bool, max_new_tokens: int) -> str:
    """The Compare page with ``full`` and this SPEC (and the prompt, when the sweep ran on one)."""
    query: dict[str, object] = {"m": ["full", spec] if spec != "full" else ["full"], "n": max_new_tokens}
    if prompt is not None:
        query |= {"prompt": prompt, "chat": int(chat)}
    return f"Compare?{urlencode(query, doseq=True)}"


def families_from_link(offered: list[str], default: list[str]) -> tuple[Read[list[str]], str]:
    """The link's repeated ``m``: the offered families for the multiselect, and every other SPEC, as given, for the
    text box beside it (where the sweep's own check names what is wrong with it). An empty value gets a notice."""
    raw = st.query_params.get_all("m")
    if not raw:
        return Read(default), ""
    listed = list(dict.fromkeys(v for v in raw if v in offered))
    typed = list(dict.fromkeys(v.strip() for v in raw if v not in offered and v.strip()))
    empty = any(not v.strip() for v in raw)
    notice = f"The link's {shown('m', '')} is empty; it is left out." if empty else None
    return Read(listed, notice), " ".join(typed)

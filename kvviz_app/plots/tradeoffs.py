"""The Trade-offs page's figures: quality against compression with each point's interval and its verdict against
full, the frontier and each family's cliff; the items each point used and why it stopped; and, for task items, one
outcome grid per family (items x budgets: both right, lost with its cause, gained, both wrong, blank where the point
had stopped)."""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go

from kvviz.cache.layouts import LABELS
from kvviz.studies.frontier import MEASURES
from kvviz.studies.paired import INCONCLUSIVE, VERDICT_BEYOND, VERDICT_WITHIN, VERDICT_WORSE
from kvviz.studies.sweep import SweepPoint, SweepReport
from kvviz.studies.verdicts import compression_of, family_cliffs

OUTCOME_COLORS = {"both_right": "#2e7d32", "evicted": "#c62828", "quantization": "#ef6c00",
                  "not evicted": "#6a1b9a", "gained": "#1565c0", "both_wrong": "#9e9e9e"}
OUTCOME_LABELS = {"both_right": "right where full is right", "evicted": "lost: a planted span it needed was evicted",
                  "quantization": "lost: nothing planted evicted, the stack quantizes",
                  "not evicted": "lost: every planted span stayed", "gained": "gained: right where full is wrong",
                  "both_wrong": "wrong where full is wrong"}
VERDICT_SYMBOLS = {VERDICT_WITHIN: "circle", INCONCLUSIVE: "circle-open", VERDICT_WORSE: "x-open", VERDICT_BEYOND: "x"}
VERDICT_LEGEND = {VERDICT_WITHIN: "proven within the margin of full",
                  INCONCLUSIVE: "inconclusive: could hide a larger loss",
                  VERDICT_WORSE: "worse than full, within the margin unproven",
                  VERDICT_BEYOND: "beyond the margin: loses more than it",
                  "cliff": "cliff: a family's most compressed point proven within the margin"}
STOP_COLORS = {"within": "#2e7d32", "beyond": "#c62828", "worse": "#ef6c00", "cap": "#9e9e9e", "error": "#6a1b9a",
               None: "#424242"}
STOP_LABELS = {"within": "stopped: proven within the margin", "beyond": "stopped: proven beyond the margin",
               "worse": "stopped: proven worse than full", "cap": "undecided when the run ended",
               "error": "stopped: failed", None: "full (every item any point used)"}


def budget_label(point: SweepPoint) -> str:
    """A grid column's name: the budget as a share of full and the compression reached."""
    share = "fixed" if point.budget is None else (f"1/{round(1 / point.budget)}" if round(1 / point.budget)
                                                  * point.budget == 1 else f"{point.budget:.0%}")
    return f"{share} · {point.compression:.1f}x" if point.compression else share


def tradeoff_figure(report: SweepReport, measure_key: str) -> go.Figure:
    """Quality (``measure_key``) against how many times smaller than full (in the bytes of the report's layout:
    :func:`kvviz.studies.verdicts.compression_of`), log scale, one line per family. Points carry their 95% interval
    as error bars and their verdict against full on that measure as the marker (filled: proven within the margin;
    open: inconclusive; x: worse); a star marks each family's cliff; full is a diamond with its interval as a grey
    band; points on the frontier, found on the same memory, sit on grey discs. For a prompt set, each family's worst
    prompt is a dotted line under its mean."""
    measure, layout = MEASURES[measure_key], report.layout
    x = {p.spec: compression_of(p, report.full, layout) for p in report.points if p.error is None}
    points = [p for p in report.points if p.error is None and x[p.spec] is not None
              and getattr(p, measure_key) is not None]
    figure = go.Figure()
    if not points:
        return figure
    full = next((p for p in points if p.spec == "full"), None)
    interval = measure.interval
    if full is not None and interval and getattr(full, interval):
        low, high = getattr(full, interval)
        figure.add_hrect(y0=low, y1=high, fillcolor="rgba(120, 120, 120, 0.15)", line_width=0,
                         annotation_text="full's 95% interval", annotation_position="bottom left")
    on_frontier = set(report.frontiers.get(measure_key, []))
    on_disc = [p for p in points if p.spec in on_frontier]  # discs, not a line: where nothing is proven better,
    # points with less memory and a lower score all stay on it, and a line through them would zigzag
    figure.add_trace(go.Scatter(x=[x[p.spec] for p in on_disc], y=[getattr(p, measure_key) for p in on_disc],
                                name="frontier", mode="markers",
                                hoverinfo="skip", marker={"size": 26, "color": "rgba(0, 0, 0, 0.13)"}))
    cliffs = {c.spec for c in family_cliffs(report, measure_key).values() if c is not None and c.spec}
    for family in dict.fromkeys(p.family for p in points):
        members = sorted((p for p in points if p.family == family),
                         key=lambda p: (p.budget if p.budget is not None else 0, x[p.spec]))
        values = [getattr(p, measure_key) for p in members]
        bounds = [getattr(p, interval) if interval else None for p in members]
        error = None
        if any(b is not None for b in bounds):
            error = {"type": "data", "symmetric": False, "thickness": 1.2, "width": 4,
                     "array": [0 if b is None else b[1] - v for b, v in zip(bounds, values, strict=True)],
                     "arrayminus": [0 if b is None else v - b[0] for b, v in zip(bounds, values, strict=True)]}
        symbols = [_symbol(p, measure_key, cliffs) for p in members]
        figure.add_trace(go.Scatter(
            x=[x[p.spec] for p in members], y=values, name=family, legendgroup=family, mode="lines+markers",
            error_y=error, marker={"symbol": symbols, "size": [15 if p.spec in cliffs else 10 for p in members],
                                   "line": {"width": 2}},
            hovertext=[_hover(p, measure_key, report.margin, layout, x[p.spec]) for p in members],
            hoverinfo="text"))
        worst = [p.worst_prompt_agreement for p in members]
        if measure_key == "agreement_with_full" and all(w is not None for w in worst):
            figure.add_trace(go.Scatter(
                x=[x[p.spec] for p in members], y=worst, name=f"{family}: worst prompt", legendgroup=family,
                mode="lines+markers", line={"dash": "dot", "width": 1}, marker={"symbol": "x", "size": 6},
                opacity=0.6, hovertext=[f"<b>{p.spec}</b><br>worst prompt {w:.0%}" for p, w in
                                        zip(members, worst, strict=True)], hoverinfo="text"))
    judged = any(measure_key in p.paired_by_measure for p in points)
    legend = ({verdict: symbol for verdict, symbol in VERDICT_SYMBOLS.items()} | {"cliff": "star"}) if judged else {}
    for key, symbol in legend.items():
        figure.add_trace(go.Scatter(x=[None], y=[None], mode="markers", hoverinfo="skip",
                                    name=VERDICT_LEGEND[key].replace("the margin", f"{report.margin:g} points"),
                                    marker={"symbol": symbol, "size": 10, "color": "black"}))
    top = max(x[p.spec] for p in points)
    ticks = [2.0 ** k for k in range(0, 1 + math.ceil(math.log2(max(2.0, top))))]
    counted_as = "" if layout == "counted" else f", {LABELS[layout]}"
    figure.update_xaxes(type="log", title=f"compression (times smaller than full{counted_as}, log scale)",
                        tickvals=ticks,
                        ticktext=[f"{t:g}x" for t in ticks])
    figure.update_yaxes(title=measure.label + ("" if measure.higher_is_better else " (lower is better)"),
                        tickformat=".0%" if measure.percent else None)
    title = f"{measure.label.capitalize()} against memory: {report.workload}"
    if not judged:
        title += " (no verdict on this measure)"
    figure.update_layout(title=title, legend_title="family · verdict", hovermode="closest", height=540)
    return figure


def _symbol(point: SweepPoint, measure_key: str, cliffs: set[str]) -> str:
    if point.spec == "full":
        return "diamond"
    if point.spec in cliffs:
        return "star"
    paired = point.paired_by_measure.get(measure_key)
    return "circle" if paired is None else VERDICT_SYMBOLS[paired.verdict]


def _hover(point: SweepPoint, measure_key: str, margin: float, layout: str = "counted",
           x: float | None = None) -> str:
    measure = MEASURES[measure_key]
    value = getattr(point, measure_key)
    bound = getattr(point, measure.interval) if measure.interval else None
    lines = [f"<b>{point.spec}</b>", f"{point.compression:.2f}x smaller than full · {point.kv_bytes:,} B",
             f"{measure.label} {measure.with_interval(value, bound)}"]
    if layout != "counted" and x is not None:
        lines.insert(2, f"{LABELS[layout]}: {x:.2f}x smaller · {point.layout_bytes[layout]:,} B")
    if point.items_scored:
        lines.append(f"{point.items_scored} scored")
    if point.stopped is not None:
        lines.append(f"stopped after {point.items_used} items (look {point.stopped_at_look}): {point.stopped}")
    paired = point.paired_by_measure.get(measure_key)
    if paired is not None:
        lines += [f"vs full: lost {paired.lost}, gained {paired.gained}; difference {paired.interval_text()}",
                  f"verdict at {margin:g} points: {paired.verdict} ({paired.describe()})",
                  f"adjusted p: within {paired.margin_p_adjusted:.3g}, beyond {paired.beyond_p_adjusted:.3g}, "
                  f"below full {paired.p_adjusted:.3g}"]
    return "<br>".join(lines)


def allocation_figure(report: SweepReport) -> go.Figure:
    """The items each point used, one bar per point (full first, then each family least compressed first),
    coloured by why it stopped taking items: decided (within, beyond, worse) or still open when the run ended."""
    points = [p for p in report.points if p.items_used]
    figure = go.Figure()
    for reason in STOP_COLORS:
        chosen = [p for p in points if p.stopped == reason]
        if not chosen:
            continue
        figure.add_trace(go.Bar(
            y=[p.spec for p in chosen], x=[p.items_used for p in chosen], orientation="h",
            name=STOP_LABELS[reason], marker_color=STOP_COLORS[reason],
            text=[f"{p.items_used}" + ("" if p.stopped_at_look is None else f" · look {p.stopped_at_look}")
                  for p in chosen], textposition="auto",
            hovertext=[f"<b>{p.spec}</b><br>{p.items_used} items<br>{STOP_LABELS[reason]}" for p in chosen],
            hoverinfo="text"))
    figure.update_yaxes(categoryorder="array", categoryarray=[p.spec for p in reversed(points)], title=None)
    figure.update_xaxes(title="items used")
    figure.update_layout(title="Items each point used, and why it stopped", barmode="overlay",
                         height=max(260, 26 * len(points) + 120), legend={"orientation": "h", "y": -0.2})
    return figure


def outcome_cells(report: SweepReport, family: str) -> pd.DataFrame:
    """One row per (item, point) of ``family`` and of full: the item, the point's SPEC and budget label, the outcome
    against full (``both_right``, ``gained``, ``both_wrong``, or a lost item's cause), the output and the planted
    spans its cache evicted (with how many layers did)."""
    members = sorted((p for p in report.points if (p.family == family or p.spec == "full") and p.error is None
                      and p.outcomes), key=lambda p: (p.spec != "full", p.budget or 0, p.compression or 0))
    rows = []
    for point in members:
        for outcome in point.outcomes:
            evicted = ", ".join(f"{label} ({layers} layer{'s' if layers != 1 else ''})"
                                for label, layers in outcome.evicted.items())
            if point.spec == "full":
                kind = "both_right" if outcome.correct else "both_wrong"
            elif outcome.versus_full == "lost":
                kind = outcome.cause or "not evicted"
            else:
                kind = outcome.versus_full
            rows.append({"item": outcome.item, "spec": point.spec,
                         "budget": "full" if point.spec == "full" else budget_label(point), "outcome": kind,
                         "answer": outcome.answer, "evicted": evicted})
    return pd.DataFrame(rows, columns=["item", "spec", "budget", "outcome", "answer", "evicted"])


def outcome_grid(cells: pd.DataFrame, family: str) -> go.Figure:
    """``family``'s outcomes as a grid, items down and budgets across, coloured by outcome (hover: the answer and
    what was evicted, in how many layers)."""
    kinds = list(OUTCOME_COLORS)
    codes = {kind: index for index, kind in enumerate(kinds)}
    items = list(dict.fromkeys(cells["item"]))
    budgets = list(dict.fromkeys(cells["budget"]))
    table = cells.set_index(["item", "budget"])
    z, text = [], []
    for item in items:
        z.append([codes.get(table.loc[(item, b), "outcome"], None) if (item, b) in table.index else None
                  for b in budgets])
        text.append([_cell_text(table.loc[(item, b)]) if (item, b) in table.index else "" for b in budgets])
    steps = len(kinds)
    scale = []
    for index, kind in enumerate(kinds):  # a stepped scale: each code its own colour
        scale += [[index / steps, OUTCOME_COLORS[kind]], [(index + 1) / steps, OUTCOME_COLORS[kind]]]
    figure = go.Figure(go.Heatmap(z=z, x=budgets, y=items, zmin=-0.5, zmax=steps - 0.5, colorscale=scale,
                                  showscale=False, hovertext=text, hoverinfo="text", xgap=2, ygap=1))
    for kind in kinds:  # a legend for the colours
        figure.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=OUTCOME_LABELS[kind],
                                    marker={"symbol": "square", "size": 12, "color": OUTCOME_COLORS[kind]}))
    figure.update_yaxes(autorange="reversed", title="item (task:length:depth:trial)", type="category")
    figure.update_xaxes(title="budget · compression", type="category", side="top")
    figure.update_layout(title=f"{family}: every item at every budget, against full",
                         height=max(320, max(6, min(22, 1400 // max(1, len(items)))) * len(items) + 160),
                         legend={"orientation": "h", "y": -0.08}, margin={"t": 110})
    return figure


def _cell_text(row: pd.Series) -> str:
    lines = [f"<b>{row.name[0] if isinstance(row.name, tuple) else ''}</b>", row["spec"],
             OUTCOME_LABELS.get(row["outcome"], row["outcome"]), f"answer: {row['answer'][:60]}"]
    if row["evicted"]:
        lines.append(f"evicted: {row['evicted']}")
    return "<br>".join(lines)


def prompt_outcomes(report: SweepReport) -> pd.DataFrame:
    """A prompt set's agreement with full per prompt (rows) and configuration (columns), the prompts the worst
    configuration serves least well first."""
    columns = {p.spec: {o.item: o.agreement for o in p.outcomes} for p in report.points[1:]
               if p.error is None and p.outcomes}
    table = pd.DataFrame(columns)
    return table.loc[table.min(axis=1).sort_values().index] if not table.empty else table

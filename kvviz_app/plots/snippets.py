"""HTML snippets: a prompt or an answer with each token shaded, marked or struck through."""

from __future__ import annotations

import html
from collections.abc import Sequence

import numpy as np


def _style(text: str) -> str:
    """A token as HTML: escaped, with newlines shown as line breaks."""
    return html.escape(text).replace("\n", "↵<br>")


def _wrap(inner: str) -> str:
    return ('<div style="font-family:monospace;white-space:pre-wrap;line-height:1.7;max-height:420px;'
            f'overflow-y:auto;border:1px solid #ddd;padding:8px;border-radius:6px">{inner}</div>')


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


def kept_map_html(tokens: Sequence[str], fraction: Sequence[float]) -> str:
    """The prompt coloured by how many KV heads kept each token: green all, red none, amber some."""
    spans = []
    for position, (token, share) in enumerate(zip(tokens, fraction, strict=False)):
        colour = "44,160,44" if share >= 1 else "214,39,40" if share <= 0 else "255,187,0"
        alpha = 0.35 if share >= 1 or share <= 0 else 0.5
        spans.append(f'<span title="#{position}: kept by {share:.0%} of KV heads" '
                     f'style="background:rgba({colour},{alpha})">{_style(token)}</span>')
    return _wrap("".join(spans))


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

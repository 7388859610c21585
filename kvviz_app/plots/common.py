"""Numbers the figures share: arrays from tensors, MiB, whole-number ticks."""

from __future__ import annotations

import math

import numpy as np

MiB = 2**20


def as_array(values) -> np.ndarray:
    """A float numpy array from a tensor, array or list."""
    if hasattr(values, "detach"):
        values = values.detach().float().cpu().numpy()
    return np.asarray(values, dtype=float)


def integer_ticks(count: int, ticks: int = 10) -> dict:
    """Axis settings with whole-number ticks for an axis of ``count`` steps (no 0.5 ticks on a short run)."""
    return dict(tick0=0, dtick=max(1, math.ceil(count / ticks)), tickformat="d")

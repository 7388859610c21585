"""Progress reports: how a long run tells its caller how far it has got, and a step's part of its caller's report."""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[float, str], None]  # (fraction done in [0, 1], what is running now)


def share(progress: Progress | None, start: float, end: float, prefix: str = "") -> Progress | None:
    """The report of a step that is the span ``[start, end]`` of its caller's run: the step's fraction ``f`` reaches
    the caller as ``start + (end - start) * f``, its message after ``prefix``. None when the caller does not listen."""
    if progress is None:
        return None

    def report(fraction: float, message: str) -> None:
        progress(start + (end - start) * fraction, prefix + message)

    return report

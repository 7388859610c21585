"""Where a command's output goes: JSON to a file or stdout, progress to stderr."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

Progress = Callable[[float, str], None]


def write_json(path: str | None, data: dict) -> None:
    text = json.dumps(data, indent=2)
    if path in (None, "-"):
        print(text)
    else:
        Path(path).write_text(text + "\n", encoding="utf-8")


def stderr_progress() -> Progress:
    def report(fraction: float, message: str) -> None:
        bar = "#" * int(fraction * 30)
        print(f"\r[{bar:<30}] {fraction:4.0%} {message[:60]:<60}", end="", file=sys.stderr, flush=True)
        if fraction >= 1:
            print(file=sys.stderr)

    return report


def progress_unless(quiet: bool) -> Progress | None:
    return None if quiet else stderr_progress()

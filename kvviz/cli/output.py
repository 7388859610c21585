"""Where a command's output goes: JSON to a file or stdout, progress to stderr."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Protocol

from kvviz.cli.options import UsageError
from kvviz.runtime.progress import Progress


def write_json(path: str | None, data: dict) -> None:
    """``data`` as JSON to stdout (``-``) or to the file ``path``; a file that cannot be written is a UsageError."""
    text = json.dumps(data, indent=2)
    if path in (None, "-"):
        print(text)
        return
    try:
        Path(path).write_text(text + "\n", encoding="utf-8")
    except OSError as error:
        raise UsageError(f"cannot write {path}: {error.strerror}") from None


class Report(Protocol):
    def to_json(self) -> dict: ...

    def lines(self) -> list[str]: ...


def emit_report(args: argparse.Namespace, report: Report) -> None:
    """A study's report as its command prints it: JSON where ``--json`` says, its text lines unless the JSON goes to
    stdout (which then holds the JSON alone)."""
    if args.json:
        write_json(args.json, report.to_json())
    if args.json != "-":
        print("\n".join(report.lines()))


def stderr_progress() -> Progress:
    def report(fraction: float, message: str) -> None:
        bar = "#" * int(fraction * 30)
        print(f"\r[{bar:<30}] {fraction:4.0%} {message[:60]:<60}", end="", file=sys.stderr, flush=True)
        if fraction >= 1:
            print(file=sys.stderr)

    return report


def progress_unless(quiet: bool) -> Progress | None:
    return None if quiet else stderr_progress()

"""``python -m kvviz``: the engine from a terminal, for scripts and benchmarks.

One module per command in this package, each with ``add_parser(commands)`` and ``run(args)``; adding a command is
adding its module and its name to ``COMMANDS``. Every mistake a user can make (a bad SPEC, a missing file, an unknown
model, a bad setting) ends with one line on stderr and exit code 2, never a traceback; anything else is kvviz's own
bug and ends with its traceback and exit code 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from kvviz.cli.options import UsageError
from kvviz.comparison.session import PromptError
from kvviz.comparison.startup import apply_settings
from kvviz.methods import SpecError
from kvviz.runtime.models import ModelError
from kvviz.runtime.settings import SettingsError

USAGE_ERROR = 2
INTERNAL_ERROR = 1
USER_MISTAKES = (UsageError, SpecError, ModelError, SettingsError, PromptError)
COMMANDS = ("prepare", "config", "info", "methods", "compare", "ppl", "needle", "axes", "tail", "bench", "prefix",
            "sweep")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvviz", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        command = importlib.import_module(f"kvviz.cli.{name}")
        command.add_parser(commands).set_defaults(handler=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; argparse itself exits 2 on a malformed command line."""
    args = build_parser().parse_args(argv)
    try:
        apply_settings()
        return args.handler(args)
    except USER_MISTAKES as error:
        print(f"error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except Exception:  # a bug: the traceback is what a report needs
        traceback.print_exc()
        return INTERNAL_ERROR

"""``python -m kvviz``: the engine from a terminal, for scripts and benchmarks.

One module per command in this package, each with ``add_parser(commands)`` and ``run(args)``; adding a command is
adding its module and its name to ``COMMANDS``. Every mistake a user can make (a bad SPEC, a missing file, an unknown
model) ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvviz.cli.options import UsageError
from kvviz.methods import SpecError
from kvviz.runtime.models import ModelError

USAGE_ERROR = 2
COMMANDS = ("prepare", "config", "info", "methods", "compare", "ppl", "needle", "axes", "tail", "bench", "prefix")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvviz", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        command = importlib.import_module(f"kvviz.cli.{name}")
        command.add_parser(commands).set_defaults(handler=command.run)
    return parser


def configure_presses_from_settings() -> None:
    """Hand the server's own kvpress presses (KVVIZ_PRESSES, KVVIZ_ALLOW_PRESSES) to the methods, which read no
    environment themselves."""
    from kvviz.methods.kvpress.catalog import configure_presses
    from kvviz.runtime.settings import Settings

    settings = Settings.from_env()
    configure_presses(settings.presses, settings.custom_presses_allowed)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configure_presses_from_settings()
        return args.handler(args)
    except (SpecError, ModelError, UsageError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return USAGE_ERROR

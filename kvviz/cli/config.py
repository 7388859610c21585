"""``config``: the effective deployment settings (the container's start check); exit 2 naming a bad variable."""

from __future__ import annotations

import argparse

from kvviz.cli.output import write_json


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return commands.add_parser("config", help="print the deployment settings read from KVVIZ_* variables")


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from kvviz.runtime.settings import Settings, SettingsError

    settings = Settings.from_env()
    if settings.presses:  # imported only when set: checking them loads kvpress
        from kvviz.methods.kvpress.catalog import custom_press_problems

        problems = custom_press_problems()
        if problems:
            raise SettingsError("; ".join(problems))
    write_json("-", asdict(settings))
    return 0

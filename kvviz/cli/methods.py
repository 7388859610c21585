"""``methods``: every registered method with its declared parameters (the docs are generated from the same data)."""

from __future__ import annotations

import argparse

from kvviz.methods import REGISTRY


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("methods", help="list methods and their parameters")
    parser.add_argument("--kvpress", action="store_true",
                        help="every press kvpress exports and how kvviz runs it (kvpress_native)")
    parser.add_argument("--press", metavar="NAME",
                        help="the parameters of kvpress_native:press=NAME (read from the press's dataclass fields)")
    return parser


def run(args: argparse.Namespace) -> int:
    if args.kvpress:
        from kvviz.methods.kvpress.coverage import coverage, markdown_table

        print(markdown_table(coverage()))
        return 0
    if args.press:
        from kvviz.methods.kvpress.native import KVPressNative

        for param in KVPressNative(press=args.press).params:
            print(f"    {param.name}={param.default}  [{param.describe_range()}]  {param.help}")
        return 0
    for name in sorted(REGISTRY):
        method = REGISTRY[name]
        print(f"{name} ({method.kind}): {method.summary}")
        local = getattr(method, "on_local_layers", None)
        if local is not None and name != "full":
            print(f"    on local (sliding-window) layers: {local.value}")
        for param in method.params:
            print(f"    {param.name}={param.default}  [{param.describe_range()}]  {param.help}")
    return 0

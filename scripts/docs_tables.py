"""Rewrite the generated tables in docs/*.md from the code that declares them; --check exits 1 naming stale ones.

A generated block sits between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->``. The method
reference comes from the registry, the kvpress coverage from kvpress itself, the environment table from the settings.
tests/test_docs.py checks every block against what this script would write.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _methods() -> str:
    import kvviz.methods  # noqa: F401  (fills the registry)
    from kvviz.cache.spec import methods_markdown

    return methods_markdown()


def _kvpress_coverage() -> str:
    from kvviz.methods.kvpress.coverage import coverage, markdown_table

    return markdown_table(coverage())


def _environment() -> str:
    from kvviz.runtime.settings import variables_markdown

    return variables_markdown()


BLOCKS: dict[str, tuple[str, Callable[[], str]]] = {
    "methods": ("docs/methods.md", _methods),
    "kvpress-coverage": ("docs/kvpress.md", _kvpress_coverage),
    "environment": ("docs/deployment.md", _environment),
}


def block_pattern(name: str) -> re.Pattern[str]:
    """The lines between a block's two markers (the body plus its final newline)."""
    return re.compile(rf"^<!-- generated: {re.escape(name)} -->\n(.*?)^<!-- end generated: {re.escape(name)} -->",
                      re.S | re.M)


def current(name: str) -> str | None:
    """The block's text as the doc holds it now (None when the doc has no such block)."""
    path, _ = BLOCKS[name]
    found = block_pattern(name).search((ROOT / path).read_text())
    return found.group(1).removesuffix("\n") if found else None


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    check = "--check" in argv
    stale = []
    for name, (path, render) in BLOCKS.items():
        text, body = (ROOT / path).read_text(), render()
        if current(name) is None:
            print(f"{path}: no generated block '{name}'", file=sys.stderr)
            return 1
        if current(name) != body:
            stale.append(f"{path} ({name})")
            if not check:
                start, end = block_pattern(name).search(text).span(1)
                (ROOT / path).write_text(text[:start] + body + "\n" + text[end:])
    if stale:
        print(("stale: " if check else "rewrote: ") + ", ".join(stale))
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The layout map in docs/architecture.md is the map a newcomer reads: it must name every module, and nothing that
is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAPPED = ("kvviz", "kvviz_app", "views")  # every Python file in these folders has its line in the map
MAP = ROOT / "docs" / "architecture.md"


def layout_map() -> set[str]:
    """Paths named in the layout block: a line's first word, under the folders it is indented beneath."""
    text = MAP.read_text()
    block = re.search(r"^## Layout\n.*?^```\n(.*?)^```", text, re.S | re.M).group(1)
    named, parents = set(), []
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        word = line.split()[0].rstrip(",")
        parents = parents[:depth]
        path = "".join(parents) + word
        named.add(path.rstrip("/"))
        if word.endswith("/"):
            parents.append(word)
    return named


def modules() -> set[str]:
    files = {p.relative_to(ROOT).as_posix() for folder in MAPPED for p in (ROOT / folder).rglob("*.py")}
    return {f for f in files if not f.endswith(("__init__.py", "__main__.py"))}


def test_the_layout_map_names_every_module():
    named = layout_map()
    covered = {m for m in modules() if m in named or any(m.startswith(f"{folder}/") for folder in named
                                                          if folder in ("kvviz/methods", "kvviz/bench/sections"))}
    assert modules() - covered == set(), "add these to the layout map in docs/architecture.md"


def test_everything_the_layout_map_names_exists():
    missing = sorted(p for p in layout_map() if not (ROOT / p).exists())
    assert missing == [], "the layout map in docs/architecture.md names paths that are gone"

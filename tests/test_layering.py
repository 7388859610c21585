"""The house's imports run one way: each layer imports only itself and the layers below it, and no module imports
one that imports it back. Drawn from the code's own import statements (lazy and type-checking imports included)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module belongs to the longest prefix that names it.
LAYERS = (
    ("kvviz.cache",),
    ("kvviz.runtime",),
    ("kvviz.methods",),
    ("kvviz.planning",),
    ("kvviz.comparison",),
    ("kvviz.studies",),
    ("kvviz.runs",),
    ("kvviz.lessons",),
    ("kvviz.bench",),
    ("kvviz.cli", "kvviz.__main__"),
    ("kvviz_app",),
    ("views", "app"),
)
PACKAGES = ("kvviz", "kvviz_app", "views", "app")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    files = [ROOT / "app.py", *(p for folder in ("kvviz", "kvviz_app", "views") for p in (ROOT / folder).rglob("*.py"))]
    return {module_name(p): p for p in files}


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports (``from a import b`` counts as ``a.b`` when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [n if n in modules else node.module for n in names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in PACKAGES and n in modules)
    return found


def layer_of(module: str) -> int | None:
    matches = [(len(prefix), index) for index, prefixes in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    return max(matches)[1] if matches else None


def graph() -> dict[str, set[str]]:
    files = sources()
    return {name: imports_of(path, set(files)) - {name} for name, path in files.items()}


def test_every_module_has_a_layer():
    assert [m for m in graph() if m != "kvviz" and layer_of(m) is None] == []


def test_no_import_points_up_a_layer():
    upward = sorted(f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
                    for module, targets in graph().items() for target in targets
                    if module != "kvviz" and target != "kvviz" and layer_of(target) > layer_of(module))
    assert upward == []


def test_no_import_closes_a_circle():
    edges, circles = graph(), []
    state: dict[str, str] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in sorted(edges.get(module, ())):
            if state.get(target) == "open":
                circles.append(" -> ".join([*trail[trail.index(target):], target]))
            elif target not in state:
                visit(target, [*trail, target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert circles == []


def test_the_engine_knows_nothing_of_streamlit():
    offenders = sorted(name for name, path in sources().items() if name.startswith("kvviz.")
                       for node in ast.walk(ast.parse(path.read_text()))
                       if isinstance(node, (ast.Import, ast.ImportFrom))
                       and any(n.split(".")[0] == "streamlit" for n in
                               ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])))
    assert offenders == []


def test_importing_the_cache_loads_no_method():
    """The cache is the bottom layer: importing it (in a fresh interpreter) must not pull in any method module."""
    probe = "import kvviz.cache.kvcache, sys; print(sorted(m for m in sys.modules if m.startswith('kvviz.methods')))"
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def test_no_method_module_reads_the_environment():
    """Methods receive their settings (the server's own presses: kvviz.methods.kvpress.catalog.configure_presses)
    from the entry points; none reads os.environ or builds Settings itself."""
    readers = sorted(name for name, path in sources().items() if name.startswith("kvviz.methods")
                     for node in ast.walk(ast.parse(path.read_text()))
                     if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "from_env"))
                     or (isinstance(node, ast.ImportFrom) and node.module == "kvviz.runtime.settings"))
    assert readers == []


def test_no_source_file_is_over_400_lines():
    """A file that long does more than one job; split it along them."""
    long = sorted(f"{path.relative_to(ROOT)} ({lines} lines)" for path in sources().values()
                  if (lines := len(path.read_text().splitlines())) > 400)
    assert long == []


def test_per_thread_state_says_why_no_argument_carries_it():
    """What a caller decides travels as an argument (a model call's keywords reach every attention call); a context
    variable stays only where no argument can reach, and says why on its own line."""
    unexplained = [f"{path.relative_to(ROOT)}:{number}" for path in sources().values()
                   for number, line in enumerate(path.read_text().splitlines(), start=1)
                   if "ContextVar(" in line and "#" not in line]
    assert unexplained == []

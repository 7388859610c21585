"""Rewrite the generated tables in docs/*.md from the code that declares them; --check exits 1 naming stale ones.

A generated block sits between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->``. The method
reference comes from the registry, the kvpress coverage from kvpress itself, the environment table from the settings,
the benchmark's targets from the ``section.add(...)`` calls in kvviz/bench/sections (read, not run).
tests/test_docs.py checks every block against what this script would write.
"""

from __future__ import annotations

import ast
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


# How a target's condition reads in the docs (ast.unparse of the code's test); any other is shown as code.
CONDITIONS = {"loaded.device == 'cpu'": "on a CPU", "loaded.dtype == torch.float32": "in float32",
              "row.mode == 'query_agnostic'": "query-agnostic methods"}


def _text(node: ast.expr, function: ast.FunctionDef) -> str:
    """A figure's name as the code builds it: an f-string's fields read ``*``; a local name, what it was set to."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(str(v.value) if isinstance(v, ast.Constant) else "*" for v in node.values)
    if isinstance(node, ast.Name):
        for assign in (n for n in ast.walk(function) if isinstance(n, ast.Assign)):
            if any(isinstance(t, ast.Name) and t.id == node.id for t in assign.targets):
                return _text(assign.value, function)
    return ast.unparse(node)


def _functions(tree: ast.Module) -> list[ast.FunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]


def _targets(node: ast.expr, function: ast.FunctionDef, tree: ast.Module) -> list[tuple[str, str]]:
    """Every (target, condition) an argument can carry: a literal, either branch of a conditional, a local name's
    value, or a parameter's argument at each call in the module; empty targets left out."""
    if isinstance(node, ast.IfExp):
        when = CONDITIONS.get(ast.unparse(node.test), f"`{ast.unparse(node.test)}`")
        return ([(t, "; ".join(filter(None, (when, c)))) for t, c in _targets(node.body, function, tree)]
                + [(t, "; ".join(filter(None, ("otherwise", c)))) for t, c in _targets(node.orelse, function, tree)])
    if isinstance(node, ast.Name):
        parameters = [a.arg for a in function.args.args]
        if node.id in parameters and not any(isinstance(n, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == node.id for t in n.targets) for n in ast.walk(function)):
            index, found = parameters.index(node.id), []
            for caller in _functions(tree):
                for call in (n for n in ast.walk(caller) if isinstance(n, ast.Call)):
                    if isinstance(call.func, ast.Name) and call.func.id == function.name:
                        argument = call.args[index] if index < len(call.args) else next(
                            (k.value for k in call.keywords if k.arg == node.id), None)
                        found += _targets(argument, caller, tree) if argument is not None else []
            return found
        for assign in (n for n in ast.walk(function) if isinstance(n, ast.Assign)):
            if any(isinstance(t, ast.Name) and t.id == node.id for t in assign.targets):
                return _targets(assign.value, function, tree)
    target = _text(node, function)
    return [(target, "")] if target else []


def section_order() -> tuple[str, ...]:
    """The bench's sections in the order it runs them (``ORDER`` in kvviz/bench/sections/__init__.py, read)."""
    tree = ast.parse((ROOT / "kvviz" / "bench" / "sections" / "__init__.py").read_text())
    return next(ast.literal_eval(n.value) for n in tree.body
                if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "ORDER" for t in n.targets))


def targets_in(tree: ast.Module) -> list[tuple[str, str, str]]:
    """(figure, target, when) for every target a module's functions give ``section.add``."""
    found = []
    for function in _functions(tree):
        for call in (n for n in ast.walk(function) if isinstance(n, ast.Call)):
            if not (isinstance(call.func, ast.Attribute) and call.func.attr == "add"
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == "section"):
                continue
            target = call.args[3] if len(call.args) > 3 else next(
                (k.value for k in call.keywords if k.arg == "target"), None)
            for bound, when in _targets(target, function, tree) if target is not None else []:
                found.append((_text(call.args[0], function), bound, when))
    return list(dict.fromkeys(found))


def declared_targets() -> list[tuple[str, str, str, str]]:
    """(section, figure, target, when) for every target the bench's sections declare, in the order they run."""
    folder = ROOT / "kvviz" / "bench" / "sections"
    return [(name, *found) for name in section_order()
            for found in targets_in(ast.parse((folder / f"{name}.py").read_text()))]


def _targets_table() -> str:
    rows = ["| section | figure | target | when |", "|---|---|---|---|"]
    return "\n".join(rows + [f"| `{s}` | `{f}` | {t} | {w} |" for s, f, t, w in declared_targets()])


BLOCKS: dict[str, tuple[str, Callable[[], str]]] = {
    "methods": ("docs/methods.md", _methods),
    "kvpress-coverage": ("docs/kvpress.md", _kvpress_coverage),
    "environment": ("docs/deployment.md", _environment),
    "targets": ("docs/performance.md", _targets_table),
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

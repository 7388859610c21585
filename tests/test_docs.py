"""The docs a newcomer walks: a short README, links that lead somewhere, and tables generated from the code."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from kvviz.methods import KINDS, REGISTRY
from kvviz.runtime.settings import variables_markdown

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _tables_script():
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "scripts" / "docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prose(text: str) -> str:
    """The text outside code: fenced blocks, indented blocks and inline code removed."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"^    .*$", "", text, flags=re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """The anchors a Markdown renderer gives the headings of ``path`` (GitHub's rule, repeats numbered)."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M),
                              flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchor, repeat = slug, 0
        while anchor in found:
            repeat += 1
            anchor = f"{slug}-{repeat}"
        found.add(anchor)
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(path.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # a web address, checked by nobody here
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no such heading)")
    return broken


def test_the_readme_fits_in_150_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file_and_heading(path):
    assert broken_links(path) == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_reference_to_numbered_issues_a_reader_cannot_see(path):
    assert re.findall(r"\bissues?\s*#?\d+|(?<![\w/&])#\d+\b", path.read_text(), flags=re.I) == []


def test_the_link_checker_catches_a_missing_file_and_heading(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n[ok](#top) [gone](b.md) [bad](a.md#nowhere) `[code](c.md)`\n")
    assert broken_links(tmp_path / "a.md") == ["b.md (no such file)", "a.md#nowhere (no such heading)"]


def test_the_environment_table_is_the_one_the_settings_render():
    text = (ROOT / "docs" / "deployment.md").read_text()
    assert variables_markdown() in text
    assert text.count("| variable | default |") == 1, "one environment-variable table"


def test_every_generated_block_matches_the_code():
    tables = _tables_script()
    stale = [name for name, (_, render) in tables.BLOCKS.items() if tables.current(name) != render()]
    assert stale == [], "run: python scripts/docs_tables.py"


def test_the_readme_names_every_method_on_its_axis():
    rows = {kind: re.search(rf"^\| {kind} \|.*$", (ROOT / "README.md").read_text(), re.M) for kind in KINDS}
    named = {kind: set(re.findall(r"`(\w+)`", row.group(0))) for kind, row in rows.items() if row}
    assert named == {kind: {n for n, cls in REGISTRY.items() if cls.kind == kind} for kind in KINDS}


def _figures_table() -> str:
    text = (ROOT / "docs" / "performance.md").read_text()
    return text.split("| target | figure | value |")[1].split("\n\n")[0]


def test_every_target_the_bench_declares_has_a_current_figure():
    table = _figures_table()
    missing = [f"{section}.{figure}" for section, figure, _, _ in _tables_script().declared_targets()
               if f"`{figure}`" not in table]
    assert missing == [], "add a row to docs/performance.md's current figures"


def test_the_current_figures_name_only_targets_the_bench_declares():
    declared = {figure for _, figure, _, _ in _tables_script().declared_targets()}
    named = set()
    for row in _figures_table().splitlines()[2:]:
        figure = row.split(" | ")[1]
        if re.search(r"[<>=]=|[<>] ", figure):
            named |= set(re.findall(r"`([^`]+)`", figure))
    assert named - declared == set(), "a target no code checks"


def test_the_benchmark_lists_every_section():
    text = (ROOT / "docs" / "performance.md").read_text().split("## The benchmark")[1].split("\n## ")[0]
    assert [s for s in _tables_script().section_order() if f"`{s}`" not in text] == []


def test_the_target_reader_follows_conditions_locals_and_parameters():
    import ast

    tree = ast.parse("""
def measure(section, loaded, bound):
    name = f"{loaded.name}_vs_full"
    section.add(name, 1.0, "x", "<= 0.5" if loaded.device == "cpu" else "")
    section.add("same", True, target="== True")
    section.add("both", 1.0, "x", bound)
    section.add("untargeted", 1.0, "x")

def run(section, loaded):
    measure(section, loaded, "<= 2")
""")
    assert _tables_script().targets_in(tree) == [("*_vs_full", "<= 0.5", "on a CPU"), ("same", "== True", ""),
                                                 ("both", "<= 2", "")]


def test_the_architecture_quotes_compares_defaults():
    import ast

    tree = ast.parse((ROOT / "views" / "2_Compare.py").read_text())
    specs = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 and any(getattr(t, "id", "") == "DEFAULT_SPECS" for t in n.targets))
    quoted = (ROOT / "docs" / "architecture.md").read_text().split("**Compare's defaults**")[1].split("\n\n")[0]
    assert [spec for spec in specs if f"`{spec}`" not in quoted] == []


def test_cli_md_names_every_field_of_a_cliff():
    from dataclasses import fields

    from kvviz.studies.verdicts import Cliff

    listed = re.search(r"`cliff` is `\{([^}]*)\}`", (ROOT / "docs" / "cli.md").read_text()).group(1)
    assert re.findall(r'"(\w+)"', listed) == [f.name for f in fields(Cliff)] + ["sentence"]


@pytest.mark.parametrize("doc", ["README.md", "docs/architecture.md"])
def test_the_page_tables_follow_the_sidebar(doc):
    sidebar = re.findall(r'st\.Page\("views/[^"]+", title="([^"]+)"', (ROOT / "app.py").read_text())
    rows = re.findall(r"^\| ([A-Z][\w -]+?) \| ", (ROOT / doc).read_text(), flags=re.M)
    assert [row for row in rows if row in sidebar] == [title for title in sidebar if title in rows]
    assert len([row for row in rows if row in sidebar]) >= 8


SETTING_WIDGETS = {"radio", "selectbox", "select_slider", "slider", "number_input", "multiselect", "checkbox",
                   "text_input", "text_area", "toggle", "segmented_control", "pills"}
NOT_SETTINGS = {  # widgets a page draws directly, and why they are not settings a link carries
    "tail_failure": "which failure of the result on screen to inspect",
    "sweep_measure": "which of the result's measures the chart draws",
    "planner_measure": "a switch that runs the model on demand",
    "planner_layouts": "a switch that runs the model on demand",
    "prefix_preamble": "a long pasted text, kept in the page (too long for an address)",
    "prefix_questions": "pasted questions, kept with their preamble",
}


def test_every_page_setting_starts_from_the_link():
    """The README says every page keeps its settings in the URL: every setting widget of a page is built through
    kvviz_app.url (a lambda handed to ``linked``), except the few named above."""
    import ast

    plain = []
    for page in sorted((ROOT / "views").glob("*.py")):
        tree = ast.parse(page.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and getattr(node.func.value, "id", "") == "st" and node.func.attr in SETTING_WIDGETS):
                continue
            ancestor, in_lambda = parents.get(node), False
            while ancestor is not None and not in_lambda:
                in_lambda, ancestor = isinstance(ancestor, ast.Lambda), parents.get(ancestor)
            key = next((ast.literal_eval(k.value) for k in node.keywords if k.arg == "key"
                        and isinstance(k.value, ast.Constant)), None)
            if not in_lambda and key not in NOT_SETTINGS:
                plain.append(f"{page.name}:{node.lineno} st.{node.func.attr} key={key}")
    assert plain == [], "build it with kvviz_app.url's settings (or say in NOT_SETTINGS why it is none)"


def test_cli_md_lists_every_command_that_loads_a_model():
    commands = sorted(path.stem for path in (ROOT / "kvviz" / "cli").glob("*.py")
                      if "options.add_model_options(" in path.read_text())
    line = (ROOT / "docs" / "cli.md").read_text().split("## Options every model command takes")[1].split("\n\n")[1]
    assert sorted(re.findall(r"`(\w+)`", line)) == commands


def test_every_dtype_the_loader_accepts_is_in_the_help_and_in_cli_md():
    from kvviz.cli.options import add_model_options
    from kvviz.runtime.models import ModelError, resolve_dtype

    with pytest.raises(ModelError) as refused:
        resolve_dtype("cpu", "no-such-dtype")
    accepted = re.findall(r"\b(float\d+|bfloat\d+)\b", str(refused.value))
    import argparse

    parser = argparse.ArgumentParser()
    add_model_options(parser)
    help_text = next(action.help for action in parser._actions if "--dtype" in action.option_strings)
    row = next(line for line in (ROOT / "docs" / "cli.md").read_text().splitlines() if line.startswith("| `--dtype"))
    assert accepted and all(name in help_text and f"`{name}`" in row for name in accepted)


def test_deployment_md_quotes_what_the_page_says_while_a_run_waits():
    from types import SimpleNamespace

    from kvviz.runtime.jobs import Status
    from kvviz_app.progress_ui import queue_message

    said = queue_message(2, SimpleNamespace(status=Status.WAITING, message=""))
    assert f'"{said}"' in (ROOT / "docs" / "deployment.md").read_text()


def test_architecture_md_holds_no_dated_figures():
    """Dated figures belong in performance.md (and its history), where they are kept current."""
    text = re.sub(r"\]\([^)]*\)", "]", prose((ROOT / "docs" / "architecture.md").read_text()))  # link targets
    assert re.findall(r"\b20\d\d-\d\d-\d\d\b", text) == []


def test_the_layer_table_names_the_engine_its_jobs_line_admission_and_the_cluster():
    row = next(line for line in (ROOT / "docs" / "architecture.md").read_text().splitlines()
               if line.startswith("| 1 | `kvviz/runtime/`"))
    for module in ("engine.py", "jobs", "waiting line", "admission", "cluster.py"):
        assert module in row, module

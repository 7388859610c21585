"""The Trade-offs page driven through AppTest as a user sets up a small task sweep, shared by the tests that run one
(in process and on a Ray cluster)."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest

PAGE = Path(__file__).resolve().parents[1] / "views" / "8_Trade_offs.py"


def opened() -> AppTest:
    """The page as a new session opens it, run once."""
    return AppTest.from_file(str(PAGE), default_timeout=300).run()


def sweep(app: AppTest, family: str, budget: float, task: str, items: int, adaptive: bool = False) -> AppTest:
    """Pick one family at one budget on ``items`` items of ``task`` (a fixed design, or an adaptive one capped at
    ``items``), press Run the sweep, and check nothing failed."""
    app.multiselect(key="sweep_families").set_value([family])
    app.multiselect(key="sweep_budgets").set_value([budget])
    app.selectbox(key="sweep_task").set_value(task)
    app.radio(key="sweep_design").set_value("adaptive" if adaptive else "fixed")
    app.run()
    app.number_input(key="sweep_cap" if adaptive else "sweep_items").set_value(items)
    app.run()
    next(b for b in app.button if b.label == "Run the sweep").click().run()
    assert not app.exception and not app.error, [str(e.value) for e in app.error]
    return app

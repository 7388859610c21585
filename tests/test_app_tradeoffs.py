"""The Trade-offs page through AppTest: a small task sweep with its intervals, outcome grids and links, a prompt
set refused for its bad line, and a selection it refuses."""

from pathlib import Path
from urllib.parse import parse_qs

from streamlit.testing.v1 import AppTest

from tests.tradeoffs_page import opened, sweep


def test_a_task_sweep_draws_intervals_and_opens_every_failed_item_in_compare():
    app = opened()
    assert not app.exception and not app.error
    assert app.radio(key="sweep_workload").value == "task" and app.radio(key="sweep_design").value == "adaptive"
    assert app.number_input(key="sweep_cap").value == 256 and app.number_input(key="sweep_time").value == 165
    plan = next(m.value for m in app.markdown if "A configuration losing 0 points" in m.value)
    assert plan.startswith("Adaptive, up to 256 items in rounds of 16, 3 families"), "the power of the design first"
    families = app.multiselect(key="sweep_families")
    assert "snapkv" in families.value and any("sweeps budget" in o for o in families.options)
    sweep(app, "streaming_llm", 0.125, "needle", 3)
    assert "configurations on 3 needle items" in app.success[0].value
    assert any("Wilson score interval" in str(c.value) for c in app.caption)
    chart = app.get("plotly_chart")[0].proto.spec
    assert '"frontier"' in chart and '"error_y"' in chart and "full's 95% interval" in chart
    grid = app.get("plotly_chart")[1].proto.spec
    assert "every item at every budget" in grid
    failures, table = app.dataframe[0].value, app.dataframe[1].value
    assert list(table["spec"])[0] == "full" and table["accuracy_ci"].notna().all()
    assert table["verdict"].iloc[0] is None and table["verdict"].iloc[1] == "inconclusive", "3 items prove nothing"
    assert any("betting confidence sequence" in str(c.value) for c in app.caption)
    assert any("the full cache is right on" in m.value.lower() for m in app.markdown), "full's real accuracy"
    link = parse_qs(failures["open"].iloc[0].split("?", 1)[1])
    assert link["item"] == [failures["item"].iloc[0]] and link["m"] == ["full", failures["spec"].iloc[0]]
    assert link["n"] == ["16"] and link["seed"] == ["0"]
    lost = failures[failures["outcome"] != "gained"]
    assert (lost["outcome"] == "evicted").all(), "a window of 1/8 loses the key wherever it is not recent"
    assert [b.label for b in app.get("download_button")] == ["Points as CSV", "Sweep as JSON"]
    app.radio(key="sweep_layout").set_value("paged_shared").run()
    assert any("smaller than full (paged, shared blocks)" in m.value for m in app.markdown), "the summary's bytes"
    assert "paged_shared_compression" in app.dataframe[1].value, "the layout's compression beside the counted one"


def test_an_adaptive_sweep_shows_each_point_s_items_and_a_margin_moved_later_is_exploratory():
    app = sweep(opened(), "streaming_llm", 0.0625, "multikey", 32, adaptive=True)
    assert "every point decided" in app.success[0].value
    allocation = app.get("plotly_chart")[1].proto.spec
    assert "Items each point used, and why it stopped" in allocation
    assert "stopped: proven beyond the margin" in allocation
    table = app.dataframe[-1].value
    assert list(table["stopped"])[1] == "beyond" and list(table["verdict"])[1] == "beyond margin"
    assert not app.warning
    app.number_input(key="sweep_margin").set_value(10.0).run()
    assert "**Exploratory.** This run's margin was fixed at 5 points" in app.warning[0].value
    assert app.markdown and any(m.value.startswith("- Exploratory: the margin was fixed") for m in app.markdown)


def test_a_failed_item_opens_in_compare_with_its_own_prompt():
    compare = Path(__file__).resolve().parents[1] / "views" / "2_Compare.py"
    app = AppTest.from_file(str(compare), default_timeout=300)
    app.query_params.update({"item": "needle:256:0.5:1", "seed": "0", "m": ["full", "streaming_llm:window=28"]})
    app.run()
    assert not app.exception and not app.error
    assert "Task item **needle:256:0.5:1** (seed 0)" in app.info[0].value and not app.text_area


def test_fixed_configurations_alone_are_refused_before_running():
    app = opened()
    app.multiselect(key="sweep_families").set_value(["fp8"])
    app.run()
    assert "nothing to sweep: fp8 has no free parameter" in app.error[0].value
    assert next(b for b in app.button if b.label == "Run the sweep").disabled


def test_hostile_settings_in_a_link_are_named_and_replaced_before_anything_runs():
    """A margin of 0 or 100, no items and a cap of no seconds, given in a link: each is named in a warning with the
    value used instead, and the page still offers its run."""
    for params, said in [({"margin": "0"}, "below 0.5"), ({"margin": "100"}, "over 50.0"),
                         ({"items": "0", "design": "fixed"}, "below 1"), ({"cap": "0"}, "below 1"),
                         ({"time": "0"}, "below 1")]:
        app = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "views" / "8_Trade_offs.py"),
                                default_timeout=300)
        app.query_params.update(params)
        app.run()
        assert not app.exception and not app.error, params
        assert any(said in w.value for w in app.warning), (params, [w.value for w in app.warning])
        assert any(b.label == "Run the sweep" for b in app.button)

"""The Trade-offs page through AppTest: a small sweep on the default prompt, and a selection it refuses."""

from pathlib import Path
from urllib.parse import parse_qs

from streamlit.testing.v1 import AppTest

PAGE = Path(__file__).resolve().parents[1] / "views" / "8_Trade_offs.py"


def test_a_sweep_draws_lines_and_the_frontier_and_links_each_point_to_compare():
    app = AppTest.from_file(str(PAGE), default_timeout=300).run()
    assert not app.exception and not app.error
    families = app.multiselect(key="sweep_families")
    assert "snapkv" in families.value and any("sweeps budget" in o for o in families.options)
    families.set_value(["streaming_llm", "kivi:residual=0"])
    app.multiselect(key="sweep_budgets").set_value([0.25, 0.5])
    app.number_input(key="sweep_max_new").set_value(4)
    app.run()
    next(b for b in app.button if b.label == "Run the sweep").click().run()
    assert not app.exception and not app.error, [str(e.value) for e in app.error]
    assert "configurations on" in app.success[0].value
    assert any("One prompt is a demonstration" in str(m.value) for m in app.markdown)
    chart = app.get("plotly_chart")[0].proto.spec
    assert '"frontier"' in chart and '"type":"log"' in chart.replace(" ", "")
    table = app.dataframe[0].value
    assert list(table["spec"])[:2] == ["full", "streaming_llm:window=" + list(table["spec"])[1].split("=")[1]]
    link = parse_qs(table["open"].iloc[1].split("?", 1)[1])
    assert link["m"] == ["full", table["spec"].iloc[1]] and link["n"] == ["4"] and "Ines" in link["prompt"][0]
    assert table["frontier"].any()
    assert [b.label for b in app.get("download_button")] == ["Points as CSV", "Sweep as JSON"]


def test_fixed_configurations_alone_are_refused_before_running():
    app = AppTest.from_file(str(PAGE), default_timeout=300).run()
    app.multiselect(key="sweep_families").set_value(["fp8"])
    app.run()
    assert "nothing to sweep: fp8 has no free parameter" in app.error[0].value
    assert next(b for b in app.button if b.label == "Run the sweep").disabled

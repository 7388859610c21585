"""Every page through streamlit.testing's AppTest, driving real runs of the default model.

Runs are kept small (short prompts, a handful of tokens); the model itself is loaded once per process by
st.cache_resource and shared by all pages.
"""

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 300


def page(name: str, **params) -> AppTest:
    app = AppTest.from_file(str(ROOT / "views" / name), default_timeout=TIMEOUT)
    for key, value in params.items():
        app.query_params[key] = value
    return app.run()


def texts(elements) -> list[str]:
    return [str(e.value) for e in elements]


def test_attention_page_shows_sinks_heatmaps_and_shading(monkeypatch):
    app = page("1_Attention.py", layer="5", head="2", sinks="1")
    assert not app.exception and not app.error
    metrics = {m.label: m.value for m in app.metric}
    assert int(metrics["Prompt tokens"]) > 40
    assert metrics["Layer 5"].endswith("%")
    assert len(app.get("plotly_chart")) == 3  # sink mass, heatmap, head gallery
    assert any("Layer 5, head 2" in s.value for s in app.subheader)
    assert app.slider(key="layer").value == 5
    shading = [h.proto.body for h in app.get("html")]
    app.radio(key="scope").set_value("mean over all layers").run()  # a second capture: every layer explicit
    assert not app.exception and not app.error
    assert [h.proto.body for h in app.get("html")] != shading

    app.text_area(key="attention_text").set_value("   ").run()
    assert "the prompt is empty" in " ".join(texts(app.error))
    monkeypatch.setenv("KVVIZ_MAX_PROMPT_TOKENS", "10")
    app.text_area(key="attention_text").set_value("A sentence that is clearly longer than ten tokens, "
                                                  "because it goes on and on.").run()
    assert "this server allows 10" in " ".join(texts(app.error))
    assert not app.exception


def test_compare_page_runs_methods_and_reports(monkeypatch):
    specs = ["full", "streaming_llm:sinks=2,window=16", "kivi:residual=0"]
    app = page("2_Compare.py", m=specs, n="4")
    assert not app.exception and not app.error
    assert app.number_input(key="cfg_count").value == 3
    assert app.selectbox(key="cfg1_eviction").value == "streaming_llm"
    assert app.selectbox(key="cfg2_quantization").value == "kivi"
    app.text_area(key="compare_text").set_value("Name three colours of the rainbow, then count to five.").run()
    app.button[0].click().run()
    assert not app.exception and not app.error, texts(app.error)
    table = app.dataframe[0].value
    assert list(table["method"]) == ["full", "streaming_llm:sinks=2,window=16", "kivi:residual=0"]
    assert table["agreement"][0] == 1.0 and table["error"].eq("").all()
    assert table["compression"][2] > 1  # 2-bit keys and values
    assert any(s.value.startswith("3 configurations") for s in app.success)
    assert not app.get("plotly_chart"), "diagnostics are drawn when asked for"
    drawn = {}
    for view in ("Memory", "Divergence", "Quantization error", "Kept tokens"):
        app.button_group(key="compare_show").set_value(view).run()
        assert not app.exception and app.query_params["show"] == view
        drawn[view] = (len(app.get("plotly_chart")), " ".join(c.value for c in app.caption))
    # memory bars, savings per axis, serving layouts, growth, bytes per layer (with its type); KL; reconstruction +
    # key channels; the kept heatmap
    assert [count for count, _ in drawn.values()] == [5, 1, 2, 1], drawn
    assert "KV-Compress" in drawn["Memory"][1] and app.query_params["block"] == "16"
    assert "of prompt tokens cached" in drawn["Kept tokens"][1]
    assert "quantized per channel" in drawn["Quantization error"][1]
    assert [b.label for b in app.get("download_button")] == ["Results as CSV", "Results as JSON"]
    assert app.query_params["m"] == specs

    app.text_input(key="cfg1_spec").set_value("snapkv:budget=abc").run()
    assert any("bad value in 'snapkv:budget=abc'" in e for e in texts(app.error))
    assert app.button[0].disabled
    assert app.dataframe, "the previous results stay on the page"


def test_needle_page_grid_and_failures():
    app = page("3_Needle.py", m=["full", "window:window=16"], len="128", depth="0.5", n="4")
    assert not app.exception
    app.button[0].click().run()
    assert not app.exception and not app.error, texts(app.error)
    assert app.success[0].value.startswith("2 runs")
    assert len(app.get("plotly_chart")) >= 1
    assert [b.label for b in app.get("download_button")] == ["Grid as CSV", "Grid as JSON"]


def test_memory_planner_numbers():
    app = page("4_Memory_planner.py", model_config="Llama-3-8B", context="8192", batch="8",
               gpu="NVIDIA A100 (80 GB)")
    assert not app.exception
    metrics = {m.label: m.value for m in app.metric}
    assert metrics["KV per sequence (8,192 tokens)"] == "1.07 GB" and metrics["Weights"] == "16.1 GB"
    assert metrics["KV per token (16-bit)"] == "0.13 MB"
    assert int(metrics["Sequences that fit"]) == 52
    app.select_slider(key="kvbits").set_value(2).run()
    app.radio(key="evict").set_value("ratio").run()
    metrics = {m.label: m.value for m in app.metric}
    assert int(metrics["Sequences that fit"].replace(",", "")) > 52 * 20
    app.selectbox(key="model_config").set_value("DeepSeek-V2").run()
    assert "MLA" in app.subheader[0].value and "exceed" in app.error[0].value
    assert app.query_params["model_config"] == "DeepSeek-V2"
    assert len(app.dataframe[0].value) >= 5


def test_memory_planner_projects_a_measured_configuration_s_layouts_onto_the_chosen_shape():
    app = page("4_Memory_planner.py", model_config="Llama-3-8B", context="8192", gpu="NVIDIA A100 (80 GB)")
    app.toggle(key="planner_layouts").set_value(True).run()
    assert not app.exception and not app.error, texts(app.error)
    table = app.dataframe[1].value
    assert list(table["layout"]) == ["counted", "dense per layer", "paged, shared blocks", "paged, compacted",
                                     "paged per head"]
    fits = dict(zip(table["layout"], table["sequences that fit"], strict=True))
    assert fits["counted"] > 2 * fits["paged, shared blocks"]  # snapkv's scattered keeps hold nearly every block
    assert any("A projection from the measured model" in c.value for c in app.caption)


@pytest.mark.parametrize("step", [4])
def test_lessons_step_runs_live(step):
    app = page("5_Lessons.py", step=str(step))
    assert not app.exception and app.radio(key="step").index == step - 1
    app.button(key=f"lesson_button_{step}").click().run()
    assert not app.exception and not app.error
    assert any(c.value.startswith("Most attended") for c in app.caption)


def test_lessons_levers_step_says_what_a_paged_engine_would_keep():
    app = page("5_Lessons.py", step="2")
    assert any("paged serving engine" in m.value for m in app.markdown)
    app.button(key="lesson_button_2").click().run()
    assert not app.exception and not app.error, texts(app.error)
    kept = [c.value for c in app.caption if "shared blocks of 16" in c.value]
    assert kept and "of full's blocks (it counts" in kept[0]


def test_lessons_every_step_renders_with_its_link():
    app = page("5_Lessons.py", step="1")
    for index in range(len(app.radio(key="step").options)):
        app.radio(key="step").set_value(app.radio(key="step").options[index]).run()
        assert not app.exception and not app.error
    assert app.query_params["step"] == str(len(app.radio(key="step").options))


def test_tail_risk_page_scores_each_method_and_shows_what_a_failure_lost():
    app = page("6_Tail_risk.py", m=["full", "window:window=24"], task=["multikey", "vartrack"], len="192",
               depth="0.25", hops="1", protect="system")
    assert not app.exception
    next(b for b in app.button if b.label == "Run the tasks").click().run()
    assert not app.exception and not app.error, texts(app.error)
    assert "calibrated runs" in app.success[0].value
    assert len(app.get("plotly_chart")) == 2, "the accuracy heatmap and the needle-vs-hops contrast"
    assert app.selectbox(key="tail_failure").options, "a 24-token window loses planted statements at 192 tokens"
    assert any("evicted" in str(c.value) for c in app.caption)
    assert [b.label for b in app.get("download_button")] == ["Runs as CSV", "Report as JSON"]


def test_tail_risk_page_offers_its_downloads_when_no_run_failed():
    app = page("6_Tail_risk.py", m=["full"], task=["multikey"], len="192", depth="0.25", hops="1", protect="system")
    next(b for b in app.button if b.label == "Run the tasks").click().run()
    assert not app.exception and not app.error, texts(app.error)
    assert "Every method got every kept item right." in texts(app.caption), "full is its own reference"
    assert [b.label for b in app.get("download_button")] == ["Runs as CSV", "Report as JSON"]


def test_compare_page_says_what_native_presses_did_and_refuses_an_unmappable_one(monkeypatch):
    from kvviz.comparison.startup import apply_settings
    from kvviz.methods.kvpress.catalog import configure_presses

    monkeypatch.setenv("KVVIZ_PRESSES", "tests.own_presses.KeyScalingPress")  # keys no prompt token has
    apply_settings()  # as the server's start-up hands them to the catalog
    try:
        _compare_with_native_presses()
    finally:
        configure_presses((), True)


def _compare_with_native_presses() -> None:
    specs = ["full", "kvpress_native:press=think,key_channel_compression_ratio=0.25",
             "kvpress_native:press=merging,inner=knorm", "kvpress_native:press=keyscaling"]
    app = page("2_Compare.py", m=specs, n="2")
    app.text_area(key="compare_text").set_value("Name three colours of the rainbow.").run()
    app.button[0].click().run()
    assert not app.exception
    assert "What the kvpress presses did" in texts(app.subheader)
    said = " ".join(texts(app.markdown))
    assert "Key channels kept per KV head: 48" in said and "evicted entries merged into" in said
    assert [e.label for e in app.expander] == ["Key channels kept per layer x KV head",
                                               "Which tokens were merged into which survivor, per layer x KV head"]
    assert any("Not shown: kvpress keyscaling changed keys" in w for w in texts(app.warning))
    assert app.dataframe[0].value["error"][3].startswith("kvpress keyscaling changed keys")
    app.button_group(key="compare_show").set_value("Kept tokens").run()
    assert "kvpress_native:press=keyscaling" not in app.selectbox(key="kept_method").options


def test_compare_draws_a_widget_per_press_field_and_runs_the_chosen_values():
    """kvpress_native's widgets come from the chosen press's dataclass fields: switching the press redraws them with
    that press's defaults, and the run's SPEC carries the values set in them."""
    import dataclasses

    import kvpress

    app = page("2_Compare.py", m=["full", "window:window=16"], n="2")
    app.text_area(key="compare_text").set_value("Name three colours of the rainbow.").run()
    app.selectbox(key="cfg1_eviction").set_value("kvpress_native").run()
    assert not app.exception and not app.error, texts(app.error)
    fields = {f.name: f.default for f in dataclasses.fields(kvpress.SnapKVPress)}
    assert app.selectbox(key="cfg1_kvpress_native_press").value == "snapkv"
    assert app.number_input(key="cfg1_kvpress_native_window_size").value == fields["window_size"]
    assert app.number_input(key="cfg1_kvpress_native_kernel_size").value == fields["kernel_size"]

    app.selectbox(key="cfg1_kvpress_native_press").set_value("streamingllm").run()
    drawn = {w.key: w for w in app.number_input if w.key.startswith("cfg1_kvpress_native_")}
    assert set(drawn) == {"cfg1_kvpress_native_compression_ratio", "cfg1_kvpress_native_n_sink"}
    sinks = next(f for f in dataclasses.fields(kvpress.StreamingLLMPress) if f.name == "n_sink")
    assert drawn["cfg1_kvpress_native_n_sink"].value == sinks.default
    assert "StreamingLLMPress.n_sink" in drawn["cfg1_kvpress_native_n_sink"].help
    assert drawn["cfg1_kvpress_native_compression_ratio"].value == 0.5  # kvpress's 0 would compress nothing

    drawn["cfg1_kvpress_native_n_sink"].set_value(2)
    drawn["cfg1_kvpress_native_compression_ratio"].set_value(0.75).run()
    app.button[0].click().run()
    assert not app.exception and not app.error, texts(app.error)
    spec = "kvpress_native:press=streamingllm,compression_ratio=0.75,n_sink=2"
    assert list(app.dataframe[0].value["method"]) == ["full", spec]
    assert app.query_params["m"] == ["full", spec]
    app.button_group(key="compare_show").set_value("Kept tokens").run()
    assert app.selectbox(key="kept_method").options == [spec]  # its ledger: a quarter of the prompt kept

"""Figure builders: shapes, downsampling and the HTML the pages place."""

import numpy as np
import pandas as pd
import torch

from kvviz_app import plots


def test_downsample_keeps_row_sums_and_bounds():
    matrix = torch.softmax(torch.randn(1000, 1000), dim=-1)
    small = plots.downsample(matrix, 100)
    assert small.shape == (100, 100)
    # block averages: each cell is a mean, so rows sum to (row sum) / (columns per bin)
    assert np.allclose(small.sum(axis=1) * 10, 1.0, atol=1e-4)
    assert plots.downsample(np.ones((5, 7)), 100).shape == (5, 7)


def test_heatmap_downsamples_long_prompts():
    figure = plots.attention_heatmap(np.random.rand(3000, 3000), 3000, "t", size=128)
    heat = figure.data[0]
    assert np.asarray(heat.z).shape == (128, 128)
    assert heat.x[-1] < 3000 and "downsampled" in figure.layout.title.text


def test_sink_mass_and_gallery():
    assert list(plots.sink_mass_figure([0.1, 0.5], 4).data[0].y) == [0.1, 0.5]
    gallery = plots.head_gallery({h: np.eye(10) for h in range(5)}, 10, layer=2)
    assert len(gallery.data) == 5


def test_received_attention_normalises_by_visible_queries():
    # every query puts equal mass on every visible key: all keys then receive the same mean attention per query
    n = 6
    causal = np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]
    scores = plots.received_attention(causal.sum(axis=0)[None, :])
    assert scores[0] > scores[-1]  # earlier keys are seen by more queries
    raw = plots.received_attention(np.ones((2, n)), skip=2)
    assert np.isnan(raw[:2]).all() and np.all(np.diff(raw[2:]) > 0)


def test_html_snippets_escape_and_mark():
    shaded = plots.token_shading_html(["<b>", " x"], [np.nan, 1.0])
    assert "&lt;b&gt;" in shaded and "rgba(255,127,14,1.00)" in shaded and "sink" in shaded
    marked = plots.divergence_html(["a", "b", "c"], 1)
    assert marked.index("a") < marked.index("border-left") < marked.index(">bc<")
    assert "border-left" not in plots.divergence_html(["a"], None)
    kept = plots.kept_map_html(["a", "b", "c"], plots.kept_fraction(torch.tensor([[1, 0, 1], [1, 0, 0]])))
    assert kept.count("44,160,44") == 1 and kept.count("214,39,40") == 1 and kept.count("255,187,0") == 1


def test_memory_figure_splits_codes_and_metadata():
    frame = pd.DataFrame({"method": ["full", "kivi"], "codes": [0, 300], "metadata": [0, 50],
                          "full_precision": [1000, 100], "formula": [1000, 1000]})
    figure = plots.memory_figure(frame, weight_bytes=10_000)
    names = [trace.name for trace in figure.data]
    assert {"quantized codes", "scales / zero points", "full precision", "formula (full)", "weights"} <= set(names)


def test_needle_figures():
    frame = pd.DataFrame({
        "method": ["full", "full", "window", "window"], "length": [128, 128, 128, 128], "depth": [0.1, 0.9, 0.1, 0.9],
        "found": [True, True, False, True], "survived": [True, True, False, True],
        "evicted_step": [None, None, 0, None], "evicted_layers": [[], [], [0, 1, 2], []],
    })
    heat = plots.needle_heatmaps(frame)
    assert len(heat.data) == 2 and np.asarray(heat.data[1].z).tolist() == [[0.0, 1.0]]
    failures = frame[~frame["found"]]
    scatter = plots.needle_eviction_figure(failures)
    assert list(scatter.data[0].y) == [0] and scatter.data[0].customdata[0][1] == 3


def test_planner_figures():
    figure = plots.planner_context_figure({"MHA": 1000.0, "GQA": 250.0}, [1024, 2048], batch=2, gpu_gb=80)
    assert len(figure.data) == 3 and figure.data[0].y[0] == 1000 * 1024 * 2 / 1e9
    assert list(figure.data[2].y) == [80, 80], "the GPU line is a trace in data units"
    assert not figure.layout.annotations, "an annotation on a log axis is read as 10^y (the 10^78 GB axis)"
    assert len(plots.gpu_budget_figure(16, 8, 72, 80).data) == 2


def test_kv_growth_and_kl_lines():
    assert list(plots.kv_growth_figure({"full": [plots.MiB, 2 * plots.MiB]}).data[0].y) == [1, 2]
    figure = plots.kl_figure({"window": [0.0, 0.5], "kivi": [0.1, 0.1]})
    assert [t.name for t in figure.data] == ["window", "kivi"]


def test_reconstruction_figure_pairs_keys_and_values():
    figure = plots.reconstruction_figure({"kivi": ([0.1, 0.2], [0.05, 0.06])})
    assert [t.name for t in figure.data] == ["kivi keys", "kivi values"]


def test_step_axes_tick_whole_numbers_and_needle_depths_are_categories():
    short = plots.kv_growth_figure({"full": [1, 2, 3]})
    assert short.layout.xaxis.dtick == 1 and short.layout.xaxis.tickformat == "d"
    assert plots.kl_figure({"snapkv": [0.1] * 200}).layout.xaxis.dtick == 20
    import pandas as pd

    frame = pd.DataFrame({"method": ["full"] * 3, "length": [128] * 3, "depth": [0.1, 0.5, 0.9],
                          "found": [True, False, True]})
    figure = plots.needle_heatmaps(frame)
    assert figure.layout.xaxis.type == "category" and list(figure.data[0].x) == ["10%", "50%", "90%"]


def test_layouts_figure_draws_every_layout_per_configuration_with_the_share_it_frees():
    from kvviz.cache.layouts import LABELS

    held = {"full": {name: 1000 for name in LABELS}, "snapkv": {name: 250 if name == "counted" else 900
                                                                for name in LABELS}}
    freed = {m: {name: 1 - held[m][name] / 1000 for name in LABELS} for m in held}
    figure = plots.layouts_figure(held, freed, LABELS, 16)
    assert [trace.name for trace in figure.data] == list(LABELS.values())
    counted = figure.data[0]
    assert list(counted.x) == ["full", "snapkv"] and list(counted.text) == ["0%", "75%"]
    assert list(figure.data[2].text) == ["0%", "10%"] and "blocks of 16" in figure.layout.title.text


def test_the_tradeoff_x_axis_reads_compression_in_the_chosen_layout():
    from kvviz.studies.sweep import SweepPoint
    from kvviz.studies.verdicts import compression_of

    full = SweepPoint("full", "full", "fixed", None, kv_bytes=1000, kv_bytes_full=1000,
                      layout_bytes={"counted": 1000, "paged_shared": 1024})
    point = SweepPoint("snapkv:budget=0.25", "snapkv", "eviction", 0.25, kv_bytes=250, kv_bytes_full=1000,
                       layout_bytes={"counted": 250, "paged_shared": 1000})
    assert compression_of(point, full, "counted") == 4.0
    assert compression_of(point, full, "paged_shared") == 1.024
    unlaid = SweepPoint("x", "x", "fixed", None, kv_bytes=5, kv_bytes_full=10)
    assert compression_of(unlaid, full, "paged_shared") is None


def test_switching_the_tradeoff_x_axis_to_a_layout_moves_a_family_s_curve():
    from dataclasses import replace

    from kvviz.studies.sweep import SweepPoint, SweepReport

    def point(spec, budget, counted, paged):
        return SweepPoint(spec, "snapkv" if budget else "full", "eviction", budget, kv_bytes=counted,
                          kv_bytes_full=1000, agreement_with_full=1.0 - (budget or 0) / 10,
                          layout_bytes={"counted": counted, "paged_shared": paged})

    points = [point("full", None, 1000, 1024), point("snapkv:budget=0.25", 0.25, 250, 1000),
              point("snapkv:budget=0.5", 0.5, 500, 1024)]
    report = SweepReport("m", "one prompt", "prompt", 100, [0.25, 0.5], [], points, ["agreement_with_full"], 1.0,
                         frontiers={"agreement_with_full": ["full"]})
    counted = plots.tradeoff_figure(report, "agreement_with_full")
    paged = plots.tradeoff_figure(replace(report, layout="paged_shared", frontiers={"agreement_with_full": ["full",
                                  "snapkv:budget=0.25"]}), "agreement_with_full")
    family = next(t for t in counted.data if t.name == "snapkv")
    moved = next(t for t in paged.data if t.name == "snapkv")
    assert list(family.x) == [4.0, 2.0] and list(moved.x) == [1.024, 1.0]
    assert "paged, shared blocks" in paged.layout.xaxis.title.text
    rings = next(t for t in paged.data if t.name == "frontier")
    assert rings.mode == "markers", "rings, not a line: a frontier of unproven dominance need not be monotone"
    assert list(rings.x) == [1.0, 1.024] and list(rings.y) == [1.0, 0.975], "the report's frontier, at the layout's x"

"""The benchmark runs in --quick mode with every section's keys; forked caches equal independent runs; blockwise
capture gives the same statistics whatever the block size."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvviz import bench
from kvviz.bench.browser import chromium_path
from kvviz.cache import attention
from kvviz.cache.capture import CaptureConfig
from kvviz.cache.stats import StatsRecorder
from kvviz.cli import main
from kvviz.comparison.session import PromptSession, capture_for
from kvviz.methods import REGISTRY, parse_spec


def test_quick_bench_reports_every_section(real_model):
    report = bench.run_bench(real_model, "quick")
    assert [s.name for s in report.sections] == list(bench.SECTIONS)
    failed_to_run = [(s.name, s.skipped) for s in report.sections if s.skipped and s.skipped.startswith("failed")]
    assert not failed_to_run
    data = report.to_json()
    json.dumps(data)  # serialisable as is
    figures = {s["name"]: {f["name"] for f in s["figures"]} for s in data["sections"] if not s["skipped"]}
    assert {"shared_vs_independent", "same_tokens_as_independent"} <= figures["shared_prefill"]
    assert "replay_vs_generate" in figures["replay_vs_generate"]
    assert any(name.startswith("stats_growth@") for name in figures["capture"])
    assert "worst" in figures["kv_bytes"]
    assert {"student_comparison", "short_projected_wait_p95", "upload_projected_wait_p95"} <= figures["classroom"]
    assert {"short_together_vs_one_at_a_time", "upload_together_vs_one_at_a_time",
            "upload_wait_p50_together_vs_one_at_a_time", "upload_together_wait_p95",
            "upload_one_at_a_time_wait_p95"} <= figures["classroom"], "both classes served both ways"
    assert {"floor_seconds", "batched_decode_vs_floor", "same_tokens"} <= figures["batched_compare"]
    if chromium_path() is not None:  # the app section runs where chromium is
        assert {"cached_rerender", "cached_rerender_server_seconds",
                "cached_rerender_server_seconds_first_visit"} <= figures["app"], "new browsers and a returning one"
        assert "app_vs_engine_browser_idle" in figures["app"] or shutil.which("chrt") is None, "both browsers"
    assert all("load_average" in names for names in figures.values()), "each section says how busy the machine was"
    by_name = {s.name: {f.name: f for f in s.figures} for s in report.sections}
    assert by_name["shared_prefill"]["same_tokens_as_independent"].passed
    assert by_name["replay_vs_generate"]["same_tokens"].passed
    assert all(f.passed for name, f in by_name["capture"].items() if name.startswith("stats_growth@"))
    assert by_name["kv_bytes"]["worst"].passed, report.table()
    assert "| section | figure |" in report.table()


def test_cli_bench_on_a_random_model_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--quick", "--random-model", "tiny", "--device", "cpu", "--json", str(out),
                 "--sections", "shared_prefill,capture,needle", "--lengths", "64,128"])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["model"] == "random:tiny" and data["machine"]["device"] == "cpu"
    sections = {s["name"]: s for s in data["sections"]}
    assert sections["needle"]["skipped"].startswith("needs a real tokenizer")
    assert {f["name"] for f in sections["capture"]["figures"]} >= {"capture_vs_plain@64", "stats_growth@64->128"}
    assert "| shared_prefill |" in capsys.readouterr().out


def test_gpu_check_dry_run_runs_the_script_on_the_cpu(tmp_path, real_model):
    """The GPU script's own command lines, checked here so a lent GPU's few minutes are not spent on a broken script:
    the bench, then (given the tokenizer a GPU machine lacks) every lesson step and the class-of-30 projection."""
    out = tmp_path / "gpu.json"
    tokenizer = tmp_path / "tokenizer"
    real_model.tokenizer.save_pretrained(tokenizer)
    script = Path(__file__).parents[1] / "scripts" / "gpu_check.sh"
    done = subprocess.run(["bash", str(script), "--dry-run", str(out)],
                          env={**os.environ, "PYTHON": sys.executable, "KVVIZ_TOKENIZER": str(tokenizer)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["model"] == "random:tiny" and data["preset"] == "quick" and data["machine"]["device"] == "cpu"
    assert [s["name"] for s in data["sections"]] == list(bench.SECTIONS)
    assert not [s["name"] for s in data["sections"] if (s["skipped"] or "").startswith("failed")]
    assert "| capture | stats_growth@64->128 |" in done.stdout
    classroom = json.loads((tmp_path / "gpu_classroom.json").read_text())["sections"][0]
    figures = {f["name"]: f["value"] for f in classroom["figures"]}
    assert all(figures[f"lesson_{step}_cold"] > 0 for step in range(1, 7)), figures
    mix = figures["lesson_1_cold"] + 25 * figures["student_comparison"]
    assert figures["short_projected_all_done"] == pytest.approx(mix, rel=0.01), "figures are rounded to 4 decimals"
    assert figures["upload_projected_all_done"] == pytest.approx(30 * figures["upload_comparison"], rel=1e-3)


def test_cli_bench_class_students_sizes_the_classrooms_heavy_half(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--random-model", "tiny", "--device", "cpu", "--json", str(out),
                 "--sections", "classroom", "--class-students", "2"]) == 0
    figures = {f["name"]: f for s in json.loads(out.read_text())["sections"] for f in s["figures"]}
    assert figures["upload_one_at_a_time_wait_p50"]["note"].startswith("a class of 2 students each comparing")
    assert "one run at a time (at most 1 at once here)" in figures["upload_one_at_a_time_wait_p50"]["note"]
    assert "prefill forwards fed more than one run" in figures["short_together_all_done"]["note"]
    assert 0 < figures["upload_decode_share"]["value"] < 1, "decode steps are part of a run, not all of it"
    assert figures["upload_decode_together_vs_apart"]["value"] > 0
    assert "all done would be" in figures["upload_decode_together_vs_apart"]["note"]
    assert figures["upload_wait_p50_together_vs_one_at_a_time"]["target"] == "<= 1.0"
    assert 0 < figures["upload_linear_together_vs_apart"]["value"], "what a batch shares, measured"
    assert "the linear layers for 8 runs' 5 rows" in figures["upload_linear_together_vs_apart"]["note"]
    assert main(["bench", "--quick", "--class-students", "0"]) == 2
    assert "--class-students must be at least 1" in capsys.readouterr().err


def test_cli_bench_refuses_unknown_sections(capsys):
    assert main(["bench", "--quick", "--sections", "nope"]) == 2
    assert "unknown section" in capsys.readouterr().err


def test_sections_run_in_registry_order_and_reuse_each_others_measurements():
    """Asked in any order, sections run in the registry's; kivi times its step against decode_large_cache's own
    ``full`` step (one measurement per run), and kv_bytes alone measures the shared forks itself."""
    loaded = bench.random_model("tiny", "cpu")
    report = bench.run_bench(loaded, "quick", ("kivi", "kv_bytes", "decode_large_cache"))
    assert [s.name for s in report.sections] == ["kv_bytes", "decode_large_cache", "kivi"]
    assert not [s.skipped for s in report.sections if s.skipped]
    by_name = {s.name: {f.name: f for f in s.figures} for s in report.sections}
    full_ms = by_name["decode_large_cache"]["full_step_ms"].value
    kivi_baseline_ms = float(by_name["kivi"]["decode_step_vs_full"].note.split(" vs ")[1].removesuffix(" ms"))
    assert kivi_baseline_ms == pytest.approx(full_ms, abs=0.051)
    assert by_name["kv_bytes"]["worst"].passed


def test_run_bench_refuses_unknown_sections():
    with pytest.raises(ValueError, match="unknown bench section"):
        bench.run_bench(bench.random_model("tiny", "cpu"), "quick", ("kv_bytes", "nope"))


def test_forked_comparison_gives_the_same_tokens_as_independent_runs(tiny_model, story_ids):
    ids = story_ids[:60]
    specs = ["full", *bench.eviction_specs(16, len(ids))]
    if "kivi" in REGISTRY:
        specs.append("kivi:bits=2,group=8,residual=8")
    stacks = [parse_spec(s) for s in specs]
    shared = PromptSession(tiny_model, ids)
    shared.prefill(capture_for(stacks))
    for spec, stack in zip(specs, stacks, strict=True):
        forked, _ = shared.run(stack, 8)
        alone, _ = PromptSession(tiny_model, ids).run(spec, 8)
        assert forked.token_ids == alone.token_ids, spec
        assert forked.kv_bytes == alone.kv_bytes, spec


class _FullWidth:
    """A listener without ``partial_keys``: it must always see every key."""

    def __init__(self):
        self.widths, self.row_sums = set(), []

    def wants(self, layer_idx):
        return layer_idx == 0

    def observe(self, layer_idx, probs, query_start, query_total):
        self.widths.add(probs.shape[-1])
        self.row_sums.append(probs.sum(-1))


def test_blockwise_capture_matches_one_block(tiny_model, story_ids, monkeypatch):
    n = 90
    ids = torch.tensor([story_ids[:n]])
    config = CaptureConfig(windows=(8,), matrices=[(1, 3)], matrix_size=32)

    def captured():
        recorder, wide = StatsRecorder(config, n), _FullWidth()
        with torch.inference_mode():
            logits = tiny_model.model(input_ids=ids, listeners=(recorder, wide)).logits
        return logits, recorder.finish(), wide

    logits, whole, _ = captured()
    monkeypatch.setattr(attention, "BLOCK_BYTES_CPU", 1)
    monkeypatch.setattr(attention, "MIN_BLOCK_ROWS", 7)  # 13 blocks, the last one short
    blocked_logits, blocked, wide = captured()
    torch.testing.assert_close(blocked_logits, logits, atol=1e-5, rtol=1e-5)
    for layer in (0, 1):
        torch.testing.assert_close(blocked.key_attention[layer], whole.key_attention[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(blocked.sink_mass[layer], whole.sink_mass[layer])
        torch.testing.assert_close(blocked.window_attention[8][layer], whole.window_attention[8][layer])
    torch.testing.assert_close(blocked.matrices[(1, 3)], whole.matrices[(1, 3)], atol=1e-5, rtol=1e-5)
    assert wide.widths == {n}, "listeners without partial_keys get zero-padded full-width blocks"
    torch.testing.assert_close(torch.cat([s.flatten() for s in wide.row_sums]), torch.ones(4 * n))


def test_peak_memory_sees_a_transient_allocation_on_cpu():
    with bench.PeakMemory("cpu") as peak:
        block = torch.ones(50_000_000)  # 200 MB, freed before the block ends
        del block
    assert 150e6 < peak.peak < 400e6


def test_the_app_sections_second_browser_starts_at_the_idle_scheduling_class(tmp_path):
    """Its launcher passes every argument through and runs the program at SCHED_IDLE (a browser that only gets the
    cores the model leaves free); no launcher where util-linux's chrt is missing."""
    from kvviz.bench.sections.app import idle_class_chromium

    if shutil.which("chrt") is None:
        assert idle_class_chromium(sys.executable, tmp_path) is None
        return
    launcher = idle_class_chromium(sys.executable, tmp_path)
    shown = subprocess.run([launcher, "-c", "import os, sys; print(os.sched_getscheduler(0), sys.argv[1:])", "a b"],
                           capture_output=True, text=True, check=True).stdout
    assert shown.strip() == f"{os.SCHED_IDLE} ['a b']"


def test_process_times_split_a_processs_cpu_into_its_own_and_the_kernels():
    """Touching fresh memory is kernel time (page faults), arithmetic is the process's own; a process that is gone
    reads zeros."""
    from kvviz.bench.browser import process_cpu_seconds, process_times

    before = process_times(os.getpid())
    pages = bytearray(400 * 2**20)  # zeroed by the kernel as each page is first touched
    pages[::4096] = b"x" * len(pages[::4096])
    sum(range(3_000_000))
    after = process_times(os.getpid())
    assert after.system > before.system and after.user > before.user
    assert process_cpu_seconds(os.getpid()) == pytest.approx(sum(after), abs=0.05)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert process_times(gone.pid) == (0.0, 0.0)


def test_resident_bytes_grow_with_touched_memory_and_read_zero_for_a_process_that_is_gone():
    from kvviz.bench.browser import resident_bytes

    before = resident_bytes(os.getpid())
    pages = bytearray(200 * 2**20)
    pages[::4096] = b"x" * len(pages[::4096])
    assert resident_bytes(os.getpid()) - before > 150 * 2**20
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert resident_bytes(gone.pid) == 0


def test_the_app_section_pairs_each_sides_kernel_seconds_by_passage():
    """The app-vs-engine note lists, passage by passage, the server's kernel seconds against the mean of the engine's
    runs just before and after (where a virtual machine's page faults show, on either side)."""
    from kvviz.bench.sections.app import BrowserRun, EngineRun, _against_engine

    served = [BrowserRun(12.0, 13.0, 24.0, 5.0, 2.0, server_kernel=4.2),
              BrowserRun(10.0, 11.0, 20.0, 4.0, 2.0, server_kernel=0.6)]
    around = [(EngineRun(10.0, 4.0, kernel=1.0), EngineRun(14.0, 6.0, kernel=2.0)),
              (EngineRun(10.0, 4.0, kernel=0.4), EngineRun(10.0, 4.0, kernel=0.8))]
    against = _against_engine(served, around)
    assert against.ratios == [1.0, 1.0] and against.prefill_ratios == [1.0, 1.0]
    assert against.kernel == "app 4.2 s / engine 1.5 s; app 0.6 s / engine 0.6 s"


def test_kvpress_native_section_times_the_mapping_inside_one_run_too():
    """Beside the run-against-run ratio (noisy on a shared machine), each press's native fork is timed against the
    press's own forward inside the same run: never below 1x, since the fork contains that forward."""
    loaded = bench.random_model("tiny", "cpu")
    section = bench.run_bench(loaded, "quick", ("kvpress_native",)).sections[0]
    assert not section.skipped, section.skipped
    figures = {f.name: f for f in section.figures}
    for press in ("snapkv", "knorm", "adakv"):
        assert figures[f"{press}_native_vs_press"].target == "<= 1.2"
        inside = figures[f"{press}_native_vs_own_forward"]
        assert inside.target == "<= 1.2" and inside.value >= 1.0



def test_the_browsers_cpu_is_counted_from_the_processes_the_bench_launched_only(tmp_path):
    """Chromium started by this process (through Playwright's driver) is counted; another chromium on the machine
    (another engineer's, a CI job's) is not."""
    from kvviz.bench.browser import browser_cpu_seconds, descendants

    def process(pid: int, parent: int, name: str, ticks: int) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) S {parent} 0 0 0 0 0 0 0 0 0 {ticks} 0 0 0\n")
        (tmp_path / str(pid) / "comm").write_text(f"{name}\n")

    process(10, 1, "python", 0)  # the bench
    process(11, 10, "node", 100)  # Playwright's driver
    process(12, 11, "chromium", 300)  # the browser the bench launched, and its renderer
    process(13, 12, "chromium", 200)
    process(20, 1, "chromium", 5000)  # someone else's browser
    assert sorted(descendants(10, tmp_path)) == [11, 12, 13]
    tick = os.sysconf("SC_CLK_TCK")
    assert browser_cpu_seconds(10, tmp_path) == pytest.approx(500 / tick)
    real = subprocess.Popen(["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(20)' & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(descendants(os.getpid())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert real.pid in descendants(os.getpid()) and len(descendants(os.getpid())) >= 2
    finally:
        real.kill()
        real.wait()


def test_the_layouts_section_times_every_configuration_s_layouts_against_its_comparison():
    loaded = bench.random_model("tiny", "cpu")
    report = bench.run_bench(loaded, "quick", ("layouts",))
    figures = {f.name: f for f in report.sections[0].figures}
    assert not report.sections[0].skipped
    assert figures["layout_seconds"].value < figures["compare_seconds"].value
    assert figures["layout_bytes_vs_compare"].target == "<= 0.05"
    assert "full_paged_shared" in figures and figures["full_paged_shared"].value >= 100


def test_a_section_runs_on_the_engine_and_a_client_section_on_its_own_thread(monkeypatch):
    """kvviz's paths and a section's baselines compute on the same thread, the engine's; a client section (the
    class, the served app) submits from threads of its own and the engine serves it."""
    from kvviz.bench import harness

    loaded = bench.random_model("tiny", "cpu")
    threads: dict[str, str] = {}

    def record(name: str):
        def runner(run):
            threads[name] = threading.current_thread().name
            return harness.Section(name, name)
        return runner

    monkeypatch.setattr(harness, "RUNNERS", {})
    monkeypatch.setattr(harness, "CLIENTS", set())
    harness.bench_section("measured")(record("measured"))
    harness.bench_section("served", client=True)(record("served"))
    bench.run_bench(loaded, "quick")
    assert threads == {"measured": "kvviz-engine", "served": threading.current_thread().name}


def test_streamlits_dom_is_named_only_in_the_dom_module():
    """The bench, the browser tests and the container check find a page's elements through kvviz.bench.dom, so a
    Streamlit (or plotly.js) rename is mended there once."""
    root = Path(__file__).resolve().parents[1]
    files = [*(root / "kvviz").rglob("*.py"), *(root / "tests").glob("*.py"), *(root / "scripts").glob("*.py")]
    named = [str(path.relative_to(root)) for path in files
             if path.name != "dom.py" and path != Path(__file__).resolve()
             and any(selector in path.read_text() for selector in ("data-testid", "js-plotly-plot"))]
    assert named == []


def test_the_engine_process_section_raises_when_its_process_fails_or_dies_instead_of_waiting():
    """A process that could not load its model says why; one that died leaves nothing to read, and the section
    raises instead of waiting on the socket for ever (a child that died once hung the whole test run)."""
    from kvviz.bench.sections.engine_process import ProcessFailed, receive, start_engine_process, start_process

    for (process, connection), said in ((start_engine_process("no-such-model", "cpu", "float32", "auto"),
                                         "no-such-model"),
                                        (start_process("import os; os._exit(3)"), "exited with code 3")):
        with pytest.raises(ProcessFailed, match=said):
            receive(connection, process, timeout=120)
        connection.close()
        process.wait(30)


def test_the_engine_process_runs_a_comparison_whatever_the_callers_main_module(real_model, monkeypatch):
    """Under a Streamlit test the main module is the app's script; the engine's process must not run it."""
    import types

    from kvviz.bench.sections.engine_process import receive, send, start_engine_process
    from kvviz.comparison.session import compare

    script = types.ModuleType("__main__")
    script.__file__ = str(Path(__file__).resolve().parents[1] / "app.py")
    monkeypatch.setitem(sys.modules, "__main__", script)
    process, connection = start_engine_process(real_model.name, "cpu", "float32", real_model.weights)
    try:
        assert receive(connection, process, timeout=300) > 0, "ready, with its resident bytes"
        ids = real_model.tokenizer("The harbour was quiet that night.")["input_ids"]
        send(connection, (ids, ["full", "window:window=4"], 2))
        there = receive(connection, process, timeout=300)
        here = compare(real_model, ids, ["full", "window:window=4"], 2, reuse_prefix=False)
        assert [r.token_ids for r in there.results] == [r.token_ids for r in here.results]
        send(connection, None)
        assert receive(connection, process, timeout=60) > 0
    finally:
        connection.close()
        process.wait(60)


def test_the_adaptive_ratio_pairs_each_repeat_with_the_fixed_design_on_that_repeat_s_items():
    """A slow repeat reaches fewer items, so its fixed baseline is shorter too: the ratio is taken within each
    repeat (here 2x and 3x), never from medians of seconds over repeats that ran different items."""
    from types import SimpleNamespace

    from kvviz.bench.sections.adaptive_sweep import Repeat

    def report(decided: int, items: int) -> SimpleNamespace:
        points = [SimpleNamespace(paired=None)] + [SimpleNamespace(paired=SimpleNamespace(verdict="beyond margin"))
                                                  for _ in range(decided)]
        return SimpleNamespace(points=points, rounds=SimpleNamespace(items=items))

    slow = Repeat({"adaptive": 150.0, "fixed_same_items": 300.0}, {"adaptive": report(10, 160),
                                                                   "fixed_same_items": report(10, 160)})
    fast = Repeat({"adaptive": 150.0, "fixed_same_items": 450.0}, {"adaptive": report(10, 240),
                                                                   "fixed_same_items": report(10, 240)})
    assert slow.ratio() == pytest.approx(2.0) and fast.ratio() == pytest.approx(3.0)

"""Which runs decode together (kvviz.runtime.admission): on a CPU short comparisons start together and a long
upload's comparison alone; on an accelerator only the count bounds them; a study's step runs alone. The bench's class
is submitted to the model's engine, as the app's pages submit, and served in arrival order."""

import time
from types import SimpleNamespace

from kvviz.bench.sections.classroom import serve_class
from kvviz.runs import AttentionRequest, CompareRequest, RunRequest
from kvviz.runtime.admission import ADMISSION, ALONE, CPU_POSITIONS, ONE_AT_A_TIME, RUNS_TOGETHER, Admission, RunSize
from kvviz.runtime.engine import Engine
from kvviz.runtime.jobs import Job, Stage

SHORT = RunSize(40 * 2, "cpu")  # a student's comparison: two configurations on a ~40-token prompt
UPLOAD = RunSize(2022 * 6, "cpu")  # six configurations on a 2K-token upload


def test_a_run_starts_at_once_when_nothing_runs_whatever_its_size():
    assert ADMISSION.admits([], UPLOAD) and ADMISSION.admits([], RunSize(shares=False))


def test_short_comparisons_start_together_up_to_the_count_on_a_cpu():
    assert ADMISSION.admits([SHORT] * (RUNS_TOGETHER - 1), SHORT)
    assert not ADMISSION.admits([SHORT] * RUNS_TOGETHER, SHORT)


def test_a_long_upload_runs_alone_on_a_cpu_and_nothing_joins_it():
    assert UPLOAD.positions > CPU_POSITIONS
    assert not ADMISSION.admits([SHORT], UPLOAD)
    assert not ADMISSION.admits([UPLOAD], SHORT)
    assert not ADMISSION.admits([UPLOAD], UPLOAD)


def test_runs_join_while_the_positions_together_fit_the_cpus_bound():
    half = RunSize(CPU_POSITIONS // 2, "cpu")
    assert ADMISSION.admits([half], half)
    assert not ADMISSION.admits([half, half], SHORT)


def test_on_an_accelerator_only_the_count_bounds_runs_together():
    upload = RunSize(UPLOAD.positions, "cuda")
    assert ADMISSION.admits([upload] * (RUNS_TOGETHER - 1), upload)
    assert not ADMISSION.admits([upload] * RUNS_TOGETHER, upload)


def test_a_run_that_holds_the_model_runs_alone():
    study = RunSize(device="cuda", shares=False)
    assert not ADMISSION.admits([SHORT], study) and not ADMISSION.admits([study], RunSize(device="cuda"))


def test_one_at_a_time_admits_nothing_beside_a_run():
    assert not ONE_AT_A_TIME.admits([SHORT], SHORT)
    assert ONE_AT_A_TIME.describe("cpu") == "one run at a time"
    assert "2,048 positions" in ADMISSION.describe("cpu") and "positions" not in ADMISSION.describe("cuda")


def test_requests_say_what_they_put_on_the_model(tiny_model):
    from kvviz.runs import NeedleRequest

    compare = CompareRequest(tuple(range(30)), ("full", "window:window=8"), 3)
    assert compare.job(tiny_model).size == RunSize(60, "cpu")
    assert AttentionRequest(tuple(range(30)), 0, 4).job(tiny_model).size == RunSize(30, "cpu")
    needle = NeedleRequest(("window:window=8",), (64,), (0.5,), 1, "query_aware", False, 4)
    assert needle.job(tiny_model).size == ALONE, "a study's item decodes alone"


class _Sleep(RunRequest):
    """A run of a given size that takes ``seconds`` in short steps instead of computing, and says when it ran."""

    def __init__(self, size: RunSize, seconds: float, spans: list, index: int):
        self.size, self.seconds, self.spans, self.index = size, seconds, spans, index

    def job(self, loaded) -> Job:
        return Job(self.steps, self.size)

    def steps(self, progress):
        started = time.monotonic()
        while time.monotonic() - started < self.seconds:
            yield Stage.MEASURE
            time.sleep(0.005)
        self.spans.append((self.index, started, time.monotonic()))


def _serve(admission: Admission, sizes: list[RunSize], seconds: float) -> tuple[list[tuple[int, float, float]], int]:
    """Each size's run (taking ``seconds``) served as the bench serves a class, submitted to a model's engine:
    (index, start, end) per run, and the most runs at once."""
    spans: list[tuple[int, float, float]] = []
    requests = [_Sleep(size, seconds, spans, index) for index, size in enumerate(sizes)]
    _, at_once = serve_class(SimpleNamespace(device="cpu", engine=Engine(None, "cpu")), requests, admission)
    return sorted(spans), at_once


def test_the_class_bench_submits_to_the_engine_the_app_submits_to(tiny_model, story_ids):
    requests = [CompareRequest(tuple(story_ids[:20]), ("full", "window:window=8"), 2)] * 2
    before = len(tiny_model.engine.history)
    times, _ = serve_class(tiny_model, requests, ADMISSION)
    assert len(tiny_model.engine.history) - before == 2 and len(times) == 2
    assert tiny_model.engine.admission is ADMISSION, "the engine's own policy is back after the class"


def test_a_class_starts_runs_in_order_as_the_policy_admits_them():
    spans, at_once = _serve(Admission(most_runs=2), [SHORT] * 4, 0.1)
    starts = [start for _, start, _ in spans]
    assert at_once == 2
    assert max(starts[:2]) <= min(starts[2:]), "nobody overtakes"
    assert starts[2] >= min(end for _, _, end in spans[:2]), "the third waits for one of the first two"


def test_a_class_holds_a_run_that_does_not_fit_and_those_behind_it():
    spans, at_once = _serve(ADMISSION, [SHORT, UPLOAD, SHORT], 0.1)
    (_, _, short_end), (_, upload_start, upload_end), (_, last_start, _) = spans
    assert upload_start >= short_end and last_start >= upload_end, "the upload alone; the short run behind it waits"
    assert at_once == 1

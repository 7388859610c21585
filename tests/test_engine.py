"""One engine per loaded model (kvviz.runtime.engine): clients submit jobs and hold handles; every forward runs on the
engine's one long-lived thread; a comparison is states the engine advances; work off the model holds no place."""

import threading
import time

import pytest

from kvviz.comparison.session import compare, compare_job
from kvviz.runs import AttentionRequest, CompareRequest, ContextCostRequest
from kvviz.runtime.admission import ONE_AT_A_TIME, RunSize
from kvviz.runtime.engine import Engine
from kvviz.runtime.jobs import Cancelled, Decode, Elsewhere, Job, SharedPrefill, Stage, Status
from kvviz.runtime.prefill import prefill_together


@pytest.fixture
def forward_threads(tiny_model):
    """The threads the tiny model's forwards ran on while the test ran."""
    seen: set[threading.Thread] = set()
    hook = tiny_model.model.register_forward_pre_hook(lambda module, args: seen.add(threading.current_thread()))
    yield seen
    hook.remove()


def test_every_forward_of_submitted_runs_runs_on_the_engines_thread(tiny_model, story_ids, forward_threads):
    """Comparisons (sharing the running batch), an attention capture and a study (one length per step), submitted
    together by four users: the clients only wait, the engine computes."""
    requests = [CompareRequest(tuple(story_ids[:40]), ("full", "window:window=8"), 4),
                CompareRequest(tuple(story_ids[10:50]), ("full", "snapkv:budget=16,window=4"), 3),
                AttentionRequest(tuple(story_ids[:30]), 0, 4),
                ContextCostRequest(tuple(story_ids[:40]), (20, 40))]
    handles = tiny_model.engine.submit_all([request.job(tiny_model) for request in requests],
                                           [f"user-{index}" for index in range(len(requests))])
    for handle in handles:
        handle.result(300)
        assert handle.status is Status.DONE
    assert len(forward_threads) == 1 and next(iter(forward_threads)).name == "kvviz-engine"


def test_a_comparison_is_one_submit_whose_states_the_engine_advances(tiny_model, story_ids):
    """compare() submits one job; its steps ask for the shared prefill, then fork, decode in the batch and score."""
    before = len(tiny_model.engine.history)
    compare(tiny_model, story_ids[:30], ["window:window=8"], 3)
    assert len(tiny_model.engine.history) - before == 1, "one run"

    steps = compare_job(tiny_model, story_ids[:30], ["window:window=8"], 3).start(lambda fraction, message: None)
    asked = next(steps)
    assert isinstance(asked, SharedPrefill) and asked.prompts == [story_ids[:30]]
    seen = [asked]
    asked = steps.send(prefill_together(tiny_model.model, "cpu", asked.prompts, None))
    while True:
        seen.append(asked)
        if isinstance(asked, Decode):
            while not all(group.finished for group in asked.groups):
                tiny_model.engine._step(asked.groups)
        try:
            asked = next(steps)
        except StopIteration as stop:
            comparison = stop.value
            break
    assert [type(a).__name__ if not isinstance(a, Stage) else a for a in seen] == [
        "SharedPrefill", Stage.FORK, "Decode", Stage.SCORE]
    assert [r.method for r in comparison.results] == ["full", "window:window=8"]


def test_a_runs_result_or_error_comes_back_through_its_handle(tiny_model):
    engine = Engine(tiny_model.model, "cpu")

    def thread_name(progress):
        yield Stage.MEASURE
        return threading.current_thread().name

    def fails(progress):
        yield Stage.MEASURE
        raise KeyError("inside the engine")

    assert engine.run(Job(thread_name, RunSize(shares=False))) == "kvviz-engine"
    handle = engine.submit(Job(fails, RunSize(shares=False)))
    with pytest.raises(KeyError, match="inside the engine"):
        handle.result(5)
    assert handle.status is Status.FAILED and isinstance(handle.error, KeyError)
    assert engine.run(Job(thread_name, RunSize(shares=False))) == "kvviz-engine", "the engine serves the next run"


def test_an_idle_engines_thread_ends_and_the_next_work_starts_another(tiny_model):
    engine = Engine(tiny_model.model, tiny_model.device, idle_seconds=0.05)

    def this_thread(progress):
        yield Stage.MEASURE
        return threading.current_thread()

    first = engine.run(Job(this_thread, RunSize()))
    first.join(5)
    assert not first.is_alive(), "idle: the thread ended"
    second = engine.run(Job(this_thread, RunSize()))
    assert second is not first and second.name == "kvviz-engine"


def test_a_run_waiting_elsewhere_holds_no_place_and_what_it_submits_is_its_users(tiny_model, story_ids):
    """One run at a time: while a run's work waits off the model (a Ray sweep's shards), another user's comparison is
    admitted and finishes; the runs that work submits are the same user's, and cancelling it cancels them."""
    engine = Engine(tiny_model.model, "cpu", tiny_model.prefix_cache, admission=ONE_AT_A_TIME)
    children: list = []
    measured, go_on, submitted = threading.Event(), threading.Event(), threading.Event()

    def endless(progress):
        while True:
            yield Stage.MEASURE
            time.sleep(0.005)

    def elsewhere(stop: threading.Event):
        children.append(engine.submit(compare_job(tiny_model, story_ids[:20], ["window:window=8"], 2)))
        children[0].result(60)
        measured.set()
        go_on.wait(60)
        children.append(engine.submit(Job(endless, RunSize(shares=False))))
        submitted.set()
        stop.wait(60)

    def waits_elsewhere(progress):
        return (yield Elsewhere(elsewhere))

    sweep = engine.submit(Job(waits_elsewhere, RunSize(shares=False)), "teacher")
    assert measured.wait(60) and sweep.status is Status.ELSEWHERE
    other = engine.submit(compare_job(tiny_model, story_ids[:30], ["window:window=8"], 3), "student")
    assert other.result(60).by_method("full").error is None, "admitted while the sweep waits elsewhere"
    go_on.set()
    assert submitted.wait(60) and [child.user for child in children] == ["teacher", "teacher"]
    sweep.cancel()
    with pytest.raises(Cancelled):
        sweep.result(5)
    assert children[1].wait(5) and children[1].status is Status.CANCELLED, "its runs are cancelled with it"


def test_a_run_made_inside_a_benchmark_section_runs_alone_in_its_step(tiny_model, story_ids, forward_threads):
    """A bench section holds the model for its timings (one step); a comparison it makes runs within that step."""
    def section(progress):
        yield Stage.MEASURE
        return compare(tiny_model, story_ids[:30], ["window:window=8"], 3)

    comparison = tiny_model.engine.run(Job(section, RunSize(shares=False)))
    assert comparison.by_method("window:window=8").error is None
    assert {thread.name for thread in forward_threads} == {"kvviz-engine"}


def test_a_study_called_directly_runs_on_the_engines_thread(tiny_model, story_ids, forward_threads):
    """The CLI, the bench and notebooks call studies as functions: they submit a job and wait, so every forward
    still runs on the engine's thread (a second thread with torch work of its own would start a second OpenMP
    pool)."""
    from kvviz.studies.perplexity import streaming_perplexities, streaming_perplexity
    from kvviz.studies.prefix_reuse import context_cost

    ids = story_ids[:24]
    streaming_perplexity(tiny_model, ids, "window:window=8")
    outcomes = streaming_perplexities(tiny_model, ids, ["full", "window:window=8", "h2o:heavy=4,recent=4"])
    assert all(not isinstance(outcome, Exception) for outcome in outcomes), outcomes
    assert [cost.tokens for cost in context_cost(tiny_model, ids, [8, 16])] == [8, 16]
    assert {thread.name for thread in forward_threads} == {"kvviz-engine"}


def test_a_studys_progress_reports_and_errors_reach_its_caller(tiny_model, story_ids):
    """A study on the engine reports progress to its caller's callback and raises its errors in the caller."""
    from kvviz.studies.perplexity import streaming_perplexity

    reports: list[float] = []
    streaming_perplexity(tiny_model, story_ids[:40], "window:window=8", progress=lambda f, m: reports.append(f))
    assert reports and reports[-1] == pytest.approx(1.0, abs=0.1)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        streaming_perplexity(tiny_model, story_ids[:1], "full")


def _study_jobs(loaded, ids: list[int]) -> dict[str, Job]:
    """Each study as the job its function submits, sized to two items."""
    from kvviz.studies.needle import needle_job
    from kvviz.studies.perplexity import perplexities_job, perplexity_job
    from kvviz.studies.prefix_reuse import context_cost_job, turns_job
    from kvviz.studies.prefix_sharing import sharing_job
    from kvviz.studies.tail import tail_job

    return {"needle": needle_job(loaded, ["window:window=16"], [96], [0.25, 0.75], chat=False, max_new_tokens=2),
            "tail": tail_job(loaded, ["window:window=40"], ["needle"], [200], [0.3, 0.6]),
            "perplexity": perplexity_job(loaded, ids[:100], "window:window=16"),
            "perplexities": perplexities_job(loaded, ids[:100], ["full", "window:window=16"]),
            "turns": turns_job(loaded, [ids[:40], ids[:60]], block_tokens=16),
            "context_cost": context_cost_job(loaded, ids, [16, 32]),
            "sharing": sharing_job(loaded, ids[:40], ids[40:45], ids[50:55], ["window:window=16"], 2)}


@pytest.mark.parametrize("study", ["needle", "tail", "perplexity", "perplexities", "turns", "context_cost",
                                   "sharing"])
def test_every_study_gives_the_model_back_between_its_items(tiny_model, story_ids, study):
    """One run at a time: a second user's run waiting behind a study is admitted between the study's items."""
    engine = Engine(tiny_model.model, "cpu", tiny_model.prefix_cache, admission=ONE_AT_A_TIME)

    def short(progress):
        yield Stage.MEASURE

    handle, other = engine.submit_all([_study_jobs(tiny_model, story_ids)[study], Job(short, RunSize())],
                                      ["teacher", "student"])
    handle.result(300)
    other.result(5)
    assert handle.started_at < other.started_at < other.finished_at < handle.finished_at

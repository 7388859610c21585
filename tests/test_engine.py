"""One engine per loaded model (kvviz.runtime.engine): every forward of every run the scheduler serves runs on the
engine's one long-lived thread, work comes back with its result or its error, and an idle engine's thread ends."""

import threading

import pytest

from kvviz.runs import AttentionRequest, CompareRequest, ContextCostRequest
from kvviz.runtime.admission import ADMISSION
from kvviz.runtime.engine import Engine
from kvviz.runtime.scheduler import DONE, Scheduler


@pytest.fixture
def forward_threads(tiny_model):
    """The threads the tiny model's forwards ran on while the test ran."""
    seen: set[threading.Thread] = set()
    hook = tiny_model.model.register_forward_pre_hook(lambda module, args: seen.add(threading.current_thread()))
    yield seen
    hook.remove()


def test_every_forward_of_served_runs_runs_on_the_engines_thread(tiny_model, story_ids, forward_threads):
    """A comparison (sharing the running batch), an attention capture and a study (which holds the model by itself),
    served together through the scheduler: the workers hand the engine their model work and compute nothing."""
    requests = [CompareRequest(tuple(story_ids[:40]), ("full", "window:window=8"), 4),
                CompareRequest(tuple(story_ids[10:50]), ("full", "snapkv:budget=16,window=4"), 3),
                AttentionRequest(tuple(story_ids[:30]), 0, 4),
                ContextCostRequest(tuple(story_ids[:40]), (20, 40))]
    scheduler = Scheduler(abandon_after=None, together=len(requests), admission=ADMISSION)
    tickets = [scheduler.submit(f"user-{index}", lambda progress, r=request: r.run(tiny_model, progress),
                                request.run_size(tiny_model)) for index, request in enumerate(requests)]
    for ticket in tickets:
        assert ticket.done.wait(300) and ticket.status == DONE, ticket.error
    assert len(forward_threads) == 1 and next(iter(forward_threads)).name == "kvviz-engine"


def test_work_handed_to_the_engine_returns_its_result_or_raises_its_error_here(tiny_model):
    engine = tiny_model.engine
    assert engine.call(lambda: threading.current_thread().name) == "kvviz-engine"

    def fails():
        raise KeyError("inside the engine")

    with pytest.raises(KeyError, match="inside the engine"):
        engine.call(fails)
    assert engine.call(lambda: 7) == 7, "the engine serves the next work"


def test_a_caller_holding_the_model_runs_its_work_where_it_is(tiny_model):
    with tiny_model.lock:
        assert tiny_model.engine.call(threading.current_thread) is threading.current_thread()


def test_an_idle_engines_thread_ends_and_the_next_work_starts_another(tiny_model):
    engine = Engine(tiny_model.model, tiny_model.device, idle_seconds=0.05)
    first = engine.call(threading.current_thread)
    first.join(5)
    assert not first.is_alive(), "idle: the thread ended (and with it its hold on the model)"
    second = engine.call(threading.current_thread)
    assert second is not first and second.name == "kvviz-engine" and engine.threads_started == 2


def test_a_study_called_directly_runs_on_the_engines_thread(tiny_model, story_ids, forward_threads):
    """The CLI, the bench and notebooks call studies as functions, not through a request: every forward still runs
    on the engine's thread (a second thread with torch work of its own would start a second OpenMP pool)."""
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

"""The result store: requests keyed by their inputs, the model and kvviz's code; the class warm-up fills it."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from streamlit.testing.v1 import AppTest

import kvviz.runs
from kvviz.runs import CompareRequest, ResultStore, RunRequest
from kvviz.runtime.admission import RunSize
from kvviz.runtime.jobs import Job, Stage
from kvviz.runtime.models import LoadedModel

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class CountingRequest(RunRequest):
    kind: ClassVar[str] = "counting"
    value: int
    calls: list = field(default_factory=list, repr=False, compare=False)  # where its job records that it ran

    def job(self, loaded) -> Job:
        return Job(self.steps, RunSize())

    def steps(self, progress):
        yield Stage.MEASURE
        self.calls.append(self.value)
        return {"value": self.value, "tensor": torch.arange(self.value)}


def _loaded(device: str = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
    return LoadedModel(name="fake", model=None, tokenizer=None, device=device, dtype=dtype)


def test_store_computes_once_then_loads(tmp_path):
    store, calls = ResultStore(tmp_path), []
    first = store.fetch(_loaded(), CountingRequest(3, calls))
    again = store.fetch(_loaded(), CountingRequest(3, calls))
    assert calls == [3] and store.hits == 1
    assert torch.equal(again["tensor"], first["tensor"])
    store.fetch(_loaded(), CountingRequest(4, calls))
    assert calls == [3, 4], "other inputs are another result"


def test_store_keys_on_device_dtype_and_code(tmp_path, monkeypatch):
    store, calls = ResultStore(tmp_path), []
    store.fetch(_loaded(), CountingRequest(3, calls))
    store.fetch(_loaded("cuda"), CountingRequest(3, calls))
    store.fetch(_loaded(dtype=torch.bfloat16), CountingRequest(3, calls))
    monkeypatch.setattr(kvviz.runs, "code_fingerprint", lambda: "other code")
    store.fetch(_loaded(), CountingRequest(3, calls))
    assert calls == [3, 3, 3, 3]


def test_store_prunes_the_least_recently_used_over_its_size(tmp_path):
    store, calls = ResultStore(tmp_path), []
    store.fetch(_loaded(), CountingRequest(100, calls))
    one_file = next(tmp_path.rglob("*.pkl")).stat().st_size
    store.max_bytes = int(3.5 * one_file)  # room for three results
    for value in (101, 102, 100, 103):  # 100 is used again before 103 arrives: 101 is now the oldest
        store.fetch(_loaded(), CountingRequest(value, calls))
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.pkl")) <= store.max_bytes
    store.fetch(_loaded(), CountingRequest(100, calls))
    store.fetch(_loaded(), CountingRequest(101, calls))
    assert calls == [100, 101, 102, 103, 101], "the least recently used result went, the one used again stayed"


def test_unreadable_result_is_recomputed(tmp_path):
    store, calls = ResultStore(tmp_path), []
    store.fetch(_loaded(), CountingRequest(5, calls))
    store.path(_loaded(), CountingRequest(5, calls)).write_bytes(b"not a pickle")
    assert store.fetch(_loaded(), CountingRequest(5, calls))["value"] == 5
    assert calls == [5, 5]


@pytest.mark.slow
def test_page_opened_after_warm_up_does_not_run_the_model(real_model, monkeypatch):
    from kvviz_app.recent import recent_results
    from kvviz_app.warm import warm

    runs = warm(["Compare"])
    assert [r.error for r in runs] == [None] and runs[0].buttons == 1
    recent_results.clear()  # a new server process: nothing in memory, only the store on disk

    def no_model(self, loaded):
        raise AssertionError("the page ran the model although the warm-up stored its run")

    monkeypatch.setattr(CompareRequest, "job", no_model)
    app = AppTest.from_file(str(ROOT / "views" / "2_Compare.py"), default_timeout=120).run()
    next(b for b in app.button if b.proto.type == "primary").click().run()
    assert not app.exception and not app.error, [e.value for e in app.error]
    assert app.dataframe, "the stored comparison is shown"


def test_recent_results_return_the_same_object_and_drop_the_least_recently_used():
    from kvviz_app.recent import RecentResults

    memory, first = RecentResults(size=2), {"a": 1}
    memory.put("a", first)
    memory.put("b", {"b": 2})
    assert memory.get("a") is first, "a re-render gets the very object, not an unpickled copy"
    memory.put("c", {"c": 3})
    assert memory.get("b") is None and memory.get("a") is first and memory.get("c") == {"c": 3}


def test_attention_request_reports_each_layer_as_its_prefill_passes_it(tiny_model, story_ids):
    """The request hands its progress listener to the prefill with the call (no listener is ambient): one report per
    layer, beside the statistics the capture records."""
    from kvviz.runs import AttentionRequest

    reports: list[tuple[float, str]] = []
    stats = AttentionRequest(tuple(story_ids[:40]), layer=1, sink_tokens=1).run(
        tiny_model, lambda fraction, message: reports.append((fraction, message)))
    assert reports == [(0.5, "layer 1 of 2"), (1.0, "layer 2 of 2")]
    assert stats.sink_mass[1].shape[-1] == 40


def test_a_notebook_holds_the_same_handle_as_the_app_and_takes_no_lock(tiny_model, story_ids):
    from kvviz.runtime.jobs import Cancelled, Status

    request = CompareRequest(tuple(story_ids[:30]), ("full", "window:window=8"), 3)
    handle = request.submit(tiny_model)
    assert handle.status in (Status.WAITING, Status.RUNNING, Status.DONE)
    comparison = handle.result(120)
    assert handle.status is Status.DONE and handle.fraction == 1.0
    assert [r.method for r in comparison.results] == ["full", "window:window=8"]
    long = CompareRequest(tuple(story_ids[:30]), ("full", "window:window=8"), 200).submit(tiny_model)
    long.cancel()
    with pytest.raises(Cancelled):
        long.result(60)
    assert long.status is Status.CANCELLED

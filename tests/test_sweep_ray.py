"""Sweeps on a local Ray cluster of 2 CPUs: the same report as in process, resumable from the result store, a killed
worker losing nothing, a worker without the model named and its start's actors killed, another address refused.
One Ray instance for the module (each start costs seconds), on loopback; the workers load a tiny random-weight model
saved to a folder."""

import json
import os
import signal
import time

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read when Ray is imported: the node is 127.0.0.1
ray = pytest.importorskip("ray")

from kvviz.cli import main  # noqa: E402
from kvviz.runs import ResultStore  # noqa: E402
from kvviz.runtime.cluster import ClusterConfig, ClusterError, ModelSource, WorkerPool, connect, disconnect  # noqa: E402
from kvviz.runtime.models import load_model  # noqa: E402
from kvviz.studies.sweep import run_sweep  # noqa: E402
from kvviz.studies.sweep_measure import unit_order  # noqa: E402
from kvviz.studies.sweep_ray import WORKER_POOLS, sharded_rows  # noqa: E402
from kvviz.studies.workloads import PromptCase, PromptWorkload  # noqa: E402

SPECS = ["snapkv", "kivi:residual=0"]
BUDGETS = [0.25, 0.5]
TIMED = ("seconds", "shard_seconds", "ray_address", "workers", "shards", "shards_reused")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    assert ray.util.get_node_ip_address() == "127.0.0.1", "the variable alone keeps a local node on loopback"
    yield
    WORKER_POOLS.close()
    disconnect()


@pytest.fixture(scope="module")
def folder(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_model.model.save_pretrained(path)
    tiny_model.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def loaded(folder):
    return load_model(str(folder), "cpu")


def prompt_set(count: int) -> PromptWorkload:
    cases = [PromptCase(f"p{i}", "", tuple(range(40 + 3 * i, 100 + 5 * i))) for i in range(count)]
    return PromptWorkload(tuple(cases), max_new_tokens=4)


def without_timing(data: dict) -> dict:
    return {k: v for k, v in data.items() if k not in TIMED}


def test_a_ray_sweep_reports_what_the_process_does_and_resumes_from_stored_shards(cluster, folder, loaded, tmp_path,
                                                                                  monkeypatch, capsys):
    monkeypatch.setenv("KVVIZ_RESULTS", str(tmp_path / "store"))
    files = []
    for i in range(4):
        files += ["--prompt-file", str(tmp_path / f"p{i}.txt")]
        (tmp_path / f"p{i}.txt").write_text(f"Prompt {i}: the lighthouse keeper wrote his log every evening. " * 4)
    args = ["sweep", *files, "--model", str(folder), "--device", "cpu", "--max-new-tokens", "4", "--budgets",
            ",".join(map(str, BUDGETS)), *(a for s in SPECS for a in ("--method", s)), "--quiet"]
    assert main([*args, "--json", str(tmp_path / "here.json")]) == 0
    assert main([*args, "--ray", "--workers", "2", "--shard-items", "1", "--json", str(tmp_path / "ray.json")]) == 0
    here, sharded = (json.loads((tmp_path / name).read_text()) for name in ("here.json", "ray.json"))
    assert "shards" not in here
    assert (sharded["workers"], sharded["shards"], sharded["shards_reused"]) == (2, 4, 0)
    assert len(sharded["shard_seconds"]) == 4 and all(s > 0 for s in sharded["shard_seconds"])
    assert without_timing(sharded) == without_timing(here)  # every point, every prompt's outcome
    assert sorted(o["item"] for o in sharded["points"][1]["outcomes"]) == ["p0.txt", "p1.txt", "p2.txt", "p3.txt"]

    shard_files = sorted((tmp_path / "store" / "sweep_shard").glob("*.pkl"))
    assert len(shard_files) == 4  # each shard stored as it finished
    shard_files[0].unlink()  # as if the sweep had stopped before that shard finished
    assert main([*args, "--ray", "--workers", "2", "--shard-items", "1", "--json", str(tmp_path / "again.json")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert (again["shards"], again["shards_reused"]) == (4, 3)
    assert sum(s is None for s in again["shard_seconds"]) == 3  # one shard measured, three reused
    assert without_timing(again) == without_timing(here)
    assert "4 shards on 2 Ray workers (local), 3 reused" in capsys.readouterr().out


def test_a_worker_killed_mid_sweep_loses_nothing_and_counts_each_item_once(cluster, folder, loaded, tmp_path):
    workload = prompt_set(6)
    config, source = ClusterConfig(workers=2, shard_items=1, keep_seconds=60), ModelSource(str(folder), "cpu")
    with WORKER_POOLS.lease(config, source) as pool:
        first = pool.pids()
    killed: list[int] = []

    def kill_on_first_shard(fraction: float, message: str) -> None:
        if fraction > 0 and not killed:  # one worker just finished a shard, the other is in the middle of one
            killed.extend(first)
            for pid in first:
                os.kill(pid, signal.SIGKILL)

    store = ResultStore(tmp_path)
    report = run_sweep(loaded, workload, SPECS, BUDGETS, kill_on_first_shard,
                       sharded_rows(config, source, workload, store))
    assert WORKER_POOLS.kept() == [pool], "the sweep ran on the kept workers and kept them again"
    assert killed and set(pool.pids()).isdisjoint(first)  # Ray restarted both workers
    assert report.shard_run.shards == 6 and report.shard_run.shards_reused == 0
    order = [f"p{unit[0]}" for unit in unit_order(workload)]  # the prompts in the order the sweep uses them
    assert sorted(order) == [f"p{i}" for i in range(6)] and [item["id"] for item in report.items] == order
    for point in report.points:
        assert [o.item for o in point.outcomes] == order
    here = run_sweep(loaded, workload, SPECS, BUDGETS)
    assert without_timing(report.to_json()) == without_timing(here.to_json())


def test_a_worker_without_the_model_is_named_and_the_start_gives_its_cpus_back(cluster):
    WORKER_POOLS.close()
    with pytest.raises(ClusterError, match=r"^worker 127\.0\.0\.1 \(pid \d+\) cannot load kvviz-test/no-such-model"):
        WorkerPool(ClusterConfig(workers=2), ModelSource("kvviz-test/no-such-model", "cpu"))
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2, "the failed start's actors were killed"


def test_joining_another_address_is_refused_while_this_process_holds_one(cluster):
    here = ray.get_runtime_context().gcs_address
    connect(ClusterConfig())  # a local instance on loopback: this one
    connect(ClusterConfig(here))
    for other in ("127.0.0.1:1", "ray://127.0.0.1:10001", "auto"):
        with pytest.raises(ClusterError, match=f"already joined to the Ray cluster at {here}; it cannot join {other}"):
            connect(ClusterConfig(other))


def test_with_a_ray_address_the_trade_offs_page_sweeps_on_the_cluster(cluster, monkeypatch):
    from tests.tradeoffs_page import opened, sweep

    here = ray.get_runtime_context().gcs_address
    monkeypatch.setenv("KVVIZ_RAY_ADDRESS", here)  # the module's instance, by its address
    app = sweep(opened(), "streaming_llm", 0.25, "needle", 2)
    assert "configurations on 2 needle items" in app.success[0].value
    assert any(f"Measured on the Ray cluster: 2 shards on 1 Ray worker ({here})" in str(c.value) for c in app.caption)
    assert len(WORKER_POOLS.kept()) == 1, "the server keeps its workers for the next sweep"


def test_a_second_users_comparison_beside_a_ray_sweep_takes_about_what_it_takes_alone(cluster, folder, real_model):
    """While a sweep of 4 shards runs on the cluster, submitted as the Trade-offs page submits it, the sweep holds no
    place in the server's engine: another student's short comparison is admitted at once and finishes within 1.5x of
    its time alone (before, the sweep held the model for its whole length and the student waited for all of it)."""
    import statistics

    from kvviz.comparison.session import encode_prompt
    from kvviz.runs import CompareRequest, SweepRequest
    from kvviz.runtime.jobs import Status

    engine = real_model.engine
    here = ray.get_runtime_context().gcs_address
    sweep = SweepRequest(prompt_set(16), tuple(SPECS), tuple(BUDGETS), ClusterConfig(here, workers=1, shard_items=4),
                         ModelSource(str(folder), "cpu"))
    student = CompareRequest(tuple(encode_prompt(real_model.tokenizer, "Name two planets.", chat=True)),
                             ("full", "window:window=12"), 3)

    def comparison_seconds() -> float:
        started = time.perf_counter()
        engine.submit(student.job(real_model), "student").result(120)
        return time.perf_counter() - started

    comparison_seconds()  # warm-up
    alone = [comparison_seconds() for _ in range(3)]
    running = engine.submit(sweep.job(real_model), "teacher", abandon_after=None)
    deadline = time.monotonic() + 120
    while not running.message.startswith("shard 0 of 4") and time.monotonic() < deadline:  # its worker is up
        time.sleep(0.05)
    beside = comparison_seconds()
    assert running.status is Status.ELSEWHERE, "the sweep was still waiting on its shards when the student's run ended"
    report = running.result(300)
    alone.append(comparison_seconds())
    assert report.shard_run.shards == 4
    ratio = beside / statistics.median(alone)
    print(f"a student's comparison beside a 4-shard Ray sweep: {beside:.2f} s, alone {statistics.median(alone):.2f} s "
          f"({ratio:.2f}x)")
    assert ratio <= 1.5, f"{beside:.2f} s beside the sweep against {statistics.median(alone):.2f} s alone"


def test_a_cancelled_ray_sweep_stops_giving_out_shards_and_its_workers_go_back(cluster, folder, real_model,
                                                                                tmp_path, monkeypatch):
    from kvviz.runs import SweepRequest
    from kvviz.runtime.jobs import Cancelled, Status

    monkeypatch.setenv("KVVIZ_RESULTS", str(tmp_path / "store"))
    here = ray.get_runtime_context().gcs_address
    cases = [PromptCase(f"p{i}", "", tuple(range(100 + i, 400 + i))) for i in range(24)]
    workload = PromptWorkload(tuple(cases), max_new_tokens=48)  # shards long enough to cancel between them
    sweep = SweepRequest(workload, tuple(SPECS), tuple(BUDGETS), ClusterConfig(here, workers=1, shard_items=2),
                         ModelSource(str(folder), "cpu"))
    running = real_model.engine.submit(sweep.job(real_model), "teacher")
    deadline = time.monotonic() + 120
    while not running.message.startswith("shard 1 of 12") and time.monotonic() < deadline:
        time.sleep(0.02)
    running.cancel()
    with pytest.raises(Cancelled):
        running.result(5)
    assert running.status is Status.CANCELLED
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2, "the sweep's worker was released"
    assert len(list((tmp_path / "store" / "sweep_shard").glob("*.pkl"))) < 12, "no shard given out after the cancel"

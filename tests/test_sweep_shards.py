"""A sweep cut into shards without Ray: the cut, rows joined from shards filling the same points, and the cluster's
errors that need no cluster (Ray missing, an address nobody answers at, options without --ray)."""

import sys
import time
from pathlib import Path

import pytest

from kvviz.cli import main, options
from kvviz.runtime.cluster import RAY_REQUIREMENT, ClusterError, check_reachable, import_ray
from kvviz.runtime.settings import Settings
from kvviz.studies.sweep import run_sweep
from kvviz.studies.sweep_measure import Rows, measure_rows
from kvviz.studies.sweep_shards import ShardRun, cut_shards, shard_size
from kvviz.studies.workloads import PromptCase, PromptWorkload

ROOT = Path(__file__).resolve().parents[1]


def test_shards_cover_every_item_once_in_order():
    assert cut_shards(7, 3) == [(0, 1, 2), (3, 4, 5), (6,)]
    assert [i for shard in cut_shards(32, shard_size(32, 3)) for i in shard] == list(range(32))
    assert shard_size(32, 2) == 8 and shard_size(3, 4) == 1  # two shards per worker, never empty
    with pytest.raises(ValueError):
        cut_shards(4, 0)


def test_rows_joined_from_shards_fill_the_points_one_pass_fills(real_model):
    # a model from load_model: its linear layers give the same rows whatever the batch (kvviz.runtime.invariance)
    workload = PromptWorkload(tuple(PromptCase(f"p{i}", "", tuple(range(30 + i, 90 + 4 * i))) for i in range(5)),
                              max_new_tokens=3)
    specs = ["snapkv", "kivi:residual=0"]

    def from_shards(specs_given, indices, progress):
        parts = [measure_rows(real_model, workload, specs_given, [indices[i] for i in shard])
                 for shard in cut_shards(len(indices), 2)]
        return Rows.join(parts), ShardRun("test", 1, 3, 0, [1.0, 1.0, 1.0])

    whole = run_sweep(real_model, workload, specs, [0.25, 0.5]).to_json()
    sharded = run_sweep(real_model, workload, specs, [0.25, 0.5], source=from_shards).to_json()
    assert (sharded["workers"], sharded["shards"], sharded["shards_reused"]) == (1, 3, 0)
    timing = ("seconds", "ray_address", "workers", "shards", "shards_reused", "shard_seconds", "rounds")
    assert {k: v for k, v in sharded.items() if k not in timing} == {k: v for k, v in whole.items() if k not in timing}


def test_ray_missing_names_the_pinned_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ClusterError, match=r"Ray is not installed: pip install 'ray\[client\]==2\.60\.0'"):
        import_ray()
    assert RAY_REQUIREMENT in (ROOT / "requirements.txt").read_text().splitlines()


def test_an_unreachable_address_is_named_within_seconds():
    started = time.monotonic()
    with pytest.raises(ClusterError, match=r"cannot reach the Ray cluster at ray://127\.0\.0\.1:9 within"):
        check_reachable("ray://127.0.0.1:9", timeout=2)
    assert time.monotonic() - started < 3
    with pytest.raises(ClusterError, match="cannot read the Ray address 'head'"):
        check_reachable("head")


def test_ray_options_are_checked_before_any_model_work(capsys, monkeypatch):
    monkeypatch.setattr(options, "load", lambda args: pytest.fail("refused before loading a model"))
    assert main(["sweep", "--task", "needle", "--method", "snapkv", "--workers", "2"]) == 2
    assert "--workers and --shard-items go with --ray" in capsys.readouterr().err
    assert main(["sweep", "--task", "needle", "--method", "snapkv", "--ray", "ray://127.0.0.1:9"]) == 2
    assert "cannot reach the Ray cluster at ray://127.0.0.1:9" in capsys.readouterr().err


def test_the_app_reads_its_cluster_from_the_environment():
    assert Settings.from_env({"KVVIZ_RAY_ADDRESS": " ray://head:10001 "}).ray_address == "ray://head:10001"
    assert Settings.from_env({}).ray_address == ""


def test_a_points_measures_are_a_typed_record_written_in_one_place():
    """Measuring gives each point a Measures record (every field a SweepPoint field of the same type), and
    fill_points is the one place that writes them: no module assigns a measure to a point itself."""
    import re
    from dataclasses import fields

    from kvviz.studies.sweep import SweepPoint
    from kvviz.studies.sweep_measure import MEASURE_FIELDS, Measures

    point_types = {f.name: f.type for f in fields(SweepPoint)}
    assert all(point_types.get(f.name) == f.type for f in fields(Measures)), "a measure SweepPoint lacks or types apart"
    assigned = re.compile(r"\.(" + "|".join(MEASURE_FIELDS) + r")\s*(,[^=\n]*)?=[^=]")
    writers = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "kvviz").rglob("*.py")
                     if any(assigned.search(line) and "point" in line.split("=")[0]
                            for line in path.read_text().splitlines()))
    assert writers == []

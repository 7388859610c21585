"""Ray workers' lifecycle without Ray: kept pools lent to one sweep at a time, released when idle or replaced, and
a process's one Ray connection never reused for another address."""

import threading
import time

import pytest

from kvviz.runtime.cluster import LOCAL, ClusterConfig, Joined, ModelSource
from kvviz.studies import sweep_ray
from kvviz.studies.sweep_ray import WorkerPools


class FakePool:
    """Stands in for :class:`kvviz.runtime.cluster.WorkerPool`: records whether it was closed."""

    started: list["FakePool"] = []

    def __init__(self, config: ClusterConfig, source: ModelSource):
        self.config, self.closed = config, threading.Event()
        FakePool.started.append(self)

    def close(self) -> None:
        self.closed.set()


@pytest.fixture
def pools(monkeypatch):
    FakePool.started = []
    monkeypatch.setattr(sweep_ray, "WorkerPool", FakePool)
    with WorkerPools() as kept:
        yield kept
    assert all(p.closed.is_set() for p in FakePool.started), "leaving the pools releases every one"


SOURCE = ModelSource("m", "cpu")


def test_without_a_keep_time_the_workers_go_back_when_the_sweep_ends(pools):
    with pools.lease(ClusterConfig(), SOURCE) as pool:
        assert not pool.closed.is_set()
    assert pool.closed.is_set() and pools.kept() == []


def test_kept_workers_serve_the_next_sweep_then_go_back_after_their_idle_time(pools):
    config = ClusterConfig(keep_seconds=0.3)
    with pools.lease(config, SOURCE) as first:
        pass
    with pools.lease(config, SOURCE) as second:
        assert second is first and pools.kept() == []  # lent: not kept, so no timer can close it
        time.sleep(0.4)
        assert not first.closed.is_set()
    assert pools.kept() == [first]
    assert first.closed.wait(2) and pools.kept() == []


def test_a_lent_pool_is_never_closed_by_a_sweep_for_another_model(pools):
    config = ClusterConfig(keep_seconds=60)
    with pools.lease(config, SOURCE) as busy:
        with pools.lease(config, ModelSource("other", "cpu")) as other:
            assert other is not busy
        assert not busy.closed.is_set()
    assert pools.kept() == [busy] and other.closed.is_set()  # one kept pool at most: the last one done


def test_a_failed_sweep_closes_its_workers(pools):
    with pytest.raises(RuntimeError), pools.lease(ClusterConfig(keep_seconds=60), SOURCE) as pool:
        raise RuntimeError("a node was lost")
    assert pool.closed.is_set() and pools.kept() == []


def test_a_connection_serves_only_the_address_it_was_made_for():
    local = Joined(LOCAL, "127.0.0.1:6379")
    assert local.serves(LOCAL) and local.serves("127.0.0.1:6379")
    assert not local.serves("auto") and not local.serves("ray://head:10001")
    remote = Joined("ray://head:10001", "10.0.0.5:6379")
    assert remote.serves("ray://head:10001") and not remote.serves(LOCAL) and not remote.serves("ray://other:10001")
    made_elsewhere = Joined("10.0.0.5:6379", "10.0.0.5:6379")  # a notebook's ray.init on a cluster node
    assert made_elsewhere.serves("10.0.0.5:6379") and not made_elsewhere.serves(LOCAL)

"""A sweep's items measured in shards on Ray workers, each shard stored the moment it finishes.

:func:`sharded_rows` is the row source :func:`kvviz.studies.sweep.run_sweep` measures through instead of this
process: shards already in the result store are reused, the rest go to the workers
(:class:`kvviz.runtime.cluster.WorkerPool`, the model loaded once per worker), and their rows join in item order,
so the report is the one an in-process sweep gives. An interrupted sweep (Ctrl-C, a lost node, the driver killed)
keeps every shard that finished; running it again measures only the missing ones.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvviz.cache.layouts import DEFAULT_BLOCK_SIZE
from kvviz.runtime.cluster import ClusterConfig, ModelSource, WorkerIdentity, WorkerPool
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.progress import Progress
from kvviz.studies.sweep_measure import Rows, measure_rows
from kvviz.studies.sweep_shards import ShardKey, ShardRun, ShardStore, cut_shards, shard_size, stream_key
from kvviz.studies.workloads import Workload


def measure_shard(loaded: LoadedModel, workload: Workload, specs: tuple[str, ...], items: tuple[int, ...],
                  block_size: int = DEFAULT_BLOCK_SIZE) -> Rows:
    """One shard on a worker: its items under every SPEC (a module function, so Ray ships it by name)."""
    return measure_rows(loaded, workload, list(specs), items, block_size=block_size)


PoolKey = tuple[ClusterConfig, ModelSource]


class WorkerPools:
    """Worker pools kept between sweeps: a server's workers stay up for the next sweep for ``keep_seconds`` of its
    :class:`ClusterConfig` (loading an 8B model on every worker costs minutes), then go back to the cluster.

    A pool is lent to one sweep at a time (:meth:`lease`) and never closed while lent; one kept pool at most (a
    sweep for another cluster or model releases it); a sweep that fails closes its pool. A context manager:
    leaving it releases what is kept."""

    def __init__(self):
        self._lock = threading.Lock()
        self._kept: dict[PoolKey, WorkerPool] = {}
        self._timer: threading.Timer | None = None

    @contextmanager
    def lease(self, config: ClusterConfig, source: ModelSource) -> Iterator[WorkerPool]:
        """A pool of ``config``'s workers holding ``source``'s model, kept afterwards for ``config.keep_seconds``."""
        key = (config, source)
        with self._lock:
            pool = self._kept.pop(key, None)
            others = self._take_all()
        for other in others:
            other.close()
        if pool is None:
            pool = WorkerPool(config, source)
        try:
            yield pool
        except BaseException:
            pool.close()
            raise
        if config.keep_seconds <= 0:
            pool.close()
            return
        with self._lock:
            others = self._take_all()
            self._kept[key] = pool
            self._timer = threading.Timer(config.keep_seconds, self._expire, (key, pool))
            self._timer.daemon = True
            self._timer.start()
        for other in others:
            other.close()

    def kept(self) -> list[WorkerPool]:
        with self._lock:
            return list(self._kept.values())

    def close(self) -> None:
        """Release every kept pool now (their CPUs and GPUs go back to the cluster)."""
        with self._lock:
            pools = self._take_all()
        for pool in pools:
            pool.close()

    def _take_all(self) -> list[WorkerPool]:
        """Every kept pool, no longer kept (the caller holds the lock and closes them after releasing it)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pools = list(self._kept.values())
        self._kept.clear()
        return pools

    def _expire(self, key: PoolKey, pool: WorkerPool) -> None:
        with self._lock:
            if self._kept.get(key) is not pool:  # lent again, or replaced, since the timer started
                return
            del self._kept[key]
            self._timer = None
        pool.close()

    def __enter__(self) -> WorkerPools:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


WORKER_POOLS = WorkerPools()  # this process's kept workers (a server's); keep_seconds 0 never leaves any here


def sharded_rows(config: ClusterConfig, source: ModelSource, workload: Workload, store: ShardStore | None,
                 block_size: int = DEFAULT_BLOCK_SIZE, stop: threading.Event | None = None):
    """A round source for :func:`kvviz.studies.sweep.run_sweep` that measures each round's items in shards on the
    cluster ``config`` names, reusing and saving shards in ``store``. It computes nothing in this process: a run
    waiting on it holds no place in the model's engine (:class:`kvviz.runtime.jobs.Elsewhere`). ``stop`` set (the
    run was cancelled): no further shard is started, and the sweep ends with what was stored."""

    def measure(specs: list[str], indices: list[int], progress: Progress | None) -> tuple[Rows, ShardRun]:
        with WORKER_POOLS.lease(config, source) as pool:
            return measure_on(pool, specs, indices, progress)

    def measure_on(pool: WorkerPool, specs: list[str], indices: list[int],
                   progress: Progress | None) -> tuple[Rows, ShardRun]:
        identity: WorkerIdentity = pool.identity
        size = config.shard_items or shard_size(len(indices), pool.size)
        shards = [ShardKey(stream_key(workload), tuple(specs), tuple(indices[i] for i in positions), block_size)
                  for positions in cut_shards(len(indices), size)]
        found = {i: store.load(identity, key) for i, key in enumerate(shards)} if store is not None else {}
        parts: dict[int, Rows] = {i: rows for i, rows in found.items() if rows is not None}
        seconds: list[float | None] = [None] * len(shards)
        reused = len(parts)
        missing = [i for i in range(len(shards)) if i not in parts]

        def report() -> None:
            if progress is not None:
                progress(len(parts) / len(shards), f"shard {len(parts)} of {len(shards)} done on {pool.size} "
                         f"worker{'s' if pool.size != 1 else ''}")

        def done(job: int, rows: Rows, worker_seconds: float) -> None:
            index = missing[job]
            parts[index], seconds[index] = rows, worker_seconds
            if store is not None:
                store.save(identity, shards[index], rows)
            report()

        report()
        pool.run(measure_shard, [(workload, shards[i].specs, shards[i].items, block_size) for i in missing], done,
                 stop)
        run = ShardRun(pool.address, pool.size, len(shards), reused, seconds)
        return Rows.join([parts[i] for i in range(len(shards))]), run

    return measure

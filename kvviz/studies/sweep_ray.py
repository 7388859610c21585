"""A sweep's items measured in shards on Ray workers, each shard stored the moment it finishes.

:func:`sharded_rows` is the row source :func:`kvviz.studies.sweep.run_sweep` measures through instead of this
process: shards already in the result store are reused, the rest go to the workers
(:class:`kvviz.runtime.cluster.WorkerPool`, the model loaded once per worker), and their rows join in item order,
so the report is the one an in-process sweep gives. An interrupted sweep (Ctrl-C, a lost node, the driver killed)
keeps every shard that finished; running it again measures only the missing ones.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvviz.cache.layouts import DEFAULT_BLOCK_SIZE
from kvviz.runtime.cluster import ClusterConfig, ModelSource, WorkerIdentity, WorkerPool
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.progress import Progress
from kvviz.studies.sweep_measure import Rows, item_count, measure_rows
from kvviz.studies.sweep_shards import ShardKey, ShardRun, cut_shards, shard_size
from kvviz.studies.workloads import Workload


class ShardStore(Protocol):
    """Where finished shards live (:class:`kvviz.runs.ResultStore`), keyed by the workers' model and the shard."""

    def load(self, loaded: Any, request: ShardKey) -> Rows | None: ...

    def save(self, loaded: Any, request: ShardKey, result: Rows) -> None: ...


def measure_shard(loaded: LoadedModel, workload: Workload, specs: tuple[str, ...], items: tuple[int, ...],
                  block_size: int = DEFAULT_BLOCK_SIZE) -> Rows:
    """One shard on a worker: its items under every SPEC (a module function, so Ray ships it by name)."""
    return measure_rows(loaded, workload, list(specs), items, block_size=block_size)


_pools: dict[tuple[ClusterConfig, ModelSource], WorkerPool] = {}


def worker_pool(config: ClusterConfig, source: ModelSource) -> WorkerPool:
    """The workers of ``config`` holding ``source``'s model, started once per process and kept for later sweeps
    (workers for another model or count replace them)."""
    key = (config, source)
    if key not in _pools:
        release_workers()
        _pools[key] = WorkerPool(config, source)
    return _pools[key]


def release_workers() -> None:
    """Stop the workers this process keeps (their CPUs and GPUs go back to the cluster)."""
    for pool in list(_pools.values()):
        pool.close()
    _pools.clear()


def sharded_rows(config: ClusterConfig, source: ModelSource, workload: Workload, store: ShardStore | None,
                 block_size: int = DEFAULT_BLOCK_SIZE):
    """A row source for :func:`kvviz.studies.sweep.run_sweep` that measures ``workload``'s items in shards on the
    cluster ``config`` names, reusing and saving shards in ``store``."""

    def measure(specs: list[str], progress: Progress | None) -> tuple[Rows, ShardRun]:
        pool = worker_pool(config, source)
        identity: WorkerIdentity = pool.identity
        count = item_count(workload)
        shards = [ShardKey(workload, tuple(specs), items, block_size)
                  for items in cut_shards(count, config.shard_items or shard_size(count, pool.size))]
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
        pool.run(measure_shard, [(workload, shards[i].specs, shards[i].items, block_size) for i in missing], done)
        run = ShardRun(pool.address, pool.size, len(shards), reused, seconds)
        return Rows.join([parts[i] for i in range(len(shards))]), run

    return measure

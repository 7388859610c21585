"""A sweep on Ray against the same sweep in this process: what Ray's workers, shards and result shipping cost.

One local worker (as many torch threads as this process) measures the page's families on ``sweep_ray_items`` task
items in two shards, in turns with the in-process sweep, so a slow spell of the machine hits both alike; the two
reports must be equal. Starting the worker (Ray and the model) is timed apart: a command pays it once, a server once
per spell of sweeps (it keeps its workers while they are wanted). The scheduling overhead per shard is a no-op job's
round trip through the worker. On a 2-core CPU one process already uses both cores, so several workers cannot be
faster here; scaling over GPUs needs a machine with several.
"""

from __future__ import annotations

from kvviz.bench.harness import BenchRun, Section, Spread, bench_section, timed
from kvviz.runtime.cluster import (
    RAY_REQUIREMENT,
    ClusterConfig,
    ModelSource,
    WorkerPool,
    disconnect,
    ray_installed,
    ray_running,
)
from kvviz.studies.sweep import run_sweep
from kvviz.studies.sweep_ray import WORKER_POOLS, sharded_rows
from kvviz.studies.workloads import TaskWorkload

FAMILIES = ("streaming_llm", "snapkv", "kivi:residual=0")  # the Trade-offs page's first run
TASK = "multikey"
NOOP_JOBS = 20
TIMED_KEYS = ("seconds", "ray_address", "workers", "shards", "shards_reused", "shard_seconds")
KEEP_SECONDS = 600.0  # the worker stays up across the section's sweeps; released when the section ends


def nothing(loaded, index: int) -> int:
    """A job that does no work: its round trip is the scheduling overhead."""
    return index


@bench_section("sweep_ray")
def sweep_ray(run: BenchRun) -> Section:
    section = Section("sweep_ray", "A sweep on one local Ray worker against the same sweep in process")
    loaded, sizes = run.loaded, run.sizes
    if loaded.name.startswith("random:"):
        section.skipped = "needs a model Ray workers can load by name (a random model lives in this process only)"
        return section
    if not ray_installed():
        section.skipped = f"Ray is not installed: pip install '{RAY_REQUIREMENT}'"
        return section
    workload = TaskWorkload(TASK, sizes.sweep_ray_task_length, sizes.sweep_ray_items)
    config = ClusterConfig(workers=1, keep_seconds=KEEP_SECONDS)
    source = ModelSource(loaded.name, str(loaded.device), weights=loaded.weights)
    started_here = not ray_running()
    try:
        start_seconds, _ = timed(loaded.device, lambda: _started(config, source))
        _measure(run, section, workload, config, source, start_seconds)
    finally:
        WORKER_POOLS.close()
        if started_here:
            disconnect()
    return section


def _started(config: ClusterConfig, source: ModelSource) -> WorkerPool:
    """The section's worker, started and kept (``config.keep_seconds``) for the sweeps that lease it next."""
    with WORKER_POOLS.lease(config, source) as pool:
        return pool


def _measure(run: BenchRun, section: Section, workload: TaskWorkload, config: ClusterConfig, source: ModelSource,
             start_seconds: float) -> None:
    loaded = run.loaded
    run.log(f"  {len(FAMILIES)} families on {workload.describe()}: in process and on one Ray worker, in turns")
    here_seconds, ray_seconds, reports = [], [], {}
    for _ in range(run.sizes.repeats):
        seconds, reports["here"] = timed(loaded.device, lambda: run_sweep(loaded, workload, list(FAMILIES)))
        here_seconds.append(seconds)
        seconds, reports["ray"] = timed(loaded.device, lambda: run_sweep(
            loaded, workload, list(FAMILIES), source=sharded_rows(config, source, workload, None)))
        ray_seconds.append(seconds)
    here, on_ray = Spread(here_seconds), Spread(ray_seconds)
    shard_run = reports["ray"].shard_run
    worker_seconds = sum(s for s in shard_run.shard_seconds if s is not None)
    with WORKER_POOLS.lease(config, source) as pool:  # the worker the sweeps used, kept
        noop_seconds, _ = timed(loaded.device, lambda: pool.run(nothing, [(i,) for i in range(NOOP_JOBS)],
                                                               lambda index, result, seconds: None))
    same = ({k: v for k, v in reports["ray"].to_json().items() if k not in TIMED_KEYS}
            == {k: v for k, v in reports["here"].to_json().items() if k != "seconds"})
    run.log(f"    in process {here.median:.1f} s, on Ray {on_ray.median:.1f} s; worker start {start_seconds:.1f} s")
    section.add("sweep_ray_configurations", len(reports["here"].points), note=", ".join(FAMILIES))
    section.add("sweep_ray_in_process_seconds", here.median, "s", note=here.note())
    section.add("sweep_ray_seconds", on_ray.median, "s",
                note=f"{shard_run.shards} shards on 1 worker; {on_ray.note()}")
    section.add("ray_vs_in_process", on_ray.median / here.median, "x", "<= 1.25",
                note="one local worker with this process's threads; the worker's start is not included")
    section.add("sweep_ray_shard_overhead_seconds", (ray_seconds[-1] - worker_seconds) / shard_run.shards, "s",
                note="per shard: the Ray sweep's wall time beyond its shards' seconds on the worker (shipping the "
                     "workload and rows, joining, filling the points)")
    section.add("ray_scheduling_per_shard_ms", noop_seconds / NOOP_JOBS * 1000, "ms",
                note=f"a no-op job's round trip through the worker, mean of {NOOP_JOBS}")
    section.add("ray_worker_start_seconds", start_seconds, "s",
                note="Ray started locally and the model loaded in the worker: paid once per command, by a "
                     "server once per spell of sweeps")
    section.add("sweep_ray_same_as_in_process", same, target="== True", note="every point and every item's outcome")
    section.add("ray_gpu_scaling", "not measured", note="several workers need several GPUs; this machine is a "
                                                          "2-core CPU, where one process already uses both cores")

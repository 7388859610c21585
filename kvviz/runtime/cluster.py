"""Ray workers that each load the model once and run jobs on it: a local Ray instance on loopback, or a cluster
joined by address (``auto``, ``ray://head:10001``).

Ray is optional (``pip install`` :data:`RAY_REQUIREMENT`) and imported only here, only when a cluster is asked for.
Every failure a user can meet is a :class:`ClusterError` of one line, within seconds: Ray missing (naming the install
command), an address nobody answers at (naming it), a worker that cannot load the model (naming its node). A worker
process that dies mid-job is restarted by Ray and its job retried (:data:`RETRIES`), so a job's result arrives once.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch

from kvviz.runtime.models import DEFAULT_MODEL, LoadedModel, load_model

RAY_REQUIREMENT = "ray[client]==2.60.0"  # as requirements.txt pins it
RETRIES = 3  # restarts of a lost worker process, and retries of the job it was running
CONNECT_SECONDS = 5.0  # how long an address may take to answer before the sweep gives up, naming it
LOCAL = "local"  # the address a local instance is described by


class ClusterError(RuntimeError):
    """A cluster that cannot run the work, in one line: what failed and where."""


@dataclass(frozen=True)
class ModelSource:
    """How each worker loads the model: the arguments of :func:`kvviz.runtime.models.load_model`. ``device`` None:
    each worker picks its own (cuda where it has a GPU)."""

    name: str = DEFAULT_MODEL
    device: str | None = None
    dtype: str | None = None
    weights: str = "auto"
    trust_remote_code: bool = False

    def load(self) -> LoadedModel:
        return load_model(self.name, self.device, self.dtype, self.weights, self.trust_remote_code)


@dataclass(frozen=True)
class ClusterConfig:
    """Where work goes: ``address`` None starts a local Ray instance bound to 127.0.0.1; ``workers`` None is one per
    GPU of the cluster (one when it has none); ``shard_items`` None cuts two shards per worker."""

    address: str | None = None
    workers: int | None = None
    shard_items: int | None = None

    def describe(self) -> str:
        return self.address or LOCAL


@dataclass(frozen=True)
class WorkerIdentity:
    """A worker and the model it loaded, as the result store keys results (``name``, ``device``, ``dtype``)."""

    node: str
    pid: int
    name: str
    device: str
    dtype: str


def import_ray():
    try:
        import ray
    except ImportError:
        raise ClusterError(f"Ray is not installed: pip install '{RAY_REQUIREMENT}'") from None
    return ray


def check_reachable(address: str, timeout: float = CONNECT_SECONDS) -> None:
    """ClusterError naming ``address`` unless something accepts a connection there (``ray://host:port`` or
    ``host:port``) within ``timeout``; ``auto`` is left to Ray, which answers at once when no cluster runs here."""
    if address == "auto":
        return
    parsed = urlparse(address if "://" in address else f"ray://{address}")
    if not parsed.hostname or not parsed.port:
        raise ClusterError(f"cannot read the Ray address '{address}': give ray://HOST:PORT, HOST:PORT or auto")
    try:
        socket.create_connection((parsed.hostname, parsed.port), timeout=timeout).close()
    except OSError as error:
        raise ClusterError(f"cannot reach the Ray cluster at {address} within {timeout:g} s: "
                           f"{error.strerror or error}") from None


def connect(config: ClusterConfig) -> None:
    """Join the cluster ``config`` names, or start a local instance whose processes listen on 127.0.0.1 only;
    nothing when Ray already runs in this process (a server or a test keeps one)."""
    if config.address is None:  # read when Ray is imported: a node of one then takes 127.0.0.1 as its address
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = import_ray()
    if ray.is_initialized():
        return
    if config.address is None:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False, configure_logging=False)
        return
    check_reachable(config.address)
    try:
        ray.init(config.address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, TimeoutError) as error:
        raise ClusterError(f"cannot join the Ray cluster at {config.address}: {str(error).splitlines()[0]}") from None


class _Worker:
    """A Ray actor's body: loads the model once (again after a restart) and runs jobs on it, on ``threads`` torch
    threads when given (else the CPUs Ray gave it)."""

    def __init__(self, source: ModelSource, threads: int | None):
        self.source = source
        self.threads = threads
        self.loaded: LoadedModel | None = None

    def _model(self) -> LoadedModel:
        if self.loaded is None:
            if self.threads:
                torch.set_num_threads(self.threads)
            self.loaded = self.source.load()
        return self.loaded

    def identify(self) -> WorkerIdentity | str:
        """Who this worker is and what it loaded, or why it could not load the model."""
        import ray

        node = ray.util.get_node_ip_address()
        try:
            loaded = self._model()
        except Exception as error:  # noqa: BLE001 - any load failure is the message the driver names the worker by
            return f"worker {node} (pid {os.getpid()}) cannot load {self.source.name}: {error}"
        return WorkerIdentity(node, os.getpid(), loaded.name, str(loaded.device), str(loaded.dtype))

    def run(self, job: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """``job(model, *args)`` and its seconds on this worker."""
        started = time.perf_counter()
        result = job(self._model(), *args)
        return result, time.perf_counter() - started


class WorkerPool:
    """``size`` Ray actors, each holding the model, one GPU each where the cluster has GPUs.

    On a local instance each worker runs as many torch threads as this process: a CPU's matrix multiply sums in an
    order that depends on its thread count, so only then do a worker's figures equal this process's to the last bit
    (several workers then share the cores). On a cluster each worker uses what Ray gives it."""

    def __init__(self, config: ClusterConfig, source: ModelSource):
        ray = import_ray()
        connect(config)
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0))
        self.size = config.workers or max(1, gpus)
        self.address = config.describe()
        cpus = max(1, int(resources.get("CPU", 1)) // self.size) if not gpus else 1
        kind, need = ("GPU", self.size) if gpus else ("CPU", cpus * self.size)
        deadline = time.monotonic() + CONNECT_SECONDS  # workers just stopped take a moment to hand theirs back
        while (free := ray.available_resources().get(kind, 0)) < need and time.monotonic() < deadline:
            time.sleep(0.2)
        if free < need:  # the actors would wait for them forever
            raise ClusterError(f"{self.size} worker{'s' if self.size != 1 else ''} need {need} {kind}s; the cluster "
                               f"at {self.address} has {free:g} free")
        actor = ray.remote(_Worker).options(num_cpus=cpus, num_gpus=1 if gpus else 0, max_restarts=RETRIES,
                                            max_task_retries=RETRIES)
        threads = torch.get_num_threads() if config.address is None else None
        self.actors = [actor.remote(source, threads) for _ in range(self.size)]
        found = ray.get([a.identify.remote() for a in self.actors])
        problems = [f for f in found if isinstance(f, str)]
        if problems:
            self.close()
            raise ClusterError("; ".join(problems))
        self.workers: list[WorkerIdentity] = found
        if len({(w.name, w.device, w.dtype) for w in found}) > 1:
            self.close()
            raise ClusterError("the workers loaded the model differently: " + ", ".join(
                f"{w.node} {w.device} {w.dtype}" for w in found) + "; give --device and --dtype")

    @property
    def identity(self) -> WorkerIdentity:
        return self.workers[0]

    def run(self, job: Callable[..., Any], jobs: Sequence[tuple], done: Callable[[int, Any, float], None]) -> None:
        """``job(model, *args)`` for every ``args`` of ``jobs``, one at a time per worker, the next to whichever
        worker frees first; ``done(index, result, seconds)`` as each finishes. A job whose worker died is retried
        after Ray restarts it; ClusterError once the retries are spent."""
        ray = import_ray()
        waiting = list(enumerate(jobs))[::-1]
        running: dict[Any, tuple[int, Any]] = {}

        def give(actor) -> None:
            if waiting:
                index, args = waiting.pop()
                running[actor.run.remote(job, *args)] = (index, actor)

        for actor in self.actors:
            give(actor)
        while running:
            (ref,), _ = ray.wait(list(running), num_returns=1)
            index, actor = running.pop(ref)
            try:
                result, seconds = ray.get(ref)
            except ray.exceptions.RayActorError as error:
                raise ClusterError(f"a worker was lost {RETRIES + 1} times on job {index + 1}; what finished is "
                                   f"kept, run again to measure the rest ({str(error).splitlines()[0]})") from None
            done(index, result, seconds)
            give(actor)

    def pids(self) -> list[int]:
        """The workers' process ids now (a restarted worker has a new one)."""
        ray = import_ray()
        return [w.pid for w in ray.get([a.identify.remote() for a in self.actors])]

    def close(self) -> None:
        ray = import_ray()
        for actor in self.actors:
            ray.kill(actor)

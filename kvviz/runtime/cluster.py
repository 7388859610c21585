"""Ray workers that each load the model once and run jobs on it: a local Ray instance on loopback, or a cluster
joined by address (``auto``, ``ray://head:10001``).

Ray is optional (``pip install`` :data:`RAY_REQUIREMENT`) and imported only here, only when a cluster is asked for.
Every failure a user can meet is a :class:`ClusterError` of one line, within seconds: Ray missing (naming the install
command), an address nobody answers at (naming it), a worker that cannot load the model (naming its node), a process
already joined to another address. A worker process that dies mid-job is restarted by Ray and its job retried
(:data:`RETRIES`), so a job's result arrives once. A :class:`WorkerPool` holds cluster resources until it is closed:
use it as a context manager (its actors are killed on exit, and when its start fails).
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch

from kvviz.runtime.jobs import Cancelled
from kvviz.runtime.models import DEFAULT_MODEL, LoadedModel, load_model

RAY_REQUIREMENT = "ray[client]==2.60.0"  # as requirements.txt pins it
RETRIES = 3  # restarts of a lost worker process, and retries of the job it was running
CONNECT_SECONDS = 5.0  # how long an address may take to answer before the sweep gives up, naming it
LOCAL = "local"  # the address a local instance is described by
STOP_POLL_SECONDS = 0.5  # how often a driver waiting on its workers looks whether its run was cancelled


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
    GPU of the cluster (one when it has none); ``shard_items`` None cuts two shards per worker; ``keep_seconds``:
    how long idle workers stay up for the next sweep (0: released when the sweep ends;
    :class:`kvviz.studies.sweep_ray.WorkerPools` keeps them)."""

    address: str | None = None
    workers: int | None = None
    shard_items: int | None = None
    keep_seconds: float = 0.0

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


def ray_installed() -> bool:
    """Whether Ray can be imported (asked without importing it: see :func:`connect`)."""
    return importlib.util.find_spec("ray") is not None


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


class WorkerLoadError(ClusterError):
    """A worker could not load the model (raised in the worker; the driver reads it back from Ray's wrapper)."""


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass(frozen=True)
class Joined:
    """The one Ray connection a process holds: the address it was asked for (:data:`LOCAL` for a local instance)
    and the address of its cluster's control store (``host:port``)."""

    asked: str
    gcs: str

    def serves(self, address: str) -> bool:
        """Whether ``address`` names this connection: as asked, as its control store's ``host:port``, or
        :data:`LOCAL` for an instance on loopback."""
        if address in (self.asked, self.gcs):
            return True
        return address == LOCAL and _loopback(self.gcs.rpartition(":")[0])


class _Connection:
    """What :func:`connect` joined, while Ray stays initialized (Ray's own state is process-wide, so this is too),
    and the lock that lets one connect at a time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.joined: Joined | None = None


_CONNECTION = _Connection()


def joined(ray) -> Joined:
    """The connection this process holds: the one :func:`connect` made, or one made elsewhere (a test, a
    notebook), described by its control store's address."""
    gcs = ray.get_runtime_context().gcs_address
    if _CONNECTION.joined is not None and _CONNECTION.joined.gcs == gcs:
        return _CONNECTION.joined
    return Joined(gcs, gcs)


def connect(config: ClusterConfig) -> None:
    """Join the cluster ``config`` names, or start a local instance whose processes listen on 127.0.0.1 only.

    Ray holds one connection per process: one this process already holds is kept when it serves the address asked
    for (:meth:`Joined.serves`); one to any other address is a ClusterError, never silently reused."""
    wanted = config.describe()
    with _CONNECTION.lock:
        if config.address is None:
            # Ray reads this once, when it is imported: "0" makes the node it starts take 127.0.0.1 as its address,
            # and its processes then listen there only (checked below; docs/deployment.md says how it was measured).
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        ray = import_ray()
        if ray.is_initialized():
            held = joined(ray)
            if not held.serves(wanted):
                raise ClusterError(f"this process is already joined to the Ray cluster at {held.asked}; it cannot "
                                   f"join {wanted} as well (restart it to switch)")
            return
        if config.address is None:
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, configure_logging=False)
            if not _loopback(node := ray.util.get_node_ip_address()):  # Ray was imported before the line above
                ray.shutdown()
                raise ClusterError(f"a local Ray instance would listen on {node}, not 127.0.0.1: Ray was imported "
                                   "before kvviz set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (set it before starting)")
        else:
            check_reachable(config.address)
            try:
                ray.init(config.address, log_to_driver=False, configure_logging=False)
            except (ConnectionError, RuntimeError, TimeoutError) as error:
                raise ClusterError(f"cannot join the Ray cluster at {config.address}: "
                                   f"{str(error).splitlines()[0]}") from None
        _CONNECTION.joined = Joined(wanted, ray.get_runtime_context().gcs_address)


def ray_running() -> bool:
    """Whether this process holds a Ray connection (asked without importing Ray)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def disconnect() -> None:
    """Leave the cluster (a local instance stops); the next :func:`connect` may join any address."""
    ray = import_ray()
    with _CONNECTION.lock:
        ray.shutdown()
        _CONNECTION.joined = None


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

    def identify(self) -> WorkerIdentity:
        """Who this worker is and what it loaded; WorkerLoadError naming its node when it cannot load the model."""
        import ray

        node = ray.util.get_node_ip_address()
        try:
            loaded = self._model()
        except Exception as error:  # noqa: BLE001 - any load failure is the message the driver names the worker by
            raise WorkerLoadError(f"worker {node} (pid {os.getpid()}) cannot load {self.source.name}: "
                                  f"{error}") from None
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
        connect(config)  # first: a local instance must not see Ray imported before it could keep it on loopback
        ray = import_ray()
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
        self.actors: list[Any] = []
        try:  # whatever stops the start (a worker's error, Ctrl-C) kills the actors started so far
            self.actors = [actor.remote(source, threads) for _ in range(self.size)]
            self.workers = self._identify(ray)
            if len({(w.name, w.device, w.dtype) for w in self.workers}) > 1:
                raise ClusterError("the workers loaded the model differently: " + ", ".join(
                    f"{w.node} {w.device} {w.dtype}" for w in self.workers) + "; give --device and --dtype")
        except BaseException:
            self.close()
            raise

    def _identify(self, ray) -> list[WorkerIdentity]:
        """Every worker's identity once it loaded the model; one ClusterError naming each that could not."""
        found, problems = [], []
        for ref in [a.identify.remote() for a in self.actors]:
            try:
                found.append(ray.get(ref))
            except ray.exceptions.RayTaskError as error:
                cause = error.cause if isinstance(error.cause, WorkerLoadError) else error
                problems.append(str(cause).splitlines()[0])
            except ray.exceptions.RayActorError as error:
                problems.append(f"a worker died while loading the model: {str(error).splitlines()[0]}")
        if problems:
            raise ClusterError("; ".join(problems))
        return found

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def identity(self) -> WorkerIdentity:
        return self.workers[0]

    def run(self, job: Callable[..., Any], jobs: Sequence[tuple], done: Callable[[int, Any, float], None],
            stop: threading.Event | None = None) -> None:
        """``job(model, *args)`` for every ``args`` of ``jobs``, one at a time per worker, the next to whichever
        worker frees first; ``done(index, result, seconds)`` as each finishes. A job whose worker died is retried
        after Ray restarts it; ClusterError once the retries are spent. Once ``stop`` is set no job is given out and
        the jobs running are left to Ray (:class:`~kvviz.runtime.jobs.Cancelled` raised here)."""
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
            finished, _ = ray.wait(list(running), num_returns=1, timeout=STOP_POLL_SECONDS)
            if stop is not None and stop.is_set():
                raise Cancelled("the sweep was cancelled; the shards that finished are stored")
            if not finished:
                continue
            index, actor = running.pop(finished[0])
            ref = finished[0]
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
        """Kill the workers: their CPUs and GPUs go back to the cluster (again: nothing)."""
        ray = import_ray()
        actors, self.actors = self.actors, []
        for actor in actors:
            ray.kill(actor)

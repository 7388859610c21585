"""The runs the pages ask for, as plain requests, and a result store on disk that outlives the server process.

A request names its inputs (frozen dataclass fields) and makes the job that computes it on a loaded model's engine
(:meth:`RunRequest.job`, :mod:`kvviz.runtime.engine`): the app submits that job and polls its handle, the command
line and the bench wait for it (:meth:`RunRequest.run`). The store
keys results by the request, the model (name, device, dtype) and a fingerprint of kvviz's code, so a result is
reused only when the same code would compute the same thing. The app looks here before queueing a run, and the
class warm-up (``make warm``) fills the store before students connect: a page whose run is stored never touches the
model.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from kvviz.cache.capture import CaptureConfig
from kvviz.cache.layouts import DEFAULT_BLOCK_SIZE
from kvviz.cache.stats import AttentionStats
from kvviz.comparison.results import Comparison
from kvviz.comparison.session import PromptSession, compare_job
from kvviz.planning.memory import model_card
from kvviz.runtime.admission import RunSize
from kvviz.runtime.cluster import ClusterConfig, ModelSource
from kvviz.runtime.jobs import Elsewhere, Handle, Job, Stage, Steps
from kvviz.runtime.models import LoadedModel
from kvviz.runtime.progress import Progress
from kvviz.runtime.settings import results_folder
from kvviz.studies.needle import NeedleReport, needle_job
from kvviz.studies.paired import DEFAULT_MARGIN
from kvviz.studies.prefix_reuse import LengthCost, ReuseReport, context_cost_job, turns_job
from kvviz.studies.prefix_sharing import SharingReport, sharing_job
from kvviz.studies.sweep import DEFAULT_BUDGETS, SweepReport, check_sweep, run_sweep
from kvviz.studies.sweep_ray import sharded_rows
from kvviz.studies.sweep_rounds import Adaptive
from kvviz.studies.sweep_shards import ModelKey, ShardKey
from kvviz.studies.tail import TailReport, tail_job
from kvviz.studies.workloads import Workload

T = TypeVar("T")
MATRIX_SIZE = 160  # attention matrices are block-averaged to at most this many bins per side


@functools.cache
def code_fingerprint() -> str:
    """A hash of every kvviz source file: stored results from other code are never reused."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class RunRequest:
    """Base of the requests: ``kind`` names the computation, the dataclass fields are its inputs."""

    kind: ClassVar[str] = ""

    def job(self, loaded: LoadedModel) -> Job:
        """The request as one job for the model's engine: its steps and what its first step puts on the model
        (its size, which the engine's admission weighs). Bad inputs raise here, before any model work."""
        raise NotImplementedError

    def submit(self, loaded: LoadedModel, user: str | None = None) -> Handle:
        """The request's job submitted to the model's engine: the handle a notebook (or any client that does not
        wait at once) holds, with its status, progress, ``cancel()`` and ``result()``."""
        return loaded.engine.submit(self.job(loaded), user)

    def run(self, loaded: LoadedModel, progress: Progress | None = None) -> Any:
        """The request's job submitted to the model's engine, and its result waited for (the command line and the
        bench; a page submits the job itself and follows its handle)."""
        return loaded.engine.run(self.job(loaded), progress)


@dataclass(frozen=True)
class CompareRequest(RunRequest):
    """Compare: one prompt replayed under several SPECs (``full`` is the reference)."""

    kind: ClassVar[str] = "compare"
    prompt_ids: tuple[int, ...]
    specs: tuple[str, ...]
    max_new_tokens: int

    def job(self, loaded: LoadedModel) -> Job[Comparison]:
        return compare_job(loaded, self.prompt_ids, self.specs, self.max_new_tokens)


class _LayerProgress:
    """An attention listener that reports how far a prefill has got, layer by layer."""

    def __init__(self, layers: int, progress: Progress):
        self.layers = layers
        self.progress = progress

    def wants(self, layer_idx: int) -> bool:
        return True

    def query_rows(self, layer_idx: int, query_total: int) -> int:
        return 1  # the last query marks the layer done; asking for more would take the layer off SDPA

    def observe(self, layer_idx: int, probs: Any, query_start: int, query_total: int) -> None:
        if query_start + probs.shape[2] == query_total:
            self.progress((layer_idx + 1) / self.layers, f"layer {layer_idx + 1} of {self.layers}")


@dataclass(frozen=True)
class AttentionRequest(RunRequest):
    """Attention: sink mass in every layer, every head's matrix of ``layer``, and the attention each token receives
    in ``layer`` (in every layer with ``every_layer``: explicit attention everywhere, slower)."""

    kind: ClassVar[str] = "attention"
    prompt_ids: tuple[int, ...]
    layer: int
    sink_tokens: int
    every_layer: bool = False

    def job(self, loaded: LoadedModel) -> Job[AttentionStats]:
        """One prefill with the page's capture, between the running batch's steps."""
        card = model_card(loaded)
        config = CaptureConfig(sink_tokens=self.sink_tokens, matrices=[(self.layer, h) for h in range(card.q_heads)],
                               matrix_size=MATRIX_SIZE,
                               received_layers=None if self.every_layer else (self.layer,))
        session = PromptSession(loaded, list(self.prompt_ids))
        return Job(functools.partial(_attention_steps, session, config, card.layers), RunSize(len(self.prompt_ids),
                                                                                              loaded.device),
                   self.kind)


def _attention_steps(session: PromptSession, config: CaptureConfig, layers: int,
                     progress: Progress) -> Steps[AttentionStats]:
    yield Stage.PREFILL
    return session.prefill(config, [_LayerProgress(layers, progress)]).stats


@dataclass(frozen=True)
class NeedleRequest(RunRequest):
    """Needle: the depth x length pass-key grid per method."""

    kind: ClassVar[str] = "needle"
    specs: tuple[str, ...]
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    trials: int
    mode: str
    chat: bool
    max_new_tokens: int
    seed: int = 0  # which haystacks (keys); the page keeps the default

    def job(self, loaded: LoadedModel) -> Job[NeedleReport]:
        return needle_job(loaded, list(self.specs), list(self.lengths), list(self.depths), trials=self.trials,
                          seed=self.seed, chat=self.chat, mode=self.mode, max_new_tokens=self.max_new_tokens)


@dataclass(frozen=True)
class TailRequest(RunRequest):
    """Tail risk: the multi-key, multi-value, variable-tracking and instruction tasks per method."""

    kind: ClassVar[str] = "tail"
    specs: tuple[str, ...]
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    hops: tuple[int, ...]
    mode: str
    protect: tuple[str, ...]
    trials: int = 1  # items per cell; the page keeps the defaults
    seed: int = 0

    def job(self, loaded: LoadedModel) -> Job[TailReport]:
        return tail_job(loaded, list(self.specs), list(self.tasks), list(self.lengths), list(self.depths),
                        list(self.hops), trials=self.trials, seed=self.seed, mode=self.mode,
                        protect=list(self.protect))


@dataclass(frozen=True)
class PrefixTurnsRequest(RunRequest):
    """Prefix reuse: each prompt prefilled fresh and through one prefix cache of ``block_tokens``-token blocks."""

    kind: ClassVar[str] = "prefix_turns"
    prompts: tuple[tuple[int, ...], ...]
    labels: tuple[str, ...]
    block_tokens: int
    repeats: int = 1  # time each prefill this many times and keep the best (the CLI's --repeats)

    def job(self, loaded: LoadedModel) -> Job[ReuseReport]:
        return turns_job(loaded, [list(p) for p in self.prompts], list(self.labels), self.block_tokens, self.repeats)


@dataclass(frozen=True)
class PrefixSharingRequest(RunRequest):
    """Prefix reuse: what each eviction method keeps of one preamble for question A and for question B."""

    kind: ClassVar[str] = "prefix_sharing"
    preamble: tuple[int, ...]
    question_a: tuple[int, ...]
    question_b: tuple[int, ...]
    specs: tuple[str, ...]
    max_new_tokens: int

    def job(self, loaded: LoadedModel) -> Job[SharingReport]:
        return sharing_job(loaded, list(self.preamble), list(self.question_a), list(self.question_b),
                           list(self.specs), self.max_new_tokens)


@dataclass(frozen=True)
class ContextCostRequest(RunRequest):
    """Prefix reuse: prefill time and KV bytes of the prompt's first ``length`` tokens, per length."""

    kind: ClassVar[str] = "context_cost"
    tokens: tuple[int, ...]
    lengths: tuple[int, ...]

    def job(self, loaded: LoadedModel) -> Job[list[LengthCost]]:
        return context_cost_job(loaded, list(self.tokens), list(self.lengths))


@dataclass(frozen=True)
class SweepRequest(RunRequest):
    """Trade-offs: every family across its budgets on one workload, with the frontier. ``python -m kvviz sweep``
    builds the same request, so the page and the CLI measure the same thing."""

    kind: ClassVar[str] = "sweep"
    workload: Workload
    specs: tuple[str, ...]
    budgets: tuple[float, ...] = DEFAULT_BUDGETS
    # Where the items are measured: None here; a Ray cluster in shards, each stored as it finishes. Not an input:
    # both give the same report, so the stored result is shared.
    cluster: ClusterConfig | None = field(default=None, compare=False, repr=False)
    worker_model: ModelSource | None = field(default=None, compare=False, repr=False)  # None: the loaded model's name
    block_size: int = DEFAULT_BLOCK_SIZE  # token slots per block of the paged layouts (kvviz.cache.layouts)
    margin: float = DEFAULT_MARGIN  # fixed before the run: an adaptive sweep stops its points on it
    adaptive: Adaptive | None = None  # rounds until decided (None: one look at every item)

    def job(self, loaded: LoadedModel) -> Job[SweepReport]:
        """The sweep runs as a client of the engine, off the model: a thread of its own plans it, waits for its
        measurements and judges them, holding no place in the engine meanwhile. In this process each wave of a
        round's items is a job of its own (:func:`kvviz.comparison.batched.decode_prompts`), admitted beside other
        users' runs as the admission policy says; on a cluster the shards run on Ray workers and nothing waits here
        but the thread."""
        check_sweep(list(self.specs), list(self.budgets), self.workload)
        return Job(functools.partial(_elsewhere_steps, functools.partial(self.measure, loaded)),
                   RunSize(0, loaded.device), self.kind)

    def measure(self, loaded: LoadedModel, progress: Progress, stop: threading.Event) -> SweepReport:
        """The sweep itself, on the thread the engine gave it (``stop``: set when the run is cancelled)."""
        source, store = None, ResultStore.default()
        if self.cluster is not None:
            worker = self.worker_model or ModelSource(loaded.name, weights=loaded.weights)
            source = sharded_rows(self.cluster, worker, self.workload, store, self.block_size, stop)
        return run_sweep(loaded, self.workload, list(self.specs), list(self.budgets), progress, source,
                         margin=self.margin, block_size=self.block_size, adaptive=self.adaptive, store=store)


def _elsewhere_steps(work: Callable[[Progress, threading.Event], T], progress: Progress) -> Steps[T]:
    """A job whose whole work runs off the model: ``work(progress, stop)`` on a thread of its own."""
    return (yield Elsewhere(functools.partial(work, progress)))


@dataclass
class ResultStore:
    """Results on disk, one pickle per request; the oldest files go once the folder exceeds ``max_bytes``.

    Only the server and the warm-up write here (a folder from the server's settings, never from users), so
    unpickling reads nothing a user controls.
    """

    root: Path
    max_bytes: int = 1 << 30
    hits: int = field(default=0, init=False)

    @classmethod
    def default(cls) -> ResultStore:
        """``KVVIZ_RESULTS`` if set, else ``results/`` under kvviz's cache folder (``KVVIZ_CACHE``)."""
        return cls(results_folder())

    def path(self, loaded: ModelKey, request: RunRequest | ShardKey) -> Path:
        identity = (code_fingerprint(), request.kind, loaded.name, str(loaded.device), str(loaded.dtype), request)
        return self.root / request.kind / f"{hashlib.sha256(repr(identity).encode()).hexdigest()}.pkl"

    def load(self, loaded: ModelKey, request: RunRequest | ShardKey) -> Any | None:
        """The stored result, or None (absent, or unreadable: it is then recomputed)."""
        path = self.path(loaded, request)
        try:
            with path.open("rb") as handle:
                result = pickle.load(handle)
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
            return None
        self.hits += 1
        os.utime(path)  # recently used: pruned last
        return result

    def save(self, loaded: ModelKey, request: RunRequest | ShardKey, result: Any) -> None:
        """Write atomically (a reader never sees half a file), then prune the oldest results over the size cap."""
        path = self.path(loaded, request)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as handle:
            pickle.dump(result, handle, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(handle.name, path)
        self._prune()

    def fetch(self, loaded: LoadedModel, request: RunRequest, progress: Progress | None = None) -> Any:
        """The stored result, or compute, store and return it."""
        found = self.load(loaded, request)
        if found is None:
            found = request.run(loaded, progress)
            self.save(loaded, request, found)
        return found

    def _prune(self) -> None:
        files = sorted(self.root.rglob("*.pkl"), key=lambda p: p.stat().st_mtime, reverse=True)
        total = 0
        for path in files:
            total += path.stat().st_size
            if total > self.max_bytes:
                path.unlink(missing_ok=True)

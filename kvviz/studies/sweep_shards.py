"""A sweep cut into shards: groups of items (or prompts), each with every configuration, so a shard still shares its
prefills and decodes its configurations in one batch. Pure bookkeeping, no Ray: which items each shard holds, the
key a finished shard is stored under, and what the run did (workers, shards, reused, seconds).

A shard's key is the sweep's inputs (workload and SPECs) and its items; the result store adds the model, device,
dtype and kvviz's code, so a shard measured once is reused by any later sweep that asks for the same items.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol

from kvviz.cache.layouts import DEFAULT_BLOCK_SIZE
from kvviz.studies.workloads import TaskWorkload, Workload


class ModelKey(Protocol):
    """The model half of a stored shard's key: the workers' :class:`kvviz.runtime.cluster.WorkerIdentity` (a loaded
    model answers the same three), as :class:`kvviz.runs.ResultStore` keys every result."""

    @property
    def name(self) -> str: ...

    @property
    def device(self) -> Any: ...

    @property
    def dtype(self) -> Any: ...


class ShardStore(Protocol):
    """Where finished shards and rounds live (:class:`kvviz.runs.ResultStore`), keyed by the model and the shard."""

    def load(self, model: ModelKey, request: ShardKey) -> Any | None: ...

    def save(self, model: ModelKey, request: ShardKey, result: Any) -> None: ...


@dataclass(frozen=True)
class ShardKey:
    """What a finished shard (or a sweep's round) is stored under (a request for :class:`kvviz.runs.ResultStore`):
    the sweep's workload as :func:`stream_key` gives it, the SPECs it ran (full first) and its item indices."""

    kind: ClassVar[str] = "sweep_shard"
    workload: Workload
    specs: tuple[str, ...]
    items: tuple[int, ...]
    block_size: int = DEFAULT_BLOCK_SIZE  # of the layouts its cells report


def stream_key(workload: Workload) -> Workload:
    """The workload as the store keys a shard or a round: a task's stream without its item count (item i is the same
    item whatever the count), so a sweep asked with a larger cap finds what a smaller one measured."""
    return replace(workload, items=0) if isinstance(workload, TaskWorkload) else workload


def shard_size(items: int, workers: int) -> int:
    """Items per shard: two shards per worker, so a lost worker costs half its share and the last shards balance."""
    return max(1, math.ceil(items / (2 * max(1, workers))))


def cut_shards(items: int, size: int) -> list[tuple[int, ...]]:
    """The item indices of each shard, in order: consecutive runs of ``size`` (the last may be shorter)."""
    if size < 1:
        raise ValueError("a shard holds at least one item")
    return [tuple(range(start, min(start + size, items))) for start in range(0, items, size)]


@dataclass
class ShardRun:
    """How a sharded sweep ran: where, on how many workers, how many shards, how many came from the result store,
    and each shard's seconds on its worker (None: reused)."""

    address: str
    workers: int
    shards: int
    shards_reused: int
    shard_seconds: list[float | None]

    def describe(self) -> str:
        reused = f", {self.shards_reused} reused from the result store" if self.shards_reused else ""
        return (f"{self.shards} shard{'s' if self.shards != 1 else ''} on {self.workers} Ray "
                f"worker{'s' if self.workers != 1 else ''} ({self.address}){reused}")

    def to_json(self) -> dict:
        return {"ray_address": self.address, "workers": self.workers, "shards": self.shards,
                "shards_reused": self.shards_reused,
                "shard_seconds": [None if s is None else round(s, 3) for s in self.shard_seconds]}

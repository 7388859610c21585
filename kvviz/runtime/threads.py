"""Keeping the engine's OpenMP pool the only one: the model loaded on a thread that exits, and the engine's small
kernels on one thread on a small CPU.

Torch runs an elementwise op, a reduction or an attention over more than a few thousand elements, and every matrix
multiply, as an OpenMP parallel region, and GNU libgomp (the PyPI wheels') gives each thread that starts one a pool of
helpers, kept until that thread exits. The engine computes on a thread of its own (:mod:`kvviz.runtime.engine`); once
the live pools hold more threads than the machine has cores, helpers stop spinning between regions and every region
waits for its helper to wake. Loading a model is parallel work (the weights, the row-invariance probe), and the
thread that asks for it (the CLI's main thread, a page's script thread) lives on, so :func:`on_passing_thread` loads
on a thread that exits when the model is ready, taking its pool with it (a sweep scores its rounds on one too, for
the same reason: :mod:`kvviz.studies.sweep_measure`). Measured on the 2-core CPU (2026-12-07): a
forward of two 256-token prompts took 600 ms on the thread that loaded the model, 790 ms on another thread while the
loading thread lived, 610 ms on another once the load ran on a thread that had exited.

Another thread may still start parallel work beside the engine (a page's script thread reducing a large tensor). A
kernel of a few thousand elements then waits several times as long as it computes: a 46K-element add took 8 us on
the pool's own thread, 50-80 us on the engine's beside a second pool, 9 us there on one thread; one decode-step
attention (one query over 260 keys) 46, 119-189 and 62 us. A decode step and a quantizer's fork are thousands of such
kernels and a few small matrix multiplies, so on a CPU of at most :data:`SMALL_CPU_THREADS` threads they run on one
thread; a prefill (matrix multiplies of thousands of rows) keeps every thread. On a larger CPU one thread may cost a
decode step's matrix multiplies more than it saves; that is unmeasured, so nothing changes there. Accelerators are
left alone.

A matrix multiply's last bits may depend on its thread count, so the row-invariance probe
(:mod:`kvviz.runtime.invariance`) checks its row counts under both settings.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

SMALL_CPU_THREADS = 2  # the CPUs where one thread was measured faster for small kernels
T = TypeVar("T")


def small_work_threads(device: str) -> int | None:
    """The thread count for small kernels on ``device``: 1 on a small CPU, None (unchanged) elsewhere."""
    if not device.startswith("cpu") or torch.get_num_threads() > SMALL_CPU_THREADS:
        return None
    return 1


@contextlib.contextmanager
def small_work(device: str) -> Iterator[None]:
    """Inside this block, torch computes on :func:`small_work_threads` threads (a decode step, a fork)."""
    count = small_work_threads(device)
    before = torch.get_num_threads()
    if count is None or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def on_passing_thread(work: Callable[[], T]) -> T:
    """``work``'s result, or its error raised here, computed on a thread that exits when ``work`` returns, so that the
    OpenMP pool its parallel kernels start goes with it (module docstring). The caller waits; a daemon thread, so
    that a load interrupted from the keyboard does not hold the process open."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as error:  # noqa: BLE001 - handed back to the caller's thread and raised there
            outcome.append((False, error))

    thread = threading.Thread(target=run, name="kvviz-load", daemon=True)
    thread.start()
    thread.join()
    succeeded, value = outcome[0]
    if not succeeded:
        raise value
    return value

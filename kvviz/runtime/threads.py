"""The engine's small kernels on one thread, on a small CPU.

Torch runs an elementwise op, a reduction or an attention over more than a few thousand elements as an OpenMP
parallel region. The engine computes on a thread of its own (:mod:`kvviz.runtime.engine`), and the thread that
loaded the model (the CLI's main thread, a page's script thread) keeps an OpenMP pool of its own: with both pools
alive a 2-core CPU has more pool threads than cores, and each region the engine starts waits for its helper to wake.
Measured on the 2-core CPU (2026-12-07, torch's GNU libgomp): a 46K-element add took 8 us from the loading thread and
50-80 us from the engine's, one decode-step attention (one query over 260 keys) 46 us and 119-189 us, and 9 us and
62 us on one thread. A decode step and a quantizer's fork are thousands of such kernels and a few small matrix
multiplies, so on a CPU of at most :data:`SMALL_CPU_THREADS` threads they run on one thread; a prefill (matrix
multiplies of thousands of rows) keeps every thread. On a larger CPU one thread may cost a decode step's matrix
multiplies more than it saves; that is unmeasured, so nothing changes there. Accelerators are left alone.

A matrix multiply's last bits may depend on its thread count, so the row-invariance probe
(:mod:`kvviz.runtime.invariance`) checks its row counts under both settings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

SMALL_CPU_THREADS = 2  # the CPUs where one thread was measured faster for small kernels


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

"""Model work on a thread that ends with it, so a CPU's matrix work keeps both its cores.

Torch's CPU kernels run on OpenMP (GNU libgomp in the PyPI wheels). libgomp gives every thread that starts parallel
work a pool of helper threads of its own, kept until that thread exits, and once the pools of all live threads hold
more threads than the machine has CPUs it stops letting helpers spin between kernels: each kernel then waits for its
helpers to wake. A server whose long-lived workers take turns on the model ends up there after its second run.
Measured on the 2-core CPU (a 1K comparison of six configurations, 16 tokens): 5.8-6.5 s on two cores on threads that
each exit after their run, 9.5 s on 1.3 cores on the same kind of thread while another thread that had computed
stayed alive; in the served app (sampled with py-spy) a 2K upload's comparison took 17.1 s on 1.7 cores on the
server's first worker and 19.9-20.6 s on 1.1 cores on the later ones.

So a run that uses the model gets a thread of its own that exits when the run ends (:func:`on_own_thread`): between
runs no thread holds a pool, and one run at a time computes on both cores. Runs that decode together still each have
a thread (the running batch needs them), and while they overlap the helpers do not spin.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_own_thread(work: Callable[[], T], name: str) -> T:
    """Run ``work`` on a new thread and wait for it: its result, or its exception raised here. The thread (and the
    OpenMP pool it made) is gone when this returns."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["result"] = work()
        except BaseException as error:  # noqa: BLE001 - handed to the caller, whatever it is
            outcome["error"] = error

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["result"]  # type: ignore[return-value]

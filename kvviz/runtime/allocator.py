"""Freed memory shared between threads and kept for the next run: a server runs each user's run on its own thread.

glibc's malloc gives every thread that allocates an arena of its own (up to eight per core) and keeps what a run
freed there for that thread's next allocation. Torch's CPU tensors come from malloc, so a server whose runs each
took a thread holds several threads' peaks at once. Two arenas share what was freed; the threads take turns on the
model anyway. Measured on the 2-core CPU: four 2K-token comparisons of six configurations on four threads left
5.5 GB resident one at a time and 8.5 GB decoding together; with two arenas 4.1 and 7.1 GB, as fast.

glibc fixes its arena cap when a process makes its ninth arena. A Streamlit server has made more (its own threads,
torch's, the tokenizer's) by the time a page loads the model, so there :func:`reuse_freed_memory` comes too late for
the cap and each run's new thread took a new arena, up to sixteen on two cores: every run faulted in about 1 GB of
fresh pages (malloc_stats through gdb). A server therefore starts with :data:`ENVIRONMENT` (``make run``, the
container's entry point and the bench's served app do); the other settings take effect whenever they are set.

By default glibc also hands memory back to the kernel as soon as a thread's arena has a 64 MB heap with nothing in
it, and the next run takes it again, each 4 KB page zeroed at first touch. A served 2K comparison unmapped 0.5-7.6
GB of heaps that way (strace) and paid 2-5 s of kernel time for it on the 2-core VM, where the bench's engine, on
the main thread, paid 0.1 s. So freed heaps stay mapped (a top pad of one heap), the main arena trims only a free
top over 2 GB, and tensors up to 32 MB come from the arenas rather than from mappings of their own: the process
keeps its peak.

One caller undoes that: protobuf's C extension (upb, which every message Streamlit sends goes through) calls
``malloc_trim(0)`` on every 10,000th block it frees, and that hands every free page of every arena back whatever the
settings (a gdb breakpoint caught it in the server; strace saw 1.7 GB handed back between two runs, and the next run
faulted 250 thousand pages again). A server runs protobuf's pure-Python implementation instead (:data:`ENVIRONMENT`):
0.04 ms to serialize a message against 0.005 ms, a few milliseconds a page.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

# mallopt's parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

ARENAS = 2
HEAP = 64 << 20  # a thread arena's heap (glibc's HEAP_MAX_SIZE on 64-bit)
SETTINGS = {
    M_ARENA_MAX: ARENAS,
    M_TOP_PAD: HEAP,  # a heap emptied by a free stays mapped for the next allocation
    M_TRIM_THRESHOLD: 2**31 - 1,  # the main arena gives back only a free top over 2 GB
    M_MMAP_THRESHOLD: HEAP // 2,  # glibc's largest: a tensor up to 32 MB reuses arena memory
}
# A server's, from its start: glibc reads the cap before any thread, protobuf picks its implementation on import.
ENVIRONMENT = {"MALLOC_ARENA_MAX": str(ARENAS), "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
_done = threading.Event()


def reuse_freed_memory() -> bool:
    """Set glibc's malloc (once per process) to share freed memory between threads and keep it for the next run;
    False where the C library is not glibc."""
    if _done.is_set():
        return True
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None or not all(mallopt(parameter, value) for parameter, value in SETTINGS.items()):
        return False
    _done.set()
    return True

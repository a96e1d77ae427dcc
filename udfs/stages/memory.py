"""Giving a process's freed memory back to the system: the C heap's free pages (glibc's
``malloc_trim``) and Arrow's pool, between the blocks or tasks a long-lived worker runs."""

from __future__ import annotations

import threading
import time

import pyarrow as pa


# Seconds between two trims of the C heap in a process (see release_free_memory)
TRIM_EVERY_S = 30.0
_trim_lock = threading.Lock()
_trimmed_at: float | None = None


def release_free_memory() -> None:
    """Give the C heap's free pages back to the system, at most once every TRIM_EVERY_S
    seconds. glibc keeps what a block's requests, tensors and Arrow buffers freed, and over a
    long job that grew the engine's actor block by block while bare vLLM stayed flat;
    trimmed now and then it levels off. Not after every block: a trim also hands back the
    pages the engine reuses for each step's activations, which then fault in again
    (docs/benchmarks.md: the cost on a prefill-heavy job).
    A no-op where the C library is not glibc."""
    global _trimmed_at
    if _malloc_trim is None:
        return
    with _trim_lock:
        now = time.monotonic()
        if _trimmed_at is not None and now - _trimmed_at < TRIM_EVERY_S:
            return
        _trimmed_at = now
    _malloc_trim(0)


def trim_heap() -> None:
    """Give the C heap's free pages back to the system now (glibc), whatever the time."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def release_memory() -> None:
    """A worker that runs large tasks one after another (reading a unit of photos, compacting
    a group): the pages one took go back to the system once it is done, rather than stay
    with the allocators (Arrow's pool, glibc's heap) until the next."""
    pa.default_memory_pool().release_unused()
    trim_heap()


def _find_malloc_trim():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _find_malloc_trim()

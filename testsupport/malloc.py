"""glibc malloc tuning, for benchmarks and programs that allocate large blocks over and over.

Not part of the library: carraystore's remote reads land in reused receive buffers
(:mod:`carraystore.sources.buffers`) and do not need it. The remote-node benchmark compares runs
with and without it (:data:`TUNED_MALLOC_ENV`), and a test checks that it works.
"""

from __future__ import annotations

import os

__all__ = ["tune_malloc", "TUNED_MALLOC_ENV"]

#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: what :func:`tune_malloc` sets, as the environment variables that would set it
TUNED_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def tune_malloc(
    mmap_threshold: int = int(TUNED_MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]),
    trim_threshold: int = int(TUNED_MALLOC_ENV["MALLOC_TRIM_THRESHOLD_"]),
) -> bool:
    """Keep large freed blocks in glibc malloc's heap, for this whole process (opt-in).

    glibc maps each large block (above its mmap threshold) afresh and unmaps it when freed,
    so a program that allocates and frees MB-sized buffers over and over pays page faults
    for each. This raises glibc's mmap threshold and trim threshold, as the environment
    variables ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` would, at the cost of
    freed memory going back to the system less eagerly (up to ``trim_threshold``).
    carraystore's remote reads do not need it: their bodies land in reused buffers
    (:class:`carraystore.sources.buffers.BufferPool`), and in the storage-node benchmark the tuning no longer changed the
    rate (docs/remote.md, "Receive buffers"). Returns False and changes nothing when either
    variable is set (the environment's choice stands: Dask's nanny sets a small trim
    threshold on purpose) or when the C library is not glibc.
    """
    if any(name in os.environ for name in TUNED_MALLOC_ENV):
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(
        mallopt(_M_TRIM_THRESHOLD, int(trim_threshold))
    )

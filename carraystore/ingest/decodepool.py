"""The decoding threads of a local ingest, results in file order, a bounded number in flight.

Threads, not processes: Pillow decodes and resizes with the GIL released, and threads need
no pickling, no start method (no ``if __name__ == "__main__":``) and leave nothing behind.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from carraystore.ingest.images import DecodeOptions, decode_files

__all__ = ["decoded"]

#: Files per task sent to a decoding thread.
_FILES_PER_TASK = 16


def decoded(
    root: Path, rels: list[str], opts: DecodeOptions, workers: int
) -> Iterator[tuple[str, np.ndarray | None, str | None]]:
    """Yield (rel, array or None, error or None) in the order of ``rels``; memory bounded."""
    tasks = [rels[i : i + _FILES_PER_TASK] for i in range(0, len(rels), _FILES_PER_TASK)]
    if workers <= 1:
        for t in tasks:
            for rel, (arr, err) in zip(t, decode_files(str(root), t, opts), strict=True):
                yield rel, arr, err
        return
    with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="carraystore-decode") as pool:
        pending: deque[tuple[list[str], cf.Future[list[tuple[np.ndarray | None, str | None]]]]] = deque()
        it = iter(tasks)
        try:
            for t in it:
                pending.append((t, pool.submit(decode_files, str(root), t, opts)))
                if len(pending) >= 3 * workers:
                    break
            while pending:
                t, fut = pending.popleft()
                nxt = next(it, None)
                if nxt is not None:
                    pending.append((nxt, pool.submit(decode_files, str(root), nxt, opts)))
                for rel, (arr, err) in zip(t, fut.result(), strict=True):
                    yield rel, arr, err
        finally:
            for _, fut in pending:
                fut.cancel()

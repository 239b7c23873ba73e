"""The decoding threads of a local ingest.

:func:`decoded` hands groups of files to ``workers`` threads and yields the results in
file order with a bounded number of groups in flight. Pillow decodes and resizes JPEG,
PNG and the other formats with the GIL released, so threads use every core as processes
did, without their start-up, without pickling every decoded image back, and without a
start method: an ingest runs from a plain script (no ``if __name__ == "__main__":``), and
a killed ingest leaves no decoding process behind because there is none.
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

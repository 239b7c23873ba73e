"""The ingest runner of a ``dask.distributed`` cluster: workers decode and compress whole chunks,
this process places them in order; the same bytes as a local ingest. dask itself is never imported.
"""

from __future__ import annotations

import os
import secrets
from collections import deque
from collections.abc import Callable, Generator, Iterable
from typing import Any

import numpy as np

from carraystore.base.errors import CarrayStoreError, IngestError
from carraystore.ingest.badfiles import shape_error
from carraystore.ingest.images import MODES, DecodeOptions, decode_files
from carraystore.ingest.job import IngestResult, StoreJob
from carraystore.store.chunks import compress_chunk

__all__ = ["in_order", "run_on_cluster"]


def in_order(client: Any, submits: Iterable[Callable[[], Any]], window: int) -> Generator[Any, None, None]:
    """Results of futures in submission order, with at most ``window`` futures alive at a time.

    ``submits`` yields callables that submit work to ``client`` and return a future (or a list
    of them); it is pulled lazily, so it can plan from the results so far. Results are fetched
    one at a time, in order, each future released once taken. On an error the remaining work
    is cancelled.
    """
    window = max(1, int(window))
    it = iter(submits)
    alive: deque[Any] = deque()

    def fill() -> None:
        while len(alive) < window:
            make = next(it, None)
            if make is None:
                return
            got = make()
            alive.extend(got if isinstance(got, list) else [got])

    try:
        fill()
        while alive:
            fut = alive.popleft()
            value = fut.result()
            fut.release()
            yield value
            fill()  # after the consumer has seen the value: it may steer the next submission
    finally:
        if alive:
            client.cancel(list(alive))


def _chunk_task(
    root: str, rels: list[str], opts: DecodeOptions, shape: tuple[int, ...], first_rel: str, meta: Any
) -> tuple[bytes, int, int, list[tuple[int, str]]]:
    """On a worker, one planned chunk: (compressed good images, their number, CRC32, [(index, reason)])."""
    good: list[np.ndarray] = []
    errors: list[tuple[int, str]] = []
    for j, (arr, err) in enumerate(decode_files(root, rels, opts)):
        err = err or shape_error(arr, shape, first_rel)
        if err is None and arr is not None:
            good.append(arr)
        else:
            errors.append((j, err or "not decoded"))
    items = np.stack(good) if good else np.zeros((0, *shape), dtype=meta.np_dtype)
    data, crc = compress_chunk(meta, items)
    return data, len(good), crc, errors


def run_on_cluster(client: Any, job: StoreJob) -> IngestResult:
    """An ingest runner (``job.Runner``, via ``functools.partial``): ``run.run_locally`` decoding on a cluster.

    This process fixes the item shape and plans each chunk's files; workers decode and
    compress whole chunks; this process places them in order with keys and labels, handling
    bad files as locally. A short chunk (bad files) shifts the next task's files so later
    chunks line up; chunks already under way are decompressed and appended here.
    """
    import blosc2

    stored, opts, bad = job.plan, job.opts, job.bad
    root, rels, labels = stored.root, stored.rels, stored.labels
    sees = client.run(os.path.isdir, str(root))
    if not sees:  # the tasks would wait for a worker for ever
        raise IngestError(
            f"{root}: the dask cluster at {client.scheduler.address} has no workers; start workers "
            "(`dask worker ADDRESS`) or ingest without --dask-scheduler / client"
        )
    blind = sorted(w for w, ok in sees.items() if not ok)
    if blind:
        raise IngestError(
            f"{root}: worker(s) {', '.join(blind)} cannot see this folder; a distributed ingest reads the files "
            "on the workers, so the folder must be at the same path on every worker (a shared file system)"
        )
    _, channels = MODES[opts.color_mode]
    first_rel = ""
    begin = 0  # the files before the first one that decodes are bad: handled here, not sent out
    if opts.image_size is not None:
        shape: tuple[int, ...] = (*opts.image_size, channels)
    else:  # the first image that decodes fixes the shape, as in the local ingest
        for begin, rel in enumerate(rels):
            arr, err = decode_files(str(root), [rel], opts)[0]
            if err is None and arr is not None:
                shape, first_rel = arr.shape, rel
                break
            bad.add(begin, rel, err or "not decoded", None, "")
        else:
            raise bad.none_decoded()
    writer = job.open_writer(shape)  # as the local ingest: the same bytes
    meta = writer.meta
    k = meta.chunk_images
    window = max(4, 2 * sum(client.nthreads().values()))
    groups: list[tuple[int, int]] = []  # the planned (start, stop) file range of every task, in order
    bad_seen = [begin]  # bad files among the groups already placed (and before them)
    tag = f"carraystore-ingest-{secrets.token_hex(4)}"

    def plan() -> Any:
        pos = begin
        while pos < len(rels):
            # images before `pos` if every file in flight decodes; fill up to the next chunk boundary
            size = k - (pos - bad_seen[0]) % k
            start, pos = pos, min(pos + size, len(rels))
            groups.append((start, pos))
            yield lambda a=start, b=pos: client.submit(
                _chunk_task, str(root), rels[a:b], opts, shape, first_rel, meta, key=f"{tag}-{a}-{b}"
            )

    results = in_order(client, plan(), window)
    bar = None
    try:
        bar = job.progress_bar(initial=begin)
        for g in range(len(rels)):  # at most one task per file; the plan ends the loop
            try:
                data, ngood, crc, errors = next(results)
            except StopIteration:
                break
            except CarrayStoreError:
                raise
            except Exception as exc:  # the cluster gave up on a task (e.g. it killed several workers)
                start, stop = groups[g]
                raise IngestError(
                    f"{root}: the cluster could not decode the chunk of files {rels[start]} .. {rels[stop - 1]} "
                    f"({type(exc).__name__}: {exc}); ingest those files locally to find the one at fault"
                ) from exc
            start, stop = groups[g]
            for j, err in errors:
                bad.add(start + j, rels[start + j], err, shape, first_rel)
            bad_seen[0] += len(errors)
            failed = {j for j, _ in errors}
            idx = [i for i in range(start, stop) if i - start not in failed]
            lab = labels[idx] if labels is not None else None
            keys = [rels[i] for i in idx]
            grp = [stored.groups[i] for i in idx] if stored.groups is not None else None
            if ngood and writer.nimages % k == 0:
                writer.append_compressed_chunk(
                    data, ngood, crc, labels=lab, keys=keys, columns=stored.columns_for(keys), groups=grp
                )
            elif ngood:  # a chunk planned before an earlier bad file shifted the boundaries
                items = np.frombuffer(blosc2.decompress2(data), dtype=meta.np_dtype).reshape(k, *shape)[:ngood]
                writer.append(items, labels=lab, keys=keys, columns=stored.columns_for(keys), groups=grp)
            if bar is not None:
                bar.update(stop - start)
        for rel, reason in bad.skipped:
            writer.add_skipped(rel, reason)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        results.close()  # cancels the tasks still under way, now rather than at garbage collection
        if bar is not None:
            bar.close()
    return job.result(writer, shape)

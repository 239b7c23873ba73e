"""Stores as dask arrays and dask arrays as stores (an adapter; see docs/dask.md).

- :func:`to_dask`, :func:`labels`, :func:`fields`, :func:`targets`: the read-only view,
  defined in :mod:`carraystore.api.daskview` and re-exported here.
- :func:`from_dask`: writes a dask array into a store. Every chunk is compressed where it
  is computed (on the workers); only compressed bytes and their CRC32 travel to the one
  writer, which places them in order through a bounded window, so its memory stays a few
  chunks whatever the array's size.
- :func:`from_directory`: a folder of images ingested on a ``dask.distributed`` cluster
  (workers decode and compress whole chunks; the same store as a local ingest).
- :func:`in_order`: that bounded, ordered window over ``dask.distributed`` futures, used by
  ``from_dask`` and ``from_directory``.

Needs the ``dask`` extra: ``pip install 'carraystore[dask]'``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
from collections import deque
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from carraystore.api.daskview import Labels, fields, labels, targets, to_dask
from carraystore.api.store import Store, open_store
from carraystore.base.errors import (
    CarrayStoreError,
    IngestError,
    InvalidInputError,
    MissingDependencyError,
)
from carraystore.format.record import StoreMeta
from carraystore.ingest.badfiles import shape_error
from carraystore.ingest.images import MODES, DecodeOptions, decode_files
from carraystore.ingest.run import IngestResult, StoreJob
from carraystore.ingest.run import from_directory as ingest_directory
from carraystore.store.options import WriteKwargs, WriteOptions
from carraystore.store.writer import compress_chunk, create

if TYPE_CHECKING:
    from typing_extensions import Unpack

try:
    import dask.array as da
    from dask.base import compute as _dask_compute
    from dask.delayed import delayed as _dask_delayed
except ImportError as exc:  # pragma: no cover - the dask extra is not installed
    raise MissingDependencyError("carraystore.dask needs dask: pip install 'carraystore[dask]'") from exc

# dask's functions carry no annotations: they are called here through these typed names
_asarray: Callable[..., Any] = da.asarray
_compute: Callable[..., tuple[Any, ...]] = _dask_compute
_delayed: Callable[..., Any] = _dask_delayed

__all__ = ["to_dask", "labels", "Labels", "fields", "targets", "from_dask", "from_directory", "in_order"]


def default_client() -> Any | None:
    """The current ``dask.distributed`` client, or None (no client, or distributed not installed)."""
    try:
        from distributed import default_client as _default_client
    except ImportError:  # pragma: no cover - distributed is part of the dask extra
        return None
    current: Callable[[], Any] = _default_client  # distributed carries no annotations
    try:
        return current()
    except ValueError:
        return None


def in_order(client: Any, submits: Iterable[Callable[[], Any]], window: int) -> Generator[Any, None, None]:
    """Results of futures in submission order, with at most ``window`` futures alive at a time.

    ``submits`` yields callables that each submit work to ``client`` and return its future
    (or a list of futures, e.g. ``client.compute`` of several tasks sharing inputs). It is
    pulled lazily, whenever fewer than ``window`` futures are alive, so that it can plan the
    next task from the results yielded so far. Results are fetched one at a time, in order:
    those that finish early wait on the workers, so this process holds one result at a time.
    Each future is released once its result is taken; a worker lost midway is handled by
    the scheduler (its tasks run again elsewhere). On an error the remaining work is cancelled.
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


# -- folders of images ingested on a cluster ----------------------------------------------------


def from_directory(
    directory: str | os.PathLike[str], output: str | os.PathLike[str], *, client: Any, **options: Any
) -> IngestResult | dict[str, IngestResult]:
    """``carraystore.ingest.run.from_directory`` with the decoding on a ``dask.distributed`` cluster.

    ``client`` is a ``dask.distributed.Client``; every other argument is the local
    ingest's (``workers`` is unused). The store is byte for byte the one a local ingest
    writes (docs/dask.md). The workers read the files at the same path, so ``directory``
    must be on a file system they all see. ``carraystore.from_directory(..., client=)``
    and ``carraystore ingest --dask-scheduler`` call this.
    """
    if client is None:
        raise InvalidInputError(
            "client must be a dask.distributed Client; without one, ingest locally with carraystore.from_directory"
        )
    return ingest_directory(directory, output, runner=functools.partial(_ingest_on_cluster, client), **options)


def _chunk_task(
    root: str, rels: list[str], opts: DecodeOptions, shape: tuple[int, ...], first_rel: str, meta: Any
) -> tuple[bytes, int, int, list[tuple[int, str]]]:
    """On a cluster worker: decode the files of one planned chunk exactly as a local ingest
    does (``images.decode_files``, ``badfiles.shape_error``) and compress the good ones as one store chunk.

    Returns (compressed chunk, number of good images, CRC32, [(index in ``rels``, reason)]).
    """
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


def _ingest_on_cluster(client: Any, job: StoreJob) -> IngestResult:
    """An ingest runner (``ingest.Runner``): ``ingest.run_locally`` with the decoding on a
    dask.distributed cluster (same order, same bytes).

    This process plans: the item shape (``image_size``, or the first file that decodes, as
    locally; the files before it are bad ones, handled here), then the files of each chunk.
    Workers decode, resize and compress whole chunks (``_chunk_task``); this process places
    them in order (:func:`in_order`, a bounded window) with the keys and labels it already
    knows, and treats bad files as the local ingest does (``badfiles.BadFiles``: the same
    ``on_error``, ``max_skipped`` and messages). A chunk with bad files comes back short: the
    plan then gives the next task fewer files so that later chunks line up again, and chunks
    already under way are decompressed and appended here (same bytes).
    """
    import blosc2

    root, rels, labels, opts, bad = job.root, job.rels, job.labels, job.opts, job.bad
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
            grp = [job.groups[i] for i in idx] if job.groups is not None else None
            if ngood and writer.nimages % k == 0:
                writer.append_compressed_chunk(
                    data, ngood, crc, labels=lab, keys=keys, columns=job.columns_for(keys), groups=grp
                )
            elif ngood:  # a chunk planned before an earlier bad file shifted the boundaries
                items = np.frombuffer(blosc2.decompress2(data), dtype=meta.np_dtype).reshape(k, *shape)[:ngood]
                writer.append(items, labels=lab, keys=keys, columns=job.columns_for(keys), groups=grp)
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


# -- dask arrays as stores -------------------------------------------------------------------


def _local(a: Any) -> Any:
    """A dask array computed into this process; anything else as it is."""
    return _compute(a)[0] if isinstance(a, da.Array) else a


def _compress_block(block: np.ndarray, meta: StoreMeta) -> tuple[bytes, int, int]:
    """On a worker: one store chunk of items -> (compressed bytes, item count, CRC32)."""
    data, crc = compress_chunk(meta, np.ascontiguousarray(block))
    return data, len(block), crc


def from_dask(
    x: Any,
    path_or_url: str | os.PathLike[str],
    labels: Sequence[int] | np.ndarray | Any | None = None,
    keys: Sequence[str] | np.ndarray | Any | None = None,
    *,
    window: int | None = None,
    fields: dict[str, Any] | None = None,
    options: WriteOptions | None = None,
    **write: Unpack[WriteKwargs],
) -> Store:
    """Write a dask array (N, *item_shape) into a new store at ``path_or_url``; return it opened.

    The write options (codec, chunk_images, class_names, attrs, overwrite, lock_timeout,
    storage_options, tmp_dir) come as keywords or in ``options`` (a WriteOptions).

    Any shape and dtype a store takes: images (N, H, W, C) uint8, or other items (model
    outputs, features: ``layout="array"``). The array is rechunked along axis 0 to the
    store's chunk size (``chunk_images``, default about 4 MiB per chunk) and whole along the
    other axes. Each chunk is compressed where it is computed; the writer (this process)
    receives only compressed chunks and their CRCs, in order, one at a time; at most
    ``window`` chunks are under way (default: 8 per cluster thread, at least 32). With a
    ``dask.distributed`` client that is the cluster; otherwise dask's current scheduler
    computes batches of ``window // 2`` chunks in this process. ``labels`` (numpy or dask,
    one integer per item) and ``keys`` (strings; a list, numpy or dask array) are optional; ``class_names``
    defaults to the names ``labels`` carries (``labels(path)`` of a store);
    ``fields`` (name -> numpy or dask array of N rows: regression targets, boxes, weights)
    become the store's per-sample fields (``store.columns``, docs/targets.md). Atomic: the store appears
    only when complete. ``lock_timeout``: seconds to wait while another writer holds ``path``
    (None: for ever), then :class:`~carraystore.base.errors.StoreLockedError`. A URL
    (``s3://bucket/out.b2nd``, with ``storage_options``) is written in a staging file under
    ``tmp_dir`` (default ``TMPDIR``) and uploaded when complete, as ``carraystore.create`` does.
    """
    opts = WriteOptions.merged(options, str(path_or_url), **write)
    carried = getattr(labels, "class_names", None)  # Labels of a store carry their names
    if opts.class_names is None and carried is not None:
        opts = opts.replace(class_names=carried)
    x = x if isinstance(x, da.Array) else _asarray(x)
    if x.ndim < 1:
        raise InvalidInputError(f"from_dask needs an array of items (N, ...), got a {x.ndim}-d array")
    if any(np.isnan(c) for c in x.chunks[0]):
        raise InvalidInputError("the array's chunk sizes along axis 0 are unknown; call x.compute_chunk_sizes() first")
    n = int(x.shape[0])
    lab = None
    if labels is not None:
        lab = np.asarray(_local(labels))
        if lab.shape != (n,):
            raise InvalidInputError(f"{path_or_url}: {lab.shape} labels for {n} items; give one integer label per item")
    keylist = None
    if keys is not None:
        keylist = [str(k) for k in _local(keys)]
        if len(keylist) != n:
            raise InvalidInputError(f"{path_or_url}: {len(keylist)} keys for {n} items; give one key per item")
    cols = {name: np.asarray(_local(a)) for name, a in (fields or {}).items()}
    provenance = {"source_kind": "dask_array", "source": f"dask array {x.dtype}{tuple(x.shape)}"}
    with create(
        path_or_url,
        x.shape[1:],
        dtype=x.dtype,
        provenance=provenance,
        nthreads=1,  # the short last chunk is compressed here: one thread, the same bytes as compress_chunk
        options=opts,
    ) as writer:
        meta = writer.meta
        k = meta.chunk_images
        # every label and key is checked now, not when its chunk arrives after the compute
        if lab is not None:
            lab = writer._check_labels(lab, n)
        if keylist is not None:
            writer._check_keys(keylist, n)
        cols = writer._check_columns(cols, n)
        if n:
            want = {0: k, **{i: -1 for i in range(1, x.ndim)}}
            if (
                x.chunks[0][:-1] != (k,) * (len(x.chunks[0]) - 1)
                or not 0 < x.chunks[0][-1] <= k
                or any(len(c) > 1 for c in x.chunks[1:])
            ):
                x = x.rechunk(want)
            blocks = x.to_delayed(optimize_graph=True).reshape(-1)
            # meta rides in the function: dask.delayed would walk the dataclass for every task
            compress = _delayed(functools.partial(_compress_block, meta=meta), pure=True)
            tasks = [compress(b) for b in blocks]
            with contextlib.closing(_compute_in_order(tasks, window)) as results:  # cancels what is left on an error
                for i, (data, count, crc) in enumerate(results):
                    sl = slice(i * k, i * k + count)
                    writer.append_compressed_chunk(
                        data,
                        count,
                        crc,
                        labels=lab[sl] if lab is not None else None,
                        keys=keylist[sl] if keylist is not None else None,
                        columns={name: a[sl] for name, a in cols.items()} or None,
                    )
        elif lab is not None or keylist is not None or cols:
            writer.append(
                np.empty((0, *meta.image_shape), dtype=meta.np_dtype), labels=lab, keys=keylist, columns=cols or None
            )
    return open_store(path_or_url, opts.storage_options)


def _compute_in_order(tasks: list[Any], window: int | None) -> Generator[Any, None, None]:
    """Compute delayed tasks, yielding results in order.

    Tasks go to the scheduler in batches (one graph each, so that chunks sharing an input
    block, as after a rechunk, compute it once), at most two batches at a time. With a
    distributed client the results wait on the workers and this process fetches one at a
    time; with another scheduler a batch's results (compressed chunks) are held here.
    """
    client = default_client()
    nthreads = sum(client.nthreads().values()) if client is not None else (os.cpu_count() or 1)
    if client is not None and not nthreads:  # the tasks would wait for a worker for ever
        raise InvalidInputError(
            f"the dask cluster at {client.scheduler.address} has no workers; start workers (`dask worker ADDRESS`) "
            "or compute without a client"
        )
    batch = max(1, window // 2) if window else max(16, 4 * nthreads)
    batches = [tasks[i : i + batch] for i in range(0, len(tasks), batch)]
    if client is not None:
        yield from in_order(client, (functools.partial(client.compute, b) for b in batches), 2 * batch)
        return
    for b in batches:
        yield from _compute(*b)

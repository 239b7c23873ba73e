"""Stores as dask arrays and dask arrays as stores (an adapter; see docs/dask.md).

- :func:`to_dask`, :func:`labels`, :func:`fields`, :func:`targets`: the read-only view,
  defined in :mod:`carraystore.api.daskview` and re-exported here.
- :func:`from_dask`: writes a dask array into a store. Every chunk is compressed where it
  is computed (on the workers); only compressed bytes and their CRC32 travel to the one
  writer, which places them in order through a bounded window, so its memory stays a few
  chunks whatever the array's size.
- :func:`from_directory`: a folder of images ingested on a ``dask.distributed`` cluster
  (workers decode and compress whole chunks; the same store as a local ingest;
  :mod:`carraystore.ingest.cluster`).
- :func:`in_order`: a bounded, ordered window over ``dask.distributed`` futures, used by
  ``from_dask`` and the cluster ingest.

Needs the ``dask`` extra: ``pip install 'carraystore[dask]'``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from carraystore.api.daskview import Labels, fields, labels, targets, to_dask
from carraystore.api.store import Store, open_store
from carraystore.base.errors import InvalidInputError, MissingDependencyError
from carraystore.format.record import StoreMeta
from carraystore.ingest.cluster import in_order
from carraystore.ingest.job import IngestResult
from carraystore.ingest.run import from_directory as ingest_directory
from carraystore.store.chunks import compress_chunk
from carraystore.store.options import WriteKwargs, WriteOptions
from carraystore.store.writer import create

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


# -- folders of images ingested on a cluster ----------------------------------------------------


def from_directory(
    directory: str | os.PathLike[str], output: str | os.PathLike[str], *, client: Any, **options: Any
) -> IngestResult | dict[str, IngestResult]:
    """``carraystore.from_directory`` with the decoding on the ``dask.distributed`` cluster of ``client``.

    Every other argument is the local ingest's (``workers`` is unused); the store is byte for
    byte the one a local ingest writes (docs/dask.md).
    """
    if client is None:
        raise InvalidInputError(
            "client must be a dask.distributed Client; without one, ingest locally with carraystore.from_directory"
        )
    return ingest_directory(directory, output, client=client, **options)


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
        # every label, key and field is checked now, not when its chunk arrives after the compute
        checked = writer.check_items(n, lab, keylist, cols)
        lab, cols = checked.labels, checked.columns
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

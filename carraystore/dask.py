"""Stores as dask arrays and dask arrays as stores (docs/dask.md; ``pip install 'carraystore[dask]'``).

- :func:`to_dask`, :func:`labels`, :func:`fields`, :func:`targets`: the read-only view
  (:mod:`carraystore.api.daskview`).
- :func:`from_dask`: a dask array written into a store, each chunk compressed on the workers.
- :func:`from_directory`: a folder of images ingested on a ``dask.distributed`` cluster.
- :func:`in_order`: a bounded, ordered window over ``dask.distributed`` futures.
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


def from_directory(
    directory: str | os.PathLike[str], output: str | os.PathLike[str], *, client: Any, **options: Any
) -> IngestResult | dict[str, IngestResult]:
    """``carraystore.from_directory`` decoding on ``client``'s cluster (``workers`` unused); the same bytes."""
    if client is None:
        raise InvalidInputError(
            "client must be a dask.distributed Client; without one, ingest locally with carraystore.from_directory"
        )
    return ingest_directory(directory, output, client=client, **options)


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

    Write options as keywords or ``options`` (a WriteOptions). Images (N, H, W, C) uint8 or other
    items (``layout="array"``), rechunked along axis 0 to ``chunk_images``. Chunks are compressed
    where computed; the writer receives compressed chunks and CRCs in order, at most ``window``
    under way (default: 8 per cluster thread, at least 32). Optional ``labels`` (``class_names``
    defaults to the names they carry), ``keys`` and ``fields`` (docs/targets.md), numpy or dask.
    Atomic: the store appears only when complete. ``lock_timeout``: seconds to wait for another
    writer (None: for ever), then :class:`~carraystore.base.errors.StoreLockedError`.
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
    """Compute delayed tasks in batches (one graph each, at most two at a time), yielding results in order."""
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

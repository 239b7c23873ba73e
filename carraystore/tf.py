"""tf.data: a store as a ``tf.data.Dataset`` of batches.

    from carraystore.tf import to_dataset
    ds = to_dataset("train.b2nd", 32, transform=lambda x, y: (x.astype("float32") / 255, y))
    model.fit(ds, epochs=10)

Each full pass over the dataset is one epoch of :func:`carraystore.loader.batches`: the
first pass uses ``epoch``, the next ``epoch + 1``, and so on (``model.fit`` and
``ds.repeat()`` both start a new pass), so every pass has a new order. For
``tf.distribute``, use :func:`distribute` (or ``strategy.distribute_datasets_from_function``
with ``rank=ctx.input_pipeline_id, world_size=ctx.num_input_pipelines``).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from carraystore.errors import InvalidInputError, MissingDependencyError
from carraystore.engine import LoaderOptions, LoaderSpec, make_spec
from carraystore.loader import iterate

try:
    import tensorflow as tf
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingDependencyError("carraystore.tf needs TensorFlow: pip install 'carraystore[tf]'") from exc

__all__ = ["to_dataset", "distribute", "element_spec_for"]


def _tensor_spec(shape: tuple[Any, ...], dtype: np.dtype, what: str) -> Any:
    dtype = np.dtype(dtype)
    if dtype.fields is not None or dtype.kind not in "biuf":
        raise InvalidInputError(f"{what} has dtype {dtype}, which tf.data cannot carry; give output_signature= and a transform")
    return tf.TensorSpec(shape=shape, dtype=tf.as_dtype(dtype))


def element_spec_for(spec: LoaderSpec) -> Any:
    """The ``tf.TensorSpec`` (or pair of them) of the batches ``spec`` yields."""
    b = spec.batch_size if spec.drop_remainder else None
    if spec.transform is not None:
        # run the transform once on a zero batch to see what it returns
        x0 = np.zeros(spec.x_shape(1), dtype=spec.store.dtype)
        y0 = spec.labels_for(np.zeros(1, dtype=np.int64)) if spec.labelled else None
        try:
            x1, y1 = spec.transform(x0, y0)
        except Exception as exc:
            raise InvalidInputError(
                f"could not work out the element spec by running the transform on a zero batch ({exc}); "
                "pass output_signature= to to_dataset"
            ) from exc
        xs = _tensor_spec((b, *np.shape(x1)[1:]), np.asarray(x1).dtype, "the transform's x")
        if y1 is None:
            return xs
        return xs, _tensor_spec((b, *np.shape(y1)[1:]), np.asarray(y1).dtype, "the transform's y")
    xs = _tensor_spec((b, *spec.x_shape(1)[1:]), spec.store.dtype, str(spec.store.path))
    if not spec.labelled:
        return xs
    return xs, tf.TensorSpec(shape=spec.y_shape(b), dtype=tf.as_dtype(spec.y_dtype))


class _Passes:
    """Hands out (epoch, start_batch) for each pass over the dataset."""

    def __init__(self, epoch: int, start_batch: int) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._epoch = epoch
        self._start = start_batch

    def take(self) -> tuple[int, int]:
        with self._lock:
            k = self._next
            self._next += 1
        return self._epoch + k, self._start if k == 0 else 0


def to_dataset(
    store_or_path: Any,
    batch_size: int,
    options: LoaderOptions | None = None,
    *,
    output_signature: Any = None,
    **kwargs: Any,
) -> Any:
    """A ``tf.data.Dataset`` of (x, y) batches (x alone for unlabelled stores).

    ``kwargs`` are :func:`carraystore.loader.batches` arguments (``shuffle``, ``seed``,
    ``window``, ``rank``, ``world_size``, ``drop_remainder``, ``transform``,
    ``label_mode``, ``sequence_length``, ...). The batch dimension is ``None``, or
    ``batch_size`` with ``drop_remainder=True``. ``start_batch`` applies to the first
    pass only (resuming). ``prefetch`` is in chunks, as for ``batches``; batches are
    also prefetched with ``tf.data.AUTOTUNE``. ``output_signature`` overrides the
    element spec worked out from the store (and the transform, run once on zeros).
    """
    spec = make_spec(store_or_path, batch_size, options, **kwargs)
    epoch, start_batch = spec.options.epoch, spec.options.start_batch
    nb = spec.num_batches
    if not 0 <= int(start_batch) <= nb:
        raise InvalidInputError(f"start_batch {start_batch} is outside the epoch's {nb} batches")
    sig = output_signature if output_signature is not None else element_spec_for(spec)
    single = not isinstance(sig, tuple)
    passes = _Passes(int(epoch), int(start_batch))

    def generate() -> Any:
        e, sb = passes.take()
        it = iterate(spec, epoch=e, start_batch=sb)
        try:
            for x, y in it:
                yield x if single else (x, y)
        finally:
            it.close()

    ds = tf.data.Dataset.from_generator(generate, output_signature=sig)
    if start_batch == 0:
        ds = ds.apply(tf.data.experimental.assert_cardinality(nb))
    return ds.prefetch(tf.data.AUTOTUNE)


def distribute(strategy: Any, store_or_path: Any, global_batch_size: int, **kwargs: Any) -> Any:
    """``strategy.distribute_datasets_from_function`` over :func:`to_dataset`.

    Each input pipeline reads its own shard (``rank=ctx.input_pipeline_id``,
    ``world_size=ctx.num_input_pipelines``) in per-replica batches.
    """

    def fn(ctx: Any) -> Any:
        return to_dataset(
            store_or_path,
            ctx.get_per_replica_batch_size(global_batch_size),
            rank=ctx.input_pipeline_id,
            world_size=ctx.num_input_pipelines,
            **kwargs,
        )

    return strategy.distribute_datasets_from_function(fn)

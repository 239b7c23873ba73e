"""tf.data: a store as a ``tf.data.Dataset`` of batches.

    ds = to_dataset("train.b2nd", 32, transform=lambda x, y: (x.astype("float32") / 255, y))
    model.fit(ds, epochs=10)

Each pass over the dataset (``fit`` epoch or ``repeat()``) is the next epoch, in a new order.
For ``tf.distribute`` use :func:`distribute` (or ``to_dataset(..., input_context=ctx)``).
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from carraystore.base.atomic import write_text_atomically
from carraystore.base.errors import InvalidInputError, MissingDependencyError
from carraystore.engine.loader import iterate
from carraystore.engine.options import LoaderOptions
from carraystore.engine.spec import LoaderSpec, make_spec

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from carraystore.engine.options import LoaderKwargs

try:
    import tensorflow as tf
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingDependencyError("carraystore.tf needs TensorFlow: pip install 'carraystore[tf]'") from exc

__all__ = ["to_dataset", "distribute", "steps_per_epoch", "element_spec_for", "TrainingPosition"]


def _tensor_spec(shape: tuple[Any, ...], dtype: np.dtype, what: str) -> Any:
    dtype = np.dtype(dtype)
    if dtype.fields is not None or dtype.kind not in "biuf":
        raise InvalidInputError(
            f"{what} has dtype {dtype}, which tf.data cannot carry; give output_signature= and a transform"
        )
    return tf.TensorSpec(shape=shape, dtype=tf.as_dtype(dtype))


def _structure_spec(value: Any, b: int | None, what: str) -> Any:
    """TensorSpecs for an array, or a tuple or dict of arrays (what a transform may return)."""
    if isinstance(value, dict):
        return {k: _structure_spec(v, b, f"{what}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return tuple(_structure_spec(v, b, f"{what}[{i}]") for i, v in enumerate(value))
    return _tensor_spec((b, *np.shape(value)[1:]), np.asarray(value).dtype, what)


def element_spec_for(spec: LoaderSpec) -> Any:
    """The ``tf.TensorSpec`` of x, or the specs of (x, y) / (x, y, w); y's follow ``targets``."""
    b = spec.batch_size if spec.drop_remainder else None
    w = spec.w_signature(b)
    ws = () if w is None else (tf.TensorSpec(shape=w[0], dtype=tf.as_dtype(w[1])),)
    if spec.transform is not None:
        # run the transform once on a zero batch to see what it returns
        x0 = np.zeros(spec.x_shape(1), dtype=spec.store.dtype)
        y0 = spec.y_for(np.zeros(1, dtype=np.int64)) if spec.has_y and len(spec.store) else None
        try:
            x1, y1, *w1 = spec.transform(x0, y0)
        except Exception as exc:
            raise InvalidInputError(
                f"could not work out the element spec by running the transform on a zero batch ({exc}); "
                "pass output_signature= to to_dataset"
            ) from exc
        xs = _tensor_spec((b, *np.shape(x1)[1:]), np.asarray(x1).dtype, "the transform's x")
        if w1:  # the transform's own sample weight
            ws = (_structure_spec(w1[0], b, "the transform's w"),)
        if y1 is None:
            return xs
        return (xs, _structure_spec(y1, b, "the transform's y"), *ws)
    xs = _tensor_spec((b, *spec.x_shape(1)[1:]), spec.store.dtype, str(spec.store.path))
    ysig = spec.y_signature(b)
    if ysig is None:
        return xs
    if isinstance(spec.y_struct, str):
        ys: Any = _tensor_spec(ysig[0], ysig[1], "the target")
    elif isinstance(spec.y_struct, dict):
        ys = {k: _tensor_spec(v[0], v[1], f"target {k!r}") for k, v in ysig.items()}
    else:
        ys = tuple(_tensor_spec(v[0], v[1], "a target") for v in ysig)
    return (xs, ys, *ws)


class _Passes:
    """Hands out the epoch of each pass (a resumed dataset has one epoch).

    Passes count up unless a :class:`TrainingPosition` pins the epoch, so the pass Keras under
    a strategy uses to build the model does not use up an epoch.
    """

    def __init__(self, epoch: int, start_batch: int, resumed: bool, location: str) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._epoch = epoch
        self._start = start_batch
        self._resumed = resumed or bool(start_batch)
        self._location = location
        self._pinned: int | None = None

    def pin(self, epoch: int) -> None:
        """Every pass from now on serves ``epoch``."""
        with self._lock:
            self._pinned = int(epoch)

    def take(self) -> tuple[int, int]:
        with self._lock:
            if self._pinned is not None:
                k = self._pinned - self._epoch
            else:
                k = self._next
                self._next += 1
        if self._resumed and k:
            where = f"at batch {self._start}" if self._start else "from a resume state"
            raise InvalidInputError(
                f"{self._location}: this dataset resumes epoch {self._epoch} {where}, so it holds the "
                f"rest of that epoch only (its cardinality); go on with to_dataset(..., epoch={self._epoch + 1}) "
                f"(with Keras: fit it with initial_epoch={self._epoch}, epochs={self._epoch + 1}, then fit a whole "
                "dataset; under tf.distribute give the fit a carraystore.tf.TrainingPosition of the dataset)"
            )
        return self._epoch + k, self._start if k == 0 else 0


@dataclass
class _Feed:
    """What a dataset of :func:`to_dataset` / :func:`distribute` tells its :class:`TrainingPosition`."""

    spec: LoaderSpec | None  # one replica's (world size, per-replica batch, order, resume); None until made
    passes: list[_Passes]


#: the attribute of a returned dataset that holds its _Feed
_FEED = "_carraystore_feed"


def _replicas_per_pipeline(ctx: Any) -> int:
    n, p = int(ctx.num_replicas_in_sync), int(ctx.num_input_pipelines)
    if n % p:
        raise InvalidInputError(f"{n} replicas do not split evenly over {p} input pipelines")
    return n // p


def to_dataset(
    store_or_path: Any,
    batch_size: int,
    options: LoaderOptions | None = None,
    *,
    output_signature: Any = None,
    input_context: Any = None,
    **kwargs: Unpack[LoaderKwargs],
) -> Any:
    """A ``tf.data.Dataset`` of (x, y) batches (x alone for unlabelled stores; (x, y, w) with ``sample_weight``).

    ``kwargs``: :class:`~carraystore.engine.options.LoaderOptions` fields, or one ``options``.
    With ``start_batch`` or ``resume`` the dataset is the rest of that epoch only (a second pass
    raises). Batch dimension ``None`` (``batch_size`` with ``drop_remainder=True``).
    ``output_signature`` overrides the spec inferred by running the transform once on zeros.
    ``input_context`` makes it one pipeline's share: ``batch_size`` and a shard per replica,
    ``drop_remainder=True`` by default (docs/loading.md, tf.distribute).
    """
    replicas = 1
    if input_context is not None:
        if "rank" in kwargs or "world_size" in kwargs:
            raise InvalidInputError(
                "give input_context= or rank=/world_size=, not both: the context says which shard is this one"
            )
        replicas = _replicas_per_pipeline(input_context)
        world = int(input_context.num_replicas_in_sync)
        first_rank = int(input_context.input_pipeline_id) * replicas
        if options is None:
            kwargs.setdefault("drop_remainder", True)
        specs = [
            make_spec(store_or_path, batch_size, options, rank=first_rank + j, world_size=world, **kwargs)
            for j in range(replicas)
        ]
        if replicas > 1:
            warnings.warn(
                f"carraystore.tf.to_dataset: this input pipeline feeds {replicas} replicas, so each step takes {replicas} "
                f"of its batches and Keras would count {replicas}x the steps of an epoch; use carraystore.tf.distribute "
                "(one input pipeline per replica), or .repeat() the dataset and give fit steps_per_epoch",
                RuntimeWarning,
                stacklevel=2,
            )
    else:
        specs = [make_spec(store_or_path, batch_size, options, **kwargs)]
    spec = specs[0]
    epoch, start_batch = spec.options.epoch, spec.options.start_batch
    nb = spec.epoch_batches(epoch)
    if input_context is not None and nb == 0:
        raise InvalidInputError(
            f"{spec.store.location}: each of the {world} replicas gets {spec.shard_length} samples, fewer than one "
            f"batch of {batch_size}, so an epoch has no step; lower the global batch size or pass drop_remainder=False"
        )
    if not 0 <= int(start_batch) <= nb:
        raise InvalidInputError(f"start_batch {start_batch} is outside the epoch's {nb} batches")
    sig = output_signature if output_signature is not None else element_spec_for(spec)
    single = not isinstance(sig, tuple)
    passes = _Passes(int(epoch), int(start_batch), spec.resumes_epoch(epoch), str(spec.store.location))

    def generate() -> Any:
        e, sb = passes.take()
        its = [iterate(sp, epoch=e, start_batch=sb) for sp in specs]
        try:
            # one batch of each of this pipeline's replicas in turn (they all have nb batches)
            for group in zip(*its, strict=True):
                for batch in group:
                    yield batch[0] if single else batch
        finally:
            for it in its:
                it.close()

    ds = tf.data.Dataset.from_generator(generate, output_signature=sig)
    ds = ds.apply(tf.data.experimental.assert_cardinality((nb - int(start_batch)) * replicas))
    ds = ds.prefetch(tf.data.AUTOTUNE)
    setattr(ds, _FEED, _Feed(spec, [passes]))
    return ds


def distribute(strategy: Any, store_or_path: Any, global_batch_size: int, **kwargs: Unpack[LoaderKwargs]) -> Any:
    """A store as a ``tf.distribute.DistributedDataset`` for ``strategy``, ready for ``model.fit``.

    With ``PER_REPLICA`` input each replica reads its own shard in batches of
    ``global_batch_size / num_replicas`` (``drop_remainder=True`` unless given). Other
    strategies get one pipeline per worker, which Keras counts wrong (it warns; docs/loading.md).
    """

    feed = _Feed(None, [])  # filled as the strategy makes its pipelines

    def fn(ctx: Any) -> Any:
        ds = to_dataset(store_or_path, ctx.get_per_replica_batch_size(global_batch_size), input_context=ctx, **kwargs)
        mine: _Feed = getattr(ds, _FEED)
        if feed.spec is None:
            feed.spec = mine.spec
        feed.passes.extend(mine.passes)
        return ds

    if strategy.num_replicas_in_sync > 1:
        per_replica = tf.distribute.InputOptions(
            experimental_fetch_to_device=False,
            experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA,
        )
        # MirroredStrategy keeps this call's per-replica input workers as its default
        # (mirrored_strategy._input_workers_with_options): restore them for its other datasets
        ext = strategy.extended
        saved = getattr(ext, "_input_workers_devices", None)
        try:
            dist = strategy.distribute_datasets_from_function(fn, options=per_replica)
            setattr(dist, _FEED, feed)
            return dist
        except NotImplementedError:  # strategies without per-replica input: one pipeline per worker
            pass
        finally:
            if saved is not None:
                ext._input_workers_devices = saved
    dist = strategy.distribute_datasets_from_function(fn)
    setattr(dist, _FEED, feed)
    return dist


def steps_per_epoch(store_or_path: Any, global_batch_size: int, **kwargs: Unpack[LoaderKwargs]) -> int:
    """Steps of one whole epoch of :func:`distribute` (or of ``to_dataset`` with the same arguments)."""
    kwargs.setdefault("drop_remainder", True)
    return make_spec(store_or_path, global_batch_size, **kwargs).num_batches


class TrainingPosition(tf.keras.callbacks.Callback):  # type: ignore[misc]  # keras ships no type information
    """Records where a ``model.fit`` over a dataset of :func:`distribute` or :func:`to_dataset` is, as a resume state.

    ``state`` (after every step) resumes with any number of replicas or global batch size::

        ds = distribute(strategy, path, 64)
        model.fit(ds, epochs=10, callbacks=[TrainingPosition(ds, save_to="pos.json")])
        # later, on 2 GPUs instead of 4:
        state = TrainingPosition.load_state("pos.json")
        ds = distribute(strategy2, path, 64, resume=state)   # the rest of that epoch
        model.fit(ds, initial_epoch=state["epoch"], epochs=state["epoch"] + 1,
                  callbacks=[TrainingPosition(ds, save_to="pos.json")])
        # then whole epochs: distribute(strategy2, path, 64, epoch=state["epoch"] + 1)

    It pins the n-th epoch of a fit to the dataset's first epoch + n. ``save_to``: the state is
    written there atomically as JSON every ``every`` steps and at each epoch's end.
    """

    def __init__(self, dataset: Any, save_to: str | os.PathLike[str] | None = None, every: int = 1) -> None:
        super().__init__()
        feed = getattr(dataset, _FEED, None)
        if not isinstance(feed, _Feed):
            raise InvalidInputError(
                "TrainingPosition follows a dataset that carraystore.tf.to_dataset or distribute returned "
                f"(not one derived from it), got {type(dataset).__name__}"
            )
        self._feed = feed
        self.path = None if save_to is None else Path(save_to)
        self.every = int(every)
        if self.every < 1:
            raise InvalidInputError(f"every must be >= 1, got {every}")
        self._epochs = 0
        self._steps = 0
        #: (the dataset's epoch, its next batch, counted from the epoch's start); None before the first epoch
        self.position: tuple[int, int] | None = None

    def _spec(self) -> LoaderSpec:
        spec = self._feed.spec
        if spec is None:
            raise InvalidInputError("the strategy has not made this dataset's input pipelines yet: fit it first")
        return spec

    @property
    def state(self) -> dict[str, Any]:
        """Where training is, as a resume state: ``resume=`` of :func:`distribute` / :func:`to_dataset`."""
        spec = self._spec()
        return spec.state_dict(*(self.position or (spec.options.epoch, self._first_batch(spec.options.epoch))))

    def _first_batch(self, epoch: int) -> int:
        """The batch of ``epoch`` its pass starts at: ``start_batch`` for the dataset's first epoch, else 0."""
        o = self._spec().options
        return o.start_batch if epoch == o.epoch else 0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        e = self._spec().options.epoch + self._epochs
        self._epochs += 1
        for passes in self._feed.passes:
            passes.pin(e)
        self.position = (e, self._first_batch(e))

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        assert self.position is not None
        self.position = (self.position[0], self.position[1] + 1)
        self._steps += 1
        if self.path is not None and self._steps % self.every == 0:
            self.save()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        assert self.position is not None
        e, steps = self.position
        if steps >= self._spec().epoch_batches(e):  # not after a fit stopped inside the epoch (stop_training)
            self.position = (e + 1, 0)
        if self.path is not None:
            self.save()

    def save(self) -> None:
        """Write ``state`` to ``save_to``: a temporary file, fsynced and renamed over it."""
        assert self.path is not None
        write_text_atomically(self.path, json.dumps(self.state))

    @staticmethod
    def load_state(path: str | os.PathLike[str]) -> dict[str, Any] | None:
        """The state ``save`` wrote (None when there is none yet)."""
        p = Path(path)
        if not p.exists():
            return None
        state: dict[str, Any] = json.loads(p.read_text())
        return state

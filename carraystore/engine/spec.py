"""The loader spec: options resolved against one store (layer 4).

:class:`LoaderSpec` holds what every adapter needs to make batches; :func:`make_spec` builds it.
"""

from __future__ import annotations

import difflib
import os
import posixpath
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from carraystore.base.errors import (
    CarrayStoreError,
    ChecksumError,
    ClipError,
    InvalidInputError,
    LoaderChecksumError,
    LoaderError,
    RemoteReadError,
    ShortGroupsWarning,
)
from carraystore.base.forksafe import FORK_GATE
from carraystore.engine.options import (
    _CLASS,
    LoaderOptions,
    _int_arg,
    _resolve_targets,
    image_scale,
    map_targets,
)
from carraystore.engine.resume import ORDER_FIELDS, ResumePoint, check_order
from carraystore.engine.sampling import (
    EpochOrder,
    EpochPlan,
    clip_offsets,
    clip_starts,
    epoch_sequence,
    group_runs,
    num_batches,
    plan_epoch,
    remainder_plan,
    shard_length,
)
from carraystore.format.frame import ReadAheadSource
from carraystore.store.reader import StoreReader, open_store

__all__ = ["LoaderSpec", "make_spec"]


@dataclass
class LoaderSpec:
    """Loader options resolved against one store: what every adapter needs to make batches."""

    store: StoreReader
    batch_size: int
    options: LoaderOptions
    num_classes: int
    items: np.ndarray | None  # clip starts for sequences (fixed starts), None for every sample
    span: int
    runs: np.ndarray | None = None  # sequences: boundaries of the groups' runs
    #: ``targets`` resolved: names of fields, ``_CLASS`` for the class label; None: no y
    y_struct: Any = None
    #: ``image_size`` resolved: the stored images' sides are divided by this (1, 2, 4 or 8)
    scale: int = 1
    #: the resumed epoch's plan, once made (``options.resume``)
    _resumed: dict[int, EpochPlan] = field(default_factory=dict, init=False, repr=False, compare=False)

    # -- the options, by name ---------------------------------------------------------------
    shuffle = property(lambda self: self.options.shuffle)
    seed = property(lambda self: self.options.seed)
    window = property(lambda self: self.options.window)
    rank = property(lambda self: self.options.rank)
    world_size = property(lambda self: self.options.world_size)
    drop_remainder = property(lambda self: self.options.drop_remainder)
    label_mode = property(lambda self: self.options.label_mode)
    transform = property(lambda self: self.options.transform)
    verify = property(lambda self: self.options.verify)

    # -- sizes ----------------------------------------------------------------------------
    @property
    def n_items(self) -> int:
        return len(self.store) if self.items is None else len(self.items)

    @property
    def shard_length(self) -> int:
        """Items per rank per epoch."""
        return shard_length(self.n_items, self.world_size, self.drop_remainder)

    @property
    def num_batches(self) -> int:
        """Batches per rank of a whole epoch (the same every epoch; a resumed one: :meth:`epoch_batches`)."""
        return num_batches(self.shard_length, self.batch_size, self.drop_remainder)

    def epoch_batches(self, epoch: int) -> int:
        """Batches per rank of ``epoch``: :attr:`num_batches`, or what is left of the epoch ``resume`` names."""
        if self.resumes_epoch(epoch):
            return num_batches(len(self.plan(epoch)), self.batch_size, self.drop_remainder)
        return self.num_batches

    @property
    def labelled(self) -> bool:
        return self.label_mode is not None and self.store.labels is not None

    @property
    def item_shape(self) -> tuple[int, ...]:
        """The shape of one image as the loader yields it (``image_size`` applied)."""
        item = tuple(self.store.image_shape)
        if self.scale == 1:
            return item
        return (item[0] // self.scale, item[1] // self.scale, *item[2:])

    @property
    def item_nbytes(self) -> int:
        """Bytes of one image as the loader yields it."""
        return int(np.prod(self.item_shape)) * self.store.dtype.itemsize

    def x_shape(self, n: int) -> tuple[int, ...]:
        item = self.item_shape
        return (n, *item) if self.span == 1 else (n, self.span, *item)

    def y_shape(self, n: int | None) -> tuple[int | None, ...]:
        if self.label_mode == "categorical":
            return (n, self.num_classes)
        return (n, 1) if self.label_mode == "binary" else (n,)

    @property
    def y_dtype(self) -> np.dtype:
        return np.dtype(np.int64 if self.label_mode == "int" else np.float32)

    @property
    def has_y(self) -> bool:
        """Whether batches carry a y."""
        return self.y_struct is not None

    def y_signature(self, n: int | None) -> Any:
        """(shape, dtype) of each part of y, in the structure of ``targets`` (None: no y)."""
        if self.y_struct is None:
            return None

        def sig(leaf: str) -> tuple[tuple[int | None, ...], np.dtype]:
            if leaf == _CLASS:
                return self.y_shape(n), self.y_dtype
            col = self.store.columns[leaf]
            return (n, *col.shape[1:]), col.dtype

        return map_targets(self.y_struct, sig)

    def w_signature(self, n: int | None) -> tuple[tuple[int | None, ...], np.dtype] | None:
        """(shape, dtype) of the sample weights, or None without ``sample_weight``."""
        return None if self.options.sample_weight is None else ((n,), np.dtype(np.float32))

    def _field_rows(self, items: np.ndarray) -> np.ndarray:
        """The rows of a field for ``items``: the samples, or each clip's last frame."""
        items = np.asarray(items, dtype=np.int64)
        return items if self.span == 1 else items + (self.span - 1)

    def y_for(self, items: np.ndarray) -> Any:
        """The batch's y for ``targets``: an array, a tuple or a dict of arrays; None without y."""
        if self.y_struct is None:
            return None
        if self.y_struct == _CLASS:  # the class label alone (the default)
            return self.labels_for(items)

        def part(leaf: str) -> np.ndarray:
            if leaf == _CLASS:
                return self.labels_for(items)  # type: ignore[return-value]
            return np.array(self.store.columns[leaf][self._field_rows(items)])

        return map_targets(self.y_struct, part)

    def w_for(self, items: np.ndarray) -> np.ndarray | None:
        """The batch's sample weights (float32, shape (B,)), or None without ``sample_weight``."""
        name = self.options.sample_weight
        if name is None:
            return None
        return np.asarray(self.store.columns[name][self._field_rows(items)], dtype=np.float32)

    # -- per epoch --------------------------------------------------------------------------
    def items_for(self, epoch: int) -> np.ndarray | None:
        """The epoch's items: clip starts shifted by the epoch's offsets, or every sample (None)."""
        if self.items is None or self.runs is None or self.options.fixed_clips:
            return self.items
        o = self.options
        offsets = clip_offsets(self.runs, self.span, o.sequence_stride, seed=o.seed, epoch=epoch)
        return clip_starts(self.runs, self.span, o.sequence_stride, offsets=offsets)

    def resumes_epoch(self, epoch: int) -> bool:
        """Whether ``epoch`` is the interrupted epoch ``resume`` names (its plan is the rest of it)."""
        r = self.options.resume_point
        return r is not None and bool(r.runs) and r.epoch == epoch

    def plan(self, epoch: int) -> EpochPlan:
        """This rank's order for ``epoch`` (the rest of it, for the epoch ``resume`` names)."""
        if self.resumes_epoch(epoch):
            p = self._resumed.get(epoch)
            if p is None:
                r = self.options.resume_point
                assert r is not None
                p = self._resumed[epoch] = remainder_plan(
                    self._whole_plan_of(epoch, r.batch_size or self.batch_size),
                    r.runs,
                    self.rank,
                    self.world_size,
                    self.drop_remainder,
                )
            return p
        o = self.order(epoch)
        return plan_epoch(len(self.store), self.store.chunk_images, o, items=self.items_for(epoch))

    def order(self, epoch: int, batch_size: int | None = None) -> EpochOrder:
        """What this rank's order of ``epoch`` depends on (batches of ``batch_size``: this spec's by default)."""
        o = self.options
        return EpochOrder(
            o.shuffle, o.seed, epoch, self.window, o.rank, o.world_size, o.drop_remainder, self.span,
            self.batch_size if batch_size is None else batch_size,
        )  # fmt: skip

    def _whole_plan_of(self, epoch: int, batch_size: int) -> Callable[[int, int], EpochPlan]:
        """Every rank's plan of ``epoch`` at any world size, the epoch's items and sequence made once."""
        made: list[tuple[np.ndarray | None, np.ndarray]] = []
        order = self.order(epoch, batch_size)

        def whole(rank: int, world_size: int) -> EpochPlan:
            if not made:
                items = self.items_for(epoch)
                made.append((items, epoch_sequence(len(self.store), self.store.chunk_images, order, items)))
            items, seq = made[0]
            o = order.replace(rank=rank, world_size=world_size)
            return plan_epoch(len(self.store), self.store.chunk_images, o, items=items, sequence=seq)

        return whole

    def order_facts(self) -> dict[str, Any]:
        """What the order depends on, as a resume state records it (:data:`carraystore.engine.resume.ORDER_FIELDS`)."""
        o = self.options
        return {
            **{f: getattr(o, f) for f in ORDER_FIELDS},
            "num_items": self.n_items,
            "chunk_images": self.store.chunk_images,
            # the clips (their fixed starts and the slack their random starts move in) follow the groups' runs
            "clip_runs": None if self.runs is None else zlib.crc32(np.asarray(self.runs, dtype="<i8").tobytes()),
            # which images, in which chunks: copies of a store agree, another store of as many images does not
            "content": zlib.crc32(np.asarray(self.store.meta.crc32, dtype="<u4").tobytes()),
        }

    def state_dict(self, epoch: int, batches: int) -> dict[str, Any]:
        """The resume state after ``batches`` batches of ``epoch`` (every rank's: ranks move in lockstep)."""
        length = len(self.plan(epoch)) if self.resumes_epoch(epoch) else self.shard_length
        nb = num_batches(length, self.batch_size, self.drop_remainder)
        b = _int_arg("batches", batches, 0)
        if b > nb:
            raise InvalidInputError(f"batches must be between 0 and the epoch's {nb} batches, got {batches}")
        r = self.options.resume_point
        facts = tuple(self.order_facts().items())
        if r is not None and r.epoch == epoch and r.runs:  # the epoch was resumed: its first run's order
            start = ResumePoint(epoch, r.runs, facts, r.batch_size or self.batch_size)
        else:
            start = ResumePoint(epoch, (), facts, self.batch_size)
        per_rank = min(b * self.batch_size, length)
        return start.then(epoch, self.world_size, per_rank, batches_left=not (nb and b == nb)).to_state()

    def batch_bounds(self, plan: EpochPlan, i: int) -> tuple[int, int]:
        a = i * self.batch_size
        return a, min(a + self.batch_size, len(plan))

    def labels_for(self, items: np.ndarray) -> np.ndarray | None:
        """The batch's labels (a clip takes its first frame's label)."""
        if not self.labelled:
            return None
        y: np.ndarray = np.asarray(self.store.labels)[items]
        if self.label_mode == "categorical":
            if y.size and int(y.max()) >= self.num_classes:
                raise LoaderError(
                    f"{self.store.location}: label {int(y.max())} is outside the {self.num_classes} classes"
                )
            one_hot: np.ndarray = np.eye(self.num_classes, dtype=np.float32)[y]
            return one_hot
        if self.label_mode == "binary":
            return y.astype(np.float32).reshape(-1, 1)
        return y

    def finish(
        self, x: np.ndarray, y: Any, batch: int, epoch: int, plan: EpochPlan, w: np.ndarray | None = None
    ) -> tuple[Any, ...]:
        """Apply the transform to (x, y), giving (x, y[, w]); failures become LoaderError naming the batch.

        A transform returns (x, y), or (x, y, w) with a sample weight it computed (then ``sample_weight=`` is None).
        """
        if self.transform is None:
            return (x, y) if w is None else (x, y, w)
        try:
            out = self.transform(x, y)
            if not isinstance(out, tuple) or len(out) not in (2, 3):
                shown = f"{len(out)} values" if isinstance(out, tuple) else type(out).__name__
                raise TypeError(f"a transform must return (x, y) or (x, y, w), got {shown}")
            if len(out) == 3 and w is not None:
                raise TypeError("the transform returned a sample weight and sample_weight= gives one too; keep one")
            return out if w is None else (*out, w)
        except Exception as exc:
            a, b = self.batch_bounds(plan, batch)
            chunks = np.unique(plan.samples(a, b) // self.store.chunk_images).tolist()
            err = LoaderError(
                f"{self.store.location}: transform {getattr(self.transform, '__name__', self.transform)!r} failed on "
                f"batch {batch} of epoch {epoch} (chunks {chunks[:8]}{'...' if len(chunks) > 8 else ''}): "
                f"{type(exc).__name__}: {exc}"
            )
            err.batch = batch  # type: ignore[attr-defined]
            err.chunk = chunks[0] if chunks else None  # type: ignore[attr-defined]
            raise err from exc

    def fetch_chunk(self, chunk: int) -> np.ndarray:
        """Chunk ``chunk``'s checked compressed bytes as a uint8 array; errors become LoaderError."""
        store = self.store
        try:
            with FORK_GATE:
                data = store.chunk_buffer(chunk, items=True)
                store.check_chunk_read(chunk, data, self.verify)
            return np.frombuffer(data, dtype=np.uint8)
        except Exception as exc:
            raise _chunk_error(store, chunk, exc) from exc

    def decode_chunk(self, chunk: int, out: np.ndarray, fetched: Callable[[], None] | None = None) -> None:
        """Read, check and decompress a chunk into ``out``; ``fetched()`` once its bytes are in; LoaderError."""
        store = self.store
        try:
            with FORK_GATE:
                data = store.chunk_buffer(chunk)
                if fetched is not None:
                    fetched()
                store.check_chunk_read(chunk, data, self.verify)
                # one blosc2 thread per decoder thread: more would oversubscribe the cores
                store.decompress_chunk(chunk, data, out, nthreads=1, scale=self.scale)
        except Exception as exc:
            raise _chunk_error(store, chunk, exc) from exc


def _chunk_error(store: StoreReader, chunk: int, exc: BaseException) -> LoaderError:
    """A LoaderError naming the chunk (a LoaderChecksumError for a CRC32 mismatch)."""
    hint = (
        "; run `carraystore verify` on it"
        if isinstance(exc, CarrayStoreError) and not isinstance(exc, RemoteReadError)
        else ""
    )
    cls = LoaderChecksumError if isinstance(exc, ChecksumError) else LoaderError
    err = cls(f"{store.location}: loading chunk {chunk} failed: {type(exc).__name__}: {exc}{hint}")
    err.chunk = chunk  # type: ignore[attr-defined]
    return err


def _open(store_or_path: Any) -> StoreReader:
    if isinstance(store_or_path, StoreReader):
        return store_or_path
    if isinstance(store_or_path, (str, os.PathLike)):
        return open_store(store_or_path)
    raise InvalidInputError(
        f"expected a carraystore Store, a path or a URL of a .b2nd store, got {type(store_or_path).__name__}"
    )


def make_spec(store_or_path: Any, batch_size: int, options: LoaderOptions | None = None, **kwargs: Any) -> LoaderSpec:
    """Resolve loader options (an options value, or keyword arguments) against a store."""
    if options is None:
        options = LoaderOptions.from_kwargs(**kwargs)
    elif kwargs:
        options = options.replace(**kwargs)
    store = _open(store_or_path)
    if options.retry_timeout is not None and isinstance(store.source, ReadAheadSource):
        store.source.retry_timeout = options.retry_timeout  # (a cache passes it on to its remote source)
    batch_size = _int_arg("batch_size", batch_size, 1)
    labels = store.labels
    if store.class_names:
        ncls = len(store.class_names)
    elif labels is not None and len(labels):
        ncls = int(np.max(labels)) + 1
    else:
        ncls = 0
    if options.label_mode == "binary" and labels is not None and ncls > 2:
        names = f" ({', '.join(store.class_names)})" if store.class_names else ""
        raise InvalidInputError(
            f"{store.location}: label_mode='binary' needs at most 2 classes, the store has {ncls}{names}; "
            "use label_mode='int' or 'categorical'"
        )
    items = runs = None
    span = 1
    if options.sequence_length is not None:
        span = options.sequence_length
        n = len(store)
        groups = options.groups
        group_names: Sequence[str] | None = None
        if groups is None and store.groups is not None:  # the store's own groups (videos, sessions)
            groups, group_names = store.groups, store.group_names
        elif groups is None:
            keys = store.keys
            groups = [posixpath.dirname(k) for k in keys] if keys is not None else np.zeros(n, dtype=np.int8)
        elif len(groups) != n:
            raise InvalidInputError(
                f"{store.location}: groups has {len(groups)} entries for {n} samples; give one per sample"
            )
        if store.provenance.get("shuffled"):
            raise ClipError(
                f"{store.location} was written in a shuffled order (its provenance says shuffled=True), so neighbouring "
                "samples are not consecutive frames and sequence_length= cannot make clips; write the store again "
                "with `carraystore ingest --keep-order` (or from_directory(..., keep_order=True))"
            )
        runs = group_runs(groups)
        items = clip_starts(runs, span, options.sequence_stride)
        lens = np.diff(runs)
        short = np.flatnonzero(lens < span)
        if n and not len(items):
            longest = int(lens.max())
            raise ClipError(
                f"{store.location}: no group is long enough for sequence_length={span}: all {len(lens)} group(s) "
                f"(videos, sessions) are shorter (the longest run of one group is {longest}), so there is no "
                "clip; lower sequence_length, pass groups=, or write the frames in order with "
                "`carraystore ingest --keep-order`"
            )
        if n and len(short):
            shown = [_run_name(groups, group_names, int(runs[i])) for i in short[:5]]
            warnings.warn(
                f"{store.location}: {len(short)} of {len(lens)} group(s) hold fewer than sequence_length={span} "
                f"samples and give no clip ({', '.join(shown)}{', ...' if len(short) > 5 else ''}; "
                f"{int(lens[short].sum())} samples left out)",
                ShortGroupsWarning,
                stacklevel=3,
            )
    y_struct = _resolve_targets(store, options)
    sw = options.sample_weight
    if sw is not None:
        col = store.columns.get(sw)
        if col is None:
            close = difflib.get_close_matches(sw, sorted(store.columns), n=1)
            raise InvalidInputError(
                f"{store.location}: no field {sw!r} for sample_weight; the store's fields are {sorted(store.columns)}"
                + (f"; did you mean {close[0]!r}?" if close else "")
            )
        if col.shape[1:] not in ((), (1,)) or col.dtype.kind not in "biuf":
            raise InvalidInputError(
                f"{store.location}: sample_weight field {sw!r} is {col.dtype} of shape {col.shape[1:]}; "
                "a sample weight is one number per sample"
            )
    spec = LoaderSpec(
        store=store,
        batch_size=batch_size,
        options=options,
        num_classes=ncls,
        items=items,
        span=span,
        runs=runs,
        y_struct=y_struct,
        scale=image_scale(store, options.image_size),
    )
    if options.resume_point is not None:
        check_order(options.resume_point, spec.order_facts(), str(store.location))
        spec.plan(options.epoch)  # runs the ranks could not have made are refused here, not in a thread
    return spec


def _run_name(groups: Any, names: Sequence[str] | None, start: int) -> str:
    """The name of the group a run starting at sample ``start`` belongs to."""
    g = groups[start]
    if names is not None:
        return str(names[int(g)])
    return str(g) if str(g) else "(top folder)"

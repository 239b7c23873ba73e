"""The decoding engine: one epoch's chunks read, checked and decompressed by threads (layer 6).

Everything that turns a store into batches goes through here: ``Store.batches`` /
:func:`carraystore.engine.loader.batches` (a streaming iterator), the Keras ``StoreDataset``
(batches asked for by index, from any thread) and the tf.data adapter.

- :class:`LoaderOptions` is the one frozen set of loader arguments every adapter takes.
- :class:`LoaderSpec` is those options resolved against one store (clips, classes, sizes).
- :class:`EpochDecoder` serves batch ``i`` of one epoch. Decoded chunks live in a pool of
  chunk-sized slots allocated once (and kept for the next epoch of the same Store). A
  window's slots are reserved together, its chunks are read and decompressed by the
  decoder threads (GIL released, one blosc2 thread each), and the slots go back to the
  pool once every batch of the window was served. Windows ahead are decoded while the
  current one is served, as far as free slots allow; their byte ranges are announced to
  the byte source first, so a remote source has them in flight early.
- Errors name the store, the chunk and the batch; fork safety is :mod:`carraystore.base.forksafe`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import os
import posixpath
import queue
import sys
import threading
import time
import warnings
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import numpy as np

from carraystore.format import blocks
from carraystore.format.encoded import SCALES, reduced_sizes
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
from carraystore.base.forksafe import FORK_GATE, at_fork_in_child
from carraystore.store.reader import StoreReader, open_store
from carraystore.base.resources import available_cpus, memory_limit, parse_bytes
from carraystore.engine.resume import ORDER_FIELDS, ResumePoint, check_order
from carraystore.engine.sampling import (
    EpochPlan,
    Shuffle,
    _check_shuffle,
    clip_offsets,
    clip_starts,
    epoch_sequence,
    group_runs,
    num_batches,
    plan_epoch,
    remainder_plan,
    shard_length,
)

__all__ = [
    "LoaderOptions",
    "LoaderSpec",
    "LABEL",
    "Targets",
    "map_targets",
    "EpochDecoder",
    "BatchBuffers",
    "make_spec",
    "gather",
    "default_threads",
    "release_buffers",
    "image_scale",
    "DEFAULT_WINDOW",
]

#: Default shuffle window, in chunks.
DEFAULT_WINDOW = 16

Batch = tuple[np.ndarray, np.ndarray | None]
Transform = Callable[[np.ndarray, np.ndarray | None], tuple[Any, Any]]
#: What ``targets=`` takes: a name, a tuple of names (y is a tuple), a dict of names (y is a dict).
Targets = str | tuple[str, ...] | dict[str, str]

#: The name ``targets=`` gives the class labels (the store's ``labels``).
LABEL = "label"
#: A resolved target that is the class label (no field has an empty name).
_CLASS = ""

_LABEL_MODES = ("int", "categorical", "binary", None)
_CLIP_STARTS = ("random", "fixed")


def default_threads() -> int:
    """Decoder threads used when ``num_threads`` is not given: the cores this process may
    use (its affinity mask and cgroup CPU quota, :func:`carraystore.base.resources.available_cpus`),
    at least 2 so that reading overlaps decoding."""
    return max(2, available_cpus())


def default_memory_budget() -> int:
    """``memory_budget`` when not given: a quarter of the memory this process may use (the
    machine's RAM, or the cgroup's limit when lower)."""
    return memory_limit() // 4


def _int_arg(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool):
        raise InvalidInputError(f"{name} must be an integer, got {value!r}")
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise InvalidInputError(f"{name} must be an integer, got {value!r}") from None
    if v != value or v < minimum:
        raise InvalidInputError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return v


# ---------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------


class LoaderKwargs(TypedDict, total=False):
    """The keyword arguments of every loader (``batches``, ``Store.batches``, ``StoreDataset``,
    ``to_dataset``, ``carraystore.torch.StoreDataset``): the fields of :class:`LoaderOptions`,
    documented there once. For type checkers (``**options: Unpack[LoaderKwargs]``)."""

    shuffle: Shuffle
    seed: int
    epoch: int
    start_batch: int
    window: int | None
    rank: int
    world_size: int
    drop_remainder: bool
    transform: Transform | None
    label_mode: str | None
    targets: Targets
    sample_weight: str | None
    sequence_length: int | None
    sequence_stride: int | None
    groups: Sequence[Any] | np.ndarray | None
    clip_starts: str
    verify: bool
    prefetch: int | None
    num_threads: int | None
    queue_size: int
    retry_timeout: float | None
    memory_budget: int | str | None
    image_size: tuple[int, int] | None
    resume: Mapping[str, Any] | ResumePoint | None


@dataclass(frozen=True, eq=False)
class LoaderOptions:
    """How to walk a store: the one argument set of ``batches``, ``StoreDataset`` and ``to_dataset``.

    - ``shuffle``: ``"block"`` (chunks in a random order, samples shuffled inside windows
      of ``window`` chunks), ``"global"`` (a full permutation: the whole shard is decoded
      at once; small stores), or False (store order).
    - ``window``: chunks whose samples are shuffled together (default 16); the first
      windows of each shard ramp up from one batch's chunks (x4), so the first batch
      waits for those, not for a whole window.
    - ``seed``, ``epoch``: the order depends on them only; use a new ``epoch`` every epoch.
    - ``start_batch``: resume inside an epoch; yields exactly the batches from that index.
    - ``resume``: a state a ``state_dict()`` returned (any adapter's, or
      ``BatchIterator.state_dict()``): start in its epoch with what it had not consumed,
      cut into this ``world_size``'s equal shards (the world size may differ from the one
      that saved it; :mod:`carraystore.engine.resume`). The epoch is the state's (``epoch`` may be
      left out), the epochs after it are whole; not with ``start_batch``.
    - ``rank``, ``world_size``: this rank's shard; shards are disjoint, of equal length and
      cover every sample (``drop_remainder=False`` pads a shard by wrapping around,
      ``True`` drops the few samples over and also the last short batch).
    - ``transform(x, y) -> (x, y)``: a per-batch numpy function, run in a loader thread.
    - ``label_mode``: ``"int"`` (int64 labels), ``"categorical"`` (float32 one-hot),
      ``"binary"`` (float32 0/1, stores of two classes) or None (x only), as in
      ``keras.utils.image_dataset_from_directory``. Unlabelled stores give ``y = None``.
    - ``targets``: what y is. ``"label"`` (default): the class label, shaped by
      ``label_mode``; a field name (``store.columns``, docs/targets.md): that field as
      stored (dtype and per-sample shape kept); a tuple of names: y is a tuple; a dict
      ``{output: name}``: y is a dict (multi-output Keras models). ``"label"`` means the
      class labels whenever the store has them (a field called "label" only otherwise).
    - ``sample_weight``: a field of one number per sample; batches are then ``(x, y, w)``
      with ``w`` float32 of shape (B,), as Keras expects. The transform sees (x, y) only.
    - ``sequence_length=L``: x is (B, L, *item) clips of consecutive samples that never
      cross a group (the key's parent folder, or ``groups``, one value per sample);
      clips step by ``sequence_stride`` (default L); the class label is the clip's first
      frame's, a field (target or sample weight) its **last** frame's.
      ``clip_starts="random"`` (default) shifts each group's clips by a random offset
      every epoch (a pure function of seed and epoch; the number of clips never
      changes); ``"fixed"`` starts them at the group's first frame every epoch.
    - ``verify``: check every chunk's CRC32 before decoding it (default True; always on
      for remote stores). ``verify=False`` skips the check on local stores.
    - ``prefetch``: decoded chunks held beyond the current window (default ``window``).
    - ``num_threads``: decoder threads (default: the cores this process may use, its
      affinity mask and cgroup quota, at least 2), each decompressing whole chunks with
      one blosc2 thread. Batches are assembled several at once by their own threads
      (one per four decoder threads, at most 4; one when a ``transform`` is given, so a
      stateful transform sees batches in order).
    - ``queue_size``: finished batches waiting for the consumer.
    - ``memory_budget``: the most the loader may hold, in bytes or as ``"2GB"``/``"512MiB"``
      (default: a quarter of the memory the process may use, the cgroup's limit when
      lower): decoded chunk slots (windows and prefetch), batch buffers and a remote
      source's read-ahead. Prefetch and the number of batches assembled at once shrink to
      fit; when one window and ``queue_size`` batches cannot fit, the loader refuses to
      start and says what to lower. Iterators report what they hold (``.memory``).
    - ``retry_timeout``: remote stores: seconds a failing server is tried again before the
      epoch fails (default: the store's storage option ``retry_timeout``, 120 s); the
      loader waits meanwhile and resumes at the same batch, losing and repeating nothing.
    - ``image_size=(height, width)``: the size of the images the loader yields (default
      None: the stored size, at no cost). It must be the stored size divided by 1, 2, 4 or
      8 (both sides by the same factor, exactly); any other size is refused with the ones
      this store allows (resize in a ``transform`` instead). Encoded stores decode JPEG
      entries at that size with libjpeg's scaled IDCT (Pillow's ``Image.draft`` pixels, less
      work than a full decode); PNG, WebP and raw entries and pixel stores (uint8 images
      only) are reduced after decoding by a box average, Pillow's ``Image.reduce`` (RGBA:
      each channel on its own). Clips keep their frames; batches, shards, resume and every
      adapter see the smaller images; the decoded-chunk slots stay full size, batch
      buffers are the smaller size.
    """

    shuffle: Shuffle = "block"
    seed: int = 0
    epoch: int = 0
    start_batch: int = 0
    window: int | None = None
    rank: int = 0
    world_size: int = 1
    drop_remainder: bool = False
    transform: Transform | None = None
    label_mode: str | None = "int"
    targets: Targets = LABEL
    sample_weight: str | None = None
    sequence_length: int | None = None
    sequence_stride: int | None = None
    groups: Sequence[Any] | np.ndarray | None = None
    clip_starts: str = "random"
    verify: bool = True
    prefetch: int | None = None
    num_threads: int | None = None
    queue_size: int = 2
    retry_timeout: float | None = None
    memory_budget: int | str | None = None
    image_size: tuple[int, int] | None = None
    resume: Mapping[str, Any] | ResumePoint | None = None

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "shuffle", _check_shuffle(self.shuffle))
        s(self, "seed", _int_arg("seed", self.seed, 0))
        s(self, "epoch", _int_arg("epoch", self.epoch, 0))
        s(self, "start_batch", _int_arg("start_batch", self.start_batch, 0))
        if self.resume is not None:
            point = ResumePoint.from_state(self.resume)
            if self.start_batch:
                raise InvalidInputError(
                    "give resume= or start_batch=, not both: the state says where the epoch stopped"
                )
            if self.epoch not in (0, point.epoch):
                raise InvalidInputError(
                    f"resume= is a state of epoch {point.epoch}, but epoch={self.epoch} was given; leave epoch out"
                )
            s(self, "resume", point)
            s(self, "epoch", point.epoch)
        s(self, "window", DEFAULT_WINDOW if self.window is None else _int_arg("window", self.window, 1))
        s(self, "world_size", _int_arg("world_size", self.world_size, 1))
        s(self, "rank", _int_arg("rank", self.rank, 0))
        if self.rank >= self.world_size:
            raise InvalidInputError(f"rank {self.rank} must be below world_size {self.world_size}")
        s(self, "drop_remainder", bool(self.drop_remainder))
        if self.label_mode not in _LABEL_MODES:
            raise InvalidInputError(
                f"label_mode must be 'int', 'categorical', 'binary' or None, got {self.label_mode!r}"
            )
        s(self, "targets", _check_targets(self.targets))
        if self.sample_weight is not None and (not isinstance(self.sample_weight, str) or not self.sample_weight):
            raise InvalidInputError(f"sample_weight must be the name of a field, got {self.sample_weight!r}")
        if self.label_mode is None and LABEL in _target_names(self.targets) and self.targets != LABEL:
            raise InvalidInputError(
                "label_mode=None gives no class label, but targets names 'label'; use label_mode='int' "
                "(or 'categorical', 'binary'), or leave 'label' out of targets"
            )
        if self.sample_weight is not None and self.label_mode is None and self.targets == LABEL:
            raise InvalidInputError("sample_weight= needs a y (Keras takes (x, y, w)); label_mode=None gives x only")
        if self.transform is not None and not callable(self.transform):
            raise InvalidInputError("transform must be a function (x, y) -> (x, y)")
        if self.sequence_length is not None:
            s(self, "sequence_length", _int_arg("sequence_length", self.sequence_length, 1))
            if self.sequence_stride is not None:
                s(self, "sequence_stride", _int_arg("sequence_stride", self.sequence_stride, 1))
        elif self.groups is not None or self.sequence_stride is not None:
            raise InvalidInputError("groups= and sequence_stride= only apply with sequence_length=")
        if self.clip_starts not in _CLIP_STARTS:
            raise InvalidInputError(f"clip_starts must be 'random' or 'fixed', got {self.clip_starts!r}")
        s(self, "verify", bool(self.verify))
        s(self, "prefetch", self.window if self.prefetch is None else _int_arg("prefetch", self.prefetch, 0))
        s(
            self,
            "num_threads",
            default_threads() if self.num_threads is None else _int_arg("num_threads", self.num_threads, 1),
        )
        s(self, "queue_size", _int_arg("queue_size", self.queue_size, 1))
        s(
            self,
            "memory_budget",
            default_memory_budget() if self.memory_budget is None else parse_bytes(self.memory_budget, "memory_budget"),
        )
        if self.retry_timeout is not None:
            try:
                seconds = float(self.retry_timeout)
            except (TypeError, ValueError):
                seconds = -1.0
            if not seconds >= 0:
                raise InvalidInputError(f"retry_timeout must be seconds >= 0, got {self.retry_timeout!r}")
            s(self, "retry_timeout", seconds)
        if self.image_size is not None:
            s(self, "image_size", _check_image_size(self.image_size))

    @property
    def resume_point(self) -> ResumePoint | None:
        """``resume`` as parsed (a :class:`carraystore.engine.resume.ResumePoint`), or None."""
        r = self.resume
        assert r is None or isinstance(r, ResumePoint)
        return r

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LoaderOptions:
        """Options from keyword arguments; an unknown name gets a "did you mean" hint."""
        known = {f.name for f in dataclasses.fields(cls)}
        for name in kwargs:
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; the loader takes {sorted(known)}"
                raise InvalidInputError(f"unknown loader argument {name!r}{hint}")
        return cls(**kwargs)

    def replace(self, **changes: Any) -> LoaderOptions:
        """A copy with some options changed (checked again).

        Options made with ``resume`` took its epoch: a new ``resume`` (without ``epoch``)
        brings its own, and ``resume=None`` keeps the epoch."""
        if "resume" in changes and "epoch" not in changes and self.resume is not None and changes["resume"] is not None:
            changes["epoch"] = 0  # not given: the new state's
        return dataclasses.replace(self, **changes)


def _check_image_size(v: Any) -> tuple[int, int]:
    """``image_size`` checked: a pair (height, width) of integers >= 1."""
    what = f"image_size must be (height, width), two integers >= 1, got {v!r}"
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence) or len(v) != 2:
        raise InvalidInputError(what)
    try:
        h, w = (_int_arg("image_size", x, 1) for x in v)
    except InvalidInputError:
        raise InvalidInputError(what) from None
    return h, w


def image_scale(store: StoreReader, image_size: Sequence[int] | None) -> int:
    """The factor ``image_size`` (checked: see ``LoaderOptions``) divides the store's images by:
    1, 2, 4 or 8; InvalidInputError naming the sizes this store allows otherwise."""
    if image_size is None:
        return 1
    image_size = _check_image_size(image_size)
    shape = tuple(store.image_shape)
    if len(shape) != 3 or not store.meta.color_mode:
        raise InvalidInputError(
            f"{store.location}: image_size= applies to image stores; this store's items are {store.dtype} of shape "
            f"{shape}, not (height, width, channels) images"
        )
    h, w = shape[:2]
    if tuple(image_size) == (h, w):
        return 1
    allowed = reduced_sizes(h, w)
    scale = next((k for k in SCALES if h % k == 0 and w % k == 0 and (h // k, w // k) == tuple(image_size)), None)
    if scale is None:
        shown = ", ".join(f"({a}, {b})" for a, b in allowed)
        raise InvalidInputError(
            f"{store.location}: image_size={tuple(image_size)} is not one the store's {h}x{w} images can be decoded "
            f"at: the stored size divided by 1, 2, 4 or 8 exactly, here {shown}; for any other size, resize in a "
            "transform="
        )
    if store.dtype != np.uint8:
        raise InvalidInputError(
            f"{store.location}: image_size={tuple(image_size)} reduces {store.dtype} images; only uint8 images are "
            "decoded at a smaller size (resize in a transform= instead)"
        )
    return scale


def _check_targets(t: Any) -> Targets:
    """``targets`` checked: a non-empty name, a tuple (or list) of them, or a dict output -> name."""
    what = "targets must be a field name, a tuple of names or a dict {output: name}"

    def name(v: Any) -> str:
        if not isinstance(v, str) or not v:
            raise InvalidInputError(f"{what}; {v!r} is not a name")
        return v

    if isinstance(t, str):
        return name(t)
    if isinstance(t, (tuple, list)) and t:
        return tuple(name(v) for v in t)
    if isinstance(t, dict) and t:
        if not all(isinstance(k, str) for k in t):
            raise InvalidInputError(f"{what}; the dict's keys (the model's output names) must be strings")
        return {k: name(v) for k, v in t.items()}
    raise InvalidInputError(f"{what}, got {t!r}")


def _target_names(t: Targets) -> list[str]:
    return [t] if isinstance(t, str) else list(t.values()) if isinstance(t, dict) else list(t)


def map_targets(struct: Any, fn: Callable[[str], Any]) -> Any:
    """``fn`` applied to every name of a targets structure (a name, a tuple or a dict), keeping its shape."""
    if isinstance(struct, str):
        return fn(struct)
    if isinstance(struct, dict):
        return {k: fn(v) for k, v in struct.items()}
    return tuple(fn(v) for v in struct)


def _resolve_targets(store: StoreReader, options: LoaderOptions) -> Any:
    """The targets as the batches carry them: each name a field, or ``_CLASS`` for the class
    label; None when batches have no y (an unlabelled store, or label_mode=None)."""
    t = options.targets
    fields = store.columns

    def known() -> str:
        names = sorted(fields) + ([LABEL] if store.labels is not None else [])
        return f"the store's fields are {names}" if names else "the store has no fields and no class labels"

    def leaf(name: str) -> str:
        if name == LABEL and store.labels is not None:
            return _CLASS
        if name in fields:
            if fields[name].dtype.kind not in "biuf":
                raise InvalidInputError(
                    f"{store.location}: field {name!r} is {fields[name].dtype}, not numbers; a target is ints or floats"
                )
            return name
        if name == LABEL:
            raise InvalidInputError(
                f"{store.location}: targets names 'label' but the store has no class labels; {known()}"
            )
        close = difflib.get_close_matches(name, sorted(fields) + [LABEL], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise InvalidInputError(f"{store.location}: no field {name!r}; {known()}{hint}")

    if t == LABEL and (options.label_mode is None or (store.labels is None and LABEL not in fields)):
        return None  # today's behaviour: x only
    return map_targets(t, leaf)


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
        rows = self._field_rows(items)

        def part(leaf: str) -> np.ndarray:
            if leaf == _CLASS:
                return self.labels_for(items)  # type: ignore[return-value]
            return np.array(self.store.columns[leaf][rows])

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
        if self.items is None or self.runs is None or self.options.clip_starts == "fixed":
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
        return self._whole_plan(epoch, self.rank, self.world_size, self.batch_size, self.items_for(epoch))

    def _whole_plan_of(self, epoch: int, batch_size: int) -> Callable[[int, int], EpochPlan]:
        """Every rank's plan of ``epoch`` at any world size, the epoch's items and sequence made once."""
        made: list[tuple[np.ndarray | None, np.ndarray]] = []

        def whole(rank: int, world_size: int) -> EpochPlan:
            if not made:
                o, items = self.options, self.items_for(epoch)
                seq = epoch_sequence(
                    len(self.store), self.store.chunk_images, shuffle=o.shuffle, seed=o.seed, epoch=epoch, items=items
                )
                made.append((items, seq))
            items, seq = made[0]
            return self._whole_plan(epoch, rank, world_size, batch_size, items, seq)

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
        """The resume state after this rank consumed ``batches`` batches of ``epoch`` (of the rest
        of it, for the epoch ``resume`` names): :mod:`carraystore.engine.resume`. Ranks move in
        lockstep, so one rank's state is every rank's."""
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

    def _whole_plan(
        self,
        epoch: int,
        rank: int,
        world_size: int,
        batch_size: int,
        items: np.ndarray | None,
        sequence: np.ndarray | None = None,
    ) -> EpochPlan:
        return plan_epoch(
            len(self.store),
            self.store.chunk_images,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch,
            window=self.window,
            rank=rank,
            world_size=world_size,
            drop_remainder=self.drop_remainder,
            items=items,
            span=self.span,
            batch_size=batch_size,
            sequence=sequence,
        )

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
        """Apply the transform to (x, y); with sample weights the result is (x, y, w).

        A failure becomes a LoaderError naming the batch and its chunks."""
        if self.transform is None:
            return (x, y) if w is None else (x, y, w)
        try:
            out = self.transform(x, y)
            if not isinstance(out, tuple) or len(out) != 2:
                raise TypeError(f"a transform must return a pair (x, y), got {type(out).__name__}")
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
        """Chunk ``chunk``'s compressed bytes, checked, as a uint8 array (a view of the mapped
        file for a local store); errors become LoaderError naming the chunk."""
        store = self.store
        try:
            with FORK_GATE:
                data = store.chunk_buffer(chunk, items=True)
                if self.verify and not store.check_reads:
                    store.check_chunk_bytes(chunk, data)
            return np.frombuffer(data, dtype=np.uint8)
        except Exception as exc:
            raise _chunk_error(store, chunk, exc) from exc

    def decode_chunk(self, chunk: int, out: np.ndarray, fetched: Callable[[], None] | None = None) -> None:
        """Read, check and decompress one chunk into ``out``; errors become LoaderError naming it.
        ``fetched()`` is called once its bytes are in (before they are decompressed)."""
        store = self.store
        try:
            with FORK_GATE:
                data = store.chunk_buffer(chunk)
                if fetched is not None:
                    fetched()
                if self.verify and not store.check_reads:
                    store.check_chunk_bytes(chunk, data)
                # one blosc2 thread per decoder thread: the decoders already run in parallel,
                # and blosc2's own threads on top would oversubscribe the cores (measured: lz4
                # chunks came 1.8x faster this way on 2 cores)
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


def _set_retry_timeout(source: Any, seconds: float) -> None:
    """Give the remote source under ``source`` (behind a cache, say) its retry budget."""
    while source is not None:
        if hasattr(type(source), "retry_timeout"):
            source.retry_timeout = seconds
            return
        source = getattr(source, "inner", None)


def make_spec(store_or_path: Any, batch_size: int, options: LoaderOptions | None = None, **kwargs: Any) -> LoaderSpec:
    """Resolve loader options (an options value, or keyword arguments) against a store."""
    if options is None:
        options = LoaderOptions.from_kwargs(**kwargs)
    elif kwargs:
        options = options.replace(**kwargs)
    store = _open(store_or_path)
    if options.retry_timeout is not None:
        _set_retry_timeout(store.source, options.retry_timeout)
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


# ---------------------------------------------------------------------------------------
# gathering items out of decoded chunks
# ---------------------------------------------------------------------------------------


def gather(
    samples: np.ndarray,
    chunks: np.ndarray,
    slots: np.ndarray,
    arena: np.ndarray,
    chunk_size: int,
    out: np.ndarray | None = None,
    scale: int = 1,
) -> np.ndarray:
    """The items at ``samples`` (any shape) out of decoded chunks.

    Chunk ``chunks[j]`` (sorted) sits in ``arena[slots[j]]``, an array of shape
    (slots, chunk_size, *item_shape). The result has shape ``samples.shape + item_shape``;
    it is written into ``out`` (C-contiguous, that shape) when given, else a new array.
    ``scale`` > 1: the chunks hold images decoded at (H/scale, W/scale), each in the first
    bytes of its full-size slot (:func:`carraystore.format.encoded.reduced_view`); those are gathered.
    """
    s = samples.reshape(-1)
    c = s // chunk_size
    slot = slots[np.searchsorted(chunks, c)]
    flat = slot * chunk_size + (s - c * chunk_size)
    item = arena.shape[2:]
    if scale != 1:
        h, w, *rest = item
        small = (h // scale, w // scale, *rest)
        if out is None:
            out = np.empty((*samples.shape, *small), dtype=arena.dtype)
        rows = arena.reshape(len(arena) * chunk_size, -1)
        m = int(np.prod(small))
        # a strided view of the images' first bytes: take() would copy the whole arena to
        # make it contiguous, so index it (a temporary of the batch's size)
        out.reshape(len(s), m)[...] = rows[flat, :m]
        return out
    if out is None:
        out = np.empty((*samples.shape, *item), dtype=arena.dtype)
    # mode="clip" (the indices are valid) lets take() write straight into out, unbuffered
    np.take(arena.reshape(-1, *item), flat, axis=0, out=out.reshape(-1, *item), mode="clip")
    return out


class BatchBuffers:
    """Batch arrays reused once the consumer has let go of them.

    Writing every batch into fresh memory costs a page fault per 4 KiB, which for large
    images is slower than the copy itself. A buffer is handed out again only when nothing
    outside this pool refers to it (its reference count, which views, queues and
    buffer-protocol exports all raise, is back to the pool's own), so a consumer that
    keeps batches always gets new arrays and never sees one overwritten.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buffers: list[np.ndarray] = []

    def get(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        for buf in self.buffers:
            # references: the list, the loop variable and getrefcount's own argument
            if sys.getrefcount(buf) <= 3 and buf.shape == shape and buf.dtype == dtype:
                return buf
        buf = np.empty(shape, dtype=dtype)
        if len(self.buffers) >= self.capacity:
            self.buffers.pop(0)
        self.buffers.append(buf)
        return buf


# ---------------------------------------------------------------------------------------
# the slot pool, kept across epochs
# ---------------------------------------------------------------------------------------

# Decoded-chunk slots outlive an epoch: the next epoch on the same Store object takes them
# back instead of allocating (and page-faulting) the whole pool again. One idle pool per
# Store, freed with the Store (weak keys) or by release_buffers().
_IDLE_ARENAS: weakref.WeakKeyDictionary[Any, np.ndarray] = weakref.WeakKeyDictionary()
_ARENA_LOCK = threading.Lock()


def _take_arena(store: StoreReader, nslots: int) -> np.ndarray:
    shape = (store.chunk_images, *store.image_shape)
    with _ARENA_LOCK:
        idle = _IDLE_ARENAS.get(store)
        if idle is not None:
            # only an arena of exactly this size: a larger one would hold more than the
            # loader's memory plan counts (memory_budget)
            del _IDLE_ARENAS[store]
            if idle.shape[0] == nslots and idle.shape[1:] == shape and idle.dtype == store.dtype:
                return idle
    return np.empty((nslots, *shape), dtype=store.dtype)


def _give_back_arena(store: StoreReader, arena: np.ndarray) -> None:
    base = arena.base if arena.base is not None else arena
    with _ARENA_LOCK:
        idle = _IDLE_ARENAS.get(store)
        if idle is None or idle.shape[0] < base.shape[0]:
            _IDLE_ARENAS[store] = base


def release_buffers(store: StoreReader | None = None) -> None:
    """Free the decoded-chunk buffers kept for the next epoch (of ``store``, or of every store)."""
    with _ARENA_LOCK:
        if store is None:
            _IDLE_ARENAS.clear()
        else:
            _IDLE_ARENAS.pop(store, None)


# ---------------------------------------------------------------------------------------
# the decoder
# ---------------------------------------------------------------------------------------

_LIVE: weakref.WeakSet[EpochDecoder] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()
#: the decoder last started on each remote source: only it hints the next epoch (an older
#: one's late hint, e.g. a short resumed epoch whose next plan was still being made, would
#: keep or fetch bytes for a read that the epoch after it already made)
_NEWEST: weakref.WeakKeyDictionary[Any, EpochDecoder] = weakref.WeakKeyDictionary()
_NEWEST_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    # the parent's decoder threads do not exist here: forget them, and the locks they held
    global _LIVE_LOCK, _ARENA_LOCK, _NEWEST_LOCK
    _LIVE_LOCK = threading.Lock()
    _NEWEST_LOCK = threading.Lock()
    _ARENA_LOCK = threading.Lock()
    _LIVE.clear()


at_fork_in_child(_after_fork_in_child)


#: Items smaller than this are gathered from decoded chunks: per-item calls cost more than
#: the copy they save (measured: 64x64 RGB images ran at half the speed image by image).
DIRECT_MIN_ITEM_BYTES = 64 * 1024


#: Direct mode by default only up to this many decoder threads: its per-image calls and the
#: batch split into shares contend for the GIL and the decoder's lock, so past 4 threads it
#: got slower while whole chunks kept scaling (measured on 16 cores, 192x192 photos, ``fast``:
#: direct 42k/55k/40k/31k images/s at 2/4/8/16 threads, whole chunks 35k/47k/84k/97k;
#: bench/results/device/probe.log).
DIRECT_MAX_THREADS = 4


def direct_possible(store: StoreReader) -> bool:
    """Whether batches can be decompressed image by image, straight into their slots.

    That needs blocks of one item (the ``fast`` preset on images over 64 KiB, or
    ``Codec(block_images=1)``), no bytedelta filter, and c-blosc2's getitem (see
    :mod:`carraystore.format.blocks`).
    Each item is then decompressed once, into the batch: no decoded chunk in memory.
    """
    codec = store.codec
    return (
        store.meta.layout != "encoded"  # entries are decoded chunk by chunk (FORMAT.md 10)
        and codec.block_images == 1
        # libblosc2's getitem fails on bytedelta chunks (error -18, the filter pipeline): the
        # default preset on images over 64 KiB, e.g. 224x224 RGB, decodes whole chunks instead
        and "bytedelta" not in codec.filters
        and codec.typesize is not None
        and store.meta.image_nbytes % codec.typesize == 0
        and blocks.available()
    )


def direct_ok(store: StoreReader) -> bool:
    """Whether the engine uses direct mode by default: possible, and items large enough."""
    return store.meta.image_nbytes >= DIRECT_MIN_ITEM_BYTES and direct_possible(store)


class _Window:
    """One window of chunks (decoded, or compressed in direct mode): slots, progress, users."""

    __slots__ = ("chunks", "slots", "left", "done", "error", "pins", "unserved", "data", "touched")

    def __init__(self, chunks: np.ndarray, slots: np.ndarray, batches: range) -> None:
        self.chunks = chunks
        self.slots = slots
        self.left = len(chunks)
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.pins = 0
        self.unserved = set(batches)
        #: whether a batch asked for this window yet (windows decoded ahead are not touched)
        self.touched = False
        #: direct mode: each chunk's compressed bytes (uint8 arrays)
        self.data: list[Any] = [None] * len(chunks)
        if not self.left:
            self.done.set()


class LoaderClosed(Exception):
    """Raised inside the engine when a decoder was closed while a batch waited for it."""


#: how long a batch waits for a partly served earlier window to be finished before evicting it
#: (when a thread took on one of that window's batches: counted from the last batch served or
#: window decoded, so the wait goes on while the loader makes progress)
EVICT_PATIENCE_S = 2.0


class EpochDecoder:
    """Batches of one epoch of a :class:`LoaderSpec`, by index, from any thread.

    ``nslots`` chunk slots are allocated once; a window needs as many slots as it has
    chunks (``plan.max_window_chunks`` at most), so ``nslots`` beyond that is how far
    ahead the decoder threads may work. ``batch(i)`` waits for the windows batch ``i``
    draws from, gathers it, and starts decoding the windows after it.

    ``plan`` replaces the epoch's plan (a resumed epoch re-sharded by an adapter);
    ``serves=(k, n)`` says this decoder is asked only for the batches ``b`` with
    ``b % n == k`` (one of ``n`` worker processes): a window is done, and its slots free
    for read-ahead, once those of its batches were served.
    """

    def __init__(
        self,
        spec: LoaderSpec,
        epoch: int,
        nslots: int,
        num_threads: int,
        thread_prefix: str,
        direct: bool | None = None,
        plan: EpochPlan | None = None,
        serves: tuple[int, int] = (0, 1),
    ) -> None:
        self.spec = spec
        self.epoch = epoch
        self.plan: EpochPlan = spec.plan(epoch) if plan is None else plan
        self.serves = (int(serves[0]), max(1, int(serves[1])))
        self.k = spec.store.chunk_images
        self.pid = os.getpid()
        self.nslots = max(1, min(max(nslots, self.plan.max_window_chunks), self.plan.total_chunks))
        #: direct mode: slots hold compressed chunks and batches are decompressed image by image
        self.direct = spec.scale == 1 and (  # reduced images are made from decoded chunks
            direct_ok(spec.store) and num_threads <= DIRECT_MAX_THREADS
            if direct is None
            else bool(direct and direct_possible(spec.store))
        )
        self.arena: np.ndarray | None = None if self.direct else _take_arena(spec.store, self.nslots)
        self._readers = threading.local()
        self.cond = threading.Condition()
        self.free: list[int] = list(range(self.nslots - 1, -1, -1))
        self.windows: OrderedDict[int, _Window] = OrderedDict()
        #: windows whose batches were all served: read-ahead never decodes them again
        self.finished: set[int] = set()
        self.decode_count: dict[int, int] = {}
        #: batches a thread took on and will ask for (:meth:`claim`), until :meth:`batch` returns
        self.claimed: dict[int, int] = {}
        self._progress_at = time.monotonic()  # the last batch served or window decoded
        self.chunks_decoded = 0
        self.out_of_order = False
        self.closed = False
        self._tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._announced = -1  # the last window whose byte ranges the source was told about
        #: a remote source fetches the first window this decoder starts alone (its "lead"):
        #: later windows are neither announced nor fetched until the lead's bytes are in, so
        #: that the first batch waits for one round trip and that window's bytes, not for a
        #: share of the link among every chunk in flight (issue 20)
        self._lead: _Window | None = None
        self._lead_w = -1
        self._lead_need = 0
        self._lead_arrived: set[int] = set()
        self._lead_in = threading.Event()
        self._remote = bool(getattr(spec.store.source, "max_inflight", 0))
        if not self._remote:  # a local file: no link to share
            self._lead_in.set()
        #: a remote source keeps the bytes of the next epoch's first window that this epoch
        #: fetches for a second read, and is told the rest of that window once this epoch's
        #: bytes are all in: the next epoch starts with it in or on its way, instead of after
        #: the link idled while this epoch's last chunks were decoded, and a round trip
        #: (epochs usually follow each other; if none does, it costs one window's bytes)
        self._next_lead: frozenset[int] = frozenset()
        self._kept: set[int] = set()  # chunks of it this epoch fetched, kept for the next
        self._announced_chunks: set[int] = set()
        self._all_announced = threading.Event()
        self._epoch_chunks: list[int] = []
        #: the next epoch's first window was hinted to the source (:meth:`_next_epoch_hint`)
        self.next_epoch_hinted = False
        self.threads = [
            threading.Thread(target=self._decode_loop, name=f"{thread_prefix}-{id(self):x}-decode{i}", daemon=True)
            for i in range(max(1, num_threads))
        ]
        with _LIVE_LOCK:
            _LIVE.add(self)
        for t in self.threads:
            t.start()
        if self._remote:
            with _NEWEST_LOCK, contextlib.suppress(TypeError):  # (a source that takes no weak reference)
                _NEWEST[spec.store.source] = self
            threading.Thread(target=self._next_epoch_hint, name="carraystore-next-epoch", daemon=True).start()

    # -- decoder threads -------------------------------------------------------------------
    def _decode_loop(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            if callable(task):  # a share of a batch to decompress (direct mode)
                task()
                continue
            win, j = task
            lead = win is self._lead
            if not lead:
                self._lead_in.wait()
            fetched = functools.partial(self._lead_fetched, j) if lead else None
            err: BaseException | None = None
            if win.error is None and not self.closed:
                try:
                    if self.direct:
                        win.data[j] = self.spec.fetch_chunk(int(win.chunks[j]))
                    else:
                        assert self.arena is not None
                        self.spec.decode_chunk(int(win.chunks[j]), self.arena[int(win.slots[j])], fetched=fetched)
                except BaseException as exc:  # reported to whoever waits for the window
                    err = exc if isinstance(exc, LoaderError) else LoaderError(f"chunk {int(win.chunks[j])}: {exc!r}")
                    if err is not exc:
                        err.__cause__ = exc
            if lead:  # (in direct mode, after a failure or once closed: decode_chunk did not say)
                self._lead_fetched(j)
            with self.cond:
                if err is not None and win.error is None:
                    win.error = err
                self.chunks_decoded += 1
                win.left -= 1
                if win.left == 0:
                    win.done.set()
                    self._progress_at = time.monotonic()
                    self.cond.notify_all()

    def _lead_fetched(self, j: int) -> None:
        """The lead window's chunk ``j`` is in (or failed; said once or twice): after its
        last, announce and fetch the windows after it."""
        with self.cond:
            if j in self._lead_arrived:
                return
            self._lead_arrived.add(j)
            if len(self._lead_arrived) < self._lead_need or self._lead_in.is_set():
                return
            self._lead_in.set()
            if not self.closed:
                for v in sorted({self._lead_w, *self.windows}):
                    self._announce(v)

    def _next_epoch_hint(self) -> None:
        """Plan the next epoch (in this thread: planning a large store takes a while) and
        mark the chunks of its first window that this epoch fetches from then on as kept for
        it; once this epoch's chunks are all announced and fetched, hint the rest of that
        window. A hint only: the next epoch's order may differ (another loader's options)."""
        try:
            plan = self.spec.plan(self.epoch + 1)
            # the first window this decoder reads (a worker of several reads those of its batches)
            w = next(
                (v for v in range(plan.nwindows) if len(plan.window_chunks[v]) and self._batches_of(v, plan)), None
            )
            if w is None:
                return
            lead = [int(c) for c in plan.window_chunks[w]]
            with self.cond:
                self._next_lead = frozenset(lead)
                # announced before the plan was made: kept if not read yet (the others are
                # hinted with the rest, below)
                store = self.spec.store
                keep = [c for c in lead if c in self._announced_chunks and c not in self._kept]
                keep = [c for c in keep if store.chunks_hinted([c])]
                if keep:
                    self._keep_for_next(keep)
            # until this epoch's chunks are all asked for and in; an epoch stopped before that
            # (closed) hints nothing, one that ended (closed too) as they came in still does
            deadline = time.monotonic() + 600.0  # a stalled epoch: the retries' business, not the hint's
            while not self._all_announced.wait(0.5):
                if self.closed or time.monotonic() > deadline:
                    return
            while not self.spec.store.wait_chunks_fetched(self._epoch_chunks, timeout=0.5):
                if self.closed or time.monotonic() > deadline:
                    return
            with self.cond:
                # and those kept that the source let go (unread for long: stale, or failed a
                # check) once this epoch read them (a chunk it has yet to read is fetched by
                # that read, and the next epoch's by its own)
                store, plan = self.spec.store, self.plan
                done = {v for v, e in self.windows.items() if e.done.is_set()} | self.finished
                unread = {int(c) for v in range(plan.nwindows) if v not in done for c in plan.window_chunks[v]}
                rest = [c for c in lead if c not in self._kept or (c not in unread and not store.chunks_hinted([c]))]
                # again: this epoch may not have read them yet (an epoch reads every chunk)
                self.next_epoch_hinted = self._keep_for_next(rest)
        except Exception:  # e.g. a resumed epoch's options plan no other epoch: no hint
            pass

    def _keep_for_next(self, chunks: list[int]) -> bool:
        """Hint the next epoch's ``chunks`` (kept for its read too), unless a later decoder
        started on this source meanwhile: that epoch hints for itself (lock held). Whether
        they were hinted."""
        with _NEWEST_LOCK:  # held while hinting: a decoder starting now hints after this
            try:
                newest = _NEWEST.get(self.spec.store.source, self)
            except TypeError:
                newest = self
            if newest is not self:
                return False
            self.spec.store.prefetch_chunks(chunks, again=True)
            self._kept.update(chunks)
            return True

    # -- windows ------------------------------------------------------------------------------
    def _batches_of(self, w: int, plan: EpochPlan | None = None) -> range:
        """The batches this decoder serves that draw from window ``w`` (of ``plan``: this
        epoch's by default)."""
        plan = self.plan if plan is None else plan
        b = self.spec.batch_size
        lo, hi = int(plan.window_starts[w]), int(plan.window_starts[w + 1])
        if hi <= lo:
            return range(0)
        first, last = lo // b, (hi - 1) // b + 1
        k, n = self.serves
        if n == 1:
            return range(first, last)
        return range(first + (k - first) % n, last, n)

    def _evictable(self, keep_unserved: bool) -> int | None:
        """A resident window whose slots may be taken (lock held).

        First a window whose batches were all served; then (for a batch that needs slots)
        a window decoded ahead that no batch touched yet, the furthest first; then the
        least recently used one, which will be decoded again when asked for.
        """
        idle = [(w, e) for w, e in self.windows.items() if e.pins == 0 and e.done.is_set()]
        for w, e in idle:
            if not e.unserved:
                return w
        if keep_unserved or not idle:
            return None
        ahead = [w for w, e in idle if not e.touched]
        if ahead:
            return max(ahead)
        return idle[0][0]

    def _drop(self, w: int) -> None:
        e = self.windows.pop(w)
        self.free.extend(int(s) for s in e.slots)
        self.cond.notify_all()

    def _start(self, w: int, wait: bool) -> _Window | None:
        """Reserve slots for window ``w`` and queue its chunks (lock held).

        ``wait``: evict idle windows and wait for slots (a batch needs it); otherwise start
        only if slots are free now, evicting only windows that were fully served.
        """
        chunks = self.plan.window_chunks[w]
        need = len(chunks)
        deadline: float | None = None
        while len(self.free) < need:
            if self.closed:
                raise LoaderClosed
            if w in self.windows:  # started by another thread while this one waited for slots
                return self.windows[w] if wait else None
            victim = self._evictable(keep_unserved=not wait)
            unserved = self.windows[victim].unserved if victim is not None else set()
            claimed = any(b in self.claimed for b in unserved)  # a thread will ask for one of them
            busy = claimed or any(e.pins for e in self.windows.values())  # other threads serve batches
            if victim is not None and victim < w and unserved and busy:
                # The victim's batches come before w's: give the threads serving them time to
                # finish (its slots then free up) rather than decode it twice. For a batch a
                # thread took on, the patience runs from the loader's last progress: on a
                # starved machine it comes, only later.
                now = time.monotonic()
                deadline = now + EVICT_PATIENCE_S if deadline is None else deadline
                if claimed:
                    deadline = max(deadline, self._progress_at + EVICT_PATIENCE_S)
                if now < deadline:
                    self.cond.wait(deadline - now)
                    continue
            if victim is not None:
                self._drop(victim)
                continue
            if not wait:
                return None
            self.cond.wait()
        slots = np.array([self.free.pop() for _ in range(need)], dtype=np.int64)
        win = _Window(chunks, slots, self._batches_of(w))
        self.windows[w] = win
        if not self._lead_in.is_set() and self._lead is None:
            self._lead, self._lead_w, self._lead_need = win, w, need
            store = self.spec.store
            hinted = bool(need) and store.chunks_hinted(chunks)
            if not need or (hinted and store.wait_chunks_fetched(chunks, timeout=0)):
                # nothing to fetch, or its bytes are in (the previous epoch hinted them as its
                # own arrived): the rest may follow at once
                self._lead_in.set()
            elif hinted:
                # on their way: one chunk of the next window (that this decoder reads) beside
                # them keeps the link busy meanwhile (its round trip overlaps theirs) and takes
                # only a share of the link from them (all of the rest at once would delay the
                # first batch)
                nxt = next((v for v in range(w + 1, self.plan.nwindows) if self._batches_of(v)), None)
                if nxt is not None:
                    store.prefetch_chunks(self.plan.window_chunks[nxt][:1])
        n = self.decode_count[w] = self.decode_count.get(w, 0) + 1
        if n > 1:
            self.out_of_order = True
        self._announce(w)
        for j in range(need):
            self._tasks.put((win, j))
        return win

    def _announce(self, w: int) -> None:
        """Tell the byte source which chunks come next: up to a window beyond ``w``; for a
        remote source two windows and at least its ``max_inflight`` chunks beyond it, so that
        many ranged GETs are in flight (the source bounds the bytes it fetches ahead)."""
        want = int(getattr(self.spec.store.source, "max_inflight", 0) or 0)
        if not self._lead_in.is_set():  # the lead window alone until its bytes are in
            if w != self._lead_w or self._announced >= w:
                return
            want, last = 0, w
        else:
            # a remote source gets two windows ahead: the next one is often fetched before it is
            # decoded, and the link must not idle meanwhile
            last = min(self.plan.nwindows - 1, w + (2 if want else 1))
        # only the windows this decoder reads: another worker's are fetched by that worker
        mine = self._batches_of
        n = sum(len(self.plan.window_chunks[v]) for v in range(w + 1, last + 1) if mine(v))
        while n < want and last + 1 < self.plan.nwindows:
            last += 1
            n += len(self.plan.window_chunks[last]) if mine(last) else 0
        if last <= self._announced and w <= self._announced:
            return
        first = max(w, self._announced + 1)
        chunks = [c for v in range(first, last + 1) if mine(v) for c in self.plan.window_chunks[v]]
        self._announced = max(self._announced, last)
        if chunks:
            try:
                self.spec.store.prefetch_chunks(chunks)
                if self._remote:
                    self._announced_chunks.update(int(c) for c in chunks)
                    # the next epoch's first window reads these again: their bytes cross once
                    keep = [int(c) for c in chunks if int(c) in self._next_lead and int(c) not in self._kept]
                    if keep:
                        self._keep_for_next(keep)
            except Exception:  # a hint only
                pass
        if (
            last == self.plan.nwindows - 1
            and self._lead_in.is_set()
            and self._remote
            and not self._all_announced.is_set()
        ):
            # every chunk announced: the rest of the next epoch's first window follows them
            self._epoch_chunks = [int(c) for v in range(w, last + 1) for c in self.plan.window_chunks[v]]
            self._all_announced.set()

    def _acquire(self, w: int) -> _Window:
        with self.cond:
            if self.closed:
                raise LoaderClosed
            win = self.windows.get(w)
            if win is None:
                win = self._start(w, wait=True)
                assert win is not None
            self.windows.move_to_end(w)
            win.pins += 1
            win.touched = True
        win.done.wait()
        if win.error is not None:
            with self.cond:
                win.pins -= 1
                if self.windows.get(w) is win and win.pins == 0:
                    self._drop(w)
            err = win.error
            if isinstance(err, LoaderError):
                raise err
            raise LoaderError(f"{self.spec.store.location}: decoding window {w} failed: {err!r}") from err
        return win

    def claim(self, i: int) -> None:
        """Say that a thread took on batch ``i`` and will ask for it: until it has, the
        windows it draws from are not evicted for later batches (see :meth:`_start`)."""
        with self.cond:
            self.claimed[i] = self.claimed.get(i, 0) + 1

    def unclaim(self, i: int) -> None:
        """Take back :meth:`claim` (:meth:`batch` does once it returns)."""
        with self.cond:
            n = self.claimed.pop(i, 0) - 1
            if n > 0:
                self.claimed[i] = n
            self._progress_at = time.monotonic()
            self.cond.notify_all()

    def _release(self, w: int, win: _Window, batch: int) -> None:
        with self.cond:
            win.pins -= 1
            win.unserved.discard(batch)
            if not win.unserved and win.pins == 0 and self.windows.get(w) is win:
                # served: its slots are the first taken when needed, and until then a batch
                # asked for again (Keras asks for batches 0 and 1 before an epoch) is served
                # without decoding it again
                self.finished.add(w)
                self.cond.notify_all()

    def read_ahead(self, w: int) -> None:
        """Start decoding windows from ``w`` on while slots are free (never evicting unserved ones)."""
        with self.cond:
            while 0 <= w < self.plan.nwindows and not self.closed:
                if (
                    w not in self.windows
                    and w not in self.finished
                    and len(self._batches_of(w))  # a window none of this decoder's batches needs
                    and self._start(w, wait=False) is None
                ):
                    return
                w += 1

    # -- batches --------------------------------------------------------------------------------
    def batch(self, i: int, out: np.ndarray | None = None) -> tuple[Any, ...]:
        """Batch ``i`` of the epoch as ``(x, y)`` (``(x, y, w)`` with ``sample_weight``) after the
        transform (x written into ``out``)."""
        try:
            return self._batch(i, out)
        finally:
            self.unclaim(i)

    def _batch(self, i: int, out: np.ndarray | None) -> tuple[Any, ...]:
        spec, plan = self.spec, self.plan
        a, b = spec.batch_bounds(plan, i)
        if out is None:
            out = np.empty(spec.x_shape(b - a), dtype=spec.store.dtype)
        pos = a
        w = plan.window_of(a)
        while pos < b:
            end = min(b, int(plan.window_starts[w + 1]))
            win = self._acquire(w)
            try:
                if self.direct:
                    self._gather_direct(plan.samples(pos, end), win, out[pos - a : end - a])
                else:
                    assert self.arena is not None
                    gather(
                        plan.samples(pos, end),
                        win.chunks,
                        win.slots,
                        self.arena,
                        self.k,
                        out=out[pos - a : end - a],
                        scale=spec.scale,
                    )
            finally:
                self._release(w, win, i)
            pos = end
            w += 1
        self.read_ahead(plan.window_of(b - 1) + 1 if b > a else 0)
        items = plan.items[a:b]
        return spec.finish(out, spec.y_for(items), i, self.epoch, plan, spec.w_for(items))

    # -- direct mode -------------------------------------------------------------------------------
    def _block_reader(self) -> blocks.BlockReader:
        r = getattr(self._readers, "r", None)
        if r is None:
            codec = self.spec.store.codec
            r = self._readers.r = blocks.BlockReader(
                blocks.library(), int(codec.typesize or 1), self.spec.store.meta.image_nbytes
            )
        return r

    def _decompress_items(self, samples: np.ndarray, win: _Window, out: np.ndarray) -> None:
        reader = self._block_reader()
        k = self.k
        s = samples.reshape(-1)
        flat = out.reshape(len(s), -1)
        where = np.searchsorted(win.chunks, s // k)
        addrs = np.array([d.ctypes.data for d in win.data], dtype=np.int64)
        sizes = np.array([len(d) for d in win.data], dtype=np.int64)
        dests = flat.ctypes.data + np.arange(len(s), dtype=np.int64) * flat.strides[0]
        reader.get_many(addrs[where].tolist(), sizes[where].tolist(), (s % k).tolist(), dests.tolist())

    def _gather_direct(self, samples: np.ndarray, win: _Window, out: np.ndarray) -> None:
        """Decompress the items at ``samples`` into ``out``, shared with the decoder threads."""
        if not out.flags.c_contiguous:
            tmp = np.empty(out.shape, dtype=out.dtype)
            self._gather_direct(samples, win, tmp)
            out[...] = tmp
            return
        if samples.ndim > 1:  # clips: every frame is an item of its own
            samples = samples.reshape(-1)
        n = len(samples)
        parts = min(len(self.threads) + 1, max(1, n // 8))
        if parts <= 1 or self.closed:
            self._decompress_items(samples, win, out)
            return
        bounds = np.linspace(0, n, parts + 1).astype(int)
        flat = out.reshape(n, -1)
        errors: list[BaseException] = []
        left = [parts - 1]
        done = threading.Event()

        def share(lo: int, hi: int) -> Callable[[], None]:
            def run() -> None:
                try:
                    self._decompress_items(samples[lo:hi], win, flat[lo:hi])
                except BaseException as exc:
                    errors.append(exc)
                with self.cond:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

            return run

        for p in range(1, parts):
            self._tasks.put(share(int(bounds[p]), int(bounds[p + 1])))
        try:
            self._decompress_items(samples[: bounds[1]], win, flat[: bounds[1]])
        finally:
            done.wait()
        if errors:
            raise LoaderError(f"{self.spec.store.location}: decompressing a batch failed: {errors[0]!r}") from errors[0]

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop and join the decoder threads; keep the slots for the Store's next epoch."""
        if os.getpid() != self.pid:  # a forked child: these threads are the parent's
            return
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self._lead_in.set()
            for win in self.windows.values():
                if not win.done.is_set():
                    win.error = win.error or LoaderError(
                        f"{self.spec.store.location}: the loader was closed while decoding"
                    )
            self.cond.notify_all()
        for _ in self.threads:
            self._tasks.put(None)
        me = threading.current_thread()
        for t in self.threads:
            if t is not me and t.is_alive():
                t.join(timeout=30)
        with self.cond:
            for win in self.windows.values():
                win.done.set()
            self.windows.clear()
        arena, self.arena = self.arena, None
        if arena is not None and not any(t.is_alive() for t in self.threads):
            _give_back_arena(self.spec.store, arena)
        with _LIVE_LOCK:
            _LIVE.discard(self)


def stop_all() -> None:
    """Stop every decoder of this process (at interpreter exit)."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for d in live:
        d.close()


def batch_index(index: int, num_batches: int) -> int:
    """A random-access adapter's batch ``index`` (negative counts from the end) checked against the epoch."""
    i = int(index)
    if i < 0:
        i += num_batches
    if not 0 <= i < num_batches:
        raise IndexError(f"batch {index} out of range for an epoch of {num_batches} batches")
    return i


def cache_slots(max_window_chunks: int, cache_windows: int, prefetch: int | None) -> int:
    """Chunk slots of a random-access adapter's decoder: ``cache_windows`` windows, and never
    fewer than one window plus the read-ahead."""
    return max(cache_windows * max_window_chunks, max_window_chunks + int(prefetch or 0))


def warn_out_of_order(decoder: EpochDecoder, what: str) -> None:
    """Warn once that batches were asked for out of order (windows decoded twice)."""
    w = next((w for w, n in decoder.decode_count.items() if n > 1), None)
    warnings.warn(
        f"carraystore {what} ({decoder.spec.store.location}): window {w} of epoch {decoder.epoch} was decoded "
        f"{decoder.decode_count.get(w, 0) if w is not None else 0} times; batches are being asked for out of order. model.fit(shuffle=True), "
        "Keras's default, does that: StoreDataset already shuffles, so pass shuffle=False to fit (or raise cache_windows).",
        RuntimeWarning,
        stacklevel=4,
    )

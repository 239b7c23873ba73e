"""Loader options: the one frozen, checked argument set of every loader (layer 4).

Also the machine-dependent defaults and ``targets``/``image_size`` resolved against a store.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np

from carraystore.base.errors import InvalidInputError
from carraystore.base.resources import available_cpus, memory_limit, parse_bytes
from carraystore.engine.resume import ResumePoint
from carraystore.engine.sampling import Shuffle, _check_shuffle
from carraystore.format.encoded import SCALES, reduced_sizes
from carraystore.store.reader import StoreReader, Verify, check_verify

__all__ = [
    "LoaderOptions",
    "LoaderKwargs",
    "LABEL",
    "Targets",
    "map_targets",
    "default_threads",
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
    """Default ``num_threads``: the cores this process may use, at least 2 (reading overlaps decoding)."""
    return max(2, available_cpus())


def default_memory_budget() -> int:
    """Default ``memory_budget``: a quarter of the memory this process may use (RAM or cgroup limit)."""
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


# -- arguments -----------------------------------------------------------------------------


class LoaderKwargs(TypedDict, total=False):
    """Every loader's keyword arguments for ``Unpack[LoaderKwargs]``; see :class:`LoaderOptions`."""

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
    clip_starts: str | None
    verify: Verify
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

    - ``shuffle``: ``"block"`` (chunks in a random order, samples shuffled inside windows of
      ``window`` chunks), ``"global"`` (full permutation, whole shard decoded at once; small
      stores) or False (store order). ``window``: default 16; the first windows ramp up from
      one batch's chunks, so the first batch does not wait for a whole window.
    - ``seed``, ``epoch``: the order depends on them only; use a new ``epoch`` every epoch.
    - ``start_batch``: yield exactly the batches from that index of the epoch.
    - ``resume``: a ``state_dict()`` of any adapter or ``BatchIterator``: its epoch's
      unconsumed rest, re-sharded for this ``world_size`` (which may differ;
      :mod:`carraystore.engine.resume`); ``epoch`` may be left out; not with ``start_batch``.
    - ``rank``, ``world_size``: disjoint equal shards covering every sample
      (``drop_remainder=False`` pads by wrapping around; ``True`` drops the remainder and
      the last short batch).
    - ``transform(x, y) -> (x, y)``: a per-batch numpy function, run in a loader thread.
    - ``label_mode``: ``"int"`` (int64), ``"categorical"`` (float32 one-hot), ``"binary"``
      (float32 0/1, two classes) or None (x only), as in Keras. Unlabelled stores: ``y = None``.
    - ``targets`` (docs/targets.md): ``"label"`` (default): the class labels if the store has
      them, else a field "label"; a field name: that field as stored; a tuple or a dict
      ``{output: name}`` of names: y is a tuple or dict.
    - ``sample_weight``: a field of one number per sample; batches are ``(x, y, w)``, ``w``
      float32 (B,). The transform sees (x, y) only.
    - ``sequence_length=L``: x is (B, L, *item) clips that never cross a group (the key's
      parent folder, or ``groups``, one value per sample), stepping by ``sequence_stride``
      (default L); the class label is the clip's first frame's, a field its **last**
      frame's. ``clip_starts="random"`` shifts each group's clips by a random offset per
      epoch (clip count unchanged); ``"fixed"`` starts at the group's first frame; None
      (default): random when shuffling, fixed when not (validation sees the same clips every epoch).
    - ``verify``: check each chunk's CRC32 before decoding (default True: a local file's chunk
      once per process while the file is unchanged; ``"always"``: every read; remote: always).
    - ``prefetch``: decoded chunks held beyond the current window (default ``window``).
    - ``num_threads``: decoder threads (default :func:`default_threads`); assembler threads:
      one per four (at most 4), one with a ``transform`` (it sees batches in order).
    - ``queue_size``: finished batches waiting for the consumer.
    - ``memory_budget``: bytes or ``"2GB"``/``"512MiB"`` (default a quarter of the process'
      memory) for chunk slots, batch buffers and remote read-ahead; the loader shrinks
      prefetch and assembly to fit, or refuses to start saying what to lower (``.memory``).
    - ``retry_timeout``: remote stores: seconds a failing server is retried (default the
      store's ``retry_timeout``, 120 s); the loader resumes at the same batch, losing nothing.
    - ``image_size=(height, width)``: the stored size divided by 1, 2, 4 or 8 exactly (else
      refused, naming the allowed sizes). JPEG entries decode at that size; other entries
      and pixel stores (uint8 only) are box-averaged. Chunk slots stay full size.
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
    clip_starts: str | None = None
    verify: Verify = True
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
            raise InvalidInputError("transform must be a function (x, y) -> (x, y) or (x, y, w)")
        if self.sequence_length is not None:
            s(self, "sequence_length", _int_arg("sequence_length", self.sequence_length, 1))
            if self.sequence_stride is not None:
                s(self, "sequence_stride", _int_arg("sequence_stride", self.sequence_stride, 1))
        elif self.groups is not None or self.sequence_stride is not None:
            raise InvalidInputError("groups= and sequence_stride= only apply with sequence_length=")
        if self.clip_starts is not None and self.clip_starts not in _CLIP_STARTS:
            raise InvalidInputError(f"clip_starts must be 'random', 'fixed' or None, got {self.clip_starts!r}")
        s(self, "verify", check_verify(self.verify))
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
    def fixed_clips(self) -> bool:
        """Whether clips start at each group's first frame every epoch (``clip_starts``; None: when not shuffling)."""
        return self.clip_starts == "fixed" or (self.clip_starts is None and not self.shuffle)

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
        """A copy with some options changed (checked again); a new ``resume`` brings its own epoch."""
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
    """The factor (1, 2, 4 or 8) ``image_size`` divides the images by; else InvalidInputError."""
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
    """The targets, each name a field or ``_CLASS`` (class label); None when batches have no y."""
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

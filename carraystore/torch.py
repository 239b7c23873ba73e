"""PyTorch: a store as a ``torch.utils.data`` dataset of whole batches (docs/torch.md).

    ds = StoreDataset("train.b2nd", 32)              # rank/world_size from torch.distributed
    loader = StoreDataLoader(ds, num_workers=2)
    for epoch in range(10):
        ds.set_epoch(epoch)
        for x, y in loader: ...                      # x uint8 (B, H, W, C), y int64 (B,)

Batch ``b`` is made by worker ``b % num_workers``: the batches do not depend on the number of
workers. Datasets pickle as location + options (fork, spawn and forkserver all work).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from carraystore.base.errors import InvalidInputError, LoaderError, MissingDependencyError
from carraystore.engine.decoder import BatchBuffers, EpochDecoder
from carraystore.engine.options import LoaderOptions
from carraystore.engine.pipeline import MemoryPlan, OrderedBatches, assemblers_for, plan_memory
from carraystore.engine.random_access import ProcessSpec, WindowCache, batch_index
from carraystore.engine.resume import STATE_VERSION, ResumePoint
from carraystore.engine.sampling import EpochPlan, num_batches
from carraystore.engine.spec import LoaderSpec, make_spec
from carraystore.store.reader import StoreReader

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from carraystore.engine.options import LoaderKwargs

try:
    import torch
    from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingDependencyError("carraystore.torch needs PyTorch: pip install 'carraystore[torch]'") from exc

__all__ = ["StoreDataset", "StoreMapDataset", "StoreDataLoader", "TORCH_THREAD_PREFIX", "STATE_VERSION"]

#: Name prefix of the decoder threads these datasets start.
TORCH_THREAD_PREFIX = "carraystore-torch"


def _distributed() -> tuple[int, int] | None:
    """(rank, world_size) of an initialised torch.distributed process group, else None."""
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return None


def _torch_dtype(dtype: np.dtype) -> Any:
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except TypeError:
        return None


def _tensor(a: Any) -> Any:
    """A numpy array as a torch tensor sharing its memory (a copy only when torch cannot share it)."""
    if isinstance(a, np.ndarray):
        if not a.flags.writeable:
            a = np.array(a)
        try:
            return torch.from_numpy(a)
        except TypeError as exc:
            raise InvalidInputError(
                f"a batch of dtype {a.dtype} cannot become a torch tensor ({exc}); convert it in a transform"
            ) from exc
    return a


def _shared_empty(shape: tuple[int, ...], dtype: Any) -> Any:
    """A tensor in shared memory (a worker's batch crosses to the main process without a copy)."""
    numel = int(np.prod(shape))
    try:  # what torch's own default_collate does in a worker
        empty: Any = torch.empty(0, dtype=dtype)  # Any: torch leaves _typed_storage unannotated
        storage = empty._typed_storage()._new_shared(numel)
        return torch.empty(0, dtype=dtype).new(storage).resize_(shape)
    except Exception:  # pragma: no cover - a torch without the private call
        whole: Any = torch.empty(shape, dtype=dtype)  # Any: torch leaves share_memory_ unannotated
        return whole.share_memory_()


_BUSY = object()


class _CudaStaging:
    """Pinned host buffers reused across batches, copied to the GPU on a side stream.

    A buffer is rewritten only after its copy's CUDA event; the GPU tensor is recorded on the
    consumer's stream, so the caching allocator never reuses it early.
    """

    def __init__(self, device: Any, depth: int = 3) -> None:  # pragma: no cover - needs a GPU
        self.device = device
        self.depth = depth
        cuda: Any = torch.cuda  # Any: torch leaves cuda.Stream unannotated
        self.stream = cuda.Stream(device=device)
        self.slots: list[list[Any]] = []  # [pinned tensor, event or None]

    def host(self, shape: tuple[int, ...], dtype: Any) -> Any:  # pragma: no cover - needs a GPU
        # slot state: _BUSY (handed out, not sent), a CUDA event (copy in flight), or None (free)
        for slot in self.slots:
            t, ev = slot
            if tuple(t.shape) == shape and t.dtype == dtype and ev is not _BUSY and (ev is None or ev.query()):
                slot[1] = _BUSY
                return t
        if len(self.slots) >= self.depth:
            for i, slot in enumerate(self.slots):
                if slot[1] is not _BUSY:
                    self.slots.pop(i)
                    if slot[1] is not None:
                        slot[1].synchronize()
                    break
        t = torch.empty(shape, dtype=dtype, pin_memory=True)
        self.slots.append([t, _BUSY])
        return t

    def send(self, t: Any) -> Any:  # pragma: no cover - needs a GPU
        if not isinstance(t, torch.Tensor):
            return t
        if not t.is_pinned():
            t = t.pin_memory()
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            g = t.to(self.device, non_blocking=True)
            cuda: Any = torch.cuda  # Any: torch leaves cuda.Event unannotated
            ev = cuda.Event()
            ev.record(self.stream)
        for slot in self.slots:
            if slot[0].data_ptr() == t.data_ptr():
                slot[1] = ev
        current.wait_stream(self.stream)
        g.record_stream(current)
        return g


class _StoreBatches:
    """What both datasets share: the store by location, the options, the epoch and its plan, resume state."""

    def __init__(
        self,
        store_or_path: Any,
        batch_size: int,
        options: LoaderOptions | None,
        device: Any,
        pin_memory: bool,
        kwargs: LoaderKwargs,
    ) -> None:
        spec = make_spec(store_or_path, batch_size, options, **kwargs)
        opts = spec.options
        #: rank and world_size not given: those of torch.distributed, looked up again as an epoch is planned
        self._follows_group = opts.world_size == 1 and "rank" not in kwargs and "world_size" not in kwargs
        self._group: tuple[int, int] | None = None
        if self._follows_group:
            self._group = _distributed()
            if self._group is not None:
                opts = opts.replace(rank=self._group[0], world_size=self._group[1])
        self._source = ProcessSpec(dataclasses.replace(spec, options=opts))
        self._batch_size = spec.batch_size
        self.epoch = opts.epoch
        self._plan: tuple[LoaderSpec, int, EpochPlan] | None = None
        #: batches of the current plan handed out in this process (or counted by StoreDataLoader)
        self._seen = 0
        self.device = None if device is None else torch.device(device)
        if self.device is not None and self.device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidInputError(
                f"device={device!r} asks for CUDA, which this torch cannot reach ({torch.__version__}); "
                "pass device=None (CPU tensors)"
            )
        if self.device is not None and self.device.type not in ("cpu", "cuda"):
            raise InvalidInputError(f"device must be None, 'cpu' or a CUDA device, got {device!r}")
        #: pinned host tensors (only where CUDA is available: pinning needs it)
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        if opts.start_batch:  # the same as resuming from the state of that batch
            nb = self.num_batches
            if opts.start_batch > nb:
                raise InvalidInputError(f"start_batch {opts.start_batch} is past the epoch's {nb} batches")
            per_rank = min(opts.start_batch * self._batch_size, len(self.plan()))
            facts = tuple(spec.order_facts().items())
            self._resume_at(ResumePoint(self.epoch, ((opts.world_size, per_rank),), facts, self._batch_size))

    # -- the store, per process ------------------------------------------------------------------
    @property
    def spec(self) -> LoaderSpec:
        """The options resolved against the store (opened again in each new process)."""
        return self._source.get()

    @property
    def store(self) -> StoreReader:
        return self.spec.store

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def options(self) -> LoaderOptions:
        return self._source.options

    @property
    def rank(self) -> int:
        self._join_process_group()
        return self.options.rank

    @property
    def world_size(self) -> int:
        self._join_process_group()
        return self.options.world_size

    # -- the epoch ----------------------------------------------------------------------------------
    def _join_process_group(self) -> None:
        """Take the rank and world size of a torch.distributed process group that appeared after this dataset was built.

        A DataLoader worker started by spawn (the dataset pickled before it knew the group) cannot see the group;
        it refuses by name rather than read every rank's samples.
        """
        if not self._follows_group:
            return
        group = _distributed()
        if group is None:
            env_world = os.environ.get("WORLD_SIZE", "1")
            if self._group is None and get_worker_info() is not None and env_world.isdigit() and int(env_world) > 1:
                raise LoaderError(
                    "this dataset was built before torch.distributed.init_process_group and its DataLoader workers cannot see the process group "
                    f"(WORLD_SIZE={env_world}): every rank would read every sample. Build the dataset after "
                    "init_process_group, or pass rank= and world_size="
                )
            return
        if group == self._group:
            return
        if self.options.resume is not None:
            raise LoaderError(
                f"a torch.distributed process group (rank {group[0]} of {group[1]}) appeared after this dataset was "
                "built with a resume state or start_batch for one process; build the dataset after "
                "init_process_group, or pass rank= and world_size="
            )
        self._group = group
        self._source.set_options(self.options.replace(rank=group[0], world_size=group[1]))
        self._plan = None

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """This rank's order for ``epoch`` (default: the current one; the rest of it when resumed)."""
        self._join_process_group()
        e = self.epoch if epoch is None else int(epoch)
        spec, memo = self.spec, self._plan
        if memo is None or memo[0] is not spec or memo[1] != e:
            memo = self._plan = (spec, e, spec.plan(e))
        return memo[2]

    @property
    def num_batches(self) -> int:
        """Batches of the current epoch on this rank (the batches left of a resumed epoch)."""
        return num_batches(len(self.plan()), self._batch_size, self.options.drop_remainder)

    def __len__(self) -> int:
        """Batches this rank yields this epoch (all workers together)."""
        return self.num_batches

    def set_epoch(self, epoch: int) -> None:
        """Serve ``epoch`` from now on: a new order (call it before every epoch, as with DistributedSampler)."""
        e = int(epoch)
        if e < 0:
            raise InvalidInputError(f"epoch must be >= 0, got {epoch}")
        self.epoch = e
        self._seen = 0

    # -- resuming -------------------------------------------------------------------------------------
    def state_dict(self, batches: int | None = None) -> dict[str, Any]:
        """Where training is, JSON-friendly; any carraystore loader resumes from it as ``resume=``.

        ``batches``: batches of this epoch this rank consumed (default: those counted by
        :class:`StoreDataLoader` or a loop over the dataset). Under DDP any rank's state is every rank's.
        """
        return self.spec.state_dict(self.epoch, self._seen if batches is None else batches)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` (from :meth:`state_dict`) was; the world size may differ from the saver's."""
        self._resume_at(ResumePoint.from_state(state))
        self._seen = 0

    def _resume_at(self, point: ResumePoint) -> None:
        self._source.set_options(self.options.replace(resume=point, epoch=point.epoch, start_batch=0))
        self.epoch = point.epoch

    # -- one batch --------------------------------------------------------------------------------------
    def _host_buffer(self, shape: tuple[int, ...], worker: bool, pool: Any) -> tuple[np.ndarray, Any]:
        """Where batch x is decoded: (numpy view, the tensor behind it or None)."""
        dtype = self.spec.store.dtype
        tdtype = _torch_dtype(dtype)
        if tdtype is None:
            return np.empty(shape, dtype=dtype), None
        if worker:
            t = _shared_empty(shape, tdtype)
        elif isinstance(pool, _CudaStaging):  # pragma: no cover - needs a GPU
            t = pool.host(shape, tdtype)
        elif self.pin_memory:  # pragma: no cover - needs CUDA
            t = torch.empty(shape, dtype=tdtype, pin_memory=True)  # torch's host allocator reuses them safely
        else:
            arr = pool.get(shape, dtype)
            return arr, None
        return t.numpy(), t

    def _deliver(self, batch: tuple[Any, ...], xt: Any, xa: np.ndarray, staging: Any) -> Any:
        """(x, y[, w]) as tensors (x alone without labels), on the device or pinned where asked."""
        x, *rest = batch
        if xt is not None and x is xa:
            x = xt
        parts = [_tensor(v) for v in (x, *rest)]
        if staging is not None:  # pragma: no cover - needs a GPU
            parts = [staging.send(v) for v in parts]
        elif self.pin_memory and get_worker_info() is None:  # pragma: no cover - needs CUDA
            parts = [v.pin_memory() if isinstance(v, torch.Tensor) and not v.is_pinned() else v for v in parts]
        return parts[0] if len(parts) == 2 and parts[1] is None else tuple(parts)

    def _staging(self, worker: bool) -> Any:
        if self.device is None or self.device.type != "cuda":
            return None
        if worker:
            raise InvalidInputError(
                "device='cuda' delivers batches from the main process; use num_workers=0 (decoding already runs in "
                "threads), or device=None and DataLoader(pin_memory=True) with workers"
            )
        return _CudaStaging(self.device)  # pragma: no cover - needs a GPU

    # -- pickling: the location and the options (ProcessSpec), never an open store ---------------------
    def __getstate__(self) -> dict[str, Any]:
        self._join_process_group()  # a worker started by spawn gets the rank the parent has now
        return {**self.__dict__, "_plan": None}

    def __repr__(self) -> str:
        return (
            f"<carraystore.torch.{type(self).__name__} {self._source.location!r} batch_size={self._batch_size} "
            f"rank={self.rank}/{self.world_size} epoch={self.epoch} batches={self.num_batches}>"
        )


def _decode_jpeg_fn() -> tuple[Any, Any]:
    """``torchvision.io.decode_jpeg`` (nvJPEG on a CUDA device) and ``ImageReadMode``, or a named error."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except Exception as exc:  # ImportError, or a torchvision built for another torch (its ops fail to load)
        raise MissingDependencyError(
            f"decode_device= needs a torchvision that matches torch {torch.__version__} "
            f"({type(exc).__name__}: {exc}); install it (pip install torchvision) or leave decode_device out"
        ) from exc
    return decode_jpeg, ImageReadMode


def _on_device(v: Any, device: Any) -> Any:
    """Targets (an array, a tuple or a dict of arrays, or None) as tensors on ``device``."""
    if v is None:
        return None
    if isinstance(v, dict):
        return {k: _on_device(a, device) for k, a in v.items()}
    if isinstance(v, tuple):
        return tuple(_on_device(a, device) for a in v)
    return _tensor(np.asarray(v)).to(device)


class StoreDataset(_StoreBatches, IterableDataset[Any]):
    """A store as an ``IterableDataset`` of whole batches: ``DataLoader(ds, batch_size=None)``.

    Takes every :class:`~carraystore.engine.options.LoaderOptions` field, as keywords or one
    ``options`` value; ``rank``/``world_size`` default to an initialised ``torch.distributed``. Also:

    - ``device``: ``"cuda"`` (or ``"cuda:1"``) copies each batch to the GPU via reused pinned
      buffers on a side stream; main process only (``num_workers=0``). None: CPU tensors.
    - ``pin_memory``: CPU batches in pinned memory (ignored where CUDA is unavailable).
    - ``decode_device``: ``"cuda"`` (``"cpu"`` for torchvision's CPU decoder) decodes the JPEG
      entries of an encoded store with ``torchvision.io.decode_jpeg``, same order, shards and
      resume, ``num_workers=0``; pixels are nvJPEG's, not Pillow's (docs/torch.md). Not with
      clips, ``image_size`` or a numpy ``transform``. Needs torchvision.

    Yields ``(x, y)`` tensors (x alone without labels): x ``(B, H, W, C)`` uint8 for images
    unless a ``transform`` says otherwise, y int64. No copy (``torch.from_numpy``); workers
    decode straight into shared memory.
    """

    def __init__(
        self,
        store_or_path: Any,
        batch_size: int,
        options: LoaderOptions | None = None,
        *,
        device: Any = None,
        pin_memory: bool = False,
        decode_device: Any = None,
        **kwargs: Unpack[LoaderKwargs],
    ) -> None:
        if decode_device is not None:
            dd = torch.device(decode_device)
            if device is not None and torch.device(device) != dd:
                raise InvalidInputError(f"decode_device={decode_device!r} delivers there; device={device!r} differs")
            device = dd
        _StoreBatches.__init__(self, store_or_path, batch_size, options, device, pin_memory, kwargs)
        self.decode_device = None if decode_device is None else torch.device(decode_device)
        if self.decode_device is not None:
            self._check_decode_device()

    def _check_decode_device(self) -> None:
        spec = self.spec
        store = spec.store
        enc = store.meta.encoding
        where = f"{store.location}: decode_device={str(self.decode_device)!r}"
        if store.meta.layout != "encoded" or enc is None or tuple(enc.formats) != ("jpeg",):
            what = "a pixel store" if store.meta.layout != "encoded" else f"entries {list(enc.formats) if enc else []}"
            raise InvalidInputError(f"{where} decodes the JPEG entries of an encoded store; this is {what}")
        if store.meta.color_mode not in ("rgb", "grayscale"):
            raise InvalidInputError(f"{where} decodes RGB or grayscale images, the store's are {store.meta.color_mode}")
        if spec.span != 1 or spec.scale != 1 or spec.transform is not None:
            raise InvalidInputError(
                f"{where} yields whole images as decoded: not with sequence_length, image_size or a numpy transform "
                "(transform the GPU batch in the training step instead)"
            )
        _decode_jpeg_fn()  # torchvision there, and loadable: say so now, not in the first batch

    def _decoded_on_device(self) -> Iterator[Any]:
        """The epoch's batches, each batch's JPEG entries decoded by torchvision on ``decode_device``."""
        if get_worker_info() is not None:
            raise InvalidInputError(
                "decode_device= decodes in the main process (CUDA does not survive fork): use num_workers=0"
            )
        decode_jpeg, modes = _decode_jpeg_fn()
        spec, plan = self.spec, self.plan()
        store = spec.store
        ci = store.chunk_images
        mode = modes.RGB if store.meta.color_mode == "rgb" else modes.GRAY
        shape = tuple(store.image_shape)
        nb = num_batches(len(plan), self._batch_size, self.options.drop_remainder)
        self._seen = 0
        entries: dict[int, list[bytes]] = {}
        window = -1
        for b in range(nb):
            a, e = spec.batch_bounds(plan, b)
            items = plan.items[a:e]
            w = plan.window_of(a)
            if w != window:  # keep the chunks of this window; hint the next one's
                keep = set(plan.window_chunks[w].tolist())
                entries = {c: v for c, v in entries.items() if c in keep}
                if w + 1 < plan.nwindows:
                    store.prefetch_chunks(plan.window_chunks[w + 1])
                window = w
            data = []
            for i in items.tolist():
                c = i // ci
                got = entries.get(c)
                if got is None:
                    got = entries[c] = store.chunk_entries(c, verify=spec.verify)
                data.append(torch.frombuffer(bytearray(got[i - c * ci]), dtype=torch.uint8))
            try:
                images = decode_jpeg(data, mode=mode, device=self.decode_device)
            except Exception as exc:
                raise LoaderError(
                    f"{store.location}: batch {b} of epoch {self.epoch} did not decode on {self.decode_device} "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
            x = torch.stack([im.permute(1, 2, 0) for im in images])
            if tuple(x.shape[1:]) != shape:
                raise LoaderError(
                    f"{store.location}: batch {b} decoded to images of {tuple(x.shape[1:])}, the store's are {shape}"
                )
            y = _on_device(spec.y_for(items), self.decode_device)
            wt = _on_device(spec.w_for(items), self.decode_device)
            self._seen = b + 1
            yield x if y is None else (x, y) if wt is None else (x, y, wt)

    def __iter__(self) -> Iterator[Any]:
        if self.decode_device is not None:
            yield from self._decoded_on_device()
            return
        info = get_worker_info()
        k, n = (int(info.id), int(info.num_workers)) if info is not None else (0, 1)
        worker = info is not None
        staging = self._staging(worker)
        plan = self.plan()
        spec = self.spec
        nb = num_batches(len(plan), self._batch_size, self.options.drop_remainder)
        mine = range(k, nb, n)
        if not worker:
            self._seen = 0
        if not len(mine):
            return
        # a worker's batches are num_workers apart: one assembler each (the workers are the parallelism)
        want = plan.max_window_chunks + int(self.options.prefetch or 0)
        memory = plan_memory(spec, plan, want, 2, 1 if worker else assemblers_for(spec), "StoreDataset")
        if staging is not None:  # pragma: no cover - needs a GPU
            staging.depth = max(staging.depth, memory.batch_buffers)
        pool = staging if staging is not None else BatchBuffers(memory.batch_buffers)
        threads = int(spec.options.num_threads or 1)
        dec = EpochDecoder(spec, self.epoch, memory.slots, threads, TORCH_THREAD_PREFIX, plan=plan, serves=(k, n))

        def buffer(b: int) -> tuple[np.ndarray, Any]:
            a, e = spec.batch_bounds(plan, b)
            xa, xt = self._host_buffer(spec.x_shape(e - a), worker, pool)
            return xa, (b, xa, xt)

        dec.read_ahead(plan.window_of(k * self._batch_size))
        batches = OrderedBatches(dec, mine, buffer, spec.options.queue_size, memory.assemblers, TORCH_THREAD_PREFIX)
        try:
            while True:
                try:
                    batch, (b, xa, xt) = batches.next()
                except StopIteration:
                    return
                out = self._deliver(batch, xt, xa, staging)
                del batch, xa, xt
                if not worker:
                    self._seen = b + 1
                yield out
                del out
        finally:
            batches.stop()


class StoreMapDataset(_StoreBatches, Dataset[Any]):
    """A store as a map-style dataset: ``ds[i]`` is batch ``i`` of this rank's epoch.

    Batches, not samples (a lone sample would decompress its whole chunk). Batch ``i`` depends
    only on (options, epoch, i) and comes from ``cache_windows`` decoded windows cached per
    process, so any sampler over batch indices works. Arguments: :class:`StoreDataset`'s
    but ``device``. :meth:`state_dict` needs the number of batches consumed.
    """

    def __init__(
        self,
        store_or_path: Any,
        batch_size: int,
        options: LoaderOptions | None = None,
        *,
        pin_memory: bool = False,
        cache_windows: int = 3,
        **kwargs: Unpack[LoaderKwargs],
    ) -> None:
        _StoreBatches.__init__(self, store_or_path, batch_size, options, None, pin_memory, kwargs)
        self._windows = WindowCache(cache_windows, TORCH_THREAD_PREFIX, "StoreMapDataset")

    @property
    def cache_windows(self) -> int:
        return self._windows.cache_windows

    @property
    def memory(self) -> MemoryPlan | None:
        """The decoder's slots and buffers, once it started."""
        return self._windows.memory

    def __getitem__(self, index: int) -> Any:
        i = batch_index(index, len(self))
        worker = get_worker_info() is not None
        plan, spec = self.plan(), self.spec
        a, e = spec.batch_bounds(plan, i)
        xa, xt = self._host_buffer(spec.x_shape(e - a), worker, BatchBuffers(1))
        return self._deliver(self._windows.batch(spec, self.epoch, i, xa), xt, xa, None)

    def close(self) -> None:
        """Free the decoded windows and end the decoder threads (they restart on demand)."""
        self._windows.close()


class StoreDataLoader(DataLoader[Any]):
    """``DataLoader(dataset, batch_size=None, ...)`` that counts the batches handed out, for ``state_dict()``.

    Workers are not persistent: each epoch's workers get the dataset's epoch then.
    """

    def __init__(self, dataset: StoreDataset, num_workers: int = 0, **kwargs: Any) -> None:
        if not isinstance(dataset, StoreDataset):
            raise InvalidInputError(
                f"StoreDataLoader takes a carraystore.torch.StoreDataset, got {type(dataset).__name__}"
            )
        if kwargs.get("persistent_workers"):
            raise InvalidInputError(
                "persistent_workers=True would keep each worker's copy of the dataset, and with it the first epoch; "
                "leave it off (workers start in a few milliseconds with fork)"
            )
        if "batch_size" in kwargs and kwargs["batch_size"] is not None:
            raise InvalidInputError("StoreDataset yields whole batches: set the batch size on the dataset")
        kwargs.pop("batch_size", None)
        if num_workers and dataset.device is not None and dataset.device.type == "cuda":
            dataset._staging(worker=True)  # raises: device delivery runs in the main process
        super().__init__(dataset, batch_size=None, num_workers=num_workers, **kwargs)
        self._store_dataset = dataset

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        ds = self._store_dataset
        counting = self.num_workers > 0
        if counting:
            ds._seen = 0
        for batch in super().__iter__():
            if counting:
                ds._seen += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The dataset's :meth:`StoreDataset.state_dict`."""
        return self._store_dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The dataset's :meth:`StoreDataset.load_state_dict`."""
        self._store_dataset.load_state_dict(state)

"""Grain (JAX): a store as a random-access data source.

    source = StoreDataSource("train.b2nd")
    sampler = grain.IndexSampler(len(source), grain.NoSharding(), shuffle=True, num_epochs=1, seed=0)
    loader = grain.DataLoader(data_source=source, sampler=sampler, operations=[grain.Batch(32)])

:class:`StoreDataSource` follows Grain's ``RandomAccessDataSource`` protocol, so Grain's
samplers, sharding, workers and checkpointing apply. A record is one sample, served from a
per-process cache of decoded chunks sized by ``memory_budget`` (a quarter of the memory
limit by default): a store that fits is decoded once per process, and Grain's global
shuffle then costs a lookup and a copy per record. Beyond the budget a global shuffle
decodes about one chunk per record. Pickles as location + options. Grain is not
imported: the protocol is structural.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from carraystore.api.store import open_store
from carraystore.base.errors import InvalidInputError
from carraystore.base.resources import format_bytes, memory_limit
from carraystore.engine.options import LoaderOptions
from carraystore.engine.random_access import ProcessSpec
from carraystore.engine.spec import LoaderSpec, make_spec
from carraystore.format.encoded import reduced_view
from carraystore.store.reader import StoreReader

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from carraystore.engine.options import LoaderKwargs

__all__ = ["StoreDataSource", "CacheInfo"]

#: the loader options a source takes: what one record is, and ``memory_budget`` (its cache);
#: the others order, shard or batch records
RECORD_OPTIONS = (
    "targets",
    "label_mode",
    "sample_weight",
    "verify",
    "retry_timeout",
    "image_size",
    "memory_budget",
)
#: the default cache grows only while this share of the memory limit stays available
RESERVE_SHARE = 8

_CGROUP = Path("/sys/fs/cgroup")


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and not isinstance(a, np.ndarray) and bool(a == b))


def _record_options(options: LoaderOptions | None, kwargs: dict[str, Any]) -> tuple[LoaderOptions, bool]:
    """The options, and whether ``memory_budget`` was given; refuses by name those that do not apply."""
    opts = LoaderOptions.from_kwargs(**kwargs) if options is None else options.replace(**kwargs)
    default = LoaderOptions()
    given = set(kwargs) | {
        f.name for f in dataclasses.fields(opts) if not _same(getattr(opts, f.name), getattr(default, f.name))
    }
    odd = given - set(RECORD_OPTIONS)
    if odd:
        raise InvalidInputError(
            f"StoreDataSource serves one record by index: {sorted(odd)} do not apply (Grain's sampler orders, "
            f"shards and epochs the records, its operations batch and transform them); it takes {list(RECORD_OPTIONS)}"
        )
    return opts, "memory_budget" in given


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _available_memory() -> int | None:
    """Bytes of memory still available to this process (the machine's and the cgroup's), None if unknown."""
    avail: int | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit_name, usage_name in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        limit, usage = _read_int(_CGROUP / limit_name), _read_int(_CGROUP / usage_name)
        if limit is None or usage is None or limit >= 1 << 60:
            continue
        inactive = 0  # page cache the kernel reclaims before it runs out
        try:
            stat = (_CGROUP / Path(usage_name).parent / "memory.stat").read_text()
            for line in stat.splitlines():
                key, _, value = line.partition(" ")
                if key in ("inactive_file", "total_inactive_file"):
                    inactive = int(value)
        except (OSError, ValueError):
            pass
        left = max(0, limit - usage + inactive)
        avail = left if avail is None else min(avail, left)
        break
    return avail


def _row(y: Any) -> Any:
    """Sample 0 of a batch's y (an array, a tuple or a dict of arrays)."""
    if isinstance(y, dict):
        return {k: v[0] for k, v in y.items()}
    if isinstance(y, tuple):
        return tuple(v[0] for v in y)
    return y[0]


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """This process's cache of decoded chunks (:meth:`StoreDataSource.cache_info`)."""

    #: the most bytes it may hold
    limit: int
    #: bytes it holds now, and the chunks
    nbytes: int
    chunks: int
    #: bytes the whole store takes decoded (at ``image_size``)
    store_nbytes: int
    #: chunks this process decoded (a chunk dropped and needed again counts again)
    decoded: int
    #: whether the default cache stopped growing because memory ran short
    held_back: bool


class _Cache:
    """One process's decoded chunks: lookups without a lock, each chunk decoded by one thread at a time."""

    def __init__(self, owner: StoreDataSource) -> None:
        self.pid = os.getpid()
        self.spec = owner.spec
        store = self.spec.store
        self.k = store.chunk_images
        self.nimages = len(store)
        #: bytes of one cached chunk (a full-size chunk buffer, or a chunk of reduced images, compact)
        self.chunk_cost = (store.chunk_nbytes if self.spec.scale == 1 else self.k * self.spec.item_nbytes) or 1
        self.store_nbytes = self.chunk_cost * store.nchunks
        if owner.cache_chunks is not None:
            self.limit = owner.cache_chunks * self.chunk_cost
        else:
            self.limit = max(int(owner.options.memory_budget or 0), self.chunk_cost)
        #: the default cache, unless memory_budget or cache_chunks were given: it keeps memory available
        self.guarded = owner.cache_chunks is None and not owner.budget_given
        self.whole = self.limit >= self.store_nbytes
        self.lock = threading.Lock()
        self.chunks: OrderedDict[int, np.ndarray] = OrderedDict()
        self.loading: dict[int, threading.Event] = {}
        self.nbytes = 0
        self.decoded = 0
        self.held_back = False
        self.prefetched = False

    def get(self, c: int) -> np.ndarray:
        arr = self.chunks.get(c)
        if arr is not None:
            if not self.whole:
                with self.lock:
                    if c in self.chunks:
                        self.chunks.move_to_end(c)
            return arr
        return self._load(c)

    def _load(self, c: int) -> np.ndarray:
        spec = self.spec
        while True:
            with self.lock:
                arr = self.chunks.get(c)
                if arr is not None:
                    return arr
                waiting = self.loading.get(c)
                if waiting is None:
                    done = self.loading[c] = threading.Event()
                    first, self.prefetched = not self.prefetched, True
                    break
            waiting.wait()  # another thread decodes it; if that failed, this one tries (and raises) itself
        try:
            if first and self.whole:  # every chunk is wanted soon: a remote source fetches ahead
                spec.store.prefetch_chunks(range(spec.store.nchunks))
            # outside the lock: Grain's threads decode different chunks in parallel, one blosc2 thread each
            buf = np.empty((self.k, *spec.store.image_shape), dtype=spec.store.dtype)
            spec.decode_chunk(c, buf)  # checked (verify), under the fork gate; a LoaderError names the chunk
            arr = buf if spec.scale == 1 else np.ascontiguousarray(reduced_view(buf, spec.scale))  # compact
            grow = not self.guarded or self._memory_allows()
            with self.lock:
                self.decoded += 1
                if not grow and self.chunks:
                    self.limit = min(self.limit, self.nbytes)
                self.chunks[c] = arr
                self.nbytes += self.chunk_cost
                while self.nbytes > self.limit and len(self.chunks) > 1:
                    self.chunks.popitem(last=False)
                    self.nbytes -= self.chunk_cost
                if not grow and not self.held_back:
                    self.held_back, self.whole = True, False
                    self._warn_held_back()
            return arr
        finally:
            with self.lock:
                del self.loading[c]
            done.set()

    def _memory_allows(self) -> bool:
        """Whether the default cache may grow by a chunk and leave the reserve available."""
        if self.nbytes + self.chunk_cost > self.limit:
            return True  # it evicts rather than grows
        avail = _available_memory()
        return avail is None or avail - self.chunk_cost >= memory_limit() // RESERVE_SHARE

    def _warn_held_back(self) -> None:
        warnings.warn(
            f"carraystore StoreDataSource ({self.spec.store.location}): the cache of decoded chunks stopped at "
            f"{format_bytes(self.nbytes)} of the {format_bytes(self.store_nbytes)} the store takes decoded, as less "
            f"than 1/{RESERVE_SHARE} of memory is available (in this process; each Grain worker process has a cache "
            "of its own); records of other chunks decode a whole chunk each. Use fewer worker processes, free "
            "memory, or pass memory_budget= (per process) to set the cache's size yourself.",
            RuntimeWarning,
            stacklevel=5,
        )

    def info(self) -> CacheInfo:
        with self.lock:
            return CacheInfo(self.limit, self.nbytes, len(self.chunks), self.store_nbytes, self.decoded, self.held_back)


class StoreDataSource:
    """Record ``i`` of a store as ``{"image": (H, W, C) array, "label": int64}`` (no label when unlabelled).

    - ``store_or_path``: a Store, a path or a URL (``storage_options`` for URLs).
    - ``memory_budget``: bytes or ``"2GB"`` of decoded chunks kept per process (default a
      quarter of the memory limit): the whole store when it fits, decoded once per process.
      Unless it is given, the cache also stops growing while less than an eighth of memory
      is available (a warning says so). ``cache_chunks``: a number of chunks instead.
    - ``with_key``: add ``"key"`` (the sample's source name) where the store has keys.
    - the loader options of :data:`RECORD_OPTIONS`, as keywords or one ``options``:
      ``image_size``, ``verify`` (default True), ``targets``/``label_mode`` (``"label"`` is y
      as the loaders give it), ``sample_weight`` (``"sample_weight"``, float32),
      ``retry_timeout``, ``memory_budget``. Any other loader option is refused by name.
    """

    def __init__(
        self,
        store_or_path: Any,
        options: LoaderOptions | None = None,
        *,
        cache_chunks: int | None = None,
        with_key: bool = False,
        storage_options: dict[str, Any] | None = None,
        **kwargs: Unpack[LoaderKwargs],
    ) -> None:
        opts, self.budget_given = _record_options(options, dict(kwargs))
        if cache_chunks is not None:
            if isinstance(cache_chunks, bool) or int(cache_chunks) != cache_chunks or cache_chunks < 1:
                raise InvalidInputError(f"cache_chunks must be an integer >= 1, got {cache_chunks!r}")
            if self.budget_given:
                raise InvalidInputError(
                    "give memory_budget= (bytes of decoded chunks per process) or cache_chunks= (a number of "
                    "chunks), not both"
                )
            cache_chunks = int(cache_chunks)
        self.cache_chunks: int | None = cache_chunks
        if isinstance(store_or_path, (str, os.PathLike)):
            store_or_path = open_store(store_or_path, storage_options)
        self._source = ProcessSpec(make_spec(store_or_path, 1, opts))
        self.with_key = bool(with_key)
        self._setup()

    def _setup(self) -> None:
        self._cache_lock = threading.Lock()
        self._cache: _Cache | None = None

    def _process_cache(self) -> _Cache:
        c = self._cache
        if c is not None and c.pid == os.getpid():
            return c
        if c is not None:  # a forked child: the parent's cache and lock are not ours
            self._setup()
        with self._cache_lock:
            if self._cache is None:
                self._cache = _Cache(self)
            return self._cache

    @property
    def options(self) -> LoaderOptions:
        return self._source.options

    @property
    def spec(self) -> LoaderSpec:
        """The options resolved against the store, opened again in each new process."""
        return self._source.get()

    @property
    def store(self) -> StoreReader:
        return self.spec.store

    def cache_info(self) -> CacheInfo:
        """This process's cache: its limit, what it holds, the chunks it decoded so far."""
        return self._process_cache().info()

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, record_key: int) -> dict[str, Any]:
        cache = self._process_cache()
        n = cache.nimages
        i = int(record_key)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"record {record_key} out of range for a store of {n} images")
        k = cache.k
        image = cache.get(i // k)[i % k].copy()  # a copy: the cached chunk may be dropped, and records are mutable
        out: dict[str, Any] = {"image": image}
        spec = cache.spec
        if spec.has_y or spec.options.sample_weight is not None:
            items = np.array([i], dtype=np.int64)
            if spec.has_y:
                out["label"] = _row(spec.y_for(items))
            w = spec.w_for(items)
            if w is not None:
                out["sample_weight"] = w[0]
        if self.with_key:
            keys = spec.store.keys
            if keys is not None:
                out["key"] = keys[i]
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {
            "_source": self._source,
            "cache_chunks": self.cache_chunks,
            "budget_given": self.budget_given,
            "with_key": self.with_key,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"cache_chunks": None, "budget_given": False, **state})
        self._setup()

    def __repr__(self) -> str:
        # Grain's checkpoints compare it: the location and the record count, nothing per process
        return f"StoreDataSource({self._source.location!r}, records={len(self)})"

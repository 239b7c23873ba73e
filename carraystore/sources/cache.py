"""A local chunk cache in front of a remote byte source (layer 2).
``carraystore.open(url, cache_dir=..., cache_size=...)`` wraps the source in a :class:`CachedSource`:
each range read is one file under ``cache_dir/<identity hash>/`` (URL, size, ETag or mtime), so a
changed object gets a new folder; the first open of a new identity removes older ones of the URL.
Files are renamed into place (processes share them without locks) and carry a CRC-32 checked on
reuse. Eviction resists scans: ranges have fixed scores (a keyed hash) and the cache keeps the
lowest that fit ``cache_size``, independent of epoch order, so half the store cached saves half of
each later epoch's bytes (LRU would save none)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import stat
import struct
import tempfile
import threading
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from carraystore.base.errors import CacheFolderError, InvalidInputError
from carraystore.format.frame import ByteSource, LinkCounters, ReadAheadSource

__all__ = ["CachedSource", "CacheStats", "parse_size"]

_MAGIC = b"CSCH"
_HEADER = struct.Struct("<4sIQ")  # magic, crc32 of the payload, payload length
_SUFFIX = ".chunk"
#: Temporary files older than this (seconds) were left by a crashed process.
_STALE_TEMP_S = 3600.0

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}  # fmt: skip


def parse_size(value: int | str | None) -> int | None:
    """Bytes from an int or a string such as ``"20GB"`` or ``"512MiB"`` (None: no limit)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidInputError(f"cache_size must be bytes or a size such as '20GB', got {value!r}")
    if isinstance(value, (int, float)):
        n = int(value)
    else:
        text = str(value).strip().lower().replace(" ", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(num) :]
        if unit not in _UNITS or not num:
            raise InvalidInputError(f"cache_size {value!r}: use bytes or a size such as '20GB', '512MiB'")
        n = int(float(num) * _UNITS[unit])
    if n < 0:
        raise InvalidInputError(f"cache_size must be >= 0, got {value!r}")
    return n


class CacheStats:
    """Counters: ``hits``/``misses`` (ranges), ``fetched_bytes``, ``stored``/``evicted`` (files), ``bad`` (damaged,
    deleted), and the inner source's ``requests``, ``bytes``, ``retries``, ``coalesced`` (0 if it counts none)."""

    _INNER = ("requests", "bytes", "retries", "coalesced")

    def __init__(self, inner: LinkCounters | None = None) -> None:
        self.hits = 0
        self.misses = 0
        self.fetched_bytes = 0
        self.stored = 0
        self.evicted = 0
        self.bad = 0
        self._inner = inner

    requests = property(lambda self: self._inner.requests if self._inner else 0, doc="GETs the inner source sent")
    bytes = property(lambda self: self._inner.bytes if self._inner else 0, doc="bytes the inner source received")
    retries = property(lambda self: self._inner.retries if self._inner else 0, doc="retries of the inner source")
    coalesced = property(
        lambda self: self._inner.coalesced if self._inner else 0, doc="ranges served by coalesced GETs"
    )

    def as_dict(self) -> dict[str, int]:
        own = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return {**own, **{k: getattr(self, k) for k in self._INNER}}

    def __repr__(self) -> str:
        return f"CacheStats({', '.join(f'{k}={v}' for k, v in self.as_dict().items())})"


class CachedSource:
    """``source`` with its ranges kept under ``cache_dir`` (at most ``cache_size`` bytes; None: no limit);
    a :class:`~carraystore.format.frame.ReadAheadSource` whose read-ahead is the inner source's."""

    def __init__(
        self, source: ByteSource, cache_dir: str | os.PathLike[str], cache_size: int | str | None = None
    ) -> None:
        self.inner = source
        #: the inner source, when it reads ahead over a link
        self.link: ReadAheadSource | None = source if isinstance(source, ReadAheadSource) else None
        self.location = source.location
        self.cache_size = parse_size(cache_size)
        identity = self.link.identity if self.link else f"{source.location}|{source.size()}"
        self.identity = identity
        self._salt = hashlib.blake2b(identity.encode(), digest_size=16).digest()
        self.dir = Path(cache_dir).expanduser() / hashlib.sha256(identity.encode()).hexdigest()[:32]
        try:
            self.dir.parent.mkdir(parents=True, exist_ok=True)
            _own_folder(self.dir, source.location)
            marker = self.dir / "SOURCE"
            if not marker.exists():
                _atomic_write(self.dir, marker, identity.encode() + b"\n")
                _remove_replaced(self.dir.parent, identity)
        except OSError as exc:
            if isinstance(exc, CacheFolderError):
                raise
            raise InvalidInputError(
                f"cache_dir {cache_dir}: cannot hold the chunk cache of {source.location} ({type(exc).__name__}: {exc}); "
                "give a writable folder on a local disk, or no cache_dir"
            ) from exc
        self.stats = CacheStats(self.link.stats if self.link else None)
        self._lock = threading.Lock()
        self._admit_lock = threading.Lock()
        #: the lowest score turned away for lack of room: the kept ranges are those below it
        self._ceiling: int | None = None
        # range -> (score, file bytes), rescanned when the folder changed under it or looks full
        self._entries: dict[tuple[int, int], tuple[int, int]] = {}
        self._dir_mtime = -1
        self._rescan()

    # -- scores and names ----------------------------------------------------------------
    def score(self, offset: int, length: int) -> int:
        """The fixed rank of a range: lower scores are kept first (a pure hash, no order)."""
        h = hashlib.blake2b(struct.pack("<QQ", offset, length), key=self._salt, digest_size=8).digest()
        return int.from_bytes(h, "little")

    def path_of(self, offset: int, length: int) -> Path:
        return self.dir / f"{offset:016x}-{length:x}{_SUFFIX}"

    @staticmethod
    def _parse_name(name: str) -> tuple[int, int] | None:
        if not name.endswith(_SUFFIX):
            return None
        try:
            a, b = name[: -len(_SUFFIX)].split("-")
            return int(a, 16), int(b, 16)
        except ValueError:
            return None

    def _dir_changed(self) -> bool:
        try:
            return os.stat(self.dir).st_mtime_ns != self._dir_mtime
        except OSError:
            return True

    def _rescan(self) -> None:
        """Rebuild the view of what is cached from the directory (other processes write too)."""
        entries: dict[tuple[int, int], tuple[int, int]] = {}
        try:
            self._dir_mtime = os.stat(self.dir).st_mtime_ns
        except OSError:
            self._dir_mtime = -1
        now = time.time()
        with os.scandir(self.dir) as it:
            for e in it:
                if e.name.startswith(".tmp-"):
                    try:
                        if now - e.stat().st_mtime > _STALE_TEMP_S:
                            os.unlink(e.path)
                    except OSError:
                        pass
                    continue
                rng = self._parse_name(e.name)
                if rng is None:
                    continue
                try:
                    size = e.stat().st_size
                except OSError:
                    continue
                entries[rng] = (self.score(*rng), size)
        with self._lock:
            self._entries = entries

    def cached_bytes(self) -> int:
        """Bytes of cache files this process knows of."""
        with self._lock:
            return sum(size for _, size in self._entries.values())

    # -- ByteSource ------------------------------------------------------------------------
    def size(self) -> int:
        return self.inner.size()

    def _load(self, offset: int, length: int) -> memoryview | None:
        path = self.path_of(offset, length)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except OSError:  # absent, or evicted by another process meanwhile
            with self._lock:
                self._entries.pop((offset, length), None)
            return None
        ok = len(blob) >= _HEADER.size
        if ok:
            magic, crc, n = _HEADER.unpack_from(blob)
            payload = memoryview(blob)[_HEADER.size :]  # no copy
            ok = magic == _MAGIC and n == length == len(payload) and zlib.crc32(payload) == crc
        if ok:
            return payload
        # truncated or damaged: drop it, fetch again
        with self._lock:
            self.stats.bad += 1
            self._entries.pop((offset, length), None)
        try:
            path.unlink()
        except OSError:
            pass
        return None

    def read(self, offset: int, length: int) -> bytes | memoryview:
        cached = self._load(offset, length)
        if cached is not None:
            with self._lock:
                self.stats.hits += 1
            # bytes the inner source fetched ahead would wait for a read that never comes
            if self.link and self.link.max_inflight:
                self.link.discard(offset, length)
            return cached
        data = self.inner.read(offset, length)
        if offset + length <= self.head_bytes:
            return data  # the inner source holds these in memory: nothing to fetch or keep
        with self._lock:
            self.stats.misses += 1
            self.stats.fetched_bytes += len(data)
        self._maybe_store(offset, length, data)
        return data

    def discard(self, offset: int, length: int) -> None:
        """Forget this range here and in the inner source (it failed a check): the next read refetches."""
        with self._lock:
            self._entries.pop((offset, length), None)
        try:
            self.path_of(offset, length).unlink()
        except OSError:
            pass
        if self.link:
            self.link.discard(offset, length)

    def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes | memoryview]:
        self.prefetch(ranges)
        return [self.read(o, n) for o, n in ranges]

    def prefetch(self, ranges: Sequence[tuple[int, int]], again: bool = False) -> None:
        """Pass on the ranges not in the cache."""
        missing = self._missing(ranges)
        if missing:
            self.inner.prefetch(missing, again=again)

    # -- ReadAheadSource: the inner source's link ------------------------------------------
    max_inflight = property(lambda self: self.link.max_inflight if self.link else 0, doc="the inner source's GETs")
    readahead_bytes = property(lambda self: self.link.readahead_bytes if self.link else 0, doc="the inner's bound")
    head_bytes = property(lambda self: self.link.head_bytes if self.link else 0, doc="held by the inner source")

    @property
    def retry_timeout(self) -> float:
        """The inner source's retry budget, in seconds."""
        return self.link.retry_timeout if self.link else 0.0

    @retry_timeout.setter
    def retry_timeout(self, seconds: float) -> None:
        if self.link:
            self.link.retry_timeout = seconds

    def hinted(self, ranges: Sequence[tuple[int, int]]) -> bool:
        """Every range is in the cache, or the inner source fetches it ahead."""
        missing = self._missing(ranges)
        return not missing or (self.link is not None and self.link.hinted(missing))

    def _missing(self, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """The ranges the cache does not hold (in this process's index or on disk)."""
        with self._lock:
            missing = [(int(o), int(n)) for o, n in ranges if (int(o), int(n)) not in self._entries]
        return [r for r in missing if not self.path_of(*r).exists()]

    def wait_prefetched(self, ranges: Sequence[tuple[int, int]], timeout: float | None = None) -> bool:
        """The inner source's ``wait_prefetched`` (True when there is none)."""
        return self.link.wait_prefetched(ranges, timeout) if self.link else True

    # -- admission and eviction ----------------------------------------------------------------
    def _maybe_store(self, offset: int, length: int, data: bytes | memoryview) -> None:
        with self._admit_lock:  # one decision at a time: the budget holds in this process
            self._admit(offset, length, data)

    def _admit(self, offset: int, length: int, data: bytes | memoryview) -> None:
        need = _HEADER.size + len(data)
        budget = self.cache_size
        if budget is not None and need > budget:
            return
        s = self.score(offset, length)
        if self._ceiling is not None and s >= self._ceiling:
            return  # ranks at or above a range already turned away: keep the kept set a prefix
        victims: list[tuple[int, int]] = []
        if budget is not None:
            with self._lock:
                used = sum(size for _, size in self._entries.values())
            if used + need > budget or self._dir_changed():
                self._rescan()  # other processes may have added or evicted files
            with self._lock:
                used = sum(size for _, size in self._entries.values())
                if used + need > budget:
                    by_score = sorted(self._entries.items(), key=lambda kv: kv[1][0], reverse=True)
                    free = used
                    for rng, (sc, size) in by_score:
                        if free + need <= budget:
                            break
                        if sc <= s:
                            break
                        victims.append(rng)
                        free -= size
                    if free + need > budget:
                        # everything cached ranks below: not stored, nor anything ranking at or above it
                        self._ceiling = s if self._ceiling is None else min(self._ceiling, s)
                        return
                for rng in victims:
                    self._entries.pop(rng, None)
        for rng in victims:
            try:
                self.path_of(*rng).unlink()
                with self._lock:
                    self.stats.evicted += 1
            except FileNotFoundError:
                pass
            except OSError:
                pass
        blob = _HEADER.pack(_MAGIC, zlib.crc32(data), len(data)) + bytes(data)
        try:
            _atomic_write(self.dir, self.path_of(offset, length), blob)
        except OSError:
            return  # a full or read-only disk: the read still succeeds, uncached
        with self._lock:
            self._entries[(offset, length)] = (s, len(blob))
            self.stats.stored += 1
        if not victims and self._dir_mtime >= 0:
            # our own write changed the folder: remember that, so only others' changes rescan
            try:
                self._dir_mtime = os.stat(self.dir).st_mtime_ns
            except OSError:
                pass

    def close(self) -> None:
        self.inner.close()

    # -- pickling: the inner source re-opens itself; the cache is files -----------------------
    def __getstate__(self) -> dict[str, Any]:
        return {"inner": self.inner, "cache_dir": str(self.dir.parent), "cache_size": self.cache_size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        other = CachedSource(state["inner"], state["cache_dir"], state["cache_size"])
        self.__dict__.update(other.__dict__)

    def __repr__(self) -> str:
        return f"<CachedSource {self.location!r} in {str(self.dir)!r} size={self.cache_size}>"


def _own_folder(folder: Path, location: str) -> None:
    """Create ``folder`` (mode 0700) or check it is a real folder (no link followed), ours, not
    writable by others; CacheFolderError otherwise."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    why = ""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        why = "a symbolic link" if stat.S_ISLNK(os.lstat(folder).st_mode) else "not a folder"
    else:
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            why = f"owned by another user (uid {st.st_uid})"
        elif st.st_mode & 0o022:
            why = f"writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    if why:
        raise CacheFolderError(
            f"{folder}: the chunk cache folder of {location} is {why}; the cache never writes through one "
            "(someone else could plant or read its files). Remove it, or give a cache_dir of your own "
            "(e.g. under your home folder)"
        )


def _url_of(identity: str) -> str:
    """The URL part of an identity ``URL|size|ETag-or-mtime``."""
    return identity.rsplit("|", 2)[0]


def _remove_replaced(cache_dir: Path, identity: str) -> None:
    """Remove the folders under ``cache_dir`` that cache an older identity of the same URL."""
    url = _url_of(identity)
    try:
        folders = [e for e in os.scandir(cache_dir) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for e in folders:
        try:
            held = (Path(e.path) / "SOURCE").read_text().strip()
        except (OSError, UnicodeDecodeError):
            continue  # not one of ours, or being created
        if held != identity and _url_of(held) == url:
            shutil.rmtree(e.path, ignore_errors=True)


def _atomic_write(directory: Path, path: Path, blob: bytes) -> None:
    """Write ``blob`` to ``path`` through a temporary file and a rename: complete or absent."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise

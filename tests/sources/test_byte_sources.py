"""One set of tests of the ByteSource protocol (carraystore/format/frame.py), run on every source.

:class:`ByteSourceTests` holds the tests; each subclass gives a ``make_source`` fixture
that returns ``make(data) -> ByteSource``, a source over exactly those bytes. Subclasses:
the local file (sources/local.py), remote sources over a plain HTTP Range server and over
SeaweedFS's S3 gateway (sources/remote.py), the local chunk cache, cold and warm, over a
local file and over a remote source (sources/cache.py), and the journal's view of a store
before an unfinished write (sources/journal.py). :class:`ReadAheadSourceTests` adds the
tests of the ReadAheadSource protocol, run on every source over a link.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from carraystore.base.errors import CorruptStoreError
from carraystore.format.frame import ByteSource, ReadAheadSource
from carraystore.sources.cache import CachedSource
from carraystore.sources.journal import Journal, JournalSource
from carraystore.sources.local import LocalFileSource
from carraystore.sources.remote import RemoteSource

Make = Callable[[bytes], ByteSource]

SIZE = 150_001  # odd on purpose: no range is aligned by chance


def _data(size: int = SIZE, seed: int = 5) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


#: (offset, length) ranges worth reading: the start, the end, single bytes, empty reads
RANGES = [(0, 1), (0, 4096), (1, 0), (SIZE - 1, 1), (SIZE - 4097, 4097), (77_777, 12_345), (SIZE, 0), (4095, 2)]


class ByteSourceTests:
    """The ByteSource protocol. A subclass defines the fixture ``make_source``."""

    #: whether ``read`` after ``close`` fails (a cache may still serve what it holds)
    closed_reads_fail = True
    #: whether the source claims the ReadAheadSource protocol
    read_ahead = False

    @pytest.fixture
    def source(self, make_source: Make) -> Iterator[tuple[ByteSource, bytes]]:
        data = _data()
        src = make_source(data)
        try:
            yield src, data
        finally:
            src.close()

    def test_is_a_byte_source(self, source: tuple[ByteSource, bytes]) -> None:
        src, _ = source
        assert isinstance(src, ByteSource)
        assert isinstance(src.location, str) and src.location

    def test_claims_read_ahead_only_when_it_is_a_read_ahead_source(self, source: tuple[ByteSource, bytes]) -> None:
        assert isinstance(source[0], ReadAheadSource) == self.read_ahead

    def test_size(self, source: tuple[ByteSource, bytes]) -> None:
        src, data = source
        assert src.size() == len(data)

    @pytest.mark.parametrize("offset,length", RANGES)
    def test_read(self, source: tuple[ByteSource, bytes], offset: int, length: int) -> None:
        src, data = source
        got = src.read(offset, length)
        assert isinstance(got, (bytes, memoryview))
        assert len(got) == length and bytes(got) == data[offset : offset + length]
        assert bytes(src.read(offset, length)) == data[offset : offset + length]  # twice: the same

    @pytest.mark.parametrize("offset,length", [(SIZE - 10, 11), (SIZE, 1), (SIZE + 100, 5), (2 * SIZE, 4096)])
    def test_read_beyond_the_end_is_a_named_error(
        self, source: tuple[ByteSource, bytes], offset: int, length: int
    ) -> None:
        src, data = source
        with pytest.raises(CorruptStoreError):
            src.read(offset, length)
        assert bytes(src.read(0, 16)) == data[:16]  # the source still works

    def test_read_many_in_the_order_given(self, source: tuple[ByteSource, bytes]) -> None:
        src, data = source
        ranges = [*reversed(RANGES), (100, 50), (100, 50), (SIZE // 2, SIZE // 2)]
        got = src.read_many(ranges)
        assert len(got) == len(ranges)
        assert [bytes(g) for g in got] == [data[o : o + n] for o, n in ranges]
        assert src.read_many([]) == []

    def test_prefetch_is_a_hint_that_changes_no_byte(self, source: tuple[ByteSource, bytes]) -> None:
        src, data = source
        ranges = [(o, n) for o, n in RANGES if n]
        assert src.prefetch(ranges) is None
        assert src.prefetch([]) is None
        assert [bytes(src.read(o, n)) for o, n in ranges] == [data[o : o + n] for o, n in ranges]
        src.prefetch([(0, 10), (0, 10)])  # repeated and overlapping ranges too
        assert bytes(src.read(0, 10)) == data[:10]
        assert src.prefetch(ranges, again=True) is None  # read once more than hinted: twice here
        for _ in range(3):
            assert [bytes(src.read(o, n)) for o, n in ranges] == [data[o : o + n] for o, n in ranges]

    def test_concurrent_reads(self, source: tuple[ByteSource, bytes]) -> None:
        src, data = source
        ranges = [(o, n) for o, n in itertools.product(range(0, SIZE - 9000, 9001), (1, 1000, 9000))]
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda r: bytes(src.read(*r)), ranges))
        assert got == [data[o : o + n] for o, n in ranges]

    def test_close_twice(self, make_source: Make) -> None:
        data = _data(1000)
        src = make_source(data)
        assert bytes(src.read(0, 10)) == data[:10]
        src.close()
        src.close()
        if self.closed_reads_fail:
            with pytest.raises(ValueError, match="closed"):
                src.read(110, 5)


#: ranges past a remote source's head (the bytes it holds since opening are never fetched ahead)
AHEAD = [(77_777, 12_345), (SIZE - 4097, 4097), (20_000, 3000)]


class ReadAheadSourceTests(ByteSourceTests):
    """The ReadAheadSource protocol: a source over a link, with hints, waits and discards."""

    read_ahead = True

    def test_its_link_facts(self, source: tuple[ReadAheadSource, bytes]) -> None:
        src, _ = source
        assert isinstance(src.identity, str) and src.identity
        assert src.max_inflight >= 1 and src.readahead_bytes > 0 and src.head_bytes >= 0
        for counter in (src.stats.requests, src.stats.bytes, src.stats.retries, src.stats.coalesced):
            assert isinstance(counter, int) and counter >= 0
        src.retry_timeout = 7.5
        assert src.retry_timeout == 7.5

    def test_the_head_is_served_without_a_request(self, source: tuple[ReadAheadSource, bytes]) -> None:
        src, data = source
        before = src.stats.requests
        n = min(src.head_bytes, 100)
        assert bytes(src.read(0, n)) == data[:n] and src.stats.requests == before

    def test_hinted_ranges_arrive_and_are_read_once(self, source: tuple[ReadAheadSource, bytes]) -> None:
        src, data = source
        assert not src.hinted(AHEAD)
        assert src.wait_prefetched(AHEAD, timeout=0)  # nothing on its way
        src.prefetch(AHEAD)
        assert src.hinted(AHEAD)
        assert src.wait_prefetched(AHEAD, timeout=30)
        assert [bytes(src.read(o, n)) for o, n in AHEAD] == [data[o : o + n] for o, n in AHEAD]

    def test_a_range_hinted_again_is_still_hinted_after_its_first_read(
        self, source: tuple[ReadAheadSource, bytes]
    ) -> None:
        src, data = source
        o, n = AHEAD[0]
        src.prefetch([(o, n)])
        src.prefetch([(o, n)], again=True)
        assert src.wait_prefetched([(o, n)], timeout=30)
        assert bytes(src.read(o, n)) == data[o : o + n]
        assert src.hinted([(o, n)])
        assert bytes(src.read(o, n)) == data[o : o + n]

    def test_a_discarded_range_is_read_afresh(self, source: tuple[ReadAheadSource, bytes]) -> None:
        src, data = source
        o, n = AHEAD[1]
        src.prefetch([(o, n)])
        assert src.wait_prefetched([(o, n)], timeout=30)
        src.discard(o, n)
        assert not src.hinted([(o, n)])
        assert bytes(src.read(o, n)) == data[o : o + n]
        src.discard(o, n)  # nothing held: a no-op
        assert bytes(src.read(o, n)) == data[o : o + n]


# -- the sources ---------------------------------------------------------------------------------


def _file(folder: Path, data: bytes, name: str = "blob.bin") -> Path:
    path = folder / name
    path.write_bytes(data)
    return path


class TestLocalFileSource(ByteSourceTests):
    @pytest.fixture
    def make_source(self, tmp_path: Path) -> Make:
        return lambda data: LocalFileSource(_file(tmp_path, data))

    def test_view_is_the_same_bytes(self, source: tuple[LocalFileSource, bytes]) -> None:  # type: ignore[override]
        src, data = source
        for o, n in RANGES:
            assert bytes(src.view(o, n)) == data[o : o + n]


class TestRemoteSourceHTTP(ReadAheadSourceTests):
    """A plain HTTP server with Range support (tests/remote_servers.py)."""

    @pytest.fixture
    def make_source(self, http_server) -> Make:  # type: ignore[no-untyped-def]
        names = itertools.count()

        def make(data: bytes) -> ByteSource:
            name = f"blob{next(names)}.bin"
            _file(http_server.root, data, name)
            return RemoteSource(f"{http_server.url}/{name}", retries=0)

        return make


class TestRemoteSourceS3(ReadAheadSourceTests):
    """SeaweedFS's S3 gateway (one server for the session, tests/remote_servers.py)."""

    @pytest.fixture
    def make_source(self, seaweedfs, tmp_path: Path, request: pytest.FixtureRequest) -> Make:  # type: ignore[no-untyped-def]
        names = itertools.count()

        def make(data: bytes) -> ByteSource:
            key = f"byte-sources/{request.node.name}-{os.getpid()}-{next(names)}.bin"
            url = seaweedfs.upload("byte-sources", key, _file(tmp_path, data))
            return RemoteSource(url, seaweedfs.storage_options)

        return make


class TestCachedSourceCold(ByteSourceTests):
    """The chunk cache over a local file, empty at first (every first read is a miss). A
    ReadAheadSource with no link under it (``max_inflight`` 0)."""

    closed_reads_fail = False
    read_ahead = True

    @pytest.fixture
    def make_source(self, tmp_path: Path) -> Make:
        return lambda data: CachedSource(LocalFileSource(_file(tmp_path, data)), tmp_path / "cache")


class TestCachedSourceWarm(ByteSourceTests):
    """The chunk cache holding every range the tests read, under a small size budget;
    the file under it is gone, so what the cache serves must be right by itself."""

    closed_reads_fail = False
    read_ahead = True

    @pytest.fixture
    def make_source(self, tmp_path: Path) -> Make:
        def make(data: bytes) -> ByteSource:
            path = _file(tmp_path, data)
            warm = CachedSource(LocalFileSource(path), tmp_path / "cache")
            ranges = [*RANGES, (100, 50), (SIZE // 2, SIZE // 2), (500, 10), (0, 16), (0, 10)]
            ranges += [(o, n) for o, n in itertools.product(range(0, SIZE - 9000, 9001), (1, 1000, 9000))]
            for o, n in ranges:
                if o + n <= len(data):
                    warm.read(o, n)
            warm.close()
            # the file keeps its size but not its bytes: a cache miss would read zeros
            path.write_bytes(bytes(len(data)))
            src = CachedSource(LocalFileSource(path), tmp_path / "cache")
            src.identity_check = bytes(src.read(0, 16)) == data[:16]  # type: ignore[attr-defined]
            return src

        return make

    def test_served_from_the_cache(self, source: tuple[CachedSource, bytes]) -> None:  # type: ignore[override]
        src, data = source
        assert src.identity_check  # type: ignore[attr-defined]
        assert bytes(src.read(77_777, 12_345)) == data[77_777 : 77_777 + 12_345]
        assert src.stats.hits >= 2 and src.stats.misses == 0


class TestCachedSourceOverRemote(ReadAheadSourceTests):
    """The chunk cache in front of a remote source (a plain HTTP Range server): the link's
    hints, waits and discards pass through it."""

    closed_reads_fail = False

    @pytest.fixture
    def make_source(self, http_server, tmp_path: Path) -> Make:  # type: ignore[no-untyped-def]
        names = itertools.count()

        def make(data: bytes) -> ByteSource:
            name = f"cached{next(names)}.bin"
            _file(http_server.root, data, name)
            return CachedSource(RemoteSource(f"{http_server.url}/{name}", retries=0), tmp_path / "cache")

        return make


class TestJournalSource(ByteSourceTests):
    """The store as it was before an unfinished write: the file was overwritten in places
    and grew; the journal holds the old length and the overwritten bytes."""

    @pytest.fixture
    def make_source(self, tmp_path: Path) -> Make:
        def make(data: bytes) -> ByteSource:
            torn = bytearray(data) + _data(5000, seed=9)  # the write grew the file
            regions = []
            for o, n in ((0, 100), (len(data) // 3, 4097), (len(data) - 37, 37)):
                regions.append((o, data[o : o + n]))  # saved before the write overwrote them
                torn[o : o + n] = bytes(n)
            path = _file(tmp_path, bytes(torn))
            return JournalSource(path, Journal(len(data), tuple(regions)))

        return make

    def test_a_file_shorter_than_the_journal_says_is_named(self, tmp_path: Path) -> None:
        path = _file(tmp_path, _data(1000))
        with pytest.raises(CorruptStoreError, match="shorter"):
            JournalSource(path, Journal(2000, ((0, b"x" * 10),)))

"""verify=True checks each chunk of a local file once per process while the file is unchanged.

The CRC32 of a chunk costs about as much as decompressing it with the ``fast`` preset, so
a chunk already checked by this process is not checked again while the file's state
(device, inode, size, mtime, ctime) is what it was then. Any change through the file
system changes the ctime (a writer can set the mtime back, never the ctime), so a chunk
damaged on disk after a first epoch is still refused by the next one; ``verify="always"``
checks every read.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import silent_flip

import carraystore
from carraystore.base.errors import ChecksumError, InvalidInputError, LoaderChecksumError
from carraystore.format import blocks
from carraystore.store import reader as reader_module

BAD_CHUNK = 2
CHUNK_IMAGES = 8


@pytest.fixture(params=["arena", "direct"])
def store_path(
    request: pytest.FixtureRequest, tmp_path: Path, photo_patches: Callable[..., np.ndarray]
) -> Iterator[Path]:
    if request.param == "direct":  # blocks of one image over 64 KiB: the engine's direct mode
        if not blocks.available():
            pytest.skip("libblosc2's getitem is not available in this blosc2 wheel")
        images = photo_patches(40, size=(160, 160), seed=3)
        codec = carraystore.Codec("lz4", 1, filters=(), block_images=1)
    else:
        images, codec = photo_patches(48, size=(24, 24), seed=3), None  # the default preset
    path = tmp_path / "s.b2nd"
    with carraystore.create(path, images.shape[1:], codec=codec, chunk_images=CHUNK_IMAGES) as w:
        w.append(images, labels=np.arange(len(images)) % 3)
    wait_settled(path)
    yield path
    reader_module.forget_checked_chunks()


def wait_settled(path: Path) -> None:
    """Wait until the file's last change is older than the reader's settle time."""
    age = (time.time_ns() - os.stat(path).st_ctime_ns) / 1e9
    time.sleep(max(0.0, reader_module.SETTLE_S - age) + 0.02)


@pytest.fixture
def crc_count(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many chunk CRC32 checks the reader computes."""
    count = [0]
    real = reader_module.chunk_crc_ok

    def counted(*args: object, **kwargs: object) -> bool:
        count[0] += 1
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(reader_module, "chunk_crc_ok", counted)
    return count


def epoch(store: carraystore.Store, **kwargs: object) -> int:
    return sum(len(x) for x, _ in store.batches(8, **kwargs))  # type: ignore[arg-type]


def damage_in_place(path: Path, chunk: int) -> None:
    """Flip one byte of ``chunk`` such that it still decompresses (into wrong pixels), in the file
    itself (same size, same inode), and set its atime and mtime back to what they were."""
    at, value = silent_flip(path, chunk)
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes([value]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


def test_each_chunk_is_checked_once_per_process_while_the_file_is_unchanged(
    store_path: Path, crc_count: list[int]
) -> None:
    store = carraystore.open(store_path)
    n = len(store)
    assert epoch(store) == n
    assert crc_count[0] == store.nchunks  # the first epoch checks every chunk
    crc_count[0] = 0
    assert epoch(store, epoch=1) == n and crc_count[0] == 0
    again = carraystore.open(store_path)  # once per process, not per open store
    assert epoch(again, epoch=2) == n and crc_count[0] == 0
    again[3], again.take(np.arange(0, n, 5)), again.read_chunk(1)
    assert crc_count[0] == 0
    assert epoch(store, verify="always") == n and crc_count[0] == store.nchunks
    crc_count[0] = 0
    store.read_chunk(1, verify="always")
    assert crc_count[0] == 1


def test_a_chunk_damaged_on_disk_after_an_epoch_is_refused_by_the_next(store_path: Path, crc_count: list[int]) -> None:
    store = carraystore.open(store_path)
    k = store.chunk_images
    assert epoch(store) == len(store)
    crc_count[0] = 0
    assert epoch(store, epoch=1) == len(store) and crc_count[0] == 0  # checked: not again
    damage_in_place(store_path, BAD_CHUNK)  # same inode and size, mtime set back: the ctime moved
    with pytest.raises(LoaderChecksumError, match=rf"chunk {BAD_CHUNK}\b") as info:
        epoch(store, epoch=2)
    assert info.value.chunk == BAD_CHUNK  # type: ignore[attr-defined]
    with pytest.raises(ChecksumError, match=rf"chunk {BAD_CHUNK}\b.*CRC32"):
        store[BAD_CHUNK * k + 1]
    with pytest.raises(LoaderChecksumError, match=rf"chunk {BAD_CHUNK}\b"):
        epoch(carraystore.open(store_path), epoch=3)
    wait_settled(store_path)
    # however long it has been unchanged since, the damaged chunk is never recorded as checked
    for e in (4, 5):
        with pytest.raises(LoaderChecksumError, match=rf"chunk {BAD_CHUNK}\b"):
            epoch(store, epoch=e)
    assert store[0].shape == store.image_shape  # the other chunks still read


def test_any_change_of_the_file_checks_every_chunk_again(store_path: Path, crc_count: list[int]) -> None:
    store = carraystore.open(store_path)
    assert epoch(store) == len(store)
    crc_count[0] = 0
    st = os.stat(store_path)
    os.utime(store_path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the bytes are the same; the ctime moved
    wait_settled(store_path)
    assert epoch(store, epoch=1) == len(store) and crc_count[0] == store.nchunks
    crc_count[0] = 0
    assert epoch(store, epoch=2) == len(store) and crc_count[0] == 0


def test_a_file_changed_moments_ago_is_checked_on_every_read(
    store_path: Path, crc_count: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a change within the file system's timestamp granularity could leave the state as it was
    monkeypatch.setattr(reader_module, "SETTLE_S", 3600.0)
    store = carraystore.open(store_path)
    assert epoch(store) == len(store) and epoch(store, epoch=1) == len(store)
    assert crc_count[0] == 2 * store.nchunks


def test_verify_takes_true_false_or_always(store_path: Path, crc_count: list[int]) -> None:
    store = carraystore.open(store_path)
    assert epoch(store, verify=False) == len(store) and crc_count[0] == 0
    for bad in ("yes", "Always", "once"):
        with pytest.raises(InvalidInputError, match="verify must be True, False or 'always'"):
            store.batches(8, verify=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError, match="verify must be True, False or 'always'"):
            store.read_chunk(0, verify=bad)  # type: ignore[arg-type]

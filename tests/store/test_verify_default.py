"""A flipped byte in a chunk never reaches training silently.

Every reader and loader checks each chunk's CRC32 by default (``verify=True``; what it
costs is measured in bench/bench_verify.py). The damage here is a single byte whose flip
still decompresses, into wrong pixels: exactly what a reader without the check would hand
out. Every path must stop with an error that names the chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import silent_flip

import carraystore
from carraystore.base.errors import ChecksumError, LoaderChecksumError
from carraystore.format import blocks

BAD_CHUNK = 2


def silently_damaged_copy(path: Path, out: Path, chunk: int) -> Path:
    """A copy of ``path`` with one byte of ``chunk`` flipped such that it still decompresses."""
    at, value = silent_flip(path, chunk)
    raw = bytearray(path.read_bytes())
    raw[at] = value
    out.write_bytes(bytes(raw))
    return out


@pytest.fixture(scope="module", params=["arena", "direct"])
def damaged(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, photo_patches: Callable[..., np.ndarray]
) -> Path:
    root = tmp_path_factory.mktemp("verify")
    if request.param == "direct":  # blocks of one image over 64 KiB: the engine's direct mode
        if not blocks.available():
            pytest.skip("libblosc2's getitem is not available in this blosc2 wheel")
        images, codec = (
            photo_patches(40, size=(160, 160), seed=1),
            carraystore.Codec("lz4", 1, filters=(), block_images=1),
        )
    else:
        images, codec = photo_patches(120, size=(24, 24), seed=1), None  # the default preset
    path = root / "good.b2nd"
    with carraystore.create(path, images.shape[1:], codec=codec, chunk_images=8) as w:
        w.append(images, labels=np.arange(len(images)) % 2)
    return silently_damaged_copy(path, root / "bad.b2nd", BAD_CHUNK)


def test_the_damage_is_silent_without_the_check(damaged: Path) -> None:
    store = carraystore.open(damaged)
    pixels = store.read_chunk(BAD_CHUNK, verify=False)  # what an unchecked reader hands out
    assert pixels.shape[0] == store.chunk_images
    assert store.verify() and store.verify()[0].chunk == BAD_CHUNK


def test_every_reader_refuses_the_damaged_chunk_by_default(damaged: Path) -> None:
    store = carraystore.open(damaged)
    k = store.chunk_images
    for read in (
        lambda: store.read_chunk(BAD_CHUNK),
        lambda: store[BAD_CHUNK * k + 1],
        lambda: store[:],
        lambda: store.take(np.array([BAD_CHUNK * k])),
    ):
        with pytest.raises(ChecksumError, match=rf"chunk {BAD_CHUNK}\b.*CRC32"):
            read()
    store[0], store[(BAD_CHUNK + 1) * k]  # the other chunks still read


def test_every_loader_refuses_the_damaged_chunk_by_default(damaged: Path) -> None:
    with pytest.raises(LoaderChecksumError, match=rf"chunk {BAD_CHUNK}\b") as info:
        for _ in carraystore.open(damaged).batches(8):
            pass
    assert info.value.chunk == BAD_CHUNK  # type: ignore[attr-defined]
    assert isinstance(info.value, ChecksumError) and isinstance(info.value, carraystore.LoaderError)

    pytest.importorskip("keras")
    from carraystore.keras import StoreDataset

    ds = StoreDataset(damaged, 8, shuffle=False)
    with pytest.raises(LoaderChecksumError, match=rf"chunk {BAD_CHUNK}\b"):
        for i in range(len(ds)):
            ds[i]
    ds.close()

    pytest.importorskip("tensorflow")
    from carraystore.tf import to_dataset

    with pytest.raises(Exception, match=rf"chunk {BAD_CHUNK}\b.*CRC32"):
        for _ in to_dataset(damaged, 8):
            pass

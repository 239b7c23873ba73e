"""Custom filter chains that blosc2 mis-decodes are refused by the writer, never stored.

With blosc2 4.x some chains (found by test_properties) compress chunks that decompress to
other bytes, while the CRC (taken over the compressed chunk) and verify see nothing wrong.
The writer decompresses each chunk of a non-preset codec once and compares; a mismatch is
a CodecRoundTripError and nothing is published.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import carraystore
from carraystore.base.errors import CodecRoundTripError, InvalidInputError
from carraystore.format.codec import PRESETS, Codec, is_preset
from carraystore.store.chunks import compress_chunk

#: (codec, number of items, item shape): blosc2 4.14 mis-decodes the last, partial chunk of
#: these random uint8 items (the full chunks before it round-trip)
BAD_CHAINS = [
    (Codec("blosclz", 1, filters=("bitshuffle",) * 3), 300_000, (1, 1, 1)),
    (Codec("blosclz", 1, filters=("bitshuffle", "bytedelta", "delta")), 100_000, (1, 1, 3)),
]
IDS = ["bitshuffle3", "bitshuffle-bytedelta-delta"]


def _items(n: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (n, *shape), dtype=np.uint8)


@pytest.mark.parametrize(("codec", "n", "shape"), BAD_CHAINS, ids=IDS)
def test_a_mis_decoding_chain_is_refused_and_nothing_published(
    tmp_path: Path, codec: Codec, n: int, shape: tuple[int, ...]
) -> None:
    path = tmp_path / "s.b2nd"
    with pytest.raises(CodecRoundTripError) as info, carraystore.create(path, image_shape=shape, codec=codec) as w:
        w.append(_items(n, shape))
    msg = str(info.value)
    assert str(path) in msg and "blosclz" in msg and "filter chain" in msg
    assert isinstance(info.value, InvalidInputError)
    assert not path.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary file or lock left behind


@pytest.mark.parametrize(("codec", "n", "shape"), BAD_CHAINS, ids=IDS)
def test_a_mis_decoding_chain_is_refused_when_appending(
    tmp_path: Path, codec: Codec, n: int, shape: tuple[int, ...]
) -> None:
    # the same items as above, the first ten written by an earlier create (they round-trip);
    # the append extends the store in place, and its last (partial) chunk mis-decodes
    path = tmp_path / "s.b2nd"
    x = _items(n, shape)
    x[:10] = 0
    with carraystore.create(path, image_shape=shape, codec=codec) as w:
        w.append(x[:10])
    before = path.read_bytes()
    with pytest.raises(CodecRoundTripError), carraystore.append(path) as w:
        w.append(x[10:])
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.b2nd"]
    with carraystore.open(path) as s:
        assert len(s) == 10 and not s[:].any()


@pytest.mark.parametrize(("codec", "n", "shape"), BAD_CHAINS, ids=IDS)
def test_compress_chunk_refuses_a_mis_decoding_chain(
    tmp_path: Path, codec: Codec, n: int, shape: tuple[int, ...]
) -> None:
    with carraystore.create(tmp_path / "s.b2nd", image_shape=shape, codec=codec) as w:
        meta = w.meta
    k = meta.chunk_images
    tail = _items(n, shape)[(n // k) * k :]  # the partial last chunk of the store above
    with pytest.raises(CodecRoundTripError, match="filter chain"):
        compress_chunk(meta, tail)
    compress_chunk(meta, np.zeros_like(tail))  # the same chunk of zeros round-trips: no error


def test_a_good_custom_chain_writes_and_reads_back(tmp_path: Path) -> None:
    codec = Codec("blosclz", 1, filters=("bitshuffle",))
    x = _items(100_000, (1, 1, 1))
    with carraystore.create(tmp_path / "s.b2nd", image_shape=(1, 1, 1), codec=codec) as w:
        w.append(x)
    with carraystore.open(tmp_path / "s.b2nd") as s:
        assert np.array_equal(s[:], x)


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize(
    ("dtype", "shape", "layout"),
    [
        ("uint8", (8, 8, 3), "NHWC"),
        ("uint8", (5, 1), "NHWC"),
        ("float32", (3,), "array"),
        ("uint16", (4, 4, 1), "NHWC"),
    ],
)
def test_presets_are_recognised_after_resolving(name: str, dtype: str, shape: tuple[int, ...], layout: str) -> None:
    # the presets skip the round-trip check (their chains are covered by the test suite)
    r = PRESETS[name].resolve(np.dtype(dtype), shape, layout)
    assert is_preset(r, np.dtype(dtype), shape, layout)
    assert is_preset(Codec.from_config({**r.to_config(), "block_images": 1}), np.dtype(dtype), shape, layout)
    assert not is_preset(
        Codec("blosclz", 1, filters=("bitshuffle",)).resolve(np.dtype(dtype), shape, layout),
        np.dtype(dtype),
        shape,
        layout,
    )

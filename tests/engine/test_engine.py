"""The decoding engine's two ways to make a batch give the same batches.

``direct`` mode (blocks of one image: each image decompressed straight into its batch
slot, see carraystore.format.blocks) and the arena mode (whole chunks decoded into slots, then
gathered) must agree bit for bit, for plain batches, clips, all-zero chunks and errors.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import make_store

import carraystore
from carraystore.base.errors import LoaderError
from carraystore.engine import decoder as engine
from carraystore.engine import spec as spec_mod
from carraystore.format import blocks

pytestmark = pytest.mark.skipif(
    not blocks.available(), reason="libblosc2's getitem is not available in this blosc2 wheel"
)


@pytest.fixture(scope="module")
def direct_store(tmp_path_factory: pytest.TempPathFactory, photo_patches: Callable[..., np.ndarray]) -> Path:
    images = photo_patches(300, size=(48, 48), seed=5)
    images[60:90] = 0  # whole all-zero chunks: blosc2 stores them as special chunks without data
    path, keys = tmp_path_factory.mktemp("direct") / "d.b2nd", [f"clip{i // 25:02d}/f{i:03d}.png" for i in range(300)]
    codec = carraystore.Codec("lz4", 1, filters=(), block_images=1)
    return make_store(path, images, np.arange(300) % 7, keys, codec=codec, chunk_images=10)


def _epoch(store: carraystore.Store, direct: bool, **kwargs: object) -> list[tuple[np.ndarray, np.ndarray]]:
    spec = spec_mod.make_spec(store, 16, **kwargs)
    dec = engine.EpochDecoder(spec, spec.options.epoch, 8, 2, "test-engine", direct=direct)
    try:
        assert dec.direct is direct
        return [tuple(np.copy(v) for v in dec.batch(i)) for i in range(spec.num_batches)]  # type: ignore[misc]
    finally:
        dec.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(epoch=0),
        dict(epoch=3, shuffle="global"),
        dict(shuffle=False),
        dict(epoch=1, sequence_length=5),
        dict(rank=1, world_size=3, epoch=2),
    ],
    ids=["block", "global", "ordered", "clips", "shard"],
)
def test_direct_and_arena_modes_give_the_same_batches(direct_store: Path, kwargs: dict) -> None:
    store = carraystore.open(direct_store)
    assert any(store.chunk_byte_range(i)[0] < 0 for i in range(store.nchunks)), (
        "the store has a special (all-zero) chunk"
    )
    direct, arena = _epoch(store, True, **kwargs), _epoch(store, False, **kwargs)
    assert len(direct) == len(arena) > 0
    for (x1, y1), (x2, y2) in zip(direct, arena, strict=True):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
    # and both are the store's own items in the plan's order
    plan = spec_mod.make_spec(store, 16, **kwargs).plan(int(kwargs.get("epoch", 0)))  # type: ignore[arg-type]
    np.testing.assert_array_equal(
        np.concatenate([x for x, _ in direct]),
        store[plan.samples(0, len(plan)).reshape(-1)].reshape(np.concatenate([x for x, _ in direct]).shape),
    )


def test_the_default_loader_uses_direct_mode_for_large_one_image_blocks(
    tmp_path: Path, photo_patches: Callable[..., np.ndarray], direct_store: Path
) -> None:
    images = photo_patches(40, size=(160, 160), seed=2)  # 75 KiB images: the fast preset makes one-image blocks
    path = tmp_path / "big.b2nd"
    with carraystore.create(path, (160, 160, 3), codec="fast", chunk_images=8) as w:
        w.append(images)
    store = carraystore.open(path)
    assert store.codec.block_images == 1 and engine.direct_ok(store)
    with store.batches(16, epoch=4) as it:
        assert it._s.decoder.direct and it._s.decoder.arena is None
        got = np.concatenate([x for x, _ in it])
        np.testing.assert_array_equal(got, images[it.plan.samples(0, len(it.plan))])
    # small items are gathered from decoded chunks even with one-image blocks
    assert not engine.direct_ok(carraystore.open(direct_store))


def test_a_damaged_chunk_is_reported_in_direct_mode(direct_store: Path, tmp_path: Path) -> None:
    store = carraystore.open(direct_store)
    offset, length = store.chunk_byte_range(12)
    data = bytearray(direct_store.read_bytes())
    data[offset + length // 2] ^= 0xFF
    bad = tmp_path / "bad.b2nd"
    bad.write_bytes(bytes(data))
    with pytest.raises(LoaderError, match="chunk 12"):
        for _ in carraystore.open(bad).batches(16, verify=True, shuffle=False):
            pass


def test_bytedelta_stores_of_large_images_decode_whole_chunks(
    tmp_path: Path, photo_patches: Callable[..., np.ndarray]
) -> None:
    """The default preset on images over 64 KiB (blocks of one image, bytedelta): libblosc2's
    getitem fails on bytedelta chunks, so the engine must not pick direct mode for them."""
    images = photo_patches(24, size=(160, 160), seed=3)
    path = tmp_path / "big.b2nd"
    with carraystore.create(path, (160, 160, 3), codec="balanced", chunk_images=8) as w:
        w.append(images, labels=np.arange(24) % 3)
    store = carraystore.open(path)
    assert store.codec.block_images == 1 and "bytedelta" in store.codec.filters
    assert not engine.direct_possible(store)
    got = np.concatenate([x for x, _ in store.batches(5, shuffle=False)])
    assert np.array_equal(got, images)

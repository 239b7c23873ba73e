"""Chunk reads with os.pread at the frame's offsets, and batch buffers reused safely."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import blosc2
import numpy as np
import pytest
from helpers import make_store

import carraystore
from carraystore.base.errors import CorruptStoreError
from carraystore.ingest.sample_data import load_photo, photo_crops
from carraystore.sources.local import LocalFileSource


@pytest.fixture(scope="module")
def photo_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(0)
    imgs = np.stack(
        photo_crops(load_photo("coffee"), 150, (48, 48), rng) + photo_crops(load_photo("rocket"), 150, (48, 48), rng)
    )
    imgs[40:60] = 0  # all-zero images: blosc2 may store a special (data-less) chunk
    path = tmp_path_factory.mktemp("io") / "s.b2nd"
    return make_store(path, imgs, np.repeat([0, 1], 150), chunk_images=20, class_names=["coffee", "rocket"])


def test_pread_reads_exactly_what_blosc2_reads(photo_store: Path) -> None:
    store = carraystore.open(photo_store)
    assert isinstance(store.source, LocalFileSource)  # reads go through os.pread at the frame's offsets
    array = blosc2.open(str(photo_store))
    for i in range(store.nchunks):
        assert store.read_chunk_bytes(i) == array.schunk.get_chunk(i), i
    np.testing.assert_array_equal(store[:], array[:])
    assert store.verify() == []


def test_pread_reports_a_truncated_chunk(photo_store: Path, tmp_path: Path) -> None:
    store = carraystore.open(photo_store)
    k = store.nchunks - 1
    chunk = store.read_chunk_bytes(k)
    data = photo_store.read_bytes()
    pos = data.find(chunk)
    # keep the file's length (and trailer) but overwrite the chunk with a short, broken one
    cut = tmp_path / "cut.b2nd"
    broken = bytearray(data)
    broken[pos + 12 : pos + 16] = (len(chunk) * 4).to_bytes(4, "little")  # header claims more bytes than exist
    cut.write_bytes(bytes(broken))
    damaged = carraystore.open(cut)
    with pytest.raises(CorruptStoreError, match=f"chunk {k}"):
        damaged.read_chunk(k)
    assert any(p.chunk == k for p in damaged.verify())


def test_pickled_store_reopens_with_its_own_file_handle(photo_store: Path) -> None:
    import pickle

    store = carraystore.open(photo_store)
    clone = pickle.loads(pickle.dumps(store))
    del store
    gc.collect()  # the first object's finalizer must not close the clone's descriptor
    np.testing.assert_array_equal(clone.read_chunk(1), carraystore.open(photo_store).read_chunk(1))


def test_batches_kept_by_the_consumer_are_never_overwritten(photo_store: Path) -> None:
    store = carraystore.open(photo_store)
    kept = [(x, y) for x, y in store.batches(16, shuffle="block", seed=3, window=4)]
    assert len({id(x) for x, _ in kept}) == len(kept)
    order = store.batches(16, shuffle="block", seed=3, window=4).plan
    np.testing.assert_array_equal(np.concatenate([x for x, _ in kept]), store[order.samples(0, len(order))])
    views = [x[:2] for x, _ in store.batches(16, shuffle="block", seed=4, window=4)]
    order4 = store.batches(16, shuffle="block", seed=4, window=4).plan
    want = store.take(order4.samples(0, len(order4)))
    for i, v in enumerate(views):  # a view keeps its batch alive, so it is never reused
        np.testing.assert_array_equal(v, want[16 * i : 16 * i + 2])


def test_reused_batch_buffers_hold_exactly_their_batch(photo_store: Path) -> None:
    """Batches consumed one at a time (buffers recycled) equal the planned samples, the short last one too."""
    store = carraystore.open(photo_store)
    it = store.batches(16, shuffle="block", seed=1, window=4)
    plan = it.plan
    got = []
    for x, y in it:
        got.append((x.copy(), y.copy()))
        del x, y
    assert len(got[-1][0]) == len(plan) % 16 or len(got[-1][0]) == 16
    want = store.take(plan.samples(0, len(plan)))
    np.testing.assert_array_equal(np.concatenate([x for x, _ in got]), want)
    np.testing.assert_array_equal(np.concatenate([y for _, y in got]), store.labels[plan.samples(0, len(plan))])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_decodes_after_the_parent_used_decoder_threads(photo_store: Path) -> None:
    """blosc2's own threads hang in a forked child (Keras use_multiprocessing forks): the store avoids them there."""
    import threading
    import time

    store = carraystore.open(photo_store)
    want = store.read_chunk(2).copy()
    stop = threading.Event()

    def keep_decoding() -> None:  # parent threads are decompressing when the fork happens
        buf = np.empty((store.chunk_images, *store.image_shape), dtype=store.dtype)
        while not stop.is_set():
            for i in range(store.nchunks):
                store.read_chunk(i, out=buf)

    busy = [threading.Thread(target=keep_decoding, daemon=True) for _ in range(2)]
    for t in busy:
        t.start()
    time.sleep(0.3)
    try:
        pid = os.fork()
    finally:
        if pid != 0:
            stop.set()
    if pid == 0:  # the child: decode in a new thread, as a Keras worker does
        code = 3
        try:
            box: list[np.ndarray] = []
            t = threading.Thread(target=lambda: box.append(carraystore.open(photo_store).read_chunk(2)))
            t.start()
            t.join(20)
            code = 0 if box and np.array_equal(box[0], want) else (2 if t.is_alive() else 1)
        finally:
            os._exit(code)
    for t in busy:
        t.join(30)
    deadline = time.time() + 30
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung decoding a chunk")
    assert os.waitstatus_to_exitcode(status) == 0


def test_loader_verify_accepts_all_zero_chunks_and_catches_damage(photo_store: Path, tmp_path: Path) -> None:
    """batches(verify=True) uses the store's own CRC check: blosc2's data-less zero chunks pass, damage does not."""
    store = carraystore.open(photo_store)
    assert sum(len(x) for x, _ in store.batches(16, verify=True, window=4)) == len(store)
    k = 4
    chunk = store.read_chunk_bytes(k)
    data = bytearray(photo_store.read_bytes())
    data[data.find(chunk) + len(chunk) // 2] ^= 0xFF
    bad = tmp_path / "bad.b2nd"
    bad.write_bytes(bytes(data))
    with pytest.raises(carraystore.LoaderError, match=f"chunk {k}.*CRC32"):
        for _ in carraystore.open(bad).batches(16, verify=True, shuffle=False, window=4):
            pass

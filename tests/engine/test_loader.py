"""carraystore.engine.loader: threaded block-shuffled batches from stores of real photos."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import index_of, ingested_photos
from loader_threads import loader_threads

import carraystore
from carraystore.base.errors import ClipError, InvalidInputError, LoaderError
from carraystore.engine.loader import THREAD_NAME_PREFIX, batches
from carraystore.engine.shuffle_report import distinct_per_batch, pairs_kept_together
from carraystore.ingest.sample_data import PHOTOS, make_photo_folder, make_video_folder

CLASSES = PHOTOS[:4]


pytestmark = pytest.mark.usefixtures("no_loader_threads_left")


@pytest.fixture(scope="module")
def photo_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 real 32x32 JPEG photos in class folders, ingested with the default shuffled write."""
    return ingested_photos(
        tmp_path_factory.mktemp("loader"), n=200, size=(32, 32), classes=CLASSES, seed=5, chunk_images=16
    )


def indices(table: dict[bytes, int], x: np.ndarray) -> list[int]:
    return [table[img.tobytes()] for img in x]


@pytest.mark.parametrize("shuffle", ["block", "global", False])
@pytest.mark.parametrize("batch_size", [32, 7])
def test_each_epoch_visits_every_sample_once(photo_store: Path, shuffle: str | bool, batch_size: int) -> None:
    store = carraystore.open(photo_store)
    table = index_of(store)
    n = len(store)
    orders = []
    for epoch in (0, 1):
        seen: list[int] = []
        sizes = []
        for x, y in store.batches(batch_size, shuffle=shuffle, epoch=epoch, window=3, prefetch=2):
            assert x.dtype == np.uint8 and x.shape[1:] == (32, 32, 3)
            idx = indices(table, x)
            assert np.array_equal(y, store.labels[idx])
            seen.extend(idx)
            sizes.append(len(x))
        assert sorted(seen) == list(range(n))
        assert sizes == [batch_size] * (n // batch_size) + ([n % batch_size] if n % batch_size else [])
        orders.append(seen)
    if shuffle:
        assert orders[0] != orders[1]
        assert orders[0] != list(range(n))
    else:
        assert orders[0] == orders[1] == list(range(n))


def test_same_arguments_give_the_same_batches(photo_store: Path) -> None:
    a = list(batches(photo_store, 16, seed=4, epoch=3, window=2))
    b = list(batches(photo_store, 16, seed=4, epoch=3, window=2))
    c = list(batches(photo_store, 16, seed=5, epoch=3, window=2))
    assert all(np.array_equal(x1, x2) and np.array_equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b, strict=True))
    assert not all(np.array_equal(x1, x2) for (x1, _), (x2, _) in zip(a, c, strict=True))


@pytest.mark.parametrize("drop", [False, True])
def test_ranks_get_disjoint_equal_shards_covering_every_sample(photo_store: Path, drop: bool) -> None:
    store = carraystore.open(photo_store)
    table = index_of(store)
    world = 3
    shards = []
    for rank in range(world):
        got = []
        for x, _ in store.batches(10, epoch=1, window=2, rank=rank, world_size=world, drop_remainder=drop):
            if drop:
                assert len(x) == 10
            got.extend(indices(table, x))
        shards.append(got)
    lengths = {len(s) for s in shards}
    assert len(lengths) == 1
    union = [i for s in shards for i in s]
    if drop:  # 200 // 3 = 66 per rank, 60 in whole batches of 10
        assert lengths == {60}
        assert len(set(union)) == len(union)
    else:  # ceil(200 / 3) = 67 per rank: one sample repeated by wrapping around
        assert lengths == {67}
        assert set(union) == set(range(len(store)))
        assert len(union) - len(set(union)) == 1


def test_resuming_yields_exactly_the_remaining_batches(photo_store: Path) -> None:
    full = list(batches(photo_store, 12, epoch=2, window=3))
    it = batches(photo_store, 12, epoch=2, window=3)
    for _ in range(5):
        next(it)
    epoch, start = it.position
    it.close()
    assert (epoch, start) == (2, 5)
    rest = batches(photo_store, 12, epoch=epoch, start_batch=start, window=3)
    assert len(rest) == len(full) - 5
    tail = list(rest)
    assert len(tail) == len(full) - 5
    for (x1, y1), (x2, y2) in zip(full[5:], tail, strict=True):
        assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    assert list(batches(photo_store, 12, epoch=2, start_batch=len(full))) == []
    with pytest.raises(InvalidInputError, match="start_batch"):
        batches(photo_store, 12, start_batch=len(full) + 1)


def test_batch_diversity_and_shuffle_quality(tmp_path: Path) -> None:
    """Class-sorted folders, default shuffled write: block shuffle mixes as well as a global one."""
    classes = PHOTOS  # 8 classes
    folder = make_photo_folder(tmp_path / "sorted", n=768, size=(16, 16), classes=classes, seed=2)
    shuffled = carraystore.from_directory(folder, tmp_path / "shuffled.b2nd", chunk_images=16, workers=1)
    kept = carraystore.from_directory(folder, tmp_path / "kept.b2nd", chunk_images=16, keep_order=True, workers=1)
    assert shuffled.path.exists() and kept.path.exists()

    def measure(path: Path, shuffle: str) -> tuple[float, float]:
        store = carraystore.open(path)
        table = index_of(store)
        orders, diversity = [], []
        for epoch in range(4):
            order, ys = [], []
            for x, y in store.batches(32, shuffle=shuffle, epoch=epoch, window=4, seed=1):
                order.extend(indices(table, x))
                ys.append(y)
            orders.append(np.array(order))
            labels = np.concatenate(ys)
            diversity.append(distinct_per_batch(labels, np.arange(len(labels)), 32))
        kept_pairs = [pairs_kept_together(orders[e - 1], orders[e], 32) for e in range(1, 4)]
        return float(np.mean(diversity)), float(np.mean(kept_pairs))

    block_div, block_pairs = measure(shuffled.path, "block")
    global_div, global_pairs = measure(shuffled.path, "global")
    sorted_div, sorted_pairs = measure(kept.path, "block")
    print(
        f"\nbatch diversity (distinct labels per batch of 32, 8 classes): block {block_div:.2f}, "
        f"global {global_div:.2f}, block on a class-sorted (--keep-order) store {sorted_div:.2f}"
        f"\nsame-batch pairs also together the epoch before: block {block_pairs:.4f}, global {global_pairs:.4f}, "
        f"class-sorted block {sorted_pairs:.4f} (a full shuffle expects {31 / 767:.4f})"
    )
    assert abs(block_div - global_div) <= 0.1 * global_div
    # the metric does tell: windows of a class-sorted store hold few classes
    assert sorted_div < 0.9 * global_div
    # block shuffle keeps more pairs together than a full shuffle, but far from all of them
    assert global_pairs < 3 * 31 / 767
    assert block_pairs < 0.5


def test_stopping_early_leaves_no_thread(photo_store: Path) -> None:
    for _batch in batches(photo_store, 8, window=2):
        break
    gc.collect()
    assert loader_threads() == []
    it = batches(photo_store, 8, window=2)
    next(it)
    threads = it.threads
    assert any(t.is_alive() for t in threads) or it.chunks_decoded > 0
    it.close()
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(StopIteration):
        next(it)
    with batches(photo_store, 8) as it2:
        next(it2)
    assert loader_threads() == []
    # never iterated at all, then dropped
    it3 = batches(photo_store, 8)
    threads = it3.threads
    del it3
    gc.collect()
    assert not any(t.is_alive() for t in threads)


def test_a_transform_runs_in_the_loader_threads(photo_store: Path) -> None:
    names = set()

    def to_float(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        names.add(threading.current_thread().name)
        return x.astype(np.float32) / 255.0, y

    store = carraystore.open(photo_store)
    plain = list(store.batches(50, epoch=1))
    done = list(store.batches(50, epoch=1, transform=to_float))
    assert all(n.startswith(THREAD_NAME_PREFIX) for n in names) and names
    for (x0, y0), (x1, y1) in zip(plain, done, strict=True):
        assert x1.dtype == np.float32 and np.allclose(x1 * 255.0, x0)
        assert np.array_equal(y0, y1)


def test_a_transform_that_raises_stops_everything(photo_store: Path) -> None:
    def bad(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if bad.calls == 2:  # type: ignore[attr-defined]
            raise ValueError("boom")
        bad.calls += 1  # type: ignore[attr-defined]
        return x, y

    bad.calls = 0  # type: ignore[attr-defined]
    it = batches(photo_store, 10, transform=bad, window=2)
    threads = it.threads
    got = 0
    with pytest.raises(LoaderError, match=r"batch 2 .*boom") as info:
        for _ in it:
            got += 1
    assert got == 2
    assert isinstance(info.value.__cause__, ValueError)
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(LoaderError, match=r"\(x, y\) or \(x, y, w\), got ndarray"):
        list(batches(photo_store, 10, transform=lambda x, y: x))


def test_a_damaged_chunk_reaches_the_consumer_naming_it(photo_store: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged.b2nd"
    shutil.copyfile(photo_store, damaged)
    data = carraystore.open(photo_store).read_chunk_bytes(3)
    raw = bytearray(damaged.read_bytes())
    at = raw.find(data)
    assert at > 0
    for j in range(at + len(data) // 2, at + len(data) // 2 + 64):
        raw[j] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    it = batches(damaged, 10, verify=True, shuffle=False, window=2, prefetch=1)
    threads = it.threads
    with pytest.raises(LoaderError, match=r"chunk 3\b") as info:
        list(it)
    assert info.value.chunk == 3  # type: ignore[attr-defined]
    assert isinstance(info.value.__cause__, carraystore.ChecksumError)
    assert not any(t.is_alive() for t in threads)


def test_threads_end_cleanly_at_interpreter_exit(photo_store: Path) -> None:
    script = textwrap.dedent(
        f"""
        import atexit, threading
        def report():
            alive = [t.name for t in threading.enumerate() if t.name.startswith("carraystore-loader") and t.is_alive()]
            print("ALIVE", alive, flush=True)
        atexit.register(report)  # runs after carraystore's own handler (registered later)
        import carraystore
        it = carraystore.open({str(photo_store)!r}).batches(4, window=1, prefetch=1, queue_size=1)
        next(it)
        print("CONSUMED", flush=True)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "CONSUMED" in proc.stdout
    assert "ALIVE []" in proc.stdout, proc.stdout


def test_label_modes_and_unlabelled_stores(photo_store: Path, tmp_path: Path) -> None:
    store = carraystore.open(photo_store)
    ints = list(store.batches(20, epoch=1))
    cats = list(store.batches(20, epoch=1, label_mode="categorical"))
    for (x0, y0), (x1, y1) in zip(ints, cats, strict=True):
        assert np.array_equal(x0, x1)
        assert y1.dtype == np.float32 and y1.shape == (len(x0), len(CLASSES))
        assert np.array_equal(np.argmax(y1, axis=1), y0) and np.all(y1.sum(axis=1) == 1)
    assert all(y is None for _, y in store.batches(20, label_mode=None))
    # a store written without labels yields y = None
    out = tmp_path / "nolabels.b2nd"
    with carraystore.create(out, (32, 32, 3), chunk_images=8) as w:
        w.append(store[:50])
    got = list(batches(out, 16))
    assert [len(x) for x, _ in got] == [16, 16, 16, 2] and all(y is None for _, y in got)


def test_binary_label_mode_as_keras_gives_it(photo_store: Path, tmp_path: Path) -> None:
    store = carraystore.open(photo_store)
    two = tmp_path / "two.b2nd"
    keep = np.flatnonzero(store.labels < 2)
    with carraystore.create(two, store.image_shape, class_names=list(store.class_names[:2]), chunk_images=8) as w:
        w.append(store[keep], labels=store.labels[keep])
    ints = list(batches(two, 16, epoch=2))
    bins = list(batches(two, 16, epoch=2, label_mode="binary"))
    assert len(bins) == len(ints) == -(-len(keep) // 16)
    for (x0, y0), (x1, y1) in zip(ints, bins, strict=True):
        # image_dataset_from_directory's "binary": float32 0/1 of shape (B, 1)
        assert np.array_equal(x0, x1) and y1.dtype == np.float32 and y1.shape == (len(x0), 1)
        assert np.array_equal(y1[:, 0], y0.astype(np.float32))
    with pytest.raises(InvalidInputError, match=r"binary.*has 4 .*categorical"):
        batches(photo_store, 16, label_mode="binary")


def test_any_item_shape_and_dtype(tmp_path: Path) -> None:
    out = tmp_path / "vectors.b2nd"
    data = np.arange(101 * 5, dtype=np.float32).reshape(101, 5)
    with carraystore.create(out, (5,), dtype="float32", chunk_images=8, layout="array") as w:
        w.append(data, labels=np.arange(101) % 3)
    rows = []
    for x, y in batches(out, 9, window=2, epoch=4):
        assert x.shape[1:] == (5,) and x.dtype == np.float32
        assert np.array_equal(y, (x[:, 0] // 5).astype(np.int64) % 3)
        rows.extend((x[:, 0] // 5).astype(int).tolist())
    assert sorted(rows) == list(range(101))


def test_sequences_of_video_frames_never_cross_a_clip(tmp_path: Path) -> None:
    folder = make_video_folder(tmp_path / "video", clips=4, frames=23, size=(24, 24))
    res = carraystore.from_directory(folder, tmp_path / "video.b2nd", keep_order=True, chunk_images=10, workers=1)
    store = carraystore.open(res.path)
    table = index_of(store)
    keys = list(store.keys)
    L = 5
    clips = []
    for x, y in store.batches(3, sequence_length=L, window=2, epoch=1):
        assert x.shape[1:] == (L, 24, 24, 3)
        for clip, label in zip(x, y, strict=True):
            idx = indices(table, clip)
            assert idx == list(range(idx[0], idx[0] + L)), "frames of a clip are consecutive"
            assert len({k.rsplit("/", 1)[0] for k in (keys[i] for i in idx)}) == 1, "a clip stays in one folder"
            assert label == store.labels[idx[0]]
            clips.append(idx[0])
    # 4 clips of 23 frames: 4 sequences of 5 each, every one exactly once
    assert len(clips) == 16 and len(set(clips)) == 16
    # an explicit groups array works the same way
    groups = [k.rsplit("/", 1)[0] for k in keys]
    firsts = [
        c[0]
        for x, _ in batches(res.path, 4, sequence_length=L, groups=groups, shuffle=False, epoch=1, clip_starts="random")
        for c in [[table[f.tobytes()] for f in clip] for clip in x]
    ]
    assert firsts == sorted(clips)


@pytest.fixture(scope="module")
def video(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """4 clips of 23 real-photo frames: one store written in order, one shuffled (the default)."""
    root = tmp_path_factory.mktemp("video")
    folder = make_video_folder(root / "video", clips=4, frames=23, size=(16, 16))
    ordered = carraystore.from_directory(
        folder, root / "ordered.b2nd", keep_order=True, chunk_images=10, workers=1
    ).path
    shuffled = carraystore.from_directory(folder, root / "shuffled.b2nd", chunk_images=10, workers=1).path
    return {"ordered": ordered, "shuffled": shuffled}


def clip_firsts(path: Path, table: dict[bytes, int], **kwargs) -> list[int]:
    return [table[clip[0].tobytes()] for x, _ in batches(path, 3, sequence_length=5, **kwargs) for clip in x]


def test_clips_on_a_shuffled_store_are_an_error_naming_keep_order(video: dict[str, Path]) -> None:
    assert carraystore.open(video["shuffled"]).provenance["shuffled"] is True
    with pytest.raises(ClipError, match="--keep-order"):
        batches(video["shuffled"], 4, sequence_length=5)
    # groups all shorter than the clip: an error too, never an empty epoch
    with pytest.raises(ClipError, match="longest run of one group is 23.*--keep-order"):
        batches(video["ordered"], 4, sequence_length=24)
    pytest.importorskip("keras")
    from carraystore.keras import StoreDataset

    with pytest.raises(ClipError, match="--keep-order"):
        StoreDataset(video["shuffled"], 4, sequence_length=5)


def test_clip_starts_move_every_epoch_and_stay_exact(video: dict[str, Path]) -> None:
    store = carraystore.open(video["ordered"])
    table = index_of(store)
    groups = [k.rsplit("/", 1)[0] for k in store.keys]
    run_first = {g: groups.index(g) for g in groups}
    per_epoch = []
    for epoch in range(6):
        firsts = sorted(clip_firsts(video["ordered"], table, epoch=epoch, seed=2))
        # 4 groups of 23 frames, clips of 5: always 4 clips per group, inside the group, 5 apart
        assert len(firsts) == 16
        for g in set(groups):
            mine = [f for f in firsts if groups[f] == g]
            assert len(mine) == 4 and all(groups[f + 4] == g for f in mine)
            assert np.all(np.diff(mine) == 5) and 0 <= mine[0] - run_first[g] <= 3
        per_epoch.append(firsts)
        # a pure function of (seed, epoch): the same again, in the same order
        assert clip_firsts(video["ordered"], table, epoch=epoch, seed=2) == clip_firsts(
            video["ordered"], table, epoch=epoch, seed=2
        )
    assert len({tuple(f) for f in per_epoch}) > 1, "the starts move from epoch to epoch"
    # resuming mid-epoch and sharding stay exact
    full = clip_firsts(video["ordered"], table, epoch=3, seed=2)
    assert clip_firsts(video["ordered"], table, epoch=3, seed=2, start_batch=2) == full[6:]
    shards = [clip_firsts(video["ordered"], table, epoch=3, seed=2, rank=r, world_size=2) for r in range(2)]
    assert sorted(shards[0] + shards[1]) == sorted(full) and not set(shards[0]) & set(shards[1])
    # clip_starts="fixed": every group's clips start at its first frame, every epoch
    for epoch in range(3):
        fixed = sorted(clip_firsts(video["ordered"], table, epoch=epoch, clip_starts="fixed"))
        assert fixed == sorted(run_first[g] + 5 * k for g in set(groups) for k in range(4))


def test_without_shuffling_clips_are_the_same_every_epoch(video: dict[str, Path]) -> None:
    # a validation loader (shuffle=False) measures on the same clips every epoch, in the same order
    table = index_of(carraystore.open(video["ordered"]))
    per_epoch = [clip_firsts(video["ordered"], table, shuffle=False, seed=2, epoch=e) for e in range(4)]
    assert all(p == per_epoch[0] for p in per_epoch)
    moving = [
        clip_firsts(video["ordered"], table, shuffle=False, seed=2, epoch=e, clip_starts="random") for e in range(4)
    ]
    assert len({tuple(m) for m in moving}) > 1  # asked for: random starts without shuffling
    pytest.importorskip("keras")
    from carraystore.keras import StoreDataset

    val = StoreDataset(video["ordered"], 4, sequence_length=5, shuffle=False)
    first = [val[i][0].copy() for i in range(len(val))]
    val.on_epoch_end()
    assert all(np.array_equal(a, val[i][0]) for i, a in enumerate(first))


def test_memory_pool_is_window_plus_prefetch_chunks(photo_store: Path) -> None:
    store = carraystore.open(photo_store)  # 200 images in 13 chunks of 16
    with store.batches(8, window=3, prefetch=2) as it:
        assert it.pool_chunks == 5
        list(it)
        assert it.chunks_decoded == store.nchunks
    with store.batches(8, shuffle="global") as it:
        assert it.pool_chunks == store.nchunks
    with store.batches(8, window=1, prefetch=0) as it:
        assert it.pool_chunks == 1
        assert sum(len(x) for x, _ in it) == len(store)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(batch_size=0), "batch_size"),
        (dict(batch_size=4, label_mode="onehot"), "label_mode"),
        (dict(batch_size=4, groups=[0] * 200), "sequence_length"),
        (dict(batch_size=4, rank=1), "world_size"),
        (dict(batch_size=4, shuffle="sometimes"), "shuffle"),
        (dict(batch_size=4, sequence_length=2, groups=[0, 1]), "groups"),
    ],
)
def test_bad_arguments_are_refused(photo_store: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        batches(photo_store, **kwargs)


def test_the_buffer_pool_is_reused_across_epochs_and_can_be_released(photo_store: Path) -> None:
    from carraystore.engine import decoder as loader

    store = carraystore.open(photo_store)
    loader.release_buffers()
    first = [x for x, _ in store.batches(16, epoch=0, window=2)]
    pool = loader.idle_arena(store)
    assert pool is not None and pool.shape[0] == 4
    kept = loader.idle_batch_buffers(store)
    assert kept is not None and len(kept.buffers) > 0
    second = store.batches(16, epoch=1, window=2)
    assert loader.idle_arena(store) is None, "the next epoch took the kept buffers"
    assert loader.idle_batch_buffers(store) is None, "the next epoch took the kept batch buffers"
    list(second)
    # batches handed out earlier (still held here) are never reused: later epochs did not touch them
    again = [x for x, _ in store.batches(16, epoch=0, window=2)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not any(a is b for a in first for b in again)
    reused = [x for x, _ in store.batches(16, epoch=1, window=2)]  # ``again``'s buffers held too
    assert not any(b is x for b in first + again for x in reused)
    del first, again, reused
    list(store.batches(16, epoch=2, window=2))
    kept_pool = loader.idle_batch_buffers(store)
    assert kept_pool is not None
    kept_ids = {id(b) for b in kept_pool.buffers}  # (the pool keeps them alive)
    for x, _ in store.batches(16, epoch=3, window=2):  # nothing held: the kept buffers are the batches
        assert id(x) in kept_ids
    loader.release_buffers(store)
    assert loader.idle_arena(store) is None and loader.idle_batch_buffers(store) is None


def test_a_store_opened_again_reuses_the_kept_buffers(photo_store: Path) -> None:
    """Opening the store again for every epoch (as some training scripts do) takes the buffers the last
    epoch kept, not fresh memory; the data are the same; a held batch is still never overwritten."""
    from carraystore.engine import decoder as loader

    loader.release_buffers()
    held = [x.copy() for x, _ in carraystore.open(photo_store).batches(16, epoch=0, window=2)]
    kept = loader.idle_batch_buffers(carraystore.open(photo_store))
    arena = loader.idle_arena(carraystore.open(photo_store))
    assert kept is not None and arena is not None, "the first store's epoch kept nothing once the store was dropped"
    kept_ids = {id(b) for b in kept.buffers}
    del kept
    again = carraystore.open(photo_store)
    it = again.batches(16, epoch=0, window=2)
    assert it._s.decoder.direct or it._s.decoder.arena is arena, "the new store's epoch allocated fresh slots"
    got = []
    for x, _ in it:
        assert id(x) in kept_ids, "the new store's epoch allocated fresh batch buffers"
        got.append(x.copy())
    assert all(np.array_equal(a, b) for a, b in zip(held, got, strict=True))
    # a batch held from one store is not reused by the next store's epoch
    keep = next(iter(carraystore.open(photo_store).batches(16, epoch=1, window=2)))[0]
    snapshot = keep.copy()
    list(carraystore.open(photo_store).batches(16, epoch=2, window=2))
    assert np.array_equal(keep, snapshot)
    loader.release_buffers()


def _count_in_child(path: str, out: multiprocessing.Queue[int]) -> None:
    out.put(sum(len(x) for x, _ in carraystore.open(path).batches(8, window=2)))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_forking_while_loader_threads_run(photo_store: Path) -> None:
    """A child forked while this process's loader threads decode can load too, and exits."""
    ctx = multiprocessing.get_context("fork")
    running = [batches(photo_store, 4, window=1, prefetch=1, queue_size=1) for _ in range(2)]
    for it in running:
        next(it)
    results: multiprocessing.Queue[int] = ctx.Queue()
    children = [ctx.Process(target=_count_in_child, args=(str(photo_store), results)) for _ in range(3)]
    for c in children:
        c.start()
    counts = [results.get(timeout=60) for _ in children]
    for c in children:
        c.join(timeout=60)
        assert c.exitcode == 0
    assert counts == [200, 200, 200]
    for it in running:  # the parent's loaders are unharmed
        assert sum(len(x) for x, _ in it) == 200 - 4


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_children_forked_during_decoding_do_not_hang(tmp_path: Path) -> None:
    """blosc2's threaded decompression hangs in a child forked while other threads of the
    parent decompress with blosc2 threads (as Keras's use_multiprocessing does); children
    must still decode (Store.decompress_chunk decompresses serially after a fork)."""
    import blosc2

    from carraystore.ingest.sample_data import load_photo, photo_crops

    # a chunk of a few MiB, so that blosc2 decompresses it with several threads
    path = tmp_path / "big_chunks.b2nd"
    crops = np.stack(photo_crops(load_photo("astronaut"), 256, (64, 64), np.random.default_rng(0)))
    with carraystore.create(path, (64, 64, 3), chunk_images=256) as w:
        w.append(np.concatenate([crops, crops[:, ::-1]]))
    store = carraystore.open(path)
    data = store.read_chunk_bytes(0)
    stop = threading.Event()

    def busy() -> None:
        buf = np.empty((store.chunk_images, *store.image_shape), dtype=store.dtype)
        while not stop.is_set():
            blosc2.decompress2(data, dst=buf, nthreads=2)

    threads = [threading.Thread(target=busy) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    codes = []
    try:
        for _ in range(5):
            pid = os.fork()
            if pid == 0:  # the child: decode in a thread, as a Keras worker would
                code = 3
                try:
                    out = np.empty((store.chunk_images, *store.image_shape), dtype=store.dtype)
                    worker = threading.Thread(
                        target=lambda out=out: [store.decompress_chunk(0, data, out) for _ in range(5)], daemon=True
                    )
                    worker.start()
                    worker.join(timeout=10)
                    code = 3 if worker.is_alive() else 0
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            codes.append(os.waitstatus_to_exitcode(status))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert codes == [0] * 5, f"forked children whose decompression hung: {codes}"


def test_batches_the_consumer_keeps_are_never_overwritten(photo_store: Path) -> None:
    """The loader reuses batch arrays the consumer let go of; kept ones stay intact."""
    reference = [x.copy() for x, _ in batches(photo_store, 8, epoch=6, window=2)]
    kept = {}
    views = {}
    for i, (x, _) in enumerate(batches(photo_store, 8, epoch=6, window=2)):
        if i % 3 == 0:
            kept[i] = x
        elif i % 3 == 1:
            views[i] = x[:, ::2]  # a view keeps its base alive too
    assert len(kept) + len(views) > 10
    for i, x in kept.items():
        assert np.array_equal(x, reference[i])
    for i, v in views.items():
        assert np.array_equal(v, reference[i][:, ::2])


def test_loader_keywords_are_typed_once_and_match_the_options() -> None:
    """``LoaderKwargs`` (the typed ``**options`` of every loader) lists exactly LoaderOptions'
    fields: a new option cannot be documented or typed in one place and missing in another."""
    import dataclasses

    from carraystore.engine.options import LoaderKwargs, LoaderOptions

    assert set(LoaderKwargs.__annotations__) == {f.name for f in dataclasses.fields(LoaderOptions)}


def test_the_store_users_get_has_the_loaders_as_methods(photo_store: Path) -> None:
    """``carraystore.open`` gives a ``carraystore.Store`` (the reader plus ``batches`` and
    ``to_dask``, defined above the loaders); the reader class itself has no loader."""
    from carraystore.store import reader

    store = carraystore.open(photo_store)
    assert type(store) is carraystore.Store and isinstance(store, reader.StoreReader)
    assert not hasattr(reader.StoreReader, "batches") and not hasattr(reader, "BATCHES")
    x, y = next(iter(store.batches(8, shuffle=False)))
    assert np.array_equal(x, store.take(np.arange(8)))
    assert type(pickle.loads(pickle.dumps(store))) is carraystore.Store

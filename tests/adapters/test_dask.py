"""carraystore.dask: stores as dask arrays, dask arrays as stores, ingest on a dask.distributed cluster.

One LocalCluster of two worker processes (one thread each) serves the whole module.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import make_store
from PIL import Image
from remote_servers import RangeHTTPServer

import carraystore as cs
from carraystore.base.errors import (
    CodecMismatchError,
    CorruptStoreError,
    IngestError,
    InvalidInputError,
    StoreChangedError,
    StoreExistsError,
    StoreLockedError,
)
from carraystore.ingest.sample_data import make_photo_folder
from carraystore.store.chunks import compress_chunk

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")
cdask = pytest.importorskip("carraystore.dask")

# one pytest-xdist worker runs the module, so one cluster serves it (a cluster per worker cost
# 4 clusters of 2 worker processes, each importing dask, distributed and carraystore)
pytestmark = pytest.mark.xdist_group("dask-cluster")


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[object, object]]:
    """(LocalCluster, Client): two worker processes, one thread each; the client is not the default.

    The dashboard gets a free loopback port: dashboard_address=None still serves one on :8787.
    """
    with distributed.LocalCluster(
        processes=True, n_workers=2, threads_per_worker=1, dashboard_address="127.0.0.1:0", silence_logs=logging.ERROR
    ) as cl:
        client = distributed.Client(cl, set_as_default=False)
        try:
            yield cl, client
        finally:
            client.close()


@pytest.fixture(scope="module")
def client(cluster: tuple[object, object]) -> object:
    return cluster[1]


def _store_of(path: Path, images: np.ndarray, labels: np.ndarray | None = None, **kw: object) -> cs.Store:
    return cs.open(make_store(path, images, labels, dtype=images.dtype, **kw))


# -- to_dask ------------------------------------------------------------------------------------


def test_to_dask_sums_and_fancy_indexes_like_numpy_on_worker_processes(
    tmp_path: Path, client: object, photo_patches: Callable[..., np.ndarray]
) -> None:
    images = photo_patches(300, (16, 16), seed=3)
    labels = np.arange(300) % 5
    store = _store_of(tmp_path / "s.b2nd", images, labels, chunk_images=32)
    x = cdask.to_dask(tmp_path / "s.b2nd")
    # the store's chunks along axis 0, whole items along the others; one read task per chunk
    assert x.chunks[0] == tuple(b - a for a, b in (store.chunk_range(i) for i in range(store.nchunks)))
    assert x.chunks[1:] == ((16,), (16,), (3,))
    assert x.numblocks == (store.nchunks, 1, 1, 1)
    assert len(dict(x.__dask_graph__())) == store.nchunks + 1  # + the store handle itself
    assert int(client.compute(x.sum(dtype="i8")).result()) == int(images.sum(dtype=np.int64))
    idx = [299, 0, 31, 32, 32, 150, 7]
    np.testing.assert_array_equal(client.compute(x[idx]).result(), images[idx])
    np.testing.assert_array_equal(client.compute(x[40:200:9, 3, ::2]).result(), images[40:200:9, 3, ::2])
    lab = cdask.labels(store)
    assert isinstance(lab, np.ndarray) and lab.dtype == np.int64
    np.testing.assert_array_equal(lab, labels)
    np.testing.assert_array_equal(client.compute(x[lab == 3]).result(), images[labels == 3])
    per_channel = client.compute(x.mean(axis=(0, 1, 2))).result()
    np.testing.assert_allclose(per_channel, images.mean(axis=(0, 1, 2)))
    # the shortcut gives the same graph
    y = store.to_dask()
    assert y.name == x.name
    np.testing.assert_array_equal(y[5:70].compute(), images[5:70])


def test_to_dask_of_a_relative_path_works_on_workers_with_another_cwd(
    tmp_path: Path, client: object, monkeypatch: pytest.MonkeyPatch, photo_patches: Callable[..., np.ndarray]
) -> None:
    images = photo_patches(50, (8, 8), seed=2)
    _store_of(tmp_path / "rel.b2nd", images, chunk_images=16)
    monkeypatch.chdir(tmp_path)
    assert all(cwd != str(tmp_path) for cwd in client.run(os.getcwd).values())  # type: ignore[attr-defined]
    for x in (cdask.to_dask("rel.b2nd"), cs.open("rel.b2nd").to_dask(), cdask.to_dask("file://rel.b2nd")):
        np.testing.assert_array_equal(client.compute(x).result(), images)  # type: ignore[attr-defined]


def test_the_store_travels_as_its_location_not_its_data(
    tmp_path: Path, photo_patches: Callable[..., np.ndarray]
) -> None:
    small = _store_of(tmp_path / "a.b2nd", photo_patches(10, (16, 16)), chunk_images=8)
    big = _store_of(tmp_path / "b.b2nd", photo_patches(2000, (32, 32), seed=1), chunk_images=64)
    assert big.cbytes > 1_000_000
    assert len(pickle.dumps(big)) < 1000
    assert len(pickle.dumps(cdask.to_dask(big))) < len(pickle.dumps(cdask.to_dask(small))) + 200


def test_a_store_replaced_after_to_dask_fails_on_the_workers_instead_of_mixing(
    tmp_path: Path, client: object, photo_patches: Callable[..., np.ndarray]
) -> None:
    # the graph describes the store as it was; workers reopen it by path and must not read another
    path = tmp_path / "r.b2nd"
    _store_of(path, photo_patches(64, (8, 8), seed=1), chunk_images=16)
    x = cdask.to_dask(path)
    _store_of(path, photo_patches(64, (8, 8), seed=2), chunk_images=16, overwrite=True)  # same shape, other pixels
    with pytest.raises(StoreChangedError, match=r"changed since to_dask.*call to_dask again"):
        client.compute(x.sum()).result()  # type: ignore[attr-defined]
    np.testing.assert_array_equal(client.compute(cdask.to_dask(path)).result(), photo_patches(64, (8, 8), seed=2))  # type: ignore[attr-defined]


def test_a_graph_built_before_an_append_names_the_change_not_corruption(
    tmp_path: Path, client: object, photo_patches: Callable[..., np.ndarray]
) -> None:
    # nothing is damaged: the store grew after to_dask; the workers (which reopen it) say so and what to do
    path = tmp_path / "g.b2nd"
    images = photo_patches(40, (8, 8), seed=3)
    _store_of(path, images[:32], chunk_images=16)
    x = cdask.to_dask(path)
    with cs.append(path) as w:
        w.append(images[32:])
    with pytest.raises(StoreChangedError, match=r"g\.b2nd: the store changed since to_dask.*call to_dask again") as exc:
        client.compute(x.sum()).result()  # type: ignore[attr-defined]
    assert not isinstance(exc.value, CorruptStoreError) and isinstance(exc.value, cs.CarrayStoreError)
    assert cs.open(path).verify() == []
    np.testing.assert_array_equal(client.compute(cdask.to_dask(path)).result(), images)  # type: ignore[attr-defined]


def test_the_graph_opens_the_store_only_where_a_chunk_is_read(
    tmp_path: Path, photo_patches: Callable[..., np.ndarray]
) -> None:
    # dask.distributed's scheduler unpickles the graph: it must not need the data (a path
    # only the workers mount, a URL only they can reach); the workers open it at their first read
    images = photo_patches(40, (8, 8), seed=6)
    path = tmp_path / "w.b2nd"
    _store_of(path, images, chunk_images=16)
    from carraystore.api.daskview import _ChunkReader  # the read-only view behind carraystore.dask.to_dask

    blob = pickle.dumps(_ChunkReader(cs.open(path)))
    path.rename(tmp_path / "away.b2nd")
    reader = pickle.loads(blob)  # no store here, like a scheduler without the mount: no error
    (tmp_path / "away.b2nd").rename(path)
    np.testing.assert_array_equal(reader[16:32], images[16:32])  # opened at the first read


def test_labels_of_an_unlabelled_store_is_an_error(tmp_path: Path, photo_patches: Callable[..., np.ndarray]) -> None:
    store = _store_of(tmp_path / "u.b2nd", photo_patches(10, (16, 16)))
    with pytest.raises(InvalidInputError, match="no class labels$"):
        cdask.labels(store)
    # one-hot labels kept as a field (as an HDF5 migration keeps them): the message says where they are
    onehot = np.eye(3, dtype=np.float32)[np.arange(10) % 3]
    with cs.create(tmp_path / "o.b2nd", (16, 16, 3)) as w:
        w.append(photo_patches(10, (16, 16)), columns={"onehot": onehot})
    with pytest.raises(InvalidInputError, match=r"no class labels; its per-sample fields are \['onehot'\]"):
        cdask.labels(tmp_path / "o.b2nd")
    np.testing.assert_array_equal(cdask.targets(tmp_path / "o.b2nd", "onehot"), onehot)
    with pytest.raises(InvalidInputError, match="storage_options"):
        cdask.to_dask(store, storage_options={"anon": True})


def test_to_dask_of_an_empty_store(tmp_path: Path) -> None:
    with cs.create(tmp_path / "e.b2nd", (4, 4, 3)):
        pass
    x = cdask.to_dask(tmp_path / "e.b2nd")
    assert x.shape == (0, 4, 4, 3)
    assert x.compute().shape == (0, 4, 4, 3)


# -- the writer's compressed-chunk API ----------------------------------------------------------


def test_append_compressed_chunk_writes_the_bytes_append_writes(
    tmp_path: Path, photo_patches: Callable[..., np.ndarray]
) -> None:
    images = photo_patches(70, (16, 16), seed=5)
    labels = np.arange(70) % 3
    keys = [f"k/{i}" for i in range(70)]
    with cs.create(tmp_path / "a.b2nd", (16, 16, 3), chunk_images=32, nthreads=1) as w:
        w.append(images, labels=labels, keys=keys)
    with cs.create(tmp_path / "b.b2nd", (16, 16, 3), chunk_images=32) as w:
        meta = w.meta
        for s in (0, 32):
            data, crc = compress_chunk(meta, images[s : s + 32])
            w.append_compressed_chunk(data, 32, crc, labels=labels[s : s + 32], keys=keys[s : s + 32])
        data, crc = compress_chunk(meta, images[64:68])  # a short chunk stays pending ...
        w.append_compressed_chunk(data, 4, crc, labels=labels[64:68], keys=keys[64:68])
        w.append(images[68:], labels=labels[68:], keys=keys[68:])  # ... so that append continues it
    assert (tmp_path / "a.b2nd").read_bytes() == (tmp_path / "b.b2nd").read_bytes()
    s = cs.open(tmp_path / "b.b2nd")
    assert s.verify() == []
    np.testing.assert_array_equal(s[:], images)


def test_append_compressed_chunk_in_place_and_a_zero_chunk(
    tmp_path: Path, photo_patches: Callable[..., np.ndarray]
) -> None:
    # an append extends the store in place (docs/appends.md); a chunk of zeros is a 32-byte
    # special chunk whose recorded CRC is the canonical zero chunk's (FORMAT.md 5.2)
    images = photo_patches(20, (16, 16), seed=4)
    with cs.create(tmp_path / "a.b2nd", (16, 16, 3), chunk_images=8) as w:
        w.append(images[:8])
    inode = (tmp_path / "a.b2nd").stat().st_ino
    zeros = np.zeros((8, 16, 16, 3), np.uint8)
    with cs.append(tmp_path / "a.b2nd") as w:
        data, crc = compress_chunk(w.meta, zeros)
        assert len(data) == 32
        w.append_compressed_chunk(data, 8, crc)
        data, crc = compress_chunk(w.meta, images[8:12])
        w.append_compressed_chunk(data, 4, crc)
    assert (tmp_path / "a.b2nd").stat().st_ino == inode
    s = cs.open(tmp_path / "a.b2nd")
    assert s.verify() == []
    np.testing.assert_array_equal(s[:], np.concatenate([images[:8], zeros, images[8:12]]))


def test_append_compressed_chunk_refuses_bad_input(tmp_path: Path, photo_patches: Callable[..., np.ndarray]) -> None:
    images = photo_patches(40, (16, 16), seed=6)
    with cs.create(tmp_path / "other.b2nd", (16, 16, 3), codec="fast", chunk_images=32) as other:
        foreign, foreign_crc = compress_chunk(other.meta, images[:32])
        other.abort()
    w = cs.create(tmp_path / "c.b2nd", (16, 16, 3), chunk_images=32)
    try:
        data, crc = compress_chunk(w.meta, images[:32])
        with pytest.raises(CorruptStoreError, match=r"c\.b2nd, chunk 0.*CRC32"):
            w.append_compressed_chunk(data, 32, crc ^ 1)
        with pytest.raises(CodecMismatchError, match="chunk 0"):
            w.append_compressed_chunk(foreign, 32, foreign_crc)
        with pytest.raises(InvalidInputError, match="1..32 items"):
            w.append_compressed_chunk(data, 33, crc)
        w.append(images[:3])
        with pytest.raises(InvalidInputError, match="3 items are pending"):
            w.append_compressed_chunk(data, 32, crc)
        with pytest.raises(InvalidInputError, match="up to 32 items"):
            compress_chunk(w.meta, images[:33])
    finally:
        w.abort()
    assert not (tmp_path / "c.b2nd").exists()


# -- from_dask ------------------------------------------------------------------------------------


def test_from_dask_round_trips_1000_images_bit_exact_on_worker_processes(
    tmp_path: Path, client: object, photo_patches: Callable[..., np.ndarray]
) -> None:
    images = photo_patches(1000, (24, 24), seed=7)
    labels = (np.arange(1000) * 7) % 10
    keys = [f"img/{i:04d}" for i in range(1000)]
    x = da.from_array(images, chunks=(137, 24, 12, 3))  # chunks unlike the store's: rechunked
    with client.as_current():
        store = cdask.from_dask(
            x,
            tmp_path / "x.b2nd",
            labels=da.from_array(labels, chunks=300),
            keys=keys,
            class_names=[str(c) for c in range(10)],
            chunk_images=128,
            attrs={"note": "from dask"},
        )
    assert isinstance(store, cs.Store) and store.shape == (1000, 24, 24, 3) and store.chunk_images == 128
    assert store.meta.blocksize < store.chunk_nbytes  # several blocks per chunk
    np.testing.assert_array_equal(store[:], images)
    np.testing.assert_array_equal(store.labels, labels)
    assert list(store.keys) == keys
    assert store.class_names == tuple(str(c) for c in range(10)) and store.attrs == {"note": "from dask"}
    assert store.verify() == []
    # chunk for chunk the bytes a local StoreWriter writes
    with cs.create(
        tmp_path / "local.b2nd",
        (24, 24, 3),
        chunk_images=128,
        class_names=store.class_names,
        attrs=store.attrs,
        provenance=store.provenance,
        nthreads=1,
    ) as w:
        w.append(images, labels=labels, keys=keys)
    assert (tmp_path / "local.b2nd").read_bytes() == (tmp_path / "x.b2nd").read_bytes()


def test_from_dask_with_other_item_shapes_and_no_cluster(tmp_path: Path) -> None:
    # a lazily computed float32 feature matrix, written with dask's threaded scheduler (no client)
    feats = da.random.default_rng(3).standard_normal((500, 7), chunks=(90, 7)).astype("float32")
    assert cdask.default_client() is None
    s = cdask.from_dask(feats, tmp_path / "f.b2nd", chunk_images=50)
    assert s.layout == "array" and s.item_shape == (7,) and s.dtype == np.float32
    np.testing.assert_array_equal(s[:], feats.compute())
    # scalars per item, int16, a short last chunk
    ints = da.arange(333, chunks=100, dtype="int16") * 3
    t = cdask.from_dask(ints, tmp_path / "i.b2nd", labels=np.arange(333) % 2, chunk_images=64)
    assert t.item_shape == () and len(t) == 333
    np.testing.assert_array_equal(t[:], np.arange(333, dtype="int16") * 3)
    np.testing.assert_array_equal(cdask.to_dask(t).compute(), np.arange(333, dtype="int16") * 3)


def test_from_dask_is_atomic_when_a_chunk_fails(tmp_path: Path) -> None:
    def boom(block: np.ndarray, block_info: dict | None = None) -> np.ndarray:
        if block_info and block_info[0]["chunk-location"][0] == 3:
            raise RuntimeError("model crashed on batch 3")
        return block

    x = da.zeros((400, 8, 8, 3), dtype="uint8", chunks=(50, 8, 8, 3)).map_blocks(boom, dtype="uint8")
    with pytest.raises(RuntimeError, match="batch 3"):
        cdask.from_dask(x, tmp_path / "z.b2nd", chunk_images=50)
    assert list(tmp_path.iterdir()) == []


def test_from_dask_checks_its_arguments(tmp_path: Path) -> None:
    x = da.zeros((10, 4, 4, 3), dtype="uint8", chunks=5)
    with pytest.raises(InvalidInputError, match=r"\(3,\) labels for 10"):
        cdask.from_dask(x, tmp_path / "a.b2nd", labels=[1, 2, 3])
    with pytest.raises(InvalidInputError, match="2 keys for 10"):
        cdask.from_dask(x, tmp_path / "a.b2nd", keys=["a", "b"])
    with pytest.raises(InvalidInputError, match="storage_options apply to URLs only"):
        cdask.from_dask(x, tmp_path / "a.b2nd", storage_options={"anon": True})
    with pytest.raises(InvalidInputError, match="unknown"):
        cdask.from_dask(x[x[:, 0, 0, 0] > 0], tmp_path / "a.b2nd")
    assert list(tmp_path.iterdir()) == []
    holder = cs.create(tmp_path / "a.b2nd", (4, 4, 3))  # another writer at work on the target
    try:
        with pytest.raises(StoreLockedError, match=r"being written by create.*waited 0\.2 s"):
            cdask.from_dask(x, tmp_path / "a.b2nd", lock_timeout=0.2)
    finally:
        holder.abort()


def test_from_dask_checks_every_label_and_key_before_computing_a_chunk(tmp_path: Path) -> None:
    # a bad label or key at the very end is refused before the (maybe hours long) compute starts
    def never(block: np.ndarray) -> np.ndarray:
        raise RuntimeError("a chunk was computed")

    x = da.zeros((40, 4, 4, 3), dtype="uint8", chunks=8).map_blocks(never, dtype="uint8")
    labels = np.zeros(40, dtype=np.int64)
    labels[-1] = 3
    with pytest.raises(InvalidInputError, match=r"labels span 0\.\.3 but there are 3 class names"):
        cdask.from_dask(x, tmp_path / "a.b2nd", labels=labels, class_names=["a", "b", "c"], chunk_images=8)
    with pytest.raises(InvalidInputError, match="labels must be integers"):
        cdask.from_dask(x, tmp_path / "a.b2nd", labels=np.r_[np.zeros(39), 0.5], chunk_images=8)
    keys = [f"k{i}" for i in range(39)] + ["bad\nkey"]
    with pytest.raises(InvalidInputError, match="key"):
        cdask.from_dask(x, tmp_path / "a.b2nd", keys=keys, chunk_images=8)
    assert list(tmp_path.iterdir()) == []


def test_from_dask_of_an_array_with_empty_chunks(tmp_path: Path) -> None:
    # zero-length blocks along axis 0 (as boolean masks leave them), also the last one
    arr = np.arange(64, dtype="uint8").reshape(32, 2)
    for i, chunks in enumerate([(16, 16, 0), (16, 0, 16), (0, 16, 16)]):
        s = cdask.from_dask(da.from_array(arr, chunks=(chunks, (2,))), tmp_path / f"e{i}.b2nd", chunk_images=16)
        assert s.nchunks == 2
        np.testing.assert_array_equal(s[:], arr)


def test_from_dask_on_a_cluster_without_workers_fails_at_once(tmp_path: Path) -> None:
    x = da.zeros((40, 4, 4, 3), dtype="uint8", chunks=8)
    with (
        distributed.LocalCluster(n_workers=0, dashboard_address="127.0.0.1:0", silence_logs=logging.ERROR) as cl,
        distributed.Client(cl, set_as_default=False) as empty,
        empty.as_current(),
        pytest.raises(InvalidInputError, match=r"has no workers.*start workers"),
    ):
        cdask.from_dask(x, tmp_path / "o.b2nd", chunk_images=8)
    assert list(tmp_path.iterdir()) == []


def test_from_dask_takes_keys_as_a_dask_array_like_labels(tmp_path: Path) -> None:
    names = np.array([f"img/{i:02d}.jpg" for i in range(20)])
    s = cdask.from_dask(
        da.zeros((20, 2), dtype="uint8", chunks=6),
        tmp_path / "k.b2nd",
        keys=da.from_array(names, chunks=7),
        labels=da.arange(20, chunks=5) % 2,
        chunk_images=8,
    )
    assert list(s.keys) == names.tolist()
    np.testing.assert_array_equal(s.labels, np.arange(20) % 2)


def test_from_dask_to_a_file_url(tmp_path: Path) -> None:
    x = da.arange(40, chunks=15, dtype="int32")
    s = cdask.from_dask(x, f"file://{tmp_path}/u.b2nd", chunk_images=8)
    assert s.path == tmp_path / "u.b2nd"
    np.testing.assert_array_equal(s[:], np.arange(40, dtype="int32"))


def test_in_order_keeps_order_and_a_bounded_window(client: object) -> None:
    alive: list[int] = []
    state = {"submitted": 0, "yielded": 0}

    def submits() -> Iterator[Callable[[], object]]:
        for i in range(24):

            def make(i: int = i) -> object:
                state["submitted"] += 1
                alive.append(state["submitted"] - state["yielded"])
                # within a window later tasks finish first: their results wait on the workers
                delay = 0.02 * (3 - i % 4)
                return client.submit(lambda i, d: (time.sleep(d), i)[1], i, delay, key=f"sleep-{i}", pure=False)

            yield make

    got = []
    for value in cdask.in_order(client, submits(), window=4):
        state["yielded"] += 1
        got.append(value)
    assert got == list(range(24))
    assert max(alive) == 4


# -- distributed ingest ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def messy_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real photos in 3 classes plus bad files: not an image, empty, and one of another size."""
    root = make_photo_folder(
        tmp_path_factory.mktemp("messy"), n=150, size=(40, 40), classes=("astronaut", "chelsea", "coffee"), seed=5
    )
    (root / "astronaut" / "broken.jpg").write_bytes(b"this is not a jpeg")
    (root / "chelsea" / "empty.png").write_bytes(b"")
    Image.new("RGB", (30, 20), (200, 10, 10)).save(root / "coffee" / "odd_size.png")
    return root


def _both(folder: Path, tmp_path: Path, client: object, **kw: object) -> tuple[cs.Store, cs.Store, object, object]:
    local = cs.from_directory(folder, tmp_path / "local.b2nd", workers=1, **kw)
    dist = cs.from_directory(folder, tmp_path / "dist.b2nd", client=client, **kw)
    return cs.open(tmp_path / "local.b2nd"), cs.open(tmp_path / "dist.b2nd"), local, dist


# small chunks: many tasks, chunk boundaries re-planned after each bad file; large chunks:
# several blosc2 blocks per chunk (whose order in the bytes depends on the compression threads)
@pytest.mark.parametrize(("image_size", "chunk_images"), [((32, 32), 8), (None, 64)])
def test_distributed_ingest_is_byte_for_byte_the_local_ingest(
    tmp_path: Path, client: object, messy_folder: Path, image_size: tuple[int, int] | None, chunk_images: int
) -> None:
    a, b, ra, rb = _both(
        messy_folder,
        tmp_path,
        client,
        image_size=image_size,
        on_error="skip",
        max_skipped=3,
        chunk_images=chunk_images,
        seed=4,
    )
    assert a.meta.blocksize < a.chunk_nbytes or chunk_images == 8
    assert (tmp_path / "local.b2nd").read_bytes() == (tmp_path / "dist.b2nd").read_bytes()
    # and what that means, spelled out
    assert len(a) == len(b) == 150 + (1 if image_size else 0)
    np.testing.assert_array_equal(a[:], b[:])
    np.testing.assert_array_equal(a.labels, b.labels)
    assert list(a.keys) == list(b.keys)
    assert ra.skipped == rb.skipped and len(rb.skipped) == (2 if image_size else 3)  # type: ignore[attr-defined]
    assert a.skipped == b.skipped
    assert b.verify() == []


def test_the_local_ingest_is_reproducible_byte_for_byte(tmp_path: Path, messy_folder: Path) -> None:
    # what makes "the same store as the local ingest" well defined: chunks of several blocks,
    # several decoding processes, and still the same file twice
    for name in ("one", "two"):
        cs.from_directory(
            messy_folder, tmp_path / f"{name}.b2nd", workers=2, on_error="skip", max_skipped=3, chunk_images=64
        )
    assert cs.open(tmp_path / "one.b2nd").meta.blocksize < cs.open(tmp_path / "one.b2nd").chunk_nbytes
    assert (tmp_path / "one.b2nd").read_bytes() == (tmp_path / "two.b2nd").read_bytes()


def test_distributed_ingest_of_split_folders(tmp_path: Path, client: object) -> None:
    src = make_photo_folder(
        tmp_path / "src",
        n=60,
        size=(24, 24),
        classes=("astronaut", "coffee"),
        seed=3,
        splits={"train": 0.75, "val": 0.25},
    )
    kw = dict(split_dirs=True, chunk_images=8, seed=1)
    local = cs.from_directory(src, tmp_path / "local", workers=1, **kw)
    dist = cs.from_directory(src, tmp_path / "dist", client=client, **kw)
    assert set(local) == set(dist) == {"train", "val"}  # type: ignore[arg-type]
    for split in ("train", "val"):
        assert (tmp_path / "local" / f"{split}.b2nd").read_bytes() == (tmp_path / "dist" / f"{split}.b2nd").read_bytes()


def test_distributed_ingest_fails_on_the_same_file_as_the_local_one(
    tmp_path: Path, client: object, messy_folder: Path
) -> None:
    errors = []
    for kw in ({"workers": 1}, {"client": client}):
        with pytest.raises(IngestError) as info:
            cs.from_directory(messy_folder, tmp_path / "f.b2nd", image_size=(32, 32), chunk_images=16, **kw)
        errors.append(str(info.value))
        assert not (tmp_path / "f.b2nd").exists()
    assert errors[0] == errors[1] and "on_error='skip'" in errors[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("image_size", [(32, 32), None])
def test_distributed_ingest_stops_at_max_skipped_like_the_local_one(
    tmp_path: Path, client: object, messy_folder: Path, image_size: tuple[int, int] | None
) -> None:
    errors = []
    for kw in ({"workers": 1}, {"client": client}):
        with pytest.raises(IngestError, match="nothing was written") as info:
            cs.from_directory(
                messy_folder, tmp_path / "f.b2nd", image_size=image_size, on_error="skip", chunk_images=8, seed=4, **kw
            )
        errors.append(str(info.value))
        assert list(tmp_path.iterdir()) == []
    assert errors[0] == errors[1]
    # without image_size one of the skipped files differs in size: the error points to resizing
    assert ("--image-size H W" in errors[0]) == (image_size is None)


def test_distributed_ingest_of_files_none_of_which_decode(tmp_path: Path, client: object) -> None:
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    for name in ("x.jpg", "y.png", "new\nline.png"):  # the last one is skipped for its name, before decoding
        (src / name).write_bytes(b"not an image")
    errors = []
    for kw in ({"workers": 1}, {"client": client}):
        with pytest.raises(IngestError, match="none of the 3 image files could be decoded") as info:
            cs.from_directory(src.parent, tmp_path / "o.b2nd", on_error="skip", max_skipped=5, **kw)
        errors.append(str(info.value))
    assert errors[0] == errors[1]
    assert not (tmp_path / "o.b2nd").exists()


def test_distributed_ingest_with_validation_split(tmp_path: Path, client: object) -> None:
    src = make_photo_folder(tmp_path / "src", n=60, size=(24, 24), classes=("astronaut", "coffee"), seed=3)
    kw = dict(validation_split=0.25, subset="both", chunk_images=8, seed=7)
    local = cs.from_directory(src, tmp_path / "local", workers=1, **kw)
    dist = cs.from_directory(src, tmp_path / "dist", client=client, **kw)
    assert set(local) == set(dist) == {"training", "validation"}  # type: ignore[arg-type]
    assert dist["validation"].nimages == 15 and dist["training"].nimages == 45  # type: ignore[index]
    for part in ("training", "validation"):
        assert (tmp_path / "local" / f"{part}.b2nd").read_bytes() == (tmp_path / "dist" / f"{part}.b2nd").read_bytes()
    one = cs.from_directory(
        src, tmp_path / "val.b2nd", client=client, validation_split=0.25, subset="validation", chunk_images=8, seed=7
    )
    assert one.path.read_bytes() == (tmp_path / "local" / "validation.b2nd").read_bytes()  # type: ignore[union-attr]


def test_distributed_ingest_of_16_bit_files_with_odd_names(tmp_path: Path, client: object) -> None:
    # uint16 kept exactly; the first file in path order is bad and its name holds a control
    # character: the cluster path skips it before planning and names it as the local one does
    src = tmp_path / "scans"
    (src / "a").mkdir(parents=True)
    gray = np.random.default_rng(2).integers(0, 65536, (20, 12, 16), dtype=np.uint16)
    for i, g in enumerate(gray):
        Image.fromarray(g).save(src / "a" / f"{i:02d}.png")
    (src / "a" / "\x01bad.png").write_bytes(b"")
    kw = dict(dtype="uint16", color_mode="grayscale", keep_order=True, on_error="skip", max_skipped=1, chunk_images=8)
    a, b, ra, rb = _both(src, tmp_path, client, **kw)
    assert (tmp_path / "local.b2nd").read_bytes() == (tmp_path / "dist.b2nd").read_bytes()
    assert b.dtype == np.uint16
    np.testing.assert_array_equal(b[:][..., 0], gray)
    assert ra.skipped == rb.skipped == [("a/\\x01bad.png", "cannot decode (empty file)")]  # type: ignore[attr-defined]


def test_distributed_ingest_refuses_split_folders_and_locked_stores(tmp_path: Path, client: object) -> None:
    src = make_photo_folder(
        tmp_path / "src", n=12, size=(16, 16), classes=("astronaut",), seed=3, splits={"train": 0.5, "validation": 0.5}
    )
    with pytest.raises(IngestError, match="look like dataset splits"):
        cs.from_directory(src, tmp_path / "o.b2nd", client=client)
    holder = cs.create(tmp_path / "o.b2nd", (16, 16, 3))  # another writer at work on the target
    try:
        with pytest.raises(StoreLockedError, match="being written by create"):
            cs.from_directory(src / "train", tmp_path / "o.b2nd", image_size=(16, 16), client=client)
    finally:
        holder.abort()
    assert not (tmp_path / "o.b2nd").exists()


def test_distributed_ingest_on_a_cluster_without_workers_fails_at_once(tmp_path: Path, messy_folder: Path) -> None:
    # with no worker the tasks would wait for ever: say so instead of hanging
    with (
        distributed.LocalCluster(n_workers=0, dashboard_address="127.0.0.1:0", silence_logs=logging.ERROR) as cl,
        distributed.Client(cl, set_as_default=False) as empty,
    ):
        t = time.monotonic()
        with pytest.raises(IngestError, match=r"has no workers.*start workers"):
            cs.from_directory(messy_folder, tmp_path / "o.b2nd", client=empty, on_error="skip", max_skipped=3)
        assert time.monotonic() - t < 30
    assert not (tmp_path / "o.b2nd").exists()


def test_distributed_ingest_needs_the_folder_on_the_workers(
    tmp_path: Path, client: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a relative path this process sees (its cwd moved) and the workers do not (theirs did not)
    make_photo_folder(tmp_path / "src", n=8, size=(16, 16), classes=("astronaut",), seed=1)
    monkeypatch.chdir(tmp_path)
    assert all(cwd != str(tmp_path) for cwd in client.run(os.getcwd).values())
    with pytest.raises(IngestError, match=r"worker\(s\) tcp://127\.0\.0\.1:\d+, tcp://.* cannot see this folder"):
        cs.from_directory("src", "o.b2nd", client=client)
    assert not (tmp_path / "o.b2nd").exists()


def _kill_when_busy(client: object, killed: dict[str, object]) -> threading.Thread:
    """A thread that SIGKILLs one worker process as soon as it runs an ingest task."""
    client.wait_for_workers(2)  # type: ignore[attr-defined]
    pids = client.run(os.getpid)  # type: ignore[attr-defined]  # worker address -> process id
    victim_addr, victim_pid = sorted(pids.items())[0]

    def run() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            busy = client.processing(workers=[victim_addr]).get(victim_addr, ())  # type: ignore[attr-defined]
            if any(str(k).startswith("carraystore-ingest") for k in busy):
                killed["tasks"] = list(busy)
                killed["pid"] = victim_pid
                os.kill(victim_pid, signal.SIGKILL)
                return
            time.sleep(0.005)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_distributed_ingest_survives_a_killed_worker(tmp_path: Path, client: object) -> None:
    folder = make_photo_folder(tmp_path / "src", n=400, size=(64, 64), classes=("astronaut", "rocket"), seed=9)
    local = tmp_path / "local.b2nd"
    cs.from_directory(folder, local, image_size=(48, 48), chunk_images=8, workers=1)
    killed: dict[str, object] = {}
    t = _kill_when_busy(client, killed)
    try:
        cs.from_directory(folder, tmp_path / "dist.b2nd", image_size=(48, 48), chunk_images=8, client=client)
    finally:
        t.join()
    assert killed.get("tasks"), "the worker was never seen running an ingest task"
    with pytest.raises(ProcessLookupError):
        os.kill(killed["pid"], 0)  # type: ignore[arg-type]
    assert (tmp_path / "dist.b2nd").read_bytes() == local.read_bytes()
    client.wait_for_workers(2)  # type: ignore[attr-defined]  # the nanny brings a fresh worker up


def test_distributed_ingest_that_the_cluster_gives_up_on_leaves_nothing(tmp_path: Path, client: object) -> None:
    # enough chunks that the kill always lands while the ingest still runs (200 raced it under load)
    folder = make_photo_folder(tmp_path / "src", n=600, size=(64, 64), classes=("astronaut",), seed=2)

    def set_allowed_failures(n: int) -> None:
        def f(dask_scheduler: object) -> None:
            dask_scheduler.allowed_failures = n  # type: ignore[attr-defined]

        client.run_on_scheduler(f)  # type: ignore[attr-defined]

    set_allowed_failures(0)  # the first lost worker fails its task for good
    killed: dict[str, object] = {}
    t = _kill_when_busy(client, killed)
    try:
        with pytest.raises(IngestError, match=r"the cluster could not decode the chunk of files .*KilledWorker"):
            cs.from_directory(folder, tmp_path / "dist.b2nd", image_size=(48, 48), chunk_images=8, client=client)
    finally:
        t.join()
        set_allowed_failures(3)
    assert killed.get("tasks")
    assert list(tmp_path.iterdir()) == [tmp_path / "src"]  # no store, no temporary file
    client.wait_for_workers(2)  # type: ignore[attr-defined]


def test_cli_ingest_with_dask_scheduler(tmp_path: Path, cluster: tuple[object, object], messy_folder: Path) -> None:
    from carraystore.cli.main import main

    cl, _ = cluster
    common = ["--image-size", "24", "24", "--on-error", "skip", "--max-skipped", "3", "--chunk-images", "8", "-q"]
    assert main(["ingest", str(messy_folder), str(tmp_path / "l.b2nd"), "--workers", "1", *common]) == 0
    assert (
        main(["ingest", str(messy_folder), str(tmp_path / "d.b2nd"), "--dask-scheduler", cl.scheduler_address, *common])
        == 0
    )  # type: ignore[attr-defined]
    assert (tmp_path / "l.b2nd").read_bytes() == (tmp_path / "d.b2nd").read_bytes()


def test_cli_unreachable_scheduler_is_a_clear_error(
    tmp_path: Path, messy_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from carraystore.cli.main import main

    rc = main(
        [
            "ingest",
            str(messy_folder),
            str(tmp_path / "d.b2nd"),
            "--dask-scheduler",
            "tcp://127.0.0.1:9",
            "--dask-timeout",
            "2",
            "-q",
        ]
    )
    assert rc != 0
    assert "cannot reach the dask scheduler at tcp://127.0.0.1:9" in capsys.readouterr().err
    assert not (tmp_path / "d.b2nd").exists()


# -- URLs (with the remote sources) ---------------------------------------------------------------


def test_to_dask_of_a_url_on_worker_processes(
    http_server: RangeHTTPServer, client: object, photo_patches: Callable[..., np.ndarray]
) -> None:
    pytest.importorskip("carraystore.sources.remote", reason="URLs need the remote sources (storage-node issue)")
    images = photo_patches(120, (16, 16), seed=8)
    _store_of(http_server.root / "web.b2nd", images, chunk_images=16)
    x = cdask.to_dask(f"{http_server.url}/web.b2nd")
    assert x.chunks[0] == (16,) * 7 + (8,)
    assert int(client.compute(x.sum(dtype="i8")).result()) == int(images.sum(dtype=np.int64))
    np.testing.assert_array_equal(client.compute(x[[100, 3]]).result(), images[[100, 3]])


def test_to_dask_of_an_s3_url_on_worker_processes(
    tmp_path: Path, client: object, seaweedfs: object, photo_patches: Callable[..., np.ndarray]
) -> None:
    # the workers reopen the store from SeaweedFS by URL and storage_options (spawned processes)
    images = photo_patches(120, (16, 16), seed=9)
    labels = np.arange(120) % 3
    _store_of(tmp_path / "s3.b2nd", images, labels, chunk_images=16)
    url = seaweedfs.upload("dask-url", "x/s3.b2nd", tmp_path / "s3.b2nd")  # type: ignore[attr-defined]
    opts = seaweedfs.storage_options  # type: ignore[attr-defined]
    x = cdask.to_dask(url, storage_options=opts)
    assert x.chunks[0] == (16,) * 7 + (8,)
    assert int(client.compute(x.sum(dtype="i8")).result()) == int(images.sum(dtype=np.int64))  # type: ignore[attr-defined]
    lab = cdask.labels(url, storage_options=opts)
    np.testing.assert_array_equal(lab, labels)
    np.testing.assert_array_equal(client.compute(x[lab == 2]).result(), images[labels == 2])  # type: ignore[attr-defined]
    y = cs.open(url, storage_options=opts).to_dask()
    np.testing.assert_array_equal(client.compute(y[[119, 0, 64]]).result(), images[[119, 0, 64]])  # type: ignore[attr-defined]


def test_cli_distributed_ingest_to_an_s3_url_with_a_progress_bar(
    tmp_path: Path,
    cluster: tuple[object, object],
    messy_folder: Path,
    seaweedfs: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from carraystore.cli.main import main

    cl, _ = cluster
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweedfs.endpoint)  # type: ignore[attr-defined]
    bucket = seaweedfs.make_bucket("dask-url")  # type: ignore[attr-defined]
    url = f"s3://{bucket}/ingest/{tmp_path.name}.b2nd"
    common = [
        "--image-size",
        "24",
        "24",
        "--on-error",
        "skip",
        "--max-skipped",
        "3",
        "--chunk-images",
        "8",
    ]  # no -q: the bar is drawn
    assert main(["ingest", str(messy_folder), str(tmp_path / "l.b2nd"), "--workers", "1", "-q", *common]) == 0
    assert main(["ingest", str(messy_folder), url, "--dask-scheduler", cl.scheduler_address, *common]) == 0  # type: ignore[attr-defined]
    with cs.open(url) as remote:
        assert remote.verify() == []
        got = remote.source.read(0, remote.source.size())
    assert bytes(got) == (tmp_path / "l.b2nd").read_bytes()


def test_from_dask_to_an_s3_url_on_worker_processes(
    tmp_path: Path, client: object, seaweedfs: object, photo_patches: Callable[..., np.ndarray]
) -> None:
    images = photo_patches(100, (16, 16), seed=4)
    labels = np.arange(100) % 4
    bucket = seaweedfs.make_bucket("dask-url")  # type: ignore[attr-defined]
    url = f"s3://{bucket}/from_dask/{tmp_path.name}.b2nd"
    opts = seaweedfs.storage_options  # type: ignore[attr-defined]
    staging = tmp_path / "staging"
    staging.mkdir()
    with client.as_current():  # type: ignore[attr-defined]
        s = cdask.from_dask(
            da.from_array(images, chunks=30), url, labels=labels, chunk_images=16, storage_options=opts, tmp_dir=staging
        )
    assert s.location == url and s.verify() == []
    np.testing.assert_array_equal(s[:], images)
    np.testing.assert_array_equal(s.labels, labels)
    assert list(staging.iterdir()) == []  # the staging file is gone once uploaded
    with pytest.raises(StoreExistsError):  # like every write: no silent replacement
        cdask.from_dask(da.from_array(images, chunks=30), url, storage_options=opts, tmp_dir=staging)

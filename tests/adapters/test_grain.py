"""carraystore.grain.StoreDataSource under Grain's own DataLoader and MapDataset, on real photo pixels."""

from __future__ import annotations

import pickle
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("grain")
grain = pytest.importorskip("grain.python")

from helpers import make_store  # noqa: E402

import carraystore  # noqa: E402
import carraystore.grain as cgrain  # noqa: E402
from carraystore.base.errors import ChecksumError, InvalidInputError  # noqa: E402
from carraystore.engine.options import LoaderOptions  # noqa: E402
from carraystore.grain import StoreDataSource  # noqa: E402
from carraystore.store.reader import StoreReader  # noqa: E402


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory, photo_patches: Callable[..., np.ndarray]) -> Path:
    """101 real photo patches (16x16), chunks of 8, label = sample index."""
    path, keys = tmp_path_factory.mktemp("grain") / "photos.b2nd", [f"p/{i:03d}.jpg" for i in range(101)]
    return make_store(path, photo_patches(101, (16, 16), seed=9), np.arange(101), keys, chunk_images=8)


def test_records_are_the_store_samples(store_path: Path) -> None:
    src = StoreDataSource(store_path, with_key=True)
    pixels = carraystore.open(store_path)[:]
    assert len(src) == 101
    for i in (0, 7, 8, 100, -1):
        rec = src[i]
        np.testing.assert_array_equal(rec["image"], pixels[i])
        assert int(rec["label"]) == i % 101 and rec["key"] == f"p/{i % 101:03d}.jpg"
    with pytest.raises(IndexError):
        src[101]
    with pytest.raises(InvalidInputError):
        StoreDataSource(store_path, cache_chunks=0)


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The chunks every reader of this process decompresses, in order."""
    seen: list[int] = []
    lock = threading.Lock()
    decompress = StoreReader.decompress_chunk

    def counted(self: StoreReader, i: int, *args: Any, **kwargs: Any) -> np.ndarray:
        with lock:
            seen.append(int(i))
        return decompress(self, i, *args, **kwargs)

    monkeypatch.setattr(StoreReader, "decompress_chunk", counted)
    yield seen


def test_a_shuffled_grain_epoch_decodes_each_chunk_once_by_default(store_path: Path, decodes: list[int]) -> None:
    """Grain's global shuffle, 16 reader threads: every record once, the store's pixels and labels, 13 decodes."""
    store = carraystore.open(store_path)
    pixels, labels = store[:], np.asarray(store.labels)
    decodes.clear()
    src = StoreDataSource(store_path, with_key=True)
    for epoch in range(2):
        sampler = grain.IndexSampler(len(src), grain.NoSharding(), shuffle=True, num_epochs=1, seed=epoch)
        loader = grain.DataLoader(data_source=src, sampler=sampler, operations=[grain.Batch(10, drop_remainder=False)])
        seen: list[int] = []
        for batch in loader:
            idx = np.array([int(k[2:5]) for k in batch["key"]])  # the record's own key: "p/007.jpg" is record 7
            np.testing.assert_array_equal(batch["image"], pixels[idx])
            np.testing.assert_array_equal(batch["label"], labels[idx])
            seen.extend(idx.tolist())
        assert sorted(seen) == list(range(101)) and seen != list(range(101))
    assert sorted(decodes) == list(range(store.nchunks))  # each of the 13 chunks once, over both epochs
    info = src.cache_info()
    assert info.chunks == store.nchunks == info.decoded and info.nbytes == info.store_nbytes <= info.limit
    assert not info.held_back


def test_memory_budget_and_cache_chunks_bound_the_cache(store_path: Path, decodes: list[int]) -> None:
    store = carraystore.open(store_path)
    pixels = store[:]
    chunk = store.chunk_nbytes
    order = np.random.default_rng(0).permutation(101)
    for src, limit, held in (
        (StoreDataSource(store_path, memory_budget=3 * chunk + 1), 3 * chunk + 1, 3),
        (StoreDataSource(store_path, memory_budget="2kB"), chunk, 1),  # under one chunk: one chunk
        (StoreDataSource(store_path, cache_chunks=2), 2 * chunk, 2),
        (pickle.loads(pickle.dumps(StoreDataSource(store_path, cache_chunks=2))), 2 * chunk, 2),
    ):
        decodes.clear()
        for i in order:
            np.testing.assert_array_equal(src[int(i)]["image"], pixels[i])
        info = src.cache_info()
        assert (info.limit, info.chunks, info.nbytes) == (limit, held, held * chunk)
        assert info.decoded == len(decodes) > store.nchunks
    with pytest.raises(InvalidInputError, match="not both"):
        StoreDataSource(store_path, memory_budget="1GB", cache_chunks=4)
    with pytest.raises(InvalidInputError, match="memory_budget"):
        StoreDataSource(store_path, memory_budget="lots")


def test_the_default_cache_stops_growing_when_memory_runs_short(
    store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pixels = carraystore.open(store_path)[:]
    free = [10**12]
    monkeypatch.setattr(cgrain, "_available_memory", lambda: free[0])
    src = StoreDataSource(store_path)
    for i in range(0, 24):  # chunks 0, 1, 2
        src[i]
    free[0] = 0
    with pytest.warns(RuntimeWarning, match="stopped at .* pass memory_budget="):
        for i in range(101):
            np.testing.assert_array_equal(src[i]["image"], pixels[i])
    info = src.cache_info()
    assert info.held_back and info.chunks == 3 and info.limit == info.nbytes
    # a budget given is the caller's: no check, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        given = StoreDataSource(store_path, memory_budget="1GB")
        for i in range(101):
            given[i]
    assert given.cache_info().chunks == 13 and not given.cache_info().held_back


def test_available_memory_reads_the_cgroup_limit_less_its_usage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "memory.max").write_text("1000000000\n")
    (tmp_path / "memory.current").write_text("700000000\n")
    (tmp_path / "memory.stat").write_text("anon 500000000\ninactive_file 150000000\nactive_file 50000000\n")
    monkeypatch.setattr(cgrain, "_CGROUP", tmp_path)
    assert cgrain._available_memory() == 450_000_000  # limit - usage + reclaimable page cache
    (tmp_path / "memory.max").write_text("max\n")  # no limit: the machine's MemAvailable
    avail = cgrain._available_memory()
    assert avail is not None and 0 < avail <= cgrain.memory_limit() + (1 << 30)


def test_a_damaged_chunk_is_a_named_error_for_every_reader(store_path: Path, tmp_path: Path) -> None:
    """Eight threads ask for records of a chunk that fails its CRC32: each gets the error, none is left waiting."""
    bad = tmp_path / "damaged.b2nd"
    bad.write_bytes(store_path.read_bytes())
    offset, length = carraystore.open(store_path).chunk_byte_range(2)
    with open(bad, "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    src = StoreDataSource(bad)
    errors: list[BaseException] = []

    def read(i: int) -> None:
        try:
            src[i]
        except ChecksumError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(16 + t % 8,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads) and len(errors) == 8
    assert all("chunk 2" in str(e) for e in errors)
    pixels = carraystore.open(store_path)[:]
    np.testing.assert_array_equal(src[0]["image"], pixels[0])  # the other chunks are served
    assert src.cache_info().chunks == 1


def test_image_size_gives_pillows_reduce_and_survives_pickling(store_path: Path) -> None:
    from PIL import Image

    pixels = carraystore.open(store_path)[:]
    src = pickle.loads(pickle.dumps(StoreDataSource(store_path, image_size=(8, 8))))
    for i in (0, 9, 100):
        np.testing.assert_array_equal(src[i]["image"], np.asarray(Image.fromarray(pixels[i]).reduce(2)))
    with pytest.raises(InvalidInputError, match=r"\(16, 16\), \(8, 8\), \(4, 4\), \(2, 2\)"):
        StoreDataSource(store_path, image_size=(5, 5))


@pytest.mark.parametrize("workers", [0, 2])
def test_grain_dataloader_with_a_shuffling_sampler(store_path: Path, workers: int) -> None:
    if workers:
        # Grain's worker processes read absl flags, which a program run through absl.app parses;
        # pytest does not (the usual workaround outside absl.app)
        from absl import flags

        flags.FLAGS.mark_as_parsed()
    src = StoreDataSource(str(store_path))
    pixels = carraystore.open(store_path)[:]
    sampler = grain.IndexSampler(len(src), grain.NoSharding(), shuffle=True, num_epochs=1, seed=3)
    loader = grain.DataLoader(
        data_source=src, sampler=sampler, operations=[grain.Batch(16, drop_remainder=False)], worker_count=workers
    )
    seen = []
    for batch in loader:
        assert batch["image"].shape[1:] == (16, 16, 3) and batch["image"].dtype == np.uint8
        np.testing.assert_array_equal(batch["image"], pixels[batch["label"]])
        seen.extend(batch["label"].tolist())
    assert sorted(seen) == list(range(101)) and seen != list(range(101))


def test_two_shards_split_the_records(store_path: Path) -> None:
    src = StoreDataSource(store_path)
    pixels = carraystore.open(store_path)[:]
    got = []
    for shard in (0, 1):
        opts = grain.ShardOptions(shard_index=shard, shard_count=2, drop_remainder=False)

        def sampler(opts: object = opts) -> object:
            return grain.IndexSampler(len(src), opts, shuffle=True, num_epochs=1, seed=1)

        records = list(grain.DataLoader(data_source=src, sampler=sampler()))
        # the records Grain's sampler picks, as Grain's own range source of record keys gives them
        want = list(grain.DataLoader(data_source=grain.RangeDataSource(0, 101, 1), sampler=sampler()))
        assert [int(r["label"]) for r in records] == want and len(want) >= 49
        for r in records:
            np.testing.assert_array_equal(r["image"], pixels[int(r["label"])])
        got.append(want)
    assert not set(got[0]) & set(got[1]) and set(got[0]) | set(got[1]) <= set(range(101))


def test_map_dataset_pipeline_and_pickling(store_path: Path) -> None:
    src = StoreDataSource(store_path)
    again = pickle.loads(pickle.dumps(src))
    assert repr(again) == repr(src) and len(pickle.dumps(src)) < 2000
    ds = grain.MapDataset.source(again).shuffle(seed=0).map(lambda r: (r["image"].mean(), int(r["label"]))).batch(32)
    labels = [v for b in ds for v in b[1].tolist()]
    assert sorted(labels) == list(range(101))


@pytest.fixture(scope="module")
def fields_store(tmp_path_factory: pytest.TempPathFactory, photo_patches: Callable[..., np.ndarray]) -> Path:
    """40 real photo patches, 4 classes, an ``angle`` and a ``w`` field per sample, chunks of 8."""
    path = tmp_path_factory.mktemp("grain_fields") / "fields.b2nd"
    with carraystore.create(path, (16, 16, 3), chunk_images=8, class_names=["a", "b", "c", "d"]) as w:
        w.append(
            photo_patches(40, (16, 16), seed=4),
            np.arange(40) % 4,
            columns={"angle": np.linspace(-1, 1, 40), "w": np.arange(40) / 10},
        )
    return path


def test_loader_options_make_the_records_the_loaders_batches(fields_store: Path) -> None:
    opts = {"targets": {"cls": "label", "angle": "angle"}, "label_mode": "categorical", "sample_weight": "w"}
    store = carraystore.open(fields_store)
    x, y, w = next(iter(store.batches(40, shuffle=False, image_size=(8, 8), **opts)))  # type: ignore[arg-type]
    src = pickle.loads(pickle.dumps(StoreDataSource(fields_store, image_size=(8, 8), verify=False, **opts)))
    assert src.options.image_size == (8, 8) and not src.options.verify
    for i in (0, 13, 39):
        rec = src[i]
        np.testing.assert_array_equal(rec["image"], x[i])
        assert rec["image"].shape == (8, 8, 3)
        np.testing.assert_array_equal(rec["label"]["cls"], y["cls"][i])
        assert rec["label"]["cls"].dtype == np.float32 and rec["label"]["angle"] == y["angle"][i]
        assert rec["sample_weight"] == w[i] and rec["sample_weight"].dtype == np.float32
    # through Grain: the records batch as the loaders' y does
    loader = grain.DataLoader(
        data_source=src,
        sampler=grain.IndexSampler(len(src), grain.NoSharding(), shuffle=True, num_epochs=1, seed=2),
        operations=[grain.Batch(8)],
    )
    for batch in loader:
        cls = batch["label"]["cls"]
        assert cls.shape == (8, 4) and batch["sample_weight"].shape == (8,)
        idx = np.round(batch["sample_weight"] * 10).astype(int)
        np.testing.assert_array_equal(cls, y["cls"][idx])
        np.testing.assert_allclose(batch["label"]["angle"], y["angle"][idx])
    # an options value, a field as y; label_mode=None: no y
    angle = StoreDataSource(fields_store, LoaderOptions(targets="angle"))[5]
    assert angle["label"] == y["angle"][5] and "sample_weight" not in angle
    assert set(StoreDataSource(fields_store, label_mode=None)[5]) == {"image"}


@pytest.mark.parametrize(
    "given",
    [
        {"shuffle": False},
        {"rank": 1, "world_size": 2},
        {"sequence_length": 2},
        {"num_threads": 2},
        {"transform": lambda x, y: (x, y)},
        {"options": LoaderOptions(seed=3)},
    ],
)
def test_options_that_order_shard_or_batch_are_refused_by_name(fields_store: Path, given: dict[str, Any]) -> None:
    name = "seed" if "options" in given else sorted(given)[0]
    with pytest.raises(InvalidInputError, match=rf"'{name}'.*do not apply"):
        StoreDataSource(fields_store, **given)


def test_an_unknown_option_gets_a_hint(fields_store: Path) -> None:
    with pytest.raises(InvalidInputError, match="did you mean 'image_size'"):
        StoreDataSource(fields_store, imag_size=(8, 8))  # type: ignore[call-arg]

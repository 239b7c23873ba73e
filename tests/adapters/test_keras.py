"""carraystore.keras.StoreDataset: a real Keras PyDataset over stores of real photos."""

from __future__ import annotations

import gc
import importlib.util
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from helpers import index_of  # noqa: E402

import carraystore  # noqa: E402
from carraystore.ingest.sample_data import PHOTOS, make_photo_folder  # noqa: E402
from carraystore.keras import KERAS_THREAD_PREFIX, StoreDataset  # noqa: E402

CLASSES = PHOTOS[:4]


def keras_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(KERAS_THREAD_PREFIX) and t.is_alive()]


@pytest.fixture(scope="module")
def splits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real 64x64 JPEG photos of 4 classes, split into train/ and val/ folders, ingested."""
    root = tmp_path_factory.mktemp("keras")
    folder = make_photo_folder(
        root / "photos", n=320, size=(64, 64), classes=CLASSES, seed=3, splits={"train": 0.8, "val": 0.2}
    )
    res = carraystore.from_directory(folder, root / "stores", split_dirs=True, chunk_images=16, workers=1)
    return {name: r.path for name, r in res.items()}


def test_getitem_is_deterministic_and_each_epoch_covers_every_sample(splits: dict[str, Path]) -> None:
    store = carraystore.open(splits["train"])
    table = index_of(store)
    ds = StoreDataset(store, 20, window=3, seed=2)
    assert len(ds) == -(-len(store) // 20)
    orders = []
    for epoch in range(2):
        assert ds.epoch == epoch
        ds.on_epoch_begin()
        forward = [ds[i] for i in range(len(ds))]
        assert ds.chunks_decoded == store.nchunks, "in-order access decodes every chunk once"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # going backwards re-decodes windows: it says so
            backward = {i: ds[i] for i in reversed(range(len(ds)))}
        for i, (x, y) in backward.items():  # any order gives the same batch
            assert np.array_equal(x, forward[i][0]) and np.array_equal(y, forward[i][1])
        seen = [table[img.tobytes()] for x, _ in forward for img in x]
        assert sorted(seen) == list(range(len(store)))
        assert np.array_equal(np.concatenate([y for _, y in forward]), store.labels[seen])
        orders.append(seen)
        ds.on_epoch_end()
        assert keras_threads() == [], "on_epoch_end ends the decoder threads"
    assert orders[0] != orders[1]
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_out_of_order_access_warns_and_stays_correct(splits: dict[str, Path]) -> None:
    store = carraystore.open(splits["train"])
    ds = StoreDataset(store, 8, window=1, cache_windows=2)
    ref = [ds[i][0] for i in range(len(ds))]
    ds.close()
    order = np.random.default_rng(0).permutation(len(ds))
    with pytest.warns(RuntimeWarning, match="out of order"):
        got = {int(i): ds[int(i)][0] for i in order}
    assert all(np.array_equal(got[i], ref[i]) for i in range(len(ds)))
    ds.close()


def _predict_indices(ds: StoreDataset, table: dict[bytes, int]) -> list[int]:
    shape = ds.store.image_shape
    model = keras.Sequential([keras.Input(shape), keras.layers.Flatten()])
    out = model.predict(ds, verbose=0)
    images = np.rint(out).astype(np.uint8).reshape(-1, *shape)
    return [table[img.tobytes()] for img in images]


@pytest.mark.parametrize("workers,multiprocessing", [(1, False), (3, False), (2, True)])
def test_keras_workers_give_no_duplicated_and_no_missing_samples(
    splits: dict[str, Path], workers: int, multiprocessing: bool
) -> None:
    store = carraystore.open(splits["train"])
    table = index_of(store)
    ds = StoreDataset(splits["train"], 16, window=4, workers=workers, use_multiprocessing=multiprocessing, seed=9)
    expected = ds.plan().items.tolist()
    seen = _predict_indices(ds, table)
    assert sorted(seen) == list(range(len(store)))
    assert seen == expected, "Keras hands the batches back in the dataset's order"
    decoded = ds.decode_counts.get(0, 0)
    print(
        f"\nworkers={workers} multiprocessing={multiprocessing}: {decoded} chunk decodes in this process for {store.nchunks} chunks"
    )
    if not multiprocessing:
        # Threads share the cache: every chunk is decoded once, except that Keras first
        # peeks at batches 0 and 1 for the tensor spec and asks for them again later, by
        # which time their window may have been served and evicted (decoded once more).
        plan = ds.plan()
        peeked = range(plan.window_of(0), plan.window_of(2 * 16 - 1) + 1)  # the windows of batches 0 and 1
        assert store.nchunks <= decoded <= store.nchunks + sum(len(plan.window_chunks[w]) for w in peeked)
    ds.close()
    gc.collect()
    assert keras_threads() == []


def test_model_fit_on_real_photos_lowers_the_loss(splits: dict[str, Path]) -> None:
    keras.utils.set_random_seed(0)

    def to_float(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return x.astype(np.float32) / 255.0, y

    train = StoreDataset(splits["train"], 16, transform=to_float)
    val = StoreDataset(splits["val"], 16, shuffle=False, transform=to_float)
    model = keras.Sequential(
        [
            keras.Input((64, 64, 3)),
            keras.layers.Conv2D(8, 3, strides=2, activation="relu"),
            keras.layers.Conv2D(16, 3, strides=2, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(len(CLASSES)),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    before = model.evaluate(train, verbose=0)
    train.set_epoch(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no out-of-order decoding on a store this small
        history = model.fit(train, epochs=2, validation_data=val, verbose=0)
    after = history.history["loss"][-1]
    print(
        f"\nKeras CNN on real photos: loss {before:.3f} before, {history.history['loss']} in 2 epochs, val {history.history['val_loss']}"
    )
    assert after < before
    assert train.epoch == 2, "each epoch moved to a new order (epochs 0 and 1 were used)"
    assert np.isfinite(history.history["val_loss"]).all()
    train.close()
    val.close()
    gc.collect()
    assert keras_threads() == []


def test_pickles_as_the_path_and_gives_the_same_batches(splits: dict[str, Path]) -> None:
    ds = StoreDataset(splits["val"], 10, epoch=3, window=2)
    x0, y0 = ds[2]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.epoch == 3 and len(clone) == len(ds)
    x1, y1 = clone[2]
    assert np.array_equal(x0, x1) and np.array_equal(y0, y1)
    ds.close()
    clone.close()


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("jax") is None, reason="needs a second Keras backend: pip install jax (CPU)"
)
def test_another_backend_never_imports_tensorflow(splits: dict[str, Path]) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        import keras
        from carraystore.keras import StoreDataset
        assert keras.backend.backend() == "jax", keras.backend.backend()
        ds = StoreDataset({str(splits["train"])!r}, 32, transform=lambda x, y: (x.astype("float32") / 255, y))
        model = keras.Sequential([keras.Input((64, 64, 3)), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(ds, epochs=1, shuffle=False, verbose=0)
        print("EPOCH", ds.epoch, "TF", any(m == "tensorflow" or m.startswith("tensorflow.") for m in sys.modules))
        """
    )
    env = dict(os.environ, KERAS_BACKEND="jax")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # (the jax backend's first fit opens one extra epoch to build the model on a batch)
    assert "TF False" in proc.stdout and int(proc.stdout.split()[1]) >= 1, proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("jax") is None, reason="Keras' numpy backend imports jax: pip install jax (CPU)"
)
def test_numpy_backend_never_imports_tensorflow(splits: dict[str, Path]) -> None:
    """Keras' numpy backend (inference only) runs StoreDataset without TensorFlow."""
    script = textwrap.dedent(
        f"""
        import sys
        import keras
        import numpy as np
        from carraystore.keras import StoreDataset
        assert keras.backend.backend() == "numpy", keras.backend.backend()
        ds = StoreDataset({str(splits["train"])!r}, 32, shuffle=False, transform=lambda x, y: (x.astype("float32") / 255, y))
        model = keras.Sequential([keras.Input((64, 64, 3)), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
        out = model.predict(ds, verbose=0)
        print("ROWS", len(out), "TF", any(m == "tensorflow" or m.startswith("tensorflow.") for m in sys.modules))
        """
    )
    env = dict(os.environ, KERAS_BACKEND="numpy")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    n = len(carraystore.open(splits["train"]))
    assert f"ROWS {n} TF False" in proc.stdout, proc.stdout


def test_the_loader_arguments_work_here_too(splits: dict[str, Path]) -> None:
    """start_batch, prefetch, queue_size, verify, label_mode: the argument set of batches."""
    store = carraystore.open(splits["train"])
    full = list(store.batches(20, seed=4, epoch=2, window=2))
    ds = StoreDataset(store, 20, seed=4, epoch=2, window=2, start_batch=3, prefetch=1, queue_size=5, verify=True)
    assert ds.max_queue_size == 5 and ds.first_batch == 3
    assert len(ds) == len(full) - 3
    ds.on_epoch_begin()
    got = [ds[i] for i in range(len(ds))]
    assert all(np.array_equal(x, fx) and np.array_equal(y, fy) for (x, y), (fx, fy) in zip(got, full[3:], strict=True))
    ds.on_epoch_end()  # the next epoch is whole again
    assert ds.epoch == 3 and ds.first_batch == 0 and len(ds) == len(full)
    x0, y0 = ds[0]
    assert np.array_equal(x0, next(iter(store.batches(20, seed=4, epoch=3, window=2)))[0])
    ds.close()
    cat = StoreDataset(store, 20, label_mode="categorical")
    assert cat[0][1].shape == (20, len(CLASSES)) and cat[0][1].dtype == np.float32
    cat.close()
    assert not isinstance(StoreDataset(store, 20, label_mode=None)[0], tuple)
    with pytest.raises(carraystore.InvalidInputError, match="start_batch"):
        StoreDataset(store, 20, start_batch=len(full) + 1)


class _Crash(Exception):
    pass


def test_image_size_gives_smaller_batches_of_pillows_reduce(splits: dict[str, Path]) -> None:
    from PIL import Image

    store = carraystore.open(splits["val"])
    ds = StoreDataset(store, 16, shuffle=False, image_size=(16, 16), num_threads=2)
    x, y = ds[1]
    assert x.shape == (16, 16, 16, 3) and x.dtype == np.uint8
    want = np.stack([np.asarray(Image.fromarray(a).reduce(4)) for a in store[16:32]])
    np.testing.assert_array_equal(x, want)
    np.testing.assert_array_equal(y, store.labels[16:32])
    with pytest.raises(
        carraystore.base.errors.InvalidInputError, match=r"\(64, 64\), \(32, 32\), \(16, 16\), \(8, 8\)"
    ):
        StoreDataset(store, 16, image_size=(20, 20))


def test_a_fit_interrupted_mid_epoch_resumes_with_exactly_one_epoch_of_samples(
    splits: dict[str, Path], tmp_path: Path
) -> None:
    """Real Keras fit, interrupted after 6 batches of epoch 1, resumed from TrainingPosition's file."""
    from carraystore.keras import TrainingPosition

    store = carraystore.open(splits["train"])
    table = index_of(store)
    seen: dict[int, list[int]] = {}
    now = {"epoch": 0}

    class Record(keras.layers.Layer):
        """Notes which samples the model is trained on (eager mode: the batch is concrete)."""

        def call(self, x):  # type: ignore[no-untyped-def]
            if not isinstance(x, keras.KerasTensor):
                arr = keras.ops.convert_to_numpy(x).astype(np.uint8)
                seen.setdefault(now["epoch"], []).extend(table[img.tobytes()] for img in arr)
            return x

    class Epochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            now["epoch"] = epoch

    class CrashAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
            if now["epoch"] == 1 and batch == 5:
                raise _Crash("the machine went away")

    model = keras.Sequential(
        [keras.Input((64, 64, 3)), Record(), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(len(CLASSES))]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=True)
    where = tmp_path / "position.json"
    ds = StoreDataset(store, 16, seed=9, window=2)
    nb = len(ds)
    with pytest.raises(_Crash):
        model.fit(ds, epochs=3, shuffle=False, verbose=0, callbacks=[Epochs(), TrainingPosition(ds, where), CrashAt()])
    ds.close()
    assert sorted(seen[0]) == list(range(len(store)))
    assert len(seen[1]) == 6 * 16
    assert TrainingPosition.load(where) == (1, 6)

    # resume: the rest of epoch 1 first, then whole epochs
    epoch, batch = TrainingPosition.load(where)
    ds = StoreDataset(store, 16, seed=9, window=2, epoch=epoch, start_batch=batch)
    assert len(ds) == nb - 6
    position = TrainingPosition(ds, where)
    model.fit(ds, initial_epoch=epoch, epochs=epoch + 1, shuffle=False, verbose=0, callbacks=[Epochs(), position])
    ds.close()
    assert sorted(seen[1]) == list(range(len(store))), "epoch 1 across the interruption: every sample exactly once"
    want = [table[img.tobytes()] for x, _ in store.batches(16, seed=9, window=2, epoch=1) for img in x]
    assert seen[1] == want, "in the order of an uninterrupted epoch 1"
    assert position.position == (2, 0) and TrainingPosition.load(where) == (2, 0)
    gc.collect()
    assert keras_threads() == []


def test_one_fit_going_on_past_a_resumed_epoch_stops_with_what_to_do(splits: dict[str, Path]) -> None:
    """Keras keeps the first epoch's step count for the whole fit: the epoch after a resumed
    one would silently lose start_batch batches. TrainingPosition stops it, saying what to do."""
    from carraystore.keras import TrainingPosition

    ds = StoreDataset(splits["train"], 32, start_batch=3)
    assert len(ds) == ds.spec.num_batches - 3
    model = keras.Sequential(
        [keras.Input((64, 64, 3)), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(len(CLASSES))]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    position = TrainingPosition(ds)
    with pytest.raises(carraystore.InvalidInputError, match=r"resumed epoch.*initial_epoch=e, epochs=e \+ 1"):
        model.fit(ds, epochs=3, shuffle=False, verbose=0, callbacks=[position])
    assert position.position == (1, 0), "the resumed epoch itself finished"
    ds.close()

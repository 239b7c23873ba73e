"""carraystore.tf: tf.data datasets over stores of real photos, and tf.distribute."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from helpers import index_of, ingested_photos  # noqa: E402

import carraystore  # noqa: E402
from carraystore.ingest.sample_data import PHOTOS, make_video_folder  # noqa: E402
from carraystore.tf import to_dataset  # noqa: E402

CLASSES = PHOTOS[:4]


@pytest.fixture(scope="module")
def photo_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ingested_photos(
        tmp_path_factory.mktemp("tf"), n=150, size=(24, 24), classes=CLASSES, seed=8, chunk_images=16
    )


def test_element_spec(photo_store: Path, tmp_path: Path) -> None:
    ds = to_dataset(photo_store, 32)
    x, y = ds.element_spec
    assert x.shape.as_list() == [None, 24, 24, 3] and x.dtype == tf.uint8
    assert y.shape.as_list() == [None] and y.dtype == tf.int64
    x, y = to_dataset(photo_store, 32, drop_remainder=True, label_mode="categorical").element_spec
    assert x.shape.as_list() == [32, 24, 24, 3] and y.shape.as_list() == [32, 4] and y.dtype == tf.float32
    spec = to_dataset(photo_store, 8, transform=lambda x, y: (x.astype(np.float32) / 255, y)).element_spec
    assert spec[0].dtype == tf.float32 and spec[0].shape.as_list() == [None, 24, 24, 3]
    assert isinstance(to_dataset(photo_store, 8, label_mode=None).element_spec, tf.TensorSpec)
    # label_mode="binary" (a store of 2 classes): float32 (B, 1), as image_dataset_from_directory gives it
    store = carraystore.open(photo_store)
    keep = np.flatnonzero(store.labels < 2)
    with carraystore.create(tmp_path / "two.b2nd", store.image_shape, class_names=list(store.class_names[:2])) as w:
        w.append(store[keep], labels=store.labels[keep])
    bds = to_dataset(tmp_path / "two.b2nd", 16, label_mode="binary", shuffle=False)
    assert bds.element_spec[1].shape.as_list() == [None, 1] and bds.element_spec[1].dtype == tf.float32
    ys = np.concatenate([yb.numpy() for _, yb in bds])
    assert np.array_equal(ys[:, 0], store.labels[keep].astype(np.float32))
    # the spec matches what comes out
    for xb, yb in to_dataset(photo_store, 32, drop_remainder=True, label_mode="categorical").take(2):
        assert xb.shape == (32, 24, 24, 3) and yb.shape == (32, 4)
    # sequences: (B, L, H, W, C)
    video = make_video_folder(tmp_path / "video", clips=2, frames=12, size=(16, 16))
    vstore = carraystore.from_directory(video, tmp_path / "video.b2nd", keep_order=True, chunk_images=8, workers=1).path
    vds = to_dataset(vstore, 2, sequence_length=4)
    assert vds.element_spec[0].shape.as_list() == [None, 4, 16, 16, 3]
    assert sum(int(xb.shape[0]) for xb, _ in vds) == 6


def test_image_size_in_the_element_spec_and_the_batches(photo_store: Path, tmp_path: Path) -> None:
    from PIL import Image

    store = carraystore.open(photo_store)
    ds = to_dataset(photo_store, 32, shuffle=False, image_size=(12, 12))
    assert ds.element_spec[0].shape.as_list() == [None, 12, 12, 3]
    xs = np.concatenate([xb.numpy() for xb, _ in ds])
    np.testing.assert_array_equal(xs, np.stack([np.asarray(Image.fromarray(a).reduce(2)) for a in store[:]]))
    video = make_video_folder(tmp_path / "video", clips=1, frames=8, size=(16, 16))
    vstore = carraystore.from_directory(video, tmp_path / "v.b2nd", keep_order=True, chunk_images=4, workers=1).path
    vds = to_dataset(vstore, 2, sequence_length=4, image_size=(4, 4))
    assert vds.element_spec[0].shape.as_list() == [None, 4, 4, 4, 3]
    assert [tuple(xb.shape) for xb, _ in vds] == [(2, 4, 4, 4, 3)]


def test_every_pass_is_a_new_epoch_visiting_every_sample_once(photo_store: Path) -> None:
    store = carraystore.open(photo_store)
    table = index_of(store)
    ds = to_dataset(photo_store, 32, seed=3, window=2)
    assert len(ds) == 5
    orders = []
    for _ in range(2):
        seen = []
        for xb, yb in ds:
            idx = [table[img.tobytes()] for img in xb.numpy()]
            assert np.array_equal(yb.numpy(), store.labels[idx])
            seen.extend(idx)
        assert sorted(seen) == list(range(len(store)))
        orders.append(seen)
    assert orders[0] != orders[1]
    # the first pass is epoch 0 of the loader, the second epoch 1
    for epoch, order in enumerate(orders):
        want = [
            i for x, _ in store.batches(32, seed=3, window=2, epoch=epoch) for i in (table[img.tobytes()] for img in x)
        ]
        assert order == want


def test_start_batch_makes_a_dataset_of_the_rest_of_the_epoch(photo_store: Path) -> None:
    full = [x.numpy() for x, _ in to_dataset(photo_store, 20, epoch=4)]
    ds = to_dataset(photo_store, 20, epoch=4, start_batch=3)
    first = [x.numpy() for x, _ in ds]
    assert len(first) == len(full) - 3 and all(np.array_equal(a, b) for a, b in zip(first, full[3:], strict=True))
    # a second pass would not have the dataset's cardinality: it says what to do instead
    with pytest.raises(Exception, match=r"rest of that epoch only.*epoch=5"):
        for _ in ds:
            pass


def test_shards_through_input_contexts(photo_store: Path) -> None:
    store = carraystore.open(photo_store)
    table = index_of(store)
    shards = []
    for pipeline in range(3):
        ctx = tf.distribute.InputContext(num_input_pipelines=3, input_pipeline_id=pipeline, num_replicas_in_sync=3)
        ds = to_dataset(
            photo_store,
            ctx.get_per_replica_batch_size(30),
            rank=ctx.input_pipeline_id,
            world_size=ctx.num_input_pipelines,
        )
        shards.append([table[img.tobytes()] for xb, _ in ds for img in xb.numpy()])
    assert [len(s) for s in shards] == [50, 50, 50]
    assert sorted(i for s in shards for i in s) == list(range(150))


def test_fit_on_a_tf_dataset(photo_store: Path) -> None:
    keras = pytest.importorskip("keras")
    ds = to_dataset(photo_store, 16, transform=lambda x, y: (x.astype(np.float32) / 255, y))
    model = keras.Sequential([keras.Input((24, 24, 3)), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(ds, epochs=2, shuffle=False, verbose=0)
    assert len(history.history["loss"]) == 2 and np.isfinite(history.history["loss"]).all()


@pytest.mark.slow
def test_distribute_datasets_from_function_over_two_cpu_replicas(photo_store: Path) -> None:
    """MirroredStrategy over two logical CPU devices (needs a fresh process to split the CPU):
    the documented ways give every replica full batches of its own shard, the right number of
    steps, and a real model.fit over several epochs sees each epoch's samples once."""
    script = textwrap.dedent(
        f"""
        import warnings
        import numpy as np, tensorflow as tf, keras, carraystore
        from carraystore.tf import distribute, steps_per_epoch, to_dataset
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        path = {str(photo_store)!r}
        store = carraystore.open(path)
        images = store[:]
        table = {{images[i].tobytes(): i for i in range(len(images))}}

        # iterating: 150 samples, global batch 30 -> shards of 75 per replica, 5 steps of 2 x 15
        def check(dist, steps=5):
            assert int(dist.cardinality) == steps, dist.cardinality
            seen, n = [], 0
            for batch in dist:
                n += 1
                xs = strategy.experimental_local_results(batch[0])
                assert len(xs) == 2 and all(x.shape[0] == 15 for x in xs), [x.shape for x in xs]
                seen.extend(table[img.tobytes()] for x in xs for img in x.numpy())
            assert n == 5, n
            assert len(seen) == len(set(seen)) == 150, len(seen)

        check(distribute(strategy, path, 30))
        # the default PER_WORKER mode (distribute left the strategy's default as it was): one pipeline
        # feeds both replicas, still a shard each; it warns that Keras would count 10 steps, not 5
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dist = strategy.distribute_datasets_from_function(
                lambda ctx: to_dataset(path, ctx.get_per_replica_batch_size(30), input_context=ctx))
        assert any("Keras would count 2x" in str(w.message) for w in caught), [str(w.message) for w in caught]
        check(dist, steps=10)
        # distribute, spelled out (docs/loading.md)
        check(strategy.distribute_datasets_from_function(
            lambda ctx: to_dataset(path, ctx.get_per_replica_batch_size(30), input_context=ctx),
            options=tf.distribute.InputOptions(experimental_fetch_to_device=False,
                experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA)))

        # model.fit: global batch 32 does not divide 150 (4 x 32 + 22; 75 per replica is 4 x 16 + 11)
        seen, now = [], [-1]

        class Record(keras.layers.Layer):
            # notes the samples each replica trains on (run_eagerly: the batches are concrete)
            def call(self, x):
                if tf.executing_eagerly() and not isinstance(x, keras.KerasTensor):
                    seen.append((now[0], [table[img.tobytes()] for img in keras.ops.convert_to_numpy(x).astype(np.uint8)]))
                return x / 255.0

        class Steps(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                now[0] = epoch
                self.params_steps = self.params["steps"]
                self.count = 0
            def on_train_batch_end(self, batch, logs=None):
                self.count += 1
            def on_epoch_end(self, epoch, logs=None):
                counts.append((self.params_steps, self.count))

        with strategy.scope():
            model = keras.Sequential([keras.Input((24, 24, 3)), Record(), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
            model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=True)
        for drop, steps, per_epoch in ((True, 4, 128), (False, 5, 150)):
            counts, seen[:] = [], []
            assert steps_per_epoch(path, 32, drop_remainder=drop) == steps
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*ran out of data")
                history = model.fit(distribute(strategy, path, 32, drop_remainder=drop),
                                    epochs=3, verbose=0, callbacks=[Steps()], shuffle=False)
            assert counts == [(steps, steps)] * 3, counts
            assert len(history.history["loss"]) == 3 and np.isfinite(history.history["loss"]).all()
            for e in range(3):  # every sample at most once per epoch (every one of them without drop)
                ids = [i for k, b in seen if k == e for i in b]
                assert len(ids) == len(set(ids)) == per_epoch, (e, len(ids), len(set(ids)))
                sizes = sorted(len(b) for k, b in seen if k == e)
                assert sizes == ([16] * 8 if drop else [11, 11] + [16] * 8), sizes
        # the PER_WORKER path, as documented: .repeat() (each pass the next epoch) + steps_per_epoch
        counts = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "Keras would count 2x": that is why steps_per_epoch
            warnings.filterwarnings("error", message=".*ran out of data")
            dist = strategy.distribute_datasets_from_function(
                lambda ctx: to_dataset(path, ctx.get_per_replica_batch_size(30), input_context=ctx).repeat())
            model.fit(dist, epochs=2, steps_per_epoch=steps_per_epoch(path, 30), verbose=0, callbacks=[Steps()], shuffle=False)
        assert counts == [(5, 5)] * 2, counts

        # resume at another number of replicas: 2 replicas stopped after 2 steps, 1 replica
        # goes on for 1 step, then 2 replicas finish the epoch: nothing trained on twice
        from carraystore.tf import TrainingPosition

        class Stop(keras.callbacks.Callback):
            def __init__(self, after):
                super().__init__()
                self.after = after
            def on_train_batch_end(self, batch, logs=None):
                if batch + 1 == self.after:
                    self.model.stop_training = True

        seen[:] = []
        ds = distribute(strategy, path, 32, epoch=1)
        pos = TrainingPosition(ds)
        model.fit(ds, initial_epoch=1, epochs=2, verbose=0, callbacks=[pos, Stop(2)], shuffle=False)
        # the fit trained on epoch 1's order (Keras's build pass did not use the epoch up)
        want = [[table[img.tobytes()] for x, _ in store.batches(16, rank=r, world_size=2, epoch=1,
                 drop_remainder=True) for img in x] for r in (0, 1)]
        assert sorted(want[0][:32] + want[1][:32]) == sorted(i for _, b in seen for i in b)
        state = pos.state
        assert state["epoch"] == 1 and state["consumed"] == [{{"world_size": 2, "samples": 64}}], state
        part1 = [i for _, b in seen for i in b]
        assert len(part1) == len(set(part1)) == 64, len(part1)

        seen[:] = []
        model1 = keras.Sequential([keras.Input((24, 24, 3)), Record(), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
        model1.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=True)
        one = to_dataset(path, 32, resume=state, drop_remainder=True)
        assert int(one.cardinality()) == 2, one.cardinality()  # 2 x 43 left: 86 -> 2 batches of 32
        pos1 = TrainingPosition(one)
        model1.fit(one, initial_epoch=1, epochs=2, verbose=0, callbacks=[pos1, Stop(1)], shuffle=False)
        state2 = pos1.state
        assert state2["consumed"] == [{{"world_size": 2, "samples": 64}}, {{"world_size": 1, "samples": 32}}], state2
        part2 = [i for _, b in seen for i in b]
        assert len(part2) == 32 and not set(part2) & set(part1), (len(part2), sorted(set(part2) & set(part1)))

        seen[:] = []
        dist = distribute(strategy, path, 32, resume=state2)
        assert int(dist.cardinality) == 1, dist.cardinality  # 54 left: 27 per replica -> 1 step of 2 x 16
        pos2 = TrainingPosition(dist)
        model.fit(dist, initial_epoch=1, epochs=2, verbose=0, callbacks=[pos2], shuffle=False)
        part3 = [i for _, b in seen for i in b]
        assert len(part3) == 32 and not set(part3) & (set(part1) | set(part2))
        assert pos2.state["epoch"] == 2 and pos2.state["consumed"] == []
        print("DISTRIBUTED OK")
        """
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DISTRIBUTED OK" in proc.stdout


def test_a_resumed_dataset_has_its_true_cardinality(photo_store: Path) -> None:
    full = to_dataset(photo_store, 20, epoch=4)
    assert int(full.cardinality()) == 8
    ds = to_dataset(photo_store, 20, epoch=4, start_batch=3)
    assert int(ds.cardinality()) == 5 and len(ds) == 5
    assert int(to_dataset(photo_store, 20, epoch=4, start_batch=8).cardinality()) == 0

"""Resume states (carraystore.engine.resume) through every loader: batches(), Keras, tf.data, PyTorch,
at the same and at another world size, on real photo pixels (label = sample index)."""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import make_store

import carraystore
from carraystore.base.errors import InvalidInputError
from carraystore.engine.loader import batches
from carraystore.engine.resume import ResumePoint

B = 10
OPTS = {"window": 2, "num_threads": 2}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, photo_patches: Callable[..., np.ndarray]) -> Path:
    """203 real photo patches (16x16), label = index: shards of 2 and 3 ranks need padding."""
    images = photo_patches(203, (16, 16), seed=11)
    return make_store(tmp_path_factory.mktemp("resume") / "s.b2nd", images, np.arange(len(images)), chunk_images=8)


def _pixels(path: Path) -> np.ndarray:
    return carraystore.open(path)[:]


def _take(it: object, k: int) -> list[int]:
    """The sample ids of the next k batches of ``it`` (checking their pixels against the store)."""
    ids: list[int] = []
    for _ in range(k):
        x, y = next(it)  # type: ignore[call-overload]
        ids.extend(int(v) for v in np.asarray(y))
    return ids


def _rest(path: Path, batches_: object) -> list[int]:
    pixels = _pixels(path)
    ids: list[int] = []
    for x, y in batches_:  # type: ignore[attr-defined]
        y = np.asarray(y)
        np.testing.assert_array_equal(np.asarray(x), pixels[y])
        ids.extend(int(v) for v in y)
    return ids


def _whole_epoch(path: Path, world: int, epoch: int, drop: bool = False) -> collections.Counter[int]:
    """What an uninterrupted epoch gives over ``world`` ranks (padding included)."""
    out: collections.Counter[int] = collections.Counter()
    for r in range(world):
        for _, y in batches(path, B, rank=r, world_size=world, epoch=epoch, drop_remainder=drop, **OPTS):
            out.update(int(v) for v in y)
    return out


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 1), (1, 2)])
def test_batches_resume_at_another_world_size_losing_and_repeating_nothing(
    store: Path, before: int, after: int
) -> None:
    its = [iter(batches(store, B, rank=r, world_size=before, epoch=2, **OPTS)) for r in range(before)]
    consumed = [i for it in its for i in _take(it, 4)]
    states = [it.state_dict() for it in its]  # type: ignore[attr-defined]
    assert all(s == states[0] for s in states) and states[0]["epoch"] == 2
    assert states[0]["consumed"] == [{"world_size": before, "samples": 40 * before}]
    json.dumps(states[0])  # JSON-friendly
    rest = [batches(store, B, rank=r, world_size=after, resume=states[0], **OPTS) for r in range(after)]
    assert len({len(it) for it in rest}) == 1  # equal shards
    got = collections.Counter(consumed)
    for it in rest:
        assert it.epoch == 2
        got.update(_rest(store, it))
    # every sample at least once; only the pads of the (re)shardings repeat, never more than the ranks
    assert sorted(got) == list(range(203))
    pads = sum(got.values()) - 203
    assert 0 <= pads < before + after, got.most_common(3)
    # the epoch after the resumed one is whole, in the uninterrupted order
    nxt = batches(store, B, rank=0, world_size=after, resume=states[0], epoch=2, **OPTS)
    assert nxt.epoch == 2


def test_a_state_at_the_same_world_size_equals_start_batch(store: Path) -> None:
    it = batches(store, B, rank=1, world_size=2, epoch=1, **OPTS)
    _take(it, 5)
    state = it.state_dict()
    via_state = _rest(store, batches(store, B, rank=1, world_size=2, resume=state, **OPTS))
    via_start = _rest(store, batches(store, B, rank=1, world_size=2, epoch=1, start_batch=5, **OPTS))
    assert via_state == via_start and len(via_state) == 102 - 50


def test_drop_remainder_states_resume_on_full_batches_only(store: Path) -> None:
    its = [batches(store, B, rank=r, world_size=2, drop_remainder=True, **OPTS) for r in range(2)]
    consumed = [i for it in its for i in _take(it, 3)]
    state = its[0].state_dict()
    rest = batches(store, B, rank=0, world_size=1, drop_remainder=True, resume=state, **OPTS)
    ids = _rest(store, rest)
    assert len(ids) % B == 0 and not set(ids) & set(consumed) and len(set(ids)) == len(ids)
    # 203 - 1 dropped by the first sharding = 202; 60 consumed; 142 left -> 14 full batches
    assert len(ids) == 140


def test_a_finished_epoch_gives_the_next_one_whole(store: Path) -> None:
    it = batches(store, B, epoch=4, **OPTS)
    n = len(_rest(store, it))
    assert n == 203
    state = it.state_dict()
    assert state["epoch"] == 5 and state["consumed"] == [] and state["samples"] == 0
    again = batches(store, B, resume=state, **OPTS)
    assert again.epoch == 5 and len(again) == 21
    want = [int(v) for _, y in batches(store, B, epoch=5, **OPTS) for v in y]
    assert _rest(store, again) == want


def test_states_of_another_order_or_malformed_are_named_errors(store: Path) -> None:
    it = batches(store, B, seed=3, **OPTS)
    _take(it, 2)
    state = it.state_dict()
    with pytest.raises(InvalidInputError, match=r"another order \(seed: saved 3, here 0\)"):
        batches(store, B, resume=state, **OPTS)
    with pytest.raises(InvalidInputError, match="window: saved 2, here 4"):
        batches(store, B, seed=3, window=4, resume=state)
    with pytest.raises(InvalidInputError, match="not both"):
        batches(store, B, seed=3, resume=state, start_batch=1, **OPTS)
    with pytest.raises(InvalidInputError, match="leave epoch out"):
        batches(store, B, seed=3, resume=state, epoch=7, **OPTS)
    with pytest.raises(InvalidInputError, match="state_dict"):
        batches(store, B, resume={"epoch": 0}, **OPTS)
    with pytest.raises(InvalidInputError, match="lacks"):
        batches(store, B, resume={"version": 1, "epoch": 0, "consumed": []}, **OPTS)
    bad = dict(state, consumed=[{"world_size": 2, "samples": 3}])
    with pytest.raises(InvalidInputError, match="not a run ranks make"):
        batches(store, B, seed=3, resume=bad, **OPTS)
    too_many = dict(state, consumed=[{"world_size": 1, "samples": 500}])
    with pytest.raises(InvalidInputError, match="cannot have consumed 500"):
        batches(store, B, seed=3, resume=too_many, **OPTS)
    # another store (fewer samples): refused, naming what differs
    images = carraystore.open(store)[:100]
    smaller = store.with_name("smaller.b2nd")
    with carraystore.create(smaller, images.shape[1:], chunk_images=8, overwrite=True) as w:
        w.append(images, np.arange(100))
    with pytest.raises(InvalidInputError, match="num_items: saved 203, here 100"):
        batches(smaller, B, seed=3, resume=state, **OPTS)
    assert ResumePoint.from_state(state).to_state() == state


def test_keras_resumes_a_state_at_another_world_size_and_records_it(store: Path, tmp_path: Path) -> None:
    keras = pytest.importorskip("keras")
    from carraystore.keras import StoreDataset, TrainingPosition

    ranks = [StoreDataset(store, B, rank=r, world_size=3, epoch=1, **OPTS) for r in range(3)]
    consumed = [int(v) for ds in ranks for i in range(3) for v in ds[i][1]]
    state = ranks[2].state_dict(3)
    assert state["consumed"] == [{"world_size": 3, "samples": 90}] and state == ranks[0].state_dict(3)
    one = StoreDataset(store, B, resume=state, **OPTS)
    assert one.epoch == 1 and len(one) == 12  # 204 - 90 = 114 left: 12 batches
    x0 = _pixels(store)
    model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Stop(keras.callbacks.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
            if batch == 4:
                self.model.stop_training = True

    # labels are indices up to 202: a 4-class head sees them as out-of-range, so train on y % 4
    one_mod = StoreDataset(store, B, resume=state, transform=lambda x, y: (x, y % 4), **OPTS)
    pos = TrainingPosition(one_mod, tmp_path / "pos.json")
    model.fit(one_mod, epochs=2, initial_epoch=1, shuffle=False, verbose=0, callbacks=[pos, Stop()])
    assert pos.position == (1, 5)
    rec = json.loads((tmp_path / "pos.json").read_text())
    assert rec["batch"] is None  # inside an epoch resumed from a state: no start_batch to give
    with pytest.raises(InvalidInputError, match="resume=TrainingPosition.load_state"):
        TrainingPosition.load(tmp_path / "pos.json")
    state2 = TrainingPosition.load_state(tmp_path / "pos.json")
    assert state2 == pos.state
    assert state2["consumed"] == [{"world_size": 3, "samples": 90}, {"world_size": 1, "samples": 50}]
    served = [int(v) for i in range(5) for v in one[i][1]]  # what the fit trained on (same order)
    for i in range(5):
        x, y = one[i]
        np.testing.assert_array_equal(x, x0[y])
    # two ranks take the rest: everything once (pads aside)
    last = [StoreDataset(store, B, rank=r, world_size=2, resume=state2, **OPTS) for r in range(2)]
    rest = [int(v) for ds in last for i in range(len(ds)) for v in ds[i][1]]
    got = collections.Counter(consumed + served + rest)
    assert sorted(got) == list(range(203)) and sum(got.values()) - 203 < 3
    assert TrainingPosition.load_state(tmp_path / "none.json") is None
    for d in [*ranks, one, one_mod, *last]:
        d.close()  # the decoder threads end now, not when garbage collected (test_keras counts them)


def test_a_torch_state_resumes_in_keras_and_tf(store: Path) -> None:
    torch_mod = pytest.importorskip("carraystore.torch")
    ds = torch_mod.StoreDataset(store, B, rank=0, world_size=2, epoch=3, **OPTS)
    first = []
    for k, (_, y) in enumerate(ds):
        first.extend(int(v) for v in y)
        if k == 1:
            break
    state = ds.state_dict(batches=2)
    want = [int(v) for _, y in batches(store, B, resume=state, **OPTS) for v in y]
    keras_mod = pytest.importorskip("carraystore.keras")
    kds = keras_mod.StoreDataset(store, B, resume=state, **OPTS)
    assert [int(v) for i in range(len(kds)) for v in kds[i][1]] == want
    kds.close()
    tf_mod = pytest.importorskip("carraystore.tf")
    tds = tf_mod.to_dataset(store, B, resume=state, **OPTS)
    assert int(tds.cardinality()) == len(kds)
    assert [int(v) for _, y in tds for v in y.numpy()] == want
    with pytest.raises(Exception, match="from a resume state"):
        for _ in tds:
            pass


def test_tf_training_position_counts_steps_into_states(store: Path, tmp_path: Path) -> None:
    pytest.importorskip("tensorflow")
    import keras

    from carraystore.tf import TrainingPosition, to_dataset

    ds = to_dataset(store, B, epoch=2, transform=lambda x, y: (x, y % 4), **OPTS)
    model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    pos = TrainingPosition(ds, save_to=tmp_path / "s.json")

    class Stop(keras.callbacks.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
            if batch == 6:
                self.model.stop_training = True

    model.fit(ds, epochs=3, shuffle=False, verbose=0, callbacks=[pos, Stop()])
    state = TrainingPosition.load_state(tmp_path / "s.json")
    assert state == pos.state and state["epoch"] == 2
    assert state["consumed"] == [{"world_size": 1, "samples": 70}]
    full = [int(v) for _, y in batches(store, B, epoch=2, **OPTS) for v in y]
    rest = [int(v) for _, y in to_dataset(store, B, resume=state, **OPTS) for v in y.numpy()]
    assert rest == full[70:]
    # a whole epoch moves the state to the next epoch; the second fit epoch is the dataset's next epoch
    ds2 = to_dataset(store, B, epoch=2, transform=lambda x, y: (x, y % 4), **OPTS)
    pos2 = TrainingPosition(ds2)
    model.fit(ds2, epochs=2, shuffle=False, verbose=0, callbacks=[pos2])
    assert pos2.state["epoch"] == 4 and pos2.state["consumed"] == []
    with pytest.raises(InvalidInputError, match="to_dataset or distribute returned"):
        TrainingPosition(ds2.take(3))


def test_plans_from_one_sequence_equal_plans_made_alone() -> None:
    """Many ranks' plans from one epoch_sequence (what resuming at another world size makes)
    are the plans each rank makes on its own, padding and drop_remainder included."""
    from carraystore.engine.sampling import EpochOrder, epoch_sequence, plan_epoch

    items = np.flatnonzero(np.arange(200) % 7 != 3)  # clip starts (span 2): not every sample
    for shuffle in ("block", "global", False):
        for kw in ({}, {"items": items, "span": 2}):
            for world, drop in ((1, False), (3, False), (4, True), (5, False)):
                seq = epoch_sequence(203, 8, EpochOrder(shuffle, seed=2, epoch=5), kw.get("items"))  # type: ignore[arg-type]
                for r in range(world):
                    args = dict(
                        shuffle=shuffle, seed=2, epoch=5, window=3, rank=r, world_size=world, drop_remainder=drop
                    )
                    alone = plan_epoch(203, 8, batch_size=10, **args, **kw)  # type: ignore[arg-type]
                    shared = plan_epoch(203, 8, batch_size=10, sequence=seq, **args, **kw)  # type: ignore[arg-type]
                    assert np.array_equal(alone.items, shared.items)
                    assert np.array_equal(alone.window_starts, shared.window_starts)
                    assert all(
                        np.array_equal(a, b) for a, b in zip(alone.window_chunks, shared.window_chunks, strict=True)
                    )


def test_a_resume_state_of_a_huge_world_is_refused_before_any_work(store: Path) -> None:
    it = batches(store, B, **OPTS)
    _take(it, 1)
    state = dict(it.state_dict(), consumed=[{"world_size": 10**9, "samples": 10**9}])
    with pytest.raises(InvalidInputError, match="world_size 1000000000.*203 items"):
        batches(store, B, resume=state, **OPTS)


def test_tf_training_position_of_a_start_batch_dataset_counts_from_the_epoch_start(store: Path) -> None:
    """A fit over ``to_dataset(..., start_batch=b)`` has served batches b, b+1, ... of the epoch:
    its state must count them from the epoch's start (else the batches before b came back),
    and a whole pass over the rest ends the epoch (else its last batches came back)."""
    pytest.importorskip("tensorflow")
    import keras

    from carraystore.tf import TrainingPosition, to_dataset

    def fit(ds: object, pos: object, stop_after: int | None) -> None:
        model = keras.Sequential(
            [keras.Input((16, 16, 3)), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)]
        )
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))

        class Stop(keras.callbacks.Callback):  # type: ignore[misc]
            def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
                if batch + 1 == stop_after:
                    self.model.stop_training = True

        model.fit(ds, epochs=2, initial_epoch=1, shuffle=False, verbose=0, callbacks=[pos, Stop()])

    full = [int(v) for _, y in batches(store, B, epoch=1, **OPTS) for v in y]
    ds = to_dataset(store, B, epoch=1, start_batch=5, transform=lambda x, y: (x, y % 4), **OPTS)
    pos = TrainingPosition(ds)
    assert pos.state["consumed"] == [{"world_size": 1, "samples": 50}]  # before the fit: at batch 5
    fit(ds, pos, stop_after=2)  # batches 5 and 6
    assert pos.position == (1, 7)
    state = pos.state
    assert state["epoch"] == 1 and state["consumed"] == [{"world_size": 1, "samples": 70}]
    rest = [int(v) for _, y in to_dataset(store, B, resume=state, **OPTS) for v in y.numpy()]
    assert rest == full[70:]
    # the whole rest of the epoch: the state moves to the next epoch, whole
    ds2 = to_dataset(store, B, epoch=1, start_batch=5, transform=lambda x, y: (x, y % 4), **OPTS)
    pos2 = TrainingPosition(ds2)
    fit(ds2, pos2, stop_after=None)
    assert pos2.position == (2, 0)
    assert pos2.state["epoch"] == 2 and pos2.state["consumed"] == []


@pytest.mark.parametrize(
    "change",
    [
        {"consumed": None},
        {"consumed": 5},
        {"consumed": [{"world_size": 1.5, "samples": 30}]},
        {"consumed": [{"world_size": 1, "samples": 30.7}]},
        {"consumed": [{"world_size": 1, "samples": "30"}]},
        {"consumed": [{"world_size": True, "samples": 30}]},
        {"consumed": [{"world_size": 1, "samples": float("inf")}]},
        {"consumed": [{"world_size": 1, "samples": 0}]},  # no state records a run that consumed nothing
        {"consumed": [{"world_size": 2, "samples": 0}] * 100_000},  # ... nor makes 100,000 cuts of the epoch
        {"version": True},
        {"version": 1.0},
    ],
)
def test_hostile_states_are_named_errors(store: Path, change: dict[str, object]) -> None:
    """A state damaged or made up is refused with InvalidInputError, quickly: never a crash, never
    a number silently rounded into another run."""
    it = batches(store, B, **OPTS)
    _take(it, 3)
    state = dict(it.state_dict(), **change)
    it.close()
    with pytest.raises(InvalidInputError):
        batches(store, B, resume=state, **OPTS)


def test_a_state_of_other_groups_is_refused_even_with_as_many_clips(store: Path) -> None:
    """Clips follow the groups: a state saved over other groups names other clips (or other
    random starts), even when their number is the same, so it is refused, not used."""
    clips = {"sequence_length": 5, **OPTS}
    saved_groups = np.repeat([0, 1], [100, 103])  # 20 + 20 clips
    it = batches(store, 4, groups=saved_groups, **clips)
    _take(it, 2)
    state = json.loads(json.dumps(it.state_dict()))
    it.close()
    assert state["num_items"] == 40
    same = batches(store, 4, groups=saved_groups, resume=state, **clips)
    assert len(same) == 8  # 40 clips - 8 consumed = 32: 8 batches
    same.close()
    other_clips = np.repeat([0, 1], [50, 153])  # 10 + 30 clips: 40 too, other ones
    # the same clip starts, but the last run ends 3 frames later: its random starts differ
    other_slack = np.repeat([0, 1, 2], [100, 100, 3])
    for groups in (other_clips, other_slack):
        with pytest.raises(InvalidInputError, match="another order"):
            batches(store, 4, groups=groups, resume=state, **clips)


def test_options_holding_a_state_take_a_state_of_another_epoch(store: Path) -> None:
    """The epoch of options made with ``resume=`` is the state's, not one the caller gave: a newer
    state passed over them (``batches(store, B, options, resume=newer)``) resumes its own epoch."""
    from carraystore.engine.options import LoaderOptions

    it = batches(store, B, epoch=2, **OPTS)
    _take(it, 3)
    options = LoaderOptions(resume=it.state_dict(), **OPTS)
    _rest(store, it)  # the epoch ends: the next state is epoch 3, whole
    newer = it.state_dict()
    assert options.epoch == 2 and newer["epoch"] == 3
    resumed = batches(store, B, options, resume=newer)
    assert resumed.epoch == 3 and len(resumed) == 21
    resumed.close()
    assert options.replace(resume=None).epoch == 2  # dropping the state keeps its epoch
    with pytest.raises(InvalidInputError, match="leave epoch out"):
        options.replace(resume=newer, epoch=2)  # an epoch given with it still has to agree


@pytest.fixture(scope="module")
def tiny_stores(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, int], Path]:
    """Stores of n blank 2x2 images (label = index) in chunks of c, made once each."""
    made: dict[tuple[int, int], Path] = {}
    root = tmp_path_factory.mktemp("tiny")

    def get(n: int, c: int) -> Path:
        if (n, c) not in made:
            path = root / f"s{n}_{c}.b2nd"
            with carraystore.create(path, (2, 2, 1), chunk_images=c) as w:
                w.append(np.zeros((n, 2, 2, 1), np.uint8), np.arange(n))
            made[n, c] = path
        return made[n, c]

    return get


def test_chains_of_runs_at_any_world_and_batch_size_lose_and_repeat_nothing(
    tiny_stores: Callable[[int, int], Path],
) -> None:
    """Property: an epoch interrupted any number of times, each run at its own world size and
    batch size, its state passed through JSON each time, serves every item of the epoch (the
    pads of each cut aside; with drop_remainder nothing twice), and its last state is the next
    epoch, whole. Clips (random starts over groups) and every shuffle included. The plans only:
    no pixel is decoded."""
    import warnings

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from carraystore.engine.spec import make_spec

    run = st.tuples(st.integers(1, 5), st.integers(1, 7), st.integers(0, 4))  # world, batch, batches taken

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        n=st.integers(4, 60),
        chunk=st.integers(1, 9),
        shuffle=st.sampled_from(["block", "global", False]),
        drop=st.booleans(),
        runs=st.lists(run, min_size=1, max_size=4),
        clips=st.sampled_from([None, (3, None, "random"), (2, 1, "fixed")]),
        gseed=st.integers(0, 99),
    )
    def chain(n, chunk, shuffle, drop, runs, clips, gseed):  # type: ignore[no-untyped-def]
        opts: dict[str, object] = {"shuffle": shuffle, "drop_remainder": drop, "window": 2, "num_threads": 1}
        if clips is not None:
            groups = np.sort(np.random.default_rng(gseed).integers(0, 4, n))
            opts.update(sequence_length=clips[0], sequence_stride=clips[1], clip_starts=clips[2], groups=groups)
        path = tiny_stores(n, chunk)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # short groups
            try:
                items = make_spec(path, 1, **opts).items_for(1)  # type: ignore[arg-type]
            except InvalidInputError:
                return  # no clip at all
            items = np.arange(n) if items is None else items
            if max(w for w, _, _ in runs) > len(items):
                return  # more ranks than items: no run makes that (refused, tested above)
            state: dict[str, object] | None = None
            got: collections.Counter[int] = collections.Counter()
            for w, b, k in [*runs, (runs[-1][0], runs[-1][1], None)]:
                kw = dict(opts, resume=json.loads(json.dumps(state))) if state else dict(opts, epoch=1)
                specs = [make_spec(path, b, rank=r, world_size=w, **kw) for r in range(w)]  # type: ignore[arg-type]
                nb = {s.epoch_batches(1) for s in specs}
                assert len(nb) == 1  # equal shards
                taken = nb.pop() if k is None else min(k, specs[0].epoch_batches(1))
                for s in specs:
                    got.update(int(i) for i in s.plan(1).items[: taken * b])
                states = [s.state_dict(1, taken) for s in specs]
                assert all(x == states[0] for x in states)  # ranks in lockstep: one state
                state = states[0]
                if state["epoch"] != 1:
                    break
        assert state is not None
        if drop:
            assert max(got.values(), default=1) == 1 and set(got) <= {int(i) for i in items}
            if state["epoch"] == 1:
                return  # the rest holds no full batch at this world size: the state stays in the epoch
        else:
            assert sorted(got) == sorted(int(i) for i in items)
            assert sum(got.values()) - len(items) < sum(w for w, _, _ in runs) + runs[-1][0]  # the pads only
        assert state["epoch"] == 2 and state["consumed"] == []

    chain()


def test_a_state_of_another_store_of_as_many_images_is_refused(
    store: Path, tmp_path: Path, photo_patches: Callable[..., np.ndarray]
) -> None:
    it = batches(store, B, **OPTS)
    _take(it, 2)
    state = it.state_dict()
    images = photo_patches(203, (16, 16), seed=12)  # other photos, as many, same chunks
    other = tmp_path / "other.b2nd"
    with carraystore.create(other, images.shape[1:], chunk_images=8) as w:
        w.append(images, np.arange(len(images)))
    with pytest.raises(InvalidInputError, match="content: saved"):
        batches(other, B, resume=state, **OPTS)
    # a copy of the store is the same store
    copy = tmp_path / "copy.b2nd"
    copy.write_bytes(Path(store).read_bytes())
    assert _rest(copy, batches(copy, B, resume=state, **OPTS)) == _rest(store, batches(store, B, resume=state, **OPTS))


def test_keras_set_epoch_serves_the_resumed_epoch_from_where_it_stopped(store: Path) -> None:
    pytest.importorskip("keras")
    from carraystore.keras import StoreDataset

    it = batches(store, B, epoch=2, **OPTS)
    _take(it, 4)
    state = it.state_dict()
    for ds in (StoreDataset(store, B, resume=state, **OPTS), StoreDataset(store, B, epoch=2, start_batch=4, **OPTS)):
        rest = [int(v) for i in range(len(ds)) for v in ds[i][1]]
        assert len(rest) == 203 - 40
        ds.set_epoch(3)
        assert len(ds) == 21
        ds.set_epoch(2)  # a loop calling set_epoch every epoch: the consumed part never comes back
        assert [int(v) for i in range(len(ds)) for v in ds[i][1]] == rest
        ds.close()

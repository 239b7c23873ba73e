"""carraystore.torch: StoreDataset / StoreMapDataset under a real torch DataLoader, on real photo pixels."""

from __future__ import annotations

import collections
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from helpers import make_store  # noqa: E402
from torch.utils.data import DataLoader, RandomSampler  # noqa: E402

import carraystore  # noqa: E402
from carraystore.base.errors import InvalidInputError  # noqa: E402
from carraystore.engine.sampling import remainder_plan  # noqa: E402
from carraystore.torch import StoreDataLoader, StoreDataset, StoreMapDataset  # noqa: E402

B = 10
OPTS = {"window": 2, "num_threads": 2}


def _write(path: Path, images: np.ndarray) -> Path:
    # label = sample index, so every yielded sample names itself
    return make_store(path, images, np.arange(len(images)), chunk_images=8, overwrite=True)


@pytest.fixture(scope="module")
def odd_store(tmp_path_factory: pytest.TempPathFactory, photo_patches: Callable[..., np.ndarray]) -> Path:
    """203 real photo patches (16x16): the last batch is short, two shards need one padded sample."""
    return _write(tmp_path_factory.mktemp("torch") / "odd.b2nd", photo_patches(203, (16, 16), seed=5))


@pytest.fixture(scope="module")
def even_store(tmp_path_factory: pytest.TempPathFactory, photo_patches: Callable[..., np.ndarray]) -> Path:
    """200 real photo patches: two shards of 100, nothing padded."""
    return _write(tmp_path_factory.mktemp("torch") / "even.b2nd", photo_patches(200, (16, 16), seed=6))


def _ids(batches: list) -> list[int]:
    return [int(v) for _, y in batches for v in y]


def _check_pixels(path: Path, batches: list) -> None:
    pixels = carraystore.open(path)[:]
    for x, y in batches:
        assert isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and y.dtype == torch.int64
        assert x.shape[1:] == (16, 16, 3)
        np.testing.assert_array_equal(x.numpy(), pixels[y.numpy()])


def _take(loader: object, k: int) -> list:
    out = []
    for batch in loader:  # type: ignore[attr-defined]
        out.append(batch)
        if len(out) == k:
            break
    return out


def test_zero_and_two_workers_give_every_sample_once_in_the_same_order(odd_store: Path) -> None:
    ds = StoreDataset(odd_store, B, **OPTS)
    assert len(ds) == 21
    kept = list(DataLoader(ds, batch_size=None, num_workers=0))  # kept without copying: never overwritten
    assert sorted(_ids(kept)) == list(range(203))
    assert [len(y) for _, y in kept] == [10] * 20 + [3]
    _check_pixels(odd_store, kept)
    two = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert _ids(two) == _ids(kept)
    _check_pixels(odd_store, two)


def test_image_size_gives_pillows_reduce_in_the_workers_too(odd_store: Path) -> None:
    from PIL import Image

    pixels = carraystore.open(odd_store)[:]
    small = np.stack([np.asarray(Image.fromarray(a).reduce(2)) for a in pixels])
    ds = StoreDataset(odd_store, B, image_size=(8, 8), **OPTS)
    for workers in (0, 2):
        got = list(DataLoader(ds, batch_size=None, num_workers=workers))
        assert sorted(_ids(got)) == list(range(203))
        for x, y in got:
            assert tuple(x.shape[1:]) == (8, 8, 3)
            np.testing.assert_array_equal(x.numpy(), small[y.numpy()])
    m = StoreMapDataset(odd_store, B, image_size=(4, 4), shuffle=False, **OPTS)
    x, y = m[3]
    assert tuple(x.shape) == (10, 4, 4, 3)
    np.testing.assert_array_equal(x.numpy(), [np.asarray(Image.fromarray(a).reduce(4)) for a in pixels[y.numpy()]])


# forkserver works the same way (the dataset pickles as for spawn); it costs another ~10 s here
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_multiprocessing_contexts(odd_store: Path, context: str) -> None:
    ds = StoreDataset(str(odd_store), B, **OPTS)
    ds.set_epoch(3)
    want = _ids(list(ds))
    got = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context))
    assert _ids(got) == want
    _check_pixels(odd_store, got)


def test_two_ranks_get_equal_shards_that_cover_every_sample(odd_store: Path) -> None:
    ranks = [_ids(list(StoreDataset(odd_store, B, rank=r, world_size=2, **OPTS))) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 102 and len(StoreDataset(odd_store, B, rank=1, world_size=2)) == 11
    assert set(ranks[0]) | set(ranks[1]) == set(range(203))
    assert len(set(ranks[0]) & set(ranks[1])) == 1  # the one sample wrapped around to pad 203 into 2 x 102
    drop = [_ids(list(StoreDataset(odd_store, B, rank=r, world_size=2, drop_remainder=True, **OPTS))) for r in (0, 1)]
    assert len(drop[0]) == len(drop[1]) == 100  # 101 per shard, the short last batch dropped too
    assert not set(drop[0]) & set(drop[1])


def test_rank_and_world_size_are_loader_options_and_default_to_torch_distributed(
    odd_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import carraystore.torch as ct
    from carraystore.engine.options import LoaderOptions

    by_value = StoreDataset(odd_store, B, LoaderOptions(rank=1, world_size=2, **OPTS))  # type: ignore[arg-type]
    assert (by_value.rank, by_value.world_size) == (1, 2)
    assert _ids(list(by_value)) == _ids(list(StoreDataset(odd_store, B, rank=1, world_size=2, **OPTS)))
    monkeypatch.setattr(ct, "_distributed", lambda: (1, 4))  # an initialised process group of 4
    for ds in (StoreDataset(odd_store, B), StoreMapDataset(odd_store, B)):
        assert (ds.rank, ds.world_size) == (1, 4) and len(ds) == 6  # 51 samples of 203
    for given in ({"world_size": 1}, {"rank": 0}, {"rank": 0, "world_size": 2}):
        ds = StoreDataset(odd_store, B, **given)  # type: ignore[arg-type]
        assert (ds.rank, ds.world_size) == (0, given.get("world_size", 1))
    assert StoreDataset(odd_store, B, LoaderOptions(world_size=2)).world_size == 2


_DDP_SCRIPT = """
import json, os, sys
import torch.distributed as dist
from torch.utils.data import DataLoader
from carraystore.torch import StoreDataset, StoreMapDataset

path, workers = sys.argv[1], int(sys.argv[2])
ds = StoreDataset(path, 10, window=2, num_threads=2)  # built before the process group, as users do
mapped = StoreMapDataset(path, 10, window=2, num_threads=2)
dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
ids = [int(v) for _, y in DataLoader(ds, batch_size=None, num_workers=workers) for v in y]
mapped_ids = [int(v) for i in range(len(mapped)) for v in mapped[i][1]]
print(json.dumps({"rank": ds.rank, "world": ds.world_size, "ids": ids, "mapped": mapped_ids}))
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_ddp_ranks_of_a_dataset_built_before_the_process_group_read_disjoint_shards(
    odd_store: Path, tmp_path: Path, workers: int
) -> None:
    # two gloo processes (torchrun's environment), each building its datasets before init_process_group
    import json
    import os
    import subprocess
    import sys

    from testsupport.servers import free_port

    script = tmp_path / "ddp.py"
    script.write_text(_DDP_SCRIPT)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(odd_store), str(workers)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert [(o["rank"], o["world"]) for o in outs] == [(0, 2), (1, 2)]
    for key in ("ids", "mapped"):
        a, b = (o[key] for o in outs)
        assert len(a) == len(b) == 102  # 203 samples in two shards, one padded
        assert set(a) | set(b) == set(range(203)) and len(set(a) & set(b)) == 1  # only the padding sample


def test_a_process_group_after_a_resumed_dataset_or_unseen_by_workers_is_refused_by_name(
    odd_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import carraystore.torch as ct
    from carraystore.base.errors import LoaderError

    monkeypatch.setattr(ct, "_distributed", lambda: None)
    resumed = StoreDataset(odd_store, B, start_batch=3, **OPTS)
    plain = StoreDataset(odd_store, B, **OPTS)
    monkeypatch.setattr(ct, "_distributed", lambda: (1, 2))  # the group appears after both were built
    with pytest.raises(LoaderError, match="init_process_group"):
        list(resumed)
    assert len(plain) == 11 and (plain.rank, plain.world_size) == (1, 2)  # 102 of 203 samples: the group joined
    # a DataLoader worker (spawn) of a job of two processes that never saw the group
    monkeypatch.setattr(ct, "_distributed", lambda: None)
    monkeypatch.setattr(ct, "get_worker_info", lambda: object())
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LoaderError, match="WORLD_SIZE=2"):
        StoreDataset(odd_store, B, **OPTS).plan()


def test_set_epoch_changes_the_order_deterministically(odd_store: Path) -> None:
    ds = StoreDataset(odd_store, B, **OPTS)
    e0 = _ids(list(ds))
    ds.set_epoch(1)
    e1 = _ids(list(ds))
    assert e0 != e1 and sorted(e0) == sorted(e1) == list(range(203))
    assert _ids(list(ds)) == e1
    assert _ids(list(StoreDataset(odd_store, B, epoch=1, **OPTS))) == e1
    assert _ids(list(DataLoader(ds, batch_size=None, num_workers=2))) == e1


def test_resume_at_the_same_world_size_with_workers(odd_store: Path) -> None:
    ds = StoreDataset(odd_store, B, epoch=2, **OPTS)
    full = _ids(list(ds))
    first = _take(StoreDataLoader(ds, num_workers=2), 7)
    state = ds.state_dict()
    assert state["epoch"] == 2 and state["samples"] == 70
    again = StoreDataset(odd_store, B, **OPTS)
    again.load_state_dict(state)
    assert len(again) == 14
    rest = list(StoreDataLoader(again, num_workers=2))
    assert _ids(first) + _ids(rest) == full  # the uninterrupted epoch's order, each sample once
    _check_pixels(odd_store, rest)
    assert again.state_dict()["epoch"] == 3 and again.state_dict()["consumed"] == []


def test_resume_from_two_ranks_on_one(even_store: Path) -> None:
    ranks = [StoreDataset(even_store, B, rank=r, world_size=2, epoch=1, **OPTS) for r in (0, 1)]
    consumed = [_ids(_take(StoreDataLoader(ds), 3)) for ds in ranks]
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict() and state["samples"] == 60
    one = StoreDataset(even_store, B, **OPTS)
    one.load_state_dict(state)
    rest = list(StoreDataLoader(one, num_workers=2))
    assert len(one) == 14
    counts = collections.Counter(consumed[0] + consumed[1] + _ids(rest))
    assert sorted(counts) == list(range(200)) and set(counts.values()) == {1}
    _check_pixels(even_store, rest)


def test_resume_from_one_rank_on_two_then_on_one_again(even_store: Path) -> None:
    one = StoreDataset(even_store, B, **OPTS)
    consumed = _ids(_take(one, 7))
    state = one.state_dict()
    assert state["consumed"] == [{"world_size": 1, "samples": 70}]
    ranks = [StoreDataset(even_store, B, rank=r, world_size=2, **OPTS) for r in (0, 1)]
    for ds in ranks:
        ds.load_state_dict(state)
    assert len(ranks[0]) == len(ranks[1]) == 7  # 130 left: 65 per rank
    parts = [_ids(_take(ds, 2)) for ds in ranks]  # interrupted again, 2 batches into the resumed epoch
    state2 = ranks[1].state_dict()
    assert state2["consumed"] == [{"world_size": 1, "samples": 70}, {"world_size": 2, "samples": 40}]
    last = StoreDataset(even_store, B, **OPTS)
    last.load_state_dict(state2)
    counts = collections.Counter(consumed + parts[0] + parts[1] + _ids(list(last)))
    assert sorted(counts) == list(range(200)) and set(counts.values()) == {1}


def test_remainder_plan_pads_an_odd_rest_by_wrapping_and_keeps_windows() -> None:
    from carraystore.engine.sampling import plan_epoch

    def first(rank: int, world_size: int):  # type: ignore[no-untyped-def]
        return plan_epoch(101, 8, seed=4, epoch=0, window=2, rank=rank, world_size=world_size)

    plans = [remainder_plan(first, [(1, 30)], r, 2) for r in (0, 1)]
    assert len(plans[0]) == len(plans[1]) == 36  # 71 left, one padded by wrapping around
    rest = np.concatenate([p.items for p in plans])
    assert collections.Counter(rest.tolist()) == collections.Counter(first(0, 1).items[30:].tolist() + [int(rest[0])])
    for p in plans:  # every window needs at most the chunks of a window of the epoch
        assert p.max_window_chunks <= first(0, 1).max_window_chunks
        for w in range(p.nwindows):
            assert set(p.items[p.window_starts[w] : p.window_starts[w + 1]] // 8) <= set(p.window_chunks[w])
    with pytest.raises(InvalidInputError, match="cannot have consumed"):
        remainder_plan(first, [(1, 102)], 0, 1)


def test_a_state_of_another_order_is_refused(odd_store: Path) -> None:
    ds = StoreDataset(odd_store, B, **OPTS)
    _take(ds, 2)
    state = ds.state_dict()
    with pytest.raises(InvalidInputError, match="seed: saved 0, here 1"):
        StoreDataset(odd_store, B, seed=1, **OPTS).load_state_dict(state)
    with pytest.raises(InvalidInputError, match="state_dict"):
        ds.load_state_dict({"epoch": 1})


def test_pickles_as_location_and_options(odd_store: Path) -> None:
    ds = StoreDataset(odd_store, B, **OPTS)
    want = _ids(list(ds))
    data = pickle.dumps(ds)
    assert len(data) < 4000 and carraystore.open(odd_store)[0].tobytes()[:64] not in data
    assert _ids(list(pickle.loads(data))) == want


def test_map_style_serves_batch_i_for_any_sampler(odd_store: Path) -> None:
    it = list(StoreDataset(odd_store, B, **OPTS))
    md = StoreMapDataset(odd_store, B, **OPTS)
    assert len(md) == 21
    seq = list(DataLoader(md, batch_size=None, num_workers=2))
    assert _ids(seq) == _ids(it)
    sampled = list(
        DataLoader(md, batch_size=None, sampler=RandomSampler(md, generator=torch.Generator().manual_seed(0)))
    )
    assert sorted(_ids(sampled)) == list(range(203)) and _ids(sampled) != _ids(it)
    _check_pixels(odd_store, sampled)
    md.load_state_dict(md.state_dict(batches=5))
    assert _ids(list(md[i] for i in range(len(md)))) == _ids(it)[50:]


def test_devices_and_pinning_on_a_cpu_machine(odd_store: Path) -> None:
    if not torch.cuda.is_available():
        with pytest.raises(InvalidInputError, match="CUDA"):
            StoreDataset(odd_store, B, device="cuda")
    ds = StoreDataset(odd_store, B, device="cpu", pin_memory=True, **OPTS)
    x, y = next(iter(ds))
    assert x.device.type == "cpu" and x.is_pinned() == torch.cuda.is_available()
    with pytest.raises(InvalidInputError, match="persistent_workers"):
        StoreDataLoader(ds, num_workers=2, persistent_workers=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/bench_device.py runs it on one)")
def test_cuda_delivery_gives_the_cpu_batches_in_order_with_batches_in_flight(odd_store: Path) -> None:
    """device='cuda' with several batches assembled at once (num_threads=16: 4 assemblers):
    the pinned staging buffers are never handed out twice while a batch is under way."""
    cpu = list(StoreDataset(odd_store, B, window=2, num_threads=16, seed=4))
    ds = StoreDataset(odd_store, B, window=2, num_threads=16, seed=4, device="cuda")
    for _ in range(2):  # the second epoch reuses the staging buffers
        got = []
        for x, y in ds:
            assert x.device.type == "cuda" and y.device.type == "cuda"
            torch.cuda._sleep(2_000_000)  # a slow step: later batches are assembled meanwhile
            got.append((x.cpu(), y.cpu()))
        assert len(got) == len(cpu)
        for (xa, ya), (xb, yb) in zip(cpu, got, strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_a_short_training_loop_on_real_photos(photo_folder: Path, tmp_path: Path) -> None:
    res = carraystore.from_directory(photo_folder, tmp_path / "photos.b2nd", chunk_images=8, workers=1)
    path = getattr(res, "path", tmp_path / "photos.b2nd")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(4),
        torch.nn.Flatten(),
        torch.nn.Linear(128, 4),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ds = StoreDataset(path, 16, window=2)
    losses = []
    for epoch in range(5):
        ds.set_epoch(epoch)
        total = 0.0
        for x, y in StoreDataLoader(ds):
            x = x.permute(0, 3, 1, 2).float() / 255
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(y)
        losses.append(total / 48)
    assert losses[-1] < losses[0] * 0.8, losses


def test_a_decoder_serving_every_other_batch_frees_each_window_once_its_own_batches_are_done(odd_store: Path) -> None:
    from carraystore.engine.decoder import EpochDecoder
    from carraystore.engine.spec import make_spec

    spec = make_spec(odd_store, B, **OPTS)
    plan = spec.plan(0)
    for serves, freed in (((0, 2), True), ((0, 1), False)):
        dec = EpochDecoder(spec, 0, plan.max_window_chunks + 2, 2, "carraystore-torch-test", serves=serves)
        try:
            for b in range(0, spec.num_batches, 2):
                dec.batch(b)
            # a worker's decoder is never asked for the odd batches: its windows must not wait for
            # them (served, their slots are the first taken)
            assert (set(dec.windows) <= dec.finished) == freed
            assert (len(dec.finished) == plan.nwindows) == freed
        finally:
            dec.close()


# -- decode_device: the JPEG entries of an encoded store decoded by torchvision (nvJPEG) ------------


@pytest.fixture(scope="module")
def jpeg_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An encoded store of 90 real-photo JPEG files (24x32, 3 classes), label = class."""
    from carraystore.ingest.sample_data import PHOTOS, make_photo_folder

    root = tmp_path_factory.mktemp("nvjpeg")
    folder = make_photo_folder(root / "photos", n=90, size=(24, 32), classes=PHOTOS[:3], seed=3)
    return carraystore.from_directory(folder, root / "enc.b2nd", layout="encoded", chunk_images=8, workers=1).path


def _pillow_decode_jpeg(data, mode=None, device=None):  # type: ignore[no-untyped-def]
    """torchvision.io.decode_jpeg's interface, decoding with Pillow (a stand-in where torchvision cannot load)."""
    import io

    from PIL import Image

    out = []
    for t in data:
        with Image.open(io.BytesIO(bytes(t.numpy()))) as im:
            a = np.asarray(im.convert("RGB" if mode == "RGB" else "L"))
        a = a if a.ndim == 3 else a[..., None]
        out.append(torch.from_numpy(a.copy()).permute(2, 0, 1).to(device))
    return out


def test_decode_device_batches_are_the_cpu_batches_in_order(jpeg_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plumbing of decode_device (entries, order, shards, labels, resume state) with a Pillow
    stand-in for torchvision's decoder: it must give exactly the CPU path's batches."""
    import carraystore.torch as ct

    modes = type("Modes", (), {"RGB": "RGB", "GRAY": "GRAY"})
    monkeypatch.setattr(ct, "_decode_jpeg_fn", lambda: (_pillow_decode_jpeg, modes))
    for kw in ({}, {"rank": 1, "world_size": 2, "epoch": 3}):
        cpu = list(StoreDataset(jpeg_store, B, **kw, **OPTS))
        dev = StoreDataset(jpeg_store, B, decode_device="cpu", **kw, **OPTS)
        got = list(dev)
        assert len(got) == len(cpu) == len(dev)
        for (xg, yg), (xc, yc) in zip(got, cpu, strict=True):
            assert xg.shape == xc.shape and xg.dtype == torch.uint8
            assert torch.equal(xg, xc) and torch.equal(yg, yc)
    # resume mid-epoch: the rest is the CPU path's rest
    dev = StoreDataset(jpeg_store, B, decode_device="cpu", **OPTS)
    it = iter(dev)
    first = [next(it) for _ in range(3)]
    state = dev.state_dict()
    assert state["consumed"] == [{"world_size": 1, "samples": 3 * B}]
    rest = list(StoreDataset(jpeg_store, B, decode_device="cpu", resume=state, **OPTS))
    whole = list(StoreDataset(jpeg_store, B, **OPTS))
    assert [int(v) for _, y in first + rest for v in y] == [int(v) for _, y in whole for v in y]


def test_decode_device_refuses_what_it_cannot_decode(
    jpeg_store: Path, odd_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import carraystore.torch as ct

    try:
        ct._decode_jpeg_fn()
    except carraystore.base.errors.MissingDependencyError as exc:  # here: no loadable torchvision
        with pytest.raises(carraystore.base.errors.MissingDependencyError, match="torchvision"):
            StoreDataset(jpeg_store, B, decode_device="cpu")
        assert "torchvision" in str(exc)
    modes = type("Modes", (), {"RGB": "RGB", "GRAY": "GRAY"})
    monkeypatch.setattr(ct, "_decode_jpeg_fn", lambda: (_pillow_decode_jpeg, modes))
    with pytest.raises(InvalidInputError, match="JPEG entries of an encoded store; this is a pixel store"):
        StoreDataset(odd_store, B, decode_device="cpu")
    with pytest.raises(InvalidInputError, match="sequence_length, image_size or a numpy transform"):
        StoreDataset(jpeg_store, B, decode_device="cpu", transform=lambda x, y: (x, y))
    with pytest.raises(InvalidInputError, match="differs"):
        StoreDataset(jpeg_store, B, decode_device="cpu", device="cuda")
    ds = StoreDataset(jpeg_store, B, decode_device="cpu", **OPTS)
    with pytest.raises(InvalidInputError, match="num_workers=0"):
        list(DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="fork"))


def test_nvjpeg_batches_on_a_gpu(jpeg_store: Path) -> None:
    """decode_device="cuda": nvJPEG's batches, in the CPU path's order, close to Pillow's pixels."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (bench/bench_device.py runs it on one)")
    pytest.importorskip("torchvision.io", reason="needs torchvision")
    cpu = list(StoreDataset(jpeg_store, B, **OPTS))
    gpu = list(StoreDataset(jpeg_store, B, decode_device="cuda", **OPTS))
    assert len(gpu) == len(cpu)
    for (xg, yg), (xc, yc) in zip(gpu, cpu, strict=True):
        assert xg.is_cuda and yg.is_cuda and xg.shape == xc.shape and xg.dtype == torch.uint8
        assert torch.equal(yg.cpu(), yc)
        diff = (xg.cpu().int() - xc.int()).abs().float()
        assert diff.mean() < 2.0, diff.mean()  # nvJPEG's IDCT and upsampling differ from libjpeg-turbo's a little

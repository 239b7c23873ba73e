"""WriteOptions: one frozen value of the write options every writer takes."""

from __future__ import annotations

import argparse
import dataclasses
import pickle
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from helpers import make_store, random_images

import carraystore
from carraystore.base.errors import InvalidInputError, StoreExistsError
from carraystore.base.lock import WriterLock
from carraystore.cli.main import main
from carraystore.format.codec import PRESETS, Codec
from carraystore.migrations import migrate
from carraystore.store.options import WRITE_OPTION_FIELDS, WriteKwargs, WriteOptions
from carraystore.store.transfer import copy_store

SHAPE = (8, 8, 3)


_images = partial(random_images, shape=SHAPE, high=255)


def _store(path: Path, n: int = 10, **kw: object) -> Path:
    return make_store(path, _images(n), np.arange(n) % 2, chunk_images=4, **kw)


def _npz(tmp_path: Path, n: int = 6) -> Path:
    p = tmp_path / "cache.npz"
    np.savez(p, images=_images(n), labels=np.arange(n) % 3)
    return p


# -- the value itself -------------------------------------------------------------------------


def test_defaults_are_the_entry_points_old_defaults() -> None:
    o = WriteOptions()
    assert (o.codec, o.chunk_images, o.class_names, o.attrs) == (None, None, None, None)
    assert (o.overwrite, o.lock_timeout, o.storage_options, o.tmp_dir, o.progress) == (False, 0.0, None, None, False)
    assert WRITE_OPTION_FIELDS == (
        "codec",
        "chunk_images",
        "class_names",
        "attrs",
        "overwrite",
        "lock_timeout",
        "storage_options",
        "tmp_dir",
        "progress",
    )
    assert carraystore.WriteOptions is WriteOptions


def test_write_kwargs_are_the_fields_typed_alike() -> None:
    # the keywords every writer takes (**write: Unpack[WriteKwargs]) are WriteOptions' fields, same types
    fields = {f.name: f.type for f in dataclasses.fields(WriteOptions)}
    kwargs = {k: getattr(t, "__forward_arg__", t) for k, t in WriteKwargs.__annotations__.items()}
    assert kwargs == fields and not WriteKwargs.__required_keys__


def test_every_writer_takes_the_write_keywords_through_write_kwargs() -> None:
    # no writer lists the fields again: each takes **write (typed by WriteKwargs) and options=
    import inspect

    from carraystore.dask import from_dask
    from carraystore.store.writer import append, create

    for fn in (create, append, migrate, from_dask):
        params = inspect.signature(fn).parameters
        assert not set(params) & set(WRITE_OPTION_FIELDS), fn
        assert params["write"].annotation == "Unpack[WriteKwargs]" and "options" in params, fn


def test_frozen_normalised_and_copied() -> None:
    attrs = {"a": 1}
    o = WriteOptions(class_names=["cat", "dog"], attrs=attrs, codec="small")
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.overwrite = True  # type: ignore[misc]
    attrs["a"] = 2  # the caller's dict changes later: the options do not
    assert o.attrs == {"a": 1} and o.class_names == ("cat", "dog")
    assert pickle.loads(pickle.dumps(o)) == o  # travels to other processes (dask workers)
    assert o.replace(overwrite=True).overwrite is True and o.overwrite is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"codec": "tiny"}, "unknown preset 'tiny'"),
        ({"codec": 3}, "codec must be a Codec, a preset name"),
        ({"chunk_images": 0}, "chunk_images must be a positive integer"),
        ({"chunk_images": 2.5}, "chunk_images must be a positive integer"),
        ({"chunk_images": True}, "chunk_images must be a positive integer"),
        ({"class_names": ["a", "b", "a"]}, "'a' is listed twice"),
        ({"class_names": "cats"}, "a list of names"),
        ({"attrs": [1, 2]}, "attrs must be a mapping"),
        ({"storage_options": "x"}, "storage_options must be a mapping"),
        ({"overwrite": "yes"}, "overwrite must be True or False"),
        ({"progress": 1}, "progress must be True or False"),
        ({"lock_timeout": -1}, "lock_timeout must be seconds to wait"),
        ({"lock_timeout": float("nan")}, "lock_timeout must be seconds to wait"),
        ({"lock_timeout": "5"}, "lock_timeout must be seconds to wait"),
        ({"tmp_dir": 5}, "tmp_dir must be a folder path"),
    ],
)
def test_invalid_values_are_named_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        WriteOptions(**kwargs)  # type: ignore[arg-type]


def test_valid_values_are_kept() -> None:
    o = WriteOptions(codec=PRESETS["fast"], chunk_images=np.int64(8), lock_timeout=None, tmp_dir=Path("/tmp"))
    assert o.codec == PRESETS["fast"] and o.chunk_images == 8 and o.lock_timeout is None
    assert WriteOptions(lock_timeout=np.float32(1.5)).lock_timeout == 1.5


def test_merged_refuses_only_contradicting_keywords() -> None:
    opts = WriteOptions(codec="small", overwrite=True)
    assert WriteOptions.merged(opts, "x", codec=None, overwrite=False) is opts  # defaults: not given
    assert WriteOptions.merged(opts, "x", codec=Codec.preset("small"), overwrite=True) is opts  # the same meaning
    with pytest.raises(InvalidInputError, match=r"x: codec='fast' \(options has 'small'\) given both"):
        WriteOptions.merged(opts, "x", codec="fast")
    built = WriteOptions.merged(None, "x", chunk_images=4, class_names=["a"])
    assert built == WriteOptions(chunk_images=4, class_names=("a",))
    with pytest.raises(InvalidInputError, match="^out.b2nd: chunk_images must be"):
        WriteOptions.merged(None, "out.b2nd", chunk_images=-1)
    with pytest.raises(InvalidInputError, match="options must be a carraystore.WriteOptions"):
        WriteOptions.merged({"overwrite": True}, "x")  # type: ignore[arg-type]


# -- every entry point takes it ---------------------------------------------------------------


def test_create_takes_options(tmp_path: Path) -> None:
    opts = WriteOptions(codec="fast", chunk_images=6, class_names=["a", "b"], attrs={"k": "v"})
    with carraystore.create(tmp_path / "s.b2nd", SHAPE, options=opts) as w:
        w.append(_images(7), labels=np.arange(7) % 2)
    s = carraystore.open(tmp_path / "s.b2nd")
    assert s.meta.codec.codec == "lz4" and s.chunk_images == 6
    assert s.meta.class_names == ("a", "b") and s.attrs == {"k": "v"}
    s.close()
    with pytest.raises(StoreExistsError):
        carraystore.create(tmp_path / "s.b2nd", SHAPE, options=opts)
    carraystore.create(tmp_path / "s.b2nd", SHAPE, options=opts.replace(overwrite=True)).abort()


def test_create_refuses_a_keyword_that_contradicts_options(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="chunk_images=8 .options has 4. given both"):
        carraystore.create(tmp_path / "s.b2nd", SHAPE, chunk_images=8, options=WriteOptions(chunk_images=4))
    with pytest.raises(InvalidInputError, match="overwrite=True .options has False."):
        carraystore.create(tmp_path / "s.b2nd", SHAPE, overwrite=True, options=WriteOptions(codec="fast"))
    assert not list(tmp_path.iterdir())
    # the same value twice is no contradiction
    carraystore.create(tmp_path / "s.b2nd", SHAPE, chunk_images=4, options=WriteOptions(chunk_images=4)).abort()


def test_options_lock_timeout_reaches_the_lock(tmp_path: Path) -> None:
    path = _store(tmp_path / "s.b2nd")
    with WriterLock(path, purpose="test"), pytest.raises(carraystore.StoreLockedError, match=r"waited 0.2 s"):
        carraystore.append(path, options=WriteOptions(lock_timeout=0.2))


def test_append_takes_options_and_refuses_what_it_cannot_honour(tmp_path: Path) -> None:
    path = _store(tmp_path / "s.b2nd", codec="fast")
    with carraystore.append(path, options=WriteOptions(codec="fast", lock_timeout=1.0)) as w:
        w.append(_images(3, 1), labels=[0, 1, 0])
    assert len(carraystore.open(path)) == 13
    with pytest.raises(InvalidInputError, match="codec is pinned"):
        carraystore.append(path, options=WriteOptions(codec="small"))
    with pytest.raises(InvalidInputError, match=r"class_names=\('x',\) cannot be used here: an append keeps"):
        carraystore.append(path, options=WriteOptions(class_names=["x"]))
    with pytest.raises(InvalidInputError, match="lock_timeout=5 .options has 1.0. given both"):
        carraystore.append(path, lock_timeout=5, options=WriteOptions(lock_timeout=1.0))


def test_migrate_takes_options(tmp_path: Path) -> None:
    src = _npz(tmp_path)
    opts = WriteOptions(codec="small", chunk_images=2, class_names=["a", "b", "c"])
    report = migrate(src, tmp_path / "m.b2nd", options=opts)
    with carraystore.open(tmp_path / "m.b2nd") as s:
        assert s.chunk_images == 2 and s.meta.codec.clevel == 5 and s.meta.class_names == ("a", "b", "c")
        assert len(s) == 6
    assert report.verified
    with pytest.raises(StoreExistsError):
        migrate(src, tmp_path / "m.b2nd", options=opts)
    migrate(src, tmp_path / "m.b2nd", options=opts.replace(overwrite=True))
    with pytest.raises(InvalidInputError, match="chunk_images=3 .options has 2."):
        migrate(src, tmp_path / "n.b2nd", chunk_images=3, options=opts)
    with pytest.raises(InvalidInputError, match="a migration keeps the source's attrs"):
        migrate(src, tmp_path / "n.b2nd", options=WriteOptions(attrs={"x": 1}))
    assert not (tmp_path / "n.b2nd").exists()


def test_the_0_1_names_are_gone(tmp_path: Path) -> None:
    import carraystore.migrations as m

    with pytest.raises(TypeError, match="preset"):
        migrate(_npz(tmp_path), tmp_path / "p.b2nd", preset="fast")  # type: ignore[call-arg]
    with pytest.raises(AttributeError):
        m.open_source  # noqa: B018


def test_copy_takes_options(tmp_path: Path) -> None:
    src = _store(tmp_path / "s.b2nd")
    (tmp_path / "d.b2nd").write_bytes(b"old")
    with pytest.raises(StoreExistsError):
        copy_store(src, tmp_path / "d.b2nd", options=WriteOptions())
    result = carraystore.copy(src, tmp_path / "d.b2nd", options=WriteOptions(overwrite=True))
    assert result.verified and (tmp_path / "d.b2nd").read_bytes() == src.read_bytes()
    with pytest.raises(InvalidInputError, match="a copy is the source byte for byte"):
        copy_store(src, tmp_path / "e.b2nd", options=WriteOptions(codec="small"))
    with pytest.raises(InvalidInputError, match="overwrite=True .options has False."):
        copy_store(src, tmp_path / "e.b2nd", overwrite=True, options=WriteOptions(progress=False))
    with pytest.raises(InvalidInputError, match="storage_options apply to URLs only|dst_storage_options apply"):
        copy_store(src, tmp_path / "e.b2nd", options=WriteOptions(storage_options={"region": "x"}))
    assert not (tmp_path / "e.b2nd").exists()


# -- the command line ---------------------------------------------------------------------------


def test_add_arguments_and_from_args_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    p = argparse.ArgumentParser()
    WriteOptions.add_arguments(p)
    args = p.parse_args(
        [
            "--preset",
            "small",
            "--chunk-images",
            "8",
            "--class-names",
            "a,b",
            "--attr",
            "k=3",
            "--attr",
            "t=x",
            "--overwrite",
            "--lock-timeout",
            "2.5",
            "--storage-options",
            "{}",
            "--tmp-dir",
            "/tmp",
            "-q",
        ]
    )
    o = WriteOptions.from_args(args)
    assert o == WriteOptions(
        codec="small",
        chunk_images=8,
        class_names=("a", "b"),
        attrs={"k": 3, "t": "x"},
        overwrite=True,
        lock_timeout=2.5,
        storage_options={},
        tmp_dir="/tmp",
        progress=False,
    )
    assert WriteOptions.from_args(p.parse_args([])) == WriteOptions()  # every default (stderr is no terminal here)
    assert WriteOptions.from_args(p.parse_args(["--wait", "4"])).lock_timeout == 4.0  # the old spelling
    cfg = WriteOptions.from_args(p.parse_args(["--codec-config", '{"codec": "zstd", "clevel": 3}']))
    assert cfg.codec == Codec("zstd", 3)
    with pytest.raises(SystemExit):
        p.parse_args(["--preset", "small", "--codec-config", "{}"])  # one codec, not two
    with pytest.raises(SystemExit):
        p.parse_args(["--lock-timeout", "-1"])
    only = argparse.ArgumentParser()
    WriteOptions.add_arguments(only, ("overwrite",))
    assert only.parse_args(["--overwrite"]).overwrite and not hasattr(only.parse_args([]), "lock_timeout")


def test_cli_migrate_copy_meta_take_lock_timeout_and_wait(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _npz(tmp_path)
    out = tmp_path / "m.b2nd"
    assert main(["migrate", str(src), str(out), "--codec-config", '{"codec": "lz4", "filters": []}', "-q"]) == 0
    with carraystore.open(out) as s:
        assert s.meta.codec.codec == "lz4"
    with WriterLock(out, purpose="test"):
        for flag in ("--wait", "--lock-timeout"):
            assert main(["meta", str(out), "--attr", "x=1", flag, "0.1"]) == 2
            assert "waited 0.1 s" in capsys.readouterr().err
            assert main(["migrate", str(src), str(out), "--overwrite", "-q", flag, "0.1"]) == 2
            assert "waited 0.1 s" in capsys.readouterr().err
    assert main(["meta", str(out), "--attr", "x=1", "--lock-timeout", "1"]) == 0
    assert main(["copy", str(out), str(tmp_path / "c.b2nd"), "-q"]) == 0
    assert main(["copy", str(out), str(tmp_path / "c.b2nd"), "-q"]) == 2  # exists
    assert main(["copy", str(out), str(tmp_path / "c.b2nd"), "-q", "--overwrite"]) == 0
    assert (tmp_path / "c.b2nd").read_bytes() == out.read_bytes()


def test_from_directory_takes_options_and_refuses_contradictions(tmp_path: Path) -> None:
    from carraystore.ingest.sample_data import make_photo_folder

    src = make_photo_folder(tmp_path / "p", n=12, size=(16, 16), classes=["coffee", "rocket"], seed=1)
    opts = WriteOptions(codec="fast", chunk_images=5, attrs={"source": "test"}, class_names=["rocket", "coffee"])
    res = carraystore.from_directory(src, tmp_path / "a.b2nd", options=opts, workers=1)
    with carraystore.open(res.path) as s:
        assert (s.codec.codec, s.codec.clevel, s.codec.filters) == ("lz4", 1, ()) and s.chunk_images == 5
        assert s.attrs == {"source": "test"} and s.class_names == ("rocket", "coffee")
    with pytest.raises(InvalidInputError, match="given both as a keyword and in options"):
        carraystore.from_directory(src, tmp_path / "b.b2nd", options=opts, chunk_images=7, workers=1)
    assert not (tmp_path / "b.b2nd").exists()
    with pytest.raises(StoreExistsError):  # overwrite comes from options too
        carraystore.from_directory(src, res.path, options=opts, workers=1)
    carraystore.from_directory(src, res.path, options=opts.replace(overwrite=True), workers=1)


def test_the_ingest_command_builds_its_write_flags_from_write_options(tmp_path: Path) -> None:
    from carraystore.ingest.sample_data import make_photo_folder

    src = make_photo_folder(tmp_path / "p", n=8, size=(16, 16), classes=["coffee", "rocket"], seed=2)
    out = tmp_path / "o.b2nd"
    args = [str(src), str(out), "--preset", "fast", "--chunk-images", "3", "--attr", "k=1", "--lock-timeout", "1", "-q"]
    assert main(["ingest", *args]) == 0
    with carraystore.open(out) as s:
        assert s.chunk_images == 3 and s.attrs == {"k": 1} and s.codec.codec == "lz4"
    assert main(["ingest", str(src), str(out), "--wait", "0.5", "-q", "--overwrite"]) == 0  # the 0.1 spelling


def test_from_dask_takes_options(tmp_path: Path) -> None:
    da = pytest.importorskip("dask.array")
    from carraystore.dask import from_dask

    x = da.from_array(_images(9), chunks=3)
    store = from_dask(x, tmp_path / "d.b2nd", options=WriteOptions(chunk_images=4, attrs={"a": 1}))
    assert store.chunk_images == 4 and store.attrs == {"a": 1}
    assert np.array_equal(store[:], _images(9))
    with pytest.raises(InvalidInputError, match="given both"):
        from_dask(x, tmp_path / "e.b2nd", chunk_images=5, options=WriteOptions(chunk_images=4))

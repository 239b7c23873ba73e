"""Store format-version upgrades, the ``carraystore migrate`` command, and the wheel layout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import blosc2
import msgpack
import numpy as np
import pytest

import carraystore
from carraystore.base.errors import FormatVersionError, MigrationError
from carraystore.cli.main import main
from carraystore.format.record import FORMAT_VERSION
from carraystore.migrations import migrate
from carraystore.migrations.versions import FORMAT_MIGRATIONS, FormatMigration, is_old_store, upgrade_record

REPO = Path(__file__).resolve().parents[2]
V0 = REPO / "tests" / "data" / "migrate" / "store_v0.b2nd"
LOCAL = REPO / "tests" / "data" / "bcolz"


# -- format versions ---------------------------------------------------------------------------


def test_v0_store_is_refused_by_open_and_upgraded_by_migrate(tmp_path: Path) -> None:
    src = tmp_path / "old.b2nd"
    shutil.copy(V0, src)
    before = src.read_bytes()
    with pytest.raises(FormatVersionError, match="carraystore migrate"):
        carraystore.open(src)
    report = migrate(src, tmp_path / "new.b2nd", progress=False)
    s = carraystore.open(tmp_path / "new.b2nd")
    # read the old file independently: blosc2 for the pixels, msgpack for its metadata
    old = blosc2.open(str(src), mode="r")
    rec = msgpack.unpackb(bytes(old.schunk.vlmeta.get_vlmeta("carraystore")), raw=False)
    assert rec["format_version"] == 0
    assert s.meta.format_version == FORMAT_VERSION
    assert np.array_equal(s[:], old[:]) and s.shape == tuple(old.shape)
    assert s.labels.tolist() == rec["labels"] and list(s.keys) == rec["paths"]
    assert list(s.class_names) == rec["classes"] and s.attrs == rec["attrs"]
    assert s.codec.codec == "zstd" and s.codec.clevel == 1  # the old store's codec is kept
    assert s.provenance["migrated_from"]["format_version"] == 0
    assert report.kind == "carraystore store (format version 0)" and report.verified
    assert src.read_bytes() == before
    with pytest.raises(MigrationError, match="already at the current"):
        migrate(tmp_path / "new.b2nd", tmp_path / "newer.b2nd", progress=False)
    # only the older store counts as old; a current store and a non-store do not
    assert is_old_store(src) and not is_old_store(tmp_path / "new.b2nd") and not is_old_store(V0.parent / "nothing")


def test_upgrade_registry_applies_steps_in_order() -> None:
    seen: list[int] = []

    def step(v: int) -> FormatMigration:
        def up(rec: dict) -> dict:
            seen.append(v)
            return {**rec, "format_version": v + 1, f"added_by_{v}": True}

        return FormatMigration(v, f"step {v}", up)

    registry = {v: step(v) for v in (2, 0, 1)}
    rec, steps = upgrade_record({"format_version": 0}, registry, target=3)
    assert seen == [0, 1, 2] and rec["format_version"] == 3 and all(rec[f"added_by_{v}"] for v in range(3))
    assert [s.split(":")[0] for s in steps] == ["v0 -> v1", "v1 -> v2", "v2 -> v3"]
    with pytest.raises(MigrationError, match="no migration from store format version 1"):
        upgrade_record({"format_version": 0}, {0: step(0)}, target=2)
    with pytest.raises(FormatVersionError):
        upgrade_record({"format_version": 5}, registry, target=3)
    assert set(FORMAT_MIGRATIONS) == set(range(FORMAT_VERSION))  # every older version has a step


# -- the command line ------------------------------------------------------------------------


def test_cli_migrates_a_carray_and_prints_a_summary(tmp_path: Path, capsys) -> None:
    src = tmp_path / "nd_4d"
    shutil.copytree(LOCAL / "py3-bcolz-zipline-1.13" / "nd_4d", src)
    out = tmp_path / "o.b2nd"
    assert main(["migrate", str(src), str(out)]) == 0
    text = capsys.readouterr().out
    for part in ("rows:", "bytes:", "codec:", "lz4-5 shuffle ->", "time:", "verified bit-exact"):
        assert part in text
    want = np.load(LOCAL / "py3-bcolz-zipline-1.13" / "expected" / "nd_4d.npy")
    assert np.array_equal(carraystore.open(out)[:], want)
    assert main(["migrate", str(src), str(out)]) == 2  # exists
    assert "--overwrite" in capsys.readouterr().err
    assert main(["migrate", str(src), str(out), "--overwrite", "--no-verify", "--preset", "fast"]) == 0
    assert "NOT verified" in capsys.readouterr().out
    assert carraystore.open(out).codec.codec == "lz4"


def test_cli_two_array_form_and_errors(photo_arrays, tmp_path: Path, capsys) -> None:
    pytest.importorskip("numcodecs")
    from testsupport.bcolz_writer import write_carray

    x, y, _ = photo_arrays
    write_carray(tmp_path / "x.bc", x, chunklen=10)
    write_carray(tmp_path / "y.bc", y, chunklen=100)
    out = tmp_path / "o.b2nd"
    assert main(["migrate", "--images", str(tmp_path / "x.bc"), "--labels", str(tmp_path / "y.bc"), str(out)]) == 0
    s = carraystore.open(out)
    assert np.array_equal(s[:], x) and np.array_equal(s.labels, y)
    assert "(with labels)" in capsys.readouterr().out
    assert main(["migrate", str(out)]) == 2
    assert "--images" in capsys.readouterr().err
    broken = tmp_path / "trunc"
    shutil.copytree(LOCAL / "broken" / "trunc_chunk", broken)
    assert main(["migrate", str(broken), str(tmp_path / "b.b2nd")]) == 2
    assert "__3.blp" in capsys.readouterr().err and not (tmp_path / "b.b2nd").exists()
    obj = tmp_path / "object"
    shutil.copytree(LOCAL / "py3-bcolz-zipline-1.13" / "object", obj)
    assert main(["migrate", str(obj), str(tmp_path / "p.b2nd")]) == 2
    assert "--allow-pickle" in capsys.readouterr().err


def test_cli_verification_failure_exits_1(tmp_path: Path, capsys, monkeypatch) -> None:
    from carraystore.migrations import core

    src = tmp_path / "nd_4d"
    shutil.copytree(LOCAL / "py3-bcolz-zipline-1.13" / "nd_4d", src)

    def failing_verify(source, path, progress):  # type: ignore[no-untyped-def]
        raise core.MigrationVerifyError(f"{source.path}: row 3 differs")

    monkeypatch.setattr(core, "_verify", failing_verify)
    assert main(["migrate", str(src), str(tmp_path / "o.b2nd")]) == 1
    assert "verification failed" in capsys.readouterr().err
    assert not (tmp_path / "o.b2nd").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# -- packaging -------------------------------------------------------------------------------


@pytest.mark.slow
def test_wheel_ships_migrations_inside_carraystore_and_migrates(tmp_path: Path) -> None:
    """The wheel installs carraystore.migrations (no top-level package named ``migrations``),
    and the installed copy migrates a real bcolz carray."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, src / name)
    for package in ("carraystore", "migrations"):  # migrations/ installs as carraystore.migrations
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(src)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot build a wheel here (offline build backend?): {r.stderr[-300:]}")
    (whl,) = wheels.glob("*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert "carraystore/migrations/__init__.py" in names and "carraystore/migrations/bcolz.py" in names
    assert not [n for n in names if n.startswith("migrations/")]
    assert not [n for n in names if n.startswith(("bench/", "testsupport/", "carraystore/cli/benchmarks/loaders/"))]
    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)
    case = tmp_path / "case"
    shutil.copytree(LOCAL / "py27-bcolz-1.2.1" / "codec_snappy_sh2", case)
    code = (
        "import sys, importlib.util; sys.path.insert(0, sys.argv[1]);"
        "import carraystore, carraystore.migrations as m;"
        "assert carraystore.__file__.startswith(sys.argv[1]), carraystore.__file__;"
        "assert importlib.util.find_spec('migrations') is None, 'top-level migrations importable';"
        "from carraystore.cli.main import main; sys.exit(main(['migrate', sys.argv[2], sys.argv[3]]))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [sys.executable, "-c", code, str(site), str(case), str(tmp_path / "o.b2nd")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    want = np.load(LOCAL / "py27-bcolz-1.2.1" / "expected" / "codec_snappy_sh2.npy")
    assert np.array_equal(carraystore.open(tmp_path / "o.b2nd")[:], want)

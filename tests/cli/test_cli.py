"""The carraystore command line on real photo folders: ingest, info, verify, preview, export."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import blosc2
import numpy as np
import pytest
from helpers import CLI, wait_for_partial
from PIL import Image

import carraystore
from carraystore.cli.main import main
from carraystore.ingest.sample_data import make_photo_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_photo_folder(
        tmp_path_factory.mktemp("cli"), n=60, size=(48, 48), splits={"train": 0.8, "val": 0.2}, seed=5
    )


@pytest.fixture()
def stores(folder: Path, tmp_path: Path) -> Path:
    assert (
        main(
            [
                "ingest",
                str(folder),
                str(tmp_path / "out"),
                "--split-dirs",
                "-q",
                "--workers",
                "1",
                "--chunk-images",
                "8",
            ]
        )
        == 0
    )
    return tmp_path / "out"


def test_ingest_and_info(stores: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert sorted(p.name for p in stores.iterdir()) == ["train.b2nd", "val.b2nd"]
    capsys.readouterr()
    assert main(["info", str(stores / "train.b2nd")]) == 0
    out = capsys.readouterr().out
    assert "48x48x3 uint8 (rgb)" in out and "astronaut (12)" in out and "zstd" in out
    assert main(["info", "--json", str(stores / "val.b2nd")]) == 0
    info = json.loads(capsys.readouterr().out)
    store = carraystore.open(stores / "val.b2nd")
    assert info["nimages"] == len(store) == 12
    assert info["class_names"] == list(store.class_names)
    assert info["codec"] == store.codec.to_config()
    assert sum(info["label_counts"].values()) == 12


def test_ingest_with_preset(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "s.b2nd"
    assert main(["ingest", str(folder / "train"), str(out), "-q", "--workers", "1", "--preset", "small"]) == 0
    assert carraystore.open(out).codec.to_config() == carraystore.Codec.preset("small").resolve(
        np.uint8, (48, 48, 3)
    ).to_config() | {"block_images": carraystore.open(out).codec.block_images}


def test_verify_names_the_damaged_chunk(stores: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = stores / "train.b2nd"
    assert main(["verify", "-q", str(good)]) == 0
    assert "OK" in capsys.readouterr().out
    store = carraystore.open(good)
    k = 3
    chunk = store.read_chunk_bytes(k)
    data = bytearray(good.read_bytes())
    pos = bytes(data).find(chunk)
    assert pos > 0
    data[pos + len(chunk) // 2] ^= 0xFF
    bad = tmp_path / "bad.b2nd"
    bad.write_bytes(bytes(data))
    assert main(["verify", "-q", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and f"chunk {k}:" in out and "CRC32" in out
    # a truncated file is reported too
    trunc = tmp_path / "trunc.b2nd"
    trunc.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert main(["verify", "-q", str(trunc)]) == 1
    assert "trunc.b2nd" in capsys.readouterr().out


def test_preview_writes_a_contact_sheet(stores: Path, tmp_path: Path) -> None:
    png = tmp_path / "sheet.png"
    assert main(["preview", str(stores / "train.b2nd"), str(png), "-n", "10", "--cols", "5", "--cell", "64"]) == 0
    with Image.open(png) as img:
        assert img.size == (5 * 64, 2 * (64 + 14))
        arr = np.asarray(img.convert("RGB"))
    assert arr.std() > 10  # real photos, not a blank page
    # the first tile holds a (thumbnailed) image of the store
    assert (arr[:64, :64] != 255).any()


def test_export_round_trips_pixels(stores: Path, tmp_path: Path) -> None:
    dest = tmp_path / "exported"
    assert main(["export", str(stores / "val.b2nd"), str(dest)]) == 0
    store = carraystore.open(stores / "val.b2nd")
    for i, key in enumerate(store.keys):
        path = dest / Path(key).with_suffix(".png")
        with Image.open(path) as img:
            np.testing.assert_array_equal(np.asarray(img), store[i])
    assert main(["export", str(stores / "val.b2nd"), str(dest)]) == 2  # refuses to overwrite


def test_export_refuses_keys_outside_the_folder(
    stores: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    evil = tmp_path / "evil.b2nd"
    evil.write_bytes((stores / "val.b2nd").read_bytes())
    arr = blosc2.open(str(evil), mode="a")
    rec = arr.vlmeta["carraystore"]
    keys = ["../../escaped.png"] + [f"k{i}.png" for i in range(rec["nimages"] - 1)]
    table = carraystore.format.record.StringTable.from_strings(keys)
    rec["keys"] = table.to_record()
    arr.schunk.vlmeta.set_vlmeta(
        "carraystore", carraystore.format.record.seal_record(rec), typesize=1
    )  # checksum intact
    del arr
    capsys.readouterr()
    assert main(["export", str(evil), str(tmp_path / "dest")]) == 2
    err = capsys.readouterr().err
    # readers refuse a '..' key when the store is opened (FORMAT.md 4.5), before export writes anything
    assert "'..' component" in err and "../../escaped.png" in err
    assert not (tmp_path / "escaped.png").exists() and not (tmp_path.parent / "escaped.png").exists()


def test_cli_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tmp_path / "missing.b2nd")]) == 2
    assert "missing.b2nd" in capsys.readouterr().err
    junk = tmp_path / "junk.b2nd"
    junk.write_bytes(b"not a store at all" * 100)
    assert main(["info", str(junk)]) == 2
    assert "junk.b2nd" in capsys.readouterr().err


def test_module_entry_point(stores: Path) -> None:
    r = subprocess.run(
        [*CLI, "info", "--json", str(stores / "val.b2nd")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(r.stdout)["nimages"] == 12


def test_sigkill_during_ingest_leaves_no_file_and_the_old_one_intact(tmp_path: Path) -> None:
    src = make_photo_folder(tmp_path / "src", n=400, size=(128, 128), seed=1)
    out = tmp_path / "out.b2nd"
    old = tmp_path / "old.b2nd"
    # an earlier store at the output path
    assert main(["ingest", str(src / "astronaut"), str(out), "-q", "--workers", "1", "--labels", "none"]) == 0
    before = out.read_bytes()
    old.write_bytes(before)
    proc = subprocess.Popen(
        [*CLI, "ingest", str(src), str(out), "--overwrite", "-q", "--workers", "1", "--chunk-images", "4"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_partial(proc, out, larger_than=200_000)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out.read_bytes() == before  # the earlier store is untouched
    assert len(carraystore.open(out)) == len(carraystore.open(old))
    # and a fresh output path gets nothing at all
    fresh = tmp_path / "fresh.b2nd"
    proc = subprocess.Popen(
        [*CLI, "ingest", str(src), str(fresh), "-q", "--workers", "1", "--chunk-images", "4"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 60
    while time.time() < deadline and not [p for p in tmp_path.iterdir() if p.name.startswith(".fresh.b2nd.partial-")]:
        assert proc.poll() is None, "ingest finished before it could be killed; make the input larger"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL  # killed mid-write, not finished
    assert not fresh.exists()
    # the next writer cleans up the dead writer's temporary file
    assert main(["ingest", str(src / "rocket"), str(fresh), "-q", "--workers", "1", "--labels", "none"]) == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".fresh.b2nd.partial-")]

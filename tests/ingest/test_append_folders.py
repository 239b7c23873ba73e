"""Appends from folders to stores with targets (manifest rows, float labels, a group column) and to
stores of the encoded layout: the same locked, crash-safe append as any other."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import pillow_pixels
from PIL import Image

import carraystore
from carraystore.base.errors import InvalidInputError, ManifestError
from carraystore.cli.main import main


def session(folder: Path, k: int, frames: int = 6, seed: int = 0) -> list[str]:
    """``folder/frame_000100.jpg ...``: one recording session of real JPEGs (pixels differ per session)."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed + k)
    names = []
    for t in range(frames):
        arr = (rng.integers(0, 60, (16, 16, 3)) + 20 * k + t).astype(np.uint8)
        Image.fromarray(arr).save(folder / f"frame_{100 + t:06d}.jpg", quality=90)
        names.append(f"frame_{100 + t:06d}.jpg")
    return names


def angle(key: str) -> float:
    k, t = key.split("/")
    return round(int(k[-2:]) + int(t[6:12]) / 1000, 4)


def write_manifest(path: Path, keys: list[str], group: bool = False) -> Path:
    head = "file,angle" + (",group" if group else "")
    rows = [f"{k},{angle(k)!r}" + (f",{k.split('/')[0]}" if group else "") for k in keys]
    path.write_text(head + "\n" + "\n".join(rows) + "\n")
    return path


@pytest.fixture()
def drive(tmp_path: Path) -> tuple[Path, Path]:
    """A store of sessions 00..02 with a steering angle per frame (labels none, targets from a manifest)."""
    frames = tmp_path / "frames"
    keys = [f"session_{k:02d}/{n}" for k in range(3) for n in session(frames / f"session_{k:02d}", k)]
    out = tmp_path / "train.b2nd"
    m = write_manifest(tmp_path / "m.csv", keys)
    argv = ["ingest", str(frames), str(out), "--labels", "none", "--targets", str(m), "--keep-order", "--workers", "1"]
    assert main(argv) == 0
    return frames, out


def check(store: carraystore.Store, root: Path) -> None:
    """Every item's angle, group and pixels against its file."""
    assert store.verify() == []
    assert [store.group_names[g] for g in store.groups] == [k.split("/")[0] for k in store.keys]
    assert np.array_equal(store.columns["angle"], [angle(k) for k in store.keys])
    for i, k in enumerate(store.keys):
        assert np.array_equal(store[i], pillow_pixels(root / k)), k


def test_a_new_session_folder_appends_with_its_manifest(drive: tuple[Path, Path], tmp_path: Path) -> None:
    """`ingest new_session/ train.b2nd --append --labels none --targets new.csv`: the folder is one more
    session: keys session_03/<file>, group session_03, angles from its manifest (keyed in the folder)."""
    frames, out = drive
    new = tmp_path / "session_03"
    names = session(new, 3)
    m = tmp_path / "new.csv"
    m.write_text("file,angle\n" + "".join(f"{n},{angle('session_03/' + n)!r}\n" for n in names))
    assert main(["ingest", str(new), str(out), "--append", "--labels", "none", "--targets", str(m)]) == 0
    (frames / "session_03").symlink_to(new)
    with carraystore.open(out) as s:
        assert len(s) == 24 and s.keys[-6:] == [f"session_03/{n}" for n in names]  # in order
        check(s, frames)


def test_a_grown_folder_appends_with_a_grown_manifest_and_group_column(
    drive: tuple[Path, Path], tmp_path: Path
) -> None:
    """The whole folder again with --skip-existing and one manifest for all (rows of stored files allowed),
    groups from its 'group' column; a missing row or other fields are refused before any write."""
    frames, out = drive
    keys = [f"session_04/{n}" for n in session(frames / "session_04", 4)]
    with carraystore.open(out) as s:
        old = list(s.keys)
    m = write_manifest(tmp_path / "all.csv", old + keys, group=True)
    before = out.read_bytes()
    short = write_manifest(tmp_path / "short.csv", old + keys[:-1])
    with pytest.raises(ManifestError, match="1 of the 6 new image files have no row"):
        carraystore.from_directory(frames, out, labels=None, targets=short, append=True, skip_existing=True)
    other = tmp_path / "other.csv"
    other.write_text("file,speed\n" + "".join(f"{k},1.5\n" for k in old + keys))
    with pytest.raises(InvalidInputError, match=r"the store has the fields \['angle'\], the append gives \['speed'\]"):
        carraystore.from_directory(frames, out, labels=None, targets=other, append=True, skip_existing=True)
    assert out.read_bytes() == before
    res = carraystore.from_directory(frames, out, labels=None, targets=m, append=True, skip_existing=True, workers=1)
    assert res.nimages == 6
    with carraystore.open(out) as s:
        assert len(s) == 24
        check(s, frames)


def test_float_labels_append_as_the_target_field(tmp_path: Path) -> None:
    frames = tmp_path / "f"
    names = session(frames, 0)
    out = tmp_path / "s.b2nd"
    carraystore.from_directory(frames, out, labels=[0.5 * i for i in range(6)], keep_order=True, workers=1)
    more = session(frames / "later", 1)  # a sub-folder: keys later/<file>
    vals = [0.5 * i for i in range(12)]  # labels follow the sorted paths of the whole folder
    carraystore.from_directory(frames, out, labels=vals, append=True, skip_existing=True, workers=1)
    rels = sorted([*names, *(f"later/{n}" for n in more)])
    with carraystore.open(out) as s:
        got = dict(zip(s.keys, s.columns["target"].tolist(), strict=True))
        assert got == dict(zip(rels, vals, strict=True))


def test_a_folder_appends_to_an_encoded_store(tmp_path: Path) -> None:
    """An encoded store (ingest --layout encoded) grows from a folder without --layout: files kept byte
    for byte where they decode to the store's pixels, every pixel right; another layout is refused."""
    a, b = tmp_path / "a", tmp_path / "b"
    session(a, 0)
    session(b / "more", 1)  # keys more/<file>
    out = tmp_path / "enc.b2nd"
    assert main(["ingest", str(a), str(out), "--labels", "none", "--layout", "encoded", "--workers", "1"]) == 0
    assert main(["ingest", str(b), str(out), "--append", "--labels", "none", "--layout", "pixels"]) == 2
    assert main(["ingest", str(b), str(out), "--append", "--labels", "none", "--quality", "80"]) == 2
    assert main(["ingest", str(b), str(out), "--append", "--labels", "none", "--workers", "1"]) == 0
    with carraystore.open(out) as s:
        assert s.layout == "encoded" and len(s) == 12 and s.verify() == []
        for i, k in enumerate(s.keys):
            src = (a if i < 6 else b) / k
            assert np.array_equal(s[i], pillow_pixels(src))
            assert s.entry(i) == src.read_bytes()  # a JPEG of 16x16 decodes to its pixels: kept as is

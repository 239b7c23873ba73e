"""``carraystore convert`` keeps every per-item value and takes the writer lock of its output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import carraystore
from carraystore.base.errors import StoreLockedError
from carraystore.base.lock import WriterLock
from carraystore.cli.main import main
from carraystore.store.convert import convert_store


def _grouped(path: Path) -> Path:
    rng = np.random.default_rng(0)
    with carraystore.create(path, (8, 8, 3), chunk_images=4, class_names=["a", "b"]) as w:
        w.append(
            rng.integers(0, 255, (10, 8, 8, 3), dtype=np.uint8),
            labels=np.arange(10) % 2,
            keys=[f"v{i // 4}/f{i}.png" for i in range(10)],
            columns={"angle": np.linspace(-1, 1, 10)},
            groups=[f"video{i // 4}" for i in range(10)],
        )
    return path


@pytest.mark.parametrize("layout", ["encoded", "pixels"])
def test_convert_keeps_groups_fields_labels_and_keys(tmp_path: Path, layout: str) -> None:
    src = _grouped(tmp_path / "src.b2nd")
    mid = tmp_path / "mid.b2nd"
    convert_store(src, mid, "encoded")
    out = mid if layout == "encoded" else tmp_path / "back.b2nd"
    if layout == "pixels":
        convert_store(mid, out, "pixels")
    with carraystore.open(src) as a, carraystore.open(out) as b:
        assert np.array_equal(a[:], b[:])
        assert np.array_equal(a.labels, b.labels) and list(a.keys) == list(b.keys)
        assert np.array_equal(a.columns["angle"], b.columns["angle"])
        assert b.group_names == a.group_names and np.array_equal(a.groups, b.groups)  # groups were dropped before


def test_convert_takes_the_writer_lock_of_its_output(tmp_path: Path) -> None:
    src = _grouped(tmp_path / "src.b2nd")
    dst = _grouped(tmp_path / "dst.b2nd")
    before = dst.read_bytes()
    with WriterLock(dst, purpose="append"):  # another writer at work on dst
        with pytest.raises(StoreLockedError):
            convert_store(src, dst, "encoded", overwrite=True)
        assert main(["convert", str(src), str(dst), "--layout", "encoded", "--overwrite"]) == 2
    assert dst.read_bytes() == before
    convert_store(src, dst, "encoded", overwrite=True, lock_timeout=1)  # the lock gone: it goes through

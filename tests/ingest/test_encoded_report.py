"""An encoded ingest says what became of each file: kept byte for byte, or re-encoded as what and why."""

from __future__ import annotations

from pathlib import Path

import pytest

import carraystore
from carraystore.cli.main import main
from carraystore.ingest.sample_data import make_photo_folder


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_photo_folder(tmp_path_factory.mktemp("p"), n=12, size=(40, 40), classes=("coffee", "rocket"), seed=2)


def test_the_summary_counts_kept_and_reencoded_files(photos: Path, tmp_path: Path) -> None:
    src = sum(p.stat().st_size for p in photos.rglob("*.jpg"))
    kept = carraystore.from_directory(photos, tmp_path / "k.b2nd", layout="encoded", workers=1)
    assert kept.entries == {"kept": 12} and kept.source_bytes == src
    assert "12 file(s) kept byte for byte" in kept.summary()
    resized = carraystore.from_directory(photos, tmp_path / "r.b2nd", layout="encoded", image_size=(24, 24), workers=1)
    assert resized.entries == {"png": 12}
    text = resized.summary()
    assert "12 re-encoded as PNG (resized to the store's size" in text and "--quality Q" in text
    q = carraystore.from_directory(photos, tmp_path / "q.b2nd", layout="encoded", quality=85, workers=1)
    assert q.entries == {"jpeg": 12} and "quality 85 was asked" in q.summary()
    pixels = carraystore.from_directory(photos, tmp_path / "p.b2nd", workers=1)
    assert pixels.entries is None and "entries:" not in pixels.summary()


def test_info_names_the_entry_formats(photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    carraystore.from_directory(photos, tmp_path / "r.b2nd", layout="encoded", image_size=(24, 24), workers=1)
    assert main(["info", str(tmp_path / "r.b2nd")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("entries"))
    assert "PNG files" in line and "become PNG (lossless)" in line

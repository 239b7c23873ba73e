"""Bad folders: split folders taken for classes, mixed sizes, too many skipped files.

Also the one image lister: ingest and the benchmarks find the same files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import carraystore
from carraystore.base.errors import IngestError
from carraystore.cli.main import main
from carraystore.ingest.run import from_directory
from carraystore.ingest.sample_data import make_photo_folder

CLASSES = ("astronaut", "coffee")


@pytest.fixture(scope="module")
def split_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real photos in data/train/<class>/ and data/validation/<class>/."""
    return make_photo_folder(
        tmp_path_factory.mktemp("split") / "data",
        n=24,
        size=(32, 32),
        classes=CLASSES,
        splits={"train": 0.75, "validation": 0.25},
    )


def test_split_folders_are_refused_and_point_to_split_dirs(
    split_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.b2nd"
    assert main(["ingest", str(split_folder), str(out), "-q", "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "train/" in err and "validation/" in err and "--split-dirs" in err and "--allow-split-names" in err
    assert not out.exists() and not list(tmp_path.iterdir())
    # the suggested way works: one store per split, the real classes
    assert main(["ingest", str(split_folder), str(tmp_path / "splits"), "--split-dirs", "-q", "--workers", "1"]) == 0
    assert carraystore.open(tmp_path / "splits" / "train.b2nd").class_names == CLASSES
    # and the override keeps the old behaviour for folders that really are classes
    res = from_directory(split_folder, tmp_path / "as_classes.b2nd", workers=1, allow_split_names=True)
    assert res.class_names == ("train", "validation")


def test_one_split_folder_holding_classes_is_refused(split_folder: Path, tmp_path: Path) -> None:
    only_train = tmp_path / "data"
    shutil.copytree(split_folder / "train", only_train / "train")
    with pytest.raises(IngestError, match="split"):
        from_directory(only_train, tmp_path / "o.b2nd", workers=1)
    with pytest.raises(IngestError, match="split"):  # unlabelled, the splits would be mixed just the same
        from_directory(split_folder, tmp_path / "o.b2nd", labels=None, workers=1)
    # a class that happens to be named "test" beside real classes, holding images only, is fine
    classes = tmp_path / "classes"
    shutil.copytree(split_folder / "train" / "astronaut", classes / "test")
    shutil.copytree(split_folder / "train" / "coffee", classes / "coffee")
    assert from_directory(classes, tmp_path / "c.b2nd", workers=1).class_names == ("coffee", "test")


def _mixed_sizes(root: Path) -> Path:
    """A folder where most images differ in size from the first one (as users' photo folders do)."""
    src = make_photo_folder(root, n=20, size=(48, 48), classes=CLASSES, seed=4)
    for i, f in enumerate(sorted(src.rglob("*.jpg"))[1:]):
        with Image.open(f) as im:
            im.resize((48 + i + 1, 40)).save(f)
    return src


def test_mixed_sizes_error_suggests_image_size_never_skip(tmp_path: Path) -> None:
    src = _mixed_sizes(tmp_path / "src")
    with pytest.raises(IngestError) as exc:
        from_directory(src, tmp_path / "o.b2nd", workers=1, keep_order=True)
    msg = str(exc.value)
    assert "--image-size" in msg and "--on-error" not in msg and "skip" not in msg


def test_skipping_most_files_stops_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _mixed_sizes(tmp_path / "src")
    out = tmp_path / "o.b2nd"
    assert main(["ingest", str(src), str(out), "-q", "--workers", "1", "--on-error", "skip"]) == 2
    err = capsys.readouterr().err
    assert (
        "--max-skipped" in err and "of 20 image files" in err and "--image-size" in err and "nothing was written" in err
    )
    assert "raise the limit" not in err  # that would drop most of the images
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["src"]
    # raising the limit is the user's call; then the skipped files are listed in the store
    with pytest.raises(SystemExit):
        main(["ingest", str(src), str(out), "-q", "--workers", "1", "--on-error", "skip", "--max-skipped", "100%"])
    assert "not a count" in capsys.readouterr().err
    assert (
        main(["ingest", str(src), str(out), "-q", "--workers", "1", "--on-error", "skip", "--max-skipped", "19"]) == 0
    )
    store = carraystore.open(out)
    assert len(store) == 1 and len(store.skipped) == 19


def test_max_skipped_as_share_and_count(tmp_path: Path) -> None:
    src = make_photo_folder(tmp_path / "src", n=40, size=(32, 32), classes=CLASSES, seed=6)
    (src / "coffee" / "broken.jpg").write_bytes(b"\xff\xd8\xff not really")
    (src / "coffee" / "empty.png").write_bytes(b"")
    with pytest.raises(
        IngestError,
        match=r"1 of the first \d+ of 42 image files.*--max-skipped\) allows \(1% = 0 of 42\).*raise the limit",
    ):
        from_directory(src, tmp_path / "a.b2nd", workers=1, on_error="skip")
    with pytest.raises(IngestError, match=r"2 of the first \d+ of 42 image files.*allows \(1 file\(s\) = 1 of 42\)"):
        from_directory(src, tmp_path / "b.b2nd", workers=1, on_error="skip", max_skipped=1)
    res = from_directory(src, tmp_path / "c.b2nd", workers=1, on_error="skip", max_skipped=0.05)
    assert res.nimages == 40 and len(res.skipped) == 2


def test_one_lister_for_ingest_and_the_benchmarks(tmp_path: Path) -> None:
    from carraystore.cli.benchmarks import datasets
    from carraystore.ingest import images

    assert datasets.IMAGE_EXTENSIONS is images.IMAGE_EXTENSIONS
    src = tmp_path / "src"
    for cls, ext in (("a", ".webp"), ("a", ".PNG"), ("b", ".tiff"), ("b", ".jpg")):
        (src / cls).mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((8, 8, 3), 7, np.uint8)).save(src / cls / f"img{ext}")
    (src / "b" / "notes.txt").write_text("no image")
    bench = datasets.list_image_folder(src)
    res = from_directory(src, tmp_path / "s.b2nd", workers=1)
    keys = sorted(carraystore.open(tmp_path / "s.b2nd").keys)
    assert keys == sorted(bench.keys()) == ["a/img.PNG", "a/img.webp", "b/img.jpg", "b/img.tiff"]
    assert res.ignored == ["b/notes.txt"]

"""validation_split + subset + seed on from_directory and `ingest`.

The files kept for validation are the ones keras.utils.image_dataset_from_directory picks
with the same seed: checked against real Keras on a real photo folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import carraystore
from carraystore.base.errors import IngestError, InvalidInputError
from carraystore.cli.main import main
from carraystore.ingest.run import from_directory
from carraystore.ingest.sample_data import make_photo_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_photo_folder(
        tmp_path_factory.mktemp("vs") / "photos", n=50, size=(24, 24), classes=("astronaut", "coffee", "rocket"), seed=8
    )


def _keras_split(folder: Path, seed: int, shuffle: bool = True) -> tuple[set[str], set[str]]:
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    train, val = keras.utils.image_dataset_from_directory(
        folder, validation_split=0.2, subset="both", seed=seed, shuffle=shuffle, image_size=(24, 24), verbose=False
    )
    rel = lambda ps: {Path(p).relative_to(folder).as_posix() for p in ps}  # noqa: E731
    return rel(train.file_paths), rel(val.file_paths)


def test_both_subsets_in_one_call_pick_the_files_keras_picks(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "stores"
    assert (
        main(
            [
                "ingest",
                str(folder),
                str(out),
                "-q",
                "--workers",
                "1",
                "--validation-split",
                "0.2",
                "--subset",
                "both",
                "--seed",
                "123",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "training.b2nd: 40 images" in printed and "validation.b2nd: 10 images" in printed
    train = carraystore.open(out / "training.b2nd")
    val = carraystore.open(out / "validation.b2nd")
    k_train, k_val = _keras_split(folder, 123)
    assert set(val.keys) == k_val and set(train.keys) == k_train
    assert train.class_names == val.class_names == ("astronaut", "coffee", "rocket")
    for store in (train, val):
        for key, lab in zip(store.keys, store.labels, strict=True):
            assert store.class_names[lab] == key.split("/")[0]
    assert val.provenance["subset"] == "validation" and val.provenance["validation_split"] == 0.2
    # another seed, another validation set (as in Keras)
    other = from_directory(folder, tmp_path / "v7.b2nd", workers=1, validation_split=0.2, subset="validation", seed=7)
    assert other.nimages == 10
    assert set(carraystore.open(tmp_path / "v7.b2nd").keys) == _keras_split(folder, 7)[1] != k_val


def test_one_subset_and_keep_order(folder: Path, tmp_path: Path) -> None:
    res = from_directory(folder, tmp_path / "t.b2nd", workers=1, validation_split=0.2, subset="training", seed=123)
    assert res.nimages == 40
    assert set(carraystore.open(tmp_path / "t.b2nd").keys) == _keras_split(folder, 123)[0]
    # without shuffling (video frames), the validation part is the last files in path order, as Keras with shuffle=False
    from_directory(folder, tmp_path / "v.b2nd", workers=1, validation_split=0.2, subset="validation", keep_order=True)
    keys = list(carraystore.open(tmp_path / "v.b2nd").keys)
    every = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.jpg"))
    assert keys == every[-10:]
    assert set(keys) == _keras_split(folder, 0, shuffle=False)[1]


def test_bad_split_arguments(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="go together"):
        from_directory(folder, tmp_path / "a.b2nd", subset="training")
    with pytest.raises(InvalidInputError, match="go together"):
        from_directory(folder, tmp_path / "a.b2nd", validation_split=0.2)
    with pytest.raises(InvalidInputError, match="between 0 and 1"):
        from_directory(folder, tmp_path / "a.b2nd", validation_split=1.5, subset="training")
    with pytest.raises(IngestError, match="no file for validation"):
        from_directory(folder, tmp_path / "a.b2nd", validation_split=0.01, subset="validation")
    with pytest.raises(InvalidInputError, match="folder"):
        from_directory(folder, tmp_path / "a.b2nd", validation_split=0.2, subset="both")
    assert not list(tmp_path.iterdir())


def test_an_output_folder_that_is_a_file_is_a_named_error(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--subset both` / `--split-dirs` into OUT that is a file: a FileExistsError traceback before."""
    out = tmp_path / "out"
    out.write_text("a file")
    splits = tmp_path / "splits"
    (splits / "train").mkdir(parents=True)
    os.symlink(folder / "coffee", splits / "train" / "coffee")
    for argv in (
        ["ingest", str(folder), str(out), "-q", "--validation-split", "0.2", "--subset", "both"],
        ["ingest", str(splits), str(out), "-q", "--split-dirs"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{out} is a file" in err, err
    assert out.read_text() == "a file"


def test_readme_maps_every_image_dataset_from_directory_argument() -> None:
    import inspect

    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("### Coming from `image_dataset_from_directory`", 1)[1].split("\n## ", 1)[0]
    params = inspect.signature(keras.utils.image_dataset_from_directory).parameters
    missing = [name for name in params if f"`{name}" not in section]
    assert missing == [], f"README table lacks {missing}"

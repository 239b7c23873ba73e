"""The CLI as people use it: help everywhere, typos, pipes, wrong files, previews."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers import CLI
from PIL import Image

import carraystore
from carraystore.cli.main import build_parser, main
from carraystore.ingest.sample_data import make_photo_folder


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of 8 real-photo images of 32x32 pixels, with keys and labels."""
    root = tmp_path_factory.mktemp("ux")
    folder = make_photo_folder(root / "photos", n=8, size=(32, 32), classes=("astronaut", "coffee"), seed=3, fmt="png")
    out = root / "small.b2nd"
    assert main(["ingest", str(folder), str(out), "-q", "--workers", "1"]) == 0
    return out


def _walk(parser: argparse.ArgumentParser, name: str) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                if not sub.description:
                    missing.append(f"{name} {sub_name}: no description")
                missing += _walk(sub, f"{name} {sub_name}")
        elif not action.help:
            missing.append(f"{name} {action.option_strings or action.dest}: no help")
    return missing


def test_every_subcommand_has_a_description_and_every_flag_a_help_text() -> None:
    parser = build_parser()
    names = set(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)
    assert {"ingest", "info", "verify", "preview", "export", "migrate", "bench", "meta"} <= names
    assert _walk(parser, "carraystore") == []


def test_a_flag_typo_gets_the_subcommands_usage_and_a_suggestion(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["ingest", str(tmp_path), str(tmp_path / "o.b2nd"), "--colr-mode", "grayscale"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: carraystore ingest" in err
    assert "did you mean --color-mode?" in err
    with pytest.raises(SystemExit):
        main(["preview", "a.b2nd", "b.png", "--colls", "4"])
    err = capsys.readouterr().err
    assert "usage: carraystore preview" in err and "did you mean --cols?" in err
    with pytest.raises(SystemExit):
        main(["bench", "layout", "--colour-mode", "rgb"])
    err = capsys.readouterr().err
    assert "usage: carraystore bench layout" in err and "did you mean --color-mode?" in err
    with pytest.raises(SystemExit):
        main(["inf", "x.b2nd"])
    assert "did you mean 'info'?" in capsys.readouterr().err


def test_extra_words_after_a_one_value_flag_say_what_it_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`meta`/`migrate --class-names a b c` is wrong (they take a,b,c): say so."""
    for argv in (
        ["meta", "s.b2nd", "--class-names", "cat", "dog", "bird"],
        ["migrate", "d.h5", "o.b2nd", "--class-names", "cat", "dog"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"usage: carraystore {argv[0]}" in err
        assert "--class-names takes one value (A,B,C)" in err, err


def test_ingest_takes_class_names_comma_separated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One form for `--class-names` everywhere (a,b,c); the space-separated form is an error that says so."""
    folder = make_photo_folder(
        tmp_path / "p", n=9, size=(16, 16), classes=("astronaut", "chelsea", "coffee"), fmt="png"
    )
    common = ["-q", "--workers", "1", "--keep-order"]
    assert main(["ingest", str(folder), str(tmp_path / "new.b2nd"), "--class-names", "coffee,astronaut", *common]) == 0
    new = carraystore.open(tmp_path / "new.b2nd")
    assert new.class_names == ("coffee", "astronaut") and len(new) == 6
    assert {k.split("/")[0] for k, lab in zip(new.keys, new.labels, strict=True) if lab == 0} == {"coffee"}
    with pytest.raises(SystemExit) as exc:
        main(["ingest", str(folder), str(tmp_path / "old.b2nd"), "--class-names", "coffee", "astronaut", *common])
    assert exc.value.code == 2 and "--class-names takes one value (A,B,C)" in capsys.readouterr().err
    assert main(["ingest", str(folder), str(tmp_path / "one.b2nd"), "--class-names", "chelsea", *common]) == 0
    assert carraystore.open(tmp_path / "one.b2nd").class_names == ("chelsea",)


def test_a_path_the_os_refuses_is_an_error_line_not_a_traceback(small_store: Path, tmp_path: Path) -> None:
    """A file where a folder goes (export OUT under a file) ended in a NotADirectoryError traceback."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = subprocess.run(
        [*CLI, "export", str(small_store), str(blocker / "sub")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert (
        r.stderr.startswith("carraystore export: error:")
        and "Not a directory" in r.stderr
        and str(blocker / "sub") in r.stderr
    )


def test_info_on_several_stores_describes_every_one_and_prints_one_json_document(
    small_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`info A MISSING B` stopped at MISSING; `info --json A B` printed two documents json.load refused."""
    missing = tmp_path / "missing.b2nd"
    assert main(["info", str(small_store), str(missing), str(small_store)]) == 2
    out, err = capsys.readouterr()
    assert out.count(f"path         {small_store}") == 2 and f"{missing}: no such store" in err
    assert main(["info", "--json", str(small_store), str(small_store)]) == 0
    docs = json.loads(capsys.readouterr().out)
    assert isinstance(docs, list) and [d["path"] for d in docs] == [str(small_store)] * 2
    assert main(["info", "--json", str(small_store)]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(small_store)  # one store: one object, as before


def test_info_piped_into_head_exits_quietly(small_store: Path) -> None:
    # enough output to fill the pipe several times over, so the writer meets a closed pipe
    cmd = [*CLI, "info", *([str(small_store)] * 400)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does after its line
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert first.startswith(b"path")
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode in (0, 141)


def test_info_names_hdf5_images_and_npz(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import h5py

    h5 = tmp_path / "data.h5"
    with h5py.File(h5, "w") as f:
        f["images"] = np.zeros((4, 8, 8, 3), np.uint8)
    jpg, png, gif = tmp_path / "photo.jpg", tmp_path / "photo.png", tmp_path / "anim.gif"
    for f in (jpg, png, gif):
        Image.fromarray(np.full((16, 16, 3), 90, np.uint8)).save(f)
    npz = tmp_path / "cache.npz"
    np.savez(npz, x=np.zeros((2, 3)))
    expected = {
        h5: ("HDF5", "carraystore migrate"),
        jpg: ("JPEG image", "ingest"),
        png: ("PNG image", "ingest"),
        gif: ("GIF image", "ingest"),
        npz: ("zip", "migrate"),
        tmp_path: ("folder of images", "carraystore ingest"),
    }
    for path, words in expected.items():
        assert main(["info", str(path)]) == 2
        err = capsys.readouterr().err
        assert str(path) in err and all(w in err for w in words), err
        assert "blosc2" not in err
    assert main(["verify", str(h5)]) == 1
    assert "HDF5" in capsys.readouterr().out
    from testsupport.bcolz_writer import write_carray

    write_carray(tmp_path / "train_data.bc", np.zeros((4, 8), np.uint8), chunklen=2)
    assert main(["info", str(tmp_path / "train_data.bc")]) == 2
    err = capsys.readouterr().err
    assert "bcolz" in err and "carraystore migrate" in err


def test_preview_into_a_missing_folder_names_the_folder(
    small_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "no" / "such" / "sheet.png"
    assert main(["preview", str(small_store), str(out)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "no" / "such") in err and "does not exist" in err
    assert ".partial" not in err
    assert not (tmp_path / "no").exists()


def test_preview_enlarges_small_images_and_prints_keys(small_store: Path, tmp_path: Path) -> None:
    store = carraystore.open(small_store)
    plain, with_keys = tmp_path / "plain.png", tmp_path / "keys.png"
    assert main(["preview", str(small_store), str(plain), "-n", "2", "--first", "--cell", "128"]) == 0
    sheet = np.asarray(Image.open(plain).convert("RGB"))
    # the first 32 px image fills its 128 px tile, each pixel a 4x4 block
    expected = np.repeat(np.repeat(store[0], 4, axis=0), 4, axis=1)
    np.testing.assert_array_equal(sheet[:128, :128], expected)
    assert main(["preview", str(small_store), str(with_keys), "-n", "2", "--first", "--cell", "128", "--keys"]) == 0
    keyed = np.asarray(Image.open(with_keys).convert("RGB"))
    assert keyed.shape[0] > sheet.shape[0]  # room for a second line of text
    np.testing.assert_array_equal(keyed[:128, :128], expected)
    key_line = keyed[128 + 14 : 128 + 26, :128]
    assert (key_line < 128).any(), "no text printed under the tile"
    # different keys print differently
    assert not np.array_equal(key_line, keyed[128 + 14 : 128 + 26, 128:256])


def test_bench_loaders_takes_color_mode_and_image_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from bench.loaders.command import main as loaders_main

    photos = make_photo_folder(tmp_path / "p", n=24, size=(40, 40), classes=("astronaut", "coffee"), seed=1)
    out_dir = tmp_path / "res"
    argv = [
        str(photos),
        "--batch-size",
        "8",
        "--epochs",
        "1",
        "--no-cold",
        "-q",
        "--color-mode",
        "grayscale",
        "--image-size",
        "24",
        "20",
        "--peers",
        "npy_files,pillow_threads,carraystore_fast_block",
        "--out",
        str(out_dir),
        "--work",
        str(tmp_path / "w"),
    ]
    assert loaders_main(argv) == 0
    capsys.readouterr()
    data = json.loads((out_dir / "loaders.json").read_text())
    assert data["info"]["image_shape"] == [24, 20, 1] and data["info"]["color_mode"] == "grayscale"
    assert all(r["status"] == "ok" and r["n_images"] == 24 for r in data["rows"]), data["rows"]
    store = carraystore.open(tmp_path / "w" / "carraystore_fast" / "data.b2nd")
    assert store.image_shape == (24, 20, 1)


@pytest.mark.parametrize("name", ["pillow_threads", "keras_load_img", "tfdata_jpeg", "tfrecord", "npy_files"])
def test_every_bench_peer_delivers_the_color_mode(name: str, tmp_path: Path) -> None:
    from bench import loaders as L

    peer = L.PEER_BY_NAME[name]
    why = peer.missing()
    if why:
        pytest.skip(f"{name}: {why}")
    photos = make_photo_folder(tmp_path / "p", n=8, size=(16, 16), classes=("astronaut", "coffee"), seed=2)
    for mode, channels in (("grayscale", 1), ("rgba", 4)):
        ctx = L.Context(str(photos), None, None, 4, 0, mode)
        dest, _ = L.build_artifact(peer, ctx, tmp_path / mode)
        x = np.concatenate([np.asarray(b) for b, _ in peer.reader(ctx, dest)(0)])
        assert x.shape == (8, 16, 16, channels), (mode, x.shape)

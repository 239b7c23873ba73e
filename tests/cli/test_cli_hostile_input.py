"""Hostile files and careless use of the CLI, ingest, export and preview.

Every test here failed before the fix: a link followed at a temp name, a store replaced by a
PNG, a 21 GB contact sheet, tracebacks instead of named errors, 16-bit PNGs clipped, a
symlink loop listed 40 times, keys rewritten, FIFOs that hang, a full disk, and worker
processes that outlive a killed ingest and keep its caller's pipes open.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import psutil
import pytest
from helpers import CLI, wait_for_partial
from PIL import Image

import carraystore
from carraystore.base.errors import IngestError, InvalidInputError
from carraystore.cli.main import main
from carraystore.ingest.run import from_directory
from carraystore.ingest.sample_data import make_photo_folder
from carraystore.store.export import make_contact_sheet

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``carraystore ARGS`` in a child process (a hang fails the test instead of blocking it)."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_photo_folder(tmp_path_factory.mktemp("photos"), n=24, size=(32, 32), seed=2)


@pytest.fixture()
def store(photos: Path, tmp_path: Path) -> Path:
    out = tmp_path / "s.b2nd"
    from_directory(photos, out, workers=1)
    return out


# -- export and preview: temporary files, outputs -------------------------------------------------


def test_export_and_preview_never_follow_a_link_planted_at_a_temp_name(store: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    # the names the old code used for its temporary files
    sheet = tmp_path / "out" / "sheet.png"
    sheet.parent.mkdir()
    (sheet.parent / ".sheet.png.partial").symlink_to(victim)
    dest = tmp_path / "dest"
    keys = list(carraystore.open(store).keys)
    for key in keys:
        target = dest / Path(key).with_suffix(".png")
        target.parent.mkdir(parents=True, exist_ok=True)
        (target.parent / f".{target.name}.partial").symlink_to(victim)
    assert main(["preview", str(store), str(sheet), "-n", "4"]) == 0
    assert main(["export", str(store), str(dest)]) == 0
    assert victim.read_text() == "precious"
    assert not sheet.is_symlink() and Image.open(sheet).format == "PNG"
    s = carraystore.open(store)
    for i, key in enumerate(keys):
        target = dest / Path(key).with_suffix(".png")
        assert not target.is_symlink()
        np.testing.assert_array_equal(np.asarray(Image.open(target)), s[i])
    # no temporary file of ours is left beside the outputs
    left = [p for p in dest.rglob(".*") if ".partial-" in p.name] + [
        p for p in sheet.parent.iterdir() if ".partial-" in p.name
    ]
    assert left == []


def test_preview_refuses_to_replace_a_store_or_any_other_non_png_file(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = store.read_bytes()
    assert main(["preview", str(store), str(store)]) == 2
    err = capsys.readouterr().err
    assert str(store) in err and "the store itself" in err
    assert store.read_bytes() == before
    notes = tmp_path / "notes.png"
    notes.write_text("not an image")
    assert main(["preview", str(store), str(notes)]) == 2
    assert "not a PNG" in capsys.readouterr().err and notes.read_text() == "not an image"
    link = tmp_path / "link.png"
    link.symlink_to(notes)
    assert main(["preview", str(store), str(link)]) == 2
    assert "symbolic link" in capsys.readouterr().err and link.is_symlink()
    # an earlier contact sheet is replaced
    sheet = tmp_path / "sheet.png"
    assert main(["preview", str(store), str(sheet), "-n", "2"]) == 0
    assert main(["preview", str(store), str(sheet), "-n", "4", "--cols", "4", "--cell", "32"]) == 0
    assert Image.open(sheet).size == (4 * 32, 32 + 14)
    # a FIFO as output is refused at once, never opened
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    r = _cli("preview", str(store), str(fifo), timeout=60)
    assert r.returncode == 2 and "not a regular file" in r.stderr and str(fifo) in r.stderr


def test_preview_sizes_are_bounded_with_a_named_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.b2nd"
    with carraystore.create(path, (8, 8, 3)) as w:
        w.append(np.random.default_rng(0).integers(0, 255, (100, 8, 8, 3), dtype=np.uint8))
    out = tmp_path / "sheet.png"
    for args, words in [
        (["--cell", "100000"], "limit of 1024"),
        (["-n", "-5"], "n must be a positive integer"),
        (["--cols", "0"], "cols must be a positive integer"),
        (["-n", "100", "--cell", "1024"], "over the limit of 64,000,000"),
    ]:
        t0 = time.perf_counter()
        assert main(["preview", str(path), str(out), *args]) == 2, args
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, (args, err)
        assert time.perf_counter() - t0 < 5  # refused before drawing anything
        assert not out.exists()
    with pytest.raises(InvalidInputError, match="limit"):
        make_contact_sheet(carraystore.open(path), n=100, cell=1024)


def test_export_into_an_existing_file_or_fifo_is_a_named_error(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    existing = tmp_path / "report.txt"
    existing.write_text("keep me")
    assert main(["export", str(store), str(existing)]) == 2
    err = capsys.readouterr().err
    assert str(existing) in err and "not a folder" in err
    assert existing.read_text() == "keep me"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = _cli("export", str(store), str(fifo), timeout=60)
    assert r.returncode == 2 and "not a folder" in r.stderr


def test_chunk_images_zero_is_a_named_error(photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["ingest", str(photos), str(tmp_path / "a.b2nd"), "--chunk-images", "0"])
    assert exc.value.code == 2
    assert "--chunk-images: must be a positive integer, got 0" in capsys.readouterr().err
    with pytest.raises(InvalidInputError, match="chunk_images must be a positive integer"):
        from_directory(photos, tmp_path / "b.b2nd", chunk_images=0, workers=1)
    with pytest.raises(InvalidInputError, match="chunk_images must be a positive integer"):
        carraystore.create(tmp_path / "c.b2nd", (8, 8, 3), chunk_images=-3)
    from carraystore.migrations import migrate

    npz = tmp_path / "cache.npz"
    np.savez(npz, images=np.zeros((4, 8, 8, 3), np.uint8))
    with pytest.raises(InvalidInputError, match="chunk_images must be a positive integer"):
        migrate(npz, tmp_path / "m.b2nd", chunk_images=0)
    assert not list(tmp_path.glob("*.b2nd")) and not list(tmp_path.glob(".*partial*"))


# -- ingest: data stored exactly, or refused by name ----------------------------------------------


def _png16(path: Path, pixels: np.ndarray) -> None:
    """A 16-bit PNG (grayscale (H, W) or RGB (H, W, 3)) written byte by byte, as scanners and microscopes write them."""
    h, w = pixels.shape[:2]
    color_type = 0 if pixels.ndim == 2 else 2
    raw = b"".join(b"\x00" + pixels[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    )


def test_16bit_pngs_are_converted_explicitly_never_clipped(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    src = tmp_path / "scans"
    (src / "a").mkdir(parents=True)
    gray = rng.integers(0, 65536, (6, 24, 32), dtype=np.uint16)
    for i, g in enumerate(gray):
        _png16(src / "a" / f"{i}.png", g)
    # default: an 8-bit store holding each file's high byte (the old code clipped 99.6% to 255)
    res = from_directory(src, tmp_path / "u8.b2nd", color_mode="grayscale", keep_order=True, workers=1)
    s8 = carraystore.open(res.path)
    assert s8.dtype == np.uint8
    np.testing.assert_array_equal(s8[:][..., 0], (gray >> 8).astype(np.uint8))
    assert (s8[:] == 255).mean() < 0.01
    assert "high byte" in s8.provenance["bit_depth"]
    # uint16: every bit kept (here in rgb mode: the gray value in each channel)
    s16 = carraystore.open(from_directory(src, tmp_path / "u16.b2nd", dtype="uint16", keep_order=True, workers=2).path)
    assert s16.dtype == np.uint16 and s16.image_shape == (24, 32, 3)
    np.testing.assert_array_equal(s16[:], np.repeat(gray[..., None], 3, axis=-1))
    # an 8-bit file in a uint16 store is scaled to the full 16-bit range
    Image.fromarray(np.full((24, 32), 200, np.uint8), "L").save(src / "a" / "z8.png")
    s16 = carraystore.open(
        from_directory(
            src, tmp_path / "mix.b2nd", dtype="uint16", color_mode="grayscale", keep_order=True, workers=1
        ).path
    )
    assert (s16[len(s16) - 1] == 200 * 257).all()
    # a 16-bit colour PNG: Pillow decodes only its high byte, so uint16 refuses it by name
    rgb = rng.integers(0, 65536, (24, 32, 3), dtype=np.uint16)
    _png16(src / "a" / "colour.png", rgb)
    with pytest.raises(IngestError, match=r"colour\.png: a 16-bit colour PNG.*--dtype uint8"):
        from_directory(src, tmp_path / "bad.b2nd", dtype="uint16", workers=1)
    res = from_directory(src, tmp_path / "c8.b2nd", keep_order=True, workers=1)
    i = list(carraystore.open(res.path).keys).index("a/colour.png")
    np.testing.assert_array_equal(carraystore.open(res.path)[i], (rgb >> 8).astype(np.uint8))
    # the CLI option
    r = _cli(
        "ingest",
        str(src),
        str(tmp_path / "cli.b2nd"),
        "-q",
        "--workers",
        "1",
        "--dtype",
        "uint16",
        "--color-mode",
        "grayscale",
        "--on-error",
        "skip",
        "--max-skipped",
        "1",
    )
    assert r.returncode == 0, r.stderr
    assert "colour.png" in r.stdout and carraystore.open(tmp_path / "cli.b2nd").dtype == np.uint16


def test_follow_links_over_a_loop_terminates_and_names_the_link(photos: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(photos, src)
    (src / "astronaut" / "loop").symlink_to(".")  # astronaut/loop/loop/loop/... forever
    (src / "rocket" / "sub").mkdir()
    (src / "rocket" / "sub" / "back").symlink_to("..")  # rocket/sub/back/sub/back/...
    res = from_directory(src, tmp_path / "s.b2nd", follow_links=True, workers=1)
    files = sorted(p.relative_to(photos).as_posix() for p in photos.rglob("*.jpg"))
    # every image once: the loops are not entered again (the old walk listed each file ~40 times)
    assert sorted(carraystore.open(res.path).keys) == files
    summary = res.summary()
    assert "astronaut/loop/ (link to ., a folder already listed" in summary
    assert "rocket/sub/back/ (link to .., a folder already listed" in summary
    # without follow_links the links are listed as not followed
    res = from_directory(src, tmp_path / "t.b2nd", workers=1)
    assert sorted(carraystore.open(res.path).keys) == files
    assert any("astronaut/loop/" in i and "not followed" in i for i in res.ignored)


def test_duplicate_class_names_are_refused(photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ingest", str(photos), str(tmp_path / "s.b2nd"), "-q", "--class-names", "rocket,rocket"]) == 2
    assert "'rocket' is listed twice" in capsys.readouterr().err
    with pytest.raises(InvalidInputError, match="listed twice"):
        carraystore.create(tmp_path / "t.b2nd", (8, 8, 3), class_names=["a", "b", "a"])
    assert not list(tmp_path.iterdir())


def test_a_backslash_in_a_file_name_stays_in_the_key(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    pix = np.random.default_rng(1).integers(0, 255, (2, 16, 16, 3), dtype=np.uint8)
    Image.fromarray(pix[0]).save(src / "a" / "back\\slash.png")
    Image.fromarray(pix[1]).save(src / "a" / "plain.png")
    store = carraystore.open(from_directory(src, tmp_path / "s.b2nd", keep_order=True, workers=1).path)
    assert list(store.keys) == ["a/back\\slash.png", "a/plain.png"]  # not a/back/slash.png
    assert main(["export", str(tmp_path / "s.b2nd"), str(tmp_path / "out")]) == 0
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "out" / "a" / "back\\slash.png")), pix[0])
    assert not (tmp_path / "out" / "a" / "back").exists()


def test_undecodable_and_newline_file_names_follow_on_error(photos: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(photos / "rocket", src / "rocket")
    good = sorted(p.name for p in (src / "rocket").iterdir())
    jpeg = (src / "rocket" / good[0]).read_bytes()
    (src / "rocket" / "new\nline.jpg").write_bytes(jpeg)
    with open(os.path.join(os.fsencode(src / "rocket"), b"caf\xe9.jpg"), "wb") as f:
        f.write(jpeg)
    with pytest.raises(IngestError, match=r"caf\\xe9\.jpg: file name is not valid UTF-8.*on_error='skip'"):
        from_directory(src, tmp_path / "s.b2nd", workers=1)
    assert not (tmp_path / "s.b2nd").exists()
    r = _cli(
        "ingest", str(src), str(tmp_path / "s.b2nd"), "-q", "--workers", "2", "--on-error", "skip", "--max-skipped", "2"
    )
    assert r.returncode == 0, r.stderr
    assert "rocket/caf\\xe9.jpg: file name is not valid UTF-8" in r.stdout
    assert "rocket/new\\nline.jpg: file name holds a NUL or newline" in r.stdout
    store = carraystore.open(tmp_path / "s.b2nd")
    assert sorted(store.keys) == [f"rocket/{n}" for n in good]
    assert sorted(s["path"] for s in store.skipped) == ["rocket/caf\\xe9.jpg", "rocket/new\\nline.jpg"]
    assert main(["verify", "-q", str(tmp_path / "s.b2nd")]) == 0


# -- disk full, FIFOs ------------------------------------------------------------------------------


def _small_tmpfs_works() -> bool:
    if shutil.which("unshare") is None or sys.platform != "linux":
        return False
    r = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not _small_tmpfs_works(), reason="needs `unshare -Urm` and a tmpfs mount (Linux user namespaces)")
def test_disk_full_is_a_named_error_and_leaves_no_temp_file(tmp_path: Path) -> None:
    """A real ENOSPC: the store and the export are written onto a 256 KiB tmpfs in a private mount namespace."""
    src = make_photo_folder(tmp_path / "src", n=60, size=(96, 96), seed=4)
    full = tmp_path / "full"
    full.mkdir()
    store = tmp_path / "s.b2nd"
    from_directory(src, store, workers=1)
    script = (
        f"mount -t tmpfs -o size=256k tmpfs {full} && "
        f"{sys.executable} -m carraystore.cli.main ingest {src} {full}/out.b2nd -q --workers 1; echo rc=$?; "
        f"{sys.executable} -m carraystore.cli.main export {store} {full}/exported; echo rc=$?; "
        f"find {full} -name '.*'"
    )
    r = subprocess.run(["unshare", "-Urm", "sh", "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.stdout.count("rc=2") == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "Could not update" not in r.stderr
    assert f"carraystore ingest: error: no space left on {full}" in r.stderr
    assert f"carraystore export: error: no space left on {full}/exported" in r.stderr
    assert ".partial" not in r.stdout  # the unfinished files are removed


@pytest.mark.slow
def test_fifos_are_never_opened(photos: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(photos, src)
    os.mkfifo(src / "coffee" / "pipe.jpg")
    r = _cli("ingest", str(src), str(tmp_path / "a.b2nd"), "-q", "--workers", "1", timeout=120)
    assert r.returncode == 2 and "coffee/pipe.jpg: not a regular file" in r.stderr
    r = _cli(
        "ingest",
        str(src),
        str(tmp_path / "b.b2nd"),
        "-q",
        "--workers",
        "2",
        "--on-error",
        "skip",
        "--max-skipped",
        "1",
        timeout=120,
    )
    assert r.returncode == 0 and "coffee/pipe.jpg: not a regular file" in r.stdout
    assert len(carraystore.open(tmp_path / "b.b2nd")) == 24
    # a FIFO as the source folder or as a store
    fifo = tmp_path / "fifo.b2nd"
    os.mkfifo(fifo)
    for args in (
        ["ingest", str(fifo), str(tmp_path / "c.b2nd")],
        ["info", str(fifo)],
        ["verify", str(fifo)],
        ["preview", str(fifo), str(tmp_path / "p.png")],
        ["export", str(fifo), str(tmp_path / "e")],
    ):
        r = _cli(*args, timeout=60)
        assert r.returncode in (1, 2) and str(fifo) in r.stdout + r.stderr, (args, r.stderr)


def test_a_fifo_given_to_migrate_copy_or_meta_is_refused_not_read(tmp_path: Path) -> None:
    """`migrate FIFO OUT` blocked for ever reading the FIFO's magic bytes."""
    fifo = tmp_path / "fifo.npz"
    os.mkfifo(fifo)
    for args in (
        ["migrate", str(fifo), str(tmp_path / "m.b2nd")],
        ["copy", str(fifo), str(tmp_path / "c.b2nd")],
        ["meta", str(fifo), "--attr", "a=1"],
    ):
        r = _cli(*args, timeout=30)
        assert r.returncode == 2 and f"{fifo} is not a regular file" in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr


def test_overwrite_never_replaces_a_folder(photos: Path, tmp_path: Path) -> None:
    """`migrate` / `copy ... --overwrite` onto a folder ended in an IsADirectoryError traceback; ingest
    decoded everything, then blamed "permissions, quota and file size limit"."""
    import h5py

    h5 = tmp_path / "d.h5"
    with h5py.File(h5, "w") as f:
        f["images"] = np.zeros((4, 8, 8, 3), np.uint8)
    out = tmp_path / "out.b2nd"
    (out / "keep").mkdir(parents=True)
    src = tmp_path / "s.b2nd"
    with carraystore.create(src, (4, 4, 3)) as w:
        w.append(np.zeros((1, 4, 4, 3), np.uint8))
    for args in (
        ["migrate", str(h5), str(out), "--overwrite"],
        ["ingest", str(photos), str(out), "--overwrite", "-q"],
        ["copy", str(src), str(out), "--overwrite"],
    ):
        r = _cli(*args, timeout=120)
        assert r.returncode == 2 and f"{out} is a folder" in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert (out / "keep").is_dir()
    with pytest.raises(carraystore.StoreExistsError, match="is a folder"):
        carraystore.create(out, (4, 4, 3), overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.h5", "out.b2nd", "s.b2nd"]


def test_export_of_a_key_that_is_also_a_folder_is_a_named_error(tmp_path: Path) -> None:
    """Keys "a.png" and "a.png/b.png": a FileExistsError traceback after writing the first file."""
    store = tmp_path / "k.b2nd"
    with carraystore.create(store, (4, 4, 3)) as w:
        w.append(np.zeros((2, 4, 4, 3), np.uint8), keys=["a.png", "a.png/b.png"])
    r = _cli("export", str(store), str(tmp_path / "e"), timeout=60)
    assert (
        r.returncode == 2 and "would be both an item's file and the folder" in r.stderr and "Traceback" not in r.stderr
    )
    assert list((tmp_path / "e").iterdir()) == []  # refused before writing anything
    # a file left in the way by something else
    with carraystore.create(tmp_path / "f.b2nd", (4, 4, 3)) as w:
        w.append(np.zeros((1, 4, 4, 3), np.uint8), keys=["d/x.png"])
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "d").write_text("a file")
    r = _cli("export", str(tmp_path / "f.b2nd"), str(tmp_path / "o"), timeout=60)
    assert r.returncode == 2 and "a file is in the way" in r.stderr and "Traceback" not in r.stderr, r.stderr


# -- a killed ingest ------------------------------------------------------------------------------


def _read_to_eof(streams: list, deadline: float) -> bool:
    """Drain the pipes; True when every one reached EOF before ``deadline``."""
    open_fds = {s.fileno() for s in streams}
    while open_fds and time.time() < deadline:
        ready, _, _ = select.select(list(open_fds), [], [], max(0.0, deadline - time.time()))
        for fd in ready:
            if not os.read(fd, 65536):
                open_fds.discard(fd)
    return not open_fds


def _still_running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_killed_ingest_leaves_no_worker_holding_the_callers_pipes(tmp_path: Path) -> None:
    src = make_photo_folder(tmp_path / "src", n=600, size=(160, 160), seed=3)
    out = tmp_path / "out.b2nd"
    proc = subprocess.Popen(
        [*CLI, "ingest", str(src), str(out), "--workers", "2", "--chunk-images", "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for_partial(proc, out, larger_than=100_000, timeout=120)
        family = psutil.Process(proc.pid).children(recursive=True)
        assert family == []  # the ingest decodes in threads: no process that could hold the pipes
        os.kill(proc.pid, signal.SIGKILL)
        # the caller reads to EOF before it reaps the child: no process may keep the pipes open
        assert _read_to_eof([proc.stdout, proc.stderr], time.time() + 10), "a worker kept the caller's pipes open"
        _, alive = psutil.wait_procs(family, timeout=10)
        assert [p.pid for p in alive if _still_running(p)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()

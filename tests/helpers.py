"""Plain functions that several test files share (fixtures live in ``conftest.py``).

``tests/`` is on ``sys.path``: ``from helpers import indexed_images``.
"""

from __future__ import annotations

import builtins
import io
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import blosc2
import msgpack
import numpy as np
import pytest
from PIL import Image

import carraystore
from carraystore.format.record import META_KEY, seal_record
from carraystore.ingest.sample_data import make_photo_folder

#: The command line that runs carraystore's CLI in a child process (``[*CLI, "info", path]``).
CLI = (sys.executable, "-m", "carraystore.cli")

# -- pixels ----------------------------------------------------------------------------------------


def indexed_images(start: int, n: int, shape: tuple[int, ...]) -> np.ndarray:
    """Random uint8 images ``start..start+n-1`` of ``shape``, image ``i`` drawn from a generator seeded ``i``."""
    out = np.zeros((n, *shape), np.uint8)
    for j in range(n):
        out[j] = np.random.default_rng(start + j).integers(0, 256, shape, dtype=np.uint8)
    return out


def random_images(n: int, seed: int = 0, *, shape: tuple[int, ...], high: int = 256) -> np.ndarray:
    """``n`` random uint8 images of ``shape`` (values below ``high``) from one generator seeded ``seed``."""
    return np.random.default_rng(seed).integers(0, high, (n, *shape), dtype=np.uint8)


def image_bytes(img: np.ndarray | Image.Image, format: str, **save: Any) -> bytes:
    """``img`` (an array or a Pillow image) encoded by Pillow as ``format`` (``JPEG``, ``PNG``)."""
    buf = io.BytesIO()
    (img if isinstance(img, Image.Image) else Image.fromarray(img)).save(buf, format=format, **save)
    return buf.getvalue()


def pillow_pixels(src: bytes | Path, mode: str = "RGB") -> np.ndarray:
    """Pillow's pixels of an image file (its path or bytes) converted to ``mode``, with a channel axis."""
    with Image.open(io.BytesIO(src) if isinstance(src, bytes) else src) as img:
        arr = np.asarray(img.convert(mode))
    return arr[..., None] if arr.ndim == 2 else arr


# -- the test's world ------------------------------------------------------------------------------


def hide_module(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Make importing ``name`` or its submodules fail with ImportError for the rest of the test."""
    real_import = builtins.__import__

    def fake_import(module: str, *args: Any, **kwargs: Any) -> Any:
        if module == name or module.startswith(f"{name}."):
            raise ImportError(f"No module named '{name}'")
        return real_import(module, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)


def tiny_keras_model(classes: int) -> Any:
    """A compiled Keras model small enough to fit in a test: rescale, global average pool, one dense layer."""
    keras = pytest.importorskip("keras")
    model = keras.Sequential(
        [
            keras.Input((None, None, 3)),
            keras.layers.Rescaling(1 / 255),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(classes),
        ]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


# -- stores ----------------------------------------------------------------------------------------


def make_store(path: Path, images: np.ndarray, labels: Any = None, keys: Any = None, **create: Any) -> Path:
    """Write ``images`` (with ``labels`` and ``keys``) in one append to a new store at ``path``; return ``path``."""
    with carraystore.create(path, images.shape[1:], **create) as w:
        w.append(images, labels=labels, keys=keys)
    return path


def ingested_photos(
    root: Path,
    name: str = "photos.b2nd",
    *,
    n: int,
    size: tuple[int, int],
    seed: int,
    classes: Any = None,
    **ingest: Any,
) -> Path:
    """A photo folder ``root/photos`` ingested with one worker into ``root/name``; return the store's path."""
    folder = make_photo_folder(root / "photos", n=n, size=size, classes=classes, seed=seed)
    return carraystore.from_directory(folder, root / name, workers=1, **ingest).path


def index_of(store: carraystore.Store) -> dict[bytes, int]:
    """Every image's bytes -> its index (the images must all differ)."""
    images = store[:]
    table = {images[i].tobytes(): i for i in range(len(images))}
    assert len(table) == len(images), "fixture images must be distinct"
    return table


def epoch_of(store: Any, **kw: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """One epoch of ``store.batches(16, **kw)``, each batch copied."""
    return [(x.copy(), y.copy()) for x, y in store.batches(16, **kw)]


# -- the metadata record, read and written with blosc2 and msgpack alone ----------------------------


def silent_flip(path: Path, chunk: int) -> tuple[int, int]:
    """(offset in the file, flipped value) of one byte of ``chunk`` whose flip still decompresses, into
    other bytes: the damage a reader without the CRC check would hand out as wrong pixels."""
    with carraystore.open(path) as store:
        data = bytearray(store.read_chunk_bytes(chunk))
        offset, _ = store.chunk_byte_range(chunk)
    good = blosc2.decompress2(bytes(data))
    for j in range(len(data) // 2, len(data) - 1):
        data[j] ^= 0x01
        try:
            if blosc2.decompress2(bytes(data)) != good:
                return offset + j, data[j]
        except Exception:
            pass
        data[j] ^= 0x01
    raise AssertionError("no byte of the chunk flips silently")  # pragma: no cover - photo data has literal bytes


def raw_record(path: Path) -> bytes:
    """The store's metadata record as stored (its msgpack bytes)."""
    array = blosc2.open(str(path), mode="r")  # kept alive: the vlmeta object points into it
    return bytes(array.schunk.vlmeta.get_vlmeta(META_KEY))


def set_raw_record(path: Path, raw: bytes) -> None:
    """Replace the store's metadata record with ``raw``, as it is."""
    array = blosc2.open(str(path), mode="a")
    array.schunk.vlmeta.set_vlmeta(META_KEY, raw, typesize=1)
    del array


def rewrite_record(path: Path, mutate: Callable[[dict[str, Any]], Any], out: Path | None = None) -> Path:
    """Change the record (of a copy at ``out`` if given) with ``mutate``, sealed again so that the checks behind
    the checksum are what is tested; return the store changed."""
    if out is not None:
        shutil.copy(path, out)
        path = out
    rec = msgpack.unpackb(raw_record(path), raw=False)
    mutate(rec)
    set_raw_record(path, seal_record(rec))
    return path


# -- killed writers --------------------------------------------------------------------------------


def kill_forked(work: Callable[[Callable[[], object]], None], delay: float = 0.0) -> int:
    """Fork a child that runs ``work(ready)``; ``delay`` s after it calls ``ready()``, SIGKILL it; return its status."""
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            os.close(r)
            work(partial(os.write, wfd, b"x"))
        finally:
            os._exit(1)
    os.close(wfd)
    assert os.read(r, 1) == b"x"
    os.close(r)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]


def kill_mid_append(path: Path, write: Callable[[carraystore.StoreWriter], None]) -> None:
    """Leave a hot journal: a forked child appends ``write(w)`` in place and is SIGKILLed before close()."""

    def work(ready: Callable[[], object]) -> None:
        w = carraystore.append(path)
        write(w)
        ready()
        time.sleep(60)  # killed here, the writer still open

    kill_forked(work)


def wait_for_partial(
    proc: subprocess.Popen[Any], out: Path, *, larger_than: int, timeout: float = 60, poll: float = 0.02
) -> None:
    """Wait until the temporary file of a writer to ``out`` holds over ``larger_than`` bytes, ``proc`` still running."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for part in [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.partial-")]:
            try:
                if part.stat().st_size > larger_than:
                    return
            except FileNotFoundError:  # renamed into place (or cleaned up) between the listing and the stat
                pass
        assert proc.poll() is None, "ingest finished before it could be killed; make the input larger"
        time.sleep(poll)
    pytest.fail(f"no temporary file appeared within {timeout:g} s")

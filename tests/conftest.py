"""Shared test fixtures: small real-photo folders and arrays, the optional ../shared folder, servers.

Keep this file to fixtures that several test files use; plain functions that several files use
live in ``helpers.py``; what one file uses lives in that file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from helpers import pillow_pixels
from loader_threads import no_loader_threads_left  # noqa: F401  (a fixture: no test leaves loader threads running)
from PIL import Image
from remote_servers import http_server, seaweedfs  # noqa: F401  (fixtures: real servers on loopback for the remote tests)

from carraystore.ingest.sample_data import PHOTOS, load_photo, make_photo_folder

try:  # property tests: the same examples on every CI run (a failure there is reproducible), random here
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI"):
        _hypothesis_settings.load_profile("ci")
except ImportError:  # pragma: no cover - hypothesis is in the test extras
    pass

#: The four photo classes the shared folders use (each class is one scikit-image photo).
PHOTO_CLASSES = ("astronaut", "chelsea", "coffee", "rocket")

#: ``../shared`` beside the checkout (read-only data another session may have provided).
SHARED_DIR = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The read-only ``shared/`` folder beside the repository; skips the test when absent."""
    if not SHARED_DIR.is_dir():
        pytest.skip(
            f"shared data folder {SHARED_DIR} is absent (it sits beside the checkout; only some machines have it)"
        )
    return SHARED_DIR


@pytest.fixture(scope="session")
def photo_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """48 real-photo JPEGs of 64x64 pixels in four class folders (12 per class)."""
    return make_photo_folder(
        tmp_path_factory.mktemp("photo_folder"), n=48, size=(64, 64), classes=PHOTO_CLASSES, seed=11
    )


@pytest.fixture(scope="session")
def photo_arrays(photo_folder: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The decoded pixels (N, 64, 64, 3) uint8, labels and relative keys of ``photo_folder``, in path order."""
    files = sorted(photo_folder.rglob("*.jpg"))
    images = [pillow_pixels(f) for f in files]
    keys = [f.relative_to(photo_folder).as_posix() for f in files]
    labels = np.array([PHOTO_CLASSES.index(k.split("/")[0]) for k in keys], dtype=np.int64)
    return np.stack(images), labels, keys


@lru_cache(maxsize=8)
def _scaled_photos(short_side: int) -> tuple[np.ndarray, ...]:
    """Every sample photo scaled (bilinear) so that its shorter side is ``short_side``."""
    out = []
    for name in PHOTOS:
        img = Image.fromarray(load_photo(name))
        scale = short_side / min(img.size)
        out.append(
            np.asarray(
                img.resize(
                    (max(short_side, round(img.size[0] * scale)), max(short_side, round(img.size[1] * scale))),
                    Image.BILINEAR,
                )
            )
        )
    return tuple(out)


def _photo_patches(n: int, size: tuple[int, int] = (16, 16), seed: int = 0) -> np.ndarray:
    """``n`` random RGB patches of ``size`` from the scaled sample photos (random positions and flips)."""
    h, w = size
    photos = _scaled_photos(max(64, 4 * max(h, w)))
    rng = np.random.default_rng(seed)
    out = np.empty((n, h, w, 3), dtype=np.uint8)
    which = rng.integers(0, len(photos), n)
    flips = rng.random(n) < 0.5
    for i in range(n):
        ph = photos[which[i]]
        y = int(rng.integers(0, ph.shape[0] - h + 1))
        x = int(rng.integers(0, ph.shape[1] - w + 1))
        patch = ph[y : y + h, x : x + w]
        out[i] = patch[:, ::-1] if flips[i] else patch
    return out


@pytest.fixture(scope="session")
def photo_patches() -> Callable[..., np.ndarray]:
    """``photo_patches(n, size=(16, 16), seed=0)``: n random RGB uint8 patches of the sample photos.

    Real photographic pixels (scaled-down scikit-image photos, random positions and flips),
    fast enough for 10,000 images; the same arguments give the same array.
    """
    return _photo_patches


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` first, in their collected order. pytest-xdist hands tests out in
    collection order: a long test handed out near the end keeps its worker busy after the
    others have finished, while at the start it runs beside the short ones."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)

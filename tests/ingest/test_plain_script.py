"""Ingest from a plain script: no ``if __name__ == "__main__":`` guard needed.

The decoding workers used to start by forkserver, which re-imports the main module: a
script holding the README's ``from_directory`` line at top level died with
``BrokenProcessPool`` and wrote nothing. Decoding now runs in threads.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

import carraystore
from carraystore.ingest.sample_data import make_photo_folder

SCRIPT = """\
import carraystore

carraystore.from_directory("photos/", "train.b2nd", image_size=(32, 32), workers=2)
print("done")
"""


def test_a_plain_script_without_a_main_guard_ingests(tmp_path: Path) -> None:
    make_photo_folder(tmp_path / "photos", n=40, size=(48, 48), classes=["chelsea", "coffee"], seed=1)
    (tmp_path / "ingest_photos.py").write_text(SCRIPT)
    r = subprocess.run([sys.executable, "ingest_photos.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "done" and "Traceback" not in r.stderr
    store = carraystore.open(tmp_path / "train.b2nd")
    assert len(store) == 40 and store.class_names == ("chelsea", "coffee") and store.shape[1:] == (32, 32, 3)
    assert np.bincount(store.labels).tolist() == [20, 20]
    # the same bytes as a single-threaded ingest: threads change nothing in the store
    carraystore.from_directory(tmp_path / "photos", tmp_path / "one.b2nd", image_size=(32, 32), workers=1)
    assert np.array_equal(carraystore.open(tmp_path / "one.b2nd")[:], store[:])

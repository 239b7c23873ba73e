"""The remote benchmark's helpers (bench.remote_epochs): its store contenders and run selection."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import carraystore
from bench.remote_epochs import STORE_KINDS, build_store, run_contender, select_run
from carraystore.base.errors import CarrayStoreError

STORES = {"carraystore": "balanced", "carraystore_fast": "fast", "carraystore_encoded": "encoded"}
PEERS = (*STORES, "jpeg_get", "webdataset", "zarr")
LINKS: list[tuple[int, int | None]] = [(0, None), (20, 400)]


def test_encoded_contender_keeps_the_jpeg_files_and_reads_the_pixels_of_the_pixel_store(
    photo_folder: Path, tmp_path: Path
) -> None:
    assert set(STORE_KINDS) == set(STORES)
    build_store("carraystore_encoded", photo_folder, tmp_path / "enc.b2nd", chunk_images=5)
    build_store("carraystore", photo_folder, tmp_path / "pix.b2nd", chunk_images=5)
    with carraystore.open(tmp_path / "enc.b2nd") as enc, carraystore.open(tmp_path / "pix.b2nd") as pix:
        assert enc.layout == "encoded" and pix.layout == "NHWC"
        assert enc.chunk_images == 5 and len(enc) == len(pix) == 48
        for i, key in enumerate(enc.keys):  # every entry is its file, byte for byte
            assert enc.entry(i) == (photo_folder / key).read_bytes(), key
        assert np.array_equal(enc[:], pix[:])
    with pytest.raises(ValueError, match="unknown store contender"):
        build_store("zarr", photo_folder, tmp_path / "z.b2nd", chunk_images=5)


def test_store_contender_takes_loader_arguments(photo_folder: Path, tmp_path: Path) -> None:
    build_store("carraystore_encoded", photo_folder, tmp_path / "enc.b2nd", chunk_images=5)
    events: list[dict] = []
    spec = {
        "kind": "carraystore_encoded",
        "location": str(tmp_path / "enc.b2nd"),
        "epochs": 2,
        "batch_size": 16,
        "seed": 0,
        "loader": {"window": 2, "num_threads": 1},
    }
    rows = run_contender(spec, events.append)
    assert [r["images"] for r in rows] == [48, 48]
    assert [(e["epoch"], e["phase"]) for e in events] == [(0, "start"), (0, "end"), (1, "start"), (1, "end")]
    with pytest.raises(CarrayStoreError):  # the arguments do reach batches
        run_contender({**spec, "loader": {"window": 0}})


def test_select_run_defaults_to_everything() -> None:
    assert select_run(STORES, PEERS, LINKS, {}) == (STORES, PEERS, LINKS, "remote")


def test_select_run_keeps_the_contenders_and_links_asked_for() -> None:
    env = {
        "CARRAYSTORE_BENCH_REMOTE_ONLY": "carraystore_encoded, webdataset,carraystore",
        "CARRAYSTORE_BENCH_REMOTE_LINKS": "20:400,0:none",
        "CARRAYSTORE_BENCH_REMOTE_NAME": "remote_encoded",
    }
    stores, peers, links, name = select_run(STORES, PEERS, LINKS, env)
    assert stores == {"carraystore": "balanced", "carraystore_encoded": "encoded"}
    assert peers == ("carraystore_encoded", "webdataset", "carraystore")
    assert links == [(20, 400), (0, None)]
    assert name == "remote_encoded"


@pytest.mark.parametrize(
    "env",
    [
        {"CARRAYSTORE_BENCH_REMOTE_ONLY": "carraystore,litdata"},  # litdata: not among these contenders
        {"CARRAYSTORE_BENCH_REMOTE_NAME": "../remote"},
        {"CARRAYSTORE_BENCH_REMOTE_LINKS": "20ms:400"},
    ],
)
def test_select_run_refuses_what_it_cannot_run(env: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        select_run(STORES, PEERS, LINKS, env)

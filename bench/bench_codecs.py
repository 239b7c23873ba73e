"""Codec suite: every codec x level x filter x block size on real photos and video-like frames.

Writes ``codecs.json``, ``codecs.md`` (table, Pareto fronts marked) and ``codecs.png``
(ratio against decompression speed) to the results folder, and times the chunk
decompression of each preset with pytest-benchmark. Scale: ``CARRAYSTORE_BENCH_SCALE``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from benchpaths import data_dir, results_dir

import carraystore
from bench.benchdata import cached_photo_folder, cached_video_folder
from carraystore.cli.benchmarks import codecs as C
from carraystore.cli.benchmarks.datasets import decode_images, list_image_folder
from carraystore.format.codec import PRESETS, Codec

SCALE = os.environ.get("CARRAYSTORE_BENCH_SCALE", "default")
HERE = Path(__file__).resolve().parent

#: photos: sample size; video: clips x frames; size: image size; grid: arguments of codec_grid.
SCALES = {
    "tiny": dict(
        photos=8,
        clips=1,
        frames=8,
        size=(64, 64),
        repeats=1,
        grid=dict(
            codecs=("lz4", "zstd"),
            clevels=(0, 1),
            filters=("none", "shuffle+bytedelta"),
            blocks=(1, 4),
            with_ts1_shuffle=False,
        ),
    ),
    "default": dict(photos=24, clips=2, frames=12, size=(256, 256), repeats=3, grid={}),
    "large": dict(photos=128, clips=4, frames=32, size=(256, 256), repeats=5, grid={}),
}
if SCALE not in SCALES:
    raise ValueError(f"CARRAYSTORE_BENCH_SCALE={SCALE!r}: use one of {sorted(SCALES)}")
CFG = SCALES[SCALE]


@pytest.fixture(scope="module")
def samples() -> dict[str, np.ndarray]:
    size = CFG["size"]
    photos = cached_photo_folder(data_dir(), max(CFG["photos"], 8), size=size)
    video = cached_video_folder(data_dir(), CFG["clips"], CFG["frames"], size=size)
    pf = list_image_folder(photos, limit=CFG["photos"], seed=0)
    vf = list_image_folder(video)  # frames in clip order: neighbours overlap, as in a video
    return {"photos": decode_images(pf.files), "video": decode_images(vf.files)}


def test_codec_suite(benchmark, samples: dict[str, np.ndarray]) -> None:
    grid = C.codec_grid(**CFG["grid"])
    t0 = time.perf_counter()
    rows = benchmark.pedantic(
        C.run_suite, args=(samples, grid), kwargs={"repeats": CFG["repeats"]}, rounds=1, iterations=1
    )
    elapsed = time.perf_counter() - t0
    from bench.loaders import library_versions, machine_info

    info = {
        "title": f"{SCALE} scale",
        "samples": {k: f"{len(v)} x {'x'.join(map(str, v.shape[1:]))}" for k, v in samples.items()},
        "combinations": len(grid),
        "seconds": round(elapsed, 1),
        "machine": machine_info(),
        "versions": library_versions(),
        "date": time.strftime("%Y-%m-%d"),
        "pinned_presets": {k: v.describe() for k, v in PRESETS.items()},
        "default_codec": Codec().describe(),
    }
    paths = C.write_results(rows, results_dir(SCALE), info=info)
    assert paths["json"].exists() and paths["md"].exists()
    assert len(rows) == len(grid) * len(samples)
    chosen = C.choose_presets(rows, dataset="photos")
    benchmark.extra_info.update(
        {
            "rows": len(rows),
            "chosen": {k: v.label for k, v in chosen.items()},
            "chosen_matches_pinned": {
                k: (v.codec, v.clevel, v.codec_obj().filters)
                == (PRESETS[k].codec, PRESETS[k].clevel, PRESETS[k].filters)
                for k, v in chosen.items()
            },
            "pinned": info["pinned_presets"],
            "pareto": {ds: len(C.pareto_front([r for r in rows if r.dataset == ds])) for ds in samples},
        }
    )
    for r in rows:  # every combination round-trips and reports sane numbers
        assert r.cbytes > 0 and r.compress_mbs > 0 and r.decompress_mbs_1t > 0 and r.decompress_mbs_2t > 0
    if SCALE != "tiny":
        # The presets must keep the order their names promise on these photos:
        # fast decompresses fastest, small stores the fewest bytes.
        pinned = {
            name: C.measure_codec(samples["photos"], codec, dataset=name, repeats=CFG["repeats"])
            for name, codec in PRESETS.items()
        }
        benchmark.extra_info["pinned_measured"] = {
            k: {"ratio": round(r.ratio, 3), "decompress_mbs_1t": round(r.decompress_mbs_1t)} for k, r in pinned.items()
        }
        assert pinned["small"].ratio >= pinned["balanced"].ratio >= pinned["fast"].ratio, benchmark.extra_info[
            "pinned_measured"
        ]
        assert pinned["fast"].decompress_mbs_1t > pinned["balanced"].decompress_mbs_1t, benchmark.extra_info[
            "pinned_measured"
        ]
        assert pinned["fast"].decompress_mbs_1t > pinned["small"].decompress_mbs_1t, benchmark.extra_info[
            "pinned_measured"
        ]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_decompress_chunk(benchmark, samples: dict[str, np.ndarray], preset: str, tmp_path: Path) -> None:
    """Store.read_chunk of one full chunk of photos, per preset (pytest-benchmark timing)."""
    images = samples["photos"]
    path = tmp_path / f"{preset}.b2nd"
    with carraystore.create(path, images.shape[1:], codec=preset, chunk_images=len(images)) as w:
        w.append(images)
    store = carraystore.open(path)
    buf = np.empty((store.chunk_images, *store.image_shape), dtype=store.dtype)
    out = benchmark(store.read_chunk, 0, buf)
    assert np.array_equal(out, images)
    benchmark.extra_info.update(
        {
            "codec": store.codec.describe(),
            "ratio": round(store.nbytes / store.cbytes, 3),
            "chunk_mb": round(images.nbytes / 1e6, 2),
        }
    )

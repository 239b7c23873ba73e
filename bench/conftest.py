"""pytest configuration of the benchmark suite (``make bench``).

Benchmark files are named ``bench_*.py``; they are collected here even when pytest is
run without ``-o python_files='bench_*.py'``. Every file reads its size from the
environment variable ``CARRAYSTORE_BENCH_SCALE`` (``tiny``, ``default`` or ``large``)
itself, so no file depends on another's fixtures. Generated datasets are cached under
``bench/out/`` (git-ignored; ``CARRAYSTORE_BENCH_DATA`` overrides) and results are
written to ``bench/results/`` (``CARRAYSTORE_BENCH_RESULTS`` overrides; the ``tiny``
smoke runs write to a temporary folder so committed results stay untouched).
"""

from __future__ import annotations

import fnmatch

import pytest


def pytest_collect_file(parent: pytest.Collector, file_path):  # type: ignore[no-untyped-def]
    if file_path.suffix != ".py" or not fnmatch.fnmatch(file_path.name, "bench_*.py"):
        return None
    patterns = parent.config.getini("python_files")
    if parent.session.isinitpath(file_path) or any(fnmatch.fnmatch(file_path.name, p) for p in patterns):
        return None  # pytest collects it already (named on the command line, or -o python_files='bench_*.py')
    return pytest.Module.from_parent(parent, path=file_path)

"""Every case of every legacy bcolz corpus migrates exactly, or fails clearly leaving nothing.

Corpora: ``../shared/fixtures/bcolz`` (beside the checkout; skipped when absent) and the
small copy in ``tests/data/bcolz`` (always present). Cases are discovered by listing the
folders, so new cases are picked up. Each case is copied to a temporary folder first,
and the copy's bytes and mtimes are checked to be unchanged afterwards.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import carraystore
from carraystore.base.errors import MigrationError
from carraystore.migrations import migrate
from carraystore.migrations.bcolz import CarrayReader

SHARED_CORPUS = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "bcolz"
LOCAL_CORPUS = Path(__file__).resolve().parents[1] / "data" / "bcolz"
ROOTS = {"shared": SHARED_CORPUS, "local": LOCAL_CORPUS}


def _cases(kind: str) -> list[tuple[str, str, str]]:
    """(root name, corpus, case) for every case folder; ``kind`` is "corpus" or "broken"."""
    out = []
    for root_name, root in ROOTS.items():
        if not root.is_dir():
            out.append((root_name, "<absent>", "<absent>"))
            continue
        for corpus in sorted(p for p in root.iterdir() if p.is_dir()):
            if (corpus.name == "broken") != (kind == "broken"):
                continue
            for case in sorted(p for p in corpus.iterdir() if p.is_dir() and p.name != "expected"):
                out.append((root_name, corpus.name, case.name))
    return out


def _case_dir(root_name: str, corpus: str, case: str) -> Path:
    root = ROOTS[root_name]
    if corpus == "<absent>":
        pytest.skip(
            f"{root} is absent (the shared fixtures sit beside the checkout in ../shared; only some machines have them)"
        )
    return root / corpus / case


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _read_all(store: carraystore.Store) -> np.ndarray:
    """The store's items exactly as stored (whole chunks, so structured padding is kept)."""
    out = np.empty(store.shape, dtype=store.dtype)  # np.concatenate would make it native-endian
    raw = out.view(np.dtype((np.void, out.dtype.itemsize))) if out.dtype.names else out
    for i in range(store.nchunks):
        a, b = store.chunk_range(i)
        chunk = store.read_chunk(i)
        raw[a:b] = chunk.view(raw.dtype) if out.dtype.names else chunk
    return out


def assert_bit_exact(got: np.ndarray, want: np.ndarray) -> None:
    """Every element bit-exact. Structured dtypes compare field by field: padding bytes hold no
    data (bcolz's own read-back left them uninitialised). A byte order differing from the
    expected file is allowed (bcolz returned native order), the values must match exactly."""
    assert got.shape == want.shape
    if want.dtype.names:
        assert got.dtype.names == want.dtype.names
        for name in want.dtype.names:
            assert_bit_exact(got[name], want[name])
        return
    g = got if got.dtype == want.dtype else got.astype(want.dtype)
    assert got.dtype.kind == want.dtype.kind and got.dtype.itemsize == want.dtype.itemsize
    assert np.ascontiguousarray(g).view(np.uint8).tobytes() == np.ascontiguousarray(want).view(np.uint8).tobytes()


def _source_dtype(case: Path) -> np.dtype:
    text = json.loads((case / "meta" / "storage").read_text())["dtype"]
    try:
        return np.dtype(text)
    except (TypeError, ValueError):
        return np.dtype(ast.literal_eval(text))


@pytest.mark.parametrize("root_name,corpus,case", _cases("corpus"))
def test_corpus_case(root_name: str, corpus: str, case: str, tmp_path: Path) -> None:
    src_orig = _case_dir(root_name, corpus, case)
    expected_dir = src_orig.parent / "expected"
    npy = expected_dir / f"{case}.npy"
    objrepr = expected_dir / f"{case}.objrepr.json"
    src = tmp_path / case
    shutil.copytree(src_orig, src)
    before = _snapshot(src)
    out = tmp_path / "out.b2nd"

    if npy.exists():
        report = migrate(src, out, progress=False)
        want = np.load(npy)
        store = carraystore.open(out)
        got = _read_all(store)
        assert got.dtype == store.dtype
        assert_bit_exact(got, want)
        assert report.verified and report.rows == len(want)
        if (src / "__rootdirs__").exists():
            assert store.dtype == want.dtype  # the table as one structured array, fields in column order
        else:
            assert store.dtype == _source_dtype(src)  # the source dtype is kept, byte order included
            assert tuple(store.shape) == want.shape  # (N, ...) exactly: no channel axis added
        attrs_file = src / "__attrs__"
        text = attrs_file.read_text().strip() if attrs_file.exists() else ""
        assert store.attrs == (json.loads(text) if text else {})
        assert store.verify() == []
    elif objrepr.exists():
        reprs = json.loads(objrepr.read_text())
        # without --allow-pickle: refused, naming the flag
        with pytest.raises(MigrationError, match="allow-pickle"):
            migrate(src, out, progress=False)
        assert not out.exists()
        # the pure reader unpickles every element exactly (Python 2 pickles need latin1)
        values = CarrayReader.open(src, allow_pickle=True).read()
        assert len(values) == len(reprs)
        for v, r in zip(values, reprs, strict=True):
            assert repr(v) == r or v == ast.literal_eval(r.rstrip("L")), (v, r)
        # these arrays mix types no fixed-size dtype holds: a clear error, no output
        with pytest.raises(MigrationError, match="no common fixed-size type"):
            migrate(src, out, progress=False, allow_pickle=True)
        assert not out.exists()
    else:
        # no expected file: the writer failed; migrating must fail clearly and leave nothing
        with pytest.raises(MigrationError) as info:
            migrate(src, out, progress=False)
        assert case in str(info.value) and "meta/storage is empty" in str(info.value)
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary files left behind"
    assert _snapshot(src) == before, "the source was modified"


@pytest.mark.parametrize("root_name,corpus,case", _cases("broken"))
def test_broken_case(root_name: str, corpus: str, case: str, tmp_path: Path) -> None:
    src_orig = _case_dir(root_name, corpus, case)
    manifest = json.loads((src_orig.parent / "MANIFEST.json").read_text())
    assert case in manifest, f"{case} is not described in MANIFEST.json"
    spec = manifest[case]
    src = tmp_path / case
    shutil.copytree(src_orig, src)
    before = _snapshot(src)
    out = tmp_path / "out.b2nd"
    if spec["expect"] == "array":
        report = migrate(src, out, progress=False)
        store = carraystore.open(out)
        assert _read_all(store).tolist() == spec["values"]
        if "warn" in spec["note"]:
            assert any("never flushed" in w for w in report.warnings), report.warnings
        else:
            assert report.warnings == []
    else:
        assert spec["expect"] == "error"
        with pytest.raises(MigrationError) as info:
            migrate(src, out, progress=False)
        assert spec["mentions"] in str(info.value)
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary files left behind"
    assert _snapshot(src) == before, "the source was modified"


def test_local_corpus_is_small_and_complete() -> None:
    """The in-repo copy stays small and keeps a case of each hard kind."""
    files = [p for p in LOCAL_CORPUS.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 1_000_000
    names = {p.name for p in LOCAL_CORPUS.glob("*/*") if p.is_dir()}
    assert {
        "ctable",
        "codec_snappy_sh1",
        "codec_snappy_sh2",
        "struct_offsets",
        "object",
        "num_c8",
        "trunc_chunk",
    } <= names
    assert os.path.exists(LOCAL_CORPUS / "broken" / "MANIFEST.json")

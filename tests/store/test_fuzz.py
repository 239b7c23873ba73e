"""Hostile files: seeded mutations of a small store's header, chunks, offsets index and trailer.

Every mutated file is opened, described (``info``) and verified in a child process that runs
many cases (so a crash or a hang is caught, and the suite stays quick). Each case must end
in one of two ways: a CarrayStoreError subclass, or exactly the original metadata (keys,
labels, class names, attrs, ...) with pixel damage, if any, reported by ``verify`` (a store
that verifies clean must read back the original pixels). Zero crashes, zero hangs, zero
silently wrong keys or labels.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import carraystore
from carraystore.format.frame import read_frame
from carraystore.sources.local import LocalFileSource

SEED = 20261123
GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden" / "carraystore-0.1.0"
CASES_PER_REGION = {"header": 70, "chunks": 70, "index": 50, "trailer": 60, "vlmeta": 110}
CHILD_TIMEOUT_S = 60

# Opens, describes and verifies every file named on stdin; one JSON line per case.
CHILD = r"""
import hashlib, json, sys, traceback
import numpy as np
import carraystore
from carraystore.cli.summary import store_info

def digest(store):
    m = store.meta
    return {
        "nimages": m.nimages, "shape": list(store.shape), "dtype": str(store.dtype),
        "labels": None if m.labels is None else m.labels.tolist(),
        "keys": None if m.keys is None else list(m.keys),
        "class_names": None if m.class_names is None else list(m.class_names),
        "attrs": m.attrs, "provenance": m.provenance, "skipped": [dict(s) for s in m.skipped],
        "codec": m.codec.to_config(), "crc32": [int(c) for c in m.crc32], "color_mode": m.color_mode,
    }

for line in sys.stdin:
    path = line.strip()
    if not path:
        continue
    print(json.dumps({"start": path}), flush=True)
    out = {"path": path}
    try:
        store = carraystore.open(path)
        out["meta"] = digest(store)
        json.dumps(store_info(store))
        problems = store.verify()
        out["problems"] = [str(p) for p in problems]
        if not problems:
            out["pixels"] = hashlib.sha256(store[:].tobytes()).hexdigest()
        store.close()
    except carraystore.CarrayStoreError as exc:
        out["error"] = type(exc).__name__
    except Exception as exc:
        out["unexpected"] = f"{type(exc).__name__}: {exc} at " + " <- ".join(
            f"{f.name}:{f.lineno}" for f in reversed(traceback.extract_tb(exc.__traceback__)[-3:]))
    print(json.dumps(out), flush=True)
"""


def _make_store(path: Path) -> None:
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (18, 8, 8, 3), dtype=np.uint8)
    images[4:8] = 0  # chunk 1 is all zeros: the frame stores it as a special chunk
    with carraystore.create(
        path,
        (8, 8, 3),
        chunk_images=4,
        class_names=["cat", "dog", "eel"],
        attrs={"split": "train", "nested": {"a": [1, 2, 3]}},
        provenance={"source": "fuzz"},
    ) as w:
        w.append(images, labels=np.arange(18) % 3, keys=[f"d/{i:02d}.png" for i in range(18)])


def _regions(path: Path) -> dict[str, tuple[int, int]]:
    data = path.read_bytes()
    frame = read_frame(LocalFileSource(path))
    vl = frame.vlmeta_raw["carraystore"]
    vl_at = data.rfind(vl)
    tail = frame.header_len + frame.cbytes
    trailer_len = int.from_bytes(data[-22:-18], "big")
    return {
        "header": (0, frame.header_len),
        "chunks": (frame.header_len, tail),
        "index": (tail, len(data) - trailer_len),
        "trailer": (len(data) - trailer_len, len(data)),
        "vlmeta": (vl_at, vl_at + len(vl)),
    }


def _mutate(data: bytes, lo: int, hi: int, rng: np.random.Generator) -> bytes:
    b = bytearray(data)
    kind = rng.integers(0, 4)
    pos = int(rng.integers(lo, hi))
    if kind == 0:  # one flipped bit
        b[pos] ^= 1 << int(rng.integers(0, 8))
    elif kind == 1:  # one byte set to a random value
        b[pos] = int(rng.integers(0, 256))
    elif kind == 2:  # a few bytes of garbage
        n = int(rng.integers(2, 9))
        b[pos : pos + n] = rng.integers(0, 256, min(n, len(b) - pos), dtype=np.uint8).tobytes()
    else:  # an "interesting" integer written over a size or offset field
        value = int(rng.choice([0, 1, 0x7F, 0x80, 0xFF, 0x7FFFFFFF, 0xFFFFFFFF]))
        width = int(rng.choice([1, 2, 4]))
        b[pos : pos + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")[: len(b) - pos]
    return bytes(b)


def _run_cases(paths: list[Path]) -> tuple[dict[str, dict[str, Any]], list[str], list[str]]:
    """Results by path, paths that crashed the child, paths that hung it."""
    results: dict[str, dict[str, Any]] = {}
    crashed: list[str] = []
    hung: list[str] = []
    todo = [str(p) for p in paths]
    while todo:
        try:
            proc = subprocess.run(
                [sys.executable, "-c", CHILD],
                input="\n".join(todo) + "\n",
                capture_output=True,
                text=True,
                timeout=CHILD_TIMEOUT_S,
                check=False,
            )
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            stderr, rc = "", None
        started = None
        for line in stdout.splitlines():
            rec = json.loads(line)
            if "start" in rec:
                started = rec["start"]
            else:
                results[rec["path"]] = rec
                started = None
        if rc == 0 and started is None:
            break
        if started is None:
            raise AssertionError(f"fuzz child failed outside any case (rc {rc}): {stderr[-2000:]}")
        (hung if rc is None else crashed).append(started)
        todo = todo[todo.index(started) + 1 :]
    return results, crashed, hung


def test_mutated_stores_never_crash_hang_or_lie(tmp_path: Path) -> None:
    original = tmp_path / "orig.b2nd"
    _make_store(original)
    data = original.read_bytes()
    regions = _regions(original)
    assert regions["vlmeta"][0] > regions["trailer"][0]
    store = carraystore.open(original)
    assert store._frame.chunk_special.tolist()[1] == 1  # the special chunk is part of what gets fuzzed
    assert store.verify() == []
    rng = np.random.default_rng(SEED)
    paths = []
    for region, count in CASES_PER_REGION.items():
        lo, hi = regions[region]
        for i in range(count):
            p = tmp_path / f"{region}-{i:03d}.b2nd"
            p.write_bytes(_mutate(data, lo, hi, rng))
            paths.append(p)
    # every single-bit flip of the first 48 bytes (header and block-offset table) of the
    # metadata chunk and of the offsets index: the fields libblosc2 trusts
    for region in ("vlmeta", "index"):
        lo = regions[region][0]
        for bit in range(48 * 8):
            b = bytearray(data)
            b[lo + bit // 8] ^= 1 << (bit % 8)
            p = tmp_path / f"{region}-bit{bit:03d}.b2nd"
            p.write_bytes(bytes(b))
            paths.append(p)
    for i, cut in enumerate((1, 23, 64, len(data) // 2, len(data) - 1)):  # truncations
        p = tmp_path / f"trunc-{i}.b2nd"
        p.write_bytes(data[:cut])
        paths.append(p)
    results, crashed, hung = _run_cases([original, *paths])
    assert not crashed, f"the process crashed on {crashed}"
    assert not hung, f"the process hung on {hung}"
    want = results[str(original)]
    assert "meta" in want and want["problems"] == [], want
    unexpected = {p: r["unexpected"] for p, r in results.items() if "unexpected" in r}
    assert not unexpected, f"errors that are not CarrayStoreError: {unexpected}"
    lied = [p for p, r in results.items() if "meta" in r and r["meta"] != want["meta"]]
    assert not lied, f"opened with different metadata (keys/labels/...): {lied}"
    bad_pixels = [p for p, r in results.items() if "pixels" in r and r["pixels"] != want["pixels"]]
    assert not bad_pixels, f"verified clean but read different pixels: {bad_pixels}"
    assert len(results) == 1 + len(paths)
    refused = sum("error" in r for r in results.values())
    damaged = sum(bool(r.get("problems")) for r in results.values())
    assert refused > 100 and damaged > 10, (refused, damaged)  # the mutations really hit something


@pytest.mark.parametrize("name", ["array_records", "black_frames"])
def test_mutated_golden_stores_never_crash_or_hang(tmp_path: Path, name: str) -> None:
    """0.1.0 stores carry no metadata checksum, so only "no crash, no hang, only named errors"
    can hold for them; a structured dtype and a special chunk widen what the parser meets."""
    original = tmp_path / "orig.b2nd"
    original.write_bytes((GOLDEN / f"{name}.b2nd").read_bytes())
    data = original.read_bytes()
    regions = _regions(original)
    rng = np.random.default_rng(SEED + len(name))
    paths = []
    for region, (lo, hi) in regions.items():
        for i in range(40):
            p = tmp_path / f"{region}-{i:03d}.b2nd"
            p.write_bytes(_mutate(data, lo, hi, rng))
            paths.append(p)
    results, crashed, hung = _run_cases(paths)
    assert not crashed and not hung, (crashed, hung)
    unexpected = {p: r["unexpected"] for p, r in results.items() if "unexpected" in r}
    assert not unexpected, f"errors that are not CarrayStoreError: {unexpected}"
    assert len(results) == len(paths)


# -- header sizes and counts, with peak memory ------------------------------
# Opens the file and prints the error and the peak memory the open and verify took (KiB;
# tracemalloc sees numpy's and Python's buffers, where every read and decompressed byte lands).
_PEAK = r"""
import json, sys, tracemalloc
import carraystore
tracemalloc.start()
try:
    with carraystore.open(sys.argv[1]) as s:
        s.verify()
    err = None
except carraystore.CarrayStoreError as exc:
    err = type(exc).__name__ + ": " + str(exc)[:300]
print(json.dumps({"error": err, "grew_kib": tracemalloc.get_traced_memory()[1] // 1024}))
"""


def _peak(path: Path) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-c", _PEAK, str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _with_record(raw: bytes, content: bytes) -> bytes:
    """The frame ``raw`` with its trailer rebuilt to hold ``content`` as the carraystore vlmeta chunk."""
    import msgpack

    f = read_frame(_BytesSource(raw))
    tail_at = f.header_len + f.cbytes
    trailer_len = int.from_bytes(raw[-22:-18], "big")
    index = raw[tail_at : len(raw) - trailer_len]
    body = b"\x94" + msgpack.packb(1) + msgpack.packb([0, {"carraystore": 0}, [content]], use_bin_type=True)
    n = len(body) + 23
    trailer = body + b"\xce" + n.to_bytes(4, "big") + b"\xd8\x00" + bytes(16)
    out = bytearray(raw[:tail_at] + index + trailer)
    out[16:24] = len(out).to_bytes(8, "big")
    return bytes(out)


class _BytesSource:
    def __init__(self, raw: bytes) -> None:
        self.raw, self.location = raw, "<bytes>"

    def size(self) -> int:
        return len(self.raw)

    def read(self, offset: int, length: int) -> bytes:
        return self.raw[offset : offset + length]


def test_header_sizes_are_bounded_before_they_are_trusted(tmp_path: Path) -> None:
    """A first dimension of 2**40 raised the metadata cap so that a 1 GiB record was decompressed
    (the issue: 1,565 MB peak for a 188 KB file); a compressed size of 0 read the whole file; a
    huge chunk count was trusted. Each is now refused with a named error, in bounded memory."""
    from carraystore.format.frame import shape0_position

    path = tmp_path / "s.b2nd"
    rng = np.random.default_rng(SEED)
    with carraystore.create(path, (64, 64, 3), chunk_images=16, codec="fast") as w:
        w.append(rng.integers(0, 256, (512, 64, 64, 3), dtype=np.uint8))  # ~6 MB of noise
    raw = path.read_bytes()
    h = int.from_bytes(raw[11:15], "big")
    sound = _peak(path)
    assert sound["error"] is None, sound

    # 1. the first dimension 2**40, and a record chunk that decompresses to 1 GiB (a special
    #    zero chunk: 32 bytes)
    zeros = bytes.fromhex("0501050100000040000001002000000000000000000000000000000000000010")  # blosc2's own
    big = bytearray(_with_record(raw, zeros))
    at = shape0_position(bytes(big[:h]), 512, "s")
    big[at : at + 8] = (2**40).to_bytes(8, "big")
    (tmp_path / "big.b2nd").write_bytes(big)
    # 2. a compressed size of 0: the "offsets index" would be the whole data region
    zero = bytearray(raw)
    zero[39:47] = (0).to_bytes(8, "big")
    (tmp_path / "zero.b2nd").write_bytes(zero)
    # 3. uncompressed size 2**62 with chunk size 1: 2**62 chunks
    many = bytearray(raw)
    many[30:38] = (2**62).to_bytes(8, "big")
    many[58:62] = (1).to_bytes(4, "big")
    (tmp_path / "many.b2nd").write_bytes(many)
    for name in ("big", "zero", "many"):
        got = _peak(tmp_path / f"{name}.b2nd")
        assert str(got["error"]).startswith(("CorruptStoreError", "MetadataTooLargeError")), (name, got)
        assert got["grew_kib"] < 3 * 1024, (name, got)  # the bugs: 1 GiB, the whole file (6 MB)


# -- the encoded layout (FORMAT.md 10) -----------------------------------------------------------


@pytest.mark.parametrize("name", ["jpeg_rgb", "mixed_rgb"])
def test_mutated_encoded_stores_never_crash_or_hang(tmp_path: Path, name: str) -> None:
    """Encoded golden stores, mutated in every region: named errors or the original record, never a crash."""
    original = tmp_path / "orig.b2nd"
    original.write_bytes((GOLDEN.parent / "carraystore-0.1.0+encoded" / f"{name}.b2nd").read_bytes())
    data = original.read_bytes()
    rng = np.random.default_rng(SEED + 2 * len(name))
    paths = []
    for region, (lo, hi) in _regions(original).items():
        for i in range(25):
            p = tmp_path / f"{region}-{i:03d}.b2nd"
            p.write_bytes(_mutate(data, lo, hi, rng))
            paths.append(p)
    results, crashed, hung = _run_cases(paths)
    assert not crashed and not hung, (crashed, hung)
    unexpected = {p: r["unexpected"] for p, r in results.items() if "unexpected" in r}
    assert not unexpected, f"errors that are not CarrayStoreError: {unexpected}"
    assert len(results) == len(paths)


def test_mutated_entries_behind_valid_checksums_give_named_errors(tmp_path: Path) -> None:
    """Entries damaged before they were written (so every CRC matches): the decoder itself meets the
    damage. Each store must read, or fail with a named error (EncodedImageError), never crash or hang."""
    src = carraystore.open(GOLDEN.parent / "carraystore-0.1.0+encoded" / "mixed_rgb.b2nd")
    entries = [src.entry(i) for i in range(len(src))]
    rng = np.random.default_rng(SEED + 7)
    paths = []
    for i in range(60):
        j = int(rng.integers(0, 3))  # the JPEG, PNG or WebP entry
        e = entries[j]
        bad = _mutate(e, 0, len(e), rng) if i % 3 else e[: int(rng.integers(4, len(e)))]  # bytes, or a truncation
        p = tmp_path / f"entry-{i:03d}.b2nd"
        with carraystore.create(p, src.image_shape, layout="encoded", chunk_images=3) as w:
            w._encoding = src.meta.encoding
            try:
                w.append_entries([*entries[:j], bad, *entries[j + 1 :]])
            except carraystore.base.errors.InvalidInputError:  # the magic bytes were hit: refused at write
                w.abort()
                continue
        paths.append(p)
    results, crashed, hung = _run_cases(paths)
    assert not crashed and not hung, (crashed, hung)
    unexpected = {p: r["unexpected"] for p, r in results.items() if "unexpected" in r}
    assert not unexpected, f"errors that are not CarrayStoreError: {unexpected}"
    damaged = [r for r in results.values() if r.get("problems")]
    assert len(paths) > 30 and len(damaged) > 10, (len(paths), len(damaged))
    assert all("EncodedImageError" in " ".join(r["problems"]) or "image" in " ".join(r["problems"]) for r in damaged)

"""Frame-header damage: `verify` must catch every header flip that breaks plain
blosc2 or a writer, and writers must refuse a damaged header with a named error.

Every bit of a small store's frame header (the bytes before its first chunk, 273 of them:
2184 flips) is flipped in turn, in-process (no subprocess; the damaged file is rewritten in
one place for each case): about 10 s. For each, either `verify` reports a problem (open
refuses the file, or `Store.verify()` lists one), or plain `blosc2.open()` reads the file
AND `append` of a few items and `update_metadata(attrs=...)` (each on a fresh copy of the
damaged bytes) work or raise a named CarrayStoreError other than a WriteError (the disk is
fine: "could not write ... check the folder" would send the user the wrong way).
"""

from __future__ import annotations

import glob
from pathlib import Path

import blosc2
import numpy as np
import pytest

import carraystore
from carraystore.base.errors import CarrayStoreError, CorruptStoreError, WriteError
from carraystore.cli import main as cli
from carraystore.store.checks import header_problems

SHAPE = (4, 4, 3)
GOLDEN = Path(__file__).parents[1] / "data" / "golden"


def _make(path: Path) -> bytes:
    n = 10
    with carraystore.create(path, SHAPE, chunk_images=4, class_names=["a", "b"]) as w:
        w.append(
            (np.arange(n * 48, dtype=np.uint8).reshape(n, *SHAPE) % 7),
            labels=np.arange(n) % 2,
            keys=[f"k/{i}.png" for i in range(n)],
        )
    return path.read_bytes()


def _verify_problem(path: Path) -> bool:
    """What `carraystore verify` decides: True when it reports a problem (exit 1)."""
    try:
        with carraystore.open(path) as store:
            return bool(store.verify())
    except CarrayStoreError:
        return True


def _writer_outcome(path: Path, damaged: bytes, what: str) -> str | None:
    """None when the write works or raises a fitting named error, else what went wrong."""
    path.write_bytes(damaged)
    try:
        if what == "append":
            with carraystore.append(path) as w:
                w.append(np.ones((3, *SHAPE), np.uint8), labels=[0, 1, 0], keys=["n/1", "n/2", "n/3"])
        else:
            carraystore.update_metadata(path, attrs={"a": 1})
    except WriteError as exc:
        return f"{what}: misleading WriteError {exc}"
    except CarrayStoreError:
        return None
    except Exception as exc:  # a raw traceback
        return f"{what}: {type(exc).__name__}: {exc}"
    return None


def test_every_header_bit_flip_is_caught_or_harmless(tmp_path: Path) -> None:
    data = _make(tmp_path / "src.b2nd")
    with carraystore.open(tmp_path / "src.b2nd") as store:
        first = min(int(store.chunk_byte_range(i)[0]) for i in range(store.nchunks) if store.chunk_byte_range(i)[1])
        assert store.verify() == []
    assert first == int.from_bytes(data[11:15], "big") > 200  # the header is everything before chunk 0
    x, w = tmp_path / "x.b2nd", tmp_path / "w.b2nd"
    failures: list[str] = []
    caught = 0
    buf = bytearray(data)
    for byte in range(first):
        for bit in range(8):
            buf[byte] ^= 1 << bit
            damaged = bytes(buf)
            buf[byte] ^= 1 << bit
            x.write_bytes(damaged)
            try:
                if _verify_problem(x):
                    caught += 1
                    continue
            except Exception as exc:
                failures.append(f"byte {byte} bit {bit}: verify raised {type(exc).__name__}: {exc}")
                continue
            try:
                array = blosc2.open(str(x), mode="r")
                array[...]
                del array
            except Exception as exc:
                failures.append(f"byte {byte} bit {bit}: verify passes, plain blosc2 fails ({exc})")
                continue
            for what in ("append", "meta"):
                bad = _writer_outcome(w, damaged, what)
                if bad:
                    failures.append(f"byte {byte} bit {bit}: verify passes, {bad}")
    assert not failures, f"{len(failures)} of {8 * first} flips:\n" + "\n".join(failures[:30])
    # the header is checked as a whole: only the thread counts (62-67) may change freely
    assert caught >= 8 * first - 8 * 4


def test_a_damaged_header_is_named_by_verify_and_refused_by_meta_and_append(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's example: flip the b2nd dtype-format byte (211 of a created store); `meta`
    ended in a raw ValueError, `append` too, and `verify` said OK."""
    path = tmp_path / "x.b2nd"
    data = bytearray(_make(path))
    at = data.index(b"\xdb\x00\x00\x00\x03|u1") - 1  # the byte before the dtype text: 0 = numpy
    data[at] ^= 1
    path.write_bytes(data)
    assert cli.main(["verify", "-q", str(path)]) == 1
    assert "frame header: " in capsys.readouterr().out
    assert cli.main(["meta", str(path), "--attr", "a=1"]) == 2
    err = capsys.readouterr().err
    assert "frame header is damaged" in err and "carraystore verify" in err and "restore" in err
    with pytest.raises(CorruptStoreError, match="frame header is damaged"):
        carraystore.append(path)
    assert path.read_bytes() == bytes(data)  # nothing written


@pytest.mark.parametrize("path", sorted(glob.glob(str(GOLDEN / "**" / "*.b2nd"), recursive=True)))
def test_golden_headers_are_sound(path: str) -> None:
    with carraystore.open(path) as store:
        assert header_problems(store._frame, store.meta) == []

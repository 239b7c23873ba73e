"""Blosc1 chunk decoding: the pre-1.11 split-flag fix, the pure snappy path, damaged chunks."""

from __future__ import annotations

import shutil
from pathlib import Path

import blosc2
import numpy as np
import pytest
from helpers import hide_module

from carraystore.base.errors import MigrationError, MissingDependencyError
from carraystore.migrations import blosc1, migrate

LOCAL = Path(__file__).resolve().parents[1] / "data" / "bcolz"
nblosc = pytest.importorskip(
    "numcodecs.blosc", reason="numcodecs (c-blosc 1.x) writes the real Blosc1 chunks these tests decode"
)
cramjam = pytest.importorskip("cramjam")


def _chunk(path: Path) -> bytes:
    return path.read_bytes()[16:]


def _photo_bytes(n: int) -> np.ndarray:
    from carraystore.ingest.sample_data import load_photo

    return np.ascontiguousarray(load_photo("coffee")).reshape(-1)[:n]


@pytest.mark.parametrize("dtype", ["u1", "<i2", "<f4", "<f8", "S3", "S24", "S300"])
@pytest.mark.parametrize("shuffle", [0, 1, 2])
def test_pure_stream_decoder_matches_blosc2_on_cblosc1_chunks(dtype: str, shuffle: int) -> None:
    """The Python block/stream decoder (used for snappy) gives what blosc2 gives, on real
    c-blosc 1.x chunks: every typesize, shuffle mode, leftover block and element count."""
    dt = np.dtype(dtype)
    checked = 0
    for n in (7, 8, 1003, 20000):
        # photo values: compressible after a shuffle, as pixels are
        a = _photo_bytes(n * dt.itemsize).view(dt) if dt.kind == "S" else _photo_bytes(n).astype(dt)
        for blocksize in (0, 256, 1000, 4096):
            c = bytes(nblosc.compress(a, b"lz4", 5, shuffle, blocksize))
            h = blosc1.parse_header(c)
            want = blosc2.decompress(blosc1.fix_split_flag(c))
            assert want == a.tobytes()
            if h.memcpyed:
                continue
            out = np.empty(h.nbytes, dtype=np.uint8)
            blosc1._decompress_streams(
                c, h, out, "test", lambda data, k: cramjam.lz4.decompress_block(data, output_len=k)
            )
            assert out.tobytes() == want
            assert blosc1.decompress(c) == want
            checked += 1
    assert checked  # photo bytes compress: the pure path really ran


def test_pre_111_chunks_need_the_split_flag_fix() -> None:
    """bcolz 0.10.0 (c-blosc 1.4) chunks that were not split lack the flag; blosc2 fails on
    them as written, and decodes them exactly once the flag is set."""
    case = LOCAL / "py27-bcolz-0.10.0" / "ctable" / "id"
    want = np.load(LOCAL / "py27-bcolz-0.10.0" / "expected" / "ctable.npy")["id"]
    raw = _chunk(case / "data" / "__0.blp")
    h = blosc1.parse_header(raw)
    assert not h.flags & 0x10 and h.blocksize // h.typesize < 128  # the old rule: not split
    try:
        wrong = blosc2.decompress(raw)
    except Exception:
        wrong = None
    assert wrong != want[:100].tobytes()
    fixed = blosc1.fix_split_flag(raw)
    assert fixed[2] == h.flags | 0x10 and fixed[3:] == raw[3 : h.cbytes]
    assert blosc2.decompress(fixed) == want[:100].tobytes()
    assert blosc1.decompress(raw) == want[:100].tobytes()


def test_split_flag_fix_leaves_split_and_flagged_chunks_alone() -> None:
    c = bytes(nblosc.compress(_photo_bytes(40000).view("<f4"), b"blosclz", 5, 1))
    assert blosc1.fix_split_flag(c) == c[: blosc1.parse_header(c).cbytes]


def test_snappy_chunks_decode_with_cramjam() -> None:
    case = LOCAL / "py27-bcolz-1.2.1" / "codec_snappy_sh2"
    want = np.load(LOCAL / "py27-bcolz-1.2.1" / "expected" / "codec_snappy_sh2.npy")
    got = b"".join(blosc1.decompress(_chunk(case / "data" / f"__{i}.blp")) for i in range(8))
    assert got == want.tobytes()
    h = blosc1.parse_header(_chunk(case / "data" / "__2.blp"))
    assert h.codec == "snappy" and h.shuffle == "bitshuffle" and not h.memcpyed
    with pytest.raises(RuntimeError):
        blosc2.decompress(_chunk(case / "data" / "__2.blp"))  # c-blosc2 has no snappy


def test_snappy_without_cramjam_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    hide_module(monkeypatch, "cramjam")
    src = tmp_path / "snappy.bc"
    shutil.copytree(LOCAL / "py27-bcolz-0.10.0" / "codec_snappy_sh1", src)
    out = tmp_path / "out.b2nd"
    with pytest.raises(MissingDependencyError, match=r"pip install 'carraystore\[migrate\]'") as info:
        migrate(src, out, progress=False)
    assert "snappy" in str(info.value)
    assert not out.exists() and not list(tmp_path.glob(".*"))


def test_damaged_chunks_raise_naming_the_file(tmp_path: Path) -> None:
    raw = _chunk(LOCAL / "py3-bcolz-zipline-1.13" / "nd_4d" / "data" / "__0.blp")
    with pytest.raises(MigrationError, match="chunk-x"):
        blosc1.parse_header(raw[:10], "chunk-x")
    with pytest.raises(MigrationError, match="truncated"):
        blosc1.decompress(raw[:100], "chunk-y")
    bad = bytearray(raw)
    bad[16:20] = (10**6).to_bytes(4, "little")  # the first block starts far outside the chunk
    with pytest.raises(MigrationError, match="chunk-z"):
        blosc1.decompress(bytes(bad), "chunk-z")

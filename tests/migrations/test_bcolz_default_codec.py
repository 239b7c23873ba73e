"""A bcolz migration without a codec keeps the carray's own codec and level (its shuffle on the source's item
size), so the store reads no slower than the carray did; ``codec=``/``--preset`` still choose."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import carraystore
from carraystore.cli.main import main
from carraystore.format.codec import PRESETS
from carraystore.migrations import migrate
from carraystore.migrations.bcolz import default_codec_for
from testsupport.bcolz_writer import write_carray

pytest.importorskip("numcodecs", reason="write_carray uses numcodecs' c-blosc 1.x")


def test_lz4_photos_keep_lz4_at_their_level_without_the_identity_shuffle(photo_arrays, tmp_path: Path) -> None:
    x, y, _ = photo_arrays
    write_carray(tmp_path / "x.bc", x, chunklen=32, cname="lz4", clevel=5, shuffle=1)
    write_carray(tmp_path / "y.bc", y, chunklen=4096, cname="lz4", clevel=5, shuffle=1)
    report = migrate(None, tmp_path / "s.b2nd", images=tmp_path / "x.bc", labels=tmp_path / "y.bc")
    with carraystore.open(tmp_path / "s.b2nd") as s:
        # bcolz shuffled 1-byte items (the identity): the store's lz4-5 runs without a filter, not balanced's zstd
        assert (s.codec.codec, s.codec.clevel, s.codec.filters) == ("lz4", 5, ())
        assert np.array_equal(s[:], x) and np.array_equal(s.labels, y)
        stored = (tmp_path / "s.b2nd").stat().st_size
    # the same codec on the same bytes: no more to read than the carray held (its chunks, headers aside)
    carray = sum(p.stat().st_size for p in (tmp_path / "x.bc" / "data").iterdir())
    assert stored <= 1.05 * carray, (stored, carray)
    assert "lz4-5 shuffle -> lz4-5" in report.summary()


def test_wider_items_keep_their_shuffle_and_zlib_becomes_balanced(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = np.cumsum(rng.normal(size=(64, 16, 16, 1)), axis=1).astype(np.float32)
    write_carray(tmp_path / "f.bc", x, chunklen=16, cname="zstd", clevel=3, shuffle=1)
    migrate(tmp_path / "f.bc", tmp_path / "f.b2nd")
    with carraystore.open(tmp_path / "f.b2nd") as s:
        assert (s.codec.codec, s.codec.clevel, s.codec.filters, s.codec.typesize) == ("zstd", 3, ("shuffle",), 4)
        assert np.array_equal(s[:], x)
    write_carray(tmp_path / "z.bc", x, chunklen=16, cname="zlib", clevel=5, shuffle=1)
    migrate(tmp_path / "z.bc", tmp_path / "z.b2nd")
    with carraystore.open(tmp_path / "z.b2nd") as s:
        want = PRESETS["balanced"].resolve(np.dtype(np.float32), (16, 16, 1))
        assert (s.codec.codec, s.codec.clevel, s.codec.filters) == (want.codec, want.clevel, want.filters)
    # the rule on cparams bcolz wrote: no cname (bcolz < 0.7.1: blosclz), bit shuffle, snappy, nonsense
    assert default_codec_for({"clevel": 9, "shuffle": 2}, 2) == carraystore.Codec(
        "blosclz", 9, filters=("bitshuffle",), typesize=2
    )
    assert default_codec_for({"cname": "snappy", "clevel": 1, "shuffle": 0}).codec == "lz4"
    assert default_codec_for({"cname": "lz4", "clevel": "x"}).clevel == 5
    assert default_codec_for({"cname": "brotli", "clevel": 5}) == PRESETS["balanced"]


def test_a_preset_still_overrides_the_default(photo_arrays, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x, _, _ = photo_arrays
    write_carray(tmp_path / "x.bc", x[:40], chunklen=32, cname="lz4", clevel=5, shuffle=1)
    assert main(["migrate", str(tmp_path / "x.bc"), str(tmp_path / "b.b2nd"), "--preset", "balanced", "-q"]) == 0
    with carraystore.open(tmp_path / "b.b2nd") as s:
        assert (s.codec.codec, s.codec.filters) == ("zstd", ("shuffle", "bytedelta"))
    migrate(tmp_path / "x.bc", tmp_path / "f.b2nd", codec="fast")
    with carraystore.open(tmp_path / "f.b2nd") as s:
        assert (s.codec.codec, s.codec.clevel) == ("lz4", 1)

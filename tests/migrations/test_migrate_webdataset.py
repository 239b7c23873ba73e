"""WebDataset tar shards (written by ``webdataset.ShardWriter``, real photo JPEGs) into stores, and hostile shards."""

from __future__ import annotations

import gzip
import io
import json
import shutil
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from helpers import image_bytes, pillow_pixels

import carraystore
from carraystore.base.errors import ImageDecodeError, InvalidInputError, MigrationError
from carraystore.cli.main import main
from carraystore.migrations import migrate
from carraystore.migrations.samples import (
    SourceFormatError,
    SourceImageError,
    TruncatedSourceError,
    brace_expand,
)
from carraystore.migrations.webdataset import split_member_name

N = 10


@pytest.fixture(scope="module")
def samples(photo_patches) -> list[dict]:
    """What the shards hold: real photo JPEGs (32x32), a class, JSON, a caption, an array and a second image."""
    photos = photo_patches(N, size=(32, 32), seed=3)
    out = []
    for i, img in enumerate(photos):
        out.append(
            {
                "__key__": f"clips/v{i // 4}/f{i:03d}",
                "jpg": image_bytes(img, "JPEG", quality=90),
                "cls": i % 3,
                "json": {"score": i / 10, "tag": "t" * (i + 1), "video": f"v{i // 4}", "nested": {"a": i}},
                "txt": f"caption {i}",
                "npy": np.arange(4, dtype=np.float32) + i,
                "seg.png": image_bytes(img[..., 0], "PNG"),
            }
        )
    return out


def _write(folder: Path, samples: list[dict], maxcount: int = 4) -> list[Path]:
    """Shards written by WebDataset's own ShardWriter (imported here: it imports torch)."""
    wds = pytest.importorskip("webdataset")
    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "shard-%06d.tar"), maxcount=maxcount, verbose=0) as w:
        for s in samples:
            w.write(dict(s))
    return sorted(folder.glob("shard-*.tar"))


@pytest.fixture(scope="module")
def shards(samples, tmp_path_factory) -> list[Path]:
    return _write(tmp_path_factory.mktemp("wds"), samples)


def _check_every_sample(store: carraystore.Store, samples: list[dict]) -> None:
    assert len(store) == len(samples)
    for i, s in enumerate(samples):
        assert np.array_equal(store[i], pillow_pixels(s["jpg"])), i
    assert list(store.keys) == [s["__key__"] for s in samples]
    assert list(store.labels) == [s["cls"] for s in samples]
    cols = store.columns
    assert np.array_equal(cols["json.score"], [s["json"]["score"] for s in samples])
    assert list(cols["json.tag"]) == [s["json"]["tag"] for s in samples]
    assert list(cols["txt"]) == [s["txt"] for s in samples]
    assert np.array_equal(cols["npy"], np.stack([s["npy"] for s in samples])) and cols["npy"].dtype == np.float32


def test_shards_migrate_every_sample_from_a_pattern_a_list_and_a_folder(shards, samples, tmp_path: Path) -> None:
    assert len(shards) == 3
    pattern = str(shards[0].parent / "shard-{000000..000002}.tar")
    report = migrate(pattern, tmp_path / "p.b2nd", progress=False)
    s = carraystore.open(tmp_path / "p.b2nd")
    _check_every_sample(s, samples)
    assert report.verified and report.rows == N and report.kind == "WebDataset shards"
    assert report.fields == {
        "json.score": "float64",
        "json.tag": "<U10",
        "json.video": "<U2",
        "txt": "<U9",
        "npy": "float32[4]",
    }
    notes = "\n".join(report.notes)
    assert "images from member 'jpg' (JPEG 10)" in notes and "labels from member 'cls'" in notes
    assert "not migrated: member 'json.nested' (a nested mapping" in notes
    assert "not migrated: member 'seg.png' (a second image" in notes
    assert s.provenance["migrated_from"]["webdataset"]["shards"] == 3
    for src in ([str(p) for p in shards], shards[0].parent):  # the same store from a list and from the folder
        migrate(src, tmp_path / "o.b2nd", progress=False, overwrite=True)
        _check_every_sample(carraystore.open(tmp_path / "o.b2nd"), samples)


def test_encoded_layout_keeps_each_jpeg_byte_for_byte(shards, samples, tmp_path: Path) -> None:
    report = migrate(shards[0].parent, tmp_path / "e.b2nd", layout="encoded", progress=False)
    s = carraystore.open(tmp_path / "e.b2nd")
    assert s.layout == "encoded"
    _check_every_sample(s, samples)
    assert [s.entry(i) for i in range(N)] == [x["jpg"] for x in samples]
    assert any(f"layout encoded: {N} of {N} images kept as their source bytes (JPEG {N})" in n for n in report.notes)
    # resized: the bytes no longer decode to the store's pixels, so PNGs of those pixels are stored instead
    report = migrate(shards[0].parent, tmp_path / "r.b2nd", layout="encoded", image_size=(24, 24), progress=False)
    r = carraystore.open(tmp_path / "r.b2nd")
    assert r.item_shape == (24, 24, 3) and not any(r.entry(i) == samples[i]["jpg"] for i in range(N))
    assert any(f"0 of {N} images kept" in n and "decodes to other pixels" in n for n in report.notes)


def test_named_members_groups_and_the_cli(shards, samples, tmp_path: Path, capsys) -> None:
    out = tmp_path / "g.b2nd"
    argv = ["migrate", *map(str, shards), str(out), "--images", "seg.png", "--groups", "json.video", "--no-labels"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "migrated WebDataset shards" in printed and "note:    groups from member 'json.video': 3 groups" in printed
    s = carraystore.open(out)
    assert s.item_shape == (32, 32, 1) and s.labels is None  # the grayscale PNG: one channel, inferred
    for i, x in enumerate(samples):
        assert np.array_equal(s[i], pillow_pixels(x["seg.png"], "L")), i
    assert [s.group_names[g] for g in s.groups] == [x["json"]["video"] for x in samples]
    assert "json.video" not in s.columns and "cls" in s.columns  # the group is not also a field
    assert main([*argv[:-1], "--labels", "cls", "--color-mode", "rgb", "--overwrite", "-q"]) == 0
    s = carraystore.open(out)
    assert s.item_shape == (32, 32, 3) and list(s.labels) == [x["cls"] for x in samples]


def test_shards_at_urls_through_the_http_byte_source(shards, samples, http_server, tmp_path: Path) -> None:
    pytest.importorskip("obstore")
    for p in shards:
        shutil.copy(p, http_server.root / p.name)
    report = migrate(f"{http_server.url}/shard-{{000000..000002}}.tar", tmp_path / "u.b2nd", progress=False)
    _check_every_sample(carraystore.open(tmp_path / "u.b2nd"), samples)
    assert report.source.startswith("http://")


def test_compressed_shards(samples, tmp_path: Path) -> None:
    plain = _write(tmp_path / "plain", samples[:5], maxcount=10)[0]
    gz = tmp_path / "gz" / "s.tar.gz"
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    report = migrate(gz, tmp_path / "z.b2nd", progress=False)
    _check_every_sample(carraystore.open(tmp_path / "z.b2nd"), samples[:5])
    assert report.codec_before == "tar (gzip)"


def test_brace_patterns() -> None:
    assert brace_expand("s-{000..002}.tar") == ["s-000.tar", "s-001.tar", "s-002.tar"]
    assert brace_expand("{a,b}/x-{8..10}.tar") == [
        "a/x-8.tar",
        "a/x-9.tar",
        "a/x-10.tar",
        "b/x-8.tar",
        "b/x-9.tar",
        "b/x-10.tar",
    ]
    with pytest.raises(InvalidInputError, match="backwards"):
        brace_expand("s-{9..1}.tar")
    with pytest.raises(InvalidInputError, match="nested"):
        brace_expand("s-{{1..2}}.tar")
    assert split_member_name("a/b.c/k.seg.png") == ("a/b.c/k", "seg.png")
    assert split_member_name("noext") == (None, None)


# -- hostile shards --------------------------------------------------------------------------------


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _bomb_png(w: int = 30000, h: int = 30000) -> bytes:
    """A PNG whose header claims w x h pixels (far beyond Pillow's MAX_IMAGE_PIXELS), with no pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


@pytest.fixture
def good(samples) -> list[tuple[str, bytes]]:
    return [
        (f"k{i}.{ext}", data) for i, s in enumerate(samples[:4]) for ext, data in (("jpg", s["jpg"]), ("cls", b"1"))
    ]


def _migrate_bytes(tmp_path: Path, data: bytes, name: str = "bad.tar") -> None:
    (tmp_path / name).write_bytes(data)
    migrate(tmp_path / name, tmp_path / "o.b2nd", progress=False)


def test_truncated_shards_are_named(good, tmp_path: Path) -> None:
    whole = _tar(good)
    with pytest.raises(TruncatedSourceError, match="truncated"):  # cut inside a member's data
        _migrate_bytes(tmp_path, whole[:1500])
    ends = [512 * k for k in range(1, len(whole) // 512) if whole[512 * k + 257 : 512 * k + 262] == b"ustar"]
    with pytest.raises(TruncatedSourceError, match="end-of-archive"):  # cut between members: tarfile ends silently
        _migrate_bytes(tmp_path, whole[: ends[-1]])
    broken = bytearray(whole)
    broken[ends[-1] : ends[-1] + 100] = b"\x07" * 100  # a damaged header mid-archive
    with pytest.raises(SourceFormatError, match="damaged"):
        _migrate_bytes(tmp_path, bytes(broken))
    with pytest.raises(TruncatedSourceError):  # a compressed shard cut short
        _migrate_bytes(tmp_path, gzip.compress(whole)[:-40], "bad.tar.gz")
    assert not (tmp_path / "o.b2nd").exists()


def test_a_member_claiming_a_huge_size_is_refused_unread(good, tmp_path: Path) -> None:
    whole = bytearray(_tar(good))
    whole[124:136] = b"%011o\0" % (1 << 32)  # the first member's size field: 4 GiB
    whole[148:156] = b"        "
    whole[148:156] = b"%06o\0 " % sum(whole[:512])
    with pytest.raises(SourceFormatError, match="more than the"):
        _migrate_bytes(tmp_path, bytes(whole))


def test_members_that_are_not_images_and_bombs(good, samples, tmp_path: Path) -> None:
    with pytest.raises(SourceImageError, match=r"not an image") as err:
        _migrate_bytes(tmp_path, _tar([*good, ("k9.jpg", b"<html>not a photo</html>")]))
    assert isinstance(err.value, ImageDecodeError) and isinstance(err.value, MigrationError)
    with pytest.raises(SourceImageError, match="decompression bomb"):
        _migrate_bytes(tmp_path, _tar([*good, ("k9.png", _bomb_png())]))  # a .png where the others have .jpg
    with pytest.raises(SourceImageError, match="no member holds an image"):
        _migrate_bytes(tmp_path, _tar([("a.txt", b"x"), ("a.cls", b"1")]))
    with pytest.raises(SourceFormatError, match="two members of type 'jpg'"):
        _migrate_bytes(tmp_path, _tar([*good, ("k3.jpg", samples[0]["jpg"])]))  # k3 again, after k3.cls
    with pytest.raises(MigrationError, match=r"key '\.\./evil'"):
        _migrate_bytes(tmp_path, _tar([("../evil.jpg", samples[0]["jpg"])]))


def test_images_of_different_sizes(good, photo_patches, tmp_path: Path) -> None:
    other = image_bytes(photo_patches(1, size=(24, 40))[0], "JPEG")
    data = _tar([*good, ("k9.jpg", other), ("k9.cls", b"2")])
    with pytest.raises(MigrationError, match=r"40x24 pixels.*--image-size H W"):
        _migrate_bytes(tmp_path, data)
    report = migrate(tmp_path / "bad.tar", tmp_path / "r.b2nd", image_size=(16, 16), progress=False)
    s = carraystore.open(tmp_path / "r.b2nd")
    assert s.item_shape == (16, 16, 3) and len(s) == 5 and any("resized to 16x16" in n for n in report.notes)


def test_unreadable_members_are_left_out_with_the_reason(good, tmp_path: Path) -> None:
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<f8", "fortran_order": False, "shape": (10**12,)})
    extra = []
    for i in range(4):
        extra += [
            (f"k{i}.pyd", b"\x80\x04K\x01."),
            (f"k{i}.xyz", b"?"),
            (f"k{i}.json", json.dumps({"n": i} if i else {"n": "zero"}).encode()),
            (f"k{i}.npy", b"garbage"),
            (f"k{i}.big.npy", head.getvalue() + b"\0" * 64),  # a header claiming 8 TB: never allocated
        ]
    report_path = tmp_path / "w.tar"
    report_path.write_bytes(_tar(sorted([*good, *extra], key=lambda m: m[0].split(".")[0])))
    report = migrate(report_path, tmp_path / "o.b2nd", progress=False)
    notes = "\n".join(report.notes)
    assert "'pyd' (pickled; never unpickled" in notes
    assert "'xyz' (a member of type .xyz" in notes
    assert "'json.n' (values of mixed types" in notes
    assert "'npy' (not an .npy" in notes
    assert "'big.npy' (an .npy whose header claims float64[1000000000000]" in notes
    assert report.fields == {} and report.labels


def test_a_png_where_the_other_samples_have_a_jpg(good, photo_patches, tmp_path: Path) -> None:
    png = image_bytes(photo_patches(1, size=(32, 32), seed=8)[0], "PNG")
    (tmp_path / "m.tar").write_bytes(_tar([*good, ("k9.png", png), ("k9.cls", b"0")]))
    report = migrate(tmp_path / "m.tar", tmp_path / "o.b2nd", layout="encoded", progress=False)
    s = carraystore.open(tmp_path / "o.b2nd")
    assert np.array_equal(s[4], pillow_pixels(png)) and s.entry(4) == png and list(s.labels) == [1, 1, 1, 1, 0]
    assert "images from member 'jpg' or 'png' (JPEG 4, PNG 1)" in report.notes
    assert report.fields == {}  # neither image type became a field


def test_class_names_as_text_become_labels(good, tmp_path: Path) -> None:
    members = [(n, b"n02123045" if n == "k1.cls" else b"n01440764") if n.endswith(".cls") else (n, d) for n, d in good]
    (tmp_path / "t.tar").write_bytes(_tar(members))
    report = migrate(tmp_path / "t.tar", tmp_path / "o.b2nd", progress=False)
    s = carraystore.open(tmp_path / "o.b2nd")
    assert s.class_names == ("n01440764", "n02123045") and list(s.labels) == [0, 1, 0, 0]
    assert "labels from member 'cls': 2 class names from its text, sorted: ['n01440764', 'n02123045']" in report.notes


def test_the_encoded_layout_for_array_sources(photo_patches, tmp_path: Path) -> None:
    x = photo_patches(5, size=(16, 16), seed=1)
    np.savez(tmp_path / "d.npz", x=x, y=np.arange(5))
    report = migrate(tmp_path / "d.npz", tmp_path / "e.b2nd", layout="encoded", progress=False)
    s = carraystore.open(tmp_path / "e.b2nd")
    assert s.layout == "encoded" and np.array_equal(s[:], x) and report.verified
    assert any("0 of 5 images kept" in n and "5 encoded from the source's pixels" in n for n in report.notes)
    np.savez(tmp_path / "f.npz", x=x.astype(np.float32))
    with pytest.raises(InvalidInputError, match="--layout encoded holds uint8 images"):
        migrate(tmp_path / "f.npz", tmp_path / "f.b2nd", layout="encoded", progress=False)

"""Writing stores to object storage and copying them, against a real SeaweedFS on loopback.

Covers ``carraystore ingest SRC s3://...``, ``carraystore.create(url)`` / ``append(url)``,
``carraystore migrate OLD s3://...`` and ``carraystore copy``: what appears at the URL is
exactly what a local write produces, it appears only when complete (a killed upload
leaves nothing), local staging files are removed, and a copy checks every chunk.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from functools import partial
from pathlib import Path

import numpy as np
import obstore
import pytest
from helpers import random_images
from obstore.store import S3Store

import carraystore as cs
from carraystore.cli.main import main as cli_main
from carraystore.sources.upload import remote_exists
from testsupport.netproxy import NetProxy

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bucket(seaweedfs) -> str:
    """A fresh key prefix in this module's bucket (``bucket/prefix``).

    One bucket for all the tests: SeaweedFS gives every bucket its own volumes, and the
    test server has room for only a few.
    """
    return f"{seaweedfs.make_bucket('remote-write')}/{uuid.uuid4().hex[:12]}"


def _object_bytes(seaweedfs, url: str) -> bytes:
    bucket, key = url[len("s3://") :].split("/", 1)
    return bytes(obstore.get(seaweedfs.s3_store(bucket), key).bytes())


def _assert_same_store(a: Path, b: Path) -> None:
    """Two stores hold the same items, labels, keys and metadata (compressed bytes may differ:
    blosc2's multi-threaded compression does not promise the same bytes from run to run)."""
    with cs.open(a) as sa, cs.open(b) as sb:
        assert sa.verify() == [] and sb.verify() == []
        ra, rb = sa.meta.to_record(), sb.meta.to_record()
        ra.pop("crc32"), rb.pop("crc32")
        assert ra == rb
        np.testing.assert_array_equal(sa[:], sb[:])


def _download(seaweedfs, url: str, path: Path) -> Path:
    path.write_bytes(_object_bytes(seaweedfs, url))
    return path


def _staging_dirs(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("carraystore-upload-*"))


_images = partial(random_images, shape=(24, 24, 3))


# -- ingest ---------------------------------------------------------------------------------


def test_ingest_cli_to_s3_equals_local_ingest(photo_folder: Path, seaweedfs, bucket: str, tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    stage.mkdir()
    url = f"s3://{bucket}/sets/train.b2nd"
    opts = json.dumps(seaweedfs.storage_options)
    assert (
        cli_main(
            [
                "ingest",
                str(photo_folder),
                url,
                "-q",
                "--workers",
                "1",
                "--storage-options",
                opts,
                "--tmp-dir",
                str(stage),
            ]
        )
        == 0
    )
    local = tmp_path / "train.b2nd"
    assert cli_main(["ingest", str(photo_folder), str(local), "-q", "--workers", "1"]) == 0
    # the object is the store a local ingest writes, and the staging folder is gone
    _assert_same_store(_download(seaweedfs, url, tmp_path / "back.b2nd"), local)
    assert _staging_dirs(stage) == []
    with cs.open(url, storage_options=seaweedfs.storage_options) as remote, cs.open(local) as here:
        assert remote.verify() == []
        np.testing.assert_array_equal(remote[:], here[:])
        np.testing.assert_array_equal(remote.labels, here.labels)
        assert list(remote.keys) == list(here.keys)
    # ingesting again refuses to replace it, unless asked
    assert (
        cli_main(
            [
                "ingest",
                str(photo_folder),
                url,
                "-q",
                "--workers",
                "1",
                "--storage-options",
                opts,
                "--tmp-dir",
                str(stage),
            ]
        )
        == 2
    )
    assert (
        cli_main(["ingest", str(photo_folder), url, "-q", "--workers", "1", "--storage-options", opts, "--overwrite"])
        == 0
    )


def test_ingest_split_dirs_to_an_s3_prefix(photo_folder: Path, seaweedfs, bucket: str, tmp_path: Path) -> None:
    root = tmp_path / "splits"
    for split in ("train", "validation"):
        (root / split).mkdir(parents=True)
        for cls in ("astronaut", "rocket"):
            (root / split / cls).symlink_to(photo_folder / cls)
    res = cs.from_directory(
        root,
        f"s3://{bucket}/ds",
        split_dirs=True,
        follow_links=True,
        workers=1,
        storage_options=seaweedfs.storage_options,
        tmp_dir=tmp_path,
    )
    assert set(res) == {"train", "validation"}
    for split, r in res.items():
        assert r.path == f"s3://{bucket}/ds/{split}.b2nd"
        data = _object_bytes(seaweedfs, r.path)
        assert len(data) == r.cbytes > 0
        local = tmp_path / f"{split}.b2nd"
        local.write_bytes(data)
        with cs.open(local) as store:
            assert len(store) == r.nimages == 24 and store.class_names == ("astronaut", "rocket")
    assert _staging_dirs(tmp_path) == []


# -- create / append --------------------------------------------------------------------------


def test_create_and_append_at_a_url(seaweedfs, bucket: str, tmp_path: Path) -> None:
    url = f"s3://{bucket}/a/store.b2nd"
    x = _images(70)
    y = np.arange(70) % 5
    keys = [f"img/{i:03d}.png" for i in range(70)]
    with cs.create(
        url,
        (24, 24, 3),
        chunk_images=16,
        class_names=list("abcde"),
        storage_options=seaweedfs.storage_options,
        tmp_dir=tmp_path,
    ) as w:
        assert w.path == url
        w.append(x[:30], labels=y[:30], keys=keys[:30])
        assert not remote_exists(url, seaweedfs.storage_options)  # nothing at the URL before close
        w.append(x[30:50], labels=y[30:50], keys=keys[30:50])
    assert w.file_size == len(_object_bytes(seaweedfs, url))
    with cs.append(url, storage_options=seaweedfs.storage_options, tmp_dir=tmp_path) as w:
        w.append(x[50:], labels=y[50:], keys=keys[50:])
    assert _staging_dirs(tmp_path) == []
    local = tmp_path / "back.b2nd"
    local.write_bytes(_object_bytes(seaweedfs, url))
    with cs.open(local) as store:
        assert store.verify() == []
        np.testing.assert_array_equal(store[:], x)
        np.testing.assert_array_equal(store.labels, y)
        assert list(store.keys) == keys and store.class_names == tuple("abcde")


def test_a_large_store_is_uploaded_in_parts(seaweedfs, bucket: str, tmp_path: Path) -> None:
    url = f"s3://{bucket}/large.b2nd"
    x = _images(40, seed=5, shape=(1024, 1024, 1))  # 40 MB of noise: more than two 16 MiB parts
    with cs.create(
        url, (1024, 1024, 1), codec="fast", chunk_images=4, storage_options=seaweedfs.storage_options, tmp_dir=tmp_path
    ) as w:
        w.append(x)
    name, key = url[len("s3://") :].split("/", 1)
    etag = obstore.head(seaweedfs.s3_store(name), key)["e_tag"]
    assert etag.strip('"').endswith("-3")  # a multipart upload's ETag counts its parts
    with cs.open(url, storage_options=seaweedfs.storage_options) as store:
        assert store.verify() == []
        np.testing.assert_array_equal(store[::7], x[::7])
    assert _staging_dirs(tmp_path) == []


def test_create_at_a_url_refusals(seaweedfs, bucket: str, tmp_path: Path) -> None:
    opts = seaweedfs.storage_options
    url = f"s3://{bucket}/x.b2nd"
    with cs.create(url, (8, 8, 1), storage_options=opts, tmp_dir=tmp_path) as w:
        w.append(_images(3, shape=(8, 8, 1)))
    with pytest.raises(cs.StoreExistsError, match=url):
        cs.create(url, (8, 8, 1), storage_options=opts, tmp_dir=tmp_path)
    with pytest.raises(cs.InvalidInputError, match="read-only"):
        cs.create("http://127.0.0.1:9/x.b2nd", (8, 8, 1))
    with pytest.raises(cs.InvalidInputError, match=r"\.b2nd"):
        cs.create(f"s3://{bucket}/x.zarr", (8, 8, 1), storage_options=opts)
    with pytest.raises(FileNotFoundError, match="no such store"):
        cs.append(f"s3://{bucket}/absent.b2nd", storage_options=opts)
    assert _staging_dirs(tmp_path) == []


def test_a_store_that_appears_meanwhile_is_not_replaced(seaweedfs, bucket: str, tmp_path: Path) -> None:
    url = f"s3://{bucket}/raced.b2nd"
    opts = seaweedfs.storage_options
    first = cs.create(url, (8, 8, 1), storage_options=opts, tmp_dir=tmp_path)
    first.append(_images(5, shape=(8, 8, 1)))
    with cs.create(url, (8, 8, 1), storage_options=opts, tmp_dir=tmp_path) as second:  # published first
        second.append(_images(3, shape=(8, 8, 1)))
    with pytest.raises(cs.StoreExistsError, match="appeared while"):
        first.close()
    with cs.open(url, storage_options=opts) as store:
        assert len(store) == 3
    assert _staging_dirs(tmp_path) == []


def test_an_error_while_writing_publishes_nothing(seaweedfs, bucket: str, tmp_path: Path) -> None:
    url = f"s3://{bucket}/broken.b2nd"
    with (
        pytest.raises(cs.InvalidInputError),
        cs.create(url, (8, 8, 3), storage_options=seaweedfs.storage_options, tmp_dir=tmp_path) as w,
    ):
        w.append(_images(20, shape=(8, 8, 3)))
        w.append(_images(2, shape=(9, 9, 3)))  # wrong shape: the writer aborts
    assert not remote_exists(url, seaweedfs.storage_options)
    assert _staging_dirs(tmp_path) == []


def test_killed_upload_leaves_nothing_at_the_url(seaweedfs, bucket: str, tmp_path: Path) -> None:
    """SIGKILL the writing process in the middle of its multipart upload: no object appears."""
    url = f"s3://{bucket}/killed.b2nd"
    with NetProxy("127.0.0.1", seaweedfs.s3_port, bandwidth=40e6 / 8) as link:  # 40 Mbit/s: 48 MB take ~10 s to upload
        opts = {**seaweedfs.storage_options, "endpoint_url": link.url}
        script = textwrap.dedent(f"""
            import numpy as np, carraystore as cs
            x = np.random.default_rng(0).integers(0, 256, (48, 1024, 1024), dtype=np.uint8)
            with cs.create({url!r}, (1024, 1024, 1), codec="fast", chunk_images=4,
                           storage_options={opts!r}, tmp_dir={str(tmp_path)!r}) as w:
                w.append(x)
        """)
        proc = subprocess.Popen(
            [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 120
            while link.stats.bytes_up < 12_000_000:  # a quarter of the parts are on their way
                assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
                assert time.monotonic() < deadline, "the upload did not start"
                time.sleep(0.02)
            staged = _staging_dirs(tmp_path)
            assert len(staged) == 1 and (staged[0] / "killed.b2nd").stat().st_size > 48_000_000
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(30) == -signal.SIGKILL  # killed, not finished
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert not remote_exists(url, seaweedfs.storage_options)
    # the next writer removes the dead process's staging folder, and can write the store
    with cs.create(url, (8, 8, 1), storage_options=seaweedfs.storage_options, tmp_dir=tmp_path) as w:
        w.append(_images(3, shape=(8, 8, 1)))
    assert _staging_dirs(tmp_path) == []
    assert remote_exists(url, seaweedfs.storage_options)


# -- migrate --------------------------------------------------------------------------------


def test_migrate_to_s3(photo_arrays, seaweedfs, bucket: str, tmp_path: Path) -> None:
    x, y, _ = photo_arrays
    np.savez(tmp_path / "old.npz", images=x, labels=y)
    url = f"s3://{bucket}/migrated/train.b2nd"
    opts = json.dumps(seaweedfs.storage_options)
    stage = tmp_path / "stage"
    stage.mkdir()
    assert (
        cli_main(
            [
                "migrate",
                str(tmp_path / "old.npz"),
                url,
                "--images",
                "images",
                "--labels",
                "labels",
                "-q",
                "--storage-options",
                opts,
                "--tmp-dir",
                str(stage),
            ]
        )
        == 0
    )
    assert _staging_dirs(stage) == []
    report = cs.migrate(tmp_path / "old.npz", tmp_path / "local.b2nd", images="images", labels="labels", progress=False)
    assert report.verified
    _assert_same_store(_download(seaweedfs, url, tmp_path / "back.b2nd"), tmp_path / "local.b2nd")


# -- copy -----------------------------------------------------------------------------------


def _store_with_holes(path: Path) -> np.ndarray:
    """A store written in two sessions (an append rewrites its last chunk: the file has a hole)."""
    x = _images(150, seed=3)
    with cs.create(path, (24, 24, 3), chunk_images=16) as w:
        w.append(x[:100], labels=np.arange(100) % 3)
    with cs.append(path) as w:
        w.append(x[100:], labels=np.arange(100, 150) % 3)
    return x


def _corrupt_chunk(src: Path, dst: Path, chunk: int) -> tuple[int, int]:
    with cs.open(src) as store:
        offset, length = store.chunk_byte_range(chunk)
    data = bytearray(src.read_bytes())
    data[offset + length // 2] ^= 0xFF
    dst.write_bytes(bytes(data))
    return offset, length


def test_copy_local_to_s3_is_bit_exact_and_refuses_to_overwrite(seaweedfs, bucket: str, tmp_path: Path) -> None:
    src = tmp_path / "src.b2nd"
    _store_with_holes(src)
    url = f"s3://{bucket}/copies/src.b2nd"
    result = cs.copy(src, url, dst_storage_options=seaweedfs.storage_options, verify=False)
    assert result.nbytes == src.stat().st_size and result.nchunks == 10
    assert _object_bytes(seaweedfs, url) == src.read_bytes()
    with pytest.raises(cs.StoreExistsError, match=url):
        cs.copy(src, url, dst_storage_options=seaweedfs.storage_options)
    with pytest.raises(cs.InvalidInputError, match="read-only"):
        cs.copy(src, "http://127.0.0.1:9/x.b2nd")


def test_copy_detects_a_corrupt_source_chunk(seaweedfs, bucket: str, tmp_path: Path) -> None:
    good = tmp_path / "good.b2nd"
    _store_with_holes(good)
    bad = tmp_path / "bad.b2nd"
    _corrupt_chunk(good, bad, 4)
    url = f"s3://{bucket}/bad.b2nd"
    with pytest.raises(cs.ChecksumError, match=r"bad\.b2nd: chunk 4 \(bytes \d+-\d+\) fails its CRC32 check"):
        cs.copy(bad, url, dst_storage_options=seaweedfs.storage_options)
    assert not remote_exists(url, seaweedfs.storage_options)
    out = tmp_path / "out.b2nd"
    assert cli_main(["copy", str(bad), str(out), "-q"]) == 2
    assert not out.exists() and not list(tmp_path.glob(".out.b2nd.*"))
    # the good one copies locally, bit for bit
    assert cli_main(["copy", str(good), str(out), "-q"]) == 0
    assert out.read_bytes() == good.read_bytes()


def test_copy_local_s3_local_round_trip(seaweedfs, bucket: str, tmp_path: Path) -> None:
    src = tmp_path / "src.b2nd"
    x = _store_with_holes(src)
    url = f"s3://{bucket}/rt/src.b2nd"
    opts = json.dumps(seaweedfs.storage_options)
    assert cli_main(["copy", str(src), url, "--dst-storage-options", opts, "-q"]) == 0  # verified by re-reading
    back = tmp_path / "back.b2nd"
    assert cli_main(["copy", url, str(back), "--storage-options", opts, "-q"]) == 0
    assert back.read_bytes() == src.read_bytes()
    # s3 -> s3 with the same options
    url2 = f"s3://{bucket}/rt/again.b2nd"
    cs.copy(url, url2, storage_options=seaweedfs.storage_options)
    with cs.open(url2, storage_options=seaweedfs.storage_options) as store:
        np.testing.assert_array_equal(store[:], x)


def test_copy_detects_a_corrupt_remote_chunk(seaweedfs, bucket: str, tmp_path: Path) -> None:
    good = tmp_path / "good.b2nd"
    _store_with_holes(good)
    bad = tmp_path / "bad.b2nd"
    _corrupt_chunk(good, bad, 7)
    name, prefix = bucket.split("/", 1)
    url = seaweedfs.upload(name, f"{prefix}/bad.b2nd", bad)
    out = tmp_path / "out.b2nd"
    with pytest.raises(cs.ChecksumError, match=rf"{url}: chunk 7"):
        cs.copy(url, out, storage_options=seaweedfs.storage_options)
    assert not out.exists()


def test_copy_from_plain_http(http_server, seaweedfs, bucket: str, tmp_path: Path) -> None:
    src = http_server.root / "served.b2nd"
    x = _store_with_holes(src)
    url = f"{http_server.url}/served.b2nd"
    dst = f"s3://{bucket}/from-http.b2nd"
    cs.copy(url, dst, dst_storage_options=seaweedfs.storage_options)
    assert _object_bytes(seaweedfs, dst) == src.read_bytes()
    with cs.open(dst, storage_options=seaweedfs.storage_options) as store:
        np.testing.assert_array_equal(store[:], x)


# -- store epochs from a URL (python -m bench.loaders URL) and the link proxy -------------------


def test_bench_loaders_on_a_store_url(seaweedfs, bucket: str, tmp_path: Path, capsys) -> None:
    from bench.loaders.command import main as loaders_main

    src = tmp_path / "src.b2nd"
    _store_with_holes(src)
    url = f"s3://{bucket}/bench/src.b2nd"
    cs.copy(src, url, dst_storage_options=seaweedfs.storage_options, verify=False)
    with cs.open(src) as store:
        nchunks = store.nchunks
    opts = json.dumps(seaweedfs.storage_options)
    assert (
        loaders_main(
            [
                url,
                "--storage-options",
                opts,
                "--epochs",
                "2",
                "--batch-size",
                "32",
                "-q",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert f"carraystore epochs from {url}" in text
    rows = json.loads((tmp_path / "out" / "store_epochs.json").read_text())["epochs"]
    assert [r["images"] for r in rows] == [150, 150]
    # an epoch costs at most one request per chunk, and fetches the chunks' bytes once
    assert all(0 < r["requests"] <= nchunks for r in rows)
    assert all(r["mb"] * 1e6 <= src.stat().st_size for r in rows)


def test_bench_loaders_cache_size_takes_a_size_like_open(seaweedfs, bucket: str, tmp_path: Path, capsys) -> None:
    from bench.loaders.command import main as loaders_main

    src = tmp_path / "src.b2nd"
    _store_with_holes(src)
    url = f"s3://{bucket}/bench/cached.b2nd"
    cs.copy(src, url, dst_storage_options=seaweedfs.storage_options, verify=False)
    opts = json.dumps(seaweedfs.storage_options)
    cache = tmp_path / "cache"
    assert (
        loaders_main(
            [
                url,
                "--storage-options",
                opts,
                "--epochs",
                "2",
                "-q",
                "--out",
                str(tmp_path / "out"),
                "--cache-dir",
                str(cache),
                "--cache-size",
                "10MB",
            ]
        )
        == 0
    )  # as cache_size="10MB"
    assert list(cache.rglob("*.chunk"))
    rows = json.loads((tmp_path / "out" / "store_epochs.json").read_text())["epochs"]
    # requests and MB are what crossed the network: the second epoch is served by the cache
    assert rows[0]["requests"] > 0 and rows[0]["mb"] > 0
    assert rows[1]["requests"] == 0 and rows[1]["mb"] == 0
    with pytest.raises(SystemExit):
        loaders_main([url, "--cache-dir", str(cache), "--cache-size", "ten"])
    assert "--cache-size" in capsys.readouterr().err


def test_link_proxy_adds_latency_and_caps_bandwidth(seaweedfs, bucket: str) -> None:
    name, prefix = bucket.split("/", 1)
    direct = seaweedfs.s3_store(name)
    obstore.put(direct, f"{prefix}/blob", os.urandom(4_000_000))
    with NetProxy("127.0.0.1", seaweedfs.s3_port, rtt=0.1, bandwidth=80e6 / 8) as link:
        store = S3Store(
            name, endpoint=link.url, region="us-east-1", skip_signature=True, client_options={"allow_http": True}
        )
        obstore.get_range(store, f"{prefix}/blob", start=0, length=10)  # connect
        requests0 = link.stats.requests
        t0 = time.perf_counter()
        obstore.get_range(store, f"{prefix}/blob", start=0, length=10)
        small = time.perf_counter() - t0
        t0 = time.perf_counter()
        data = bytes(obstore.get(store, f"{prefix}/blob").bytes())
        big = time.perf_counter() - t0
        requests = link.stats.requests - requests0
    assert len(data) == 4_000_000
    assert small >= 0.1  # one round trip
    assert big >= 4_000_000 * 8 / 80e6  # 0.4 s at 80 Mbit/s
    assert requests == 2

"""Trust under faults: stale journals, migrations that read outside their source,
copy without the writer lock, the chunk cache's folders, keys and labels as FORMAT.md says."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import CLI, indexed_images

import carraystore
from carraystore.base.errors import CorruptStoreError, StaleJournalError
from carraystore.sources.journal import journal_path

SHAPE = (8, 8, 3)
CHUNK = 4


def _store(path: Path, n: int, **kw: object) -> None:
    with carraystore.create(path, SHAPE, chunk_images=CHUNK, **kw) as w:  # type: ignore[arg-type]
        w.append(indexed_images(0, n, SHAPE), labels=np.arange(n) % 5, keys=[f"d/{i}.png" for i in range(n)])


def _append(path: Path, start: int, n: int) -> None:
    with carraystore.append(path) as w:
        w.append(
            indexed_images(start, n, SHAPE),
            labels=np.arange(n) % 5,
            keys=[f"d/{i}.png" for i in range(start, start + n)],
        )


# die once the journal is hot: after the chunks (in commit), or right after the journal and marker
_DIE = r"""
import os, sys, numpy as np, carraystore
import carraystore.store.inplace as w
if sys.argv[2] == "commit":
    w._InPlaceWrite.commit = lambda self, meta: os.kill(os.getpid(), 9)
elif sys.argv[2] == "vlmeta":  # the header and offsets index rewritten, the trailer not yet
    w._write_meta = lambda array, meta: os.kill(os.getpid(), 9)
else:
    put = w._InPlaceWrite.put_chunk
    def die(self, i, data):
        self._begin()
        os.kill(os.getpid(), 9)
    w._InPlaceWrite.put_chunk = die
if sys.argv[3] == "meta":
    carraystore.update_metadata(sys.argv[1], attrs={"b": 2})
else:
    a = carraystore.append(sys.argv[1])
    a.append(np.ones((9, 8, 8, 3), np.uint8), labels=np.zeros(9, int), keys=[f"n/{i}.png" for i in range(9)])
    a.close()
"""


def _die(path: Path, when: str, what: str = "append") -> None:
    r = subprocess.run([sys.executable, "-c", _DIE, str(path), when, what], timeout=120)
    assert r.returncode == -signal.SIGKILL and journal_path(path).exists()


@pytest.mark.parametrize("when", ["commit", "begin", "vlmeta"])
def test_a_stale_journal_is_never_rolled_back_onto_a_newer_copy(tmp_path: Path, when: str) -> None:
    """The guard sampled the last 64 KiB of old data, which a newer copy (the same
    store grown by an append) still holds: the newer copy was rolled back to 40 items."""
    store, newer = tmp_path / "store.b2nd", tmp_path / "newer.b2nd"
    _store(store, 40)
    shutil.copyfile(store, newer)
    _append(newer, 40, 500)
    _die(store, when)
    restored = newer.read_bytes()
    shutil.copyfile(newer, store)  # `cp newer.b2nd store.b2nd`: the same inode, written over
    for attempt in (lambda: carraystore.open(store), lambda: _append(store, 540, 2)):
        with pytest.raises(StaleJournalError, match=r"interrupted write to another file.*delete"):
            attempt()
    assert store.read_bytes() == restored  # nothing written into it
    journal_path(store).unlink()  # what the error says
    with carraystore.open(store) as s:
        assert len(s) == 540 and s.verify() == []


def test_a_stale_journal_is_never_rolled_back_onto_a_meta_updated_copy(tmp_path: Path) -> None:
    """A copy whose only change is a metadata update of the same length keeps the old header."""
    store, newer = tmp_path / "store.b2nd", tmp_path / "newer.b2nd"
    _store(store, 10, attrs={"a": 1})
    shutil.copyfile(store, newer)
    carraystore.update_metadata(newer, attrs={"a": 7})
    _die(store, "vlmeta", "meta")
    shutil.copyfile(newer, store)
    with pytest.raises(StaleJournalError):
        carraystore.open(store)
    journal_path(store).unlink()
    assert carraystore.open(store).attrs == {"a": 7}


def test_a_stale_journal_is_never_rolled_back_onto_an_older_copy(tmp_path: Path) -> None:
    store, older = tmp_path / "store.b2nd", tmp_path / "older.b2nd"
    _store(older, 20)
    shutil.copyfile(older, store)
    _append(store, 20, 20)
    _die(store, "commit")
    before = older.read_bytes()
    shutil.copyfile(older, store)
    with pytest.raises(CorruptStoreError, match="another file"):
        carraystore.open(store)
    assert store.read_bytes() == before


@pytest.mark.parametrize(
    ("when", "what"), [("commit", "append"), ("begin", "append"), ("vlmeta", "append"), ("vlmeta", "meta")]
)
def test_the_journal_still_rolls_back_its_own_write(tmp_path: Path, when: str, what: str) -> None:
    store = tmp_path / "store.b2nd"
    _store(store, 10, attrs={"a": 1})
    before = store.read_bytes()
    _die(store, when, what)
    with carraystore.open(store) as s:
        assert len(s) == 10 and s.attrs == {"a": 1} and s.verify() == []
    assert store.read_bytes() == before and not journal_path(store).exists()


def test_an_old_csjrnl02_journal_applies_only_while_the_old_header_is_in_place(tmp_path: Path) -> None:
    import zlib

    from carraystore.sources.journal import Journal

    store = tmp_path / "store.b2nd"
    _store(store, 10)
    before = store.read_bytes()
    h = int.from_bytes(before[11:15], "big")
    # a 02 journal made by hand, of a write that died before its commit (chunks over the tail)
    tail_at = h + int.from_bytes(before[39:47], "big")
    start = max(h, tail_at - 65536)
    j = Journal(len(before), ((0, before[:h]), (tail_at, before[tail_at:])))
    body = b"CSJRNL02" + len(before).to_bytes(8, "little") + (2).to_bytes(4, "little")
    body += start.to_bytes(8, "little") + (tail_at - start).to_bytes(8, "little")
    body += (zlib.crc32(before[start:tail_at]) & 0xFFFFFFFF).to_bytes(4, "little")
    for offset, data in j.regions:
        body += offset.to_bytes(8, "little") + len(data).to_bytes(8, "little") + data
    raw = body + (zlib.crc32(body) & 0xFFFFFFFF).to_bytes(4, "little")
    with open(store, "r+b") as f:
        f.seek(tail_at)
        f.write(b"\x55" * 300)  # a chunk written over the old index and trailer
    journal_path(store).write_bytes(raw)
    assert len(carraystore.open(store)) == 10 and store.read_bytes() == before  # rolled back
    # the same journal beside a newer copy (its header differs): refused
    newer = tmp_path / "newer.b2nd"
    shutil.copyfile(store, newer)
    _append(newer, 10, 3)
    shutil.copyfile(newer, store)
    journal_path(store).write_bytes(raw)
    with pytest.raises(StaleJournalError):
        carraystore.open(store)


def test_copy_overwrite_takes_the_destinations_writer_lock(tmp_path: Path) -> None:
    """`copy --overwrite` took no lock: run during an open append it replaced the
    store, the append failed, and every later open failed until the journal was deleted by hand."""
    from carraystore.base.errors import StoreLockedError
    from carraystore.store.transfer import copy_store

    src, dst = tmp_path / "src.b2nd", tmp_path / "dst.b2nd"
    _store(src, 6)
    _store(dst, 10)
    a = carraystore.append(dst)
    a.append(indexed_images(10, 5, SHAPE), labels=np.arange(5) % 5, keys=[f"d/{i}.png" for i in range(10, 15)])
    with pytest.raises(StoreLockedError, match=r"being written by append"):
        copy_store(src, dst, overwrite=True)
    r = subprocess.run(
        [*CLI, "copy", str(src), str(dst), "--overwrite", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "being written by append" in r.stderr and "Traceback" not in r.stderr
    a.close()  # the append is not broken
    with carraystore.open(dst) as s:
        assert len(s) == 15 and s.verify() == []
    copy_store(src, dst, overwrite=True)  # and once it is done, the copy replaces it
    with carraystore.open(dst) as s:
        assert len(s) == 6 and s.verify() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst.b2nd", "src.b2nd"]


def test_migrate_never_reads_hdf5_data_stored_outside_the_file(tmp_path: Path) -> None:
    """External storage pointed the store's pixels at /etc/passwd."""
    h5py = pytest.importorskip("h5py")
    from carraystore.base.errors import MigrationError
    from carraystore.migrations import migrate

    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 30)
    n = secret.stat().st_size // 48
    with h5py.File(tmp_path / "p.h5", "w") as f:
        f.create_dataset("images", shape=(n, 4, 4, 3), dtype="u1", external=[(str(secret), 0, n * 48)])
    with pytest.raises(MigrationError, match="outside the file"):
        migrate(tmp_path / "p.h5", tmp_path / "p.b2nd")
    # a virtual dataset mapping another file
    with h5py.File(tmp_path / "src.h5", "w") as f:
        f.create_dataset("x", data=np.arange(n * 48, dtype="u1").reshape(n, 4, 4, 3))
    layout = h5py.VirtualLayout(shape=(n, 4, 4, 3), dtype="u1")
    layout[:] = h5py.VirtualSource(str(tmp_path / "src.h5"), "x", shape=(n, 4, 4, 3))
    with h5py.File(tmp_path / "v.h5", "w") as f:
        f.create_virtual_dataset("images", layout)
    with pytest.raises(MigrationError, match="virtual dataset"):
        migrate(tmp_path / "v.h5", tmp_path / "v.b2nd")
    # labels stored outside the file: refused too
    lab = tmp_path / "lab.bin"
    lab.write_bytes(bytes(n))
    with h5py.File(tmp_path / "l.h5", "w") as f:
        f.create_dataset("images", data=np.zeros((n, 4, 4, 3), "u1"))
        f.create_dataset("labels", shape=(n,), dtype="u1", external=[(str(lab), 0, n)])
    with pytest.raises(MigrationError, match="outside the file"):
        migrate(tmp_path / "l.h5", tmp_path / "l.b2nd", labels="labels")
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".b2nd" or p.name.startswith(".")]


def test_migrate_never_follows_a_link_inside_a_bcolz_folder(tmp_path: Path) -> None:
    pytest.importorskip("numcodecs", reason="write_carray uses numcodecs' c-blosc 1.x")
    from carraystore.base.errors import MigrationError
    from carraystore.migrations import migrate
    from testsupport.bcolz_writer import write_carray

    write_carray(tmp_path / "a.bc", np.zeros((20, 4, 4, 3), np.uint8), chunklen=10)
    write_carray(tmp_path / "other.bc", np.full((20, 4, 4, 3), 7, np.uint8), chunklen=10)
    chunk = sorted((tmp_path / "a.bc" / "data").iterdir())[0]
    chunk.unlink()
    chunk.symlink_to(tmp_path / "other.bc" / "data" / chunk.name)  # data from outside the folder
    with pytest.raises(MigrationError, match="symbolic link inside the bcolz folder"):
        migrate(tmp_path / "a.bc", tmp_path / "a.b2nd")
    assert not (tmp_path / "a.b2nd").exists()


def test_the_chunk_cache_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    """The cache folder's name is predictable (a hash of the URL and size): a link
    planted there in a shared cache_dir made the cache write its files wherever it pointed."""
    import hashlib
    import os

    from carraystore.base.errors import CacheFolderError
    from carraystore.sources.cache import CachedSource
    from carraystore.sources.local import LocalFileSource

    store = tmp_path / "s.b2nd"
    _store(store, 8)
    cache, victim = tmp_path / "cache", tmp_path / "victim"
    cache.mkdir()
    victim.mkdir()
    src = LocalFileSource(store)
    identity = f"{src.location}|{src.size()}"
    folder = cache / hashlib.sha256(identity.encode()).hexdigest()[:32]
    folder.symlink_to(victim)
    with pytest.raises(CacheFolderError, match="symbolic link"):
        CachedSource(src, cache)
    assert list(victim.iterdir()) == []
    folder.unlink()
    folder.mkdir(mode=0o777)
    os.chmod(folder, 0o777)  # writable by anyone: another user could plant files in it
    with pytest.raises(CacheFolderError, match="writable by other users"):
        CachedSource(src, cache)
    folder.rmdir()
    cached = CachedSource(src, cache)  # a fresh folder: this user's only
    assert bytes(cached.read(0, 64)) == store.read_bytes()[:64]
    assert folder.is_dir() and not folder.is_symlink() and (folder.stat().st_mode & 0o077) == 0
    cached.close()


def test_an_external_per_row_dataset_is_not_carried_as_a_field(tmp_path: Path) -> None:
    """A per-row dataset beside the images would become a field; with external storage it
    would read another file, so it is left out with a note and the secret never enters the store."""
    h5py = pytest.importorskip("h5py")
    from carraystore.migrations import migrate

    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"TOP-SECRET-BYTES" * 4)
    src = tmp_path / "p.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("images", data=np.zeros((8, 4, 4, 3), np.uint8))
        f.create_dataset("sample_id", shape=(8,), dtype="<u8", external=[(str(secret), 0, 64)])
    report = migrate(src, tmp_path / "o.b2nd")
    assert any("sample_id" in n and "outside the file" in n for n in report.notes)
    with carraystore.open(tmp_path / "o.b2nd") as s:
        assert "sample_id" not in s.columns
    assert b"TOP-SECRET" not in (tmp_path / "o.b2nd").read_bytes()

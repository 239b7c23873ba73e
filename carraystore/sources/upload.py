"""Writing stores to object storage (layer 2, below the writer).
A store bound for ``s3://``/``gs://`` is staged in a private folder under ``tmp_dir`` (default
``TMPDIR``; dead writers' folders are removed later), then put atomically (multipart when large):
a killed writer leaves nothing at the URL (a bucket lifecycle rule reclaims unfinished parts).
:class:`RemoteTarget` is that round trip."""

from __future__ import annotations

import contextlib
import os
import random
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from carraystore.base.errors import CarrayStoreError, InvalidInputError, StoreExistsError, UploadError

__all__ = ["RemoteTarget", "check_writable", "put_stream", "remote_exists", "delete_remote", "PART_BYTES"]

#: Part size of multipart uploads (S3: 5 MiB-5 GiB, at most 10,000 parts; larger files get larger parts).
PART_BYTES = 16 * 1024 * 1024
#: Parts uploaded at once (a file), and parts of a stream held in memory and sent at once.
UPLOAD_CONCURRENCY = 8
STREAM_CONCURRENCY = 4
#: Attempts of a whole upload or existence check failing transiently (a streamed copy is not retried).
UPLOAD_ATTEMPTS = 3
_WRITABLE = ("s3", "s3a", "gs", "gcs")
_STAGE = re.compile(r"^carraystore-upload-(?P<pid>\d+)-[0-9a-f]+$")


def _object_store(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    """(obstore store, key) for ``url``: the same store the reader uses."""
    from carraystore.sources.remoteconfig import make_object_store

    return make_object_store(url, storage_options)


def _attempts(fn: Callable[[], Any]) -> Any:
    """``fn()``, tried again (backoff with jitter) while it fails transiently."""
    from carraystore.sources.retry import is_transient

    for attempt in range(1, UPLOAD_ATTEMPTS + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt == UPLOAD_ATTEMPTS or not is_transient(exc):
                raise
            time.sleep(random.uniform(0, 0.5 * 2**attempt))


def check_writable(url: str) -> None:
    """Raise InvalidInputError unless stores can be written at ``url`` (s3://, gs://, ...)."""
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("http", "https"):
        raise InvalidInputError(
            f"{url}: http(s) URLs are read-only; write the store to s3://, gs:// or a local path "
            "(serve it over HTTP from there)"
        )
    if scheme not in _WRITABLE:
        raise InvalidInputError(f"{url}: cannot write to {scheme}:// URLs; use s3://, gs:// or a local path")


def _part_size(nbytes: int) -> int:
    return max(PART_BYTES, -(-nbytes // 9000))


def remote_exists(url: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether an object exists at ``url``."""
    import obstore

    store, key = _object_store(url, storage_options)
    try:
        _attempts(lambda: obstore.head(store, key))
    except FileNotFoundError:
        return False
    except Exception as exc:
        raise UploadError(f"{url}: cannot check whether the object exists ({_short(exc)})") from exc
    return True


def delete_remote(url: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Delete the object at ``url`` (no error when there is none)."""
    import obstore

    store, key = _object_store(url, storage_options)
    with contextlib.suppress(FileNotFoundError):
        obstore.delete(store, key)


def put_stream(
    url: str,
    blocks: Iterable[bytes | memoryview],
    storage_options: Mapping[str, Any] | None = None,
    *,
    size_hint: int = 0,
) -> None:
    """Upload the concatenated ``blocks`` to ``url`` as one object (multipart, atomic, bounded memory).
    If the iterator raises, nothing appears at ``url`` and its exception propagates."""
    import obstore

    check_writable(url)
    store, key = _object_store(url, storage_options)
    try:
        obstore.put(
            store,
            key,
            iter(blocks),
            use_multipart=True,
            chunk_size=_part_size(size_hint),
            max_concurrency=STREAM_CONCURRENCY,
        )
    except CarrayStoreError:
        raise
    except Exception as exc:
        raise UploadError(f"{url}: upload failed ({_short(exc)}); nothing was published at the URL") from exc


def _short(exc: BaseException) -> str:
    text = str(exc).split("\n\nDebug source:", 1)[0].strip()
    return f"{type(exc).__name__}: {text[:500]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_stages(parent: Path) -> None:
    """Remove staging folders that killed writers left in ``parent``."""
    with contextlib.suppress(OSError):
        for p in parent.iterdir():
            m = _STAGE.match(p.name)
            if m and not _pid_alive(int(m.group("pid"))):
                shutil.rmtree(p, ignore_errors=True)


class RemoteTarget:
    """A store on its way to ``url``: a local staging file (``local_path``), then an atomic upload.
    Call :meth:`cleanup` whatever happened."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        overwrite: bool = False,
        tmp_dir: str | os.PathLike[str] | None = None,
        must_exist: bool = False,
    ) -> None:
        check_writable(url)
        name = url.rstrip("/").rsplit("/", 1)[-1]
        if not name.endswith(".b2nd"):
            raise InvalidInputError(f"{url}: a store's name must end in .b2nd")
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.overwrite = overwrite or must_exist
        exists = remote_exists(url, self.storage_options)
        if must_exist and not exists:
            raise FileNotFoundError(f"{url}: no such store")
        if exists and not overwrite and not must_exist:
            raise StoreExistsError(f"{url} already exists; pass overwrite=True (CLI: --overwrite) to replace it")
        parent = Path(tmp_dir) if tmp_dir is not None else Path(tempfile.gettempdir())
        if not parent.is_dir():
            raise InvalidInputError(f"{parent}: the temporary folder for staging {url} does not exist")
        _remove_stale_stages(parent)
        self.workdir = parent / f"carraystore-upload-{os.getpid()}-{secrets.token_hex(4)}"
        self.workdir.mkdir(mode=0o700)
        #: where the store is written before the upload
        self.local_path = self.workdir / name
        self.uploaded_bytes = 0

    def download(self) -> None:
        """Fetch the object at the URL into ``local_path`` (streamed), e.g. to append to it."""
        import obstore

        store, key = _object_store(self.url, self.storage_options)
        tmp = self.local_path.with_name(self.local_path.name + ".download")
        try:
            with open(tmp, "wb") as f:
                for part in obstore.get(store, key).stream(min_chunk_size=8 * 1024 * 1024):
                    f.write(part)
            os.replace(tmp, self.local_path)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise UploadError(f"{self.url}: download failed ({_short(exc)})") from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def upload(self, path: Path | None = None) -> int:
        """Put the finished file (default ``local_path``) at the URL; returns its size."""
        import obstore

        path = Path(path) if path is not None else self.local_path
        size = path.stat().st_size
        if not self.overwrite and remote_exists(self.url, self.storage_options):
            raise StoreExistsError(
                f"{self.url} appeared while this store was being written; not replacing it (pass overwrite=True)"
            )
        store, key = _object_store(self.url, self.storage_options)
        try:
            _attempts(
                lambda: obstore.put(
                    store,
                    key,
                    path,
                    use_multipart=size > PART_BYTES,
                    chunk_size=_part_size(size),
                    max_concurrency=UPLOAD_CONCURRENCY,
                )
            )
        except Exception as exc:
            raise UploadError(
                f"{self.url}: upload of {size} bytes failed ({_short(exc)}); nothing was published at the URL"
            ) from exc
        self.uploaded_bytes = size
        return size

    def cleanup(self) -> None:
        """Remove the local staging folder."""
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __repr__(self) -> str:
        return f"<RemoteTarget {self.url!r} staged at {str(self.local_path)!r}>"

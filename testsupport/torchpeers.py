"""The PyTorch peers of the remote benchmark: MosaicML Streaming (MDS) and LitData.

Both libraries need PyTorch, which carraystore does not install: this module runs only in
the peers' own virtual environment (``make bench-peers-env`` -> ``.venv-peers``, see
``bench/requirements-peers.txt``); carraystore's ``.venv`` never imports it.

- :func:`build` writes the same JPEG bytes as the WebDataset shards into an MDS dataset
  (``MDSWriter``, columns ``jpg: bytes``, ``cls: int``, no compression, ``size_limit``
  given by the caller) or a LitData dataset (``litdata.optimize``, ``chunk_size`` images
  per chunk), in the WebDataset order; bench_remote sizes both to about the WebDataset
  shard's images. Command line:
  ``python -m testsupport.torchpeers build SPEC.json``.
- :func:`mds_epoch` and :func:`litdata_epoch` read one epoch from S3 as each library's docs
  tell a user to: ``StreamingDataset`` on an ``s3://`` URL (MDS: endpoint from
  ``S3_ENDPOINT_URL``; LitData: ``storage_options``) with ``shuffle=True`` and the seed of
  the epoch, its ``StreamingDataLoader`` with ``num_workers=2`` worker processes (one per
  core of the 2-core machines this runs on), JPEGs decoded with Pillow in the workers.
  Every epoch gets a fresh, empty local cache folder, deleted after it: like carraystore,
  every epoch crosses the link.

``streaming``'s package ``__init__`` imports ``streaming.vision``, which imports
torchvision; PyPI's torchvision is a CUDA build that does not import beside the CPU torch,
so the peers' environment has no torchvision and :func:`_without_torchvision` gives
``streaming.vision`` an empty module (the datasets used here never touch it).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["build", "start_mds_fork_server", "mds_epoch", "litdata_epoch", "decode_jpeg", "collate"]

#: worker processes of each library's DataLoader: one per core of the benchmark's machine
NUM_WORKERS = 2
#: MDS fetches index.json with boto3 in the parent; forked workers would share that
#: keep-alive connection and read each other's responses (shards with the wrong bytes, seen
#: here). Its dataset drops the client when pickled, so the workers start by forkserver
#: (Python 3.14's default on Linux) and open their own connections. The fork server
#: preloads this module (torch, streaming), so a worker starts in milliseconds instead of
#: importing torch again in every epoch.
MDS_START_METHOD = "forkserver"


def _mds_context() -> Any:
    import multiprocessing

    ctx = multiprocessing.get_context(MDS_START_METHOD)
    ctx.set_forkserver_preload([__name__])
    return ctx


def decode_jpeg(data: bytes) -> np.ndarray:
    """JPEG bytes -> uint8 RGB array (Pillow, as the other peers)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


def _decode_sample(sample: dict[str, Any]) -> np.ndarray:
    return decode_jpeg(sample["jpg"])


def collate(samples: list[np.ndarray]) -> np.ndarray:
    """A batch of decoded images as one uint8 array (as the other peers yield)."""
    return np.stack(samples)


def _without_torchvision() -> None:
    """Let ``import streaming`` work where torchvision does not import (see the module docstring)."""
    if "torchvision" in sys.modules:
        return
    try:
        import torchvision  # noqa: F401
    except Exception:  # absent, or PyPI's CUDA build beside the CPU torch
        sys.modules.pop("torchvision", None)
        sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))


_without_torchvision()
import streaming  # noqa: E402


class JpegMDS(streaming.StreamingDataset):  # type: ignore[misc]
    """MDS samples decoded to uint8 RGB: the MDS docs' way, a subclass whose ``__getitem__`` transforms."""

    def __getitem__(self, idx: int) -> np.ndarray:
        return decode_jpeg(super().__getitem__(idx)["jpg"])


# ---------------------------------------------------------------------------------------
# building the datasets (local folders, uploaded by bench/bench_remote.py)
# ---------------------------------------------------------------------------------------


def _litdata_item(item: tuple[str, int]) -> dict[str, Any]:
    return {"jpg": Path(item[0]).read_bytes(), "cls": int(item[1])}


def build(
    fmt: str, out: str | os.PathLike[str], files: list[str], labels: list[int], *, shard_images: int, shard_bytes: int
) -> Path:
    """Write ``files`` (JPEG paths, in this order) with ``labels`` as an MDS or LitData folder ``out``.

    Written into ``out.tmp`` and renamed when complete, so a half-built folder is never used.
    """
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if fmt == "mds":
        with streaming.MDSWriter(out=str(tmp), columns={"jpg": "bytes", "cls": "int"}, size_limit=shard_bytes) as w:
            for f, y in zip(files, labels, strict=True):
                w.write({"jpg": Path(f).read_bytes(), "cls": int(y)})
    elif fmt == "litdata":
        from litdata import optimize

        optimize(
            fn=_litdata_item,
            inputs=list(zip(files, labels, strict=True)),
            output_dir=str(tmp),
            chunk_size=shard_images,
            num_workers=1,
            keep_data_ordered=True,
            verbose=False,
            mode="overwrite",
        )
    else:
        raise ValueError(f"unknown peer format {fmt!r} (mds or litdata)")
    tmp.rename(out)
    return out


# ---------------------------------------------------------------------------------------
# reading epochs from S3
# ---------------------------------------------------------------------------------------


def start_mds_fork_server() -> None:
    """Start the fork server of MDS's workers now (it imports torch and streaming once).

    Called before the timed epochs: it is a training run's start-up, as importing
    carraystore and opening the store are for carraystore's epochs.
    """
    p = _mds_context().Process(target=_nothing)  # the server has imported this module once it has forked p
    p.start()
    p.join()


def _nothing() -> None:
    pass


def mds_epoch(spec: dict[str, Any], e: int) -> Iterator[np.ndarray]:
    """One shuffled epoch of the MDS dataset at ``s3://{bucket}/{mds_prefix}``, from an empty cache."""
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    local = tempfile.mkdtemp(prefix="carraystore-mds-")
    try:
        ds = JpegMDS(
            remote=f"s3://{spec['bucket']}/{spec['mds_prefix']}",
            local=local,
            shuffle=True,
            shuffle_seed=spec["seed"] + e,
            batch_size=spec["batch_size"],
        )
        loader = streaming.StreamingDataLoader(
            ds,
            batch_size=spec["batch_size"],
            num_workers=NUM_WORKERS,
            collate_fn=collate,
            multiprocessing_context=_mds_context(),
        )
        yield from loader
        del loader, ds
    finally:
        shutil.rmtree(local, ignore_errors=True)


def _litdata_allow_http() -> None:
    """Let LitData's obstore client speak plain HTTP to the loopback link.

    LitData fetches chunks with obstore (``index.json`` with boto3), its client options a
    module constant without ``allow_http``: against an ``http://`` endpoint every chunk GET
    fails with "builder error" (real S3 is https). The one option is added; nothing else of
    LitData's downloads changes.
    """
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}


def litdata_epoch(spec: dict[str, Any], e: int) -> Iterator[np.ndarray]:
    """One shuffled epoch of the LitData dataset at ``s3://{bucket}/{litdata_prefix}``, from an empty cache."""
    from litdata import StreamingDataLoader, StreamingDataset

    _litdata_allow_http()
    cache = tempfile.mkdtemp(prefix="carraystore-litdata-")
    try:
        ds = StreamingDataset(
            f"s3://{spec['bucket']}/{spec['litdata_prefix']}",
            cache_dir=cache,
            shuffle=True,
            seed=spec["seed"] + e,
            storage_options=spec["storage_options"],
            transform=_decode_sample,
        )
        loader = StreamingDataLoader(ds, batch_size=spec["batch_size"], num_workers=NUM_WORKERS, collate_fn=collate)
        yield from loader
        del loader, ds
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "build":
        print("usage: python -m testsupport.torchpeers build SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[1]).read_text())
    build(
        spec["format"],
        spec["out"],
        spec["files"],
        spec["labels"],
        shard_images=spec["shard_images"],
        shard_bytes=spec["shard_bytes"],
    )
    return 0


if __name__ == "__main__":  # pragma: no cover - run by bench/bench_remote.py in the peers' environment
    sys.exit(_main(sys.argv[1:]))

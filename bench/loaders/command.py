"""``python -m bench.loaders DIR``: the loader comparison on your own image folder (from the repository root).

Given a store instead (a ``.b2nd`` path or a URL such as ``s3://bucket/train.b2nd``), it times
carraystore's own epochs from it (:func:`bench.remote_epochs.store_epochs`). ``--child SPEC``
runs one round of one peer (the comparison's fresh processes).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.loaders.child import child_main
from bench.loaders.comparison import run_comparison
from bench.loaders.registry import PEER_BY_NAME, PEERS, available_peers
from bench.loaders.report import markdown_report, write_results
from carraystore.base.errors import CarrayStoreError, InvalidInputError

__all__ = ["main", "parser"]

PROG = "python -m bench.loaders"


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _link(text: str) -> tuple[float, float | None]:
    from bench.loaders.matrix import parse_link

    try:
        return parse_link(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(text: str) -> int | None:
    from carraystore.sources.cache import parse_size

    try:
        return parse_size(text)
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parser() -> argparse.ArgumentParser:
    """The command line: the former ``carraystore bench loaders``."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Convert DIR's images into every format whose library is installed (npy files, npz, HDF5, zarr, "
            "bcolz, TFRecord, carraystore presets), then time one epoch after another of each loader in a fresh "
            "process, warm and cold page cache. Needs free disk space of several times the decoded images. "
            "Given a store instead (a .b2nd path or a URL such as s3://bucket/train.b2nd), times carraystore's "
            "epochs from it: images/s, time to the first batch, requests and MB per epoch, peak RSS."
        ),
    )
    p.add_argument("dir", nargs="?", help="folder of images in class sub-folders, or a store (.b2nd path or URL)")
    p.add_argument("--limit", type=int, default=None, help="use a seeded random subset of this many images")
    p.add_argument("--image-size", nargs=2, type=int, metavar=("H", "W"), help="resize every image, as ingest")
    p.add_argument("--color-mode", choices=["grayscale", "rgb", "rgba"], default="rgb", help="channels (default rgb)")
    p.add_argument("--batch-size", type=int, default=32, help="images per batch (default 32)")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per regime; the median counts (default 3)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold-cache epochs")
    p.add_argument(
        "--throttle-mbs",
        type=float,
        default=None,
        metavar="MBS",
        help=(
            "also time a cold epoch with reads of the disk limited to MBS MB/s (an HDD or network file system: "
            "a cgroup-v1 blkio throttle, needs root; skipped with the reason where it cannot be set)"
        ),
    )
    p.add_argument(
        "--probe-disk", action="store_true", help="measure the disk's cold sequential read speed (a 128 MiB probe file)"
    )
    p.add_argument(
        "--remote",
        type=_link,
        metavar="RTT_MS:MBIT",
        help=(
            "also read carraystore's stores over an emulated link (a SeaweedFS server on loopback behind a proxy), "
            "e.g. 20:400; with --out, writes the storage-speed matrix (storage_matrix.md/.json) of every regime"
        ),
    )
    p.add_argument("--peers", help="comma-separated loaders to run (default: all installed); see --list")
    p.add_argument("--list", action="store_true", help="list the loaders and whether each can run here, then exit")
    p.add_argument("--work", help="folder for the converted copies (kept; default: a temporary folder, removed)")
    p.add_argument("--out", help="write loaders.md, loaders.json and loaders.png into this folder")
    p.add_argument("--seed", type=int, default=0, help="seed of the subset and the shuffles (default 0)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per loader (default 1800)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.add_argument("--storage-options", type=_json_object, metavar="JSON", help="options for a store URL")
    p.add_argument("--cache-dir", help="a store URL's local chunk cache folder (default: none)")
    p.add_argument("--cache-size", type=_size, help="what the chunk cache may hold: bytes or a size such as 20GB")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def _say(quiet: bool) -> Callable[[str], None]:
    return (lambda s: None) if quiet else (lambda s: print(s, file=sys.stderr, flush=True))


def _store_epochs(args: argparse.Namespace) -> int:
    """A store's own epochs from a path or URL."""
    from bench.remote_epochs import store_epochs

    say = _say(args.quiet)
    rows = store_epochs(
        args.dir,
        args.storage_options,
        batch_size=args.batch_size,
        epochs=args.epochs,
        seed=args.seed,
        cache_dir=args.cache_dir,
        cache_size=args.cache_size,
        report=lambda d: say(f"epoch {d['epoch']}: {d['images_per_s']:,.0f} images/s") if d["phase"] == "end" else None,
    )
    remote = "requests" in rows[0]
    print(
        f"# carraystore epochs from {args.dir} (batches of {args.batch_size}, block shuffle; "
        f"opened in {rows[0]['open_s']:.3f} s)\n"
    )
    print("| epoch | images/s | first batch (s) |" + (" requests | MB |" if remote else "") + " peak RSS (MB) |")
    print("| ---: | ---: | ---: |" + (" ---: | ---: |" if remote else "") + " ---: |")
    for r in rows:
        extra = f" {r['requests']} | {r['mb']:.1f} |" if remote else ""
        print(f"| {r['epoch']} | {r['images_per_s']:,.0f} | {r['first_batch_s']:.3f} |{extra} {r['peak_rss_mb']:.0f} |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        data = {"store": args.dir, "batch_size": args.batch_size, "epochs": rows}
        (out / "store_epochs.json").write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {out / 'store_epochs.json'}")
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.list:
        _, skipped = available_peers()
        for p in PEERS:
            state = "available" if p.name not in skipped else f"skipped: {skipped[p.name]}"
            print(f"{p.name:28s} {p.label} ({state})")
        return 0
    if not args.dir:
        raise InvalidInputError("give DIR, a folder of images in class sub-folders (or --list to see the loaders)")
    if args.epochs < 1:
        raise InvalidInputError(f"--epochs must be at least 1, got {args.epochs}")
    from carraystore.store.reader import is_url

    if is_url(args.dir) or args.dir.endswith(".b2nd"):
        return _store_epochs(args)
    peers = [s.strip() for s in args.peers.split(",") if s.strip()] if args.peers else None
    unknown = [p for p in peers or () if p not in PEER_BY_NAME]
    if unknown:
        raise InvalidInputError(f"unknown loaders {unknown}; choose from {sorted(PEER_BY_NAME)}")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="carraystore-bench-"))
    matrix = None
    try:
        cmp = run_comparison(
            args.dir,
            work,
            limit=args.limit,
            image_size=tuple(args.image_size) if args.image_size else None,
            color_mode=args.color_mode,
            batch_size=args.batch_size,
            epochs=args.epochs,
            cold=not args.no_cold,
            seed=args.seed,
            peers=peers,
            timeout_s=args.timeout,
            progress=_say(args.quiet),
            throttle_mbs=args.throttle_mbs,
            probe_disk=args.probe_disk or args.throttle_mbs is not None or args.remote is not None,
        )
        if args.throttle_mbs is not None or args.remote is not None:
            from bench.loaders.matrix import build_matrix, run_remote, stores_for_remote

            remote = None
            if args.remote is not None:
                remote = run_remote(
                    stores_for_remote(cmp, work),
                    args.remote,
                    rounds=args.epochs,
                    batch_size=args.batch_size,
                    seed=args.seed,
                    timeout_s=args.timeout,
                    progress=_say(args.quiet),
                )
            matrix = build_matrix(cmp, remote)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(markdown_report(cmp, heading="# Loader comparison on your images"))
    if matrix is not None:
        from bench.loaders.matrix import matrix_markdown

        print(matrix_markdown(matrix, heading="# Storage-speed matrix on your images"))
    if args.out:
        paths = write_results(cmp, args.out)
        if matrix is not None:
            from bench.loaders.matrix import write_matrix

            paths.update({f"matrix_{k}": v for k, v in write_matrix(matrix, args.out).items()})
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 1 if any(r.status == "error" for r in cmp.rows) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; 2 (and the message on stderr) for a carraystore error."""
    args = parser().parse_args(argv)
    if args.child:
        sys.stdout.write(json.dumps(child_main(json.loads(args.child))) + "\n")
        return 0
    try:
        return _run(args)
    except CarrayStoreError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2

"""``carraystore bench codecs PATH``, ``bench shuffle STORE`` and ``bench layout SRC``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from carraystore.base.errors import InvalidInputError

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``bench`` command (sub-commands ``codecs``, ``shuffle`` and ``layout``) to the CLI."""
    p = sub.add_parser(
        "bench",
        help="measure codecs, shuffle and layouts on your own data",
        description=(
            "Measure blosc2 codecs (and recommend a preset), how well block shuffle mixes a store, or which "
            "layout feeds more images/s, on your own data."
        ),
    )
    bsub = p.add_subparsers(dest="bench_command", metavar="WHAT", help="codecs, shuffle or layout")
    bsub.required = True

    c = bsub.add_parser(
        "codecs",
        help="compression ratio and speed of every codec on your images; recommends a preset or the encoded layout",
        description=(
            "Run the codec suite on a sample of PATH (a folder of images or a .b2nd store): "
            "codecs x levels x filters x images per block, ratio and MB/s, then the presets "
            "(fast, balanced, small) through the loader on your cores, with the encoded layout (the JPEG/PNG files kept) "
            "beside them for a folder of images or an encoded store, and which one suits your data warm (page cache) "
            "and cold (your disk's read speed: measured on the disk holding PATH unless --read-mbs gives it)."
        ),
    )
    c.add_argument("path", help="folder of images (class sub-folders or flat) or a .b2nd store")
    c.add_argument("--sample", type=int, default=32, help="images to measure on (default 32)")
    c.add_argument(
        "--grid",
        choices=["full", "quick", "presets"],
        default="full",
        help=(
            "full: the whole grid (a few minutes); quick: lz4/zstd, levels 1/5, two filters, blocks of 1/4/16 images; "
            "presets: only the presets"
        ),
    )
    c.add_argument(
        "--read-mbs",
        type=float,
        default=None,
        help=(
            "your storage's read speed in MB/s (default: measured on the disk holding PATH, a 64 MiB probe file "
            "written beside it, read back cold and removed)"
        ),
    )
    c.add_argument(
        "--probe-mb",
        type=int,
        default=64,
        metavar="MB",
        help="size of the probe file that measures the disk's read speed (default 64)",
    )
    c.add_argument(
        "--image-size",
        nargs=2,
        type=int,
        metavar=("H", "W"),
        help="resize images of a folder (default: all must agree)",
    )
    c.add_argument("--repeats", type=int, default=3, help="timing repeats, the median counts (default 3)")
    c.add_argument("--seed", type=int, default=0, help="seed of the sample (default 0)")
    c.add_argument("--out", help="also write codecs.md, codecs.json and codecs.png into this folder")
    c.add_argument("-q", "--quiet", action="store_true", help="no per-row progress")
    c.set_defaults(func=_cmd_codecs)

    sh = bsub.add_parser(
        "shuffle",
        help="how well block shuffle mixes a store's epochs, against a global shuffle, per window size",
        description=(
            "Measure one epoch's order of STORE (metadata only, nothing is decoded): distinct classes, groups and "
            "source chunks per batch, and how far samples travel, each beside what a global shuffle gives, for "
            "the store's order, block shuffle at each window size and a global shuffle, with the decoded memory "
            "each window holds."
        ),
    )
    sh.add_argument("store", help="a .b2nd store (path or URL)")
    sh.add_argument("--batch-size", type=int, default=32, help="images per batch (default 32)")
    sh.add_argument(
        "--window",
        type=int,
        action="append",
        help="window in chunks (repeat for several; default: 1, 4, 16 and 64 chunks)",
    )
    sh.add_argument("--seed", type=int, default=0, help="the loader's seed (default 0)")
    sh.add_argument("--epoch", type=int, default=0, help="the epoch to measure (default 0)")
    sh.set_defaults(func=_cmd_shuffle)

    ly = bsub.add_parser(
        "layout",
        help="pixels or encoded: which layout feeds more images/s for your images, cores and link",
        description=(
            "Write a sample of SRC (a folder of images or a .b2nd store) into a store of each layout, as ingest "
            "would, and measure bytes per image (what crosses the link) and decoded images/s per core (CRC, "
            "decompression and, for the encoded layout, decoding the JPEG/PNG files). Each layout delivers "
            "min(link bytes/s / bytes per image, cores x images/s per core); prints both at each link rate, the "
            "layout that feeds more, and the break-even link rate."
        ),
    )
    ly.add_argument("src", help="folder of images (class sub-folders or flat) or a .b2nd store")
    ly.add_argument("--sample", type=int, default=64, help="images to measure on (default 64)")
    ly.add_argument("--cores", type=int, default=None, help="cores that decode (default: the cores available here)")
    ly.add_argument(
        "--link-mbit",
        type=float,
        action="append",
        metavar="MBIT",
        help="the link's rate in Mbit/s (network or disk; repeat for several; default: 100, 1000 and 10000)",
    )
    ly.add_argument("--preset", default="balanced", help="codec preset of the pixel layout (default balanced)")
    ly.add_argument(
        "--quality",
        type=int,
        default=None,
        help="encoded layout: encode every image as JPEG at this quality (default: keep files, PNG otherwise)",
    )
    ly.add_argument(
        "--image-size",
        nargs=2,
        type=int,
        metavar=("H", "W"),
        help="resize images of a folder (default: all must agree)",
    )
    ly.add_argument(
        "--decode-size",
        nargs=2,
        type=int,
        metavar=("H", "W"),
        help=(
            "also decode at this size, as the loader's image_size=(H, W) does (the stored size divided by 2, 4 or 8: "
            "JPEGs by libjpeg's scaled IDCT); reports images/s per core at both sizes"
        ),
    )
    ly.add_argument(
        "--color-mode", choices=["grayscale", "rgb", "rgba"], default="rgb", help="channels, as ingest (default rgb)"
    )
    ly.add_argument("--repeats", type=int, default=5, help="timing repeats, the median counts (default 5)")
    ly.add_argument("--seed", type=int, default=0, help="seed of the sample (default 0)")
    ly.add_argument("--json", metavar="PATH", help="also write the measurements as JSON")
    ly.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    ly.set_defaults(func=_cmd_layout)


def _say(quiet: bool) -> Any:
    return (lambda s: None) if quiet else (lambda s: print(s, file=sys.stderr, flush=True))


def _cmd_codecs(args: argparse.Namespace) -> int:
    from carraystore.cli.benchmarks import codecs as C

    if args.sample < 1:
        raise InvalidInputError(f"--sample must be at least 1, got {args.sample}")
    sample = C.encoded_candidate(
        args.path, n=args.sample, seed=args.seed, image_size=tuple(args.image_size) if args.image_size else None
    )
    images = sample.images
    say = _say(args.quiet)
    say(f"sample: {len(images)} images of {'x'.join(map(str, images.shape[1:]))} {images.dtype} from {args.path}")
    if args.grid != "presets":
        grid = (
            C.codec_grid()
            if args.grid == "full"
            else C.codec_grid(("lz4", "zstd"), (0, 1, 5), ("none", "shuffle+bytedelta"), C.BLOCKS, False)
        )
        rows = C.run_suite({"yours": images}, grid, repeats=args.repeats, progress=say)
        front = C.pareto_front(rows)
        print("Pareto front (compression ratio against 1-thread decompression speed):\n")
        print(C.results_table(front, front))
        print(
            "Images per block (bN: N images per block): whole-chunk decompression MB/s (1 thread), what block-shuffled "
            "epochs do, against the microseconds one random image costs alone (its whole block, through libblosc2's "
            "getitem, as the loader's direct mode reads; 'whole chunk' where getitem cannot, e.g. bytedelta):\n"
        )
        print(C.block_table(rows, C.block_families(rows, front)))
        if args.out:
            paths = C.write_results(rows, args.out, info={"title": f"your data: {args.path}", "images": len(images)})
            print("wrote " + ", ".join(str(p) for p in paths.values()))
    preset_rows = C.measure_presets(images, repeats=args.repeats)
    from carraystore.base.resources import available_cpus
    from carraystore.format.codec import PRESETS

    cores = available_cpus()
    if args.read_mbs is not None:
        if not args.read_mbs > 0:
            raise InvalidInputError(f"--read-mbs must be a speed above 0 MB/s, got {args.read_mbs}")
        read_mbs, where = args.read_mbs, f"reading at {args.read_mbs:g} MB/s"
    else:
        if args.probe_mb < 1:
            raise InvalidInputError(f"--probe-mb must be at least 1, got {args.probe_mb}")
        read_mbs, how = C.measure_read_mbs(args.path, args.probe_mb << 20)
        where = f"your disk, cold ({read_mbs:,.0f} MB/s)"
        print(f"Your disk: {read_mbs:,.0f} MB/s read cold ({how}); {cores} cores.\n")
    say("measuring each preset through the loader (a small store of the sample, warm page cache)")
    loader = {name: C.measure_loader(images, name, repeats=args.repeats) for name in PRESETS}
    encoded = None
    if sample.entries is not None:
        say("measuring the encoded layout through the loader (a small encoded store of the sample, warm page cache)")
        encoded = C.measure_encoded_loader(sample.entries, sample.encoding, images.shape[1:], repeats=args.repeats)
    warm_p, cold_p, _ = C.recommend_for_storage(preset_rows, loader, read_mbs)
    warm, cold, table = C.recommend_for_storage(preset_rows, loader, read_mbs, encoded)
    by = {r.dataset: r for r in preset_rows}
    regimes = list(next(iter(table.values())))
    head = [("your disk" if k == "yours" else k) for k in regimes]
    print(
        f"{'Presets and the encoded layout' if encoded else 'Presets'} on your data, {cores} cores: MB/s of images "
        "delivered, measured through the loader from the page cache and modelled at each read speed as "
        "min(read speed x ratio, loader):\n"
    )
    print("| preset | codec | ratio | decompress MB/s 1t | " + " | ".join(head) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(regimes))
    ratios = {n: (by[n].ratio if n in by else encoded[0] if encoded else 0.0) for n in table}
    for name, vals in table.items():
        what, dec = (by[name].label, f"{by[name].decompress_mbs_1t:.0f}") if name in by else (sample.note, "—")
        ratio = ratios[name]
        print(f"| {name} | {what} | {ratio:.3f} | {dec} | " + " | ".join(f"{vals[k]:.0f}" for k in regimes) + " |")
    print()
    if encoded is None:
        print(f"encoded layout: not a candidate ({sample.note})")
    else:
        per_image = images[0].nbytes / 1e6  # MB of pixels per image: the table's MB/s into images/s
        for label, key, pick, preset in (
            ("data in the page cache", "warm page cache", warm, warm_p),
            (where, "yours", cold, cold_p),
        ):
            rate = table[pick][key] / per_image
            if pick == "encoded":
                advice = (
                    f"--layout encoded ({sample.note}: {rate:,.0f} images/s modelled); among pixel presets: "
                    f"{preset} ({table[preset][key] / per_image:,.0f} images/s)"
                )
            else:
                advice = f"--preset {pick} ({rate:,.0f} images/s modelled; --layout encoded {table['encoded'][key] / per_image:,.0f})"
            print(f"recommended for {label}: {advice}")
        print(
            "(the encoded layout keeps the JPEG/PNG files: its pixels are what the reading machine's JPEG decoder "
            "gives, Pillow's (simplejpeg only where it agrees with Pillow there), and another libjpeg build may differ "
            "slightly; a pixel store gives the ingested pixels exactly, on any machine. Write it with: "
            "carraystore ingest SRC OUT.b2nd --layout encoded)"
        )
    print(f"\nrecommended preset for data in the page cache: {warm_p}")
    print(f"recommended preset for {where}: {cold_p}")
    print(f"use it with: carraystore ingest SRC OUT.b2nd --preset {cold_p}   or   carraystore.Codec.preset({cold_p!r})")
    if cold_p != "balanced" and by["balanced"].ratio > by[cold_p].ratio:
        fewer = 1 - by[cold_p].ratio / by["balanced"].ratio
        print(
            f"(the default, balanced, stores {fewer:.0%} fewer bytes: keep it where the store is copied or read over "
            "a network, or where more cores read it)"
        )
    return 0


def _cmd_shuffle(args: argparse.Namespace) -> int:
    from carraystore.engine.shuffle_report import DEFAULT_WINDOW, compare_windows, shuffle_table
    from carraystore.store.reader import StoreReader, open_store

    if args.batch_size < 1:
        raise InvalidInputError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.seed < 0 or args.epoch < 0:
        raise InvalidInputError("--seed and --epoch must be integers >= 0")
    store: StoreReader
    with open_store(args.store) as store:
        rows = compare_windows(store, args.batch_size, args.window, seed=args.seed, epoch=args.epoch)
        print(
            f"# Shuffle quality of {args.store}: {len(store):,} samples in {store.nchunks:,} chunks of "
            f"{store.chunk_images}, batches of {args.batch_size}, seed {args.seed}, epoch {args.epoch}\n"
        )
        print(shuffle_table(rows, store.chunk_nbytes, store.nchunks, default_window=DEFAULT_WINDOW))
    return 0


def _cmd_layout(args: argparse.Namespace) -> int:
    from carraystore.cli.benchmarks.layout import DEFAULT_LINKS_MBIT, measure_layouts, report_text

    report = measure_layouts(
        args.src,
        args.sample,
        seed=args.seed,
        image_size=tuple(args.image_size) if args.image_size else None,
        color_mode=args.color_mode,
        quality=args.quality,
        preset=args.preset,
        cores=args.cores,
        links_mbit=args.link_mbit or DEFAULT_LINKS_MBIT,
        repeats=args.repeats,
        progress=_say(args.quiet),
        decode_size=tuple(args.decode_size) if args.decode_size else None,
    )
    print(report_text(report))
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0

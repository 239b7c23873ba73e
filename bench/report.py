"""Copy the latest benchmark results into the docs.

    python bench/report.py [--results bench/results] [--docs docs]

Reads ``codecs.json``, ``loaders.json`` and ``storage_matrix.json`` (written by ``make bench``) and rewrites the
generated blocks of ``docs/codecs.md``, ``docs/benchmarks.md`` and the README — the text between
``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` — leaving the prose around them alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run as a script: bench.loaders from the repository root

from bench import loaders as L  # noqa: E402
from carraystore.cli.benchmarks import codecs as C  # noqa: E402


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the block ``name`` replaced by ``body`` (the markers must exist)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin not in text or end not in text:
        raise SystemExit(f"report.py: markers {begin} ... {end} not found")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body.rstrip()}\n{end}{tail}"


def _short(r: C.CodecResult) -> str:
    return f"| {r.label} | {r.ratio:.3f} | {r.compress_mbs:,.0f} | {r.decompress_mbs_1t:,.0f} | {r.decompress_mbs_2t:,.0f} |"


def codecs_section(data: dict, rel: str) -> str:
    """Preset rows, the Pareto fronts and the plot, from codecs.json."""
    rows = [C.CodecResult.from_dict(d) for d in data["results"]]
    info = data.get("info", {})
    m = info.get("machine", {})
    head = "| combination | ratio | compress MB/s | decompress MB/s 1 thread | 2 threads |\n|---|---:|---:|---:|---:|"
    out = [
        f"Measured {info.get('date', '?')} on {m.get('cpus', '?')} cores ({m.get('cpu', '?')}), "
        f"blosc2 {info.get('versions', {}).get('blosc2', '?')}; samples: "
        + ", ".join(f"{k} {v}" for k, v in info.get("samples", {}).items())
        + f"; {info.get('combinations', '?')} combinations each, {info.get('seconds', '?')} s in all. "
        "Speeds are MB/s of uncompressed pixels, median of 3 runs.",
        "",
        f"![ratio against decompression speed]({rel}/codecs.png)",
        "",
    ]
    chosen = C.choose_presets(rows, dataset="photos")
    out += ["**Chosen by this run** (from the photos, by the model above):", "", head]
    for name, r in chosen.items():
        out.append(_short(r).replace("| ", f"| `{name}`: ", 1))
    pinned = info.get("pinned_presets", {})
    if pinned:
        out += [
            "",
            "Pinned in `carraystore/format/codec.py` at the time of this run: "
            + "; ".join(f"`{k}` = {v}" for k, v in pinned.items())
            + f"; `Codec()` = {info.get('default_codec', '?')}.",
        ]
    for ds in sorted({r.dataset for r in rows}):
        front = C.pareto_front([r for r in rows if r.dataset == ds])
        out += [
            "",
            f"**Pareto front, {ds}** (no other combination is both smaller and faster to decompress):",
            "",
            head,
        ]
        out += [_short(r) for r in front]
    # every codec x filter at levels 1 and 5, one image per block: the neighbourhood of the presets
    for ds in sorted({r.dataset for r in rows}):
        out += ["", f"**Every codec and filter at levels 1 and 5, one image per block, {ds}:**", "", head]
        sel = [r for r in rows if r.dataset == ds and r.block_images == 1 and r.clevel in (1, 5)]
        out += [_short(r) for r in sorted(sel, key=lambda r: (r.codec, r.filters, r.clevel))]
    blocks = sorted({r.block_images for r in rows})
    out += [
        "",
        "**Images per block** (zstd-1 and zstd-5, shuffle+bytedelta):",
        "",
        "| dataset | combination | " + " | ".join(f"ratio b{b}" for b in blocks) + " |",
        "|---|---|" + "---:|" * len(blocks),
    ]
    for ds in sorted({r.dataset for r in rows}):
        for lvl in (1, 5):
            cells = []
            for b in blocks:
                m = [
                    r
                    for r in rows
                    if r.dataset == ds
                    and r.codec == "zstd"
                    and r.clevel == lvl
                    and r.filters == "shuffle+bytedelta"
                    and r.block_images == b
                ]
                cells.append(f"{m[0].ratio:.3f}" if m else "—")
            out.append(f"| {ds} | zstd-{lvl} shuffle+bytedelta | " + " | ".join(cells) + " |")
    out += ["", f"The full table ({len(rows)} rows): [{rel}/codecs.md]({rel}/codecs.md)."]
    return "\n".join(out)


def loaders_section(data: dict, rel: str) -> str:
    """The loader table, machine, versions and goals, from loaders.json."""
    cmp = L.Comparison.from_json(data)
    text = L.markdown_report(cmp, heading="").lstrip()
    return text + f"\n![images/s by loader]({rel}/loaders.png)\n"


def regimes_section(data: dict, rel: str) -> str:
    """The presets (block shuffle) against the fastest on-disk peer, warm and cold, from loaders.json."""
    cmp = L.Comparison.from_json(data)
    ok = {r.name: r for r in cmp.rows if r.status == "ok"}
    disk = [r for r in ok.values() if r.name in L.ON_DISK]
    i = cmp.info
    out = [
        f"{i.get('images')} photos of {'x'.join(map(str, i.get('image_shape', [])))}, batch {i.get('batch_size')}, "
        f"{i.get('machine', {}).get('cpus')} cores, median of {i.get('epochs')} rounds "
        f"(full table: [benchmarks.md](benchmarks.md)):",
        "",
        "| | images/s warm | images/s cold | MB on disk |",
        "|---|---:|---:|---:|",
    ]
    for name in ("fast", "balanced", "small"):
        r = ok.get(f"carraystore_{name}_block")
        if r:
            out.append(
                f"| carraystore `{name}`, block shuffle | {r.images_per_s_warm:,.0f} | {r.images_per_s_cold or 0:,.0f} | {r.bytes_on_disk / 1e6:,.0f} |"
            )
    if disk:
        w = max(disk, key=lambda r: r.images_per_s_warm or 0)
        c = max(disk, key=lambda r: r.images_per_s_cold or 0)
        out.append(
            f"| fastest on-disk peer, warm: {w.label} | {w.images_per_s_warm:,.0f} | {w.images_per_s_cold or 0:,.0f} | {w.bytes_on_disk / 1e6:,.0f} |"
        )
        if c is not w:
            out.append(
                f"| fastest on-disk peer, cold: {c.label} | {c.images_per_s_warm:,.0f} | {c.images_per_s_cold or 0:,.0f} | {c.bytes_on_disk / 1e6:,.0f} |"
            )
    npz = ok.get("npz_cache")
    if npz:
        out.append(
            f"| `np.savez_compressed` cache | {npz.images_per_s_warm:,.0f} | {npz.images_per_s_cold or 0:,.0f} | {npz.bytes_on_disk / 1e6:,.0f} |"
        )
    return "\n".join(out)


def matrix_section(data: dict, rel: str) -> str:
    """The storage-speed matrix and the storage rule against it, from storage_matrix.json."""
    from bench.loaders.matrix import matrix_markdown

    return (
        matrix_markdown(data, heading="").lstrip()
        + f"\nAs a file: [{rel}/storage_matrix.md]({rel}/storage_matrix.md).\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(HERE / "results"))
    ap.add_argument("--docs", default=str(HERE.parent / "docs"))
    ap.add_argument("--readme", default=str(HERE.parent / "README.md"))
    args = ap.parse_args(argv)
    results, docs, readme = Path(args.results), Path(args.docs), Path(args.readme)
    done = []
    for path, block, src, render in (
        (docs / "codecs.md", "codecs-results", "codecs.json", codecs_section),
        (docs / "codecs.md", "preset-regimes", "loaders.json", regimes_section),
        (docs / "codecs.md", "storage-matrix", "storage_matrix.json", matrix_section),
        (docs / "benchmarks.md", "loaders-results", "loaders.json", loaders_section),
        (readme, "loaders-results", "loaders.json", loaders_section),
    ):
        if not (results / src).exists():
            print(f"report.py: {results / src} not found; run make bench first", file=sys.stderr)
            continue
        rel = os.path.relpath(results, path.parent)
        text = path.read_text()
        new = replace_block(text, block, render(json.loads((results / src).read_text()), rel))
        path.write_text(new)
        done.append(str(path))
    print("updated " + ", ".join(done) if done else "nothing updated")
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())

"""Write ``store_v0.b2nd``: a store in the SYNTHETIC carraystore format version 0.

Format version 1 is the first real one; version 0 was invented so that the upgrade
registry (``carraystore.migrations.versions``) has a real file to upgrade in the tests.
Its layout is described in that module's docstring: a blosc2 NDArray of shape
(N, H, W, C) whose ``carraystore`` metadata uses other field names (``shape``, ``count``,
``classes``, ``paths``), keeps labels as a plain list, has no checksums, and records the
codec as text (``"zstd:1"``).

Run from the repository root: ``python tests/data/migrate/make_store_v0.py``.
"""

from __future__ import annotations

from pathlib import Path

import blosc2
import numpy as np

from carraystore.ingest.sample_data import load_photo, photo_crops

HERE = Path(__file__).resolve().parent


def main() -> None:
    rng = np.random.default_rng(0)
    classes = ["astronaut", "coffee", "chelsea"]
    images, labels, paths = [], [], []
    for i, name in enumerate(classes):
        for j, crop in enumerate(photo_crops(load_photo(name), 8, (16, 16), rng)):
            images.append(crop)
            labels.append(i)
            paths.append(f"{name}/{j:03d}.jpg")
    order = rng.permutation(len(images))
    x = np.stack([images[k] for k in order])
    out = HERE / "store_v0.b2nd"
    out.unlink(missing_ok=True)
    array = blosc2.asarray(
        x,
        chunks=(10, 16, 16, 3),
        blocks=(5, 16, 16, 3),
        urlpath=str(out),
        mode="w",
        meta={"carraystore": {"format": "carraystore", "format_version": 0}},
        cparams={"codec": blosc2.Codec.ZSTD, "clevel": 1},
    )
    array.schunk.vlmeta["carraystore"] = {
        "format": "carraystore",
        "format_version": 0,
        "shape": [16, 16, 3],
        "dtype": "uint8",
        "count": len(x),
        "codec": "zstd:1",
        "classes": classes,
        "labels": [labels[k] for k in order],
        "paths": [paths[k] for k in order],
        "attrs": {"description": "synthetic format-version-0 fixture", "source": "scikit-image photos"},
    }
    print(f"wrote {out} ({out.stat().st_size} bytes, {len(x)} images)")


if __name__ == "__main__":
    main()

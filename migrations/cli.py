"""``carraystore migrate``: the command line front end of ``carraystore.migrations.migrate``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from carraystore.base.errors import InvalidInputError
from carraystore.store.options import WriteOptions

__all__ = ["register", "run"]

_EPILOG = """\
examples:
  carraystore migrate train_data.bc train.b2nd                 # a bcolz carray (fast.ai save_array)
  carraystore migrate --images trn_x.bc --labels trn_y.bc train.b2nd   # two carrays
  carraystore migrate table.bc out.b2nd --images img --labels label    # a bcolz ctable
  carraystore migrate cache.npz out.b2nd                       # np.savez cache {path: image}
  carraystore migrate data.h5 out.b2nd --dataset images --labels labels
  carraystore migrate splits.h5 stores/                        # groups train/, val/: stores/train.b2nd, stores/val.b2nd
  carraystore migrate splits.h5 data_{group}.b2nd              # the same, named by a pattern
  carraystore migrate splits.h5 train.b2nd --group train       # one split
  carraystore migrate onehot.h5 out.b2nd --onehot-to-class     # one-hot rows (N, K) as class labels
  carraystore migrate images.npy out.b2nd --labels labels.npy  # np.save arrays
  carraystore migrate old.b2nd new.b2nd                        # a store of an older format version
  carraystore migrate train_data.bc s3://bucket/train.b2nd     # staged locally, verified, then uploaded
  carraystore migrate 'shards/train-{000000..000099}.tar' train.b2nd --layout encoded   # WebDataset shards
  carraystore migrate shards/*.tar train.b2nd                  # the same, listed by the shell
  carraystore migrate train.tfrecord train.b2nd --labels image/class/label    # tf.train.Example records
  carraystore migrate hf_dataset/ stores/                      # Parquet/Arrow splits: stores/train.b2nd, ...
  carraystore migrate data/train-00000-of-00001.parquet train.b2nd --groups video_id
"""


def register(subparsers: Any) -> None:
    """Add the ``migrate`` sub-command."""
    p = subparsers.add_parser(
        "migrate",
        help="convert a bcolz array, .npz cache, HDF5 file, WebDataset shards, TFRecord files, Parquet/Arrow tables "
        "or an older store into a store",
        description=(
            "Migrate SRC into the store OUT.b2nd, exactly: every element bit-exact, attrs kept, the source dtype kept. "
            "The store is re-read and compared with the source before it is renamed into place; the source is never "
            "modified. SRC may be a bcolz carray or ctable folder (any bcolz 0.7 - 1.2.1, bcolz-zipline; bcolz need not "
            "be installed), an .npz file, an HDF5 file, a carraystore store of an older format version, WebDataset tar "
            "shards (files, a {000..099} pattern or URLs), TFRecord files of tf.train.Example (TensorFlow need not be "
            "installed) or Parquet/Arrow tables with an image column (a Hugging Face datasets folder: one store per "
            "split). Images are decoded once, as ingest decodes them; --layout encoded keeps their bytes."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "src",
        nargs="*",
        metavar="SRC",
        help="the source (leave out with --images X.bc --labels Y.bc); several files for WebDataset shards or "
        "TFRecord files",
    )
    p.add_argument(
        "out",
        metavar="OUT.b2nd",
        help="the store to write: a path, or a URL such as s3://bucket/train.b2nd; for an HDF5 file with one group "
        "per split (train/images, val/images, ...): a folder (OUT/train.b2nd, ...) or a name with {group}",
    )
    p.add_argument(
        "--images",
        metavar="NAME",
        help="ctable column / HDF5 dataset / npz member / WebDataset member type (jpg, seg.png) / TFRecord feature / "
        "Parquet column with the images; or, without SRC, a bcolz carray folder",
    )
    p.add_argument(
        "--labels",
        metavar="NAME",
        help="column / dataset / member with the labels (HDF5, npz: inferred when exactly one "
        "integer array has one value per row); or, without SRC, a bcolz carray folder of labels",
    )
    p.add_argument(
        "--keys",
        metavar="NAME",
        help="WebDataset, TFRecord, Parquet: the member / feature / column with each image's key (default: "
        "WebDataset's sample keys, image/filename, the image's path)",
    )
    p.add_argument(
        "--groups",
        metavar="NAME",
        help="WebDataset, TFRecord, Parquet: the member / feature / column naming each image's group (a video, "
        "a session): splits and clips keep groups whole",
    )
    p.add_argument(
        "--layout",
        choices=["pixels", "encoded"],
        default="pixels",
        help="pixels (default): decoded pixels; encoded: each image as its JPEG/PNG/WebP bytes where they decode to "
        "its pixels, else PNG: the store stays bit-exact (FORMAT.md 10)",
    )
    p.add_argument(
        "--color-mode",
        choices=["grayscale", "rgb", "rgba"],
        default=None,
        help="WebDataset, TFRecord, Parquet: channels of the stored images (default: what holds every image: rgba "
        "if any has alpha, grayscale if all are gray, else rgb)",
    )
    p.add_argument(
        "--image-size",
        nargs=2,
        type=int,
        metavar=("H", "W"),
        help="WebDataset, TFRecord, Parquet: resize every image (bilinear; default: keep size, all must agree)",
    )
    p.add_argument("--dataset", metavar="NAME", help="HDF5: the dataset to migrate (inferred when the file holds one)")
    p.add_argument(
        "--group",
        metavar="NAME",
        help="HDF5: migrate only this group (a split such as train); names given are looked up in it first. A folder "
        "of splits (datasets, Hub Parquet, TFDS TFRecord files): migrate only this split",
    )
    p.add_argument(
        "--onehot-to-class",
        action="store_true",
        help="one-hot label rows (N, K) become class labels (checked: every row exactly one 1, the rest 0); "
        "without it they are kept as a target field",
    )
    p.add_argument(
        "--no-labels",
        action="store_true",
        help="HDF5, npz: migrate without labels (by default a labels "
        "array beside the images is inferred when exactly one fits)",
    )
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="allow pickled data: object arrays in bcolz, .npz and .npy files, pickle files of numpy arrays "
        "(unpickling runs code from the file: only for files you trust)",
    )
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip re-reading the store and comparing it with the source",
    )
    WriteOptions.add_arguments(
        p,
        ("codec", "chunk_images", "class_names", "overwrite", "lock_timeout", "storage_options", "tmp_dir", "progress"),
        helps={
            "class_names": "names of the label values, comma-separated, label 0 first "
            "(default: a class_names / classes / label_names dataset or member, when the source has one)",
            "overwrite": "replace OUT.b2nd if it exists",
            "progress": "quiet: print nothing on success (no progress bar, no summary); errors still go to stderr",
            "lock_timeout": "while another writer holds OUT.b2nd, wait up to SECONDS (default: fail at once); "
            "--wait is the same flag",
        },
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Handle ``carraystore migrate``; returns the exit status (0 done, 1 verification failed)."""
    from carraystore.migrations.core import MigrationVerifyError, migrate, migrate_splits

    src: Any = args.src[0] if len(args.src) == 1 else (args.src or None)
    out = args.out
    if src is None and args.images is None:
        raise InvalidInputError("give SRC and OUT.b2nd, or --images X.bc [--labels Y.bc] OUT.b2nd")
    common: dict[str, Any] = {
        "allow_pickle": args.allow_pickle,
        "verify": args.verify,
        "no_labels": args.no_labels,
        "onehot_to_class": args.onehot_to_class,
        "options": WriteOptions.from_args(args),
        "layout": args.layout,
    }
    for name in ("keys", "groups", "color_mode", "image_size"):  # only the sample formats take them
        if getattr(args, name) is not None:
            common[name] = getattr(args, name)
    try:
        if _splits(args):
            reports = list(migrate_splits(src, out, images=args.images, labels=args.labels, **common).values())
        else:
            reports = [
                migrate(
                    src,
                    out,
                    images=args.images,
                    labels=args.labels,
                    dataset=args.dataset,
                    group=args.group,
                    **common,
                )
            ]
    except MigrationVerifyError as exc:
        print(f"carraystore migrate: verification failed: {exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        print("\n".join(r.summary() for r in reports))  # notes and warnings included
    return 0


def _splits(args: argparse.Namespace) -> bool:
    """Whether SRC is an HDF5 file with one group per split, or a folder of splits, to migrate into one store each."""
    if len(args.src) != 1 or args.group is not None or args.dataset is not None:
        return False
    from pathlib import Path

    p = Path(args.src[0])
    if p.is_dir():
        from carraystore.migrations.detect import sample_splits

        return bool(sample_splits(p))
    if not p.is_file() or args.images is not None:
        return False
    with open(p, "rb") as f:
        if f.read(8) != b"\x89HDF\r\n\x1a\n":
            return False
    from carraystore.migrations.hdf5 import hdf5_split_groups

    return bool(hdf5_split_groups(p))

"""Benchmarks that ship with carraystore so users can measure on their own data.

``carraystore.cli.benchmarks.codecs``: the codec suite (compression ratio and speed of every
blosc2 codec / level / filter / block size on real images; Pareto plot; preset advice).
``carraystore.cli.benchmarks.loaders``: images/s of carraystore against the loaders people
use today (Keras ``load_img``, Pillow, tf.data, TFRecord, ``.npy`` files, ``.npz``,
HDF5, zarr, bcolz, in-memory numpy), each in a fresh process, warm and cold page cache.
``carraystore.cli.benchmarks.datasets``: reproducible photo and video-like image folders
(cached by their parameters) and image-folder decoding shared by both.

The command line front ends are ``carraystore bench codecs PATH`` and
``carraystore bench loaders DIR``; ``make bench`` runs the repository's ``bench/`` suite.
"""

from __future__ import annotations

__all__ = ["codecs", "loaders", "datasets"]

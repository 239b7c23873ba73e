"""Side-by-side loader comparison: the same images through every common way of feeding them.

Peers (each skipped with a reason when its library is missing):

- ``keras_load_img``: ``keras.utils.load_img`` + ``img_to_array`` per file (float32, as
  in the Keras tutorials) — the baseline published caching speedups were measured against;
- ``pillow_threads``: Pillow per file, decoded by a thread pool (one thread per core);
- ``tfdata_jpeg``: tf.data from the JPEG files, ``decode_jpeg`` with parallel map;
- ``tfrecord``: TFRecord shards of JPEG bytes through tf.data (interleaved reads, shuffle buffer);
- ``npy_files``: one ``.npy`` per image, ``np.load`` per file;
- ``npz_cache``: one ``np.savez_compressed`` file, loaded whole every epoch;
- ``hdf5``: h5py, gzip-4, chunks of 32 images, read with a chunk-shuffle generator;
- ``zarr``: zarr v3 with ``BloscCodec()`` defaults, chunks of 32 images, chunk-shuffle generator;
- ``bcolz``: a legacy bcolz carray (lz4, written by ``testsupport.bcolz_writer``, read by ``carraystore.migrations.bcolz``),
  chunk-shuffle generator;
- ``lance``: a Lance dataset of the pixels (pylance), random ``take`` of each batch's rows;
- ``numpy_memory``: the images in RAM, fancy-indexed batches (the upper bound);
- ``carraystore_<preset>_<shuffle>``: ``Store.batches`` with block or global shuffle
  (``carraystore_encoded_block``: the encoded layout, the JPEG files' bytes);
- ``carraystore_from_bcolz_block``: the bcolz peer's carrays migrated with ``migrate``'s defaults.

With ``throttle_mbs`` each round also times a cold epoch whose reads of the disk are
limited to that rate (a cgroup-v1 blkio throttle, :mod:`bench.loaders.throttle`): the
HDD or network-file-system regime; where the machine cannot throttle, it is skipped and
the report says why.

Every on-disk artifact is written in the folder's (class-sorted) order — the worst case
for chunk-level shuffling, which the "distinct labels per batch" column shows.

Every artifact is built first. Then ``epochs`` rounds run every peer once each, in a
fresh Python process (``python -m bench.loaders --child``, from the repository root), so that its
peak RSS (``VmHWM``) is its own and so that other work on the machine falls on all
peers alike. In a round, a peer reads two untimed batches (imports, thread pools,
graph tracing), then its files are evicted from the page cache
(``posix_fadvise(DONTNEED)``) and a cold epoch is timed, then (the cache now holding
the files) a warm epoch. Reported numbers are medians over the rounds.

The package keeps one concern per module: ``peer`` (Context, the Peer interface, epoch
orders), ``file_peers`` and ``array_peers`` (the peers), ``registry`` (the table order,
which can run here), ``artifacts`` (converted copies, built once), ``child`` (one round in
a fresh process), ``comparison`` (the run), ``results`` (rows and goals), ``report``
(tables, chart, files), ``machine`` (what it ran on), ``throttle`` (the throttled disk),
``matrix`` (the storage-speed matrix: these regimes plus a remote link).
"""

from __future__ import annotations

from bench.loaders.array_peers import (
    Bcolz,
    CarrayStore,
    Hdf5,
    Lance,
    MigratedBcolz,
    NpyFiles,
    NpzCache,
    NumpyMemory,
    Zarr,
)
from bench.loaders.artifacts import BUILD_VERSION, build_artifact
from bench.loaders.child import child_main
from bench.loaders.comparison import run_comparison
from bench.loaders.file_peers import KerasLoadImg, PillowThreads, TfDataJpeg, TfRecord
from bench.loaders.machine import library_versions, machine_info
from bench.loaders.peer import PEER_CHUNK, Batch, Context, Peer, chunk_shuffle, index_batches
from bench.loaders.registry import ON_DISK, PEER_BY_NAME, PEERS, available_peers
from bench.loaders.report import (
    goals_text,
    markdown_report,
    plot_results,
    results_table,
    write_results,
)
from bench.loaders.results import Comparison, PeerResult, check_goals

__all__ = [
    "PEERS",
    "PEER_BY_NAME",
    "ON_DISK",
    "PEER_CHUNK",
    "BUILD_VERSION",
    "Batch",
    "Context",
    "Peer",
    "KerasLoadImg",
    "PillowThreads",
    "TfDataJpeg",
    "TfRecord",
    "NpyFiles",
    "NpzCache",
    "Hdf5",
    "Zarr",
    "Bcolz",
    "Lance",
    "MigratedBcolz",
    "NumpyMemory",
    "CarrayStore",
    "PeerResult",
    "Comparison",
    "available_peers",
    "build_artifact",
    "child_main",
    "run_comparison",
    "write_results",
    "results_table",
    "goals_text",
    "markdown_report",
    "plot_results",
    "check_goals",
    "index_batches",
    "chunk_shuffle",
    "library_versions",
    "machine_info",
]

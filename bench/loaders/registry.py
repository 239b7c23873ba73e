"""The peers of the comparison, in table order, and which of them can run here."""

from __future__ import annotations

from collections.abc import Sequence

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
from bench.loaders.file_peers import KerasLoadImg, PillowThreads, TfDataJpeg, TfRecord
from bench.loaders.peer import Peer

__all__ = ["PEERS", "PEER_BY_NAME", "ON_DISK", "available_peers"]

#: Every peer, in table order.
PEERS: list[Peer] = [
    KerasLoadImg(),
    PillowThreads(),
    TfDataJpeg(),
    TfRecord(),
    NpyFiles(),
    NpzCache(),
    Hdf5(),
    Zarr(),
    Bcolz(),
    Lance(),
    NumpyMemory(),
    CarrayStore("fast", "block"),
    CarrayStore("balanced", "block"),
    CarrayStore("small", "block"),
    CarrayStore("encoded", "block"),
    MigratedBcolz("block"),
    CarrayStore("fast", "global"),
    CarrayStore("balanced", "global"),
]
PEER_BY_NAME = {p.name: p for p in PEERS}
#: Peers whose data lives on disk (the ones the goals compare against).
ON_DISK = [p.name for p in PEERS if p.on_disk and not isinstance(p, CarrayStore)]


def available_peers(names: Sequence[str] | None = None) -> tuple[list[Peer], dict[str, str]]:
    """The peers that can run here (optionally only ``names``) and a reason for each skipped one."""
    chosen = PEERS if names is None else [PEER_BY_NAME[n] for n in names]
    ok, skipped = [], {}
    for p in chosen:
        why = p.missing()
        if why is None:
            ok.append(p)
        else:
            skipped[p.name] = why
    return ok, skipped

"""Test and benchmark infrastructure, outside the wheel: imported by tests/ and bench/ only.

- ``bcolz_writer``: bcolz carrays and ctables with real c-blosc 1.x chunks (``write_carray``);
- ``netproxy``: a loopback TCP link (round trip, bandwidth cap, injected faults);
- ``servers``: SeaweedFS and a plain HTTP Range server on loopback (``servers`` also runs
  alone as a process: ``python -m testsupport.servers ROOT``);
- ``sourcetree``: the checkout on a child interpreter's path, ``carraystore.migrations`` included;
- ``torchpeers``: MosaicML Streaming and LitData for bench/bench_remote.py, imported only
  in the peers' own environment (``make bench-peers-env``).

Importable from the repository root (pytest puts it on ``sys.path``: ``pythonpath`` in
pyproject.toml; child processes get ``PYTHONPATH`` set to the root).
"""

"""Benchmarks that ship with carraystore so users can measure on their own data.

``codecs``: the codec suite (compression ratio and speed of every blosc2 codec / level /
filter / block size on real images; Pareto plot; preset advice). ``layout``: pixels or
encoded for your images, cores and link. ``datasets``: an image folder's files and labels,
decoded to one array. The command line front ends are ``carraystore bench codecs PATH``,
``bench shuffle STORE`` and ``bench layout SRC``; ``make bench`` runs the repository's
``bench/`` suite (the loader comparison and the remote benchmarks among it).
"""

from __future__ import annotations

__all__ = ["codecs", "datasets", "layout"]

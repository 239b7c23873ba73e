"""Benchmarks users run on their own data: ``carraystore bench codecs|shuffle|layout``.

``codecs``: codec ratio/speed and preset advice; ``layout``: pixels or encoded;
``datasets``: an image folder decoded to one array.
"""

from __future__ import annotations

__all__ = ["codecs", "datasets", "layout"]

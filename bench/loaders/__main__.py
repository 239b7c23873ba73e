"""``python -m bench.loaders DIR``: the loader comparison (``--child SPEC``: one round of one peer)."""

import sys

from bench.loaders.command import main

sys.exit(main())

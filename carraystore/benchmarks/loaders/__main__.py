"""``python -m carraystore.benchmarks.loaders --child SPEC``: one round of one peer."""

import sys

from carraystore.benchmarks.loaders.child import main

sys.exit(main())

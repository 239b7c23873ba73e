"""``python -m carraystore.cli.benchmarks.loaders --child SPEC``: one round of one peer."""

import sys

from carraystore.cli.benchmarks.loaders.child import main

sys.exit(main())

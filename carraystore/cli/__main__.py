"""``python -m carraystore.cli``: the ``carraystore`` command."""

import sys

from carraystore.cli.main import main

sys.exit(main())

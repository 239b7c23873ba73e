"""The package run from this checkout by an interpreter it is not installed in.

``carraystore.migrations`` lives in the top-level ``migrations/`` folder (setuptools
``package-dir``), so ``PYTHONPATH=ROOT`` alone finds ``carraystore`` but not its migrations.
:func:`pythonpath` returns a ``PYTHONPATH`` whose ``sitecustomize`` maps that one package,
as an editable install's finder does.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_SITECUSTOMIZE = """\
import importlib.util
import sys

_MIGRATIONS = {migrations!r}


class _MigrationsFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "carraystore.migrations":
            return None
        return importlib.util.spec_from_file_location(
            name, _MIGRATIONS + "/__init__.py", submodule_search_locations=[_MIGRATIONS]
        )


sys.meta_path.append(_MigrationsFinder)
"""


def pythonpath(folder: Path) -> str:
    """A ``PYTHONPATH`` value for a child interpreter: the checkout and the migrations' mapping (written under ``folder``)."""
    site = folder / "sourcetree-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(migrations=str(ROOT / "migrations")))
    return os.pathsep.join([str(ROOT), str(site)])

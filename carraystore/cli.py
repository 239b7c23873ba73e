"""The ``carraystore`` command line. Thin: every command calls the library.

Sub-commands live in small modules that expose ``register(subparsers)``; each one adds
its parser and sets ``func`` to a handler ``(args) -> int`` (the exit status).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from carraystore._version import __version__
from carraystore.errors import CarrayStoreError

#: Modules that add sub-commands, in the order they appear in --help.
COMMAND_MODULES = (
    "carraystore.commands",
    "carraystore.migrations.cli",
    "carraystore.benchmarks.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="carraystore",
        description="Compressed single-file image stores for Keras and tf.data.",
    )
    parser.add_argument("--version", action="version", version=f"carraystore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # that part is not built yet
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 failed check, 2 usage or input error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CarrayStoreError as exc:
        print(f"carraystore {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"carraystore {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"carraystore {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

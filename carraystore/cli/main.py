"""The ``carraystore`` command line; each module's ``register(subparsers)`` sets ``func(args) -> exit status``."""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys
from collections.abc import Sequence

from carraystore._version import __version__
from carraystore.base.errors import CarrayStoreError

#: Modules that add sub-commands, in the order they appear in --help.
COMMAND_MODULES = (
    "carraystore.cli.commands",
    "carraystore.migrations.cli",
    "carraystore.cli.benchmarks.cli",
)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors suggest the closest command or flag ("did you mean")."""

    def error(self, message: str) -> None:  # type: ignore[override]
        m = re.search(r"invalid choice: '?([^'()]*?)'? \(choose from (.*)\)", message)
        if m:
            choices = [c.strip().strip("'") for c in m.group(2).split(",")]
            close = difflib.get_close_matches(m.group(1), choices, n=1)
            if close and "did you mean" not in message:
                message += f"; did you mean {close[0]!r}?"
        super().error(message)

    def unknown_arguments(self, extra: Sequence[str], argv: Sequence[str] = ()) -> None:
        """Exit with the usage, the unknown arguments and a hint for each (closest flag, or what a flag takes)."""
        flags = sorted(s for s in self._option_string_actions if s.startswith("--"))
        hints = []
        for arg in extra:
            if arg.startswith("-"):
                close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1, cutoff=0.6)
                if close:
                    hints.append(f"{arg.split('=', 1)[0]}: did you mean {close[0]}?")
            elif arg in argv:  # `meta --class-names a b c`: the words after a one-value flag
                i = list(argv).index(arg)
                while i > 0 and not argv[i - 1].startswith("-"):
                    i -= 1
                action = self._option_string_actions.get(argv[i - 1]) if i > 0 else None
                if action is not None and action.nargs is None and action.metavar:
                    hint = f"{argv[i - 1]} takes one value ({action.metavar}): {argv[i - 1]} {action.metavar}"
                    if hint not in hints:
                        hints.append(hint)
        message = f"unrecognized arguments: {' '.join(extra)}"
        if hints:
            message += "\n  " + "\n  ".join(hints)
        self.error(message)


def _subparser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub-)sub-command parser that ``args`` were parsed by (for its usage line)."""
    current = parser
    while True:
        action = next((a for a in current._actions if isinstance(a, argparse._SubParsersAction)), None)
        if action is None:
            return current
        name = getattr(args, action.dest, None)
        if name not in action.choices:
            return current
        current = action.choices[name]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="carraystore",
        description="Compressed single-file image stores for Keras and tf.data.",
    )
    parser.add_argument("--version", action="version", version=f"carraystore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 failed check, 2 usage or input error)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = _subparser(parser, args)
        if isinstance(sub, _Parser):
            sub.unknown_arguments(extra, list(argv) if argv is not None else sys.argv[1:])
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return status
    except BrokenPipeError:
        # the reader went away (``| head -1``): stop quietly; /dev/null so the final flush cannot fail
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, what a shell reports for a process ended by a closed pipe
    except CarrayStoreError as exc:
        print(f"carraystore {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the OS refused: missing, a file where a folder goes, permissions
        print(f"carraystore {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"carraystore {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

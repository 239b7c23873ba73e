"""WriteOptions: the one frozen value of the options every store writer takes.

``create``, ``append``, ``migrate``, ``copy``, ``from_directory`` and ``from_dask`` take
``options=WriteOptions(...)`` or the same fields as keywords (:class:`WriteKwargs`), joined by
:meth:`WriteOptions.merged`; :meth:`WriteOptions.add_arguments` gives them as CLI flags.

- ``codec``: a :class:`~carraystore.format.codec.Codec`, a preset name (``fast``, ``balanced``,
  ``small``) or None: ``balanced`` for a new store, the pinned codec for an append (checked)
- ``chunk_images``: items per chunk; None: about 4 MiB per chunk
- ``class_names``: the names of the label values, label 0 first; each name once
- ``attrs``: JSON-able user metadata kept in the store
- ``overwrite``: replace an existing store at the output
- ``lock_timeout``: seconds to wait for another writer of the output; None: for ever (``--wait``)
- ``storage_options``: fsspec-style options for an output URL
- ``tmp_dir``: where a store bound for a URL is staged (default ``$TMPDIR``)
- ``progress``: a progress bar on stderr (the CLI's unless ``--quiet``)

A field an entry point cannot honour is refused if it would change what is written (``copy``
is byte for byte), ignored if it only concerns how the write runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import numbers
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from carraystore.base.errors import InvalidInputError
from carraystore.format.codec import PRESETS, Codec

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["WriteOptions", "WriteKwargs", "WRITE_OPTION_FIELDS", "attr_arg", "json_object_arg"]


def _copied_map(value: Any, name: str) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidInputError(f"{name} must be a mapping (a dict) or None, got {type(value).__name__}")
    return dict(value)  # a copy: later changes to the caller's dict do not leak in (and it pickles)


class WriteKwargs(TypedDict, total=False):
    """The fields of :class:`WriteOptions` as keywords (``**write: Unpack[WriteKwargs]``); a test keeps them equal."""

    codec: Codec | str | None
    chunk_images: int | None
    class_names: Sequence[str] | None
    attrs: Mapping[str, Any] | None
    overwrite: bool
    lock_timeout: float | None
    storage_options: Mapping[str, Any] | None
    tmp_dir: str | os.PathLike[str] | None
    progress: bool


@dataclass(frozen=True)
class WriteOptions:
    """How a store is written: codec, chunk size, names, and where and how it is written.

    Fields: see the module docstring. Invalid values raise
    :class:`~carraystore.base.errors.InvalidInputError`; ``attrs`` and ``storage_options``
    are copied.
    """

    codec: Codec | str | None = None
    chunk_images: int | None = None
    class_names: Sequence[str] | None = None
    attrs: Mapping[str, Any] | None = None
    overwrite: bool = False
    lock_timeout: float | None = 0.0
    storage_options: Mapping[str, Any] | None = None
    tmp_dir: str | os.PathLike[str] | None = None
    progress: bool = False

    def __post_init__(self) -> None:
        codec = self.codec
        if isinstance(codec, str):
            if codec not in PRESETS:
                raise InvalidInputError(f"unknown preset {codec!r}; choose one of {sorted(PRESETS)}")
        elif codec is not None and not isinstance(codec, Codec):
            raise InvalidInputError(
                f"codec must be a Codec, a preset name ({', '.join(sorted(PRESETS))}) or None, got {type(codec).__name__}"
            )
        n = self.chunk_images
        if n is not None:
            try:
                ok = not isinstance(n, bool) and int(n) == n and n >= 1
            except (TypeError, ValueError, OverflowError):
                ok = False
            if not ok:
                raise InvalidInputError(
                    f"chunk_images must be a positive integer (images per chunk), got {n!r}; "
                    "or None for about 4 MiB per chunk"
                )
        if self.class_names is not None:
            if isinstance(self.class_names, (str, bytes)):
                raise InvalidInputError(
                    f"class_names must be a list of names, got the single string {self.class_names!r}; "
                    "e.g. class_names=['cat', 'dog']"
                )
            names = tuple(str(c) for c in self.class_names)
            seen: set[str] = set()
            for c in names:
                if c in seen:
                    raise InvalidInputError(
                        f"class name {c!r} is listed twice in {list(names)}; class names must be unique"
                    )
                seen.add(c)
            object.__setattr__(self, "class_names", names)
        object.__setattr__(self, "attrs", _copied_map(self.attrs, "attrs"))
        object.__setattr__(self, "storage_options", _copied_map(self.storage_options, "storage_options"))
        for name in ("overwrite", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(f"{name} must be True or False, got {getattr(self, name)!r}")
        t = self.lock_timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, numbers.Real) or math.isnan(t) or t < 0):
            raise InvalidInputError(
                f"lock_timeout must be seconds to wait (a number >= 0; 0 fails at once) or None to wait "
                f"for ever, got {t!r}"
            )
        if self.tmp_dir is not None and not isinstance(self.tmp_dir, (str, os.PathLike)):
            raise InvalidInputError(f"tmp_dir must be a folder path or None, got {type(self.tmp_dir).__name__}")

    # -- joining with the keywords ------------------------------------------------------------
    @classmethod
    def merged(cls, options: WriteOptions | None, where: str, **given: Unpack[WriteKwargs]) -> WriteOptions:
        """``options``, or one built from the keywords ``given`` (a default counts as not given).

        A keyword given with ``options`` must agree with it, else InvalidInputError names
        both; errors are prefixed with ``where``.
        """
        unknown = sorted(set(given) - set(WRITE_OPTION_FIELDS))
        if unknown:
            raise TypeError(f"WriteOptions has no field(s) {unknown}")
        if options is None:
            try:
                return cls(**given)
            except InvalidInputError as exc:
                raise InvalidInputError(f"{where}: {exc}") from None
        if not isinstance(options, WriteOptions):
            raise InvalidInputError(
                f"{where}: options must be a carraystore.WriteOptions, got {type(options).__name__}"
            )
        conflicts = [
            f"{name}={value!r} (options has {getattr(options, name)!r})"
            for name, value in given.items()
            if not _same(value, _DEFAULTS[name]) and not _same(value, getattr(options, name))
        ]
        if conflicts:
            raise InvalidInputError(
                f"{where}: {', '.join(conflicts)} given both as a keyword and in options; "
                "give each setting once, in options or as a keyword"
            )
        return options

    def refuse(self, fields: Sequence[str], where: str, why: str) -> None:
        """Raise InvalidInputError when any of ``fields`` is set (not its default): the entry point cannot honour it."""
        bad = [f"{f}={getattr(self, f)!r}" for f in fields if not _same(getattr(self, f), _DEFAULTS[f])]
        if bad:
            raise InvalidInputError(f"{where}: {', '.join(bad)} cannot be used here: {why}")

    def replace(self, **changes: Any) -> WriteOptions:
        """A copy with ``changes`` (checked like a new value)."""
        return dataclasses.replace(self, **changes)

    # -- the command line ---------------------------------------------------------------------
    @staticmethod
    def add_arguments(
        parser: argparse.ArgumentParser, fields: Sequence[str] | None = None, helps: Mapping[str, str] | None = None
    ) -> None:
        """Add the flags of ``fields`` (default all; ``_FLAGS``) to ``parser``; ``helps``: help texts."""
        helps = dict(helps or {})
        for name in fields if fields is not None else WRITE_OPTION_FIELDS:
            if name not in _CLI_HELP:
                raise ValueError(f"WriteOptions has no field {name!r}")
            text = helps.get(name, _CLI_HELP[name])
            if name == "codec":
                group = parser.add_mutually_exclusive_group()
                group.add_argument("--preset", choices=sorted(PRESETS), help=text)
                group.add_argument(
                    "--codec-config", metavar="JSON", help='an explicit codec, e.g. \'{"codec": "zstd", "clevel": 3}\''
                )
            else:
                flags, kwargs = _FLAGS[name]
                parser.add_argument(*flags, help=text, **kwargs)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> WriteOptions:
        """The WriteOptions of parsed flags (``progress`` only on a terminal); ``overrides`` set fields."""
        values: dict[str, Any] = {}
        if getattr(args, "codec_config", None):
            try:
                values["codec"] = Codec.from_config(json.loads(args.codec_config))
            except json.JSONDecodeError as exc:
                raise InvalidInputError(f"--codec-config is not valid JSON: {exc}") from exc
        elif getattr(args, "preset", None):
            values["codec"] = args.preset
        for name in ("chunk_images", "class_names", "lock_timeout", "storage_options", "tmp_dir"):
            if getattr(args, name, None) is not None:
                values[name] = getattr(args, name)
        if getattr(args, "attrs", None):
            values["attrs"] = dict(args.attrs)
        if getattr(args, "overwrite", False):
            values["overwrite"] = True
        if hasattr(args, "quiet"):
            values["progress"] = not args.quiet and sys.stderr.isatty()
        values.update(overrides)
        return cls(**values)


#: The field names, in order.
WRITE_OPTION_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(WriteOptions))
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(WriteOptions)}

_CLI_HELP = {
    "codec": "codec preset of the new store: fast, balanced (default) or small; see docs/codecs.md",
    "chunk_images": "images per chunk (default: about 4 MiB per chunk)",
    "class_names": "names of the label values, comma-separated, label 0 first",
    "attrs": "set an attr (repeatable); VALUE is read as JSON when it parses (3, true, [1,2]), else as text",
    "overwrite": "replace the output store if it exists",
    "lock_timeout": "while another writer holds the output store, wait up to SECONDS (default 0: fail at once); "
    "--wait is the same flag",
    "storage_options": "options for an s3:// or gs:// output, as pandas/zarr take them (the AWS_* environment works too)",
    "tmp_dir": "where a store bound for a URL is staged before its upload (default: $TMPDIR)",
    "progress": "no progress bar",
}


def _same(a: Any, b: Any) -> bool:
    """Whether two values of one field mean the same (a preset name and its Codec, a list and a tuple)."""
    if isinstance(a, str) and a in PRESETS:
        a = PRESETS[a]
    if isinstance(b, str) and b in PRESETS:
        b = PRESETS[b]
    a, b = (x.tolist() if hasattr(x, "tolist") else x for x in (a, b))  # numpy arrays of names
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return tuple(str(x) for x in a) == tuple(str(x) for x in b)
    if isinstance(a, os.PathLike) or isinstance(b, os.PathLike):
        return a is not None and b is not None and os.fspath(a) == os.fspath(b)
    try:
        return bool(a == b)
    except Exception:  # an object whose == does not give one truth value
        return a is b


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if math.isnan(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be seconds >= 0, got {text!r}")
    return value


def _names(text: str) -> tuple[str, ...]:
    return tuple(c.strip() for c in text.split(","))


def attr_arg(text: str) -> tuple[str, Any]:
    """``--attr KEY=VALUE``: VALUE as JSON when it parses (3, true, [1,2]), else as text."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def json_object_arg(text: str) -> dict[str, Any]:
    """A flag's JSON object (``--storage-options``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('must be a JSON object, e.g. \'{"endpoint_url": "http://127.0.0.1:8333"}\'')
    return value


#: Each field's flags and their argparse settings (``codec`` is two exclusive flags: ``add_arguments``).
_FLAGS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "chunk_images": (("--chunk-images",), dict(type=_positive_int, metavar="N")),
    "class_names": (("--class-names",), dict(type=_names, metavar="A,B,C")),
    "attrs": (("--attr",), dict(dest="attrs", action="append", type=attr_arg, metavar="KEY=VALUE")),
    "overwrite": (("--overwrite",), dict(action="store_true")),
    "lock_timeout": (
        ("--lock-timeout", "--wait"),
        dict(dest="lock_timeout", type=_seconds, default=0.0, metavar="SECONDS"),
    ),
    "storage_options": (("--storage-options",), dict(type=json_object_arg, metavar="JSON")),
    "tmp_dir": (("--tmp-dir",), dict(metavar="DIR")),
    "progress": (("-q", "--quiet"), dict(action="store_true")),
}

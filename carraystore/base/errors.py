"""Exception classes. Every error carraystore raises derives from CarrayStoreError."""

from __future__ import annotations

__all__ = [
    "CarrayStoreError",
    "FormatError",
    "NotAStoreError",
    "FormatVersionError",
    "UnknownCodecError",
    "CodecMismatchError",
    "CorruptStoreError",
    "ChecksumError",
    "EncodedImageError",
    "MetadataChecksumError",
    "MetadataTooLargeError",
    "StoreChangedError",
    "StaleJournalError",
    "CacheFolderError",
    "StoreExistsError",
    "InvalidInputError",
    "CodecRoundTripError",
    "ImageDecodeError",
    "IngestError",
    "ManifestError",
    "GroupSplitError",
    "ShortGroupsWarning",
    "FrameSplitWarning",
    "MigrationError",
    "MissingDependencyError",
    "LoaderError",
    "WriteError",
    "NoSpaceError",
    "ClipError",
    "LoaderChecksumError",
    "StoreLockedError",
    "RemoteReadError",
    "UploadError",
]


class CarrayStoreError(Exception):
    """Base class of every error raised by carraystore."""


class FormatError(CarrayStoreError):
    """The file's metadata breaks the format specification (FORMAT.md)."""


class NotAStoreError(FormatError):
    """The file is not a carraystore store (no carraystore metadata)."""


class FormatVersionError(FormatError):
    """The store's format version is newer than this reader knows."""


class UnknownCodecError(FormatError):
    """A codec, filter or split mode name that this version does not know."""


class CodecMismatchError(FormatError):
    """The codec recorded in the metadata differs from the file's real headers."""


class CorruptStoreError(CarrayStoreError):
    """The file is truncated, damaged or inconsistent."""


class EncodedImageError(CorruptStoreError):
    """An image of an encoded store (FORMAT.md 10) fails to decode or to match its record (message names the item)."""


class ChecksumError(CorruptStoreError):
    """A compressed chunk does not match its recorded CRC32."""


class MetadataChecksumError(ChecksumError):
    """The metadata record does not match its recorded CRC-32 (FORMAT.md 4.3)."""


class MetadataTooLargeError(CorruptStoreError):
    """The metadata record would decompress to more than the format allows for the store's size."""


class StoreChangedError(CarrayStoreError):
    """The store was appended to or replaced after something (e.g. a ``to_dask`` graph) was built on it; build again."""


class StaleJournalError(CorruptStoreError):
    """A rollback journal was not made for the file now beside it; never applied (delete it if the file is wanted)."""


class StoreExistsError(CarrayStoreError, FileExistsError):
    """The output path already exists and overwriting was not asked for."""


class InvalidInputError(CarrayStoreError, ValueError):
    """Arguments or data handed to carraystore are not acceptable."""


class CodecRoundTripError(InvalidInputError):
    """A custom filter chain made a chunk that does not round-trip (blosc2 mis-decodes some); nothing stored."""


class CacheFolderError(InvalidInputError, OSError):
    """A chunk-cache folder not this user's own: a link, not a folder, another user's, or writable by others."""


class ImageDecodeError(CarrayStoreError):
    """An image file could not be decoded (corrupt, truncated, not an image, too large)."""


class IngestError(CarrayStoreError):
    """Ingesting a folder of images failed."""


class ManifestError(IngestError):
    """A targets manifest (CSV or JSON lines of per-file fields) is malformed or does not match the files."""


class GroupSplitError(IngestError):
    """A validation split that keeps whole groups (videos, sessions) cannot leave both parts non-empty."""


class ShortGroupsWarning(UserWarning):
    """A warning, not an error: some groups (videos, sessions) are shorter than ``sequence_length``
    and give no clip (``warnings.filterwarnings("error", category=ShortGroupsWarning)`` makes it one)."""


class FrameSplitWarning(UserWarning):
    """A warning, not an error: a validation split of files that look like frames of sequences, made
    without groups, puts neighbouring frames in both parts (``warnings.filterwarnings("error",
    category=FrameSplitWarning)`` makes it one)."""


class MigrationError(CarrayStoreError):
    """Migrating a legacy array or file into a store failed."""


class MissingDependencyError(CarrayStoreError, ImportError):
    """An optional dependency is needed for this operation; the message says what to install."""


class LoaderError(CarrayStoreError):
    """A loader thread failed while reading or transforming a chunk."""


class WriteError(CarrayStoreError, OSError):
    """Writing a file failed (the file system refused the write); the temporary file is removed."""


class NoSpaceError(WriteError):
    """The file system ran out of space while a store or an exported file was written."""


class StoreLockedError(CarrayStoreError):
    """Another writer (append, ingest, migrate, create) holds the store's writer lock."""


class RemoteReadError(CarrayStoreError, OSError):
    """Bytes of a remote store could not be read, after retries; the message and ``url``, ``offset``,
    ``length``, ``attempts`` name what failed."""

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        offset: int | None = None,
        length: int | None = None,
        attempts: int = 0,
    ) -> None:
        super().__init__(message)
        self.url = url
        self.offset = offset
        self.length = length
        self.attempts = attempts

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UploadError(CarrayStoreError):
    """Writing a store to object storage failed; nothing was published at the URL."""


class ClipError(InvalidInputError):
    """``sequence_length=`` cannot make clips from this store (shuffled, or groups too short)."""


class LoaderChecksumError(LoaderError, ChecksumError):
    """A loader read a chunk that fails its CRC32 check (``err.chunk`` names it)."""

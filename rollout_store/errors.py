"""One error tree for the library.

Every error raised on purpose derives from `RolloutStoreError`; errors from dependencies
(msgpack, the file system layer) are re-raised as one of these, naming where the problem is.
"""

from __future__ import annotations

__all__ = [
    "RolloutStoreError",
    "InvalidValueError",
    "DuplicateNodeError",
    "CorruptFileError",
    "ChecksumMismatch",
    "UnsupportedVersionError",
    "FileLockedError",
]


class RolloutStoreError(Exception):
    """Base class of every error this library raises on purpose."""


class InvalidValueError(RolloutStoreError, TypeError, ValueError):
    """A value handed to the graph cannot be recorded exactly.

    It is both a `TypeError` (a value of a type JSON cannot carry) and a `ValueError`
    (a cycle, nesting too deep), so callers may catch either. `path` names the bad value,
    for example ``request_messages[3].content[1].image_url``.
    """

    def __init__(self, message: str, path: str) -> None:
        super().__init__(f"{message} - at {path}")
        self.path = path
        self.reason = message


class DuplicateNodeError(RolloutStoreError, ValueError):
    """A turn was added with a `node_id` the graph already holds."""


class CorruptFileError(RolloutStoreError, ValueError):
    """A rollout file is damaged, cut short or not a rollout file.

    `offset` is the byte offset of the first bad record (or None when it is the file as a
    whole), `record` its index in the file.
    """

    def __init__(self, message: str, *, offset: int | None = None, record: int | None = None):
        where = []
        if record is not None:
            where.append(f"record {record}")
        if offset is not None:
            where.append(f"offset {offset}")
        super().__init__(f"{message} (at {', '.join(where)})" if where else message)
        self.offset = offset
        self.record = record
        self.reason = message


class ChecksumMismatch(CorruptFileError):
    """A record's or blob's checksum does not match its content."""

    def __init__(
        self,
        what: str,
        expected: bytes | int,
        actual: bytes | int,
        *,
        offset: int | None = None,
        record: int | None = None,
    ) -> None:
        exp = expected.hex() if isinstance(expected, bytes) else f"{expected:#x}"
        act = actual.hex() if isinstance(actual, bytes) else f"{actual:#x}"
        super().__init__(
            f"{what} checksum mismatch: expected {exp}, got {act}", offset=offset, record=record
        )
        self.expected = expected
        self.actual = actual


class UnsupportedVersionError(CorruptFileError):
    """The file was written by a newer or unknown version of the format."""


class FileLockedError(RolloutStoreError, OSError):
    """A rollout file is already open for appending by another process (nothing is damaged:
    close the other graph, or open another file)."""

"""One error tree for the library.

Every error raised on purpose derives from `RolloutStoreError`; errors from dependencies
(msgpack, the file system layer) are re-raised as one of these, naming where the problem is.
A file that cannot be opened at all raises the standard `OSError`, as `open()` would; a write
that fails once the library has the file (a full disk) is a `FileWriteError`.
"""

from __future__ import annotations

__all__ = [
    "RolloutStoreError",
    "InvalidValueError",
    "DuplicateNodeError",
    "CorruptFileError",
    "ChecksumMismatch",
    "UnsupportedVersionError",
    "IndexKeyMismatch",
    "IndexKeyRecomputeError",
    "StoreError",
    "StoreUnavailableError",
    "MissingObjectError",
    "CorruptObjectError",
    "StoreRequiredError",
    "StoreObjectError",
    "MissingStoreObjectError",
    "DamagedStoreObjectError",
    "FileLockedError",
    "FileWriteError",
    "FileSyncError",
    "InvalidArgumentError",
    "ReadOnlyError",
    "RecordTooLargeError",
    "UnknownNodeError",
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


class IndexKeyMismatch(CorruptFileError):
    """A turn record names an index key its content does not give (`verify` recomputes
    them; `load` trusts them). `field` is the key ("request", "token", "prompt" or "roots"),
    `node_id` the turn, `recorded` the record's value and `expected` the recomputed one."""

    def __init__(
        self,
        message: str,
        *,
        field: str,
        node_id: str,
        recorded: object,
        expected: object,
        offset: int,
        record: int,
    ) -> None:
        super().__init__(
            f"{message}: the record was changed after it was written (its content is intact, "
            "but turns added to the loaded graph could link to a wrong parent); restore the "
            "file from a copy, or load it with recover=True, which recomputes every key, "
            "and save it",
            offset=offset,
            record=record,
        )
        self.field = field
        self.node_id = node_id
        self.recorded = recorded
        self.expected = expected


class IndexKeyRecomputeError(CorruptFileError):
    """`verify` could not recompute a turn record's index keys from its content (`cause`
    says why), so it cannot vouch for them. The content is intact: `load` files the turn
    under the keys its record names, as it files every turn, and so does `load(recover=True)`,
    listing it in `LoadReport.unkeyed`. `node_id` is the turn, `cause` what failed."""

    def __init__(self, *, node_id: str, cause: str, offset: int, record: int) -> None:
        super().__init__(
            f"turn {node_id!r}: its index keys cannot be recomputed from its content "
            f"({cause}), so they are not checked; its content is intact: load (and "
            "recover=True, which lists it in load_report.unkeyed) keeps it and every later "
            "turn, this one filed under the keys its record names (a turn added to the "
            "loaded graph may not find it as its parent); please report the file",
            offset=offset,
            record=record,
        )
        self.node_id = node_id
        self.cause = cause


# ---------------------------------------------------------------- content stores


class StoreError(RolloutStoreError):
    """A content store could not do what was asked; `key` is the object's key (or None)."""

    def __init__(self, message: str, *, key: bytes | None = None) -> None:
        super().__init__(f"{message} (key {key.hex()})" if key is not None else message)
        self.key = key
        self.reason = message


class StoreUnavailableError(StoreError, ConnectionError):
    """The store did not answer (down, timed out, refused) after its bounded retries.

    Nothing was recorded: retry once the store is back.
    """


class MissingObjectError(StoreError, LookupError):
    """No object under `key` in the store."""


class CorruptObjectError(StoreError, ValueError):
    """An object read from a store does not hash to its key (damaged or tampered with).

    `expected` is the key, `actual` the digest of what the store returned; the bytes are never
    handed on.
    """

    def __init__(self, message: str, *, key: bytes, actual: bytes) -> None:
        super().__init__(f"{message}: its content hashes to {actual.hex()}", key=key)
        self.expected = key
        self.actual = actual


class StoreRequiredError(StoreError, ValueError):
    """A file keeps its long strings in a content store (saved with ``blobs="store"``) and
    was read without one: pass ``store=`` to `load` or `open`."""


class StoreObjectError(StoreError):
    """A blob record of a file names an object its content store does not have
    (`MissingStoreObjectError`) or has damaged (`DamagedStoreObjectError`). `key` is the
    object's key; `offset` and `record` place the blob record in the file."""

    offset: int | None  # (always set: typed as `CorruptFileError` types them)
    record: int | None

    def __init__(self, message: str, *, key: bytes, offset: int, record: int) -> None:
        Exception.__init__(
            self, f"{message} (key {key.hex()}; at record {record}, offset {offset})"
        )
        self.key = key
        self.reason = message
        self.offset = offset
        self.record = record


class MissingStoreObjectError(StoreObjectError, MissingObjectError):
    """The content store has no object a blob record of the file names. The file is not
    damaged: it was most likely read with another store than the one it was saved with.
    `store` names the store as the message does."""

    def __init__(self, *, key: bytes, store: str, offset: int, record: int) -> None:
        message = f"object {key.hex()} not found in store {store} (is it the right store?)"
        Exception.__init__(
            self, f"{message}; the file names it at record {record}, offset {offset}"
        )
        self.key = key
        self.reason = message
        self.offset = offset
        self.record = record
        self.store = store


class DamagedStoreObjectError(StoreObjectError, CorruptFileError):
    """The object a blob record names is in the content store but damaged (it does not hash
    to its key, or not to the record's digest)."""


class FileLockedError(RolloutStoreError, OSError):
    """A rollout file is already open for appending by another process (nothing is damaged:
    close the other graph, or open another file)."""


class FileWriteError(RolloutStoreError, OSError):
    """Writing a rollout file failed (a full disk, a quota, an I/O error). Nothing of the
    failed write is kept: the file, and the graph, are as they were before the call. It is an
    `OSError` with the system's `errno` and `strerror`; free space or fix the file, then call
    again."""


class FileSyncError(RolloutStoreError, OSError):
    """Syncing a rollout file's writes to disk failed at the end of a `group_commit` (an I/O
    error). Unlike a `FileWriteError`, what was written stays in the file and in the graph,
    not known to be on disk yet: the next synced write, or `close`, syncs it again. It is an
    `OSError` with the system's `errno` and `strerror`."""


class InvalidArgumentError(RolloutStoreError, TypeError, ValueError):
    """An argument the library cannot work with: a setting out of range, an unknown mode, an
    object of the wrong kind, or an operation the object's state forbids. Fix the call; a
    `TypeError` and a `ValueError`, like `InvalidValueError`."""


class UnknownNodeError(RolloutStoreError, KeyError):
    """No turn with this node id is in the graph (a `KeyError`)."""


class ReadOnlyError(RolloutStoreError, AttributeError):
    """An attribute of an immutable object was set (a node view, a blob handle)."""


class RecordTooLargeError(RolloutStoreError, ValueError):
    """A record or string is larger than a frame of the file can hold (4 GiB)."""

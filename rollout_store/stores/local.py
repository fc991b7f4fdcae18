"""Content store backends of one machine: `MemoryStore` (one process) and `DirectoryStore`.

`MemoryStore` is the reference every backend must match (tests/stores/test_stores.py runs one
contract suite over all of them). `DirectoryStore` is for many processes on one machine: an
object is written to a temporary file, flushed to disk, then linked under its final name, so
a process killed at any moment leaves either the whole object or none under its key (at most
a stray temporary file, which `remove_temporaries` deletes). A put over an object that does not
hold the content of its key (damaged behind the store's back) replaces it, atomically: every
backend heals that way, so one damaged object never spoils the later turns that store its
content again. Redis and S3 backends are in
`redis_store` and `s3_store`; `open_store` opens any of them from its name on a command line.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import secrets
import shutil
import stat
import tempfile
import threading
import time
from array import array
from collections.abc import Iterator
from pathlib import Path

from .._core import KeyNumbers
from ..errors import InvalidArgumentError, MissingObjectError, StoreError, StoreUnavailableError
from ..folders import sync_folder
from .content import KEY_SIZE, ContentStore, check_key, content_key, index_key, verified

__all__ = ["STORE_HELP", "DirectoryStore", "MemoryStore", "open_store", "store_spec"]


class MemoryStore:
    """Objects in this process's memory, shared by every graph handed this store.

    Strings that graphs store are kept as the `str` objects themselves (`put_text`,
    `get_text`): every graph over this store shares one object per distinct string. Keys are
    computed here, on put, from the bytes; Python's bytes and str objects are immutable, so
    what is read back is what was hashed. `get` of a string encodes it again (a file being
    written, another process's copy). The keys are kept side by side in one buffer and found
    through the engine's index of their first 8 bytes (`_core.KeyNumbers`): no object a key.
    """

    def __init__(self) -> None:
        self._keys = bytearray()  # object i's key at [32 i, 32 i + 32)
        self._values: list[bytes | str] = []  # object i
        self._numbers = KeyNumbers()  # a key's first 8 bytes -> the numbers of its objects
        self._tokens: dict[bytes, array[int]] = {}  # shared token arrays, by SHA-256
        self._small: dict[bytes | str, bytes | str] = {}  # see `share_small`
        self._lock = threading.Lock()
        self.nbytes = 0  # bytes of all objects (UTF-8 for strings)

    def __repr__(self) -> str:
        return f"MemoryStore({len(self._values)} objects, {self.nbytes} bytes)"

    def __len__(self) -> int:
        return len(self._values)

    def _find(self, key: bytes) -> int | None:
        """The number of the object under `key` (a well-formed key), or None."""
        keys, found = self._keys, self._numbers.get(index_key(key))
        if type(found) is int:  # (one object under these 8 bytes: mostly)
            at = found * KEY_SIZE
            return found if keys[at : at + KEY_SIZE] == key else None
        for number in found or ():  # type: ignore[union-attr]  # (a tuple: several)
            at = number * KEY_SIZE
            if keys[at : at + KEY_SIZE] == key:
                return number
        return None

    def _add(self, key: bytes, value: bytes | str, data: bytes) -> bytes | str:
        """Store `value` (whose bytes are `data`) under `key` unless an intact object is
        there; the object now stored. A damaged one (`_holds` fails) is replaced."""
        with self._lock:
            number = self._find(key)
            if number is None:
                self._append(key, value)
                self.nbytes += len(data)
                return value
            found = self._values[number]
            if _holds(found, data):
                return found
            self._values[number] = value
            self.nbytes += len(data) - _size(found)
            return value

    def put(self, data: bytes) -> bytes:
        data = bytes(data)
        key = content_key(data)
        self._add(key, data, data)
        return key

    def put_text(self, text: str, data: bytes, key: bytes | None = None) -> bytes:
        if key is None:
            key = content_key(data)
        if self.intact(key, text, data) is None:
            self._add(key, text, data)
        return key

    def intact(self, key: bytes, value: bytes | str, data: bytes) -> bytes | str | None:
        """The object stored under `key` if it is `value` (whose bytes are `data`), else None
        (absent or damaged); nothing changes."""
        number = self._find(key)
        if number is None:
            return None
        found = self._values[number]
        if type(found) is type(value):
            return found if found == value else None
        return found if _holds(found, data) else None

    def share_bytes(self, data: bytes) -> bytes:
        key = content_key(data)
        found = self._add(key, bytes(data), data)
        if type(found) is str:  # (only a blob table's strings are str: never equal bytes)
            return bytes(data)
        return found  # type: ignore[return-value]

    def share_tokens(self, tokens: array[int]) -> array[int]:
        key = content_key(tokens.tobytes())
        with self._lock:
            found = self._tokens.get(key)
            if found is None or found.typecode != tokens.typecode:
                self._tokens[key] = found = tokens
        return found

    def share_small(self, value: bytes | str) -> bytes | str:
        """An object equal to `value` (a short packed value such as sampling parameters, or a
        model name) that every graph over this store holds: the first one given. Not an
        object of the store (nothing to put, get or verify), as `share_tokens`."""
        with self._lock:
            return self._small.setdefault(value, value)

    def _number(self, key: bytes) -> int:
        number = self._find(check_key(key))
        if number is None:
            raise MissingObjectError("no such object in the memory store", key=key)
        return number

    def get(self, key: bytes) -> bytes:
        value = self._values[self._number(key)]
        if type(value) is str:
            value = value.encode("utf-8", "surrogatepass")
        return verified(key, value, "the memory store")  # type: ignore[arg-type]

    def get_text(self, key: bytes) -> str:
        number = self._number(key)
        value = self._values[number]
        if type(value) is str:
            return value
        text = verified(key, value, "the memory store").decode("utf-8", "surrogatepass")  # type: ignore[arg-type]
        with self._lock:  # from now on the string itself is shared
            self._values[number] = text
        return text

    def contains(self, key: bytes) -> bool:
        return self._find(check_key(key)) is not None

    def keys(self) -> Iterator[bytes]:
        """Every key (a snapshot)."""
        with self._lock:
            keys = bytes(self._keys)
        return iter([keys[at : at + KEY_SIZE] for at in range(0, len(keys), KEY_SIZE)])

    def _damage(self, key: bytes, value: bytes | str) -> None:
        """Tests only: put `value` under `key` as it is, as damage behind the store's back
        would (a key not held yet is added)."""
        with self._lock:
            number = self._find(check_key(key))
            if number is None:
                self._append(key, value)
            else:
                self._values[number] = value

    def _append(self, key: bytes, value: bytes | str) -> None:
        """A new object (the lock held): its key and value first, so a reader that finds its
        number in the index (without the lock) finds them too."""
        number = len(self._values)
        self._keys += key
        self._values.append(value)
        try:
            self._numbers.add(index_key(key), number)
        except BaseException:  # (2**32 - 1 keys) as it was
            del self._keys[-KEY_SIZE:]
            self._values.pop()
            raise


def _holds(found: bytes | str, data: bytes) -> bool:
    """Whether the object `found` is the content `data` (of its key): comparing with the
    content costs less than hashing the object again."""
    if type(found) is str:
        return found.encode("utf-8", "surrogatepass") == data
    return found == data


def _size(found: bytes | str) -> int:
    return len(found.encode("utf-8", "surrogatepass")) if type(found) is str else len(found)


#: Why one object of a directory store cannot be read when the store itself can: something
#: other than a file at its path (a directory, a link: objects are never links, a pipe), a
#: permission refused, a disk error under it. A damaged object then, missing to its readers
#: (a server marks the sessions that need it damaged) and replaced by the next put of its
#: content; any other error (out of file descriptors, say) is the store's, and may pass.
_UNREADABLE = frozenset(
    {errno.EISDIR, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EIO, errno.ELOOP}
)
_REFUSED = frozenset({errno.EACCES, errno.EPERM})


class _NotAnObject(OSError):
    """Something other than a regular file where an object's file must be."""


def _read_object(path: Path) -> bytes:
    """The bytes of the object file at `path`: never through a link, never blocking on a pipe
    or a device (`_NotAnObject` for anything but a regular file)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _NotAnObject(errno.EISDIR, "not a regular file", str(path))
        with os.fdopen(fd, "rb", closefd=False) as file:
            return file.read()
    finally:
        os.close(fd)


class DirectoryStore:
    """Objects as files under `path` (`<path>/ab/cdef...`, named by the key's hex).

    Safe for many threads and processes at once: a put writes a temporary file in
    `<path>/tmp`, fsyncs it and hard-links it to its final name (atomic, never replaces an
    intact object); where hard links are not supported it renames instead. An object already
    under the key is read and compared with the content first: a damaged one is replaced by
    renaming the temporary file over it (atomic: a reader sees the old file or the new one).
    `fsync=False` skips the flushes (faster, but a power loss may lose recent objects).
    `readonly=True` reads only: nothing is created (not even the directory, so a mistyped
    path leaves no trace) and `put` raises `StoreError`.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, fsync: bool = True, readonly: bool = False
    ) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.readonly = readonly
        self._tmp = self.path / "tmp"
        if readonly:
            return
        try:
            self._tmp.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StoreUnavailableError(
                f"cannot create the directory store at {self.path}: {error}"
            ) from error

    def __repr__(self) -> str:
        return f"DirectoryStore({str(self.path)!r})"

    def __str__(self) -> str:
        return f"dir:{self.path}"

    def _object_path(self, key: bytes) -> Path:
        name = key.hex()
        return self.path / name[:2] / name[2:]

    def object_path(self, key: bytes) -> Path:
        """The file the object under `key` is kept in (named in damage reports)."""
        return self._object_path(check_key(key))

    def put(self, data: bytes) -> bytes:
        data = bytes(data)
        key = content_key(data)
        final = self._object_path(key)
        if self._intact(final, data, key):
            return key
        if self.readonly:
            raise StoreError(f"the directory store at {self.path} is open read-only", key=key)
        tmp: str | None = None
        try:
            try:
                final.parent.mkdir()
                new_folder = True
            except FileExistsError:
                new_folder = False
                if not final.parent.is_dir():  # (damage: a file where the folder must be)
                    self._set_aside(final.parent)
                    final.parent.mkdir()
                    new_folder = True
            try:
                fd, tmp = tempfile.mkstemp(dir=self._tmp, prefix="put-")
            except FileNotFoundError:  # its folder removed by hand: made again
                self._tmp.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=self._tmp, prefix="put-")
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                if self.fsync:
                    out.flush()
                    os.fsync(out.fileno())
            try:
                os.link(tmp, final)
            except FileExistsError:
                # another writer stored the content first, or a damaged object is there:
                # replace that one (every writer renames the same content into place)
                if not self._intact(final, data, key):
                    if stat.S_ISDIR(final.lstat().st_mode):  # (rename cannot replace one)
                        self._set_aside(final)
                    os.replace(tmp, final)
                    tmp = None
            except OSError:  # no hard links here: rename (replacing equal content is harmless)
                os.replace(tmp, final)
                tmp = None
            if self.fsync:
                sync_folder(final.parent)
                if new_folder:  # the folder's own entry, for the object to be found after a crash
                    sync_folder(final.parent.parent)
        except OSError as error:
            raise StoreUnavailableError(
                f"writing an object to the directory store at {self.path} failed: {error}",
                key=key,
            ) from error
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        return key

    def _intact(self, final: Path, data: bytes, key: bytes) -> bool:
        """Whether `final` holds `data` (absent, or damage that cannot be read: False)."""
        try:
            info = final.lstat()
            if stat.S_ISREG(info.st_mode) and info.st_size != len(data):
                return False
            return _read_object(final) == data
        except FileNotFoundError:
            return False
        except OSError as error:
            if isinstance(error, _NotAnObject) or error.errno in _UNREADABLE:
                return False
            raise StoreUnavailableError(
                f"reading an object from the directory store at {self.path} failed: {error}",
                key=key,
            ) from error

    def _set_aside(self, path: Path) -> None:
        """Move what stands where an object or its folder must be (damage) into `tmp`, out
        of the way and kept for a look (`remove_temporaries` clears it)."""
        os.rename(path, self._tmp / f"damaged-{path.name}-{secrets.token_hex(4)}")

    def get(self, key: bytes) -> bytes:
        path = self._object_path(check_key(key))
        try:
            data = _read_object(path)
        except FileNotFoundError:
            raise MissingObjectError(
                f"no such object in the directory store at {self.path}", key=key
            ) from None
        except OSError as error:
            if error.errno in _REFUSED:  # this process may not read it: not damage
                raise MissingObjectError(
                    f"the object {path} in the directory store cannot be read by this process "
                    f"({error}): give it the store's owner or modes",
                    key=key,
                ) from error
            if isinstance(error, _NotAnObject) or error.errno in _UNREADABLE:
                raise MissingObjectError(  # this object, not the store: as good as missing
                    f"the object {path} in the directory store cannot be read ({error}); "
                    "a put of its content replaces it (or remove it by hand)",
                    key=key,
                ) from error
            raise StoreUnavailableError(
                f"reading an object from the directory store at {self.path} failed: {error}",
                key=key,
            ) from error
        return verified(key, data, f"the directory store at {self.path}")

    def contains(self, key: bytes) -> bool:
        return self._object_path(check_key(key)).exists()

    def keys(self) -> Iterator[bytes]:
        """Every key, read from the directory names."""
        if not self.path.is_dir():
            return
        for folder in sorted(self.path.iterdir()):
            if len(folder.name) != 2 or not folder.is_dir():
                continue
            for item in sorted(folder.iterdir()):
                with contextlib.suppress(ValueError):
                    key = bytes.fromhex(folder.name + item.name)
                    if len(key) == 32:
                        yield key

    def remove_temporaries(self, older_than: float = 3600.0) -> int:
        """Delete temporary files left by writers killed mid-put, and the damage a put set
        aside (`_set_aside`); returns how many."""
        removed = 0
        limit = time.time() - older_than
        if not self._tmp.is_dir():
            return 0
        for item in self._tmp.iterdir():
            with contextlib.suppress(OSError):
                info = item.lstat()
                if info.st_mtime <= limit:
                    if stat.S_ISDIR(info.st_mode):
                        shutil.rmtree(item)
                    else:
                        item.unlink()
                    removed += 1
        return removed


#: The names `open_store` takes, for the help of a `--store` option.
STORE_HELP = "memory, dir:PATH, redis://host:port/db or s3://bucket/prefix"

_STORE_PREFIXES = ("dir:", "redis://", "rediss://", "unix://", "s3://")


def open_store(spec: str, *, readonly: bool = False) -> ContentStore:
    """The content store a `--store` value names (the CLI's and the capture server's).

    `memory` (one process; logs keep their strings inline), `dir:PATH` (a directory many
    processes share), `redis://host:port/db` or `s3://bucket/prefix` (many machines; the S3
    endpoint comes from boto3's usual settings, e.g. `AWS_ENDPOINT_URL`). An unknown name
    raises `InvalidArgumentError` (a `ValueError`). `readonly=True` (the CLI's reading
    commands) opens a directory store without creating anything.
    """
    if spec == "memory":
        return MemoryStore()
    if spec.startswith("dir:") and len(spec) > 4:
        return DirectoryStore(spec[4:], readonly=readonly)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        from .redis_store import RedisStore

        return RedisStore(spec)
    if spec.startswith("s3://") and spec[5:].split("/", 1)[0]:
        from .s3_store import S3Store

        bucket, _, prefix = spec[5:].partition("/")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        return S3Store(bucket, prefix=prefix or "rollout_store/")
    raise InvalidArgumentError(f"unknown content store {spec!r}: use {STORE_HELP}")


def store_spec(value: str) -> str:
    """An argparse `type=` for a `--store` option: the name as given, if `open_store` could
    take it (the store itself is opened only when the command runs)."""
    if value == "memory" or value.startswith(_STORE_PREFIXES):
        return value
    raise argparse.ArgumentTypeError(f"expected {STORE_HELP}")

"""The content store protocol: immutable objects keyed by the SHA-256 of their bytes.

A `ContentStore` holds byte strings, each under its key, `content_key(data)`. It has three
primitives and nothing else:

- `put(data) -> key`: store `data` unless an intact object with its key is already there
  (put-if-absent); the store computes the key itself, so a caller cannot file content under
  a key of its choosing. An object under the key that is not `data` (damaged behind the
  store's back) is replaced: one damaged object never spoils every later put of its
  content. Storing is atomic: an object is either absent or whole, never half-written.
- `get(key) -> bytes`: the object's bytes, verified against the key before they are returned
  (`CorruptObjectError` if they do not hash to it, `MissingObjectError` if absent).
- `contains(key) -> bool`.

Every backend is thread-safe and raises `StoreUnavailableError` when the store does not
answer after its bounded retries (`RetryPolicy`). Keys are cryptographic because a store is
shared across rollouts, processes or machines: whoever controls a tool output could craft
two strings with one xxh3 digest, never two with one SHA-256.

`StringCache` is the byte-bounded cache of strings (and turn records) read from a store. It
is an object of its own so that graphs can share one explicitly (a capture server passes one
to every session).

This module is the low layer: the blob table depends on this protocol only; the backends
(`stores`, `redis_store`, `s3_store`) live above the files layer.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

from ..errors import CorruptObjectError, InvalidArgumentError, StoreUnavailableError

__all__ = [
    "KEY_SIZE",
    "ContentStore",
    "RetryPolicy",
    "StringCache",
    "TextStore",
    "check_key",
    "content_key",
    "index_key",
    "verified",
]

#: Bytes in a key (SHA-256).
KEY_SIZE = 32

_T = TypeVar("_T")


def content_key(data: bytes) -> bytes:
    """The key of `data` in every content store: its 32-byte SHA-256 digest."""
    return hashlib.sha256(data).digest()


_HEAD = struct.Struct("<Q").unpack_from  # (no slice made, as int.from_bytes(key[:8]) makes)


def index_key(digest: bytes) -> int:
    """The int a key or digest is filed under in an index of contents (a `MemoryStore`'s, a
    blob table's): its first 8 bytes, little-endian."""
    key: int = _HEAD(digest)[0]
    return key


def check_key(key: object) -> bytes:
    """`key` if it is a well-formed key, else `InvalidArgumentError` (a `ValueError`; not a
    store error: a caller bug)."""
    if type(key) is not bytes or len(key) != KEY_SIZE:
        raise InvalidArgumentError(f"a content key is {KEY_SIZE} bytes, got {key!r:.80}")
    return key


def verified(key: bytes, data: bytes, where: str) -> bytes:
    """`data` if it hashes to `key`; else `CorruptObjectError` naming `where` it came from."""
    actual = content_key(data)
    if actual != key:
        raise CorruptObjectError(f"object read from {where} is damaged", key=key, actual=actual)
    return data


@runtime_checkable
class ContentStore(Protocol):
    """Immutable byte objects keyed by `content_key`; see the module docstring."""

    def put(self, data: bytes) -> bytes:
        """Store `data` unless an intact object is present (a damaged one is replaced,
        atomically); return its key."""
        ...

    def get(self, key: bytes) -> bytes:
        """The verified bytes stored under `key`."""
        ...

    def contains(self, key: bytes) -> bool:
        """Whether an object is stored under `key`."""
        ...


@runtime_checkable
class TextStore(Protocol):
    """A store inside this process that keeps strings as `str` objects (`MemoryStore`).

    Graphs over it share the very string objects: a string is held once in the process,
    whatever the number of graphs, and read with no decoding and no cache.
    """

    def put_text(self, text: str, data: bytes, key: bytes | None = None) -> bytes:
        """Store `text`, whose UTF-8 (surrogatepass) bytes are `data`; return their key
        (`key`, when given, is `content_key(data)` as the caller computed it)."""
        ...

    def intact(self, key: bytes, value: bytes | str, data: bytes) -> bytes | str | None:
        """The object stored under `key` if it is `value` (a str or bytes whose bytes are
        `data`), else None (absent or damaged); nothing is stored."""
        ...

    def get_text(self, key: bytes) -> str:
        """The string stored under `key` (the stored object itself)."""
        ...

    def share_bytes(self, data: bytes) -> bytes:
        """The store's own object equal to `data`, stored first if absent."""
        ...

    def share_tokens(self, tokens: array[int]) -> array[int]:
        """An array equal to `tokens` that every graph over this store shares (the first one
        given); not an object of the store (nothing to put, get or verify)."""
        ...


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff for calls to a store outside the process.

    `attempts` calls at most, sleeping `first_delay`, then twice that, up to `max_delay`
    between them; the worst case waits about `first_delay * 2**(attempts-1)` in all.
    """

    attempts: int = 4
    first_delay: float = 0.05
    max_delay: float = 0.5

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.first_delay < 0 or self.max_delay < 0:
            raise InvalidArgumentError("attempts must be >= 1 and delays >= 0")

    def run(
        self,
        what: str,
        call: Callable[[], _T],
        transient: tuple[type[BaseException], ...],
        key: bytes | None = None,
    ) -> _T:
        """`call()`, retried on `transient` errors; then `StoreUnavailableError` naming `what`."""
        delay = self.first_delay
        for attempt in range(1, self.attempts + 1):
            try:
                return call()
            except transient as error:
                if attempt == self.attempts:
                    raise StoreUnavailableError(
                        f"{what} failed after {attempt} attempts: {type(error).__name__}: {error}",
                        key=key,
                    ) from error
            time.sleep(delay)
            delay = min(delay * 2, self.max_delay)
        raise AssertionError("unreachable")  # pragma: no cover


#: Default size of a `StringCache`.
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024


class StringCache:
    """Strings and turn records read from a store, least recently used first out, at most
    `max_bytes` in all (what a graph puts is not cached: recording reads nothing back).

    Sizes are UTF-8 bytes. Thread-safe; share one between graphs to bound their total.
    `max_bytes=0` caches nothing. `share_bytes` also lets the graphs sharing the cache share
    one copy of a large packed value (a tool list).
    """

    __slots__ = ("_entries", "_lock", "hits", "max_bytes", "misses", "nbytes")

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if type(max_bytes) is not int or max_bytes < 0:
            raise InvalidArgumentError("max_bytes must be an int >= 0")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[bytes, tuple[str | bytes, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> str | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            value = entry[0]
            return value if type(value) is str else None

    def get_bytes(self, key: bytes) -> bytes | None:
        """The bytes object cached under `key` (a turn record), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or type(entry[0]) is not bytes:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put_bytes(self, key: bytes, data: bytes) -> None:
        """Remember `data`, the verified object stored under `key` (a turn record)."""
        if len(data) <= self.max_bytes:
            with self._lock:
                self._insert(key, data, len(data))

    def put(self, key: bytes, text: str, nbytes: int) -> None:
        """Remember `text` (`nbytes` UTF-8 bytes) under `key`, evicting the oldest entries."""
        if nbytes <= self.max_bytes:
            with self._lock:
                self._insert(key, text, nbytes)

    def share_bytes(self, data: bytes) -> bytes:
        """An object equal to `data` that other graphs sharing this cache hold too (`data`
        itself the first time; the cache forgets it like a string, the graphs keep it)."""
        if len(data) > self.max_bytes:
            return data
        key = b"v" + content_key(data)  # never equal to a string's key
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] == data:
                self._entries.move_to_end(key)
                return data if type(entry[0]) is not bytes else entry[0]
            self._insert(key, data, len(data))
            return data

    def _insert(self, key: bytes, value: str | bytes, nbytes: int) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = (value, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            _, (_, size) = self._entries.popitem(last=False)
            self.nbytes -= size

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

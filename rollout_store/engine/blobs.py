"""The content-addressed blob table that a graph owns, and the handle type.

Long strings are keyed by xxh3-128 of their UTF-8 bytes (surrogatepass). xxh3 collisions
can be crafted, so a digest hit is shared only after comparing content; two different
strings with one digest are both kept, each under its own handle.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import xxhash

from .._core import KeyNumbers
from ..errors import InvalidArgumentError, ReadOnlyError
from ..stores.content import index_key
from .index import index_members

__all__ = [
    "DIGEST_BYTES",
    "BlobTable",
    "Handle",
    "content_digest",
    "shared_digests",
    "utf8",
]


#: The bytes of a blob's digest.
DIGEST_BYTES = 16


def content_digest(data: bytes | memoryview) -> bytes:
    """The 16-byte xxh3-128 digest used as a blob's key."""
    return xxhash.xxh3_128_digest(data)


def utf8(text: str) -> tuple[bytes, bool]:
    """The UTF-8 of a string a blob table keeps, and whether it holds lone surrogates (as
    `json.loads('"\\ud800"')` gives: written with surrogatepass)."""
    try:
        return text.encode("utf-8"), False
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass"), True


def shared_digests(index: KeyNumbers, digest: Callable[[int], bytes]) -> int:
    """How many blobs of a table have a digest an earlier blob has too: of those filed under
    one key, the ones past the first of each digest."""
    return sum(len(group) - len({digest(i) for i in group}) for group in index.shared())


class Handle:
    """A small immutable reference to one blob, made when asked for (see `BlobTable`)."""

    __slots__ = ("digest", "index", "size", "surrogates")

    digest: bytes
    index: int
    size: int  # UTF-8 bytes (surrogatepass)
    surrogates: bool  # the string holds lone surrogates

    def __init__(self, digest: bytes, index: int, size: int, surrogates: bool = False) -> None:
        # each slot set through its own descriptor (`__setattr__` refuses): one is made per
        # blob added or read, and this is a third of what `object.__setattr__` costs
        _SET_DIGEST(self, digest)
        _SET_INDEX(self, index)
        _SET_SIZE(self, size)
        _SET_SURROGATES(self, surrogates)

    def __setattr__(self, name: str, value: object) -> None:
        raise ReadOnlyError("Handle is immutable")

    def __repr__(self) -> str:
        return f"Handle({self.digest.hex()[:16]}..., index={self.index}, size={self.size})"


_SET_DIGEST: Callable[[Handle, bytes], None] = Handle.__dict__["digest"].__set__
_SET_INDEX: Callable[[Handle, int], None] = Handle.__dict__["index"].__set__
_SET_SIZE: Callable[[Handle, int], None] = Handle.__dict__["size"].__set__
_SET_SURROGATES: Callable[[Handle, bool], None] = Handle.__dict__["surrogates"].__set__


class BlobTable:
    """Long strings stored once each, addressed by content.

    Additions are transactional: `mark()` before a change and `rollback(mark)` undoes every
    blob added since, so a rejected turn leaves no orphan blob.

    A blob costs the table its string and a few flat entries, no object of its own: its
    digest in one `bytearray`, its size and surrogate flag in one `array`, its number under
    its digest's first 8 bytes in a `KeyNumbers`. A `Handle` is made when asked for
    (`intern`, `handle`) and kept, so that a blob has one; the packer's `packer_intern`
    keeps none.
    """

    __slots__ = (
        "_by_digest",
        "_digests",
        "_given",
        "_hasher",
        "_referenced_bytes",
        "_references",
        "_sizes",
        "_strings",
        "_total_bytes",
        "_used",
        "_used_bytes",
    )

    def __init__(self, hasher: Callable[[bytes], bytes] = content_digest) -> None:
        self._hasher: Callable[[bytes], bytes] = hasher  # never changed
        self._strings: list[str] = []
        self._digests = bytearray()  # blob i's digest at [16 i, 16 i + 16)
        self._sizes = array("Q")  # its UTF-8 bytes << 1 | (it holds lone surrogates)
        # the handles given out, by blob number (None until one is asked for)
        self._given: dict[int, Handle] | None = None
        # The first 8 bytes of a digest (an int key, held without an int object) map to one
        # blob's number, or to several when different strings share them (each is compared).
        self._by_digest = KeyNumbers()
        self._total_bytes = 0
        self._references = 0
        self._referenced_bytes = 0
        # the blobs something refers to (a byte each; see `note_used`) and their UTF-8 bytes:
        # one copy of each is what `blob_bytes_saved` subtracts
        self._used = bytearray()
        self._used_bytes = 0

    def __len__(self) -> int:
        return len(self._sizes)

    def intern(self, text: str) -> Handle:
        """The handle of `text`, adding it when no stored string equals it."""
        return self.handle(self._intern(text))

    def packer_intern(self, text: str) -> int:
        """`intern` for the packer: the blob's number << 1 | whether it holds lone surrogates
        (no handle made or kept)."""
        index = self._intern(text)
        return index << 1 | self._sizes[index] & 1

    def _intern(self, text: str) -> int:
        """The number of the blob of `text`, added when no stored string equals it."""
        data, surrogates = utf8(text)
        digest = self.digest_of(data)
        self._references += 1
        self._referenced_bytes += len(data)
        found: int
        for found in index_members(self._by_digest.get(index_key(digest))):
            if self._strings[found] == text:
                return found
        index = self._append(text, digest, len(data), surrogates)
        self.note_used((index,))
        return index

    def canonical(self, text: str) -> str | None:
        """The stored string equal to `text` (the object the table holds), or None: nothing
        is added. What a request's decoded tip holds in place of the request's own copy."""
        data = text.encode("utf-8", "surrogatepass")  # (the bytes `intern` hashes)
        found: int
        for found in index_members(self._by_digest.get(index_key(self.digest_of(data)))):
            stored = self._strings[found]
            if stored == text:
                return stored
        return None

    def add_verified(self, text: str, digest: bytes, data_len: int, surrogates: bool) -> Handle:
        """Append a blob read back from a file (`data_len` UTF-8 bytes), digest checked."""
        return self.fresh_handle(self._append(text, digest, data_len, surrogates))

    def digest_of(self, data: bytes) -> bytes:
        """The table's digest of a string's UTF-8 `data`: `InvalidArgumentError` when its
        hasher gives other than 16 bytes (the digests are kept 16 bytes apart)."""
        digest = self._hasher(data)
        if type(digest) is not bytes or len(digest) != DIGEST_BYTES:
            raise InvalidArgumentError(
                f"a blob table's hasher must return {DIGEST_BYTES} bytes, got {digest!r:.60}"
            )
        return digest

    def _append(self, text: str, digest: bytes, data_len: int, surrogates: bool) -> int:
        index = len(self._sizes)
        # a second string with this digest (or its first 8 bytes) is a collision: both kept
        self._by_digest.add(index_key(digest), index)  # (first: the one step that may fail)
        self._strings.append(text)
        self._digests += digest
        self._sizes.append(data_len << 1 | surrogates)
        self._total_bytes += data_len
        return index

    def share_tokens(self, tokens: array[int]) -> array[int]:
        """`tokens` (never changed once stored) or an equal array shared with other graphs;
        a private table shares nothing."""
        return tokens

    def share_text(self, text: bytes) -> bytes:
        """`text` (a raw JSON text the graph remembers, see `RequestStore.raw_shared`) or an
        equal object other graphs hold; a private table shares nothing."""
        return text

    def share_packed(self, packed: bytes) -> bytes:
        """`packed` (a plain packing, no blob references) or an equal object shared with other
        graphs; a private table shares nothing."""
        return packed

    def heal_strings(self, value: Any) -> None:
        """Put again (at `flush`) the damaged objects of the long strings in `value`, a
        message a turn re-sends as an echo of a response (kept as a reference, its strings
        not stored again); a private table has no objects to heal."""

    def flush(self) -> None:
        """Store what the turn being added puts, once it passed every check (a table over a
        content store); a private table keeps everything in itself, at once."""

    def share_plain(self, packed: bytes) -> bytes:
        """`packed` (a plain packing that no stored value is: a raw tip's system part) or an
        equal object other graphs hold; a private table shares nothing."""
        return packed

    def share_name(self, text: str) -> str:
        """`text` (a model name, a finish reason, a system digest) or an equal object shared
        with other graphs; a private table shares nothing."""
        return text

    @property
    def fetches(self) -> bool:
        """Whether reading a blob may fetch it from outside the process."""
        return False

    def note_used(self, indices: Iterable[int]) -> None:
        """Count the blobs `indices` as referred to (a committed turn's, or one just interned).

        A table read back past damage holds blobs only lost turns used: no turn notes them,
        and `blob_bytes_saved` does not subtract them."""
        flags = self._used
        for index in indices:
            if index >= len(flags):
                flags.extend(bytes(index + 1 - len(flags)))
            if not flags[index]:
                flags[index] = 1
                self._used_bytes += self.size(index)

    @property
    def used_bytes(self) -> int:
        """The UTF-8 bytes of the distinct blobs referred to (see `note_used`)."""
        return self._used_bytes

    def forget_used(self, n: int) -> None:
        """Drop the used flags of the blobs from `n` on (removed by `rollback`)."""
        flags = self._used
        if len(flags) > n:
            self._used_bytes -= sum(self.size(i) for i in range(n, len(flags)) if flags[i])
            del flags[n:]

    def count_references(self, n: int, nbytes: int) -> None:
        """Record `n` more references, `nbytes` in all, to stored blobs (a file being loaded)."""
        self._references += n
        self._referenced_bytes += nbytes

    def string(self, index: int) -> str:
        """The stored string of blob `index`: always the same object."""
        return self._strings[index]

    def digest(self, index: int) -> bytes:
        """The xxh3-128 digest of blob `index`."""
        if not 0 <= index < len(self._sizes):
            raise IndexError(index)
        return bytes(self._digests[DIGEST_BYTES * index : DIGEST_BYTES * (index + 1)])

    def size(self, index: int) -> int:
        """The UTF-8 bytes of blob `index` (its string is not read)."""
        return self._sizes[index] >> 1

    def surrogates(self, index: int) -> bool:
        """Whether the string of blob `index` holds lone surrogates."""
        return bool(self._sizes[index] & 1)

    def handle(self, index: int) -> Handle:
        """The `Handle` of blob `index`: one object, kept once asked for."""
        given = self._given
        if given is None:
            given = self._given = {}
        handle = given.get(index)
        if handle is None:
            handle = given[index] = self.fresh_handle(index)
        return handle

    def fresh_handle(self, index: int) -> Handle:
        """A new `Handle` of blob `index`."""
        packed = self._sizes[index]
        return Handle(self.digest(index), index, packed >> 1, bool(packed & 1))

    def __iter__(self) -> Iterator[Handle]:
        return (self.handle(i) for i in range(len(self._sizes)))

    def mark(self) -> tuple[int, int, int]:
        return (len(self._sizes), self._references, self._referenced_bytes)

    def rollback(self, mark: tuple[int, int, int]) -> None:
        """Forget every blob added since `mark` (the caller holds the graph's lock)."""
        n, self._references, self._referenced_bytes = mark
        self.forget_used(n)
        by_digest, given = self._by_digest, self._given
        while len(self._sizes) > n:
            index = len(self._sizes) - 1
            taken = by_digest.pop_last(index_key(self.digest(index)), index)
            assert taken, "a blob table's index out of step with its blobs"
            if given is not None:
                given.pop(index, None)
            self._strings.pop()
            self._total_bytes -= self._sizes.pop() >> 1
        del self._digests[DIGEST_BYTES * n :]

    def _collisions(self) -> int:
        """Blobs whose digest another blob has too (different strings, both kept)."""
        return shared_digests(self._by_digest, self.digest)

    def stats(self) -> dict[str, int]:
        """Number of blobs, their UTF-8 bytes, references to them, and bytes sharing saved.

        `blob_bytes_saved` is the bytes of the references less one copy of each blob
        referred to (see `note_used`), never negative: a table read back past damage may
        hold blobs no kept turn refers to, which it does not subtract, and one read from a
        damaged snapshot counts none of the references its turns make (the snapshot's count
        of them is of the turns written)."""
        return {
            "blobs": len(self._strings),
            "blob_bytes": self._total_bytes,
            "blob_references": self._references,
            "blob_bytes_saved": max(self._referenced_bytes - self._used_bytes, 0),
            "collisions": self._collisions(),
        }

"""The blob table of a graph over a content store: references in memory, strings in the store.

A graph made with `RolloutGraph(store=...)` keeps, per blob, a handle and the blob's store key
(SHA-256); the string lives in the store. Over a `TextStore` (the memory store) the graph
reads the store's own `str` objects, shared by every graph over it. Over any other store a
string is fetched on read (verified against its key by the store) through a `StringCache`
bounded in bytes, which graphs may share.

Finding a string again: the graph's xxh3 digests give candidates; a candidate is the same
string only if its cached or stored string equals the new one, or (when it is not at hand)
if the new string's SHA-256 equals the candidate's key. So two strings with one xxh3 digest
stay apart, each under its own key, in every store.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator
from typing import Any

from .._core import KeyNumbers
from ..errors import CorruptObjectError, InvalidArgumentError, MissingObjectError
from ..stores.content import (
    KEY_SIZE,
    ContentStore,
    StringCache,
    TextStore,
    content_key,
    index_key,
)
from .blobs import (
    DIGEST_BYTES,
    BlobTable,
    Handle,
    content_digest,
    shared_digests,
    utf8,
)
from .index import index_members

__all__ = ["DEFAULT_GRAPH_CACHE_BYTES", "StoreBlobTable"]

#: Plain packings of shared values at least this large are shared through a memory store
#: (a three-tool list packs to about 350 bytes: every session of a group keeps one object).
SHARE_PACKED_BYTES = 256

#: The cache of a graph over an out-of-process store when none is given.
DEFAULT_GRAPH_CACHE_BYTES = 8 * 1024 * 1024

#: What a pending put does (`StoreBlobTable.flush`): store a new blob's string, put a damaged
#: object's string again, share a large value through the memory store.
_PUT, _HEAL, _SHARE = 0, 1, 2

#: A put `flush` makes: (what, blob number or -1, str or packed bytes, its UTF-8, its key or
#: None: the store's put computes it).
_Pending = tuple[int, int, str | bytes, bytes, bytes | None]

#: The key of a new blob until its put gives it (a store other than the memory store).
_NO_KEY = bytes(KEY_SIZE)

#: A table of fewer blobs finds a digest by scanning its digests (`bytearray.find`, C speed:
#: about 3 microseconds per 1,000 blobs); from this many on it keeps an index (about 60 bytes
#: a blob), so a large graph never scans far.
INDEX_FROM = 2048


class StoreBlobTable(BlobTable):
    """A `BlobTable` whose strings are kept in `store` (see the module docstring).

    What a turn adds to the store (its new strings, a damaged object's string put again, a
    large value shared through the memory store) is put by `flush`, which the graph calls
    once the turn has passed every check: a turn refused for its input leaves the store as
    it was (`rollback` forgets what it would have put). Until then a new blob's string is
    the turn's own, and its key is computed when asked for. A store error in `flush`
    propagates (the graph rolls the turn back); objects it put by then stay in the store,
    unreferenced: content-addressed objects are immutable and harmless.

    What a blob costs the graph is kept compact, in a few flat tables rather than objects
    per blob: its store key (32 bytes) and xxh3 digest (16 bytes) in two `bytearray`s, its
    size and surrogate flag in one `array`. A digest is found by scanning the digests while
    the table is small (`INDEX_FROM`); a larger table also files each blob's number under
    its digest's first 8 bytes in a `KeyNumbers`. `Handle`s are made when asked for.
    """

    __slots__ = (
        "_broken",
        "_cache",
        "_index",
        "_keys",
        "_nbytes",
        "_pending",
        "_pending_texts",
        "_refbytes",
        "_refs",
        "_text_store",
        "store",
    )

    def __init__(
        self,
        store: ContentStore,
        cache: StringCache | None = None,
        hasher: Callable[[bytes], bytes] = content_digest,
    ) -> None:
        # (the private table's lists and dict are not made: every method using them is
        # replaced here)
        if not isinstance(store, ContentStore):
            raise InvalidArgumentError(
                f"store must be a ContentStore (put, get, contains), got {type(store).__name__}"
            )
        self.store = store
        self._text_store = store if isinstance(store, TextStore) else None
        if self._text_store is not None:
            self._cache = cache  # only if asked for: the store holds str objects already
        else:
            self._cache = cache if cache is not None else StringCache(DEFAULT_GRAPH_CACHE_BYTES)
        self._hasher = hasher
        self._keys = bytearray()  # blob i's store key at [32 i, 32 i + 32)
        self._digests = bytearray()  # its xxh3 digest at [16 i, 16 i + 16)
        self._sizes = array("Q")  # its UTF-8 bytes << 1 | (it holds lone surrogates)
        # from INDEX_FROM blobs on: the digest's first 8 bytes -> the numbers of the blobs
        # whose digests begin so (each candidate is confirmed by content or key); None while
        # the digests are scanned
        self._index: KeyNumbers | None = None
        self._nbytes = 0
        self._refs = 0
        self._refbytes = 0
        self._used = bytearray()  # (see `BlobTable.note_used`)
        self._used_bytes = 0
        # keys whose objects a read found damaged or missing (`string`), put again by the
        # next turn that stores their strings; None until a read fails
        self._broken: set[bytes] | None = None
        # what the turn being added puts at `flush`: (what, blob number or -1, str or
        # packed bytes, its UTF-8, its key or None: computed by the store's put); None
        # while there is nothing (most graphs of a server, most of the time)
        self._pending: list[_Pending] | None = None
        # the strings of the blobs it adds, by number (their objects are not stored yet)
        self._pending_texts: dict[int, str] | None = None

    @property
    def cache(self) -> StringCache | None:
        return self._cache

    def key(self, index: int) -> bytes:
        """The store key of blob `index`."""
        if not 0 <= index < len(self._sizes):
            raise IndexError(index)
        key = bytes(self._keys[KEY_SIZE * index : KEY_SIZE * index + KEY_SIZE])
        texts = self._pending_texts
        if key == _NO_KEY and texts is not None and index in texts:  # (its put's: not yet)
            key = content_key(utf8(texts[index])[0])
            self._keys[KEY_SIZE * index : KEY_SIZE * index + KEY_SIZE] = key
        return key

    def _intern(self, text: str) -> int:
        data, surrogates = utf8(text)
        digest = self.digest_of(data)
        self._refs += 1
        self._refbytes += len(data)
        sha: list[bytes] = []
        for index in self._candidates(digest):
            if self.digest(index) == digest and self._same(index, text, data, sha):
                if self._broken is not None:
                    self._heal(index, text, data)
                return index
        store, key, put = self._text_store, _NO_KEY, True
        if store is not None:
            # (the memory store's own object, when it holds one: nothing to put)
            key = content_key(data)
            put = store.intact(key, text, data) is None
        # (else the key is the store's put's: not cached, the cache holds what is read)
        index = self._add(key, digest, len(data), surrogates)
        if put:
            self._queue((_PUT, index, text, data, None if key is _NO_KEY else key), text)
        self.note_used((index,))
        return index

    def flush(self) -> None:
        """Put what the turn being added stores (see the class docstring), in order."""
        pending = self._pending
        if pending is None:
            return
        text_store, put = self._text_store, self.store.put
        for what, index, value, data, key in pending:
            if what == _SHARE:
                assert text_store is not None  # (only the memory store shares values)
                text_store.share_bytes(data)
                continue
            if text_store is None:
                key = put(data)
            else:
                assert type(value) is str
                key = text_store.put_text(value, data, key)
            if what == _PUT:
                self._keys[KEY_SIZE * index : KEY_SIZE * index + KEY_SIZE] = key
            elif self._broken is not None:
                self._broken.discard(key)
        self._pending = self._pending_texts = None

    def _queue(self, entry: _Pending, text: str | None = None) -> None:
        """Put `entry` at `flush` (a new blob's `text` read from here meanwhile)."""
        if self._pending is None or self._pending_texts is None:
            self._pending, self._pending_texts = [], {}
        self._pending.append(entry)
        if text is not None:
            self._pending_texts[entry[1]] = text

    def canonical(self, text: str) -> str | None:
        """The memory store's object of `text`, shared by every graph over it, or None (any
        other store: its strings are fetched, never held)."""
        store = self._text_store
        if store is None:
            return None
        digest = self.digest_of(text.encode("utf-8", "surrogatepass"))
        for index in self._candidates(digest):
            if self.digest(index) == digest:
                pending = self._pending_texts.get(index) if self._pending_texts else None
                if pending is not None:  # (stored at `flush`, as this very object)
                    if pending == text:
                        return pending
                    continue
                try:
                    stored = store.get_text(self.key(index))
                except (CorruptObjectError, MissingObjectError):
                    continue  # (the tip keeps the request's own)
                if stored == text:
                    return stored
        return None

    def heal_strings(self, value: Any) -> None:
        if not self._broken:  # (mostly: nothing found damaged)
            return
        stack = [value]
        while stack:
            item = stack.pop()
            if type(item) is str:
                data = utf8(item)[0]
                digest = self.digest_of(data)
                for index in self._candidates(digest):
                    if self.digest(index) == digest and self.key(index) == content_key(data):
                        self._heal(index, item, data)
            elif isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            elif isinstance(item, list | tuple):
                stack.extend(item)

    def _note_broken(self, key: bytes) -> None:
        if self._broken is None:
            self._broken = set()
        self._broken.add(key)

    def _heal(self, index: int, text: str, data: bytes) -> None:
        """Put the string of blob `index` again (at `flush`) if a read found its object
        damaged or gone (the store replaces a damaged object atomically)."""
        key = self.key(index)
        broken = self._broken
        if broken is None or key not in broken:
            return
        if not any(what == _HEAL and at == index for what, at, *_ in self._pending or ()):
            self._queue((_HEAL, index, text, data, key))

    def _candidates(self, digest: bytes) -> Iterator[int]:
        """The blobs that may have `digest` (each is checked against it)."""
        index = self._index
        if index is not None:
            yield from index_members(index.get(index_key(digest)))
            return
        digests = self._digests
        at = digests.find(digest)
        while at >= 0:
            if at % DIGEST_BYTES == 0:
                yield at // DIGEST_BYTES
            at = digests.find(digest, at + 1)

    def _same(self, index: int, text: str, data: bytes, sha: list[bytes]) -> bool:
        pending = self._pending_texts.get(index) if self._pending_texts else None
        if pending is not None:  # added by this turn: its string is at hand
            return pending == text
        key = self.key(index)
        if self._text_store is not None:
            try:
                return self._text_store.get_text(key) == text
            except (CorruptObjectError, MissingObjectError):
                self._note_broken(key)  # decided by the key below, then put again
        else:
            cached = self._cache.get(key) if self._cache is not None else None
            if cached is not None:
                return cached == text
        if not sha:  # computed once per intern, only when a candidate is not at hand
            sha.append(content_key(data))
        return sha[0] == key

    def _add(self, key: bytes, digest: bytes, size: int, surrogates: bool) -> int:
        if len(key) != KEY_SIZE or len(digest) != DIGEST_BYTES:
            raise InvalidArgumentError(
                f"a blob needs a {KEY_SIZE}-byte key and a {DIGEST_BYTES}-byte digest"
            )
        index = len(self._sizes)
        if self._index is not None:
            self._index.add(index_key(digest), index)  # (first: the one step that may fail)
        self._keys += key
        self._digests += digest
        self._sizes.append(size << 1 | surrogates)
        self._nbytes += size
        if self._index is None and index + 1 >= INDEX_FROM:
            numbers = KeyNumbers()
            for i in range(index + 1):
                numbers.add(index_key(self.digest(i)), i)
            self._index = numbers
        return index

    def add_verified(self, text: str, digest: bytes, data_len: int, surrogates: bool) -> Handle:
        """A blob read back from a self-contained file: put into the store, then referenced."""
        data = text.encode("utf-8", "surrogatepass")
        if self._text_store is not None:
            key = self._text_store.put_text(text, data)
        else:
            key = self.store.put(data)
        return self.fresh_handle(self._add(key, digest, data_len, surrogates))

    def add_reference(self, key: bytes, digest: bytes, data_len: int, surrogates: bool) -> Handle:
        """A blob whose string is already in the store under `key` (a file of references)."""
        return self.fresh_handle(self._add(key, digest, data_len, surrogates))

    def share_tokens(self, tokens: array[int]) -> array[int]:
        """Over the memory store, a long root prompt is one array for every graph (a GRPO
        group's shared prompt prefix). Elsewhere the graph keeps its own."""
        if self._text_store is not None and len(tokens) * 4 >= SHARE_PACKED_BYTES:
            return self._text_store.share_tokens(tokens)
        return tokens

    def share_text(self, text: bytes) -> bytes:
        """Over the memory store with a cache the graphs share (a capture server's sessions):
        one object for their equal raw texts (the tool list every session re-sends), which
        the cache confirms equal; it may forget it, the graphs keep theirs. Elsewhere the
        graph keeps its own: a cache of fetched strings is not filled with texts."""
        if self._text_store is not None and self._cache is not None:
            return self._cache.share_bytes(text)
        return text

    def share_packed(self, packed: bytes) -> bytes:
        """A large packing shared with other graphs: the memory store's own object, or else
        the one held by the cache the graphs share (graphs that store one tool list share
        it). With neither, the graph keeps its own copy."""
        if len(packed) < SHARE_PACKED_BYTES:
            return self._share_small(packed)  # type: ignore[return-value]
        store = self._text_store
        if store is not None:
            key = content_key(packed)
            found = store.intact(key, packed, packed)
            if type(found) is bytes:
                return found
            if found is None:  # stored at `flush` (this object: nothing else holds one)
                self._queue((_SHARE, -1, packed, packed, key))
            return packed
        if self._cache is not None:
            return self._cache.share_bytes(packed)
        return packed

    def share_plain(self, packed: bytes) -> bytes:
        """A packing that no stored value is (a raw tip's system part) shared with other
        graphs as `share_packed` shares one, but never put into the store: there it would be
        an object no turn refers to, which the same messages decoded do not leave."""
        if len(packed) < SHARE_PACKED_BYTES:
            return self._share_small(packed)  # type: ignore[return-value]
        if self._cache is not None:
            return self._cache.share_bytes(packed)
        return packed

    def share_name(self, text: str) -> str:
        """Over the memory store, one object for the equal names of every graph over it (the
        model and finish reason every session of a group sends). Elsewhere the graph's own."""
        return self._share_small(text)  # type: ignore[return-value]

    def _share_small(self, value: bytes | str) -> bytes | str:
        """A short value shared through the memory store (`MemoryStore.share_small`: not an
        object of the store), else `value` itself."""
        share = getattr(self._text_store, "share_small", None)  # (a TextStore may lack it)
        return value if share is None else share(value)

    @property
    def fetches(self) -> bool:
        return self._text_store is None

    def count_references(self, n: int, nbytes: int) -> None:
        self._refs += n
        self._refbytes += nbytes

    def string(self, index: int) -> str:
        """The string of blob `index`, read from the store (or the cache), verified. A
        damaged or missing object is remembered: the next turn that stores its string puts
        it again (the store replaces a damaged object), so the graph heals itself."""
        texts = self._pending_texts
        if texts:
            pending = texts.get(index)
            if pending is not None:  # added by the turn being added: not stored yet
                return pending
        key = self.key(index)
        try:
            if self._text_store is not None:
                return self._text_store.get_text(key)
            cache = self._cache
            if cache is not None:
                text = cache.get(key)
                if text is not None:
                    return text
            data = self.store.get(key)  # verified against the key by the store
        except (CorruptObjectError, MissingObjectError):
            self._note_broken(key)
            raise
        text = data.decode("utf-8", "surrogatepass") if self._sizes[index] & 1 else data.decode()
        if cache is not None:
            cache.put(key, text, len(data))
        return text

    def handle(self, index: int) -> Handle:
        """A `Handle` of blob `index` (a new object each time; equal fields)."""
        if not 0 <= index < len(self._sizes):
            raise IndexError(index)
        return self.fresh_handle(index)

    def mark(self) -> tuple[int, int, int]:
        return (len(self._sizes), self._refs, self._refbytes)

    def rollback(self, mark: tuple[int, int, int]) -> None:
        # (what is pending is the rolled-back turn's: `flush` runs before every commit)
        self._pending = self._pending_texts = None
        n, self._refs, self._refbytes = mark
        self.forget_used(n)
        index_of = self._index
        while len(self._sizes) > n:
            index = len(self._sizes) - 1
            if index_of is not None:  # (this one: the last added under its key)
                taken = index_of.pop_last(index_key(self.digest(index)), index)
                assert taken, "a blob table's index out of step with its blobs"
            self._nbytes -= self._sizes.pop() >> 1
        del self._keys[KEY_SIZE * n :]
        del self._digests[DIGEST_BYTES * n :]

    def stats(self) -> dict[str, int]:
        index = self._index
        if index is None:  # (a small table: its digests are scanned)
            collisions = len(self._sizes) - len({self.digest(i) for i in range(len(self._sizes))})
        else:
            collisions = shared_digests(index, self.digest)
        return {
            "blobs": len(self._sizes),
            "blob_bytes": self._nbytes,
            "blob_references": self._refs,
            "blob_bytes_saved": max(self._refbytes - self._used_bytes, 0),
            "collisions": collisions,
        }

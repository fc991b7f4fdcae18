"""The blob table of a graph over a content store: references in memory, strings in the store.

A graph made with `RolloutGraph(store=...)` keeps, per blob, a handle and the blob's store key
(SHA-256); the string lives in the store. Over a `TextStore` (the memory store) the graph
reads the store's own `str` objects, shared by every graph over it. Over any other store a
string is fetched on read (verified against its key by the store) through a `StringCache`
bounded in bytes, which graphs may share.

Finding a string again: the graph's xxh3 index gives candidates; a candidate is the same
string only if its cached or stored string equals the new one, or (when it is not at hand)
if the new string's SHA-256 equals the candidate's key. So two strings with one xxh3 digest
stay apart, each under its own key, in every store.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator

from .blobs import BlobTable, Handle, content_digest
from .content import ContentStore, StringCache, TextStore, content_key
from .errors import InvalidArgumentError
from .index import index_add, index_members, index_remove

__all__ = ["DEFAULT_GRAPH_CACHE_BYTES", "StoreBlobTable"]

#: Plain packings of shared values at least this large are shared through a memory store
#: (a three-tool list packs to about 350 bytes: every session of a group keeps one object).
SHARE_PACKED_BYTES = 256

#: The cache of a graph over an out-of-process store when none is given.
DEFAULT_GRAPH_CACHE_BYTES = 8 * 1024 * 1024


class StoreBlobTable(BlobTable):
    """A `BlobTable` whose strings are kept in `store` (see the module docstring).

    Adding a blob puts it into the store at once; a store error propagates (the graph rolls
    the turn back). Objects put for a turn that is then rejected stay in the store,
    unreferenced: content-addressed objects are immutable and harmless.
    """

    __slots__ = (
        "_cache",
        "_digests",
        "_handles_",
        "_keys",
        "_nbytes",
        "_refbytes",
        "_refs",
        "_text_store",
        "_xxh",
        "store",
    )

    def __init__(
        self,
        store: ContentStore,
        cache: StringCache | None = None,
        hasher: Callable[[bytes], bytes] = content_digest,
    ) -> None:
        super().__init__(hasher)
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
        self._xxh = hasher
        self._keys: list[bytes] = []
        self._handles_: list[Handle] = []
        self._digests: dict[bytes, Handle | list[Handle]] = {}
        self._nbytes = 0
        self._refs = 0
        self._refbytes = 0

    @property
    def cache(self) -> StringCache | None:
        return self._cache

    def __len__(self) -> int:
        return len(self._keys)

    def key(self, index: int) -> bytes:
        """The store key of blob `index`."""
        return self._keys[index]

    def intern(self, text: str) -> Handle:
        try:
            data = text.encode("utf-8")
            surrogates = False
        except UnicodeEncodeError:
            data = text.encode("utf-8", "surrogatepass")
            surrogates = True
        digest = self._xxh(data)
        self._refs += 1
        self._refbytes += len(data)
        found = self._digests.get(digest)
        if found is not None:
            sha: list[bytes] = []
            for handle in index_members(found):
                if self._same(handle, text, data, sha):
                    return handle
        if self._text_store is not None:
            key = self._text_store.put_text(text, data)
        else:
            key = self.store.put(data)
            if self._cache is not None:
                self._cache.put(key, text, len(data))
        return self._add(key, digest, len(data), surrogates)

    def _same(self, handle: Handle, text: str, data: bytes, sha: list[bytes]) -> bool:
        key = self._keys[handle.index]
        if self._text_store is not None:
            return self._text_store.get_text(key) == text
        cached = self._cache.get(key) if self._cache is not None else None
        if cached is not None:
            return cached == text
        if not sha:  # computed once per intern, only when a candidate is not at hand
            sha.append(content_key(data))
        if sha[0] != key:
            return False
        if self._cache is not None:
            self._cache.put(key, text, len(data))
        return True

    def _add(self, key: bytes, digest: bytes, size: int, surrogates: bool) -> Handle:
        handle = Handle(digest, len(self._keys), size, surrogates)
        self._keys.append(key)
        self._handles_.append(handle)
        self._nbytes += size
        index_add(self._digests, digest, handle)
        return handle

    def add_verified(self, text: str, digest: bytes, data_len: int, surrogates: bool) -> Handle:
        """A blob read back from a self-contained file: put into the store, then referenced."""
        data = text.encode("utf-8", "surrogatepass")
        if self._text_store is not None:
            key = self._text_store.put_text(text, data)
        else:
            key = self.store.put(data)
        return self._add(key, digest, data_len, surrogates)

    def add_reference(self, key: bytes, digest: bytes, data_len: int, surrogates: bool) -> Handle:
        """A blob whose string is already in the store under `key` (a file of references)."""
        return self._add(key, digest, data_len, surrogates)

    def share_tokens(self, tokens: array[int]) -> array[int]:
        """Over the memory store, a long root prompt is one array for every graph (a GRPO
        group's shared prompt prefix). Elsewhere the graph keeps its own."""
        if self._text_store is not None and len(tokens) * 4 >= SHARE_PACKED_BYTES:
            return self._text_store.share_tokens(tokens)
        return tokens

    def share_packed(self, packed: bytes) -> bytes:
        """A large packing shared with other graphs: the memory store's own object, or else
        the one held by the cache the graphs share (graphs that store one tool list share
        it). With neither, the graph keeps its own copy."""
        if len(packed) < SHARE_PACKED_BYTES:
            return packed
        if self._text_store is not None:
            return self._text_store.share_bytes(packed)
        if self._cache is not None:
            return self._cache.share_bytes(packed)
        return packed

    @property
    def fetches(self) -> bool:
        return self._text_store is None

    def count_references(self, n: int, nbytes: int) -> None:
        self._refs += n
        self._refbytes += nbytes

    def string(self, index: int) -> str:
        """The string of blob `index`, read from the store (or the cache), verified."""
        key = self._keys[index]
        if self._text_store is not None:
            return self._text_store.get_text(key)
        cache = self._cache
        if cache is not None:
            text = cache.get(key)
            if text is not None:
                return text
        data = self.store.get(key)  # verified against the key by the store
        handle = self._handles_[index]
        text = data.decode("utf-8", "surrogatepass") if handle.surrogates else data.decode()
        if cache is not None:
            cache.put(key, text, len(data))
        return text

    def handle(self, index: int) -> Handle:
        return self._handles_[index]

    def __iter__(self) -> Iterator[Handle]:
        return iter(self._handles_)

    def mark(self) -> tuple[int, int, int]:
        return (len(self._keys), self._refs, self._refbytes)

    def rollback(self, mark: tuple[int, int, int]) -> None:
        n, self._refs, self._refbytes = mark
        while len(self._keys) > n:
            handle = self._handles_.pop()
            self._keys.pop()
            self._nbytes -= handle.size
            index_remove(self._digests, handle.digest, handle)

    def stats(self) -> dict[str, int]:
        return {
            "blobs": len(self._keys),
            "blob_bytes": self._nbytes,
            "blob_references": self._refs,
            "blob_bytes_saved": self._refbytes - self._nbytes,
            "collisions": sum(len(v) - 1 for v in self._digests.values() if isinstance(v, list)),
        }

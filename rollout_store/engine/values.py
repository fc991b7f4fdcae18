"""Whole values stored once per graph: tool lists, sampling parameters, system prompts.

A value is found by its plain packing (every string inline). Short plain packings are their
own key, so the dictionary's equality check is the content comparison; longer ones are keyed
by xxh3-128 (as an int, in the same dictionary: an int never equals a bytes key) and a hit is
confirmed by expanding the stored form and comparing bytes. A graph
whose strings are in an out-of-process store keys them by SHA-256 instead (`hashed=True`): a
hit is then exact without expanding, which would fetch the value's strings from the store.
"""

from __future__ import annotations

from collections.abc import Callable

import xxhash

from ..stores.content import content_key
from .index import NOT_YET, OneOrMany, index_add, index_members

__all__ = ["ValueTable"]

#: Plain packings shorter than this are dictionary keys themselves.
INLINE_KEY_LIMIT = 1024


class ValueTable:
    """Stored packed values, found by the exact plain packing of a fresh value."""

    __slots__ = ("_exact", "_expand", "_found", "_hashed", "_limit")

    def __init__(
        self,
        expand: Callable[[bytes], bytes | None],
        share_threshold: int | None,
        hashed: bool = False,
    ):
        self._hashed = hashed
        # Below the string-sharing threshold a packing cannot hold a blob reference, so
        # the stored form equals the plain one and can be the key.
        self._limit = min(INLINE_KEY_LIMIT, share_threshold or INLINE_KEY_LIMIT)
        self._expand = expand
        # a short plain packing (bytes) -> its value; the xxh3-128 of a longer one (an int)
        # -> the value (or values, see `index`) with that digest: one dict, not two (a
        # capture server's session holds a value or two of each kind)
        self._found: OneOrMany[bytes | int, bytes] = {}
        # SHA-256 -> the one value (`hashed`); a dict at the first such value
        self._exact: dict[bytes, bytes] = NOT_YET

    def __len__(self) -> int:
        found = sum(len(index_members(v)) for v in self._found.values())
        return found + len(self._exact)

    def find(self, plain: bytes) -> bytes | None:
        """The stored value whose plain packing equals `plain`, or None."""
        if len(plain) < self._limit:
            return self._found.get(plain)  # type: ignore[return-value]  # (bare: a bytes key)
        if self._hashed:
            return self._exact.get(content_key(plain))
        for stored in index_members(self._found.get(xxhash.xxh3_128_intdigest(plain))):
            if stored == plain or self._expand(stored) == plain:
                return stored
        return None

    def add(self, plain: bytes, stored: bytes) -> None:
        """Remember `stored` as the value whose plain packing is `plain` (caller checked find)."""
        if len(plain) < self._limit:
            # a stored form equal to its plain packing is the key too: one object, not two
            self._found[stored if stored == plain else plain] = stored
        elif self._hashed:
            if self._exact is NOT_YET:
                self._exact = {}
            self._exact[content_key(plain)] = stored
        else:
            index_add(self._found, xxhash.xxh3_128_intdigest(plain), stored)

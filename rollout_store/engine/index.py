"""The one-or-many index: a dict whose value is one item, or a tuple or list when several
share a key.

Most keys of the graph's digest indexes (and of the blob table) hold a single item; storing
it bare instead of in a one-item list saves a list per key. A few items share a key as a
tuple of exactly their number (a list keeps room to grow: a key of two or three turns, as a
conversation's consecutive turns often are under one token block, costs about half), and
more than `SMALL` as a list, so adding stays constant time. Items are compared by identity
and must never be tuples or lists themselves.

The token indexes, whose every lookup wants a range of lengths, are the engine's
(`_core.SizedIndex`, see `engine::sized_index`): they group a key's turns by length from
`SMALL` turns on, as these indexes move to lists.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from types import MappingProxyType
from typing import Any, TypeVar

__all__ = [
    "NOT_YET",
    "SMALL",
    "OneOrMany",
    "index_add",
    "index_members",
    "index_remove",
]

#: An empty, read-only mapping that stands for a dict not made yet: read like an empty dict,
#: replaced by a dict of its own at the first write (`if d is NOT_YET: d = {}`). An empty
#: dict costs 64 bytes, and a graph has several that most graphs never fill (one capture
#: session each, thousands in a server). Typed Any so a dict-typed field can hold it.
NOT_YET: Any = MappingProxyType({})

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

#: The most items a key holds as a tuple (rebuilt on each add); beyond, a list.
SMALL = 8

#: The type of such an index, e.g. ``OneOrMany[int, Turn]``.
OneOrMany = dict[K, T | tuple[T, ...] | list[T]]


def index_members(found: T | tuple[T, ...] | list[T] | None) -> Sequence[T]:
    """The items of one key, given what `index.get(key)` returned."""
    if found is None:
        return ()
    if isinstance(found, tuple | list):
        return found
    return (found,)


def index_add(index: dict[K, T | tuple[T, ...] | list[T]], key: K, item: T) -> None:
    """File `item` under `key` as well."""
    found = index.get(key)
    if found is None:
        index[key] = item
    elif isinstance(found, list):
        found.append(item)
    elif isinstance(found, tuple):
        index[key] = (*found, item) if len(found) < SMALL else [*found, item]
    else:
        index[key] = (found, item)


def index_remove(index: dict[K, T | tuple[T, ...] | list[T]], key: K, item: T) -> None:
    """Take `item` (this very object) from under `key`, if it is there."""
    found = index.get(key)
    if found is item:
        del index[key]
    elif isinstance(found, tuple | list):
        for i, member in enumerate(found):
            if member is item:
                rest = [*found[:i], *found[i + 1 :]]
                if len(rest) == 1:
                    index[key] = rest[0]
                elif isinstance(found, list):
                    del found[i]
                else:
                    index[key] = tuple(rest)
                break

"""The one-or-many index: a dict whose value is one item, or a tuple or list when several
share a key.

Most keys of the graph's digest indexes (and of the blob table) hold a single item; storing
it bare instead of in a one-item list saves a list per key. A few items share a key as a
tuple of exactly their number (a list keeps room to grow: a key of two or three turns, as a
conversation's consecutive turns often are under one token block, costs about half), and
more than `SMALL` as a list, so adding stays constant time. Items are compared by identity
and must never be tuples or lists themselves.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

__all__ = ["SMALL", "OneOrMany", "index_add", "index_members", "index_remove"]

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
    return found if isinstance(found, tuple | list) else (found,)


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

"""The one-or-many index: a dict whose value is one item, or a list when several share a key.

Most keys of the graph's digest indexes (and of the blob table) hold a single item; storing
it bare instead of in a one-item list saves a list per key. Items are compared by identity
and must never be lists themselves.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

__all__ = ["OneOrMany", "index_add", "index_members", "index_remove"]

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

#: The type of such an index, e.g. ``OneOrMany[int, Turn]``.
OneOrMany = dict[K, T | list[T]]


def index_members(found: T | list[T] | None) -> Sequence[T]:
    """The items of one key, given what `index.get(key)` returned."""
    if found is None:
        return ()
    return found if isinstance(found, list) else (found,)


def index_add(index: dict[K, T | list[T]], key: K, item: T) -> None:
    """File `item` under `key` as well."""
    found = index.get(key)
    if found is None:
        index[key] = item
    elif isinstance(found, list):
        found.append(item)
    else:
        index[key] = [found, item]


def index_remove(index: dict[K, T | list[T]], key: K, item: T) -> None:
    """Take `item` (this very object) from under `key`, if it is there."""
    found = index.get(key)
    if found is item:
        del index[key]
    elif isinstance(found, list):
        for i, member in enumerate(found):
            if member is item:
                del found[i]
                break
        if len(found) == 1:
            index[key] = found[0]

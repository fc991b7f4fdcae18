"""The one-or-many index: a dict whose value is one item, or a tuple or list when several
share a key.

Most keys of the graph's digest indexes (and of the blob table) hold a single item; storing
it bare instead of in a one-item list saves a list per key. A few items share a key as a
tuple of exactly their number (a list keeps room to grow: a key of two or three turns, as a
conversation's consecutive turns often are under one token block, costs about half), and
more than `SMALL` as a list, so adding stays constant time. Items are compared by identity
and must never be tuples or lists themselves.

The token indexes file each turn with a length (its tokens', or its prompt's) and every scan
of theirs wants a range of lengths. A key of theirs holding more than `SMALL` items holds
them grouped by length (`ByLength`), so a scan visits the groups in its range only: one
prompt sampled thousands of times files every turn under one key, and a lookup none of
whose lengths fit visits none of them.

A length group can itself grow large: a group of a thousand rollouts sampled from one prompt
files a thousand turns of one length under one key, and a continuation looks among them for
the one whose tokens start its prompt. A group of more than `SMALL` items, given what an
item's content is (`content_of`), holds them by that content's digest (`ByContent`), so such
a lookup asks for the one digest its own tokens have at that length (`sized_exact`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from types import MappingProxyType
from typing import Any, TypeVar

__all__ = [
    "NOT_YET",
    "SMALL",
    "ByContent",
    "ByLength",
    "OneOrMany",
    "index_add",
    "index_members",
    "index_remove",
    "sized_add",
    "sized_exact",
    "sized_members",
    "sized_remove",
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


class ByLength(dict[int, Any]):
    """The items of one key grouped by length (each length's items one-or-many, in the
    order they were filed)."""

    __slots__ = ()


class ByContent(dict[int, Any]):
    """The items of one length group keyed by the digest of their content (each digest's
    items one-or-many, in the order they were filed)."""

    __slots__ = ()


def index_members(found: T | tuple[T, ...] | list[T] | None) -> Sequence[T]:
    """The items of one key, given what `index.get(key)` returned."""
    if found is None:
        return ()
    if isinstance(found, tuple | list):
        return found
    if type(found) is ByLength or type(found) is ByContent:
        groups: dict[int, Any] = found  # type: ignore[assignment]
        return [item for group in groups.values() for item in index_members(group)]
    return (found,)


def sized_members(found: Any, low: int, high: int) -> Iterator[Any]:
    """The items of one key of a sized index that may have a length in [low, high): every
    item of a small key (the caller checks each), the groups in range of a large one."""
    if type(found) is ByLength:
        for length, group in found.items():
            if low <= length < high:
                yield from index_members(group)
    else:
        yield from index_members(found)


def sized_exact(found: Any, low: int, high: int, content_at: Callable[[int], int]) -> Iterator[Any]:
    """`sized_members`, but of a group held by content only the items whose content digest
    is `content_at(length)` (the caller still checks each)."""
    if type(found) is ByLength:
        for length, group in found.items():
            if low <= length < high:
                if type(group) is ByContent:
                    yield from index_members(group.get(content_at(length)))
                else:
                    yield from index_members(group)
    else:
        yield from index_members(found)


def sized_add(
    index: dict[Any, Any],
    key: Any,
    item: Any,
    length_of: Callable[[Any], int],
    content_of: Callable[[Any], int] | None = None,
) -> None:
    """File `item` under `key` in a sized index (`length_of` gives an item's length, which
    never changes while it is filed; `content_of`, if given, the digest of its content, for
    a large length group to be held by it)."""
    found = index.get(key)
    if type(found) is ByLength:
        length = length_of(item)
        group = found.get(length)
        if type(group) is ByContent:
            index_add(group, content_of(item), item)  # type: ignore[misc]
        elif content_of is not None and isinstance(group, list) and len(group) >= SMALL:
            by_content = ByContent()
            for member in (*group, item):
                index_add(by_content, content_of(member), member)
            found[length] = by_content
        else:
            index_add(found, length, item)
    elif isinstance(found, tuple) and len(found) == SMALL:
        grouped = ByLength()
        for member in (*found, item):
            index_add(grouped, length_of(member), member)
        index[key] = grouped
    else:
        index_add(index, key, item)


def sized_remove(
    index: dict[Any, Any], key: Any, item: Any, length_of: Callable[[Any], int]
) -> None:
    """Take `item` from under `key` of a sized index, if it is there."""
    found = index.get(key)
    if type(found) is ByLength:
        length = length_of(item)
        group = found.get(length)
        if type(group) is ByContent:
            for digest, members in list(group.items()):
                if any(member is item for member in index_members(members)):
                    index_remove(group, digest, item)
                    break
            if not group:
                del found[length]
        else:
            index_remove(found, length, item)
        if not found:
            del index[key]
    else:
        index_remove(index, key, item)


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

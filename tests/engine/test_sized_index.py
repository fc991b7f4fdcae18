"""The engine's token index (`_core.SizedIndex`) against a reference in Python: the
package's earlier sized index (the one-or-many index of `engine.index`, grouped by length
and by content), which it replaced. Filed as the linker files (the token index: content
digests, nothing removed; the token roots: no digests, roots taken out when they move),
any sequence of filings, removals and lookups hands back the same turns in the same
order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_store._core import SizedIndex
from rollout_store.engine import index
from rollout_store.engine.index import index_add, index_remove

NO_LIMIT = 2**64 - 1


class _ByLength(dict[int, Any]):
    pass


class _ByContent(dict[int, Any]):
    pass


def _members(found: Any) -> list[int]:
    if found is None:
        return []
    if isinstance(found, tuple | list):
        return list(found)
    if isinstance(found, _ByLength | _ByContent):
        return [item for group in found.values() for item in _members(group)]
    return [found]


class Reference:
    """The sized index as the package kept it in Python."""

    def __init__(self, lengths: dict[int, int], content: Callable[[int], int] | None) -> None:
        self.index: dict[int, Any] = {}
        self.lengths, self.content = lengths, content

    def add(self, key: int, item: int) -> None:
        found, length, content = self.index.get(key), self.lengths[item], self.content
        if type(found) is _ByLength:
            group = found.get(length)
            if type(group) is _ByContent:
                index_add(group, content(item), item)  # type: ignore[misc]
            elif content is not None and isinstance(group, list) and len(group) >= index.SMALL:
                by_content = _ByContent()
                for member in (*group, item):
                    index_add(by_content, content(member), member)
                found[length] = by_content
            else:
                index_add(found, length, item)
        elif isinstance(found, tuple) and len(found) == index.SMALL:
            grouped = _ByLength()
            for member in (*found, item):
                index_add(grouped, self.lengths[member], member)
            self.index[key] = grouped
        else:
            index_add(self.index, key, item)

    def remove(self, key: int, item: int) -> None:
        found = self.index.get(key)
        if type(found) is _ByLength:
            length = self.lengths[item]
            index_remove(found, length, item)
            if not found:
                del self.index[key]
        else:
            index_remove(self.index, key, item)

    def members(self, key: int, low: int, high: int) -> list[int]:
        found = self.index.get(key)
        if type(found) is _ByLength:
            return [
                item
                for length, group in found.items()
                if low <= length < high
                for item in _members(group)
            ]
        return _members(found)

    def exact(self, key: int, low: int, high: int, content_at: Callable[[int], int]) -> list[int]:
        found = self.index.get(key)
        if type(found) is not _ByLength:
            return _members(found)
        out: list[int] = []
        for length, group in found.items():
            if low <= length < high:
                if type(group) is _ByContent:
                    out += _members(group.get(content_at(length)))
                else:
                    out += _members(group)
        return out


def _digest(item: int) -> int:
    return (item * 0x9E3779B97F4A7C15) % 5  # few digests: groups of several turns each


def _digest_at(length: int) -> int:
    return length % 5


_step = st.tuples(
    st.sampled_from(["add", "add", "add", "remove", "members", "exact"]),
    st.integers(0, 1),  # key
    st.integers(1, 3),  # length of a new turn
    st.integers(0, 6),  # low
    st.integers(0, 8),  # high (8: none)
    st.integers(0, 10**6),  # which filed turn to remove
)


@pytest.mark.parametrize("with_content", [True, False], ids=["token_index", "token_roots"])
@settings(max_examples=100, deadline=None)
@given(steps=st.lists(_step, min_size=60, max_size=160))
def test_the_engine_index_hands_back_what_the_python_one_did(
    with_content: bool, steps: list[tuple[str, int, int, int, int, int]]
) -> None:
    saved, index.SMALL = index.SMALL, 3  # groups formed within a short run
    try:
        _run(with_content, steps)
    finally:
        index.SMALL = saved


def _run(with_content: bool, steps: list[tuple[str, int, int, int, int, int]]) -> None:
    lengths: dict[int, int] = {}
    content = _digest if with_content else None
    ours, reference = SizedIndex(index.SMALL), Reference(lengths, content)
    filed: list[tuple[int, int]] = []
    for op, key, length, low, high_code, pick in steps:
        high = NO_LIMIT if high_code == 8 else high_code
        if op == "add":
            item = len(lengths)
            lengths[item] = length
            if with_content or item % 2:
                ours.add(key, item, length, content)
                reference.add(key, item)
                filed.append((key, item))
            else:  # a root under its keys, in one call
                ours.add_all([key, key + 1], item, length)
                for under in (key, key + 1):
                    reference.add(under, item)
                    filed.append((under, item))
        elif op == "remove" and filed and not with_content:  # (the token index keeps all)
            key, item = filed.pop(pick % len(filed))
            if item % 2:
                assert ours.remove(key, item, lengths[item])
                assert not ours.remove(key, item, lengths[item])
            else:
                assert ours.remove_all([key, 7], item, lengths[item]) == 1
            reference.remove(key, item)
        elif op == "members":
            assert ours.members(key, low, high) == reference.members(key, low, high)
        elif op == "exact":
            found = ours.exact(key, low, high, _digest_at)
            assert found == reference.exact(key, low, high, _digest_at)
    for key in range(4):
        assert ours.members(key) == reference.members(key, 0, NO_LIMIT)
        assert (key in ours) == (key in reference.index)
    assert len(ours) == len(reference.index)
    assert sorted((key, sorted(items)) for key, items in ours.items()) == sorted(
        (key, sorted(_members(found))) for key, found in reference.index.items()
    )


def test_a_content_function_that_fails_leaves_the_index_as_it_was() -> None:
    index = SizedIndex(2)
    for item in range(3):
        index.add(1, item, 50)

    def failing(item: int) -> int:
        raise RuntimeError(f"no digest for {item}")

    before = index.members(1)
    with pytest.raises(RuntimeError, match="no digest for 0"):
        index.add(1, 3, 50, failing)
    assert index.members(1) == before
    index.add(1, 3, 50, lambda item: item % 2)
    assert index.exact(1, 0, 100, lambda length: 1) == [1, 3]
    assert index.nbytes > 0


def test_keys_and_lengths_out_of_range_are_refused_or_find_nothing() -> None:
    index = SizedIndex()
    index.add(2**64 - 1, 0, 2**32 - 1)
    assert index.members(2**64 - 1, 2**32 - 1) == [0]
    assert index.members(2**64 - 1, 2**32) == []  # no length is that long
    with pytest.raises(OverflowError):
        index.add(2**64, 1, 1)
    with pytest.raises(OverflowError):
        index.add(1, 1, 2**32)
    assert index.visited == 1

"""The engine's key index through `_core.KeyNumbers`: 64-bit keys to the numbers filed under
them, each key's in filing order, as the blob tables and the memory store ask of it (lookups
of anything, rollbacks of the last number filed), and its byte count."""

from __future__ import annotations

import random

import pytest

from rollout_store import _core


def test_agrees_with_a_dict_of_lists_through_adds_and_rollbacks() -> None:
    rng = random.Random(5)
    index = _core.KeyNumbers()
    reference: dict[int, list[int]] = {}
    filed: list[tuple[int, int]] = []
    keys = [rng.getrandbits(64) for _ in range(300)] + [0, 2**64 - 1]
    for number in range(3000):
        if filed and rng.random() < 0.2:  # a rollback takes the last number filed
            key, last = filed.pop()
            assert index.pop_last(key, last)
            reference[key].pop()
            if not reference[key]:
                del reference[key]
            continue
        key = rng.choice(keys)
        index.add(key, number)
        reference.setdefault(key, []).append(number)
        filed.append((key, number))
    assert len(index) == len(reference)
    assert sorted(index.shared()) == sorted(tuple(v) for v in reference.values() if len(v) > 1)
    for key in keys:
        numbers = reference.get(key)
        found = index.get(key)
        if numbers is None:
            assert found is None
        elif len(numbers) == 1:
            assert found == numbers[0] and type(found) is int
        else:
            assert found == tuple(numbers)


def test_only_the_last_number_under_a_key_is_taken_out() -> None:
    index = _core.KeyNumbers()
    index.add(7, 1)
    index.add(7, 2)
    assert not index.pop_last(7, 1) and not index.pop_last(8, 2)
    assert index.get(7) == (1, 2)
    assert index.pop_last(7, 2) and index.get(7) == 1
    assert index.pop_last(7, 1) and index.get(7) is None and len(index) == 0


def test_a_key_that_is_not_a_64_bit_int_is_never_there() -> None:
    index = _core.KeyNumbers()
    index.add(7, 0)
    for key in (-1, 2**64, "7", 7.5, None):
        assert index.get(key) is None
    for key, number in ((2**64, 0), (-1, 0), (7, 2**32), (7, -1)):
        with pytest.raises(OverflowError):
            index.add(key, number)
    assert index.get(7) == 0 and len(index) == 1


def test_counts_its_bytes_and_grows_by_a_few_dozen_per_key() -> None:
    index = _core.KeyNumbers()
    assert index.nbytes == 0
    for number in range(10_000):
        index.add(number * 0x9E3779B97F4A7C15 % 2**64, number)
    # 16-byte entries and 4-byte slots, with their spare room: far below a dict's 24-byte
    # entries plus a 36-byte int per key and an int per number
    assert 10_000 * 16 <= index.nbytes <= 10_000 * 32

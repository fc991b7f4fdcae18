"""The engine's key index through `_core.KeyIndex`: a `dict` of 64-bit keys for what the
graph's request index asks of it (order, replacement, lookups of anything), its byte count,
and the garbage collector seeing what it holds."""

from __future__ import annotations

import gc
import random
import weakref

import pytest

from rollout_store import _core


def test_agrees_with_a_dict_in_order_and_content() -> None:
    rng = random.Random(5)
    index = _core.KeyIndex()
    reference: dict[int, object] = {}
    keys = [rng.getrandbits(64) for _ in range(3000)] + [0, 2**64 - 1]
    for i, key in enumerate(keys):
        index[key] = reference[key] = (i,)
    for key in rng.sample(keys, 500):  # replaced values keep their key's place
        index[key] = reference[key] = [key]
    assert len(index) == len(reference) and bool(index)
    assert index.keys() == list(reference) == list(index)
    assert index.values() == list(reference.values())
    assert index.items() == list(reference.items())
    assert index.last() is next(reversed(reference.values()))
    for key in keys:
        assert index[key] is reference[key] and index.get(key) is reference[key]
        assert key in index
    for _ in range(500):
        key = rng.getrandbits(64)
        assert index.get(key) is reference.get(key)


def test_a_key_that_is_not_a_64_bit_int_is_never_there() -> None:
    index = _core.KeyIndex()
    assert not index and len(index) == 0 and index.last() is None
    index[7] = "seven"
    for key in (-1, 2**64, "7", 7.5, None):
        assert index.get(key) is None and index.get(key, "d") == "d"
        assert key not in index
        with pytest.raises(KeyError):
            index[key]
    with pytest.raises(OverflowError):
        index[2**64] = "too big"
    with pytest.raises(OverflowError):
        index[-1] = "negative"
    assert index.items() == [(7, "seven")]


def test_counts_its_bytes_and_grows_by_a_few_dozen_per_key() -> None:
    index = _core.KeyIndex()
    assert index.nbytes == 0
    for key in range(10_000):
        index[key * 0x9E3779B97F4A7C15 % 2**64] = None
    # 16-byte entries and 4-byte slots, with their spare room: far below a dict's 24-byte
    # entries plus a 36-byte int per key
    assert 10_000 * 20 <= index.nbytes <= 10_000 * 48


def test_the_garbage_collector_sees_its_values() -> None:
    class Holder:
        index: _core.KeyIndex

    holder = Holder()
    holder.index = _core.KeyIndex()
    holder.index[1] = holder  # a cycle through the index
    ref = weakref.ref(holder)
    del holder
    gc.collect()
    assert ref() is None

"""The engine's prefix digests (`_core.Packer.hash_prefix`, `_core.Blake3`) against references
that share no code with them: the `blake3` package over msgpack's own packings."""

from __future__ import annotations

from typing import Any

import blake3
import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_store import _core

#: the engine hashes in pieces of 64 KiB: sizes around them
SIZES = (0, 1, 100, (1 << 16) - 5, (1 << 16) + 5, 3 << 16)


#: what msgpack packs as the engine does (the engine's own ext types are checked elsewhere)
_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    _text,
)
plain_json = st.recursive(
    _scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(_text, children, max_size=4)
    ),
    max_leaves=20,
)


def _msgpack_items(messages: list[Any]) -> bytes:
    return b"".join(msgpack.packb(m, use_bin_type=True) for m in messages)


@given(st.lists(plain_json, max_size=12), st.data())
def test_hash_prefix_is_blake3_of_msgpacks_packings(messages: list[Any], data: Any) -> None:
    low = data.draw(st.integers(0, len(messages) + 2))
    hasher, size = _core.Packer(None, None).hash_prefix(messages, low)
    want = _msgpack_items(messages[:low])
    assert size == len(want)
    assert hasher.digest() == blake3.blake3(want).digest()


@pytest.mark.parametrize("size", SIZES)
def test_hash_prefix_across_pieces(size: int) -> None:
    messages: list[Any] = [{"role": "user", "content": "x" * size + str(i)} for i in range(5)]
    messages.append({"n": [1, 1.0, True, None, -0.0, 2**63, -(2**63)]})
    hasher, hashed = _core.Packer(None, None).hash_prefix(messages, len(messages))
    want = _msgpack_items(messages)
    assert hashed == len(want) and hasher.digest() == blake3.blake3(want).digest()


def test_a_state_goes_on_and_copies_are_their_own() -> None:
    hasher = _core.Blake3(b"abc")
    copy = hasher.copy()
    hasher.update(memoryview(b"--def--")[2:5])
    assert hasher.digest() == blake3.blake3(b"abcdef").digest()
    assert copy.digest() == blake3.blake3(b"abc").digest()
    big = bytes(range(256)) * 4096  # 1 MiB: hashed with the GIL released
    copy.update(big)
    assert copy.digest() == blake3.blake3(b"abc" + big).digest()
    with pytest.raises(TypeError):
        hasher.update("text")  # type: ignore[arg-type]


def test_a_refused_message_is_named_by_its_place() -> None:
    messages = [{"role": "user", "content": "ok"}, {"role": "user", "content": [{1j: 2}]}]
    with pytest.raises(_core.RefusedValue) as info:
        _core.Packer(None, None).hash_prefix(messages, 2)
    message, path = info.value.args
    assert path == "[1].content[0]" and "complex" in message
    # the messages before `low` only: the bad one is not reached
    hasher, size = _core.Packer(None, None).hash_prefix(messages, 1)
    assert hasher.digest() == blake3.blake3(msgpack.packb(messages[0])).digest()
    assert size == len(msgpack.packb(messages[0]))

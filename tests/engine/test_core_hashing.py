"""The engine's prefix digests (the request table's, `_core.Blake3`) against references that
share no code with them: the `blake3` package over msgpack's own packings."""

from __future__ import annotations

from array import array
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


def _digest(messages: list[Any]) -> tuple[bytes, list[bytes]]:
    """The digest the request table takes of `messages`, and their packings."""
    first, plains, (_, _, _, digest) = _core.RequestTable().find_messages(
        _core.Packer(None, None), messages
    )
    assert first == 0
    return digest, plains


@given(st.lists(plain_json, max_size=12), st.data())
def test_the_tables_digest_is_blake3_of_msgpacks_packings(messages: list[Any], data: Any) -> None:
    low = data.draw(st.integers(0, len(messages)))
    digest, plains = _digest(messages[:low])
    want = _msgpack_items(messages[:low])
    assert b"".join(plains) == want
    assert digest == blake3.blake3(want).digest()


@pytest.mark.parametrize("size", SIZES)
def test_the_tables_digest_across_pieces(size: int) -> None:
    messages: list[Any] = [{"role": "user", "content": "x" * size + str(i)} for i in range(5)]
    messages.append({"n": [1, 1.0, True, None, -0.0, 2**63, -(2**63)]})
    digest, _ = _digest(messages)
    assert digest == blake3.blake3(_msgpack_items(messages)).digest()


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


#: piece sizes around BLAKE3's chunk (1 KiB) and its subtrees
_pieces = st.lists(
    st.sampled_from([0, 1, 63, 64, 1023, 1024, 1025, 2048, 3000, 4096, 8191, 65536, 70000]),
    max_size=12,
)


@given(pieces=_pieces, copy_at=st.integers(0, 12))
def test_a_state_in_any_pieces_digests_as_blake3_and_stays_small(
    pieces: list[int], copy_at: int
) -> None:
    """The state is kept compactly (its subtrees' chaining values and its last chunk, not
    BLAKE3's own 1.9 KB): digests taken anywhere, and copies that go on alone, are BLAKE3's
    of the bytes so far."""
    data = bytes(range(251)) * (sum(pieces) // 251 + 1)
    hasher, fed, copy = _core.Blake3(), 0, None
    for i, size in enumerate(pieces):
        if i == copy_at:
            copy = (fed, hasher.copy())
        hasher.update(data[fed : fed + size])
        fed += size
        assert hasher.digest() == blake3.blake3(data[:fed]).digest()
        # at most a chaining value a bit of its chunk count (and one more), and a chunk
        assert hasher.nbytes <= 32 * ((fed // 1024).bit_length() + 1) + 1024
    if copy is not None:
        at, state = copy
        state.update(data[at:fed])
        assert state.digest() == blake3.blake3(data[:fed]).digest()


def test_a_refused_message_is_named_by_its_place() -> None:
    messages = [{"role": "user", "content": "ok"}, {"role": "user", "content": [{1j: 2}]}]
    with pytest.raises(_core.RefusedValue) as info:
        _digest(messages)
    message, path = info.value.args
    assert path == "[1].content[0]" and "complex" in message
    # the messages before it only: the bad one is not reached
    digest, _ = _digest(messages[:1])
    assert digest == blake3.blake3(msgpack.packb(messages[0])).digest()


#: texts of each storage kind a str has (ASCII, Latin-1, 2-byte, 4-byte code points)
_hole_texts = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=30)


@given(st.lists(st.tuples(st.binary(max_size=20), _hole_texts), max_size=6), st.binary())
def test_update_hollow_hashes_the_text_but_its_holes(
    pieces: list[tuple[bytes, str]], after: bytes
) -> None:
    data, holes, between = b">", [], []
    for before, text in pieces:
        data += before
        between.append(before)
        start = len(data)
        data += text.encode("utf-8")
        holes.append((start, len(data), text))
    data += after + b"<"
    between.append(after)
    hasher = _core.Blake3(b"head")
    assert hasher.update_hollow(data, 1, len(data) - 1, holes)
    assert hasher.digest() == blake3.blake3(b"head" + b"".join(between)).digest()


@pytest.mark.parametrize("text", ["abc", "caf\xe9", "\u20ac!", "\U0001f600x"])
def test_update_hollow_refuses_a_hole_that_differs_and_feeds_nothing(text: str) -> None:
    utf8 = text.encode("utf-8")
    data = b"[" + utf8 + b"]" + utf8 + b"!"
    hole = (1, 1 + len(utf8), text)
    later = (2 + len(utf8), 2 + 2 * len(utf8), text)
    hasher = _core.Blake3(b"x")
    assert hasher.update_hollow(data, 0, len(data), [hole, later])
    assert hasher.digest() == blake3.blake3(b"x[]!").digest()
    refused = [
        [(hole[0], hole[1], text[:-1] + "?")],  # other text
        [(hole[0] + 1, hole[1] + 1, text)],  # other place
        [(hole[0], hole[1] - 1, text)],  # other length
        [later, hole],  # out of order
        [(0, 4, "[abc")],  # before the range fed (below)
        [(len(data) - 2, len(data) + 1, "!")],  # past its end
        [(hole[0], hole[1], "\ud800")],  # a lone surrogate has no UTF-8
    ]
    for holes in refused:
        hasher = _core.Blake3(b"x")
        assert not hasher.update_hollow(data, 1, len(data), holes)
        assert hasher.digest() == blake3.blake3(b"x").digest()
    with pytest.raises(ValueError):
        _core.Blake3().update_hollow(data, 0, len(data) + 1, [])
    with pytest.raises(ValueError):
        _core.Blake3().update_hollow(data, 3, 2, [])
    with pytest.raises(TypeError):
        _core.Blake3().update_hollow(data, 0, 1, [(0, 1, b"[")])  # type: ignore[list-item]


def test_update_hollow_compares_utf8_not_a_texts_storage() -> None:
    latin = "caf\xe9"  # stored one byte a character: its Latin-1 bytes are not its UTF-8
    data = b"[" + latin.encode("latin-1") + b"]"
    hasher = _core.Blake3()
    assert not hasher.update_hollow(data, 0, len(data), [(1, 5, latin)])
    assert hasher.digest() == blake3.blake3(b"").digest()


@pytest.mark.parametrize(
    "sizes",
    [(70_000, 70_000), (5, 20_000, 7, 1, 40_000, 3), (20_000, 3, 5, 16_383, 16_384, 0)],
)
def test_update_hollow_of_short_and_long_pieces_hashes_the_same(sizes: tuple[int, ...]) -> None:
    """Pieces between holes, short ones hashed gathered and long ones as they are (the
    GIL released for a large text), give the digest of the pieces one after the other."""
    pieces = [bytes([65 + k % 26]) * size for k, size in enumerate(sizes)]
    data, holes = b"", []
    for k, piece in enumerate(pieces):
        data += piece
        if k < len(pieces) - 1:
            text = f"<{k}>" * 3
            holes.append((len(data), len(data) + len(text), text))
            data += text.encode()
    hasher = _core.Blake3()
    assert hasher.update_hollow(data, 0, len(data), holes)
    assert hasher.digest() == blake3.blake3(b"".join(pieces)).digest()


@given(st.lists(st.integers(0, 2**32 - 1), max_size=50))
def test_u32_ids_are_an_arrays_bytes(ids: list[int]) -> None:
    assert _core.u32_ids(ids) == array("I", ids).tobytes()


class _Id(int):
    pass


@pytest.mark.parametrize(
    "ids",
    [[1, True], [False], [1, 2.0], [2**32], [-1], [2**70], [1, _Id(3)], ["1"], [None], [1j]],
)
def test_u32_ids_leave_anything_but_exact_32_bit_ints_to_the_caller(ids: list[Any]) -> None:
    assert _core.u32_ids(ids) is None

"""check_packed (the engine's): every value the library stores passes; what it passes decodes
and dumps; where msgpack's own decoder can vouch for a value, the engine finds what it finds."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable

import msgpack
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from support import json_like

from rollout_store import MAX_DEPTH
from rollout_store.engine.blobs import BlobTable
from rollout_store.engine.encoding import EXT_BLOB, EXT_ECHO, unpack
from rollout_store.engine.intake import Encoder
from rollout_store.files.packed import (
    PackedInfo,
    blob_indexes,
    check_int_array,
    check_packed,
    splice_blobs,
)

#: The longest value the msgpack reference decodes.
QUICK_LIMIT = 16 << 10


class _Unsure(Exception):
    pass


def quick_check(
    data: bytes,
    n_blobs: int,
    max_depth: int,
    *,
    blob_surrogates: Callable[[int], bool] | None = None,
    echo_ok: bool = False,
) -> PackedInfo | None:
    """A reference that shares no code with the engine: what msgpack's own decoder finds in
    a short value that packs back to exactly its bytes, holding no bytes, blob references in
    range and at most one echo (first in a top-level array) as its only extension types;
    None when it cannot vouch for the value (then only the engine decides)."""
    if len(data) > QUICK_LIMIT or b"\xc4\x00" in data:
        return None
    containers = sum(1 for b in data if 0x80 <= b <= 0x9F or 0xDC <= b <= 0xDF)
    if containers >= max_depth:
        return None
    info = PackedInfo(-1)

    def ext(code: int, payload: bytes) -> msgpack.ExtType:
        if code == EXT_BLOB and len(payload) == 4:
            index = int.from_bytes(payload, "big")
            if index >= n_blobs:
                raise _Unsure
            info.refs += 1
            if blob_surrogates is not None and blob_surrogates(index):
                info.special = True
        elif code == EXT_ECHO and echo_ok and not payload and not info.echoes:
            info.echoes = 1
        else:
            raise _Unsure
        return msgpack.ExtType(code, payload)

    try:
        value = msgpack.unpackb(
            data, raw=False, strict_map_key=False, ext_hook=ext, max_bin_len=0, timestamp=1
        )
        if msgpack.packb(value, use_bin_type=True) != data:
            return None
    except Exception:
        return None
    if type(value) is list:
        info.top_items = len(value)
        if info.echoes and value[0] != msgpack.ExtType(EXT_ECHO, b""):
            return None
    elif info.echoes:
        return None
    return info


@given(json_like)
def test_every_stored_value_passes_and_splices_to_its_plain_packing(value: object) -> None:
    blobs = BlobTable()
    stored, special = Encoder(blobs, 8).encode(value, "v")
    surrogates = lambda i: blobs.handle(i).surrogates  # noqa: E731
    info = check_packed(stored, len(blobs), MAX_DEPTH, blob_surrogates=surrogates)
    assert info.special >= special
    plain, _ = Encoder(None, None).encode(value, "v")
    spliced = splice_blobs(
        stored, info.blob_refs, lambda i: blobs.string(i).encode("utf-8", "surrogatepass")
    )
    if not info.special:
        assert spliced == plain


@given(json_like)
def test_blob_indexes_name_the_blobs_a_value_refers_to_in_order(value: object) -> None:
    blobs = BlobTable()
    stored, _ = Encoder(blobs, 8).encode(value, "v")
    info = check_packed(stored, len(blobs), MAX_DEPTH)
    named: list[int] = []
    unpack(stored, lambda i: named.append(i) or "blob")
    assert blob_indexes(stored, info.blob_refs) == named
    assert len(named) == info.refs


@given(st.binary(max_size=60))
def test_whatever_passes_decodes_and_dumps(data: bytes) -> None:
    try:
        check_packed(data, 2, MAX_DEPTH)
    except ValueError:
        return
    value = unpack(data, lambda i: "blob")
    json.dumps(value)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\xc4\x01x", "bytes"),
        (b"\x91\xc4\x00", "bytes"),
        (b"\x81\x90\x01", "dict key"),  # a list as a key
        (b"\x92\x01\xc7\x00\x01", "not allowed"),  # a tuple marker second in an array
        (b"\x93\x90\xc7\x00\x01\x01", "not allowed"),  # a tuple marker after an empty array
        (b"\x81\xc7\x00\x01\x01", "not allowed"),  # a tuple marker as a key
        (b"\xd6\x04\x00\x00\x00\x09", "out of range"),
        # a blob reference in a form no version writes: the splicers read `D6 04` at its offset
        (b"\x91\xc7\x04\x04\x00\x00\x00\x00", "4-byte fixext"),
        (b"\xc7\x00\x05", "not allowed"),  # an echo where none may be
        (b"\xc7\x03\x02abc", "decimal"),
        (b"\xc1", "not msgpack"),
        (b"\x01\x02", "after the value"),
        (b"\xdd\xff\xff\xff\xff", "more items than bytes"),
        (b"\xa3ab", "past the end"),
        (b"\xa2\xff\xfe", "UTF-8"),
    ],
)
def test_values_that_could_not_be_handed_back_are_refused(data: bytes, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        check_packed(data, 1, MAX_DEPTH)


def test_depth_is_bounded() -> None:
    ok = b"\x91" * (MAX_DEPTH - 1) + b"\x90"
    check_packed(ok, 0, MAX_DEPTH)
    with pytest.raises(ValueError, match="nesting deeper"):
        check_packed(b"\x91" + ok, 0, MAX_DEPTH)


def test_many_empty_maps_check_in_flat_memory() -> None:
    """An array of 128 Ki empty maps: 1 byte each packed, 64 bytes each decoded."""
    n = 1 << 17
    data = b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        info = check_packed(data, 0, MAX_DEPTH)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert info.top_items == n
    assert peak < 32 << 10  # not a per-item allocation


def test_top_level_array_count() -> None:
    packed = msgpack.packb([{"a": [1, 2.5, None, True]}, "x"], use_bin_type=True)
    assert check_packed(packed, 0, MAX_DEPTH).top_items == 2
    assert check_packed(msgpack.packb({"a": 1}), 0, MAX_DEPTH).top_items == -1


def test_record_mode_allows_bytes_and_bounds_containers() -> None:
    record = msgpack.packb(["id\udc00".encode("utf-8", "surrogatepass"), b"\x00", [[1, 2]]])
    check_packed(record, 0, 3, record=True, max_containers=3)
    with pytest.raises(ValueError, match="more containers"):
        check_packed(record, 0, 3, record=True, max_containers=2)
    with pytest.raises(ValueError, match="not allowed"):
        check_packed(b"\x91\xc7\x00\x01", 0, 3, record=True)


def test_int_arrays() -> None:
    check_int_array(msgpack.packb([1, -5, 2**40, -(2**40)]))
    check_int_array(b"\x91\xc7\x03\x02123")  # a big int
    for bad in (b"\x91\xa1x", b"\x91\x90", b"\x92\x01", b"\x01", b"\x91\x01\x01"):
        with pytest.raises(ValueError, match="token ids"):
            check_int_array(bad)


def test_strings_are_utf8_each_not_only_together() -> None:
    # two strings that are invalid alone but form "é" when concatenated
    with pytest.raises(ValueError, match="UTF-8"):
        check_packed(b"\x92\xa1\xc3\xa1\xa9", 0, MAX_DEPTH)
    with pytest.raises(ValueError, match="UTF-8"):
        check_packed(b"\x92\xa1\xa9\xa1a", 0, MAX_DEPTH)  # a lone continuation byte
    check_packed(msgpack.packb(["é", "ü" * 40, "x"]), 0, MAX_DEPTH)


def test_many_short_strings_check_in_flat_memory() -> None:
    n = 1 << 16
    data = b"\xdd" + n.to_bytes(4, "big") + b"\xa1x" * n
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        check_packed(data, 0, MAX_DEPTH)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak < 128 << 10  # not a per-string allocation (the strings are 128 KiB)


def _agrees(data: bytes, n_blobs: int, echo_ok: bool = False) -> bool:
    """quick_check never accepts what check_packed refuses, and finds what it finds; True
    when quick_check could tell."""
    quick = quick_check(data, n_blobs, MAX_DEPTH, echo_ok=echo_ok)
    if quick is None:
        return False
    slow = check_packed(data, n_blobs, MAX_DEPTH, echo_ok=echo_ok)  # raises if it refuses
    assert (quick.top_items, quick.special, quick.echoes) == (
        slow.top_items,
        slow.special,
        slow.echoes,
    )
    assert quick.refs == slow.refs == len(slow.blob_refs)
    return True


@example({"0000000\ud800": None})  # a lone surrogate in a blob: special, from the blob table
@given(json_like)
def test_quick_check_agrees_on_stored_values(value: object) -> None:
    blobs = BlobTable()
    stored, special = Encoder(blobs, 8).encode(value, "v")
    _agrees(stored, len(blobs))
    # the loader's quick look knows which blobs hold lone surrogates, as intake does
    quick = quick_check(
        stored, len(blobs), MAX_DEPTH, blob_surrogates=lambda i: blobs.handle(i).surrogates
    )
    if quick is not None:
        assert quick.special == special
    if not special and len(stored) <= QUICK_LIMIT and b"\xc4\x00" not in stored:
        # an ordinary stored value is what the quick look exists for
        assert quick_check(stored, len(blobs), MAX_DEPTH) is not None


@given(st.binary(max_size=60), st.booleans())
def test_quick_check_never_accepts_what_check_packed_refuses(data: bytes, echo_ok: bool) -> None:
    _agrees(data, 2, echo_ok)


@given(json_like, st.data())
def test_quick_check_agrees_on_damaged_values(value: object, data: st.DataObject) -> None:
    stored = bytearray(Encoder(BlobTable(), 8).encode(value, "v")[0])
    at = data.draw(st.integers(0, len(stored) - 1))
    stored[at] = data.draw(st.integers(0, 255))
    _agrees(bytes(stored), 2)


@pytest.mark.parametrize(
    "data",
    [
        b"\xc4\x01x",  # bytes
        b"\x91\xc4\x00",  # empty bytes
        b"\x91\xc5\x00\x00",  # empty bytes, bin 16
        b"\x81\x90\x01",  # a list as a key
        b"\x92\x01\xc7\x00\x01",  # a tuple marker
        b"\xd6\x04\x00\x00\x00\x09",  # a blob out of range
        b"\xc7\x00\x05",  # an echo where none may be
        b"\x92\xc7\x00\x05\xc7\x00\x05",  # two echoes
        b"\x82\xa1a\x01\xa1a\x02",  # a repeated key (decoded, it packs shorter)
        b"\xd9\x01a",  # a non-canonical string header
        b"\xca\x00\x00\x00\x00",  # a 32-bit float
        b"\x91\xd6\xff\x00\x00\x00\x01",  # a msgpack timestamp (ext -1: no hook sees it)
        b"\x91\xd7\xff" + bytes(8),  # a 64-bit timestamp
        b"\x91" * MAX_DEPTH + b"\x90",  # nesting deeper than MAX_DEPTH
        b"\x92" + msgpack.packb("x" * (QUICK_LIMIT + 1)) + b"\x01",  # too long to decode
    ],
)
def test_quick_check_leaves_the_close_looks_to_check_packed(data: bytes) -> None:
    assert quick_check(data, 1, MAX_DEPTH) is None


def test_quick_check_counts_blob_references_and_one_echo() -> None:
    blob = msgpack.packb(msgpack.ExtType(4, b"\x00\x00\x00\x01"))
    echo = msgpack.packb(msgpack.ExtType(5, b""))
    data = b"\x93" + echo + b"\x81\xa1k" + blob + blob
    info = quick_check(data, 2, MAX_DEPTH, echo_ok=True, blob_surrogates=lambda i: i == 1)
    assert info is not None
    assert (info.top_items, info.refs, info.echoes, info.special) == (3, 2, 1, True)
    assert quick_check(data, 2, MAX_DEPTH) is None  # no echo allowed
    assert quick_check(data, 1, MAX_DEPTH, echo_ok=True) is None  # blob 1 out of range
    echo_key = b"\x81" + echo + b"\xc0"  # an echo as a dict key: check_packed refuses it
    assert quick_check(echo_key, 1, MAX_DEPTH, echo_ok=True) is None
    assert quick_check(b"\x91\x91" + echo, 1, MAX_DEPTH, echo_ok=True) is None  # nested


_ext = st.builds(
    msgpack.ExtType,
    st.integers(0, 7),
    st.sampled_from([b"", b"\x00\x00\x00\x00", b"\x00\x00\x00\x01", b"\x00\x00\x00\x09", b"12"]),
)
_raw_trees = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
              st.text(max_size=40), st.binary(max_size=3), _ext),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(
            st.one_of(st.text(max_size=3), st.integers(-9, 9), _ext), children, max_size=3
        ),
    ),
    max_leaves=12,
)  # fmt: skip


@given(_raw_trees, st.booleans())
def test_quick_check_agrees_on_trees_with_any_extension_types(tree: object, echo_ok: bool) -> None:
    _agrees(msgpack.packb(tree, use_bin_type=True), 2, echo_ok)

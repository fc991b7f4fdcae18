"""The engine's value intake and rebuild against the package's Python ones, byte for byte.

`_core.Packer` (through this file's `Encoder`) must pack every value exactly as the Python walk
and msgpack did (the stored format is unchanged), intern the same long strings in the same
order, and refuse every bad value with the same error class, message and path;
`_core.unpack` must rebuild what msgpack's rebuild did, blobs as the table's own objects.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
from typing import Any

import msgpack
import numpy as np
import pydantic
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from support import assert_same, assert_same_json, json_like, same

from rollout_store import InvalidValueError, _core
from rollout_store.engine import encoding as reference_unpack
from rollout_store.engine import intake as reference_intake
from rollout_store.engine.blobs import BlobTable
from rollout_store.engine.encoding import ECHO_PACKED
from rollout_store.engine.intake import MAX_DEPTH

unpack = _core.unpack


class Encoder:
    """`intake.Encoder`'s interface over the engine's `Packer` (what the graph will call)."""

    def __init__(self, blobs: BlobTable | None, threshold: int | None) -> None:
        self._packer = _core.Packer(None if blobs is None else blobs.intern, threshold)
        self.last_refs = False
        self.last_longest = 0

    def encode(self, value: Any, path: str) -> tuple[bytes, bool]:
        try:
            packed = self._packer.pack(value)
        except _core.RefusedValue as refused:
            message, where = refused.args
            raise InvalidValueError(message, path + where) from None
        self.last_refs = self._packer.last_refs
        self.last_longest = self._packer.last_longest
        return packed, self._packer.last_special


class Text(str):
    pass


class Number(int):
    pass


class Real(float):
    pass


class Members(dict):  # type: ignore[type-arg]
    pass


class Items(list):  # type: ignore[type-arg]
    pass


Pair = collections.namedtuple("Pair", "a b")


def _subclassed(value: Any) -> Any:
    """`value` with its containers and scalars swapped for subclasses (read as their bases)."""
    t = type(value)
    if t is str:
        return Text(value)
    if t is int:
        return Number(value)
    if t is float:
        return Real(value)
    if t is list:
        return Items(_subclassed(v) for v in value)
    if t is tuple:
        items = [_subclassed(v) for v in value]
        return Pair(*items) if len(items) == 2 else tuple(items)
    if t is dict:
        return Members((k, _subclassed(v)) for k, v in value.items())
    return value


def _both(value: Any, threshold: int | None) -> tuple[Any, Any]:
    """(engine, reference) results of packing `value`: packing, special, refs, longest and
    the blob table's strings, or the error's (class, message, path)."""
    results = []
    for make in (Encoder, reference_intake.Encoder):
        blobs = BlobTable() if threshold is not None else None
        encoder = make(blobs, threshold)
        try:
            packed, special = encoder.encode(value, "request_messages[3]")
        except InvalidValueError as error:
            results.append((type(error), str(error), error.path, error.reason))
            continue
        strings = [] if blobs is None else [blobs.string(i) for i in range(len(blobs))]
        results.append((packed, special, encoder.last_refs, encoder.last_longest, strings, blobs))
    return results[0], results[1]


def _check_packing(value: Any, threshold: int | None) -> None:
    ours, theirs = _both(value, threshold)
    assert ours[:4] == theirs[:4]
    if len(ours) > 4:
        assert same(ours[4], theirs[4])
        packed, blobs = ours[0], ours[5]
        string = blobs.string if blobs is not None else None
        rebuilt = unpack(packed, string or _no_blob)
        assert_same(rebuilt, reference_unpack.unpack(packed, string or _no_blob))
        assert_same_json(rebuilt, value)


def _no_blob(index: int) -> str:
    raise AssertionError(f"blob {index} read from a plain packing")


@given(json_like, st.sampled_from([None, 1, 8, 64]))
@example({"a": [1, 2.0, True, None, -0.0, float("nan")]}, 8)
@example([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1], None)
@example({1: "a", 1.5: "b", None: "c", False: "d", 2**80: "e"}, 8)
@example({"\ud800" * 20: "\udfff" * 20, "é" * 20: ["x" * 20, "x" * 20]}, 8)
@example(((), [], {}, ((),)), None)
def test_packing_and_rebuild_equal_the_python_walk(value: Any, threshold: int | None) -> None:
    _check_packing(value, threshold)


@given(json_like, st.sampled_from([None, 8]))
def test_subclasses_pack_as_their_bases(value: Any, threshold: int | None) -> None:
    _check_packing(_subclassed(value), threshold)


@pytest.mark.parametrize("depth", [MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1])
@pytest.mark.parametrize("kind", ["list", "dict", "tuple"])
def test_nesting_near_the_bound(depth: int, kind: str) -> None:
    value: Any = "leaf"
    for i in range(depth):
        value = [value] if kind == "list" else {f"k{i % 3}": value} if kind == "dict" else (value,)
    ours, theirs = _both(value, 8)
    assert ours[:4] == theirs[:4]
    # MAX_DEPTH containers nest; one more is refused
    assert (len(ours) == 4) == (depth > MAX_DEPTH)


class Model(pydantic.BaseModel):
    x: int = 1


@dataclasses.dataclass
class Point:
    x: int = 0


def _cycles() -> list[Any]:
    a: list[Any] = []
    a.append(a)
    d: dict[str, Any] = {"messages": [{"content": []}]}
    d["messages"][0]["content"].append(d)
    deep: list[Any] = [[[]]]
    deep[0][0].append(deep[0])
    t: list[Any] = []
    t.append((1, {"x": t}))
    return [a, d, deep, t]


BAD = [
    {1, 2},
    frozenset(),
    b"bytes",
    bytearray(b"x"),
    object(),
    Model(),
    Point(),
    np.float32(1.5),
    np.int64(3),
    np.bool_(True),
    np.array([1, 2]),
    np.zeros((2, 2)),
    msgpack.ExtType(4, b"\0\0\0\0"),
    complex(1, 2),
    {"content": [{"type": "text"}, {"image_url": {"url": b"x"}}]},
    {"a": {(1, 2): "tuple key"}},
    {"a": [{"ok": 1}, {frozenset(): 1}]},
    {"key with space": [object()]},
    {"if": [None, {"ok": {1, 2}}]},
    {1: [{2.5: [{None: [{True: [set()]}]}]}]},
    [10**5000],
    {"n": -(10**5000)},
    *_cycles(),
]


@pytest.mark.parametrize("value", BAD, ids=lambda v: type(v).__name__)
@pytest.mark.parametrize("threshold", [None, 4])
def test_bad_values_are_refused_as_before(value: Any, threshold: int | None) -> None:
    ours, theirs = _both(value, threshold)
    assert len(ours) == 4, ours
    assert ours == theirs


def test_the_path_names_the_bad_value() -> None:
    messages = [{"role": "user", "content": [{"type": "text"}, {"image_url": {1, 2}}]}]
    with pytest.raises(InvalidValueError) as caught:
        Encoder(None, None).encode(messages[0], "request_messages[3]")
    assert caught.value.path == "request_messages[3].content[1].image_url"
    assert caught.value.reason == "value of type set cannot be represented in JSON"


def test_a_long_string_is_interned_once_and_rebuilt_as_the_tables_object() -> None:
    blobs = BlobTable()
    long = "a long shared string " * 10
    packed, special = Encoder(blobs, 64).encode([long, {"k": long}, long + "!"], "v")
    assert (len(blobs), special) == (2, False)
    first, second = unpack(packed, blobs.string), unpack(packed, blobs.string)
    assert first[0] is first[1]["k"] is second[0] is blobs.string(0)
    assert first[2] is blobs.string(1)


def test_a_raising_intern_passes_its_error_through() -> None:
    class Boom(Exception):
        pass

    def intern(text: str) -> Any:
        raise Boom(text[:3])

    packer = _core.Packer(intern, 4)
    with pytest.raises(Boom, match="abc"):
        packer.pack(["ok", "abcdef"])


def test_the_echo_is_what_echo_returns_and_refused_without_one() -> None:
    data = b"\x92" + ECHO_PACKED + b"\x01"
    assert unpack(data, _no_blob, lambda: {"r": 1}) == [{"r": 1}, 1]
    with pytest.raises(ValueError, match="unknown extension type 5"):
        unpack(data, _no_blob)


@pytest.mark.parametrize(
    "data",
    [b"", b"\x92\x01", b"\x01\x02", b"\xc1", b"\xa2\xff\xfe", b"\xc7\x00\x09", b"\xdb\xff\xff"],
)
def test_damaged_bytes_raise_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        unpack(data, _no_blob)
    with pytest.raises(ValueError):
        reference_unpack.unpack(data, _no_blob)


def test_big_ints_beyond_the_digit_limit_rebuild_as_written() -> None:
    n = 7**6000  # about 5,000 digits: more than a default process writes as text
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        packed, special = Encoder(None, None).encode([n, -n], "v")
    finally:
        sys.set_int_max_str_digits(old)
    assert special
    assert unpack(packed, _no_blob) == [n, -n] == reference_unpack.unpack(packed, _no_blob)


def test_json_dumps_of_a_rebuild_equals_the_recorded_text() -> None:
    text = (
        '{"a": [1, 1.0, true, -0.0, NaN, Infinity, 1e+16, 123456789012345678901234567890], '
        '"\\ud800": "\\udfff"}'
    )
    value = json.loads(text)
    packed, _ = Encoder(None, None).encode(value, "v")
    assert json.dumps(unpack(packed, _no_blob)) == text


def test_a_rust_panic_is_a_python_exception_and_the_packer_still_works() -> None:
    blobs = BlobTable()
    packer = _core.Packer(blobs.intern, 8)
    with pytest.raises(BaseException) as caught:
        packer._pack_then_panic(["a long string here"])
    assert type(caught.value).__name__ == "PanicException"
    assert "panic for tests" in str(caught.value)
    assert packer.pack(["short"]) == b"\x91\xa5short"

"""The engine's value intake and rebuild (`_core.Packer`, `_core.unpack`) against references
that share no code with it.

The plain format is msgpack's (`msgpack.packb(use_bin_type=True)` writes the same bytes); the
library's extension types are checked against bytes spelled out here; every packing rebuilds
to a value `json.dumps` writes exactly as it wrote what was put in (type for type: 1 / 1.0 /
True, float bits, key order, tuples); long strings land in the blob table in the order the
value holds them; refusals name the exact message and path.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import json
import sys
import tracemalloc
from array import array
from typing import Any

import msgpack
import numpy as np
import pydantic
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from support import assert_same, assert_same_json, json_like

from rollout_store import InvalidValueError, _core
from rollout_store.engine.blobs import BlobTable
from rollout_store.engine.encoding import ECHO_PACKED
from rollout_store.engine.intake import MAX_DEPTH, Encoder

unpack = _core.unpack


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


def _long_strings(value: Any, threshold: int | None) -> list[str]:
    """The strings a packing of `value` holds as blob references, in the order it meets them
    (each once): strings of `threshold` code points or more, dict keys among them unless an
    exact ASCII str (a key is short, and an ASCII one is written inline)."""
    found: dict[str, None] = {}

    def walk(v: Any) -> None:
        if isinstance(v, str):
            if threshold is not None and len(v) >= threshold:
                found.setdefault(str(v))
        elif isinstance(v, dict):
            for k, item in v.items():
                if isinstance(k, str) and not (type(k) is str and k.isascii()):
                    walk(k)
                walk(item)
        elif isinstance(v, list | tuple):
            for item in v:
                walk(item)

    walk(value)
    return list(found)


def _has_special(value: Any, blobs: list[str]) -> bool:
    """Whether a packing of `value` holds an extension type a caller could imitate: a tuple,
    an int beyond 64 bits or a string with a lone surrogate (inline or as a blob)."""

    def special(v: Any) -> bool:
        if isinstance(v, tuple):
            return True
        if isinstance(v, bool) or v is None or isinstance(v, float):
            return False
        if isinstance(v, int):
            return not -(2**63) <= v < 2**64
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
            return False
        if isinstance(v, dict):
            return any(special(k) or special(item) for k, item in v.items())
        return any(special(item) for item in v)

    return special(value) or any(special(s) for s in blobs)


def _plain_msgpack(value: Any) -> bytes | None:
    """msgpack's own packing of `value`, or None when it needs an extension type."""
    try:
        packed: bytes = msgpack.packb(value, use_bin_type=True, strict_types=True)
    except (TypeError, ValueError, OverflowError):  # a tuple, a surrogate, a big int
        return None
    return packed


def _check_packing(value: Any, threshold: int | None) -> None:
    blobs = BlobTable() if threshold is not None else None
    encoder = Encoder(blobs, threshold)
    packed, special = encoder.encode(value, "request_messages[3]")
    strings = [] if blobs is None else [blobs.string(i) for i in range(len(blobs))]
    assert strings == _long_strings(value, threshold)
    assert special == _has_special(value, strings)
    assert encoder.last_refs == bool(strings)
    assert encoder.last_longest == max(map(len, strings), default=0)
    if not strings:
        plain = _plain_msgpack(value)
        if plain is not None:
            assert packed == plain
    rebuilt = unpack(packed, blobs.string if blobs is not None else _no_blob)
    assert_same(rebuilt, value)
    assert_same_json(rebuilt, value)


def _no_blob(index: int) -> str:
    raise AssertionError(f"blob {index} read from a plain packing")


plain_json = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),
        st.floats(),
        st.text(st.characters(exclude_categories=["Cs"])),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=8), children, max_size=4),
    ),
    max_leaves=24,
)


@given(plain_json)
def test_plain_values_pack_as_msgpack_does(value: Any) -> None:
    assert Encoder(None, None).encode(value, "v") == (msgpack.packb(value), False)


@given(json_like, st.sampled_from([None, 1, 8, 64]))
@example({"a": [1, 2.0, True, None, -0.0, float("nan")]}, 8)
@example([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1], None)
@example({1: "a", 1.5: "b", None: "c", False: "d", 2**80: "e"}, 8)
@example({"\ud800" * 20: "\udfff" * 20, "é" * 20: ["x" * 20, "x" * 20]}, 8)
@example(((), [], {}, ((),)), None)
def test_packing_rebuilds_exactly_and_interns_the_long_strings(
    value: Any, threshold: int | None
) -> None:
    _check_packing(value, threshold)


def _ext(code: int, payload: bytes) -> bytes:
    """An extension item as msgpack writes it: fixext for 1, 2, 4, 8 and 16 bytes, else ext8
    or ext16 (a big endian length, then the type)."""
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    if len(payload) in fixed:
        return bytes((fixed[len(payload)], code)) + payload
    if len(payload) < 256:
        return bytes((0xC7, len(payload), code)) + payload
    return b"\xc8" + len(payload).to_bytes(2, "big") + bytes((code,)) + payload


@pytest.mark.parametrize(
    ("value", "threshold", "packed"),
    [
        ((), None, b"\x91" + _ext(1, b"")),
        ((1, "a"), None, b"\x93" + _ext(1, b"") + b"\x01\xa1a"),
        ([(None,)], None, b"\x91\x92" + _ext(1, b"") + b"\xc0"),
        (2**64, None, _ext(2, b"18446744073709551616")),
        (-(2**63) - 1, None, _ext(2, b"-9223372036854775809")),
        ({2**70: 1}, None, b"\x81" + _ext(2, b"1180591620717411303424") + b"\x01"),
        ("a\ud800", None, _ext(3, b"a\xed\xa0\x80")),
        ({"\udfff": 0}, None, b"\x81" + _ext(3, b"\xed\xbf\xbf") + b"\x00"),
        (["long text", "long text"], 8, b"\x92" + _ext(4, bytes(4)) * 2),
        (
            ["short", "long text", "other text"],
            8,
            b"\x93\xa5short" + _ext(4, bytes(4)) + _ext(4, b"\0\0\0\1"),
        ),
        ("\ud800" * 8, 8, _ext(4, bytes(4))),
    ],
)
def test_the_extension_types_are_packed_as_specified(
    value: Any, threshold: int | None, packed: bytes
) -> None:
    blobs = BlobTable() if threshold is not None else None
    got, special = Encoder(blobs, threshold).encode(value, "v")
    assert got == packed
    # a tuple, a big int or a surrogate (inline or in a blob) is special; a blob is not
    assert special == (not isinstance(value, list) or threshold is None)
    assert_same(unpack(got, blobs.string if blobs is not None else _no_blob), value)


@given(json_like, st.sampled_from([None, 8]))
def test_subclasses_pack_as_their_bases(value: Any, threshold: int | None) -> None:
    subclassed = _subclassed(value)
    if threshold is None:
        assert Encoder(None, None).encode(subclassed, "v") == Encoder(None, None).encode(value, "v")
    else:
        blobs = BlobTable()
        packed, _ = Encoder(blobs, threshold).encode(subclassed, "v")
        assert_same(unpack(packed, blobs.string), value)


@pytest.mark.parametrize("depth", [MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1])
@pytest.mark.parametrize("kind", ["list", "dict", "tuple"])
def test_nesting_near_the_bound(depth: int, kind: str) -> None:
    value: Any = "leaf"
    for i in range(depth):
        value = [value] if kind == "list" else {f"k{i % 3}": value} if kind == "dict" else (value,)
    encoder = Encoder(BlobTable(), 8)
    # MAX_DEPTH containers nest; one more is refused
    if depth > MAX_DEPTH:
        with pytest.raises(InvalidValueError) as caught:
            encoder.encode(value, "v")
        assert caught.value.reason == f"nesting deeper than {MAX_DEPTH} levels"
    else:
        packed, _ = encoder.encode(value, "v")
        assert_same(unpack(packed, _no_blob), value)


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


_SET = "value of type set cannot be represented in JSON"
_DIGITS = (
    "an int with more digits than Python writes as text (sys.get_int_max_str_digits()): "
    "json.dumps cannot write it either"
)
_CYCLE = "reference cycle (a container contains itself)"
_NUMPY_VALUE = "is not a JSON value: pass `value.item()`"

#: what each of BAD is refused with: the path after the field's name, and the reason
REFUSALS = [
    ("", _SET),
    ("", "value of type frozenset cannot be represented in JSON"),
    ("", "value of type bytes cannot be represented in JSON"),
    ("", "value of type bytearray cannot be represented in JSON"),
    ("", "value of type object cannot be represented in JSON"),
    (
        "",
        "a pydantic model (Model) is not a JSON value: pass what the SDK would send, "
        '`value.model_dump(mode="json", exclude_unset=True)`',
    ),
    ("", "a dataclass (Point) is not a JSON value: pass `dataclasses.asdict(value)`"),
    ("", f"a numpy value (float32) {_NUMPY_VALUE}"),
    ("", f"a numpy value (int64) {_NUMPY_VALUE}"),
    ("", f"a numpy value (bool) {_NUMPY_VALUE}"),
    ("", "a numpy array (ndarray) is not a JSON value: pass `value.tolist()`"),
    ("", "a numpy array (ndarray) is not a JSON value: pass `value.tolist()`"),
    ("", "value of type ExtType cannot be represented in JSON"),
    ("", "value of type complex cannot be represented in JSON"),
    (".content[1].image_url.url", "value of type bytes cannot be represented in JSON"),
    (".a", "dict key of type tuple (JSON keys are str, int, float, bool, None)"),
    (".a[1]", "dict key of type frozenset (JSON keys are str, int, float, bool, None)"),
    ("['key with space'][0]", "value of type object cannot be represented in JSON"),
    (".if[1].ok", _SET),
    ("[1][0][2.5][0][None][0][True][0]", _SET),
    ("[0]", _DIGITS),
    (".n", _DIGITS),
    ("[0]", _CYCLE),
    (".messages[0].content[0]", _CYCLE),
    ("[0][0][0]", _CYCLE),
    ("[0][1].x", _CYCLE),
]


@pytest.mark.parametrize(
    ("value", "refusal"), list(zip(BAD, REFUSALS, strict=True)), ids=lambda v: type(v).__name__
)
@pytest.mark.parametrize("threshold", [None, 4])
def test_bad_values_are_refused_with_their_path(
    value: Any, refusal: tuple[str, str], threshold: int | None
) -> None:
    blobs = BlobTable() if threshold is not None else None
    with pytest.raises(InvalidValueError) as caught:
        Encoder(blobs, threshold).encode(value, "request_messages[3]")
    assert (caught.value.path, caught.value.reason) == (
        "request_messages[3]" + refusal[0],
        refusal[1],
    )


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


def test_big_ints_beyond_the_digit_limit_rebuild_as_written() -> None:
    n = 7**6000  # about 5,000 digits: more than a default process writes as text
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        packed, special = Encoder(None, None).encode([n, -n], "v")
        digits = str(n).encode("ascii")
    finally:
        sys.set_int_max_str_digits(old)
    assert special
    assert packed == b"\x92" + _ext(2, digits) + _ext(2, b"-" + digits)
    assert unpack(packed, _no_blob) == [n, -n]


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
    packer = _core.Packer(blobs.packer_intern, 8)
    with pytest.raises(BaseException) as caught:
        packer._pack_then_panic(["a long string here"])
    assert type(caught.value).__name__ == "PanicException"
    assert "panic for tests" in str(caught.value)
    assert packer.pack(["short"]) == b"\x91\xa5short"


def test_packing_leaves_nothing_behind_in_the_interpreter() -> None:
    """Packers made and dropped turn after turn, each handing long strings to the blob table,
    leave no interpreter memory behind once the table goes (the attribute names the engine
    reads on each handle are interned strings, not a fresh str per call that the type's
    attribute cache would keep)."""

    def turns(n: int) -> None:
        blobs = BlobTable()
        for i in range(n):
            packer = _core.Packer(blobs.packer_intern, 8)
            packer.pack({"role": "user", "content": f"a long string {i}", "items": [i, 1.5]})

    turns(50)  # the caches a first use fills
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        turns(3000)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 2048, kept


@settings(max_examples=300, deadline=None)
@given(json_like, st.sampled_from([1, 4, 16]))
def test_a_stored_packing_spliced_is_the_plain_packing_of_its_value(
    value: Any, threshold: int
) -> None:
    """`_core.splice` puts each blob reference's string back as `Packer(None, None)` packs it
    (lone surrogates as their extension type): what verify hashes for a stored request."""
    from rollout_store.files.packed import check_packed

    blobs = BlobTable()
    stored = _core.Packer(blobs.packer_intern, threshold).pack(value)
    info = check_packed(stored, len(blobs), 1000)
    refs = info.blob_refs.tobytes() if info.refs else b""
    assert _core.splice(stored, refs, blobs.string) == _core.Packer(None, None).pack(value)


def test_splice_refuses_an_offset_that_is_no_blob_reference() -> None:
    blobs = BlobTable()
    stored = _core.Packer(blobs.packer_intern, 4).pack(["long text", "x"])
    at = stored.index(b"\xd6")
    ok = array("I", [at]).tobytes()
    assert _core.splice(stored, ok, blobs.string) == _core.Packer(None, None).pack(
        ["long text", "x"]
    )
    for refs in (array("I", [at + 1]).tobytes(), array("I", [len(stored)]).tobytes(), b"\0"):
        with pytest.raises(ValueError, match="splice"):
            _core.splice(stored, refs, blobs.string)
    with pytest.raises(ValueError, match="splice"):  # out of order
        _core.splice(stored, array("I", [at, at]).tobytes(), blobs.string)

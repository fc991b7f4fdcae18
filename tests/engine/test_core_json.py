"""The engine's exact JSON against the standard library: `_core.loads` against `json.loads` on
the same bytes and `_core.dumps` against `json.dumps`, on generated values and odd texts."""

from __future__ import annotations

import collections
import enum
import json
import math
import struct
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_store import _core

_SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d"])
_TEXT = st.text(alphabet=st.one_of(st.characters(), _SURROGATES), max_size=12)
_INTS = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.integers(min_value=-(10**300), max_value=10**300),
    st.sampled_from([2**63, -(2**63) - 1, 2**64, -(2**64), 0]),
)
_FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e16, 1e-5, 5e-324, 1.7976931348623157e308, 1.0]),
)
_SCALARS = st.one_of(st.none(), st.booleans(), _INTS, _FLOATS, _TEXT)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(_TEXT, inner, max_size=5),
    ),
    max_leaves=30,
)
# what json.dumps also takes: tuples, and int, float, bool and None keys
_DUMPABLE = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.lists(inner, max_size=5).map(tuple),
        st.dictionaries(
            st.one_of(_TEXT, _INTS, _FLOATS, st.booleans(), st.none()), inner, max_size=5
        ),
    ),
    max_leaves=30,
)
_SPELLINGS: list[dict[str, Any]] = [
    {},
    {"ensure_ascii": False},
    {"indent": 2},
    {"separators": (",", ":")},
]
_ENCODINGS = ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-be"]


def _same(data: bytes) -> None:
    """`_core.loads(data)` is what `json.loads(data)` gives, or both refuse it."""
    try:
        expected = json.loads(data)
    except (ValueError, RecursionError):
        with pytest.raises(ValueError):
            _core.loads(data)
        return
    got = _core.loads(data)
    assert type(got) is type(expected)
    assert json.dumps(got) == json.dumps(expected)


@given(_VALUES, st.sampled_from(_SPELLINGS), st.sampled_from(_ENCODINGS))
def test_loads_matches_json_loads(value: Any, spelling: dict[str, Any], encoding: str) -> None:
    text = json.dumps(value, **spelling)
    data = text.encode(encoding, "surrogatepass")
    assert json.dumps(_core.loads(data)) == json.dumps(json.loads(data)) == json.dumps(value)


@given(_DUMPABLE)
def test_dumps_matches_json_dumps(value: Any) -> None:
    assert _core.dumps(value) == json.dumps(value)


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "\u00e9", "\\u0061"]), _SCALARS)))
def test_duplicate_keys_keep_first_position_and_last_value(members: list[Any]) -> None:
    # "\\u0061" is the key "a" written as an escape: the same key
    body = ", ".join(f'"{key}": {json.dumps(value)}' for key, value in members)
    _same(("{" + body + "}").encode())


@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_float_repr_on_random_bit_patterns(bits: int) -> None:
    (value,) = struct.unpack("<d", struct.pack("<Q", bits))
    assert _core.dumps(value) == json.dumps(value)
    assert _core.dumps([value, {"k": value}]) == json.dumps([value, {"k": value}])
    text = json.dumps(value).encode()
    assert json.dumps(_core.loads(text)) == json.dumps(value)


@given(st.binary(max_size=40))
def test_arbitrary_bytes_accepted_or_refused_alike(data: bytes) -> None:
    _same(data)


_JSONISH = st.text(
    alphabet='[]{}",: 0123456789.eE+-truefalsnNaIifyx\\u\t\n\ud800\u00e9', max_size=24
)


@given(_JSONISH)
def test_jsonish_text_accepted_or_refused_alike(text: str) -> None:
    _same(text.encode("utf-8", "surrogatepass"))


@pytest.mark.parametrize(
    "data",
    [
        b'"\\ud800"',
        b'"\\udc00\\ud800"',
        b'"\\ud83d\\ude00"',
        b'"\\ud800\\u0041"',
        b'"\xed\xa0\x80"',  # a raw surrogate, as surrogatepass reads it
        b'"\xed\xa0\x80\\udc00"',
        b"1e400",
        b"-1e400",
        b"[NaN, Infinity, -Infinity, -0.0, -0, 1E+2, 0.1]",
        b"123456789012345678901234567890",
        b"\xef\xbb\xbf[1]",
        b'{"a": 1, "b": 2, "a": 3}',
        b'{"": [], "x": {}, "y": [{}]}',
        b" \t\r\n[ 1 , 2 ] \n",
        b"[1.]",
        b"01",
        b"-",
        b'"\\x"',
        b'"a\nb"',
        b"\xef\xbb\xbf\xef\xbb\xbf1",
        b"\xff\xfe1\x00",
        "[1]".encode("utf-32"),
    ],
)
def test_edge_texts(data: bytes) -> None:
    _same(data)


def test_malformed_json_raises_with_the_byte_offset() -> None:
    with pytest.raises(_core.DecodeError) as caught:
        _core.loads(b'[1, 2 "x"]')
    assert isinstance(caught.value, ValueError)
    assert caught.value.offset == 6
    assert str(caught.value) == "Expecting ',' delimiter at byte 6"
    with pytest.raises(_core.DecodeError, match=r"Expecting value at byte 4$"):
        _core.loads(b"\xef\xbb\xbf[x]")  # the BOM counts
    with pytest.raises(_core.DecodeError, match=r"invalid UTF-8 at byte 2$") as caught:
        _core.loads(b'["\xff"]')
    assert caught.value.offset == 2
    with pytest.raises(_core.DecodeError, match="Unterminated string starting at byte 1"):
        _core.loads(b'["abc')


def test_depth_is_bounded_and_named() -> None:
    deep = b"[" * 501 + b"]" * 501
    with pytest.raises(_core.DecodeError, match="nesting deeper than 500 levels at byte 500"):
        _core.loads(deep)
    assert json.dumps(_core.loads(deep, max_depth=501)) == json.dumps(json.loads(deep))
    with pytest.raises(ValueError, match="nesting deeper than 3 levels"):
        _core.dumps([[[[1]]]], max_depth=3)


def test_int_digit_limit_behaves_like_json_loads() -> None:
    digits = b"7" * 5000
    with pytest.raises(ValueError, match="Exceeds the limit") as expected:
        json.loads(digits)
    with pytest.raises(ValueError) as got:
        _core.loads(digits)
    assert str(got.value) == str(expected.value)
    with pytest.raises(ValueError, match="Exceeds the limit"):
        _core.dumps(10**5000)
    # where the process raised its limit, both read the digits
    code = (
        "import json; from rollout_store import _core; d = b'7' * 5000; "
        "assert _core.loads(d) == json.loads(d); assert _core.dumps(json.loads(d)) == d.decode()"
    )
    proc = subprocess.run(
        [sys.executable, "-X", "int_max_str_digits=0", "-c", code],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


class _Color(enum.IntEnum):
    RED = 1


class _F(float):
    def __repr__(self) -> str:
        return "not used"


class _S(str):
    pass


def test_dumps_subclasses_and_keys_as_json_does() -> None:
    value: Any = {
        "e": _Color.RED,
        "f": _F(2.5),
        "s": _S("x\u00e9"),
        "o": collections.OrderedDict([("b", 1), ("a", 2)]),
        1: "int key",
        2.5: "float key",
        False: "bool key",
        None: "none key",
        float("nan"): "nan key",
        2**70: "big key",
        "t": (1, (2, [])),
    }
    assert _core.dumps(value) == json.dumps(value)


class _Items(dict[Any, Any]):
    """A dict whose own items() differ from what it holds (json.dumps asks items())."""

    def items(self) -> Any:
        return iter([("shown", 1), (2, [3])])


class _Iterated(list[Any]):
    """A list whose iteration differs from what it holds (json.dumps iterates it)."""

    def __iter__(self) -> Any:
        return iter(["shown", {"k": None}])


class _IteratedTuple(tuple[Any, ...]):
    def __iter__(self) -> Any:
        return iter([1.5, "shown"])


def test_dumps_reads_container_subclasses_as_json_does() -> None:
    moved = collections.OrderedDict([("a", 1), ("b", 2), ("c", 3)])
    moved.move_to_end("a")  # its order is its own, not the dict's underneath
    value: Any = {
        "moved": moved,
        "d": _Items(hidden=0),
        "l": _Iterated(["hidden"]),
        "t": _IteratedTuple(("hidden",)),
        "nested": [_Items(), _Iterated([_Items(x=1)])],
    }
    assert _core.dumps(value) == json.dumps(value)


class _Pairs(dict[Any, Any]):
    def items(self) -> Any:
        return iter([("a", 1, 2)])


def test_dumps_refuses_bad_items_of_a_dict_subclass() -> None:
    with pytest.raises(ValueError) as expected:
        json.dumps(_Pairs(a=1))
    with pytest.raises(ValueError) as got:
        _core.dumps(_Pairs(a=1))
    assert str(got.value) == str(expected.value)


def test_dumps_refuses_what_json_refuses() -> None:
    for bad in (object(), {1, 2}, b"bytes", [1, object()]):
        with pytest.raises(TypeError, match="is not JSON serializable"):
            _core.dumps(bad)
    with pytest.raises(TypeError, match="keys must be str, int, float, bool or None, not tuple"):
        _core.dumps({(1, 2): 3})
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular reference detected"):
        _core.dumps(loop)


def test_loads_builds_plain_python_values() -> None:
    value = _core.loads(b'{"a": [1, 1.0, true, null, "\\ud800", 1e400, NaN]}')
    assert list(value) == ["a"]
    one, one_f, true, none, lone, inf, nan = value["a"]
    assert (type(one), type(one_f), true, none, lone) == (int, float, True, None, "\ud800")
    assert inf == math.inf and math.isnan(nan)

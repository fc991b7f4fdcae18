"""A plain packing at least as long as the share threshold is taken as stored without the
validating walk only where byte scans show the walk would build exactly it (`_walk_free`):
no long string's type byte, no ext or bin type, fewer container bytes than MAX_DEPTH."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_store import InvalidValueError, RolloutGraph, TurnNode
from rollout_store._core import Packer
from rollout_store.engine.blobs import BlobTable
from rollout_store.engine.intake import MAX_DEPTH, Encoder
from rollout_store.engine.requests import _long_string_types, _walk_free


def test_long_string_types_by_threshold():
    assert _long_string_types(None) == b""
    assert _long_string_types(31) is None  # a fixstr can hold such a string: no scan tells
    assert _long_string_types(32) == b"\xd9\xda\xdb"
    assert _long_string_types(255) == b"\xd9\xda\xdb"
    assert _long_string_types(256) == b"\xda\xdb"
    assert _long_string_types(1024) == b"\xda\xdb"
    assert _long_string_types(0x10000) == b"\xdb"


_texts = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="ab", min_size=250, max_size=1100),  # around str8/str16 and thresholds
    st.text(alphabet="é€x", min_size=20, max_size=400),  # non-ASCII: more bytes than chars
)
_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    _texts,
)
_values = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.one_of(_texts, st.integers(-5, 5)), inner, max_size=5),
    ),
    max_leaves=40,
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(_values, st.sampled_from([32, 100, 256, 1024, None]))
def test_walk_free_packing_is_what_the_walk_builds(value: Any, threshold: int | None):
    plain = Packer(None, None).pack(value)
    if not _walk_free(plain, _long_string_types(threshold)):
        return  # the walk decides (checked by the rest of the suite)
    blobs = BlobTable()
    packed, special = Encoder(blobs, threshold).encode(value, "value")
    assert packed == plain
    assert not special
    assert len(blobs) == 0


@pytest.mark.parametrize(
    "value",
    [
        ["x" * 1024],  # a blob string (str16)
        {"k": "é" * 600},  # 1,200 bytes of a non-ASCII blob string
        [b"bytes", "y" * 2000],  # bin
        [msgpack.ExtType(4, b"\x00\x00\x00\x00"), "z" * 2000],  # a forged blob reference
        [2**70, "w" * 2000],  # a big int (an ext type in the plain packing)
    ],
)
def test_long_packing_with_long_string_or_foreign_type_is_not_walk_free(value: Any):
    try:
        packed = Packer(None, None).pack(value)
    except ValueError:  # bin and caller's ext types: packed as msgpack packs them
        packed = msgpack.packb(value, use_bin_type=True)
    assert not _walk_free(packed, _long_string_types(1024))


def test_nesting_is_bounded_by_container_bytes():
    deep: Any = "leaf"
    for _ in range(MAX_DEPTH - 1):
        deep = [deep]
    assert _walk_free(Packer(None, None).pack(deep), b"\xda\xdb")  # 499 containers
    assert not _walk_free(Packer(None, None).pack([deep]), b"\xda\xdb")  # 500: the walk decides


def _tools(n: int) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "Does one thing of the repository well." * 2,
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
        for i in range(n)
    ]


def test_long_tools_list_without_long_strings_round_trips_and_is_shared():
    tools = _tools(12)
    assert len(Packer(None, None).pack(tools)) > 1024  # at least as long as the share threshold
    graph = RolloutGraph(share_threshold=1024)
    messages = [{"role": "user", "content": "hi"}]
    a = graph.add_turn(TurnNode(request_messages=messages, request_tools=tools))
    b = graph.add_turn(TurnNode(request_messages=messages + [{"role": "user", "content": "x"}]))
    c = graph.add_turn(
        TurnNode(request_messages=[{"role": "user", "content": "other"}], request_tools=tools)
    )
    assert json.dumps(graph.request_tools(a.node_id)) == json.dumps(tools)
    assert graph.request_tools(b.node_id) is None
    assert json.dumps(graph.request_tools(c.node_id)) == json.dumps(tools)
    assert len(graph.blobs) == 0  # no string of 1,024 characters: nothing became a blob


def test_long_value_with_a_long_string_still_makes_a_blob():
    tools = _tools(3) + [{"type": "function", "function": {"description": "d" * 5000}}]
    graph = RolloutGraph(share_threshold=1024)
    node = graph.add_turn(TurnNode(request_messages=[], request_tools=tools))
    assert len(graph.blobs) == 1
    assert json.dumps(graph.request_tools(node.node_id)) == json.dumps(tools)


@pytest.mark.parametrize("bad", [b"raw", bytearray(b"raw")])
def test_long_value_with_bytes_inside_is_refused_and_changes_nothing(bad: Any):
    tools = _tools(12) + [{"type": "function", "function": {"name": bad}}]
    graph = RolloutGraph(share_threshold=1024)
    with pytest.raises(InvalidValueError) as info:
        graph.add_turn(TurnNode(request_messages=[], request_tools=tools))
    assert info.value.path.startswith("request_tools[12]")
    assert len(graph) == 0
    assert len(graph.blobs) == 0

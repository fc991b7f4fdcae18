"""The engine's loose link key (`_core.link_echoes`) against the linker's own in Python:
`response_link_key(response) == link_key(message)` (an exception: no echo).

A response is compared with its echo in the next request loosely (null members, role left
out, text parts, tool-call arguments as parsed JSON); the engine reads both from their plain
packings and must answer what Python answers, or None where it cannot tell from bytes."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from support import messages, small_json

from rollout_store import _core
from rollout_store.engine.messages import LINK_DEPTH, link_key, response_link_key


def python_echoes(response: Any, message: Any) -> bool:
    try:
        return bool(response_link_key(response) == link_key(message))
    except ValueError:
        return False


def packed(value: Any) -> bytes | None:
    try:
        return _core.Packer(None, None).pack(value)
    except ValueError:
        return None


def assert_agrees(response: Any, message: Any) -> bool | None:
    r, m = packed(response), packed(message)
    if r is None or m is None:
        assume(False)  # (values the packer refuses are never a turn's)
    got = _core.link_echoes(r, m)  # type: ignore[arg-type]
    if got is not None:
        assert got is python_echoes(response, message), (response, message)
    return got


def _loosened(message: Any, draw: Any) -> Any:
    """What a harness may send back for a response: nulls added or dropped, the role named,
    keys in another order, content as text parts, arguments written again."""
    if not isinstance(message, dict):
        return message
    out = dict(message)
    if draw(st.booleans()):
        out["refusal"] = None
    if draw(st.booleans()):
        out["role"] = out.get("role") or "assistant"
    content = out.get("content")
    if isinstance(content, str) and draw(st.booleans()):
        cut = draw(st.integers(0, len(content)))
        out["content"] = [
            {"type": "text", "text": content[:cut]},
            {"type": "text", "text": content[cut:], "cache": None},
        ]
    calls = out.get("tool_calls")
    if isinstance(calls, list) and draw(st.booleans()):
        rewritten = []
        for call in calls:
            call = copy.deepcopy(call)
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    parsed = json.loads(function["arguments"])
                    function["arguments"] = json.dumps(parsed, separators=(",", ":"))
                except ValueError:
                    pass
            rewritten.append(call)
        out["tool_calls"] = rewritten
    items = list(out.items())
    if draw(st.booleans()):
        items.reverse()
    return dict(items)


tool_calls = st.lists(
    st.fixed_dictionaries(
        {
            "id": st.text(max_size=4),
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {
                    "name": st.one_of(st.sampled_from(["f", "g"]), small_json),
                    "arguments": st.one_of(
                        small_json.map(lambda v: json.dumps(v)),
                        st.sampled_from(['{"a": 1}', '{"a":1.0}', "{'a': 1}", "", "[1, 2]"]),
                        small_json,
                    ),
                }
            ),
        }
    ),
    max_size=3,
)
responses = st.one_of(
    messages,
    st.fixed_dictionaries(
        {"role": st.sampled_from(["assistant", None])},
        optional={
            "content": st.one_of(st.none(), st.text(max_size=8), small_json),
            "tool_calls": st.one_of(tool_calls, small_json),
        },
    ),
)


@settings(max_examples=600, deadline=None)
@given(responses, st.data())
@example({"content": "hi", "refusal": None}, None)
@example({"role": "assistant", "content": [{"type": "text", "text": 1}]}, None)
@example([1, 2.0, True], None)
def test_the_engine_links_a_response_to_its_loose_echo_as_python_does(
    response: Any, data: Any
) -> None:
    echo = _loosened(response, data.draw) if data is not None else response
    assert_agrees(response, echo)
    other = data.draw(responses) if data is not None else {"role": "user"}
    assert_agrees(response, other)


@pytest.mark.parametrize(
    ("response", "message", "expected"),
    [
        ({"content": "hi"}, {"role": "assistant", "content": "hi", "x": None}, True),
        ({"role": "assistant", "content": None}, {"role": "assistant", "content": ""}, True),
        ({"content": [1, 2]}, {"role": "assistant", "content": (1, 2)}, True),
        ({"role": ("a",), "content": "x"}, {"role": ["a"], "content": "x"}, False),
        ({"role": ("a",), "content": "x"}, {"role": ("a",), "content": "x"}, True),
        ({"content": (1, 2)}, {"role": "assistant", "content": (1.0, True + 1)}, True),
        ([float("nan")], [float("nan")], None),
        ({"content": [{"type": "text", "text": 5}]}, {"content": "5"}, None),
        (
            {"tool_calls": [{"function": {"name": "f", "arguments": '{"x": [1, 2]}'}}]},
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "f", "arguments": {"x": [1.0, 2]}}}],
            },
            True,
        ),
    ],
)
def test_the_cases_python_decides_its_own_way(response: Any, message: Any, expected: Any) -> None:
    assert assert_agrees(response, message) is expected


def test_a_message_nested_past_the_bound_has_no_key() -> None:
    deep: Any = 1
    for _ in range(LINK_DEPTH):
        deep = [deep]
    message = {"role": "assistant", "content": deep}
    assert assert_agrees(message, message) is False
    assert python_echoes(message, message) is False


def test_a_packing_that_is_no_plain_value_is_left_to_python() -> None:
    blobs_packer = _core.Packer(lambda s: pytest.fail("no intern"), None)
    assert _core.link_echoes(b"\xd6\x04\x00\x00\x00\x01", blobs_packer.pack({"a": 1})) is None
    assert _core.link_echoes(b"\x91", b"\x90") is None


@pytest.mark.parametrize("depth", [95, 96, 97, 98])
@pytest.mark.parametrize("same", [True, False])
def test_arguments_nested_about_the_room_they_have_are_json_or_text_as_in_python(
    depth: int, same: bool
) -> None:
    """Arguments whose JSON nests past `LINK_DEPTH - 4` are compared as text, the rest as
    parsed JSON: written alike or not, at the bound and around it."""
    arguments = "[" * depth + "1" + "]" * depth
    other = arguments if same else "[" * depth + "1.0" + "]" * depth
    response = {
        "role": "assistant",
        "tool_calls": [{"function": {"name": "f", "arguments": arguments}}],
    }
    message = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": other}}]}
    assert assert_agrees(response, message) is python_echoes(response, message)


def test_a_packing_whose_dict_python_merges_is_left_to_python() -> None:
    # {"role": "user", "role": "assistant", "content": "hi"}: unpacked, the last role stays
    repeated = b"\x83" + b"".join(
        bytes((0xA0 | len(s),)) + s.encode()
        for s in ("role", "user", "role", "assistant", "content", "hi")
    )
    response = _core.Packer(None, None).pack({"content": "hi"})
    message = _core.unpack(repeated, lambda i: pytest.fail("no blob"))
    assert python_echoes({"content": "hi"}, message) is True
    assert _core.link_echoes(response, repeated) is None

"""Materialization: get() gives back exactly what was recorded, byte for byte and type for type."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import (
    FUZZ,
    add_all,
    assert_same,
    assert_same_json,
    chat_turns,
    fresh,
    json_like,
    materialized,
    messages,
    same,
    small_json,
)

from rollout_store import RolloutGraph, TurnNode, export_session

THRESHOLDS = [8, 64, 1024, None]
LONE = json.loads('"\\ud800"')
LONE_LOW = json.loads('"\\udfff"')


def odd_values() -> dict[str, Any]:
    return {
        "key_order": {"b": 1, "a": 2, "c": {"z": 0, "y": 1, "x": {"q": [], "p": {}}}},
        "numbers": [1, 1.0, True, 0, 0.0, -0.0, False, None, -1, -1.0, 1e-320, 5e-324],
        "specials": [math.nan, math.inf, -math.inf, -math.nan],
        "big_ints": [2**70, -(2**65), 2**64, 2**64 - 1, 2**63, -(2**63), -(2**63) - 1, 10**40],
        "short_surrogates": [LONE, LONE_LOW, "a" + LONE + "b", "\ud83d\ude00", "\U0001f600"],
        "long_ascii": "a" * 5000,
        "long_surrogates": ("x" + LONE) * 1500 + LONE_LOW,
        "long_non_ascii": "ü€\U0001f600" * 700,
        "medium": "m" * 40,
        "medium_non_ascii": "é" * 40,
        "empties": [[], {}, (), "", [[]], {"": {}}],
        "keys": {
            2: "int",
            1.5: "float",
            True: "bool",
            None: "none",
            -0.0: "negzero",
            2**70: "big",
            "k": "str",
            "é" * 30: "long key",
            LONE: "surrogate key",
        },
        "tuples": (1, [2, (3, ())], {"t": (None,)}),
        "image": {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 4000}},
    }


def _fields_for(value: Any) -> dict[str, Any]:
    """`value` placed in every recorded field."""
    return {
        "request_messages": [
            {"role": "system", "content": value},
            {"role": "user", "content": value},
            value,
        ],
        "response_message": {"role": "assistant", "content": value},
        "request_tools": [{"type": "function", "function": {"parameters": value}}, value],
        "sampling_params": {"temperature": 0.0, "extra": value},
    }


def _check_turn(graph: RolloutGraph, node_id: str, fields: dict[str, Any]) -> None:
    got = materialized(graph, node_id)
    getters = {
        "request_messages": graph.request_messages,
        "response_message": graph.response_message,
        "request_tools": graph.request_tools,
        "sampling_params": graph.sampling_params,
    }
    for name, want in fields.items():
        assert_same(got[name], want)
        assert_same_json(got[name], want)
        if name in getters:
            assert_same(getters[name](node_id), want)


@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("name", sorted(odd_values()))
def test_odd_values_come_back_exactly(name, threshold):
    value = odd_values()[name]
    graph = RolloutGraph(share_threshold=threshold)
    fields = _fields_for(value)
    node = graph.add_turn(TurnNode(node_id="a", **copy.deepcopy(fields)))
    _check_turn(graph, node.node_id, fields)
    # a second turn re-sending the same content goes through the shared paths
    again = graph.add_turn(TurnNode(node_id="b", **copy.deepcopy(fields)))
    _check_turn(graph, again.node_id, fields)


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_numbers_keep_type_and_sign(threshold):
    graph = RolloutGraph(share_threshold=threshold)
    value = [1, 1.0, True, 0.0, -0.0, math.nan, 2**70, -(2**65)]
    graph.add_turn(TurnNode(node_id="a", response_message={"v": value, 0.0: -0.0}))
    got = graph.response_message("a")
    v = got["v"]
    assert [type(x) for x in v] == [int, float, bool, float, float, float, int, int]
    assert math.copysign(1.0, v[3]) == 1.0
    assert math.copysign(1.0, v[4]) == -1.0
    assert math.isnan(v[5])
    assert v[6] == 2**70 and v[7] == -(2**65)
    (key,) = [k for k in got if k != "v"]
    assert type(key) is float and math.copysign(1.0, got[key]) == -1.0
    assert json.dumps(got) == json.dumps({"v": value, 0.0: -0.0})


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_container_types_are_kept(threshold):
    graph = RolloutGraph(share_threshold=threshold)
    messages_tuple = ({"role": "user", "content": ("a", ["b"])}, ["x", ("y",)])
    graph.add_turn(TurnNode(node_id="t", request_messages=messages_tuple))
    graph.add_turn(TurnNode(node_id="l", request_messages=list(messages_tuple)))
    graph.add_turn(TurnNode(node_id="e", request_messages=()))
    graph.add_turn(TurnNode(node_id="el", request_messages=[]))
    graph.add_turn(TurnNode(node_id="n", request_messages=None))
    graph.add_turn(TurnNode(node_id="s", request_messages=({"role": "system", "content": "s"},)))
    assert_same(graph.request_messages("t"), messages_tuple)
    assert_same(graph.request_messages("l"), list(messages_tuple))
    assert_same(graph.request_messages("e"), ())
    assert_same(graph.request_messages("el"), [])
    assert graph.request_messages("n") is None
    assert_same(graph.request_messages("s"), ({"role": "system", "content": "s"},))


def test_unset_fields_come_back_as_the_defaults():
    graph = RolloutGraph()
    graph.add_turn(TurnNode(node_id="a"))
    node = graph.get("a")
    expected = {
        "request_messages": [],
        "request_tools": None,
        "response_message": {},
        "sampling_params": {},
        "requested_sampling_params": {},
        "prompt_ids": [],
        "sampled_ids": [],
        "sampled_logprobs": None,
        "model": None,
        "n_tools": 0,
    }
    for name, value in expected.items():
        assert_same(getattr(node, name), value)


def test_fields_given_as_none_come_back_none():
    graph = RolloutGraph()
    names = ("request_messages", "response_message", "sampling_params", "prompt_ids")
    graph.add_turn(TurnNode(node_id="a", **dict.fromkeys(names)))
    node = graph.get("a")
    for name in names:
        assert getattr(node, name) is None, name


def test_scalar_fields_and_metadata_round_trip():
    graph = RolloutGraph()
    tools = [{"type": "function", "function": {"name": "f"}}] * 3
    graph.add_turn(
        TurnNode(
            node_id="a",
            model="m-1",
            finish_reason="stop",
            harness_session_id="s-9",
            request_tools=tools,
            n_tools=None,  # counted from the tools
            request_messages=[{"role": "system", "content": "sys"}, {"role": "user"}],
        )
    )
    graph.add_turn(TurnNode(node_id="b", n_tools=7, system_digest="given", request_tools=tools))
    a, b = graph.get("a"), graph.get("b")
    assert (a.model, a.finish_reason, a.harness_session_id) == ("m-1", "stop", "s-9")
    assert a.n_tools == 3 and b.n_tools == 7
    assert isinstance(a.system_digest, str) and b.system_digest == "given"
    assert a.index == 0 and b.index == 1


def test_deep_long_texts_share_and_come_back():
    graph = RolloutGraph(share_threshold=16)
    text = "q" * 100
    fields = {"response_message": {"a": [{"b": [text, (text, {"c": text})]}], text: text}}
    graph.add_turn(TurnNode(node_id="a", **copy.deepcopy(fields)))
    _check_turn(graph, "a", fields)
    assert graph.stats()["blobs"] == 1


# ---------------------------------------------------------------- deep nesting

_DEEP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from support import same
    from rollout_store import MAX_DEPTH, RolloutGraph, TurnNode, export_session

    kind = sys.argv[1]

    def nest(n):
        v = "leaf"
        for i in range(n):
            k = kind if kind != "mixed" else ("list", "dict", "tuple")[i % 3]
            v = [v] if k == "list" else {{"k": v}} if k == "dict" else (v,)
        return v

    for depth, threshold in ((400, 8), (400, None), (MAX_DEPTH, 1024)):
        graph = RolloutGraph(share_threshold=threshold)
        fields = dict(
            request_messages=[nest(depth - 1)],
            response_message=nest(depth),
            request_tools=nest(depth),
            sampling_params={{"x": nest(depth - 1)}},
        )
        node = graph.add_turn(TurnNode(**fields))
        got = graph.get(node.node_id)
        for name, want in fields.items():
            value = getattr(got, name)
            assert same(value, want), name
            assert json.dumps(value) == json.dumps(want), name
        again = graph.add_turn(TurnNode(**fields))  # the shared paths: same request again
        assert same(graph.get(again.node_id).request_messages, fields["request_messages"])
        json.dumps(export_session(graph, include_messages=True))
    print("OK")
    """
)


@pytest.mark.parametrize("kind", ["list", "dict", "tuple", "mixed"])
def test_deep_nesting_round_trips(kind, tmp_path):
    """Run in a child process: a crash (C stack overflow) must fail the test, not the run."""
    script = tmp_path / "deep.py"
    script.write_text(
        _DEEP_SCRIPT.format(
            tests=str(__import__("pathlib").Path(__file__).resolve().parents[1] / "support")
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script), kind], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "OK"


# ---------------------------------------------------------------- isolation


def test_editing_materialized_values_changes_nothing_else():
    graph = RolloutGraph(share_threshold=64)
    image = "data:image/png;base64," + "B" * 500
    turns = chat_turns(4, images=[image, image + "x", image + "y", image + "z"])
    for fields in turns:
        fields["request_tools"] = [{"type": "function", "function": {"name": "f", "p": [1]}}]
        fields["sampling_params"] = {"temperature": 0.5, "stop": ["\n"]}
    ids = add_all(graph, turns)
    originals = [materialized(graph, n) for n in ids]
    snapshot = json.dumps(export_session(graph, include_messages=True))

    got = dataclasses.replace(graph.get(ids[1]))  # an editable copy of the view
    got.request_messages[1]["content"][1]["image_url"]["url"] = "edited"
    got.request_messages[1]["content"].append({"type": "text", "text": "new"})
    got.request_messages[2]["content"] = "edited echo"  # the echo of turn 0's response
    got.request_messages.pop()
    got.response_message["content"] = "edited"
    got.request_tools[0]["function"]["p"].append(2)
    got.sampling_params["stop"][0] = "edited"
    got.prompt_ids = [1]
    msgs = graph.request_messages(ids[2])
    msgs[0]["content"] = "edited system"
    msgs[3]["content"] = "edited"
    graph.response_message(ids[0])["content"] = "edited"
    graph.request_tools(ids[3])[0]["function"]["name"] = "g"
    graph.sampling_params(ids[3])["temperature"] = 9

    for node_id, want in zip(ids, originals, strict=True):
        assert_same(materialized(graph, node_id), want)
    assert json.dumps(export_session(graph, include_messages=True)) == snapshot


def test_each_get_builds_fresh_containers():
    graph = RolloutGraph()
    add_all(graph, chat_turns(3))
    first, second = graph.get("t2"), graph.get("t2")
    assert first.request_messages == second.request_messages
    assert first.request_messages is not second.request_messages
    for a, b in zip(first.request_messages, second.request_messages, strict=True):
        assert a is not b


# ---------------------------------------------------------------- sharing on and off


def _odd_conversation(surrogates: bool) -> list[dict[str, Any]]:
    odd = odd_values()
    if not surrogates:
        for name in ("short_surrogates", "long_surrogates"):
            del odd[name]
        del odd["keys"][LONE]
    history: list[Any] = [{"role": "system", "content": odd["long_non_ascii"]}]
    turns = []
    for k, name in enumerate(sorted(odd)):
        history.append({"role": "user", "content": [odd[name], k]})
        response = {"role": "assistant", "content": odd[name], "n": k}
        turns.append(
            {
                "request_messages": copy.deepcopy(history),
                "response_message": copy.deepcopy(response),
                "request_tools": [odd["keys"]] if k % 2 else None,
                "sampling_params": {"seed": k, "odd": odd["numbers"]},
            }
        )
        history.append(response)
    return turns


def _export_across_thresholds(turns: list[dict[str, Any]]) -> set[str]:
    documents = set()
    for threshold in THRESHOLDS:
        graph = RolloutGraph(share_threshold=threshold)
        ids = add_all(graph, copy.deepcopy(turns))
        for node_id, fields in zip(ids, turns, strict=True):
            _check_turn(graph, node_id, {k: v for k, v in fields.items() if v is not None})
        documents.add(
            json.dumps(export_session(graph, include_messages=True, include_discarded=True))
        )
    return documents


def test_sharing_on_and_off_export_identical_bytes():
    assert len(_export_across_thresholds(_odd_conversation(surrogates=False))) == 1


def test_sharing_on_and_off_export_identical_bytes_with_lone_surrogates():
    assert len(_export_across_thresholds(_odd_conversation(surrogates=True))) == 1


# ---------------------------------------------------------------- properties

thresholds = st.sampled_from(THRESHOLDS)


def _any_value_round_trips(value: Any, threshold: int | None) -> None:
    graph = RolloutGraph(share_threshold=threshold)
    fields = _fields_for(value)
    graph.add_turn(TurnNode(node_id="a", **copy.deepcopy(fields)))
    graph.add_turn(TurnNode(node_id="b", **copy.deepcopy(fields)))
    _check_turn(graph, "a", fields)
    _check_turn(graph, "b", fields)


@given(value=json_like, threshold=thresholds)
def test_any_json_like_value_round_trips(value, threshold):
    _any_value_round_trips(value, threshold)


@pytest.mark.slow
@FUZZ
@given(value=json_like, threshold=thresholds)
def test_any_json_like_value_round_trips_fuzz(value, threshold):
    _any_value_round_trips(value, threshold)


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Turns that re-send earlier messages (and echo responses), with arbitrary content."""
    n_turns = draw(st.integers(min_value=1, max_value=5))
    system = draw(
        st.lists(
            st.fixed_dictionaries({"role": st.just("system"), "content": small_json}), max_size=2
        )
    )
    history: list[Any] = []
    turns = []
    for _ in range(n_turns):
        history.extend(draw(st.lists(messages, min_size=0, max_size=3)))
        sys_now = draw(st.sampled_from([system, system[:1], []]))
        request = sys_now + history
        if draw(st.booleans()):
            request = tuple(request)
        response = draw(st.one_of(messages, st.none()))
        turns.append(
            {
                "request_messages": copy.deepcopy(request),
                "response_message": copy.deepcopy(response),
                "request_tools": draw(st.one_of(st.none(), st.lists(small_json, max_size=2))),
                "sampling_params": draw(st.one_of(st.none(), small_json)),
            }
        )
        if response is not None and draw(st.integers(0, 3)):
            history.append(copy.deepcopy(response))
    return turns


def _conversation_round_trips(turns: list[dict[str, Any]]) -> None:
    documents = set()
    for threshold in (8, 1024, None):
        graph = RolloutGraph(share_threshold=threshold)
        ids = add_all(graph, copy.deepcopy(turns))
        for node_id, fields in zip(ids, turns, strict=True):
            got = materialized(graph, node_id)
            for name, want in fields.items():
                assert_same(got[name], want)
        documents.add(repr([(graph.parent(n), json.dumps(materialized(graph, n))) for n in ids]))
    assert len(documents) == 1


@given(turns=conversations())
def test_conversations_round_trip_equal_across_thresholds(turns):
    _conversation_round_trips(turns)


@pytest.mark.slow
@FUZZ
@given(turns=conversations())
def test_conversations_round_trip_equal_across_thresholds_fuzz(turns):
    _conversation_round_trips(turns)


def test_round_trip_of_fresh_json_bodies():
    """The common case: bodies decoded by json.loads, re-sent turn after turn."""
    graph = RolloutGraph()
    turns = chat_turns(6, pad=3000)
    ids = add_all(graph, [fresh(t) for t in turns])
    for node_id, fields in zip(ids, turns, strict=True):
        got = materialized(graph, node_id)
        for name, want in fields.items():
            assert same(got[name], want), name
            assert json.dumps(got[name]) == json.dumps(want)

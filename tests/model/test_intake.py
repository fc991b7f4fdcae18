"""Intake: validation with exact error paths, and rejected turns leaving the graph untouched."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from support import add_all, chat_turns, fresh, image_url, materialized, same, token_turns

from rollout_store import (
    MAX_DEPTH,
    DuplicateNodeError,
    InvalidValueError,
    RolloutGraph,
    TurnNode,
    export_session,
)


def _nest(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def _cyclic_list() -> list[Any]:
    a: list[Any] = [1]
    a.append(a)
    return a


def _cyclic_dict() -> dict[str, Any]:
    d: dict[str, Any] = {"a": 1}
    d["self"] = d
    return d


# ---------------------------------------------------------------- error paths


def _conversation(bad: Any) -> list[Any]:
    """Four messages; message 3 holds `bad` at content[1].image_url."""
    return [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": bad}],
        },
    ]


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [
        ({1, 2}, "set"),
        (b"\x89PNG", "bytes"),
        (bytearray(b"x"), "bytearray"),
        (frozenset(), "frozenset"),
        (object(), "object"),
        (1 + 2j, "complex"),
    ],
)
def test_bad_value_in_messages_names_exact_path(bad, fragment):
    graph = RolloutGraph()
    with pytest.raises(InvalidValueError) as info:
        graph.add_turn(TurnNode(request_messages=_conversation(bad)))
    assert info.value.path == "request_messages[3].content[1].image_url"
    assert fragment in str(info.value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("field", "value", "path"),
    [
        ("response_message", {"role": "assistant", "tool_calls": [{"args": {1}}]}, None),
        ("request_tools", [{"type": "function"}, {"function": {"parameters": b"x"}}], None),
        ("sampling_params", {"temperature": 0.5, "stop": ["a", {None}]}, None),
        ("sampled_logprobs", [-0.5, object()], "sampled_logprobs[1]"),
    ],
)
def test_bad_value_in_other_fields_names_path(field, value, path):
    expected = {
        "response_message": "response_message.tool_calls[0].args",
        "request_tools": "request_tools[1].function.parameters",
        "sampling_params": "sampling_params.stop[1]",
    }.get(field, path)
    graph = RolloutGraph()
    with pytest.raises(InvalidValueError) as info:
        graph.add_turn(TurnNode(**{field: value}))
    assert info.value.path == expected


def test_non_identifier_keys_are_quoted_in_path():
    graph = RolloutGraph()
    with pytest.raises(InvalidValueError) as info:
        graph.add_turn(TurnNode(sampling_params={"extra-body": {3: {"x y": [0, {1}]}}}))
    assert info.value.path == "sampling_params['extra-body'][3]['x y'][1]"


@pytest.mark.parametrize("make", [_cyclic_list, _cyclic_dict], ids=["list", "dict"])
@pytest.mark.parametrize("field", ["request_messages", "response_message", "request_tools"])
def test_reference_cycle_is_reported_as_cycle(make, field):
    graph = RolloutGraph()
    value = [{"role": "user", "content": make()}] if field == "request_messages" else make()
    with pytest.raises(InvalidValueError) as info:
        graph.add_turn(TurnNode(**{field: value}))
    assert "cycle" in str(info.value)
    assert info.value.path.startswith(field)
    assert len(info.value.path) < len(field) + 60  # names where the cycle closes, not 500 hops


def test_nesting_beyond_max_depth_is_rejected():
    graph = RolloutGraph()
    with pytest.raises(InvalidValueError) as info:
        graph.add_turn(TurnNode(response_message=_nest(MAX_DEPTH + 1)))
    assert "deeper" in str(info.value)
    assert "cycle" not in str(info.value)
    assert info.value.path.startswith("response_message[0]")
    ok = graph.add_turn(TurnNode(response_message=_nest(MAX_DEPTH)))
    assert graph.response_message(ok.node_id) == _nest(MAX_DEPTH)


@pytest.mark.parametrize("key", [(1, 2), frozenset({1}), b"k"])
def test_non_json_dict_key_is_rejected(key):
    graph = RolloutGraph()
    message = {"role": "user", "content": "x", "metadata": {"ok": 1, key: 2}}
    with pytest.raises(InvalidValueError) as info:
        graph.add_turn(TurnNode(request_messages=[message]))
    assert info.value.path.startswith("request_messages[0].metadata")
    assert type(key).__name__ in str(info.value)


@pytest.mark.parametrize(
    ("field", "value", "path"),
    [
        ("prompt_ids", [1, 2, True, 4], "prompt_ids[2]"),
        ("prompt_ids", [False], "prompt_ids[0]"),
        ("prompt_ids", [1, 2.0], "prompt_ids[1]"),
        ("prompt_ids", [1, "2"], "prompt_ids[1]"),
        ("prompt_ids", [1, None], "prompt_ids[1]"),
        ("sampled_ids", [5, 6, 7.0], "sampled_ids[2]"),
        ("sampled_ids", [5, True], "sampled_ids[1]"),
        ("prompt_ids", "123", "prompt_ids"),
        ("prompt_ids", {1: 2}, "prompt_ids"),
        ("sampled_ids", 7, "sampled_ids"),
    ],
)
def test_bad_token_ids(field, value, path):
    fields = {"prompt_ids": [1, 2, 3], "sampled_ids": [4], field: value}
    graph = RolloutGraph()
    with pytest.raises(InvalidValueError) as info:
        graph.add_turn(TurnNode(**fields))
    assert info.value.path == path


@pytest.mark.parametrize("node_id", [1, b"id", ("a",), 1.5])
def test_node_id_must_be_str(node_id):
    graph = RolloutGraph()
    with pytest.raises(InvalidValueError) as info:
        graph.add_turn(TurnNode(node_id=node_id))
    assert info.value.path == "node_id"


@pytest.mark.parametrize(
    ("field", "value"),
    [("model", 3), ("finish_reason", ["stop"]), ("harness_session_id", 1.0), ("n_tools", "2")],
)
def test_scalar_fields_are_type_checked(field, value):
    graph = RolloutGraph()
    with pytest.raises(InvalidValueError) as info:
        graph.add_turn(TurnNode(**{field: value}))
    assert info.value.path == field


def test_duplicate_node_id():
    graph = RolloutGraph()
    graph.add_turn(TurnNode(node_id="a", response_message={"content": "first"}))
    with pytest.raises(DuplicateNodeError):
        graph.add_turn(TurnNode(node_id="a", response_message={"content": "second"}))
    assert graph.node_ids() == ["a"]
    assert graph.response_message("a") == {"content": "first"}


def test_unknown_parent_id():
    graph = RolloutGraph()
    graph.add_turn(TurnNode(node_id="a"))
    with pytest.raises(InvalidValueError) as info:
        graph.add_turn(TurnNode(node_id="b", parent_id="nope"))
    assert info.value.path == "parent_id"
    assert graph.node_ids() == ["a"]


def test_add_turn_rejects_non_turnnode():
    graph = RolloutGraph()
    with pytest.raises(TypeError):
        graph.add_turn({"node_id": "a"})  # type: ignore[arg-type]
    assert len(graph) == 0


@pytest.mark.parametrize("role", [["system"], {"name": "system"}])
def test_unhashable_role_is_valid_json(role):
    """A message whose role is a list or dict is odd but valid JSON: record it exactly."""
    graph = RolloutGraph()
    messages = [{"role": role, "content": "x"}, {"role": "user", "content": "y"}]
    node = graph.add_turn(TurnNode(request_messages=copy.deepcopy(messages)))
    assert same(graph.request_messages(node.node_id), messages)


# ---------------------------------------------------------------- add_turn result


def test_add_turn_sets_index_and_parent_and_returns_a_view():
    graph = RolloutGraph()
    first = TurnNode(
        request_messages=[{"role": "user", "content": "q"}], request_tools=[{}, {}], n_tools=None
    )
    out = graph.add_turn(first)
    assert out is not first and isinstance(out, TurnNode)
    assert first.node_id is None  # a fresh id goes to the stored turn, not to the caller's node
    assert (first.index, first.parent_id) == (0, None)
    assert isinstance(out.node_id, str) and out.index == 0 and out.parent_id is None
    assert out.n_tools == 2  # n_tools=None counts the tools
    second = graph.add_turn(TurnNode(parent_id=out.node_id))
    assert second.index == 1 and second.parent_id == out.node_id
    assert second.node_id != out.node_id
    assert graph.node_ids() == [out.node_id, second.node_id]
    assert out.node_id in graph and "missing" not in graph
    assert list(graph) == graph.node_ids()


def test_caller_mutation_after_add_does_not_reach_the_graph():
    graph = RolloutGraph()
    fields = {
        "request_messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
        "response_message": {"role": "assistant", "content": "b", "extra": {"k": [1]}},
        "request_tools": [{"name": "f", "parameters": {"type": "object"}}],
        "sampling_params": {"temperature": 0.7, "stop": ["x"]},
        "prompt_ids": [1, 2, 3],
        "sampled_ids": [4, 5],
        "sampled_logprobs": [-0.5, -1.5],
    }
    snapshot = copy.deepcopy(fields)
    node = graph.add_turn(TurnNode(node_id="a", **fields))
    fields["request_messages"][0]["content"][0]["text"] = "changed"
    fields["request_messages"].append({"role": "user"})
    fields["response_message"]["extra"]["k"].append(2)
    fields["request_tools"][0]["parameters"]["type"] = "array"
    fields["sampling_params"]["stop"].clear()
    fields["prompt_ids"][0] = 99
    fields["sampled_ids"].append(6)
    fields["sampled_logprobs"][0] = 0.0
    got = materialized(graph, node.node_id)
    for name, value in snapshot.items():
        assert same(got[name], value), name


# ---------------------------------------------------------------- atomicity


def _base_graph() -> tuple[RolloutGraph, list[dict[str, Any]], list[dict[str, Any]]]:
    """A graph holding 3 chat turns (one image each) and 3 token turns, plus their follow-ups."""
    graph = RolloutGraph()
    images = [image_url(100 + k, size=4096) for k in range(4)]
    chat = chat_turns(4, tag="chat", images=images)
    tokens = token_turns(4, n_new=70)
    add_all(graph, chat[:3], prefix="c")
    add_all(graph, tokens[:3], prefix="k")
    return graph, chat, tokens


def _state(graph: RolloutGraph) -> dict[str, Any]:
    return {
        "nodes": graph.node_ids(),
        "roots": graph.root_ids(),
        "leaves": graph.leaf_ids(),
        "paths": graph.path_id_lists(),
        "blobs": len(graph.blobs),
        "blob_stats": graph.blobs.stats(),
        "turns": [materialized(graph, n) for n in graph.node_ids()],
        "export": json.dumps(export_session(graph, include_messages=True, include_discarded=True)),
        "structure": {
            k: v
            for k, v in graph.stats().items()
            if k not in ("messages_received", "tokens_received")
        },
    }


NEW_LONG = "N" * 5000  # a long string the graph has not seen, placed before the bad value


def _bad_turns() -> dict[str, Callable[[list[Any], list[Any]], TurnNode]]:
    def bad_message(chat, tokens):
        msgs = fresh(chat[3]["request_messages"])
        msgs.insert(2, {"role": "user", "content": NEW_LONG})
        msgs[-1]["content"][1]["image_url"] = {"url": b"raw"}
        return TurnNode(node_id="bad", request_messages=msgs)

    def bad_system(chat, tokens):
        msgs = fresh(chat[3]["request_messages"])
        msgs[0]["content"] = NEW_LONG
        msgs.insert(1, {"role": "system", "content": {1}})
        return TurnNode(node_id="bad", request_messages=msgs)

    def bad_response(chat, tokens):
        return TurnNode(
            node_id="bad",
            request_messages=fresh(chat[3]["request_messages"]) + [{"content": NEW_LONG}],
            response_message={"role": "assistant", "content": [NEW_LONG + "x", {2}]},
        )

    def bad_tools(chat, tokens):
        return TurnNode(
            node_id="bad",
            request_messages=fresh(chat[3]["request_messages"]),
            request_tools=[{"description": NEW_LONG}, {"parameters": object()}],
        )

    def bad_sampling(chat, tokens):
        return TurnNode(
            node_id="bad",
            **{**tokens[3], "sampling_params": {"logit_bias": NEW_LONG, "stop": {"x"}}},
        )

    def bad_logprobs(chat, tokens):
        return TurnNode(
            node_id="bad",
            **{
                **tokens[3],
                "request_messages": [{"role": "user", "content": NEW_LONG}],
                "sampled_logprobs": [-0.1, {"x"}, -0.3],
            },
        )

    def bad_prompt_ids(chat, tokens):
        ids = list(tokens[3]["prompt_ids"])
        ids[-1] = True
        return TurnNode(
            node_id="bad",
            prompt_ids=ids,
            request_messages=[{"role": "user", "content": NEW_LONG}],
        )

    def bad_sampled_ids(chat, tokens):
        return TurnNode(
            node_id="bad",
            **{**tokens[3], "sampled_ids": [1, 2.5]},
            response_message={"content": NEW_LONG},
        )

    def cycle(chat, tokens):
        msgs = fresh(chat[3]["request_messages"])
        msgs[-1]["content"].append({"text": NEW_LONG})
        msgs[-1]["content"].append(_cyclic_list())
        return TurnNode(node_id="bad", request_messages=msgs)

    def too_deep(chat, tokens):
        msgs = fresh(chat[3]["request_messages"])
        msgs.append({"role": "user", "content": NEW_LONG, "deep": _nest(MAX_DEPTH + 5)})
        return TurnNode(node_id="bad", request_messages=msgs)

    def tuple_key(chat, tokens):
        return TurnNode(
            node_id="bad",
            response_message={"content": NEW_LONG, "meta": {(1,): 2}},
        )

    def duplicate(chat, tokens):
        return TurnNode(node_id="c1", request_messages=[{"role": "user", "content": NEW_LONG}])

    def unknown_parent(chat, tokens):
        return TurnNode(
            node_id="bad",
            parent_id="nope",
            request_messages=[{"role": "user", "content": NEW_LONG}],
        )

    def int_node_id(chat, tokens):
        return TurnNode(node_id=7, request_messages=[{"role": "user", "content": NEW_LONG}])

    return {
        f.__name__: f
        for f in (
            bad_message,
            bad_system,
            bad_response,
            bad_tools,
            bad_sampling,
            bad_logprobs,
            bad_prompt_ids,
            bad_sampled_ids,
            cycle,
            too_deep,
            tuple_key,
            duplicate,
            unknown_parent,
            int_node_id,
        )
    }


BAD_TURNS = _bad_turns()


@pytest.mark.parametrize("case", sorted(BAD_TURNS))
def test_rejected_turn_leaves_graph_unchanged(case):
    graph, chat, tokens = _base_graph()
    before = _state(graph)
    with pytest.raises((InvalidValueError, DuplicateNodeError)):
        graph.add_turn(BAD_TURNS[case](chat, tokens))
    assert _state(graph) == before
    assert "bad" not in graph
    # later good turns still link to the right parents and share the old blobs
    chat_next = graph.add_turn(TurnNode(node_id="c3", **chat[3]))
    tok_next = graph.add_turn(TurnNode(node_id="k3", **tokens[3]))
    assert chat_next.parent_id == "c2" and graph.link_kind("c3") == "messages"
    assert tok_next.parent_id == "k2" and graph.link_kind("k3") == "tokens"
    assert graph.stats()["blobs"] == 4
    for node_id, fields in (("c3", chat[3]), ("k3", tokens[3])):
        got = materialized(graph, node_id)
        for name, value in fields.items():
            assert same(got[name], value), name


@pytest.mark.parametrize("case", sorted(BAD_TURNS))
def test_rejected_turn_leaves_stats_unchanged(case):
    """stats() as a whole, counters of received messages and tokens included."""
    graph, chat, tokens = _base_graph()
    before = graph.stats()
    with pytest.raises((InvalidValueError, DuplicateNodeError)):
        graph.add_turn(BAD_TURNS[case](chat, tokens))
    assert graph.stats() == before


def test_rejected_turn_does_not_change_later_generated_ids():
    """A graph that saw a rejected turn equals one that never saw it, generated ids too."""
    clean, dirty = RolloutGraph(), RolloutGraph()
    turns = chat_turns(3)
    for k, fields in enumerate(turns):
        if k == 1:
            with pytest.raises(InvalidValueError):
                dirty.add_turn(TurnNode(request_messages=[{"role": "user", "content": {1}}]))
        clean.add_turn(TurnNode(**fresh(fields)))
        dirty.add_turn(TurnNode(**fresh(fields)))
    assert dirty.node_ids() == clean.node_ids()
    assert json.dumps(export_session(dirty, include_messages=True)) == json.dumps(
        export_session(clean, include_messages=True)
    )


# ---------------------------------------------------------------- forged packings


def _forgeries() -> dict[str, tuple[Any, Any]]:
    """A real value and a caller's msgpack.ExtType object that packs like its stored form."""
    ext = msgpack.ExtType
    lone = json.loads('"\\ud800"')
    return {
        "tuple": ((1, 2), [ext(1, b""), 1, 2]),
        "big int": (2**70, ext(2, str(2**70).encode())),
        "surrogate": (lone, ext(3, lone.encode("utf-8", "surrogatepass"))),
        "blob": ("L" * 2000, ext(4, (0).to_bytes(4, "big"))),
        "echo": ("x", ext(5, b"")),
        "big int key": ({2**70: 1}, {ext(2, str(2**70).encode()): 1}),
    }


@pytest.mark.parametrize("kind", sorted(_forgeries()))
@pytest.mark.parametrize(
    "where", ["history", "system", "tools", "sampling", "response echo", "response"]
)
def test_forged_extension_objects_are_rejected(kind, where):
    """msgpack.ExtType is no JSON value, even when it imitates what the graph stores."""
    real, forged = _forgeries()[kind]
    graph = RolloutGraph()
    good = {"role": "user", "content": real}
    fake = {"role": "user", "content": forged}
    reply = {"role": "assistant", "content": "r"}
    if where == "history":
        first = TurnNode(node_id="a", request_messages=[good], response_message=reply)
        second = TurnNode(node_id="b", request_messages=[fake, reply, {"role": "user"}])
    elif where == "system":
        first = TurnNode(node_id="a", request_messages=[{**good, "role": "system"}])
        second = TurnNode(node_id="b", request_messages=[{**fake, "role": "system"}])
    elif where == "tools":
        first = TurnNode(node_id="a", request_tools=[good])
        second = TurnNode(node_id="b", request_tools=[fake])
    elif where == "sampling":
        first = TurnNode(node_id="a", sampling_params=good)
        second = TurnNode(node_id="b", sampling_params=fake)
    elif where == "response echo":
        first = TurnNode(node_id="a", request_messages=[{"role": "user"}], response_message=good)
        second = TurnNode(node_id="b", request_messages=[{"role": "user"}, fake, {"role": "user"}])
    else:
        first = TurnNode(node_id="a", response_message=good)
        second = TurnNode(node_id="b", response_message=fake)
    graph.add_turn(first)
    before = graph.stats()
    with pytest.raises(InvalidValueError):
        graph.add_turn(second)
    assert graph.node_ids() == ["a"]
    assert graph.stats() == before


def test_review_findings_on_bad_scalars_and_buffers():
    """n_tools beyond 64 bits, a strided memoryview, a forged ExtType: clear errors, no change."""
    graph = RolloutGraph()
    graph.add_turn(TurnNode(node_id="ok", request_messages=[{"role": "user", "content": "hi"}]))
    before = graph.stats()
    with pytest.raises(InvalidValueError, match="n_tools"):
        graph.add_turn(TurnNode(n_tools=2**70))
    with pytest.raises(InvalidValueError, match=r"request_tools\[0\]"):
        graph.add_turn(TurnNode(request_tools=[memoryview(b"abcdef")[::2]]))
    with pytest.raises(
        InvalidValueError, match=r"ExtType cannot be represented in JSON - at request_tools\[0\]"
    ):
        graph.add_turn(TurnNode(request_tools=[msgpack.ExtType(2, b"12")]))
    assert graph.stats() == before and graph.node_ids() == ["ok"]


def test_forged_ext_cannot_imitate_a_long_string_with_a_lone_surrogate():
    text = "\ud800 lone surrogate"
    fake = msgpack.ExtType(3, text.encode("utf-8", "surrogatepass"))
    graph = RolloutGraph(share_threshold=4)
    graph.add_turn(
        TurnNode(
            request_messages=[
                {"role": "system", "content": text},
                {"role": "user", "content": text},
            ],
            response_message={"role": "assistant", "content": text},
            request_tools=[text],
            sampling_params={"stop": text},
        )
    )
    forged = [
        TurnNode(request_tools=[fake]),
        TurnNode(sampling_params={"stop": fake}),
        TurnNode(request_messages=[{"role": "system", "content": fake}]),
        TurnNode(request_messages=[{"role": "user", "content": fake}]),
        TurnNode(
            request_messages=[
                {"role": "user", "content": text},
                {"role": "assistant", "content": fake},
            ]
        ),
    ]
    for node in forged:
        with pytest.raises(InvalidValueError, match="ExtType"):
            graph.add_turn(node)
    assert len(graph) == 1

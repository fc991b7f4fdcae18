"""Values given as subclasses of dict whose own `items()` disagree with what the dict holds:
the graph keeps what `json.dumps` writes of them (an empty one is `{}`, whatever its
`items()` says; a non-empty one is what its `items()` yields), and refuses, naming where,
what `json.dumps` refuses (members that are not 2-tuples), changing nothing. Token fields
given as list or tuple subclasses, and request messages and tool lists too, are read by
iterating them, as `json.dumps` reads them (a list subclass's `RawJSON` items decoded)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from rollout_store import (
    InvalidValueError,
    MemoryStore,
    RawJSON,
    RolloutGraph,
    TurnNode,
    write_session_json,
)
from rollout_store.model.raw import resolve_raw


class _Claims(dict[str, Any]):
    """A dict whose items() yields members it does not hold."""

    def items(self) -> Any:
        return iter([("claimed", 1), ("long", "c" * 2000)])


class _BadPairs(dict[str, Any]):
    def __init__(self, pairs: list[Any]) -> None:
        super().__init__(held=0)
        self.pairs = pairs

    def items(self) -> Any:
        return iter(self.pairs)


def _fields(value: Any) -> dict[str, Any]:
    return {
        "request_messages": [{"role": "user", "content": [value, {"k": value}]}],
        "request_tools": [value],
        "sampling_params": {"p": value},
        "response_message": {"role": "assistant", "content": value},
    }


def _views(graph: RolloutGraph, node_id: str) -> dict[str, Any]:
    node = graph.get(node_id)
    return {
        "request_messages": graph.request_messages(node_id),
        "request_tools": node.request_tools,
        "sampling_params": node.sampling_params,
        "response_message": graph.response_message(node_id),
    }


@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("value", [_Claims(), _Claims(held=1)], ids=["empty", "holding"])
def test_a_dict_subclass_is_kept_as_json_dumps_writes_it(
    value: Any, store: bool, tmp_path: Path
) -> None:
    objects = MemoryStore() if store else None
    graph = RolloutGraph(store=objects)
    given = _fields(value)
    node_id = graph.add_turn(TurnNode(**given)).node_id
    want = {name: json.dumps(field) for name, field in given.items()}
    assert {k: json.dumps(v) for k, v in _views(graph, node_id).items()} == want
    graph.save(tmp_path / "g.rls", blobs="store" if store else "inline")
    loaded = RolloutGraph.load(tmp_path / "g.rls", store=objects)
    assert {k: json.dumps(v) for k, v in _views(loaded, node_id).items()} == want


@pytest.mark.parametrize(
    "pairs", [[("a", 1, 2)], [["a", 1]], [("a", 1), "ab"]], ids=["triple", "list", "str"]
)
@pytest.mark.parametrize("field", ["request_messages", "response_message", "sampling_params"])
def test_a_dict_subclass_yielding_other_than_pairs_is_refused_where_it_is(
    pairs: list[Any], field: str
) -> None:
    bad = _BadPairs(pairs)
    with pytest.raises(ValueError, match="items must return 2-tuples"):
        json.dumps(bad)
    graph = RolloutGraph()
    first = [{"role": "user", "content": "x" * 2000}]
    graph.add_turn(TurnNode(request_messages=first, response_message={"content": "a"}))
    before = io.StringIO()
    write_session_json(graph, before, include_messages=True)
    stats = graph.stats()
    fields: dict[str, Any] = {
        "request_messages": [*first, {"content": "a"}, {"role": "user", "content": "y" * 3000}]
    }
    where = "request_messages[2].extra" if field == "request_messages" else f"{field}.extra"
    if field == "request_messages":
        fields["request_messages"][2] = {"role": "user", "content": "y" * 3000, "extra": bad}
    else:
        fields[field] = {"c": "z" * 3000, "extra": bad}
    with pytest.raises(InvalidValueError, match="items must return 2-tuples") as error:
        graph.add_turn(TurnNode(**fields))
    assert error.value.path == where
    after = io.StringIO()
    write_session_json(graph, after, include_messages=True)
    assert after.getvalue() == before.getvalue()
    assert graph.stats() == stats


class _Ids(list[Any]):
    """A list whose iteration yields other items than it holds (json.dumps iterates it)."""

    def __init__(self, held: list[Any], shown: list[Any]) -> None:
        super().__init__(held)
        self.shown = shown

    def __iter__(self) -> Any:
        return iter(self.shown)


class _IdsTuple(tuple[Any, ...]):
    def __iter__(self) -> Any:
        return iter([x + 1 for x in tuple.__iter__(self)])


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt_ids": _Ids([1, 2], [7, 8, 9])},
        {"prompt_ids": [5], "sampled_ids": _Ids([1], [6, 7])},
        {"prompt_ids": [5], "sampled_ids": [6], "sampled_logprobs": _Ids([0.5], [-0.25])},
        {"prompt_ids": [5], "sampled_ids": [6], "sampled_logprobs": _Ids([0.5], [-1, None])},
        {"prompt_ids": _IdsTuple((1, 2)), "sampled_ids": _IdsTuple((2**40,))},
    ],
    ids=["prompt", "sampled", "logprobs", "logprobs-json", "tuples"],
)
def test_token_fields_given_as_subclasses_are_kept_as_json_dumps_writes_them(
    fields: dict[str, Any], tmp_path: Path
) -> None:
    graph = RolloutGraph()
    node = TurnNode(request_messages=[{"role": "user", "content": "x"}], **fields)
    node_id = graph.add_turn(node).node_id
    graph.save(tmp_path / "g.rls")
    for held in (graph, RolloutGraph.load(tmp_path / "g.rls")):
        got = held.get(node_id)
        for name, value in fields.items():
            assert json.dumps(list(getattr(got, name))) == json.dumps(value), name


class _Messages(list[Any]):
    """Messages whose iteration yields other messages than the list holds."""

    def __iter__(self) -> Any:
        return iter(
            [{"role": "system", "content": "shown"}, {"role": "user", "content": "s" * 2000}]
        )


class _MessagesTuple(tuple[Any, ...]):
    def __iter__(self) -> Any:
        return iter([{"role": "user", "content": "shown"}])


class _Plain(list[Any]):
    """A list subclass with nothing overridden."""


_HELD = [{"role": "system", "content": "held"}, {"role": "user", "content": "held"}]


@pytest.mark.parametrize(
    "messages",
    [_Messages(_HELD), _MessagesTuple(_HELD), _Plain([RawJSON(b'{"role": "user", "content": 1}')])],
    ids=["list", "tuple", "raw-items"],
)
def test_request_messages_given_as_a_subclass_are_kept_as_json_dumps_writes_them(
    messages: Any, tmp_path: Path
) -> None:
    want = json.dumps(resolve_raw(list(messages), "request_messages"))
    graph = RolloutGraph()
    node_id = graph.add_turn(
        TurnNode(request_messages=messages, response_message={"content": "a"})
    ).node_id
    graph.save(tmp_path / "g.rls")
    for held in (graph, RolloutGraph.load(tmp_path / "g.rls")):
        assert json.dumps(held.request_messages(node_id)) == want
    # the next turn re-sends it as plain JSON and links to it
    again = json.loads(want) + [{"content": "a"}, {"role": "user", "content": "next"}]
    child = graph.add_turn(TurnNode(request_messages=again)).node_id
    assert graph.parent(child) == node_id
    assert json.dumps(graph.request_messages(child)) == json.dumps(again)


@pytest.mark.parametrize(
    "tools",
    [_Messages([1, 2, 3]), _MessagesTuple((1, 2)), _Plain([RawJSON(b'{"name": "f"}'), {"n": 2}])],
    ids=["list", "tuple", "raw-items"],
)
def test_request_tools_given_as_a_subclass_are_kept_and_counted_as_json_dumps_writes_them(
    tools: Any,
) -> None:
    want = resolve_raw(list(tools), "request_tools")
    graph = RolloutGraph()
    node = TurnNode(request_messages=[{"role": "user", "content": "x"}], request_tools=tools)
    node_id = graph.add_turn(node).node_id
    assert json.dumps(graph.request_tools(node_id)) == json.dumps(want)
    assert graph.get(node_id).n_tools == len(want)

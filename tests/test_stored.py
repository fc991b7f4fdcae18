"""The compact stored turn: default ids kept as no string, a single child held bare, shared
values interned per graph, token fields only where there are tokens; all behave as before."""

from __future__ import annotations

import pytest
from support import chat_turns, token_turns

from rollout_store import DuplicateNodeError, RolloutGraph, TurnNode, UnknownNodeError


def _turns(graph: RolloutGraph) -> list:
    return graph._turns  # the stored turns, to check how they are kept


def test_default_ids_are_derived_and_found() -> None:
    graph = RolloutGraph()
    for fields in chat_turns(3):
        graph.add_turn(TurnNode(**fields))
    assert graph.node_ids() == ["turn-0", "turn-1", "turn-2"]
    assert [t.ident for t in _turns(graph)] == [None, None, None]
    assert graph.get("turn-2").parent_id == "turn-1"
    assert "turn-1" in graph and "turn-3" not in graph
    # only the canonical spelling of a default id names the turn
    for other in ("turn-01", "turn-+1", "turn- 1", "turn-\u0661", "turn-1.0", "Turn-1", 1):
        assert other not in graph
        with pytest.raises(UnknownNodeError):
            graph.get(other)  # type: ignore[arg-type]


def test_chosen_ids_that_look_like_default_ones_stay_apart() -> None:
    graph = RolloutGraph()
    turns = chat_turns(4)
    graph.add_turn(TurnNode(node_id="turn-1", **turns[0]))  # index 1's default id
    graph.add_turn(TurnNode(**turns[1]))  # index 1: its default id is taken
    with pytest.raises(DuplicateNodeError):  # the id index 1 got instead
        graph.add_turn(TurnNode(node_id="turn-2", **turns[2]))
    graph.add_turn(TurnNode(node_id="turn-3", **turns[2]))  # index 2
    graph.add_turn(TurnNode(node_id="turn-3x", **turns[3]))
    ids = graph.node_ids()
    assert ids == ["turn-1", "turn-2", "turn-3", "turn-3x"]
    assert [graph.get(n).index for n in ids] == [0, 1, 2, 3]
    assert [graph.parent(n) for n in ids] == [None, *ids[:-1]]
    assert [t.ident for t in _turns(graph)] == ["turn-1", "turn-2", "turn-3", "turn-3x"]
    assert graph.add_turn(TurnNode(**turns[0])).node_id == "turn-4"  # its default again
    assert _turns(graph)[4].ident is None
    for taken in ids:
        with pytest.raises(DuplicateNodeError):
            graph.add_turn(TurnNode(node_id=taken, **turns[0]))
    assert len(graph) == 5


def test_default_id_of_an_existing_turn_is_a_duplicate() -> None:
    graph = RolloutGraph()
    turns = chat_turns(2)
    graph.add_turn(TurnNode(**turns[0]))
    with pytest.raises(DuplicateNodeError):
        graph.add_turn(TurnNode(node_id="turn-0", **turns[1]))
    assert graph.node_ids() == ["turn-0"]
    node = graph.add_turn(TurnNode(parent_id="turn-0", **turns[1]))
    assert node.parent_id == "turn-0" and graph.link_kind(node.node_id) == "explicit"


def test_ids_survive_a_file(tmp_path) -> None:
    graph = RolloutGraph()
    turns = chat_turns(4)
    graph.add_turn(TurnNode(node_id="turn-1", **turns[0]))
    for fields in turns[1:]:
        graph.add_turn(TurnNode(**fields))
    path = tmp_path / "g.rollout"
    graph.save(path)
    back = RolloutGraph.load(path)
    assert back.node_ids() == graph.node_ids()
    assert [back.parent(n) for n in back.node_ids()] == [graph.parent(n) for n in graph.node_ids()]
    assert [t.ident for t in _turns(back)] == [t.ident for t in _turns(graph)]


def test_children_one_bare_several_as_a_tuple() -> None:
    graph = RolloutGraph()
    turns = chat_turns(2)
    root = graph.add_turn(TurnNode(**turns[0]))
    first = graph.add_turn(TurnNode(**turns[1]))
    stored = _turns(graph)
    assert stored[0].kids is stored[1] and stored[0].children == (stored[1],)
    assert stored[1].kids is None and stored[1].children is None
    second = graph.add_turn(TurnNode(**turns[1]))  # a retry: a sibling
    assert stored[0].children == (stored[1], stored[2])
    assert graph.child_ids(root.node_id) == [first.node_id, second.node_id]
    assert graph.forks() == [(root.node_id, [first.node_id, second.node_id])]


def test_shared_values_are_one_tuple_and_tokens_only_where_given() -> None:
    graph = RolloutGraph()
    tools = [{"type": "function", "function": {"name": "f"}}]
    for fields in chat_turns(3):
        graph.add_turn(TurnNode(request_tools=tools, sampling_params={"t": 1}, **fields))
    stored = _turns(graph)
    assert stored[0].values is not None
    assert all(t.values is stored[0].values for t in stored)
    # sampled_ids=[] by default: every such turn shares one record of its empty tokens
    assert all(t.tokens is stored[0].tokens and t.prompt is None for t in stored)
    assert stored[0].tokens is not None and len(stored[0].sampled) == 0
    assert graph.get("turn-2").sampled_ids == [] and graph.get("turn-2").prompt_ids == []
    assert graph.get("turn-2").request_tools == tools
    assert graph.get("turn-2").sampling_params == {"t": 1}

    plain = RolloutGraph()
    bare = TurnNode(request_messages=[{"role": "user", "content": "hi"}], sampled_ids=None)
    bare.sampling_params = bare.requested_sampling_params = None
    plain.add_turn(bare)
    assert _turns(plain)[0].values is None  # no shared value at all: no tuple
    assert _turns(plain)[0].tokens is None  # no token field at all: no record
    assert plain.get("turn-0").sampled_ids is None

    tokens = RolloutGraph()
    for fields in token_turns(2):
        tokens.add_turn(TurnNode(**fields))
    assert all(t.tokens is not None for t in _turns(tokens))
    assert tokens.get("turn-1").sampled_logprobs == token_turns(2)[1]["sampled_logprobs"]

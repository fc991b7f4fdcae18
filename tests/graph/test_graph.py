"""The rollout graph: linking by tokens and messages, queries, retries and training sequences."""

from __future__ import annotations

import copy
import itertools
import json
import math
import tracemalloc
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import FUZZ, add_all, chat_turns, fresh, small_json, token_turns

from rollout_store import RolloutGraph, TurnNode

# ---------------------------------------------------------------- token linking


@pytest.mark.parametrize("n_new", [2, 70, 200])
def test_token_chain_links_each_turn_to_the_previous(n_new):
    graph = RolloutGraph()
    ids = add_all(graph, token_turns(6, n_new=n_new, n_sampled=5))
    assert [graph.parent(n) for n in ids] == [None, *ids[:-1]]
    assert [graph.link_kind(n) for n in ids] == ["none"] + ["tokens"] * 5
    assert graph.root_ids() == [ids[0]] and graph.leaf_ids() == [ids[-1]]
    assert graph.path_ids(ids[-1]) == ids
    assert graph.path_id_lists() == [ids]
    assert all(graph.root_of(n) == ids[0] for n in ids)


def test_token_parent_is_the_longest_exact_prefix():
    graph = RolloutGraph()
    turns = token_turns(3, n_new=30, n_sampled=40)
    ids = add_all(graph, turns)
    full1 = turns[1]["prompt_ids"] + turns[1]["sampled_ids"]
    # extends turn 1's prompt + sampled: the child of turn 1, not of turn 0
    deeper = graph.add_turn(TurnNode(node_id="x", prompt_ids=full1 + [7, 8]))
    assert deeper.parent_id == ids[1]
    # extends turn 0's prompt + sampled but diverges inside turn 1's sampled tokens
    full0 = turns[0]["prompt_ids"] + turns[0]["sampled_ids"]
    prompt = turns[1]["prompt_ids"] + [5]
    assert prompt[: len(full0)] == full0
    fork = graph.add_turn(TurnNode(node_id="y", prompt_ids=prompt, sampled_ids=[6]))
    assert fork.parent_id == ids[0]
    assert graph.fork_ids() == [ids[0], ids[1]]
    # repeats turn 1's prompt only (not its sampled tokens): a sibling of turn 1
    retry = graph.add_turn(TurnNode(node_id="z", prompt_ids=list(turns[1]["prompt_ids"])))
    assert retry.parent_id == ids[0]
    # exactly turn 2's prompt + sampled, nothing new: still its child
    full2 = turns[2]["prompt_ids"] + turns[2]["sampled_ids"]
    assert graph.add_turn(TurnNode(node_id="w", prompt_ids=full2)).parent_id == ids[2]


def test_diverging_prompt_is_a_new_root():
    graph = RolloutGraph()
    turns = token_turns(2, n_new=10)
    add_all(graph, turns)
    other = list(turns[1]["prompt_ids"])
    other[0] += 1  # differs in the very first token
    assert graph.add_turn(TurnNode(node_id="o", prompt_ids=other)).parent_id is None
    assert graph.link_kind("o") == "none"
    assert graph.root_ids() == ["t0", "o"]


def test_explicit_parent_wins_over_tokens_and_messages():
    graph = RolloutGraph()
    turns = token_turns(3)
    add_all(graph, turns[:2])
    node = graph.add_turn(TurnNode(node_id="e", parent_id="t0", **turns[2]))
    assert node.parent_id == "t0"
    assert graph.link_kind("e") == "explicit"
    assert graph.child_ids("t0") == ["t1", "e"]


def test_tokens_take_precedence_over_messages():
    graph = RolloutGraph()
    chat = chat_turns(2)
    tokens = token_turns(2)
    graph.add_turn(TurnNode(node_id="a", **chat[0], **tokens[0]))
    graph.add_turn(TurnNode(node_id="b", **chat[1], **tokens[1]))
    assert graph.parent("b") == "a" and graph.link_kind("b") == "tokens"


# ---------------------------------------------------------------- message linking


def test_message_chain_links_without_tokens():
    graph = RolloutGraph()
    ids = add_all(graph, chat_turns(5))
    assert [graph.parent(n) for n in ids] == [None, *ids[:-1]]
    assert [graph.link_kind(n) for n in ids] == ["none"] + ["messages"] * 4


def test_changing_system_prompt_still_links():
    graph = RolloutGraph()
    turns = chat_turns(4, system=None)
    systems = [
        [{"role": "system", "content": "v1"}],
        [{"role": "system", "content": "v2 longer"}, {"role": "developer", "content": "d"}],
        [],
        [{"role": "developer", "content": "v3"}],
    ]
    for k, fields in enumerate(turns):
        fields["request_messages"] = systems[k] + fields["request_messages"]
    ids = add_all(graph, turns)
    assert [graph.parent(n) for n in ids] == [None, *ids[:-1]]
    for node_id, fields in zip(ids, turns, strict=True):
        assert graph.request_messages(node_id) == fields["request_messages"]


def _tool_turns(echo: dict[str, Any]) -> tuple[TurnNode, TurnNode]:
    user = {"role": "user", "content": "call f"}
    response = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "f", "arguments": '{"a": 1}'},
            }
        ],
        "refusal": None,
    }
    first = TurnNode(node_id="a", request_messages=[user], response_message=response)
    tool_result = {"role": "tool", "tool_call_id": "call_1", "content": "ok"}
    second = TurnNode(node_id="b", request_messages=[user, echo, tool_result])
    return first, second


def _echo(arguments: str, content: Any = "") -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        ],
    }


@pytest.mark.parametrize(
    "echo",
    [
        _echo('{"a":1}'),
        _echo('{ "a" : 1 }', content=None),
        _echo('{"a": 1}', content=[]),
    ],
)
def test_loose_echo_of_response_links(echo):
    graph = RolloutGraph()
    first, second = _tool_turns(echo)
    graph.add_turn(first)
    assert graph.add_turn(second).parent_id == "a"
    assert graph.link_kind("b") == "messages"
    assert graph.request_messages("b")[1] == echo  # stored as sent, not as the response


@pytest.mark.parametrize(
    "echo",
    [
        _echo('{"a":2}'),
        _echo('{"a":1, "b": 0}'),
        _echo('{"a":1}', content="different text"),
        {**_echo('{"a":1}'), "role": "user"},
    ],
)
def test_different_echo_does_not_link(echo):
    graph = RolloutGraph()
    first, second = _tool_turns(echo)
    graph.add_turn(first)
    assert graph.add_turn(second).parent_id is None


def test_request_that_drops_history_does_not_link():
    graph = RolloutGraph()
    turns = chat_turns(3)
    add_all(graph, turns[:2])
    compacted = fresh(turns[2])
    del compacted["request_messages"][1:3]  # context compaction dropped turn 0's exchange
    assert graph.add_turn(TurnNode(node_id="c", **compacted)).parent_id is None


def test_response_with_nan_links_to_its_exact_echo():
    """A tool_use input holding NaN (json.loads accepts it), re-sent verbatim, still links."""
    graph = RolloutGraph()
    turns = chat_turns(3)
    for k in (0, 1):
        response = {
            "role": "assistant",
            "content": [
                {"type": "text", "text": f"calling {k}"},
                {"type": "tool_use", "id": f"tu{k}", "name": "f", "input": {"x": math.nan}},
            ],
        }
        turns[k]["response_message"] = response
        for later in turns[k + 1 :]:
            later["request_messages"][2 + 2 * k] = copy.deepcopy(response)
    ids = add_all(graph, fresh(turns))
    assert [graph.parent(n) for n in ids] == [None, ids[0], ids[1]]


def test_late_parent_whose_response_holds_nan_adopts_its_child():
    """Out of order: the continuation arrives first, then the turn whose response it echoes."""
    graph = RolloutGraph()
    turns = chat_turns(2)
    response = {
        "role": "assistant",
        "content": [{"type": "text", "text": "x"}, {"type": "data", "value": math.nan}],
    }
    turns[0]["response_message"] = response
    turns[1]["request_messages"][2] = copy.deepcopy(response)
    graph.add_turn(TurnNode(node_id="t1", **turns[1]))
    graph.add_turn(TurnNode(node_id="t0", **turns[0]))
    assert graph.parent("t1") == "t0"


def test_tool_arguments_with_nan_link():
    graph = RolloutGraph()
    first, second = _tool_turns(_echo('{"a": NaN}'))
    first.response_message["tool_calls"][0]["function"]["arguments"] = '{"a": NaN}'
    graph.add_turn(first)
    assert graph.add_turn(second).parent_id == "a"


def test_lone_surrogate_in_history_does_not_break_linking():
    """json.loads('"\\ud800"') is a valid request string; later turns must still link."""
    graph = RolloutGraph()
    turns = chat_turns(4)
    lone = json.loads('"bad \\ud800 text"')
    for fields in turns[1:]:
        fields["request_messages"][3]["content"] = lone  # turn 1's user message
    ids = add_all(graph, turns)
    assert [graph.parent(n) for n in ids] == [None, *ids[:-1]]


# ---------------------------------------------------------------- out of order


def _check_chain(graph: RolloutGraph, ids: list[str]) -> None:
    assert [graph.parent(n) for n in ids] == [None, *ids[:-1]]
    assert graph.root_ids() == [ids[0]]
    assert graph.leaf_ids() == [ids[-1]]
    assert graph.fork_ids() == []
    assert graph.discarded_ids() == []


def test_turn_3_before_turn_2_tokens():
    graph = RolloutGraph()
    turns = token_turns(4, n_new=70)
    for k in (0, 2, 1, 3):
        graph.add_turn(TurnNode(node_id=f"t{k}", **turns[k]))
    _check_chain(graph, ["t0", "t1", "t2", "t3"])
    assert graph.link_kind("t2") == "tokens"


def test_turn_3_before_turn_2_messages():
    graph = RolloutGraph()
    turns = chat_turns(4)
    for k in (0, 2, 1, 3):
        graph.add_turn(TurnNode(node_id=f"t{k}", **turns[k]))
    _check_chain(graph, ["t0", "t1", "t2", "t3"])
    assert graph.link_kind("t2") == "messages"


def _rollout(kind: str, n: int) -> list[dict[str, Any]]:
    if kind == "messages":
        return chat_turns(n)
    return token_turns(n, n_new=2 if kind == "short tokens" else 70)


@pytest.mark.parametrize("kind", ["short tokens", "long tokens", "messages"])
def test_every_arrival_order_of_four_turns_gives_the_chain(kind):
    turns = _rollout(kind, 4)
    for order in itertools.permutations(range(4)):
        graph = RolloutGraph()
        for k in order:
            graph.add_turn(TurnNode(node_id=f"t{k}", **copy.deepcopy(turns[k])))
        assert [graph.parent(f"t{k}") for k in range(4)] == [None, "t0", "t1", "t2"], order
        assert graph.node_ids() == [f"t{k}" for k in order]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["short tokens", "long tokens", "messages"])
def test_every_arrival_order_of_six_turns_gives_the_chain(kind):
    turns = _rollout(kind, 6)
    expected = [None, *[f"t{k}" for k in range(5)]]
    for order in itertools.permutations(range(6)):
        graph = RolloutGraph()
        for k in order:
            graph.add_turn(TurnNode(node_id=f"t{k}", **copy.deepcopy(turns[k])))
        assert [graph.parent(f"t{k}") for k in range(6)] == expected, order


def _two_interleaved_rollouts(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["short tokens", "long tokens", "messages"]))
    a = _rollout(kind, 5)
    b = (
        chat_turns(5, tag="other")
        if kind == "messages"
        else token_turns(5, start=50_000, n_new=2 if kind == "short tokens" else 70)
    )
    named = [(f"a{k}", t) for k, t in enumerate(a)] + [(f"b{k}", t) for k, t in enumerate(b)]
    order = data.draw(st.permutations(named))
    graph = RolloutGraph()
    for node_id, fields in order:
        graph.add_turn(TurnNode(node_id=node_id, **copy.deepcopy(fields)))
    for prefix in "ab":
        ids = [f"{prefix}{k}" for k in range(5)]
        assert [graph.parent(n) for n in ids] == [None, *ids[:-1]]
        assert graph.path_ids(ids[-1]) == ids
    assert sorted(graph.root_ids()) == ["a0", "b0"]


@given(data=st.data())
def test_random_arrival_of_two_interleaved_rollouts(data):
    _two_interleaved_rollouts(data)


@pytest.mark.slow
@FUZZ
@given(data=st.data())
def test_random_arrival_of_two_interleaved_rollouts_fuzz(data):
    _two_interleaved_rollouts(data)


@st.composite
def linear_conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Each request re-sends the previous one, the exact response, then new user content."""
    system = draw(
        st.lists(
            st.fixed_dictionaries({"role": st.just("system"), "content": small_json}), max_size=2
        )
    )
    user = st.fixed_dictionaries({"role": st.sampled_from(["user", "tool"]), "content": small_json})
    history: list[Any] = draw(st.lists(user, min_size=1, max_size=2))
    turns = []
    for _ in range(draw(st.integers(min_value=2, max_value=5))):
        response = draw(
            st.fixed_dictionaries(
                {"role": st.just("assistant"), "content": small_json},
                optional={"tool_calls": small_json, "extra": small_json},
            )
        )
        turns.append(
            {
                "request_messages": copy.deepcopy(draw(st.sampled_from([system, []])) + history),
                "response_message": copy.deepcopy(response),
            }
        )
        history = [*history, response, *draw(st.lists(user, max_size=2))]
    return turns


@given(turns=linear_conversations(), threshold=st.sampled_from([8, 1024, None]))
def test_linear_conversation_with_any_content_is_a_chain(turns, threshold):
    graph = RolloutGraph(share_threshold=threshold)
    ids = add_all(graph, turns)
    assert [graph.parent(n) for n in ids] == [None, *ids[:-1]]


@pytest.mark.slow
@FUZZ
@given(turns=linear_conversations(), threshold=st.sampled_from([8, 1024, None]), data=st.data())
def test_linear_conversation_in_any_order_is_a_chain_fuzz(turns, threshold, data):
    graph = RolloutGraph(share_threshold=threshold)
    named = [(f"t{k}", fields) for k, fields in enumerate(turns)]
    for node_id, fields in data.draw(st.permutations(named)):
        graph.add_turn(TurnNode(node_id=node_id, **copy.deepcopy(fields)))
    ids = [node_id for node_id, _ in named]
    assert [graph.parent(n) for n in ids] == [None, *ids[:-1]]


def _token_chain(data: st.DataObject, shuffle: bool) -> None:
    ids = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300), label="ids")
    pool = st.lists(st.sampled_from(ids) | st.integers(0, 2**32 - 1), max_size=150)
    # an empty prompt means "no token ids" (linked by messages), so the root has some
    full = data.draw(
        st.lists(st.sampled_from(ids) | st.integers(0, 2**32 - 1), min_size=1, max_size=150)
    )
    turns = []
    for _ in range(data.draw(st.integers(min_value=2, max_value=5))):
        sampled = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=80))
        turns.append({"prompt_ids": list(full), "sampled_ids": sampled})
        full = full + sampled + data.draw(pool)
    named = [(f"t{k}", fields) for k, fields in enumerate(turns)]
    order = data.draw(st.permutations(named)) if shuffle else named
    graph = RolloutGraph()
    for node_id, fields in order:
        graph.add_turn(TurnNode(node_id=node_id, **fields))
    node_ids = [node_id for node_id, _ in named]
    assert [graph.parent(n) for n in node_ids] == [None, *node_ids[:-1]]
    for node_id, fields in named:
        node = graph.get(node_id)
        assert node.prompt_ids == fields["prompt_ids"]
        assert node.sampled_ids == fields["sampled_ids"]
    last = turns[-1]
    assert graph.sequence_for(node_ids[-1]).input_ids == last["prompt_ids"] + last["sampled_ids"]


@given(data=st.data())
def test_linear_token_rollout_with_any_ids_is_a_chain(data):
    _token_chain(data, shuffle=False)


@given(data=st.data())
def test_linear_token_rollout_with_any_ids_in_any_order_is_a_chain(data):
    _token_chain(data, shuffle=True)


@pytest.mark.slow
@FUZZ
@given(data=st.data())
def test_linear_token_rollout_in_any_order_is_a_chain_fuzz(data):
    _token_chain(data, shuffle=True)


@st.composite
def trees(draw: st.DrawFn, kind: str) -> list[tuple[int | None, dict[str, Any]]]:
    """A random rollout tree: (parent index, turn fields) per node, every link unambiguous.

    Each node extends its parent's prompt + sampled tokens (or request + echoed response)
    with fresh content; roots may repeat an earlier root's prompt (a retried first call).
    """
    counter = itertools.count(1000)
    nodes: list[tuple[int | None, dict[str, Any]]] = []
    for i in range(draw(st.integers(min_value=1, max_value=8))):
        parent = draw(st.sampled_from([None, *range(i)]))
        roots = [k for k, (p, _) in enumerate(nodes) if p is None]
        retry_of = (
            draw(st.sampled_from(roots))
            if parent is None and roots and draw(st.booleans())
            else None
        )
        if kind == "tokens":
            if parent is not None:
                up = nodes[parent][1]
                new = [next(counter) for _ in range(draw(st.integers(0, 70)))]
                prompt = up["prompt_ids"] + up["sampled_ids"] + new
            elif retry_of is not None:
                prompt = list(nodes[retry_of][1]["prompt_ids"])
            else:
                prompt = [next(counter) for _ in range(draw(st.integers(1, 70)))]
            sampled = [next(counter) for _ in range(draw(st.integers(1, 40)))]
            fields = {"prompt_ids": prompt, "sampled_ids": sampled}
        else:
            if parent is not None:
                up = nodes[parent][1]
                new = [
                    {"role": "user", "content": f"m{next(counter)}"}
                    for _ in range(draw(st.integers(0, 2)))
                ]
                rest = [*up["request_messages"], up["response_message"], *new]
                rest = [m for m in rest if m["role"] != "system"]
            elif retry_of is not None:
                rest = [m for m in nodes[retry_of][1]["request_messages"] if m["role"] != "system"]
            else:
                rest = [{"role": "user", "content": f"task {next(counter)}"}]
            system = draw(st.sampled_from([[], [{"role": "system", "content": f"s{i}"}]]))
            fields = {
                "request_messages": copy.deepcopy(system + rest),
                "response_message": {"role": "assistant", "content": f"a{next(counter)}"},
            }
        nodes.append((parent, fields))
    return nodes


def _expected_discarded(nodes: list[tuple[int | None, dict[str, Any]]], kind: str) -> list[str]:
    children: dict[int | None, list[int]] = {}
    for k, (parent, _) in enumerate(nodes):
        children.setdefault(parent, []).append(k)
    groups = [v for p, v in children.items() if p is not None]
    by_prompt: dict[str, list[int]] = {}
    for k in children.get(None, []):
        fields = nodes[k][1]
        if kind == "tokens":
            key = json.dumps(fields["prompt_ids"])
        else:
            key = json.dumps(fields["request_messages"])
        by_prompt.setdefault(key, []).append(k)
    groups += list(by_prompt.values())
    out = set()
    for group in groups:
        if len(group) > 1 and any(k in children for k in group):
            out.update(k for k in group if k not in children)
    return [f"n{k}" for k in sorted(out)]


def _check_tree(kind: str, data: st.DataObject) -> None:
    nodes = data.draw(trees(kind), label="tree")
    order = data.draw(st.permutations(range(len(nodes))), label="arrival order")
    graph = RolloutGraph()
    for k in order:
        graph.add_turn(TurnNode(node_id=f"n{k}", **copy.deepcopy(nodes[k][1])))
    assert [graph.parent(f"n{k}") for k in range(len(nodes))] == [
        None if p is None else f"n{p}" for p, _ in nodes
    ]
    discarded = sorted(graph.discarded_ids(), key=lambda n: int(n[1:]))
    assert discarded == _expected_discarded(nodes, kind)


@pytest.mark.parametrize("kind", ["tokens", "messages"])
@given(data=st.data())
def test_random_tree_in_any_arrival_order(kind, data):
    _check_tree(kind, data)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tokens", "messages"])
@FUZZ
@given(data=st.data())
def test_random_tree_in_any_arrival_order_fuzz(kind, data):
    _check_tree(kind, data)


# ---------------------------------------------------------------- retries and forks


def test_retried_turn_without_children_is_discarded_tokens():
    graph = RolloutGraph()
    turns = token_turns(3)
    add_all(graph, turns[:2])
    retry = {**turns[1], "sampled_ids": [1, 2, 3]}  # same prompt, another sample, dropped
    graph.add_turn(TurnNode(node_id="r", **retry))
    graph.add_turn(TurnNode(node_id="t2", **turns[2]))
    assert graph.child_ids("t0") == ["t1", "r"]
    assert graph.parent("t2") == "t1"
    assert graph.discarded_ids() == ["r"]
    assert graph.fork_ids() == ["t0"]
    assert graph.leaf_ids() == ["r", "t2"]
    assert graph.path_id_lists() == [["t0", "r"], ["t0", "t1", "t2"]]


def test_retried_turn_without_children_is_discarded_messages():
    graph = RolloutGraph()
    turns = chat_turns(3)
    add_all(graph, turns[:2])
    retry = fresh(turns[1])
    retry["response_message"]["content"] = "a worse answer"
    graph.add_turn(TurnNode(node_id="r", **retry))
    graph.add_turn(TurnNode(node_id="t2", **turns[2]))
    assert graph.parent("r") == "t0" and graph.parent("t2") == "t1"
    assert graph.discarded_ids() == ["r"]


@pytest.mark.parametrize("kind", ["tokens", "messages"])
def test_retried_first_call_is_discarded(kind):
    graph = RolloutGraph()
    turns = token_turns(2) if kind == "tokens" else chat_turns(2)
    retry = fresh(turns[0])
    if kind == "tokens":
        retry["sampled_ids"] = [9, 9, 9]
    else:
        retry["response_message"]["content"] = "timeout, retried"
    graph.add_turn(TurnNode(node_id="r", **retry))
    add_all(graph, turns)
    assert graph.root_ids() == ["r", "t0"]
    assert graph.parent("t1") == "t0"
    assert graph.discarded_ids() == ["r"]
    assert graph.root_of("t1") == "t0" and graph.root_of("r") == "r"


def test_siblings_that_all_stop_are_not_discarded():
    graph = RolloutGraph()
    turns = token_turns(2)
    add_all(graph, turns)
    graph.add_turn(TurnNode(node_id="s", **{**turns[1], "sampled_ids": [4, 4]}))
    assert graph.fork_ids() == ["t0"]
    assert graph.discarded_ids() == []
    different = token_turns(1, start=77_000)[0]
    graph.add_turn(TurnNode(node_id="other", **different))
    assert graph.discarded_ids() == []


def test_discarded_nodes_with_lone_surrogate_in_root_request():
    graph = RolloutGraph()
    lone = json.loads('"\\udc00"')
    graph.add_turn(TurnNode(node_id="a", request_messages=[{"role": "user", "content": lone}]))
    graph.add_turn(TurnNode(node_id="b", request_messages=[{"role": "user", "content": "x"}]))
    assert graph.discarded_ids() == []


def test_queries_on_a_tree():
    graph = RolloutGraph()
    turns = token_turns(3, n_new=3)
    add_all(graph, turns)
    branch = turns[1]["prompt_ids"] + turns[1]["sampled_ids"] + [1, 1]
    graph.add_turn(TurnNode(node_id="b", prompt_ids=branch, sampled_ids=[2]))
    graph.add_turn(TurnNode(node_id="lone", prompt_ids=[5, 5], sampled_ids=[6]))
    assert graph.node_ids() == ["t0", "t1", "t2", "b", "lone"]
    assert graph.root_ids() == ["t0", "lone"]
    assert graph.leaf_ids() == ["t2", "b", "lone"]
    assert graph.child_ids("t1") == ["t2", "b"]
    assert graph.child_ids("t2") == []
    assert graph.fork_ids() == ["t1"]
    assert graph.path_ids("b") == ["t0", "t1", "b"]
    assert graph.path_id_lists() == [["t0", "t1", "t2"], ["t0", "t1", "b"], ["lone"]]
    assert graph.root_of("b") == "t0" and graph.root_of("lone") == "lone"
    assert len(graph) == 5
    stats = graph.stats()
    assert (stats["n_turns"], stats["n_roots"], stats["n_leaves"], stats["n_forks"]) == (5, 2, 3, 1)
    summary = graph.summary("b")
    assert summary["parent_id"] == "t1" and summary["link"] == "tokens"
    assert summary["n_prompt"] == len(branch) and summary["n_sampled"] == 1
    assert summary["index"] == 3 and summary["node_id"] == "b"
    for query in (graph.get, graph.parent, graph.children, graph.path_to, graph.summary):
        with pytest.raises(KeyError):
            query("missing")


# ---------------------------------------------------------------- sequences


def test_sequence_masks_sampled_spans_with_their_logprobs():
    graph = RolloutGraph()
    turns = token_turns(3, n_prompt=4, n_new=2, n_sampled=3)
    ids = add_all(graph, turns)
    seq = graph.sequence_for(ids[-1])
    last = turns[-1]
    assert seq.input_ids == last["prompt_ids"] + last["sampled_ids"]
    n = len(seq.input_ids)
    mask = [0] * n
    logprobs = [0.0] * n
    for fields in turns:
        start = len(fields["prompt_ids"])
        end = start + len(fields["sampled_ids"])
        mask[start:end] = [1] * (end - start)
        logprobs[start:end] = fields["sampled_logprobs"]
    assert seq.loss_mask == mask
    assert seq.logprobs == logprobs
    assert sum(mask) == 9
    assert seq.prompt_len == 4
    assert seq.node_ids == ids and seq.n_turns == 3 and seq.root_id == ids[0]
    assert graph.sequences() == [seq]
    # the sequence of a middle turn stops at that turn
    mid = graph.sequence_for(ids[1])
    assert mid.input_ids == turns[1]["prompt_ids"] + turns[1]["sampled_ids"]
    assert mid.loss_mask == mask[: len(mid.input_ids)]
    assert mid.n_turns == 2


@pytest.mark.parametrize(
    "logprobs",
    [None, [], [-0.5], [-0.5, -0.5, -0.5, -0.5], [-0.5, -0.5, None]],
    ids=["missing", "empty", "short", "long", "not numbers"],
)
def test_turn_with_missing_or_misaligned_logprobs_is_masked_out(logprobs):
    graph = RolloutGraph()
    turns = token_turns(3, n_prompt=4, n_new=2, n_sampled=3)
    turns[1]["sampled_logprobs"] = logprobs
    ids = add_all(graph, turns)
    assert graph.get(ids[1]).sampled_logprobs == logprobs
    seq = graph.sequence_for(ids[-1])
    start = len(turns[1]["prompt_ids"])
    assert seq.loss_mask[start : start + 3] == [0, 0, 0]
    assert seq.logprobs[start : start + 3] == [0.0, 0.0, 0.0]
    assert sum(seq.loss_mask) == 6  # turns 0 and 2 still count


def test_explicit_parent_whose_tokens_are_not_a_prefix_is_context_free():
    graph = RolloutGraph()
    graph.add_turn(
        TurnNode(node_id="a", prompt_ids=[1, 2], sampled_ids=[3], sampled_logprobs=[-1.0])
    )
    graph.add_turn(
        TurnNode(
            node_id="b",
            parent_id="a",
            prompt_ids=[9, 9, 9, 9],
            sampled_ids=[4, 5],
            sampled_logprobs=[-0.1, -0.2],
        )
    )
    seq = graph.sequence_for("b")
    assert seq.input_ids == [9, 9, 9, 9, 4, 5]
    assert seq.loss_mask == [0, 0, 0, 0, 1, 1]
    assert seq.logprobs == [0.0] * 4 + [-0.1, -0.2]
    assert seq.node_ids == ["a", "b"] and seq.prompt_len == 2


def test_one_sequence_per_leaf_and_message_only_turns():
    graph = RolloutGraph()
    turns = token_turns(2)
    add_all(graph, turns)
    graph.add_turn(
        TurnNode(node_id="s", **{**turns[1], "sampled_ids": [4], "sampled_logprobs": [-2.0]})
    )
    graph.add_turn(TurnNode(node_id="m", request_messages=[{"role": "user", "content": "x"}]))
    seqs = graph.sequences()
    assert [s.node_ids[-1] for s in seqs] == ["t1", "s", "m"]
    assert seqs[1].input_ids == turns[1]["prompt_ids"] + [4]
    assert seqs[1].loss_mask[-1] == 1 and seqs[1].logprobs[-1] == -2.0
    assert seqs[2].to_dict() == {
        "input_ids": [],
        "loss_mask": [],
        "logprobs": [],
        "node_ids": ["m"],
        "prompt_len": 0,
        "root_id": "m",
        "n_turns": 1,
    }


def _answer(call_id: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }


def _retry_turns() -> dict[str, TurnNode]:
    """Two retries answer with the same call but different call ids; `next` re-sends the
    second answer verbatim (and its tool result)."""
    user = {"role": "user", "content": "call f"}
    result = {"role": "tool", "tool_call_id": "call_B", "content": "ok"}
    return {
        "first": TurnNode(
            node_id="first", request_messages=[user], response_message=_answer("call_A")
        ),
        "retry": TurnNode(
            node_id="retry", request_messages=[user], response_message=_answer("call_B")
        ),
        "next": TurnNode(node_id="next", request_messages=[user, _answer("call_B"), result]),
    }


@pytest.mark.parametrize("order", list(itertools.permutations(["first", "retry", "next"])))
def test_exact_echo_wins_over_a_loose_one_among_retries(order):
    graph = RolloutGraph()
    turns = _retry_turns()
    for name in order:
        graph.add_turn(copy.deepcopy(turns[name]))
    assert graph.parent("next") == "retry"
    assert graph.parent("first") is None and graph.parent("retry") is None
    assert graph.discarded_ids() == ["first"]


def test_a_call_that_sampled_nothing_and_its_retry_are_siblings():
    """A failed call (no sampled tokens) retried with its very prompt: the retry is a sibling
    that continues, the failed call is discarded; an ordinary continuation still links."""
    graph = RolloutGraph()
    prompt = list(range(100))
    graph.add_turn(TurnNode(node_id="a", prompt_ids=prompt, sampled_ids=[1, 2]))
    failed = [*prompt, 1, 2, 5]
    graph.add_turn(TurnNode(node_id="fail", prompt_ids=failed, sampled_ids=[]))
    graph.add_turn(TurnNode(node_id="retry", prompt_ids=failed, sampled_ids=[7]))
    graph.add_turn(TurnNode(node_id="next", prompt_ids=[*failed, 7, 9], sampled_ids=[8]))
    assert [graph.parent(n) for n in ("fail", "retry", "next")] == ["a", "a", "retry"]
    assert graph.discarded_ids() == ["fail"]
    # the retry arriving first does not adopt the failed call either
    late = RolloutGraph()
    late.add_turn(TurnNode(node_id="retry", prompt_ids=failed, sampled_ids=[7]))
    late.add_turn(TurnNode(node_id="fail", prompt_ids=failed, sampled_ids=[]))
    assert late.parent("retry") is None and late.parent("fail") is None


def test_moves_never_make_a_cycle():
    """An exact twin arriving late never adopts a turn it descends from (review finding)."""

    def user(s):
        return {"role": "user", "content": s}

    def assistant(s, **extra):
        return {"role": "assistant", "content": s, **extra}

    graph = RolloutGraph()
    graph.add_turn(
        TurnNode(node_id="T", request_messages=[user("1")], response_message=assistant("r", x=None))
    )
    graph.add_turn(
        TurnNode(
            node_id="X",
            request_messages=[user("1"), assistant("r"), user("2")],
            response_message=assistant("x"),
        )
    )
    graph.add_turn(
        TurnNode(node_id="Y", request_messages=[], response_message=user("1"), parent_id="X")
    )
    graph.add_turn(
        TurnNode(node_id="N", request_messages=[user("1")], response_message=assistant("r"))
    )
    for node_id in graph.node_ids():
        path = graph.path_ids(node_id)  # terminates: no cycle
        assert len(path) == len(set(path)) <= len(graph)
    assert graph.path_ids("N") == ["T", "X", "Y", "N"]


def test_short_token_prompts_link_through_their_own_index():
    """Turns of fewer than one block of tokens are found by exact length, not by a scan."""
    graph = RolloutGraph()
    for r in range(30):
        base = [1000 * r + k for k in range(20)]
        graph.add_turn(TurnNode(node_id=f"r{r}", prompt_ids=base, sampled_ids=[7, 8]))
        graph.add_turn(TurnNode(node_id=f"c{r}", prompt_ids=[*base, 7, 8, 9], sampled_ids=[5]))
    assert all(graph.parent(f"c{r}") == f"r{r}" for r in range(30))
    # a late root adopts a continuation that arrived first, found by its first 16 tokens
    graph.add_turn(TurnNode(node_id="child", prompt_ids=[*range(40), 1, 2, 3], sampled_ids=[4]))
    graph.add_turn(TurnNode(node_id="late", prompt_ids=list(range(40)), sampled_ids=[1, 2]))
    assert graph.parent("child") == "late"
    assert len(graph._linker.token_index) >= 61  # one key per turn, not one shared bucket


def test_message_turn_moves_under_a_late_token_turn_it_continues():
    def user(s):
        return {"role": "user", "content": s}

    def assistant(s):
        return {"role": "assistant", "content": s}

    token_turn = {
        "node_id": "T",
        "request_messages": [user("1")],
        "response_message": assistant("r"),
        "prompt_ids": [1, 2, 3],
        "sampled_ids": [4],
    }
    message_turn = {
        "node_id": "M",
        "request_messages": [user("1"), assistant("r"), user("2")],
        "response_message": assistant("s"),
    }
    for order in ((token_turn, message_turn), (message_turn, token_turn)):
        graph = RolloutGraph()
        for fields in order:
            graph.add_turn(TurnNode(**fields))
        assert (graph.parent("M"), graph.link_kind("M")) == ("T", "messages")


@pytest.mark.parametrize("order", ["ABC", "ACB", "CAB", "CBA", "BCA", "BAC"])
@pytest.mark.parametrize("prompt_len", [3, 300])
def test_longer_retry_adopts_the_continuation_whatever_the_order(order, prompt_len):
    """Two samples of one prompt where one is a prefix of the other (a retry after a length
    cut-off): the continuation hangs under the longer one in every arrival order."""
    prompt = list(range(prompt_len))
    short = list(range(1000, 1000 + (70 if prompt_len > 64 else 2)))
    long = list(range(1000, 1000 + (140 if prompt_len > 64 else 4)))
    specs = {"A": (prompt, short), "B": (prompt, long), "C": ([*prompt, *long, 9], [7])}
    graph = RolloutGraph()
    for name in order:
        graph.add_turn(
            TurnNode(node_id=name, prompt_ids=specs[name][0], sampled_ids=specs[name][1])
        )
    assert graph.parent("C") == "B"


@pytest.mark.parametrize("order", ["XYC", "XCY", "YXC", "YCX", "CXY", "CYX"])
def test_continuation_of_a_retry_after_a_failed_call_in_every_order(order):
    prompt = list(range(100, 120))
    turns = {
        "X": TurnNode(node_id="X", prompt_ids=prompt, sampled_ids=[]),
        "Y": TurnNode(node_id="Y", prompt_ids=prompt, sampled_ids=[1, 2, 3]),
        "C": TurnNode(node_id="C", prompt_ids=[*prompt, 1, 2, 3, 7], sampled_ids=[9]),
    }
    graph = RolloutGraph()
    for name in order:
        graph.add_turn(turns[name])
    assert graph.parent("C") == "Y"


@pytest.mark.parametrize("late_first", [False, True])
def test_a_request_of_system_messages_only_adopts_its_continuation(late_first):
    system = {"role": "system", "content": "Start."}
    opening = {"role": "assistant", "content": "I begin."}
    first = TurnNode(node_id="E", request_messages=[system], response_message=opening)
    later = TurnNode(
        node_id="C", request_messages=[system, opening, {"role": "user", "content": "ok"}]
    )
    graph = RolloutGraph()
    for node in (later, first) if late_first else (first, later):
        graph.add_turn(node)
    assert graph.parent("C") == "E"


def test_queries_over_a_long_request_keep_no_buffer_of_its_size() -> None:
    """`stats()` and `discarded_ids()` pack each root's request to compare prompts; the
    graph's reused packer must not keep a buffer of that size afterwards (16 graphs over one
    store each kept 425 KiB after one export, 6x the group's unique content)."""
    image = "data:image/png;base64," + "QUJD" * 60_000  # 240 KB, stored once as a blob
    graph = RolloutGraph()
    for k in range(3):  # three roots of one prompt: a retried first call among them
        graph.add_turn(
            TurnNode(
                request_messages=[{"role": "user", "content": [image, f"task {k % 2}"]}],
                response_message={"role": "assistant", "content": "ok"},
            )
        )
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        graph.stats()
        graph.discarded_ids()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 32 * 1024, f"queries kept {kept} bytes"

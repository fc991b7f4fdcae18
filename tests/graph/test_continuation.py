"""The shorter path for a request that continues the latest turn (`RequestStore._continuation`)
must pick the base and the parent the usual path picks: a longer stored request it extends
wins, twins are left to the usual path, and a request that differs anywhere is not taken."""

from __future__ import annotations

import json
from typing import Any

from rollout_store import RolloutGraph, TurnNode

SYSTEM = {"role": "system", "content": "be brief"}


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _reply(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def _add(graph: RolloutGraph, messages: list[Any], reply: dict[str, Any]) -> TurnNode:
    # every request decoded on its own, as a harness receives it
    node = TurnNode(
        request_messages=json.loads(json.dumps(messages)),
        response_message=json.loads(json.dumps(reply)),
        prompt_ids=None,
        sampled_ids=None,
    )
    return graph.add_turn(node)


def test_a_longer_stored_request_is_the_base_not_the_latest_turn() -> None:
    graph = RolloutGraph()
    a, ra, b, rb = _user("a"), _reply("ra"), _user("b"), _reply("rb")
    longer = _add(graph, [SYSTEM, a, ra, b], rb)  # arrives before its ancestor
    latest = _add(graph, [SYSTEM, a], ra)
    assert graph.get(longer.node_id).parent_id == latest.node_id  # adopted
    turn = _add(graph, [SYSTEM, a, ra, b, rb, _user("c")], _reply("rc"))
    assert turn.parent_id == longer.node_id


def test_a_stored_request_one_message_past_the_base_is_found() -> None:
    """The count right after the latest turn's is probed too: a stored request of its
    request plus its echoed response (which arrived first) is the longer base and parent."""
    graph = RolloutGraph()
    a, ra, rb = _user("a"), _reply("ra"), _reply("rb")
    longer = _add(graph, [SYSTEM, a, ra], rb)  # arrives before its ancestor
    latest = _add(graph, [SYSTEM, a], ra)
    assert graph.get(longer.node_id).parent_id == latest.node_id  # adopted
    turn = _add(graph, [SYSTEM, a, ra, rb], _reply("rc"))
    assert turn.parent_id == longer.node_id
    assert graph.request_messages(turn.node_id) == [SYSTEM, a, ra, rb]


def test_twins_of_the_latest_turn_take_the_usual_path() -> None:
    graph = RolloutGraph()
    a, ra = _user("a"), _reply("ra")
    first = _add(graph, [SYSTEM, a], ra)
    _add(graph, [SYSTEM, a], ra)  # the very request and response again
    turn = _add(graph, [SYSTEM, a, ra, _user("b")], _reply("rb"))
    assert turn.parent_id == first.node_id


def test_a_request_that_differs_before_the_echo_is_not_continued() -> None:
    graph = RolloutGraph()
    ra = _reply("ra")
    latest = _add(graph, [SYSTEM, _user("a")], ra)
    turn = _add(graph, [SYSTEM, _user("A"), ra, _user("b")], _reply("rb"))
    assert turn.parent_id is None
    assert latest.parent_id is None
    assert graph.get(turn.node_id).request_messages[1] == _user("A")


def test_a_conversation_continued_turn_by_turn_reads_back_as_sent() -> None:
    graph = RolloutGraph()
    messages: list[Any] = [SYSTEM]
    sent = []
    previous = None
    for k in range(12):
        messages += [_user(f"question {k} " * (k + 1)), _user(f"more {k}")]
        reply = _reply(f"answer {k}")
        node = _add(graph, messages, reply)
        assert node.parent_id == (previous.node_id if previous is not None else None)
        sent.append(json.dumps(messages))
        messages = [*messages, reply]
        previous = node
    for k, text in enumerate(sent):
        assert json.dumps(graph.get(f"turn-{k}").request_messages) == text

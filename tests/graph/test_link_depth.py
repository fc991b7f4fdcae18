"""Whether a response and its loose echo link depends on the two messages alone: values
nested deeper than `LINK_DEPTH` (content, or a tool call's arguments as JSON) follow one
fixed rule, whether `add_turn` is called directly or from deep inside other frames, and raw
and decoded requests agree."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import pytest

from rollout_store import RawJSON, RolloutGraph, TurnNode, export_session
from rollout_store.engine.messages import LINK_DEPTH, json_nesting

T = TypeVar("T")

#: The levels above the nested value: the message, its content array, the content part.
CONTENT_ABOVE = 3
#: The levels above a call's arguments: the message, its tool calls, the call, its function.
ARGUMENTS_ABOVE = 4


def _nested(depth: int) -> Any:
    """A value whose arrays nest `depth` levels deep."""
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def _frames_deeper(frames: int, call: Callable[[], T]) -> T:
    """`call()`, made from `frames` frames deeper in the stack."""
    return call() if frames == 0 else _frames_deeper(frames - 1, call)


def _conversation(kind: str, depth: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A response (without a role, as engines return it) and its loose echo: with its role
    named; for "spaced arguments" also with its arguments text spaced differently."""
    if kind == "content":
        response: dict[str, Any] = {
            "content": [{"type": "data", "data": _nested(depth - CONTENT_ABOVE)}]
        }
        return response, {"role": "assistant", **response}
    arguments = "[" * depth + "1" + "]" * depth
    assert json_nesting(arguments.encode()) == depth

    def message(text: str) -> dict[str, Any]:
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": text}}
        return {"content": None, "tool_calls": [call]}

    if kind == "arguments":
        return message(arguments), {"role": "assistant", **message(arguments)}
    return message(arguments), {"role": "assistant", **message(" " + arguments)}


def _turns(kind: str, depth: int, raw: bool) -> list[TurnNode]:
    """Two turns, the second echoing the response of the first."""
    response, echo = _conversation(kind, depth)
    task = [{"role": "user", "content": "task"}]
    request: Any = [*task, echo, {"role": "user", "content": "go on"}]
    if raw:
        request = RawJSON(json.dumps(request).encode())
    return [
        TurnNode(node_id="a", request_messages=task, response_message=response),
        TurnNode(node_id="b", request_messages=request),
    ]


def _recorded(turns: list[TurnNode]) -> RolloutGraph:
    graph = RolloutGraph()
    for turn in turns:
        graph.add_turn(turn)
    return graph


def _outcome(graph: RolloutGraph) -> dict[str, Any]:
    """The links of a graph, and its export."""
    document = export_session(graph, include_messages=True)
    return {
        "links": [(graph.parent(n), graph.link_kind(n)) for n in ("a", "b")],
        "turns": json.dumps(document["turns"]),
    }


CASES = [
    # content: at the bound, just past it, and near MAX_DEPTH (a message nests at most 500)
    ("content", LINK_DEPTH, True),
    ("content", LINK_DEPTH + 1, False),
    ("content", 300, False),
    ("content", 400, False),
    ("content", 480, False),
    # parsed arguments: at the bound, then compared as text (differently spaced: no link)
    ("spaced arguments", LINK_DEPTH - ARGUMENTS_ABOVE, True),
    ("spaced arguments", LINK_DEPTH - ARGUMENTS_ABOVE + 1, False),
    ("spaced arguments", 300, False),
    ("spaced arguments", 480, False),
    ("spaced arguments", 600, False),  # a text: not bounded by MAX_DEPTH
    # the very same arguments text links at any depth
    ("arguments", LINK_DEPTH - ARGUMENTS_ABOVE + 1, True),
    ("arguments", 600, True),
    ("arguments", 5000, True),
]


@pytest.mark.parametrize(("kind", "depth", "links"), CASES)
@pytest.mark.parametrize("raw", [False, True], ids=["decoded", "raw"])
def test_a_loose_echo_links_alike_from_any_caller_depth(
    kind: str, depth: int, links: bool, raw: bool
) -> None:
    direct = _outcome(_recorded(_turns(kind, depth, raw)))
    for frames in (150, 300, 450):
        turns = _turns(kind, depth, raw)
        graph = _frames_deeper(frames, partial(_recorded, turns))
        assert _outcome(graph) == direct, frames
    assert _outcome(_recorded(_turns(kind, depth, not raw))) == direct


@pytest.mark.parametrize(("kind", "depth", "links"), CASES)
def test_a_loose_echo_links_up_to_the_link_depth(kind: str, depth: int, links: bool) -> None:
    """Content links loosely while it nests at most `LINK_DEPTH` levels (the message being
    the first); arguments are parsed while they would too, then compared as text."""
    graph = _recorded(_turns(kind, depth, raw=False))
    assert graph.parent("b") == ("a" if links else None)
    assert graph.link_kind("b") == ("messages" if links else "none")


def test_brackets_inside_argument_strings_do_not_count() -> None:
    """Arguments holding many brackets in their strings (escaped quotes and backslashes
    among them) nest one level: they are parsed, so a differently spaced echo links."""
    arguments = json.dumps({"code": "[" * 300 + '\\"{' * 200 + "\\" + "{" * 200})
    assert json_nesting(arguments.encode()) == 1
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    response = {"content": None, "tool_calls": [call]}
    spaced = {**call, "function": {"name": "f", "arguments": " " + arguments + " "}}
    echo = {"role": "assistant", "content": None, "tool_calls": [spaced]}
    task = [{"role": "user", "content": "task"}]
    graph = _recorded(
        [
            TurnNode(node_id="a", request_messages=task, response_message=response),
            TurnNode(node_id="b", request_messages=[*task, echo]),
        ]
    )
    assert graph.parent("b") == "a"

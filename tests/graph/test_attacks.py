"""Values found by review that the graph took wrongly: each is refused with the library's own
error naming where it is, and the graph stays as it was (or is recorded and saved exactly)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from rollout_store import MAX_DEPTH, InvalidValueError, RolloutGraph, TurnNode, export_session
from rollout_store.viewer.app import Viewer

# an int Python will not write as text (json.dumps neither): more digits than the limit
_DIGITS = sys.get_int_max_str_digits() or 4300
_HUGE = 10 ** (_DIGITS + 10)


@pytest.mark.parametrize(
    ("field", "value", "path"),
    [
        ("prompt_ids", [1, _HUGE], "prompt_ids[1]"),
        ("sampled_ids", [_HUGE], "sampled_ids[0]"),
        ("sampled_logprobs", [-0.5, _HUGE], "sampled_logprobs[1]"),
        ("request_messages", [{"role": "user", "content": [_HUGE]}], "request_messages[0]"),
        ("request_messages", [{"role": "user", _HUGE: 1}], "request_messages[0]"),
        ("request_tools", [{"n": _HUGE}], "request_tools[0]"),
        ("sampling_params", {"seed": _HUGE}, "sampling_params"),
        ("response_message", {"content": _HUGE}, "response_message"),
    ],
    ids=["prompt", "sampled", "logprobs", "message", "key", "tools", "params", "response"],
)
def test_an_int_too_long_to_write_is_refused_where_it_is(
    field: str, value: Any, path: str, tmp_path: Path
) -> None:
    """Such an int raised a bare ValueError from add_turn, and in token ids it was recorded:
    the graph then could not be exported or saved (a log refused the turn)."""
    graph = RolloutGraph()
    graph.add_turn(TurnNode(prompt_ids=[1], sampled_ids=[2], request_messages=[{"role": "u"}]))
    node: dict[str, Any] = {"prompt_ids": [1, 2, 3], "sampled_ids": [4, 5]}
    node[field] = value
    with pytest.raises(InvalidValueError) as caught:
        graph.add_turn(TurnNode(**node))
    assert caught.value.path.startswith(path) and "digits" in str(caught.value)
    assert len(graph) == 1
    json.dumps(export_session(graph, include_messages=True))
    graph.save(tmp_path / "g.rls")
    assert len(RolloutGraph.load(tmp_path / "g.rls")) == 1


@pytest.mark.parametrize("kind", ["dict", "list"])
def test_the_viewer_shows_a_turn_nested_as_deep_as_intake_takes(kind: str) -> None:
    """A value nested MAX_DEPTH - 2 levels is recorded; the viewer's copy of it recursed twice
    a level and raised RecursionError (a 500 at the capture server's view route)."""
    value: Any = 1
    for _ in range(MAX_DEPTH - 2):
        value = {"a": value} if kind == "dict" else [value]
    graph = RolloutGraph()
    graph.add_turn(
        TurnNode(
            node_id="t",
            prompt_ids=None,
            sampled_ids=None,
            request_messages=[{"role": "user", "content": value}],
            response_message={"content": value},
        )
    )
    answer = Viewer(graph).respond("/api/turn", "id=t")
    assert answer.status == 200
    shown = json.loads(answer.body)
    assert json.dumps(shown["messages"][0]["content"]) == json.dumps(value)
    assert json.dumps(shown["response"]["content"]) == json.dumps(value)

"""Export: the session document, its streamed writer (same bytes) and the JSONL trace."""

from __future__ import annotations

import io
import json
import math
from typing import Any

import pytest
from support import add_all, chat_turns, fresh, token_turns

from rollout_store import (
    RolloutGraph,
    TurnNode,
    export_session,
    iter_turn_records,
    write_session_json,
    write_trace_jsonl,
)

TURN_FIELDS = {
    "node_id",
    "index",
    "root_id",
    "parent_id",
    "n_prompt",
    "n_sampled",
    "n_tools",
    "model",
    "finish_reason",
    "harness_session_id",
    "sampling_params",
    "discarded",
}
MESSAGE_FIELDS = {"request_messages", "request_tools", "response_message"}


def _graph_with_retry() -> tuple[RolloutGraph, list[dict[str, Any]]]:
    """t0 -> t1 -> t2 by tokens and messages, plus r: a dropped retry of t1."""
    graph = RolloutGraph()
    tokens = token_turns(3)
    chat = chat_turns(3, images=["data:image/png;base64," + "Q" * 3000])
    turns = []
    for k in range(3):
        turns.append(
            {
                **tokens[k],
                **chat[k],
                "request_tools": [{"type": "function", "function": {"name": "f"}}],
                "sampling_params": {"temperature": 0.5, "seed": k, "odd": [1, 1.0, -0.0]},
                "model": "m",
                "finish_reason": "stop" if k < 2 else "length",
                "harness_session_id": "sess",
            }
        )
    add_all(graph, turns[:2])
    retry = {**fresh(turns[1]), "sampled_ids": [5, 5], "sampled_logprobs": [-1.0, -2.0]}
    graph.add_turn(TurnNode(node_id="r", **retry))
    graph.add_turn(TurnNode(node_id="t2", **turns[2]))
    return graph, [*turns[:2], retry, turns[2]]


def test_export_session_fields():
    graph, turns = _graph_with_retry()
    doc = export_session(graph, session_id="s-1", metadata={"run": 7})
    assert list(doc) == ["session_id", "metadata", "turns", "sequences", "stats"]
    assert doc["session_id"] == "s-1" and doc["metadata"] == {"run": 7}
    assert [t["node_id"] for t in doc["turns"]] == ["t0", "t1", "t2"]  # r was discarded
    t2 = doc["turns"][2]
    assert set(t2) == TURN_FIELDS
    assert t2["index"] == 3 and t2["root_id"] == "t0" and t2["parent_id"] == "t1"
    assert t2["n_prompt"] == len(turns[3]["prompt_ids"])
    assert t2["n_sampled"] == len(turns[3]["sampled_ids"])
    assert t2["n_tools"] == 1 and t2["model"] == "m" and t2["finish_reason"] == "length"
    assert t2["harness_session_id"] == "sess" and t2["discarded"] is False
    assert json.dumps(t2["sampling_params"]) == json.dumps(turns[3]["sampling_params"])
    assert [s["node_ids"] for s in doc["sequences"]] == [["t0", "t1", "t2"]]
    assert doc["sequences"][0] == graph.sequence_for("t2")
    assert doc["stats"] == {
        "turns": 4,
        "roots": 1,
        "leaves": 2,
        "forks": 1,
        "discarded": 1,
        "exported_turns": 3,
        "sequences": 1,
    }


def test_export_include_discarded_and_messages():
    graph, turns = _graph_with_retry()
    doc = export_session(graph, include_discarded=True, include_messages=True)
    assert [t["node_id"] for t in doc["turns"]] == ["t0", "t1", "r", "t2"]
    assert [t["discarded"] for t in doc["turns"]] == [False, False, True, False]
    assert [s["node_ids"][-1] for s in doc["sequences"]] == ["r", "t2"]
    assert doc["stats"]["exported_turns"] == 4 and doc["stats"]["sequences"] == 2
    for record, fields in zip(doc["turns"], turns, strict=True):
        assert set(record) == TURN_FIELDS | MESSAGE_FIELDS
        for name in MESSAGE_FIELDS:
            assert json.dumps(record[name]) == json.dumps(fields[name]), name
    assert doc["session_id"] is None and doc["metadata"] is None


OPTIONS = [
    {},
    {"include_messages": True},
    {"include_discarded": True},
    {"include_messages": True, "include_discarded": True},
    {"session_id": "é-\ud800", "metadata": {"nan": math.nan, 1: (2, -0.0), "big": 2**80}},
]


@pytest.mark.parametrize("options", OPTIONS)
def test_write_session_json_equals_json_dumps(options):
    graph, _ = _graph_with_retry()
    expected = json.dumps(export_session(graph, **options))
    text = io.StringIO()
    write_session_json(graph, text, **options)
    assert text.getvalue() == expected
    binary = io.BytesIO()
    write_session_json(graph, binary, **options)
    assert binary.getvalue() == expected.encode("ascii")


def test_write_session_json_to_files(tmp_path):
    graph, _ = _graph_with_retry()
    expected = json.dumps(export_session(graph, include_messages=True))
    with open(tmp_path / "t.json", "w", encoding="utf-8") as fp:
        write_session_json(graph, fp, include_messages=True)
    with open(tmp_path / "b.json", "wb") as fp:
        write_session_json(graph, fp, include_messages=True)
    assert (tmp_path / "t.json").read_text(encoding="utf-8") == expected
    assert (tmp_path / "b.json").read_bytes() == expected.encode("ascii")


def test_export_of_an_empty_graph():
    graph = RolloutGraph()
    doc = export_session(graph)
    assert doc["turns"] == [] and doc["sequences"] == []
    out = io.StringIO()
    write_session_json(graph, out)
    assert out.getvalue() == json.dumps(doc)


def test_export_with_lone_surrogate_in_a_root_request():
    graph = RolloutGraph()
    lone = json.loads('"\\ud800"')
    graph.add_turn(TurnNode(node_id="a", request_messages=[{"role": "user", "content": lone}]))
    doc = export_session(graph, include_messages=True)
    assert doc["turns"][0]["request_messages"][0]["content"] == lone
    out = io.StringIO()
    write_session_json(graph, out, include_messages=True)
    assert out.getvalue() == json.dumps(doc)


def _expected_record(node_id: str, parent_id: Any, index: int, fields: dict[str, Any]) -> dict:
    return {
        "node_id": node_id,
        "parent_id": parent_id,
        "index": index,
        "model": fields.get("model"),
        "finish_reason": fields.get("finish_reason"),
        "harness_session_id": fields.get("harness_session_id"),
        "request_messages": fields.get("request_messages"),
        "request_tools": fields.get("request_tools"),
        "sampling_params": fields.get("sampling_params"),
        "response_message": fields.get("response_message"),
        "prompt_ids": fields.get("prompt_ids"),
        "sampled_ids": fields.get("sampled_ids"),
        "sampled_logprobs": fields.get("sampled_logprobs"),
    }


@pytest.mark.parametrize("binary", [False, True])
def test_trace_jsonl_has_one_exact_line_per_turn(binary):
    graph, turns = _graph_with_retry()
    graph.add_turn(
        TurnNode(
            node_id="odd",
            response_message={"v": [math.inf, -0.0, 2**70, 1.0, True], "k": {3: None}},
            sampled_logprobs=[-0.0, math.nan],
        )
    )
    out = io.BytesIO() if binary else io.StringIO()
    write_trace_jsonl(graph, out)
    text = out.getvalue().decode("ascii") if binary else out.getvalue()
    assert text.endswith("\n")
    lines = text.split("\n")[:-1]
    assert len(lines) == len(graph) == 5
    expected = [
        _expected_record("t0", None, 0, turns[0]),
        _expected_record("t1", "t0", 1, turns[1]),
        _expected_record("r", "t0", 2, turns[2]),
        _expected_record("t2", "t1", 3, turns[3]),
        _expected_record(
            "odd",
            None,
            4,
            {
                "response_message": {"v": [math.inf, -0.0, 2**70, 1.0, True], "k": {3: None}},
                "sampled_logprobs": [-0.0, math.nan],
            },
        ),
    ]
    assert [json.loads(line)["parent_id"] for line in lines] == [None, "t0", "t0", "t1", None]
    for line, record, node_id in zip(lines, expected, graph.nodes(), strict=True):
        assert line == json.dumps(record)
        node = graph.get(node_id)
        loaded = json.loads(line)
        for name in ("request_messages", "response_message", "prompt_ids", "sampled_ids"):
            assert loaded[name] == json.loads(json.dumps(getattr(node, name))), name
    assert [r["node_id"] for r in iter_turn_records(graph)] == graph.nodes()


def test_streaming_writers_accept_gzip_files(tmp_path):
    import gzip

    graph = RolloutGraph()
    add_all(graph, chat_turns(3))
    path = tmp_path / "session.json.gz"
    with gzip.open(path, "wb") as fp:
        write_session_json(graph, fp, include_messages=True)
    with gzip.open(path) as fp:
        assert fp.read().decode() == json.dumps(export_session(graph, include_messages=True))
    with gzip.open(path, "wt") as fp:
        write_trace_jsonl(graph, fp)
    with gzip.open(path, "rt") as fp:
        assert len(fp.read().splitlines()) == 3

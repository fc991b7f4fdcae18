"""Export: the session document, its streamed writer (same bytes) and the JSONL trace."""

from __future__ import annotations

import collections
import io
import json
import math
import sys
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

TURN_FIELDS = [
    "node_id",
    "index",
    "root_id",
    "n_sampled",
    "n_prompt",
    "n_tools",
    "finish_reason",
    "harness_session_id",
    "sampling_params",
    "requested_sampling_params",
    "sampled_logprobs",
    "discarded",
]
MESSAGE_FIELDS = ["request_messages", "request_tools", "response_message"]
DOCUMENT_FIELDS = [
    "session_id",
    "metadata",
    "budget_stop_count",
    "turns",
    "stats",
    "sequences",
    "validation",
    "trainable",
    "capture_level",
    "rollout_type",
]
ROW_FIELDS = [
    "role",
    "root_id",
    "node_ids",
    "n_turns",
    "prompt_len",
    "n_trainable",
    "turn_lengths",
    "input_ids",
    "loss_mask",
    "logprobs",
    "trainable",
    "validation",
]


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
                "n_tools": 1,
                "sampling_params": {"temperature": 0.5, "seed": k, "odd": [1, 1.0, -0.0]},
                "requested_sampling_params": {"temperature": 1, "max_tokens": 2**70},
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
    assert list(doc) == DOCUMENT_FIELDS
    assert doc["session_id"] == "s-1" and doc["metadata"] == {"run": 7}
    assert doc["budget_stop_count"] == 0
    # every turn is listed, the dropped retry flagged
    assert [t["node_id"] for t in doc["turns"]] == ["t0", "t1", "r", "t2"]
    assert [t["discarded"] for t in doc["turns"]] == [False, False, True, False]
    t2 = doc["turns"][3]
    assert list(t2) == TURN_FIELDS
    assert t2["index"] == 3 and t2["root_id"] == "t0"
    assert t2["n_prompt"] == len(turns[3]["prompt_ids"])
    assert t2["n_sampled"] == len(turns[3]["sampled_ids"])
    assert t2["n_tools"] == 1 and t2["finish_reason"] == "length"
    assert t2["harness_session_id"] == "sess"
    for name in ("sampling_params", "requested_sampling_params", "sampled_logprobs"):
        assert json.dumps(t2[name]) == json.dumps(turns[3][name]), name
    # the retry's row is left out unless asked for
    assert [s["node_ids"] for s in doc["sequences"]] == [["t0", "t1", "t2"]]
    row = doc["sequences"][0]
    assert list(row) == ROW_FIELDS
    seq = graph.sequence_for("t2")
    assert row["role"] == "agent" and row["trainable"] is True
    assert row["input_ids"] == seq.input_ids and row["loss_mask"] == seq.loss_mask
    assert row["logprobs"] == seq.logprobs and row["prompt_len"] == seq.prompt_len
    assert row["n_trainable"] == seq.n_trainable == 9
    assert row["turn_lengths"] == [3, 3, 3]
    assert row["validation"] == []
    assert doc["stats"] == {
        "n_turns": 4,
        "n_roots": 1,
        "n_leaves": 2,
        "n_forks": 1,
        "n_discarded": 1,
        "n_sequences": 1,
        "n_trainable_sequences": 1,
        "n_trainable_tokens": 9,
    }
    assert doc["validation"] == [
        doc["validation"][0],
        doc["validation"][1],
    ]
    assert doc["validation"][0].startswith("[WARN] discarded_turns: ")
    assert doc["validation"][1].startswith("[INFO] forks: ")
    assert doc["trainable"] is True
    assert doc["capture_level"] == "tokens" and doc["rollout_type"] == "train"


def test_export_include_discarded_and_messages():
    graph, turns = _graph_with_retry()
    doc = export_session(graph, include_discarded=True, include_messages=True)
    assert [t["node_id"] for t in doc["turns"]] == ["t0", "t1", "r", "t2"]
    assert [(s["node_ids"][-1], s["role"]) for s in doc["sequences"]] == [
        ("r", "discarded"),
        ("t2", "agent"),
    ]
    assert doc["sequences"][0]["trainable"] is False
    assert doc["stats"]["n_sequences"] == 2 and doc["stats"]["n_trainable_sequences"] == 1
    for record, fields in zip(doc["turns"], turns, strict=True):
        assert list(record) == TURN_FIELDS + MESSAGE_FIELDS
        for name in MESSAGE_FIELDS:
            assert json.dumps(record[name]) == json.dumps(fields[name]), name
    assert doc["session_id"] is None and doc["metadata"] is None


def test_eval_capture_levels_keep_the_structure_and_train_nothing():
    graph, _ = _graph_with_retry()
    for level in ("logprobs", "text", "messages"):
        doc = export_session(graph, capture_level=level)
        assert doc["capture_level"] == level and doc["rollout_type"] == "eval"
        assert doc["trainable"] is False
        row = doc["sequences"][0]
        assert row["node_ids"] == ["t0", "t1", "t2"] and row["role"] == "agent"
        assert row["n_trainable"] == 0 and set(row["loss_mask"]) == {0}
        assert row["trainable"] is False and row["validation"] == []
        assert doc["stats"]["n_trainable_tokens"] == 0
    eval_doc = export_session(graph, purpose="eval")
    assert eval_doc["rollout_type"] == "eval" and eval_doc["capture_level"] == "tokens"


def test_roles_agent_auxiliary_and_no_tools_anywhere():
    graph = RolloutGraph()
    for k, turn in enumerate(token_turns(2)):
        graph.add_turn(TurnNode(node_id=f"a{k}", n_tools=2, **turn))
    # a toolless root: a title generator
    graph.add_turn(
        TurnNode(node_id="title", prompt_ids=[7, 7], sampled_ids=[8], sampled_logprobs=[-1.0])
    )
    doc = export_session(graph)
    assert [(s["root_id"], s["role"], s["trainable"]) for s in doc["sequences"]] == [
        ("a0", "agent", True),
        ("title", "auxiliary", False),
    ]
    assert doc["validation"][0].startswith("[WARN] multiple_roots: ")

    plain = RolloutGraph()  # nobody sends tools: every live path is the agent's
    for k, turn in enumerate(token_turns(2)):
        plain.add_turn(TurnNode(node_id=f"a{k}", **turn))
    plain.add_turn(TurnNode(node_id="ctx", prompt_ids=[7], sampled_ids=[8]))  # no logprobs
    roles = [(s["root_id"], s["role"]) for s in export_session(plain)["sequences"]]
    assert roles == [("a0", "agent"), ("ctx", "auxiliary")]
    roles = [
        (s["root_id"], s["role"]) for s in export_session(plain, capture_level="text")["sequences"]
    ]
    assert roles == [("a0", "agent"), ("ctx", "agent")]


def test_sequence_findings():
    graph = RolloutGraph()
    graph.add_turn(
        TurnNode(node_id="a", prompt_ids=[1, 2], sampled_ids=[3, 4], sampled_logprobs=[-0.5, 0.0])
    )
    graph.add_turn(
        TurnNode(node_id="b", prompt_ids=[1, 2, 3, 4, 5], sampled_ids=[6], sampled_logprobs=[0.5])
    )
    graph.add_turn(TurnNode(node_id="c", prompt_ids=[9], sampled_ids=[10]))  # no logprobs
    doc = export_session(graph)
    rows = {s["root_id"]: s for s in doc["sequences"]}
    assert [f.split(":")[0] for f in rows["a"]["validation"]] == [
        "[FATAL] invalid_training_sequence"
    ]
    assert "positive_logprob" in rows["a"]["validation"][0]
    assert rows["c"]["validation"] == [rows["c"]["validation"][0]]
    assert rows["c"]["validation"][0].startswith("[FATAL] nothing_trainable: ")
    assert not any(r["trainable"] for r in rows.values()) and doc["trainable"] is False


def test_rollout_findings_one_turn_and_budget_stop():
    graph = RolloutGraph()
    graph.add_turn(TurnNode(node_id="a", **token_turns(1)[0]))
    doc = export_session(graph)
    assert doc["validation"][0].startswith("[FATAL] degenerate_rollout: ")
    assert doc["trainable"] is False and doc["sequences"][0]["trainable"] is True
    doc = export_session(graph, budget_stop_count=1)
    assert doc["validation"] == [] and doc["trainable"] is True
    assert doc["budget_stop_count"] == 1
    empty = export_session(RolloutGraph())
    assert empty["validation"][0].startswith("[FATAL] no_turns: ")
    assert empty["trainable"] is False and empty["turns"] == [] and empty["sequences"] == []


class _Session:
    def __init__(self, graph: RolloutGraph) -> None:
        self.session_id = "s1"
        self.metadata = {"api_type": "openai"}
        self.findings = ["[FATAL] capture_ingest_failed: a response could not be recorded"]
        self.budget_stop_count = 2
        self.graph = graph


def test_session_fields_come_from_a_session_object_or_keywords():
    graph, _ = _graph_with_retry()
    session = _Session(graph)
    doc = export_session(session)
    assert (doc["session_id"], doc["metadata"], doc["budget_stop_count"]) == (
        "s1",
        {"api_type": "openai"},
        2,
    )
    assert doc["validation"][-1] == session.findings[0]
    doc = export_session(session, session_id="other", metadata=None, findings=[])
    assert doc["session_id"] == "other" and doc["metadata"] is None
    assert not any("capture_ingest_failed" in f for f in doc["validation"])
    with pytest.raises(TypeError, match="RolloutGraph or a session"):
        export_session(object())


def test_jsonl_trace_says_which_turns_were_discarded():
    graph, _ = _graph_with_retry()
    records = list(iter_turn_records(graph))
    assert [(r["node_id"], r["discarded"]) for r in records] == [
        ("t0", False),
        ("t1", False),
        ("r", True),
        ("t2", False),
    ]


OPTIONS = [
    {},
    {"capture_level": "text"},
    {"session_id": "x", "budget_stop_count": 3, "findings": ["[WARN] w: x"], "purpose": "eval"},
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


def _expected_record(
    node_id: str, parent_id: Any, index: int, fields: dict[str, Any], discarded: bool = False
) -> dict:
    return {
        "node_id": node_id,
        "parent_id": parent_id,
        "index": index,
        "model": fields.get("model"),
        "finish_reason": fields.get("finish_reason"),
        "harness_session_id": fields.get("harness_session_id"),
        "request_messages": fields.get("request_messages", []),
        "request_tools": fields.get("request_tools"),
        "sampling_params": fields.get("sampling_params", {}),
        "requested_sampling_params": fields.get("requested_sampling_params", {}),
        "response_message": fields.get("response_message", {}),
        "prompt_ids": fields.get("prompt_ids", []),
        "sampled_ids": fields.get("sampled_ids", []),
        "sampled_logprobs": fields.get("sampled_logprobs"),
        "discarded": discarded,
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
        _expected_record("r", "t0", 2, turns[2], discarded=True),
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
    for line, record, node_id in zip(lines, expected, graph.node_ids(), strict=True):
        assert line == json.dumps(record)
        node = graph.get(node_id)
        loaded = json.loads(line)
        for name in ("request_messages", "response_message", "prompt_ids", "sampled_ids"):
            assert loaded[name] == json.loads(json.dumps(getattr(node, name))), name
    assert [r["node_id"] for r in iter_turn_records(graph)] == graph.node_ids()


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


def test_summarise_reads_the_document():
    from rollout_store.export.document import summarise

    graph, _ = _graph_with_retry()
    doc = export_session(graph, session_id="s-1", include_discarded=True)
    text = summarise(doc)
    lines = text.splitlines()
    assert lines[0] == "session s-1  train  trainable=True"
    assert lines[1] == "  graph: 4 turns, 1 roots, 1 forks, 1 discarded"
    assert lines[2] == "  training: 1 sequence(s), 9 trainable tokens"
    assert lines[3].startswith("  [discarded ] turns=2")
    assert any(line.startswith("  [agent     ] turns=3") for line in lines)
    assert lines[-1].startswith("  [INFO] forks: ")


def test_cli_export_capture_level_is_byte_identical(tmp_path):
    from rollout_store.cli import main

    graph, _ = _graph_with_retry()
    path = tmp_path / "g.rls"
    graph.save(path)
    out = tmp_path / "out.json"
    args = ["export", str(path), "--capture-level", "text", "--discarded", "-o", str(out)]
    assert main(args) == 0
    loaded = RolloutGraph.load(path)
    expected = export_session(loaded, capture_level="text", include_discarded=True)
    assert out.read_text() == json.dumps(expected) + "\n"
    assert json.loads(out.read_text())["rollout_type"] == "eval"


def test_turns_keep_arrival_order_and_roots_after_re_linking():
    graph = RolloutGraph()
    turns = token_turns(4)
    for k in (3, 0, 2, 1):  # descendants first: every one re-linked later
        graph.add_turn(TurnNode(node_id=f"t{k}", **turns[k]))
    doc = export_session(graph)
    assert [t["node_id"] for t in doc["turns"]] == ["t3", "t0", "t2", "t1"]
    assert [t["root_id"] for t in doc["turns"]] == ["t0"] * 4
    assert [t["index"] for t in doc["turns"]] == [0, 1, 2, 3]


# ---------------------------------------------------------------- what a new user meets first


def _text_graph() -> RolloutGraph:
    """Two turns recorded without token ids, sent two tools."""
    graph = RolloutGraph()
    tools = [{"type": "function", "function": {"name": n}} for n in ("read", "write")]
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    for k in range(2):
        response = {"role": "assistant", "content": f"answer {k}"}
        graph.add_turn(
            TurnNode(
                request_messages=list(messages), request_tools=tools, response_message=response
            )
        )
        messages += [response, {"role": "user", "content": f"more {k}"}]
    return graph


def test_n_tools_counts_the_tools_sent_unless_given() -> None:
    graph = _text_graph()
    assert [t["n_tools"] for t in export_session(graph)["turns"]] == [2, 2]
    assert TurnNode().n_tools == 0  # the default still reads as the capture graph's 0
    import copy
    import pickle

    from rollout_store import COUNT_TOOLS

    node = TurnNode(request_tools=[{}, {}, {}])
    for twin in (pickle.loads(pickle.dumps(node)), copy.deepcopy(node)):
        assert twin.n_tools is COUNT_TOOLS  # another process's node is counted alike
        assert graph.add_turn(twin).n_tools == 3
    given = RolloutGraph()
    given.add_turn(TurnNode(node_id="a", request_tools=[{}, {}], n_tools=0))
    given.add_turn(TurnNode(node_id="b", request_tools=[{}, {}], n_tools=5))
    given.add_turn(TurnNode(node_id="c"))
    assert [given.summary(n)["n_tools"] for n in "abc"] == [0, 5, 0]


def test_a_rollout_without_token_ids_exports_as_text_and_eval() -> None:
    doc = export_session(_text_graph())
    assert doc["capture_level"] == "text" and doc["rollout_type"] == "eval"
    assert doc["trainable"] is False
    assert [s["role"] for s in doc["sequences"]] == ["agent"]


def test_when_no_row_trains_the_fatal_findings_come_first() -> None:
    graph = _text_graph()
    doc = export_session(graph, capture_level="tokens")  # said to be tokens: nothing to train
    assert doc["trainable"] is False and doc["rollout_type"] == "eval"
    first = doc["validation"][0]
    assert first.startswith("[FATAL] row 0 (agent, ending at ")
    assert "no_prompt_ids" in first
    assert doc["sequences"][0]["validation"][0].startswith("[FATAL] invalid_training_sequence")


def test_unknown_capture_level_or_purpose_is_refused_with_the_valid_ones() -> None:
    from rollout_store import InvalidArgumentError

    graph, _ = _graph_with_retry()
    with pytest.raises(InvalidArgumentError, match="tokens, logprobs, text, messages; got 'bogus'"):
        export_session(graph, capture_level="bogus")
    with pytest.raises(InvalidArgumentError, match="auto, train, eval; got 'training'"):
        write_session_json(graph, io.StringIO(), purpose="training")


class _Items(dict[str, Any]):
    """Metadata whose own items() differ from what the dict holds: json.dumps asks items()."""

    def items(self) -> Any:
        return iter([("shown", [1, 2])])


class _Iterated(list[Any]):
    def __iter__(self) -> Any:
        return iter(["shown", None])


def test_write_session_json_reads_subclassed_metadata_as_json_dumps_does() -> None:
    graph = RolloutGraph()
    graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "hi"}]))
    moved = collections.OrderedDict([("a", 1), ("b", 2)])
    moved.move_to_end("a")  # json.dumps writes an OrderedDict's own order: b, then a
    for metadata in (
        _Items(hidden=0),
        {"a": _Iterated(["hidden"]), "b": [_Items()]},
        {"moved": moved},
    ):
        text = io.StringIO()
        write_session_json(graph, text, metadata=metadata)
        assert text.getvalue() == json.dumps(export_session(graph, metadata=metadata))


def _frames_below() -> int:
    """The frames of the stack under the caller's, the caller's included."""
    count, frame = 0, sys._getframe(1)
    while frame is not None:
        count, frame = count + 1, frame.f_back
    return count


def test_write_session_json_writes_metadata_as_deep_as_json_dumps_does() -> None:
    """Values the caller hands the document (metadata) nest as deep as json.dumps writes
    them: the streamed bytes are still json.dumps's, and what it refuses is refused alike."""
    graph = RolloutGraph()
    graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "hi"}]))
    deep: Any = "leaf"
    # nearly as deep as json.dumps can write from this frame (the runner's frames below this
    # test, which pytest-xdist's worker adds to, count against the same recursion limit)
    for _ in range(sys.getrecursionlimit() - _frames_below() - 20):
        deep = [deep]
    text = io.StringIO()
    write_session_json(graph, text, metadata={"deep": deep})
    assert text.getvalue() == json.dumps(export_session(graph, metadata={"deep": deep}))
    loop: list[Any] = []
    loop.append(loop)
    for bad, error in (({1, 2}, TypeError), (loop, ValueError)):
        with pytest.raises(error) as expected:
            json.dumps(export_session(graph, metadata={"bad": bad}))
        with pytest.raises(error) as got:
            write_session_json(graph, io.StringIO(), metadata={"bad": bad})
        assert str(got.value) == str(expected.value)

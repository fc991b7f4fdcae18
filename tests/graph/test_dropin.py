"""The capture graph's API on rollout_store: node objects, forks, sequences, stats, defaults.

Code written against the capture graph this library replaces must run unchanged; these tests
pin its shapes (what each query returns, the dataclass defaults, add_turn's effect on the node
it is given) and the behaviour its capture server relies on (an empty `prompt_ids` means no
token ids; logprobs are aligned by count).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pydantic
import pytest
from support import chat_turns, fresh

from rollout_store import (
    InvalidValueError,
    RolloutGraph,
    TrainingSequence,
    TurnNode,
    common_prefix_len,
)


def tok(node_id: str, prompt: list[int], sampled: list[int], **kw: object) -> TurnNode:
    return TurnNode(
        node_id=node_id,
        prompt_ids=prompt,
        sampled_ids=sampled,
        sampled_logprobs=[-0.5] * len(sampled),
        **kw,  # type: ignore[arg-type]
    )


def chain(graph: RolloutGraph, n: int) -> list[TurnNode]:
    """n turns, each prompt = previous prompt + sampled + one context token."""
    out = []
    prompt = [1, 2]
    for k in range(n):
        sampled = [100 + 10 * k, 101 + 10 * k]
        out.append(graph.add_turn(tok(f"n{k}", list(prompt), sampled)))
        prompt = prompt + sampled + [900 + k]
    return out


# ---------------------------------------------------------------- TurnNode


def test_turn_node_fields_and_defaults_are_the_capture_graphs():
    names = [f.name for f in dataclasses.fields(TurnNode)]
    assert names == [
        "node_id",
        "prompt_ids",
        "sampled_ids",
        "sampled_logprobs",
        "parent_id",
        "index",
        "model",
        "finish_reason",
        "harness_session_id",
        "system_digest",
        "n_tools",
        "request_messages",
        "request_tools",
        "sampling_params",
        "requested_sampling_params",
        "response_message",
    ]
    node = TurnNode(node_id="a", prompt_ids=[1], sampled_ids=[2])
    assert node.sampled_logprobs is None and node.parent_id is None
    assert node.index == 0 and node.n_tools == 0
    assert node.request_messages == [] and node.request_tools is None
    assert node.sampling_params == {} and node.requested_sampling_params == {}
    assert node.response_message == {}
    # fresh containers per node, as with default_factory
    other = TurnNode(node_id="b", prompt_ids=[], sampled_ids=[])
    assert other.request_messages is not node.request_messages


def test_turn_node_positional_construction_follows_field_order():
    node = TurnNode("a", [1, 2], [3], [-0.1])
    assert (node.node_id, node.prompt_ids, node.sampled_ids, node.sampled_logprobs) == (
        "a",
        [1, 2],
        [3],
        [-0.1],
    )


def test_end_ids_and_context_ids():
    parent = TurnNode(node_id="p", prompt_ids=[1, 2], sampled_ids=[3])
    child = TurnNode(node_id="c", prompt_ids=[1, 2, 3, 99, 98], sampled_ids=[4])
    assert parent.end_ids == [1, 2, 3]
    assert child.context_ids(parent) == [99, 98]
    assert child.context_ids(None) == [1, 2, 3, 99, 98]
    assert child.context_ids(None) is not child.prompt_ids


def test_add_turn_sets_index_and_parent_on_the_given_node_and_returns_a_node():
    graph = RolloutGraph()
    first = tok("a", [1, 2], [3])
    second = tok("b", [1, 2, 3, 4], [5])
    first.index = 7  # overwritten: the index is the arrival order
    got_first = graph.add_turn(first)
    got_second = graph.add_turn(second)
    assert (first.index, first.parent_id) == (0, None)
    assert (second.index, second.parent_id) == (1, "a")
    assert isinstance(got_second, TurnNode)
    assert (got_second.node_id, got_second.index, got_second.parent_id) == ("b", 1, "a")
    assert got_first == first and got_second == second
    assert got_second.end_ids == [1, 2, 3, 4, 5]


def test_requested_sampling_params_round_trip_and_are_exported():
    graph = RolloutGraph()
    requested = {"temperature": 1, "top_p": 0.95, "max_tokens": 64000}
    sent = {"temperature": 1.0}
    graph.add_turn(
        tok("a", [1], [2], sampling_params=sent, requested_sampling_params=fresh(requested))
    )
    node = graph.get("a")
    assert json.dumps(node.requested_sampling_params) == json.dumps(requested)
    assert json.dumps(node.sampling_params) == json.dumps(sent)


# ---------------------------------------------------------------- queries return nodes


def test_queries_return_nodes_and_forks_are_pairs():
    graph = RolloutGraph()
    graph.add_turn(tok("p", [1], [2, 3]))
    graph.add_turn(tok("dead", [1, 2, 3], [4]))
    graph.add_turn(tok("live", [1, 2, 3], [5]))
    graph.add_turn(tok("live2", [1, 2, 3, 5, 6], [7]))
    graph.add_turn(tok("other", [50, 51], [52]))

    for query in (graph.nodes(), graph.roots(), graph.leaves(), graph.children("p")):
        assert all(isinstance(n, TurnNode) for n in query)
    assert [n.node_id for n in graph.nodes()] == ["p", "dead", "live", "live2", "other"]
    assert [n.node_id for n in graph.roots()] == ["p", "other"]
    assert [n.node_id for n in graph.leaves()] == ["dead", "live2", "other"]
    assert [n.node_id for n in graph.children("p")] == ["dead", "live"]
    assert [n.node_id for n in graph.path_to("live2")] == ["p", "live", "live2"]
    assert [[n.node_id for n in path] for path in graph.paths()] == [
        ["p", "dead"],
        ["p", "live", "live2"],
        ["other"],
    ]
    assert graph.forks() == [("p", ["dead", "live"])]
    assert [n.node_id for n in graph.discarded_nodes()] == ["dead"]
    assert graph.children("p") == [graph.get("dead"), graph.get("live")]

    # the ids-only names keep their meaning
    assert graph.node_ids() == ["p", "dead", "live", "live2", "other"]
    assert graph.root_ids() == ["p", "other"]
    assert graph.leaf_ids() == ["dead", "live2", "other"]
    assert graph.child_ids("p") == ["dead", "live"]
    assert graph.path_ids("live2") == ["p", "live", "live2"]
    assert graph.path_id_lists() == [["p", "dead"], ["p", "live", "live2"], ["other"]]
    assert graph.fork_ids() == ["p"]
    assert graph.discarded_ids() == ["dead"]
    assert graph.parent("live2") == "live" and graph.root_of("live2") == "p"
    assert list(graph) == graph.node_ids()


def test_stats_have_the_capture_graphs_keys_first():
    graph = RolloutGraph()
    graph.add_turn(tok("p", [1], [2, 3]))
    graph.add_turn(tok("dead", [1, 2, 3], [4]))
    graph.add_turn(tok("live", [1, 2, 3], [5]))
    graph.add_turn(tok("live2", [1, 2, 3, 5, 6], [7]))
    stats = graph.stats()
    assert list(stats)[:5] == ["n_turns", "n_roots", "n_leaves", "n_forks", "n_discarded"]
    assert [stats[k] for k in list(stats)[:5]] == [4, 1, 2, 1, 1]
    assert RolloutGraph().stats()["n_turns"] == 0


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 9]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2


# ---------------------------------------------------------------- sequences


def test_sequence_for_is_a_training_sequence():
    graph = RolloutGraph()
    turns = chain(graph, 3)
    seq = graph.sequence_for(turns[-1].node_id)
    assert isinstance(seq, TrainingSequence)
    assert seq.node_ids == ["n0", "n1", "n2"] and seq.root_id == "n0" and seq.n_turns == 3
    assert seq.prompt_len == 2
    assert seq.n_trainable == 6 == sum(seq.loss_mask)
    assert seq.turn_lengths() == [2, 2, 2]
    assert len(seq.input_ids) == len(seq.loss_mask) == len(seq.logprobs)
    trained = [t for t, m in zip(seq.input_ids, seq.loss_mask, strict=True) if m]
    assert trained == [100, 101, 110, 111, 120, 121]
    assert [s.node_ids[-1] for s in graph.sequences()] == ["n2"]
    assert seq.to_dict()["input_ids"] is seq.input_ids


def test_turn_lengths_merge_turns_without_context_between_them():
    seq = TrainingSequence([1, 2, 3, 4, 5], [0, 1, 1, 1, 0], [0.0] * 5, ["a"], 1, "a", 1)
    assert seq.turn_lengths() == [3]
    assert TrainingSequence([], [], [], [], 0, "a", 0).turn_lengths() == []


# ---------------------------------------------------------------- an empty prompt_ids


def eval_turn(node_id: str, messages: list[dict], reply: str) -> TurnNode:
    # what the capture server builds for a hosted provider: `... or []` everywhere
    return TurnNode(
        node_id=node_id,
        prompt_ids=[],
        sampled_ids=[],
        sampled_logprobs=None,
        request_messages=messages,
        response_message={"content": reply},  # providers often omit the role
    )


def test_empty_prompt_ids_link_by_messages():
    graph = RolloutGraph()
    first = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}]
    graph.add_turn(eval_turn("a", fresh(first), "step 1"))
    second = [*first, {"role": "assistant", "content": "step 1"}, {"role": "user", "content": "r"}]
    graph.add_turn(eval_turn("b", fresh(second), "step 2"))
    third = [*second, {"role": "assistant", "content": "step 2"}, {"role": "user", "content": "s"}]
    graph.add_turn(eval_turn("c", fresh(third), "done"))
    assert graph.parent("b") == "a" and graph.parent("c") == "b"
    assert graph.link_kind("c") == "messages"
    assert graph.stats()["n_roots"] == 1
    assert len(graph.sequences()) == 1
    # the empty lists come back as they went in
    node = graph.get("b")
    assert node.prompt_ids == [] and node.sampled_ids == [] and node.end_ids == []


def test_empty_prompt_ids_late_parent_adopts_its_continuation():
    graph = RolloutGraph()
    turns = chat_turns(3)
    graph.add_turn(TurnNode(node_id="t2", prompt_ids=[], sampled_ids=[], **turns[2]))
    graph.add_turn(TurnNode(node_id="t0", prompt_ids=[], sampled_ids=[], **turns[0]))
    graph.add_turn(TurnNode(node_id="t1", prompt_ids=[], sampled_ids=[], **turns[1]))
    assert [graph.parent(n) for n in ("t0", "t1", "t2")] == [None, "t0", "t1"]


def test_token_linking_still_wins_when_ids_are_present():
    graph = RolloutGraph()
    chain(graph, 2)
    assert graph.parent("n1") == "n0" and graph.link_kind("n1") == "tokens"


# ---------------------------------------------------------------- logprobs judged by count


@pytest.mark.parametrize(
    "logprobs",
    [[-0.5, 0], [0, 0], [-1, -2.5], [-0.5, -0.0]],
    ids=["int-zero", "all-int", "mixed", "negative-zero"],
)
def test_aligned_logprobs_of_any_real_numbers_train(logprobs):
    graph = RolloutGraph()
    graph.add_turn(
        TurnNode(node_id="a", prompt_ids=[1, 2], sampled_ids=[3, 4], sampled_logprobs=logprobs)
    )
    seq = graph.sequence_for("a")
    assert seq.loss_mask == [0, 0, 1, 1]
    assert json.dumps(seq.logprobs[2:]) == json.dumps(logprobs)
    assert json.dumps(graph.get("a").sampled_logprobs) == json.dumps(logprobs)


@pytest.mark.parametrize(
    "logprobs", [[-0.5], [-0.5, -0.5, -0.5], [-0.5, None], [-0.5, True], [-0.5, "x"]]
)
def test_misaligned_or_non_numeric_logprobs_are_context(logprobs):
    graph = RolloutGraph()
    graph.add_turn(
        TurnNode(node_id="a", prompt_ids=[1, 2], sampled_ids=[3, 4], sampled_logprobs=logprobs)
    )
    assert graph.sequence_for("a").loss_mask == [0, 0, 0, 0]
    assert json.dumps(graph.get("a").sampled_logprobs) == json.dumps(logprobs)


def test_numpy_token_fields_come_back_as_plain_lists():
    graph = RolloutGraph()
    graph.add_turn(
        TurnNode(
            node_id="a",
            prompt_ids=np.array([1, 2, 3], dtype=np.int64),
            sampled_ids=[np.int32(4), np.int64(5)],
            sampled_logprobs=np.array([-0.25, -0.5], dtype=np.float32),
        )
    )
    graph.add_turn(
        TurnNode(
            node_id="b",
            prompt_ids=[np.int64(1), 2, 3, 4, 5, 6],
            sampled_ids=np.array([7], dtype=np.uint32),
            sampled_logprobs=[np.float64(-0.125)],
        )
    )
    a, b = graph.get("a"), graph.get("b")
    assert a.prompt_ids == [1, 2, 3] and type(a.prompt_ids[0]) is int
    assert a.sampled_ids == [4, 5] and all(type(x) is int for x in a.sampled_ids)
    assert a.sampled_logprobs == [-0.25, -0.5] and all(type(x) is float for x in a.sampled_logprobs)
    assert b.sampled_logprobs == [-0.125] and type(b.sampled_logprobs[0]) is float
    assert graph.parent("b") == "a"
    assert graph.sequence_for("b").loss_mask == [0, 0, 0, 1, 1, 0, 1]
    assert json.dumps(graph.sequence_for("b").logprobs[-1]) == "-0.125"


def test_numpy_token_array_of_two_dimensions_is_refused():
    graph = RolloutGraph()
    with pytest.raises(InvalidValueError) as err:
        graph.add_turn(
            TurnNode(node_id="a", prompt_ids=np.zeros((2, 2), dtype=np.int64), sampled_ids=[])
        )
    assert err.value.path == "prompt_ids" and "1-D" in str(err.value)
    assert len(graph) == 0


# ---------------------------------------------------------------- non-JSON objects


def test_a_pydantic_model_in_a_message_names_the_path_and_the_fix():

    class ToolCall(pydantic.BaseModel):
        name: str
        arguments: str

    graph = RolloutGraph()
    graph.add_turn(tok("ok", [1], [2]))
    before = json.dumps(graph.stats())
    bad = {"role": "assistant", "tool_calls": [ToolCall(name="f", arguments="{}")]}
    with pytest.raises(InvalidValueError) as err:
        graph.add_turn(tok("bad", [1, 2, 3], [4], request_messages=[{"role": "user"}, bad]))
    message = str(err.value)
    assert err.value.path == "request_messages[1].tool_calls[0]"
    assert "ToolCall" in message and "pydantic" in message
    assert '.model_dump(mode="json"' in message
    assert isinstance(err.value, TypeError)
    assert json.dumps(graph.stats()) == before and graph.node_ids() == ["ok"]


@pytest.mark.parametrize("field", ["response_message", "sampling_params", "request_tools"])
def test_a_numpy_value_in_a_json_field_names_the_path_and_the_fix(field):
    value = {"x": [1, np.int64(3)]}
    graph = RolloutGraph()
    with pytest.raises(InvalidValueError) as err:
        graph.add_turn(TurnNode(node_id="a", prompt_ids=[1], sampled_ids=[2], **{field: value}))
    assert err.value.path == f"{field}.x[1]"
    assert "numpy" in str(err.value) and ".item()" in str(err.value)
    assert len(graph) == 0


def test_a_numpy_array_in_a_json_field_suggests_tolist():
    graph = RolloutGraph()
    with pytest.raises(InvalidValueError) as err:
        graph.add_turn(tok("a", [1], [2], response_message={"embedding": np.zeros(3)}))
    assert err.value.path == "response_message.embedding"
    assert ".tolist()" in str(err.value)


# ---------------------------------------------------------------- files keep the new fields


def test_files_keep_requested_sampling_params_and_empty_prompts(tmp_path):
    graph = RolloutGraph()
    first = [{"role": "user", "content": "go"}]
    graph.add_turn(eval_turn("a", fresh(first), "step 1"))
    graph.add_turn(
        TurnNode(
            node_id="t",
            prompt_ids=[1, 2],
            sampled_ids=[3],
            sampled_logprobs=[-0.5],
            requested_sampling_params={"temperature": 1, "top_p": 1.0},
        )
    )
    path = tmp_path / "g.rls"
    graph.save(path)
    loaded = RolloutGraph.load(path)
    assert (
        json.dumps(loaded.get("t").requested_sampling_params) == '{"temperature": 1, "top_p": 1.0}'
    )
    assert loaded.get("a").prompt_ids == [] and loaded.get("a").requested_sampling_params == {}
    second = [*first, {"role": "assistant", "content": "step 1"}, {"role": "user", "content": "r"}]
    loaded.add_turn(eval_turn("b", fresh(second), "done"))
    assert loaded.parent("b") == "a"

    with RolloutGraph.open(tmp_path / "live.rls") as live:
        live.add_turn(eval_turn("a", fresh(first), "step 1"))
        live.add_turn(eval_turn("b", fresh(second), "done"))
    reopened = RolloutGraph.load(tmp_path / "live.rls")
    assert reopened.parent("b") == "a" and reopened.get("b").prompt_ids == []


def test_files_written_before_requested_sampling_params_still_load(tmp_path, monkeypatch):
    """Turn records of 18 fields (no requested_sampling_params) read back with it as None."""
    from rollout_store.files import storage

    original = storage.pack

    def pack_18_fields(value: object) -> bytes:
        if isinstance(value, list) and len(value) == 19 and isinstance(value[0], str):
            value = value[:18]
        return original(value)

    graph = RolloutGraph()
    graph.add_turn(tok("a", [1, 2], [3], sampling_params={"temperature": 1}))
    path = tmp_path / "old.rls"
    monkeypatch.setattr(storage, "pack", pack_18_fields)
    graph.save(path)
    monkeypatch.undo()
    loaded = RolloutGraph.load(path)
    assert loaded.get("a").requested_sampling_params is None
    assert json.dumps(loaded.get("a").sampling_params) == '{"temperature": 1}'
    assert loaded.get("a").prompt_ids == [1, 2]


# ---------------------------------------------------------------- what a capture server does


def _captured(chat_request: dict, response: dict, index: int) -> TurnNode:
    """A node built the way the capture server builds one (`... or []`, `... or {}`)."""
    choice = response["choices"][0]
    logprobs = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
    return TurnNode(
        node_id=f"call-{index}",
        prompt_ids=list(response.get("prompt_token_ids") or []),
        sampled_ids=list(choice.get("token_ids") or []),
        sampled_logprobs=list(logprobs) if logprobs else None,
        model=chat_request.get("model"),
        finish_reason=choice.get("finish_reason"),
        n_tools=len(chat_request.get("tools") or []),
        request_messages=chat_request.get("messages") or [],
        request_tools=chat_request.get("tools"),
        sampling_params={"temperature": 1},
        requested_sampling_params={},
        response_message=choice.get("message") or {},
    )


def test_a_hosted_provider_conversation_is_one_eval_thread():
    from rollout_store import export_session

    graph = RolloutGraph()
    messages: list = [{"role": "user", "content": "go"}]
    for k in range(4):
        reply = {"choices": [{"message": {"content": f"step {k}"}, "finish_reason": "stop"}]}
        request = {"model": "m", "messages": fresh(messages)}
        graph.add_turn(_captured(request, reply, k))
        assert graph.stats()["n_turns"] == k + 1
        messages += [
            {"role": "assistant", "content": f"step {k}"},
            {"role": "user", "content": "r"},
        ]
    assert graph.stats()["n_roots"] == 1 and len(graph.sequences()) == 1
    doc = export_session(graph, capture_level="text", session_id="s", metadata={})
    assert doc["rollout_type"] == "eval" and doc["trainable"] is False
    assert not [f for f in doc["validation"] if f.startswith("[FATAL")]
    assert [s["node_ids"] for s in doc["sequences"]] == [[f"call-{k}" for k in range(4)]]


def test_a_vllm_rollout_trains_every_turn():
    from rollout_store import export_session

    graph = RolloutGraph()
    tools = [{"type": "function", "function": {"name": "bash"}}]
    prompt = [1, 2, 3]
    for k in range(3):
        sampled = [100 + k, 200 + k]
        reply = {
            "prompt_token_ids": list(prompt),
            "choices": [
                {
                    "message": {"role": "assistant", "content": f"step {k}"},
                    "token_ids": sampled,
                    "logprobs": {"content": [{"logprob": -0.5}, {"logprob": 0}]},
                    "finish_reason": "stop",
                }
            ],
        }
        graph.add_turn(_captured({"model": "m", "messages": [], "tools": tools}, reply, k))
        prompt = prompt + sampled + [900 + k]
    doc = export_session(graph)
    (row,) = doc["sequences"]
    assert row["role"] == "agent" and row["trainable"] is True
    assert row["turn_lengths"] == [2, 2, 2] and doc["stats"]["n_trainable_tokens"] == 6
    assert doc["trainable"] is True

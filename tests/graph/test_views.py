"""Nodes handed out by queries are views: cheap to list, rebuilt field by field, never stale.

A view holds its graph and the stored turn. Scalar fields (ids, index, parent, model, counts)
are read from the stored turn; messages, tools, token ids and logprobs are rebuilt each time
they are read, as fresh containers, so changing them changes nothing stored.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import pickle
import tracemalloc
from pathlib import Path

import pytest
from support import chat_turns, image_url, token_turns

from rollout_store import ReadOnlyError, RolloutGraph, TurnNode


def multimodal_graph(n: int) -> RolloutGraph:
    graph = RolloutGraph()
    turns = chat_turns(n, images=[image_url(k, 16 * 1024) for k in range(n)])
    tokens = token_turns(n, n_prompt=50, n_new=20, n_sampled=10)
    for k in range(n):
        graph.add_turn(TurnNode(node_id=f"t{k}", **turns[k], **tokens[k]))
    return graph


def test_a_view_reads_every_field_as_recorded():
    graph = RolloutGraph()
    turns = chat_turns(2)
    tokens = token_turns(2)
    graph.add_turn(TurnNode(node_id="a", model="m", n_tools=2, **turns[0], **tokens[0]))
    graph.add_turn(TurnNode(node_id="b", finish_reason="stop", **turns[1], **tokens[1]))
    view = graph.get("b")
    assert isinstance(view, TurnNode)
    assert (view.node_id, view.index, view.parent_id) == ("b", 1, "a")
    assert view.finish_reason == "stop" and graph.get("a").model == "m"
    assert graph.get("a").n_tools == 2
    assert json.dumps(view.request_messages) == json.dumps(turns[1]["request_messages"])
    assert json.dumps(view.response_message) == json.dumps(turns[1]["response_message"])
    assert view.prompt_ids == tokens[1]["prompt_ids"]
    assert view.sampled_ids == tokens[1]["sampled_ids"]
    assert view.sampled_logprobs == tokens[1]["sampled_logprobs"]
    assert view.end_ids == tokens[1]["prompt_ids"] + tokens[1]["sampled_ids"]
    parent = graph.get("a")
    assert view.context_ids(parent) == tokens[1]["prompt_ids"][len(parent.end_ids) :]


def test_mutating_rebuilt_values_changes_nothing_stored():
    graph = RolloutGraph()
    turns = chat_turns(2)
    for k, fields in enumerate(turns):
        graph.add_turn(TurnNode(node_id=f"t{k}", prompt_ids=[k], sampled_ids=[9], **fields))
    view = graph.nodes()[1]
    view.request_messages.append({"role": "user", "content": "injected"})
    view.request_messages[0]["content"] = "changed"
    view.response_message["content"] = "changed"
    view.prompt_ids.append(5)
    assert json.dumps(view.request_messages) == json.dumps(turns[1]["request_messages"])
    assert json.dumps(graph.get("t1").response_message) == json.dumps(turns[1]["response_message"])
    assert view.prompt_ids == [1]
    assert view.request_messages is not view.request_messages  # rebuilt on every read


def test_views_are_read_only():
    graph = RolloutGraph()
    graph.add_turn(TurnNode(node_id="a", prompt_ids=[1], sampled_ids=[2]))
    view = graph.get("a")
    with pytest.raises(AttributeError):
        view.parent_id = "x"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        view.request_messages = []  # type: ignore[misc]
    assert graph.parent("a") is None


def test_adding_a_view_is_refused_before_anything_changes(tmp_path: Path) -> None:
    """A view cannot be given its place in the graph (it is read-only): add_turn refuses it
    before recording anything, in this graph, in another, and in a log."""
    source = RolloutGraph()
    source.add_turn(TurnNode(node_id="a", request_messages=[{"role": "user", "content": "x"}]))
    view = source.get("a")
    for graph in (RolloutGraph(), RolloutGraph.open(tmp_path / "log.rls", fsync="never")):
        size = (tmp_path / "log.rls").stat().st_size
        with pytest.raises(ReadOnlyError, match=r"dataclasses\.replace"):
            graph.add_turn(view)
        assert graph.node_ids() == [] and graph.stats()["n_turns"] == 0
        assert (tmp_path / "log.rls").stat().st_size == size
        graph.add_turn(dataclasses.replace(view))  # a plain copy is taken, under its id
        assert graph.node_ids() == ["a"]
        graph.close()
    assert RolloutGraph.load(tmp_path / "log.rls").node_ids() == ["a"]
    with pytest.raises(ReadOnlyError):
        source.add_turn(view)
    assert source.node_ids() == ["a"]


def test_a_view_reflects_a_late_ancestor_without_being_fetched_again():
    graph = RolloutGraph()
    tokens = token_turns(3)
    graph.add_turn(TurnNode(node_id="t2", **tokens[2]))
    early = graph.get("t2")
    listed = graph.roots()[0]
    assert early.parent_id is None
    graph.add_turn(TurnNode(node_id="t0", **tokens[0]))
    graph.add_turn(TurnNode(node_id="t1", **tokens[1]))
    assert early.parent_id == "t1" and listed.parent_id == "t1"
    assert graph.sequence_for("t2").node_ids == ["t0", "t1", "t2"]


def test_a_view_is_a_dataclass_that_replace_copy_and_pickle_turn_into_plain_nodes():
    graph = RolloutGraph()
    graph.add_turn(TurnNode(node_id="a", prompt_ids=[1], sampled_ids=[2], model="m"))
    view = graph.get("a")
    changed = dataclasses.replace(view, node_id="b")
    assert type(changed) is TurnNode and changed.node_id == "b" and changed.model == "m"
    assert dataclasses.asdict(view)["prompt_ids"] == [1]
    for clone in (copy.copy(view), copy.deepcopy(view), pickle.loads(pickle.dumps(view))):
        assert type(clone) is TurnNode and clone == view
    # a plain copy can be added again (under a new id)
    graph.add_turn(dataclasses.replace(view, node_id="c", parent_id=None))
    assert graph.get("c").prompt_ids == [1]


def test_equality_of_views_and_nodes():
    graph = RolloutGraph()
    node = TurnNode(node_id="a", prompt_ids=[1], sampled_ids=[2])
    returned = graph.add_turn(node)
    assert returned == node and graph.get("a") == returned and graph.get("a") == node
    assert graph.get("a") != TurnNode(node_id="a", prompt_ids=[1], sampled_ids=[3])
    assert "node_id='a'" in repr(graph.get("a"))


def listing_cost(graph: RolloutGraph) -> int:
    """Peak bytes allocated while listing every node and reading ids, indexes, parents."""
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    nodes = graph.nodes()
    seen = 0
    for n in nodes:
        # nothing kept but a count: only what the library allocates is measured
        seen += n.node_id is not None and n.index >= 0 and n.parent_id != n.node_id
    assert seen == len(graph)
    peak = tracemalloc.get_traced_memory()[1] - before
    del nodes
    return peak


@pytest.mark.parametrize("n_turns", [60, pytest.param(200, marks=pytest.mark.slow)])
def test_listing_nodes_allocates_per_turn_not_per_message(n_turns):
    """Multimodal turns (200 in the slow run): listing every node and reading ids, indexes
    and parents costs memory proportional to the turn count and well under 1% of what the
    graph retains."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        graph = multimodal_graph(n_turns)
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - base
        half = multimodal_graph(n_turns // 2)
        listing_cost(graph)  # warm caches (interned names, method caches)
        cost_full = listing_cost(graph)
        cost_half = listing_cost(half)
    finally:
        tracemalloc.stop()
    assert cost_full < 0.005 * retained, (cost_full, retained)
    # proportional to the turn count: twice the turns, about twice the bytes
    assert cost_full < 2.5 * cost_half + 4096, (cost_half, cost_full)
    # per view well under a kilobyte: never a message (a 16 KiB image) rebuilt
    assert cost_full / n_turns < 1024, cost_full / n_turns


def test_views_read_while_other_threads_add_turns():
    import threading

    graph = RolloutGraph()
    tokens = token_turns(60)
    errors: list[BaseException] = []
    done = threading.Event()

    def reader() -> None:
        try:
            while not done.is_set():
                for node in graph.nodes():
                    parent = node.parent_id
                    assert parent is None or parent in graph
                    assert (
                        node.prompt_ids is not None
                        and node.end_ids[: len(node.prompt_ids)] == node.prompt_ids
                    )
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for k in reversed(range(60)):  # every turn arrives before its ancestors: re-linking
        graph.add_turn(TurnNode(node_id=f"t{k}", **tokens[k]))
    done.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors[0]
    assert [graph.parent(f"t{k}") for k in range(60)] == [None] + [f"t{k}" for k in range(59)]

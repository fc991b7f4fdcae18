"""Graphs over one memory store share their short values and names through it, without
making them objects of the store."""

from __future__ import annotations

from rollout_store import MemoryStore, RolloutGraph, TurnNode


def _turn(session: str, model: str) -> TurnNode:
    return TurnNode(
        request_messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
        ],
        response_message={"role": "assistant", "content": "hello"},
        sampling_params={"temperature": 0.5, "max_tokens": 64},
        model="".join(list(model)),  # an object of its own each time
        finish_reason="".join(list("stop")),
        harness_session_id=session,
    )


def test_graphs_over_one_memory_store_share_names_and_small_values() -> None:
    store = MemoryStore()
    graphs = [RolloutGraph(store=store) for _ in range(3)]
    for i, graph in enumerate(graphs):
        graph.add_turn(_turn(f"s{i}", "m-1"))
    metas = [graph._turns[0].meta for graph in graphs]
    assert all(
        m.model is metas[0].model and m.finish_reason is metas[0].finish_reason for m in metas
    )
    assert all(m.system_digest is metas[0].system_digest for m in metas)
    assert [m.harness_session_id for m in metas] == ["s0", "s1", "s2"]
    samplings = [graph._turns[0].sampling for graph in graphs]
    assert samplings[0] is not None and all(s is samplings[0] for s in samplings)
    assert len(store) == 0  # no long string was stored: nothing shared became an object
    # what each graph exports is what it was given
    for i, graph in enumerate(graphs):
        node = graph.get("turn-0")
        assert node.model == "m-1" and node.harness_session_id == f"s{i}"
        assert graph.sampling_params("turn-0") == {"temperature": 0.5, "max_tokens": 64}


def test_private_graphs_share_nothing() -> None:
    graphs = [RolloutGraph() for _ in range(2)]
    for i, graph in enumerate(graphs):
        graph.add_turn(_turn(f"s{i}", "m-1"))
    a, b = (graph._turns[0] for graph in graphs)
    assert a.meta.model == b.meta.model and a.meta.model is not b.meta.model
    assert a.sampling == b.sampling and a.sampling is not b.sampling

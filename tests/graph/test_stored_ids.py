"""Adversarial checks of node ids kept in a turn's own bytes (HAS_IDENT) and of packed token
heads: what the graph accepted before must still be accepted, found and kept exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_store import DuplicateNodeError, RolloutGraph, TurnNode


class _Id(str):
    """A str subclass, as some callers' ids are (enum members, typed ids)."""


def test_a_str_subclass_node_id_is_kept_as_its_text_and_found(tmp_path: Path) -> None:
    graph = RolloutGraph()
    graph.add_turn(TurnNode(node_id=_Id("a"), request_messages=[]))
    assert graph.node_ids() == ["a"] and type(graph.node_ids()[0]) is str
    assert graph.get("a").node_id == "a"
    # the same id again, however spelled, is refused and changes nothing
    for again in (_Id("a"), "a"):
        with pytest.raises(DuplicateNodeError):
            graph.add_turn(TurnNode(node_id=again, request_messages=[]))
    assert len(graph) == 1
    graph.add_turn(TurnNode(node_id="b", parent_id="a", request_messages=[]))
    assert graph.parent("b") == "a"
    graph.save(tmp_path / "g.rls")
    loaded = RolloutGraph.load(tmp_path / "g.rls")
    assert loaded.node_ids() == ["a", "b"] and loaded.parent("b") == "a"

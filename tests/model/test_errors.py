"""What the library raises on purpose is in its error tree, and still the builtin kind
callers caught before (ValueError, TypeError, KeyError, AttributeError, OSError)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_store import (
    CorruptFileError,
    FileLockedError,
    InvalidArgumentError,
    ReadOnlyError,
    RolloutGraph,
    RolloutStoreError,
    TurnNode,
    UnknownNodeError,
)


def test_bad_arguments_are_invalid_argument_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="share_threshold"):
        RolloutGraph(share_threshold=0)
    graph = RolloutGraph()
    with pytest.raises(InvalidArgumentError, match="TurnNode"):
        graph.add_turn({"request_messages": []})  # type: ignore[arg-type]
    assert issubclass(InvalidArgumentError, RolloutStoreError)
    assert issubclass(InvalidArgumentError, TypeError)
    assert issubclass(InvalidArgumentError, ValueError)


def test_a_share_threshold_beyond_64_bits_is_an_invalid_argument(tmp_path: Path) -> None:
    """The engine counts string lengths in 64 bits: a larger threshold is refused by the
    library's own error (it was an OverflowError), the largest one shares nothing and its
    graph saves and loads."""
    for huge in (2**64, 2**100):
        with pytest.raises(InvalidArgumentError, match="below 2\\*\\*64"):
            RolloutGraph(share_threshold=huge)
    graph = RolloutGraph(share_threshold=2**64 - 1)
    graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "x" * 5000}]))
    assert graph.stats()["blobs"] == 0
    graph.save(tmp_path / "g.rls")
    assert RolloutGraph.load(tmp_path / "g.rls").share_threshold == 2**64 - 1


def test_a_bad_fsync_policy_is_an_invalid_argument(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="fsync"):
        RolloutGraph.open(tmp_path / "log.rls", fsync="sometimes")


def test_an_unknown_node_is_an_unknown_node_error() -> None:
    graph = RolloutGraph()
    graph.add_turn(TurnNode(node_id="a", request_messages=[{"role": "user", "content": "hi"}]))
    with pytest.raises(UnknownNodeError, match="nope"):
        graph.get("nope")
    with pytest.raises(KeyError):
        graph.parent("nope")


def test_a_view_is_read_only() -> None:
    graph = RolloutGraph()
    view = graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "hi"}]))
    with pytest.raises(ReadOnlyError):
        view.model = "m"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del view.model  # type: ignore[misc]


def test_a_held_lock_is_not_a_damaged_file(tmp_path: Path) -> None:
    path = tmp_path / "log.rls"
    with RolloutGraph.open(path), pytest.raises(FileLockedError) as info:
        RolloutGraph.open(path)
    assert not isinstance(info.value, CorruptFileError)
    assert isinstance(info.value, RolloutStoreError) and isinstance(info.value, OSError)

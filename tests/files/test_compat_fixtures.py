"""Files written by an earlier version (tests/data, made by tests/data/make_fixtures.py) load,
verify and export byte for byte, and keep doing so once saved again or appended to."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rollout_store import DirectoryStore, RolloutGraph, TurnNode, export_session
from rollout_store.files import storage

DATA = Path(__file__).resolve().parents[1] / "data"
FILES = ["v2_inline_snapshot.rls", "v2_store_snapshot.rls", "v2_append_log.rls"]


def _expected(graph: RolloutGraph) -> str:
    """What make_fixtures.py writes beside each file."""
    doc = export_session(graph, include_messages=True, include_discarded=True)
    turns = [graph.get(node_id) for node_id in graph.node_ids()]
    tokens = [[t.prompt_ids, t.sampled_ids, t.sampled_logprobs, t.parent_id] for t in turns]
    return json.dumps({"export": doc, "tokens": tokens})


def _store(tmp_path: Path, name: str) -> DirectoryStore | None:
    """A copy of the fixture's store (opening one creates its scratch folder)."""
    if "store" not in name:
        return None
    copy = tmp_path / "objects"
    shutil.copytree(DATA / "v2_store_objects", copy)
    return DirectoryStore(copy, fsync=False)


@pytest.mark.parametrize("name", FILES)
def test_fixture_loads_verifies_and_exports_byte_for_byte(tmp_path: Path, name: str) -> None:
    path, store = DATA / name, _store(tmp_path, name)
    want = (DATA / f"{name}.expected").read_text()
    assert storage.verify(path, store=store).ok
    loaded = RolloutGraph.load(path, store=store)
    assert loaded.load_report is not None and loaded.load_report.ok
    assert _expected(loaded) == want
    doc = json.loads(want)
    assert "\\ud800" in want and "NaN" in want and "-0.0" in want and str(2**70) in want
    assert [] in [t[1] for t in doc["tokens"]]  # a failed call: no sampled ids
    again = tmp_path / "again.rls"
    loaded.save(again)
    assert _expected(RolloutGraph.load(again)) == want


@pytest.mark.parametrize("name", FILES)
def test_a_fixture_recovers_whole(name: str, tmp_path: Path) -> None:
    """recover=True on an intact file keeps every turn, with nothing dropped."""
    store = _store(tmp_path, name)
    loaded = RolloutGraph.load(DATA / name, recover=True, store=store)
    assert _expected(loaded) == (DATA / f"{name}.expected").read_text()


def test_the_fixture_log_keeps_appending(tmp_path: Path) -> None:
    path = tmp_path / "log.rls"
    shutil.copyfile(DATA / "v2_append_log.rls", path)
    with RolloutGraph.open(path, share_threshold=16, fsync="never") as graph:
        n = len(graph)
        graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "more " * 9}]))
        want = _expected(graph)
    loaded = RolloutGraph.load(path)
    assert len(loaded) == n + 1 and _expected(loaded) == want
    assert storage.verify(path).ok

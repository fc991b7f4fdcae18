"""Every cut and flipped byte of a small file holding shared long strings, token turns, a
failed call, forks and a retry: load, verify and recover raise nothing but the library's
errors, verify accepts no file whose export differs, and recover keeps every turn written
before the damage, unaltered."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from rollout_store import RolloutGraph, RolloutStoreError, TurnNode, write_session_json
from rollout_store.files import storage

_LONG = "L" * 40


def _build(graph: RolloutGraph) -> None:
    system = {"role": "system", "content": "S" * 30}
    user = {"role": "user", "content": _LONG}
    answer = {"role": "assistant", "content": "ok"}
    tools = [{"name": "t", "description": _LONG}]
    turns = [
        TurnNode("m1", None, None, request_messages=[system, user], response_message=answer),
        TurnNode(
            "m2",
            None,
            None,
            request_messages=[system, user, answer, {"role": "user", "content": [1, 1.0, -0.0]}],
            response_message={"role": "assistant", "content": _LONG},
            request_tools=tools,
        ),
        TurnNode(  # a fork of m1's conversation
            "m3",
            None,
            None,
            request_messages=[system, user, answer, {"role": "user", "content": "\ud800"}],
            response_message={"role": "assistant", "content": float("nan")},
            request_tools=tools,
        ),
        TurnNode("t1", [1, 2, 3], [4, 5], [-0.5, -0.25], request_messages=[user]),
        TurnNode("t2", [1, 2, 3, 4, 5, 6], [], request_messages=[user]),  # a failed call
        TurnNode("t3", [1, 2, 3, 4, 5, 6], [7], [-1.0], request_messages=[user]),
        TurnNode("t4", [1, 2, 9], [2**70], request_messages=[user]),  # a fork by tokens
        TurnNode("t5", [1, 2, 3, 4, 5, 6], [7], [-1.0], request_messages=[user]),  # a retry
    ]
    for turn in turns:
        graph.add_turn(turn)


def _export(graph: RolloutGraph) -> str:
    out = io.StringIO()
    write_session_json(graph, out, include_messages=True, include_discarded=True)
    return out.getvalue()


def _turn(graph: RolloutGraph, node_id: str) -> str:
    node = graph.get(node_id)
    fields = [node.prompt_ids, node.sampled_ids, node.sampled_logprobs, node.request_messages]
    return json.dumps([*fields, node.response_message, node.request_tools, node.parent_id])


def _loaded(path: Path, recover: bool = False) -> RolloutGraph | None:
    try:
        return RolloutGraph.load(path, recover=recover)
    except RolloutStoreError:
        return None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["log", "snapshot"])
def test_every_cut_and_flip_of_a_small_file(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "g.rls"
    if mode == "log":
        with RolloutGraph.open(path, share_threshold=8) as graph:
            _build(graph)
    else:
        graph = RolloutGraph(share_threshold=8)
        _build(graph)
        graph.save(path)
    full = RolloutGraph.load(path)
    want, turns = _export(full), {n: _turn(full, n) for n in full.node_ids()}
    data = path.read_bytes()
    damaged = tmp_path / "d.rls"
    written_by: dict[str, int] = {}  # node id -> the shortest cut that holds it whole
    for cut in range(len(data) + 1):
        damaged.write_bytes(data[:cut])
        recovered = _loaded(damaged, recover=True)
        for node_id in recovered.node_ids() if recovered is not None else ():
            written_by.setdefault(node_id, cut)
            assert _turn(recovered, node_id) == turns[node_id], (cut, node_id)
    assert sorted(written_by) == sorted(turns)
    for pos in range(len(data)):
        changed = bytearray(data)
        changed[pos] ^= 0xFF if pos % 2 else 1 << (pos // 2 % 8)  # a byte, or one bit of it
        damaged.write_bytes(bytes(changed))
        report = storage.verify(damaged)  # never raises for damage
        loaded = _loaded(damaged)
        if report.ok or loaded is not None:
            assert report.ok and loaded is not None and _export(loaded) == want, pos
        recovered = _loaded(damaged, recover=True)
        kept = set(recovered.node_ids()) if recovered is not None else set()
        assert {n for n, end in written_by.items() if end <= pos} <= kept, pos
        for node_id in kept:
            assert recovered is not None and _turn(recovered, node_id) == turns[node_id]

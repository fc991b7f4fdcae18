"""Labels, annotations, rewards and group ids on a graph: checks, files, export and trace."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest

from rollout_store import (
    InvalidValueError,
    RolloutGraph,
    RolloutStoreError,
    TurnNode,
    UnknownNodeError,
    export_session,
    write_trace_jsonl,
)
from rollout_store.files.storage import verify

DATA = Path(__file__).resolve().parents[1] / "data"

ODD = {
    "s": [1, 1.0, True, -0.0, math.nan, math.inf, 2**100, "\ud800", (), {}, [], None],
    "k": {"z": 1, "a": 2},
}


def _turn(node_id: str, prompt: list[int], sampled: list[int], **kw: object) -> TurnNode:
    return TurnNode(
        request_messages=[{"role": "user", "content": node_id}],
        response_message={"role": "assistant", "content": node_id},
        prompt_ids=prompt,
        sampled_ids=sampled,
        sampled_logprobs=[-0.5] * len(sampled),
        node_id=node_id,
        **kw,  # type: ignore[arg-type]
    )


def _graph() -> RolloutGraph:
    graph = RolloutGraph()
    graph.add_turn(_turn("a", [1, 2, 3], [4, 5]))
    graph.add_turn(_turn("b", [1, 2, 3, 4, 5, 6], [7]))
    graph.add_turn(_turn("c", [1, 2, 3, 4, 5, 8], [9], finish_reason="length"))
    return graph


def _fill(graph: RolloutGraph) -> None:
    graph.add_labels("math", "hard", "math")
    graph.annotate(judge=ODD, note="x")
    graph.annotate({"note": "replaced", "with space": []})
    graph.set_reward(0.25)
    graph.set_reward(1, leaf="b")
    graph.set_group("grp-1")


def _same_meta(a: RolloutGraph, b: RolloutGraph) -> None:
    assert a.labels == b.labels
    assert json.dumps(a.annotations) == json.dumps(b.annotations)
    assert a.reward == b.reward and a.rewards == b.rewards and a.group == b.group
    assert a.meta == b.meta


def test_metadata_api_and_byte_identical_annotations() -> None:
    graph = _graph()
    _fill(graph)
    assert graph.labels == ["math", "hard"]
    assert list(graph.annotations) == ["judge", "note", "with space"]
    assert json.dumps(graph.annotations["judge"]) == json.dumps(ODD)
    assert graph.annotations["note"] == "replaced"
    assert graph.reward == 0.25 and graph.rewards == {"b": 1} and graph.group == "grp-1"
    assert graph.reward_for("b") == 1 and graph.reward_for("c") == 0.25
    graph.annotations["judge"]["k"]["z"] = 99  # a fresh copy each read
    assert graph.annotations["judge"]["k"]["z"] == 1
    graph.set_reward(None, leaf="b")
    assert graph.rewards == {} and graph.reward_for("b") == 0.25
    graph.set_labels(["only"])
    graph.remove_annotations("note")
    assert graph.labels == ["only"] and "note" not in graph.annotations


@pytest.mark.parametrize(
    ("call", "path"),
    [
        (lambda g: g.annotate(bad={"x": [1, {2, 3}]}), "annotations['bad'].x[1]"),
        (lambda g: g.set_reward(math.nan), "reward"),
        (lambda g: g.set_reward(True), "reward"),
        (lambda g: g.set_reward("1", leaf="a"), "rewards['a']"),
        (lambda g: g.set_reward(2**70), "reward"),
        (lambda g: g.add_labels("ok", 3), "labels[1]"),
        (lambda g: g.add_labels(""), "labels[0]"),
        (lambda g: g.set_group(""), "group"),
        (lambda g: g.update_metadata(labels=["new"], annotations={"k": object()}), "annotations"),
    ],
)
def test_bad_metadata_names_the_value_and_changes_nothing(call, path, tmp_path: Path) -> None:
    log = tmp_path / "g.rls"
    with RolloutGraph.open(log) as graph:
        graph.add_turn(_turn("a", [1, 2], [3]))
        _fill_simple(graph)
        before, size = graph.meta, log.stat().st_size
        with pytest.raises(InvalidValueError) as info:
            call(graph)
        assert info.value.path.startswith(path)
        assert graph.meta == before and log.stat().st_size == size
    _same_meta(RolloutGraph.load(log), graph)


def _fill_simple(graph: RolloutGraph) -> None:
    graph.add_labels("x")
    graph.annotate(k=1)
    graph.set_reward(0.5)


def test_reward_for_an_unknown_turn_is_refused() -> None:
    graph = _graph()
    with pytest.raises(UnknownNodeError, match="'zz'"):
        graph.set_reward(1.0, leaf="zz")
    with pytest.raises(UnknownNodeError):
        graph.update_metadata(reward=1.0, rewards={"zz": 1.0})
    assert graph.meta.empty


def test_snapshot_and_log_round_trip(tmp_path: Path) -> None:
    graph = _graph()
    _fill(graph)
    graph.save(tmp_path / "s.rls")
    loaded = RolloutGraph.load(tmp_path / "s.rls")
    _same_meta(loaded, graph)
    assert verify(tmp_path / "s.rls").ok
    log = tmp_path / "l.rls"
    with RolloutGraph.open(log) as appending:
        for node_id in graph.node_ids():
            node = graph.get(node_id)
            appending.add_turn(_turn(node_id, node.prompt_ids, node.sampled_ids))
        _fill(appending)
    with RolloutGraph.open(log) as reopened:  # the last meta record wins
        _same_meta(reopened, graph)
        reopened.set_reward(-3, leaf="c")
        reopened.add_labels("later")
    final = RolloutGraph.load(log)
    assert final.rewards == {"b": 1, "c": -3} and final.labels == ["math", "hard", "later"]
    assert verify(log).ok
    final.save(tmp_path / "again.rls")
    _same_meta(RolloutGraph.load(tmp_path / "again.rls"), final)


def test_a_graph_without_metadata_writes_the_same_records(tmp_path: Path) -> None:
    graph = _graph()
    graph.save(tmp_path / "plain.rls")
    data = (tmp_path / "plain.rls").read_bytes()
    assert b"annotations" not in data  # no meta record
    graph.set_reward(1.0)
    graph.save(tmp_path / "meta.rls")
    assert b"annotations" in (tmp_path / "meta.rls").read_bytes()


@pytest.mark.parametrize("name", ["v1_log.rls", "v1_snapshot.rls", "v2_log.rls", "v2_snapshot.rls"])
def test_old_fixtures_read_with_no_metadata(name: str) -> None:
    graph = RolloutGraph.load(DATA / name)
    assert graph.meta.empty and graph.labels == [] and graph.annotations == {}
    assert graph.reward is None and graph.group is None and graph.drift() == []
    doc = export_session(graph)
    assert not {"labels", "annotations", "reward", "rewards", "group", "drift"} & set(doc)


def test_a_version_1_log_refuses_metadata(tmp_path: Path) -> None:
    log = tmp_path / "v1.rls"
    log.write_bytes((DATA / "v1_log.rls").read_bytes())
    with RolloutGraph.open(log) as graph:
        size = log.stat().st_size
        with pytest.raises(RolloutStoreError, match="version-1 log"):
            graph.set_reward(1.0)
        assert graph.meta.empty and log.stat().st_size == size


def test_a_damaged_meta_record_is_refused(tmp_path: Path) -> None:
    graph = _graph()
    graph.set_reward(1.0, leaf="b")
    graph.save(tmp_path / "s.rls")
    data = (tmp_path / "s.rls").read_bytes()
    at = data.index(b"rewards")
    damaged = data[:at] + b"rewardX" + data[at + 7 :]
    (tmp_path / "d.rls").write_bytes(damaged)
    assert not verify(tmp_path / "d.rls").ok


def test_export_and_trace_carry_metadata() -> None:
    graph = _graph()
    _fill(graph)
    doc = export_session(graph)
    assert doc["group"] == "grp-1" and doc["labels"] == ["math", "hard"]
    assert json.dumps(doc["annotations"]["judge"]) == json.dumps(ODD)
    assert doc["reward"] == 0.25 and doc["rewards"] == {"b": 1}
    assert {row["node_ids"][-1]: row["reward"] for row in doc["sequences"]} == {"b": 1, "c": 0.25}
    out = io.StringIO()
    write_trace_jsonl(graph, out)
    lines = out.getvalue().splitlines()
    assert len(lines) == len(graph) + 1
    assert json.loads(lines[1])["reward"] == 1  # the leaf rewarded on its own
    trailer = json.loads(lines[-1])["graph"]
    assert trailer["labels"] == ["math", "hard"] and trailer["reward"] == 0.25


def test_streamed_document_equals_the_dict_with_metadata() -> None:
    from rollout_store import write_session_json

    graph = _graph()
    _fill(graph)
    out = io.StringIO()
    write_session_json(graph, out, include_messages=True)
    assert out.getvalue() == json.dumps(export_session(graph, include_messages=True))


def _drifting(graph: RolloutGraph) -> None:
    """Three calls whose messages continue each other but whose ids drop the thinking (50),
    then labels, annotations, rewards and a group."""
    messages: list = [{"role": "user", "content": "q"}]
    prompt = [1, 2, 3]
    for k in range(3):
        answer = {"role": "assistant", "content": f"a{k}"}
        graph.add_turn(
            TurnNode(
                request_messages=list(messages),
                response_message=answer,
                prompt_ids=prompt,
                sampled_ids=[50, 60 + k],
                sampled_logprobs=[-0.5, -0.25],
                node_id=f"d{k}",
            )
        )
        messages += [answer, {"role": "user", "content": f"q{k}"}]
        prompt = [*prompt, 60 + k, 7]
        if k == 1:
            graph.add_labels("x")
            graph.annotate(k={"v": [1.0, -0.0, "\ud800"]})
    graph.set_reward(2, leaf="d2")
    graph.set_group("g")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["log", "snapshot"])
def test_every_cut_and_flip_of_a_file_with_metadata_and_drift(tmp_path: Path, mode: str) -> None:
    from rollout_store import write_session_json

    def export(graph: RolloutGraph) -> str:
        out = io.StringIO()
        write_session_json(graph, out)
        return out.getvalue()

    def loaded(path: Path, recover: bool = False) -> RolloutGraph | None:
        try:
            return RolloutGraph.load(path, recover=recover)
        except RolloutStoreError:
            return None

    path = tmp_path / "g.rls"
    if mode == "log":
        with RolloutGraph.open(path) as graph:
            _drifting(graph)
    else:
        graph = RolloutGraph()
        _drifting(graph)
        graph.save(path)
    full = RolloutGraph.load(path)
    assert len(full.drift()) == 2 and full.group == "g"
    want = export(full)
    data = path.read_bytes()
    damaged = tmp_path / "d.rls"
    for cut in range(len(data) + 1):
        damaged.write_bytes(data[:cut])
        recovered = loaded(damaged, recover=True)
        if recovered is not None:  # what was kept is what was written, drift included
            kept = {d["node_id"] for d in recovered.drift()}
            assert kept == {d["node_id"] for d in full.drift()} & set(recovered.node_ids())
    for pos in range(len(data)):
        changed = bytearray(data)
        changed[pos] ^= 0xFF if pos % 2 else 1 << (pos // 2 % 8)
        damaged.write_bytes(bytes(changed))
        report = verify(damaged)
        graph_read = loaded(damaged)
        if report.ok or graph_read is not None:
            assert report.ok and graph_read is not None and export(graph_read) == want, pos
        loaded(damaged, recover=True)  # only the library's errors

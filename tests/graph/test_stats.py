"""stats(): what content-addressing saved (`blob_bytes_sent`, `blob_bytes_saved`), counted as
turns arrive and derived again when a file is read, against the long strings each turn sent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support import add_all, chat_turns, fresh, image_url, materialized

from rollout_store import DirectoryStore, RawJSON, RolloutGraph, TurnNode
from rollout_store import graph as graph_module

DATA = Path(__file__).resolve().parents[1] / "data"

#: The fields of a turn that may hold long strings (what it sent and what it got back).
FIELDS = (
    "request_messages",
    "response_message",
    "request_tools",
    "sampling_params",
    "requested_sampling_params",
    "sampled_logprobs",
)


def long_bytes(value: Any, threshold: int) -> int:
    """UTF-8 bytes of the strings of at least `threshold` characters in a JSON value."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass")) if len(value) >= threshold else 0
    if isinstance(value, dict):
        return sum(long_bytes(v, threshold) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(long_bytes(v, threshold) for v in value)
    return 0


def sent(turns: list[dict[str, Any]], threshold: int = 1024) -> int:
    """Long-string bytes of every field of every turn, each request whole."""
    return sum(long_bytes(t.get(name), threshold) for t in turns for name in FIELDS)


def unique(turns: list[dict[str, Any]], threshold: int = 1024) -> int:
    """Bytes of the distinct long strings the turns hold (what a content-addressed store keeps)."""
    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, str) and len(value) >= threshold:
            found.add(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v)

    for t in turns:
        for name in FIELDS:
            walk(t.get(name))
    return sum(len(s.encode("utf-8", "surrogatepass")) for s in found)


def figures(graph: RolloutGraph) -> tuple[int, int, int]:
    stats = graph.stats()
    return stats["blob_bytes_sent"], stats["blob_bytes"], stats["blob_bytes_saved"]


def test_an_image_resent_by_each_of_20_turns_saves_19_copies() -> None:
    """The image opens the conversation, so every turn's request sends it once more."""
    image = image_url(1)
    turns = chat_turns(20, images=[image])
    graph = RolloutGraph()
    add_all(graph, turns)
    size = len(image.encode())
    assert sent(turns) == 20 * size  # what the requests sent, counted from them
    assert graph.stats()["blob_bytes_saved"] == 19 * size
    assert figures(graph) == (20 * size, size, 19 * size)


def test_an_image_attached_anew_each_turn_counts_every_copy_resent() -> None:
    """Each turn attaches the same image again: turn k's request holds k copies."""
    image = image_url(2)
    turns = chat_turns(20, images=[image] * 20)
    graph = RolloutGraph()
    add_all(graph, turns)
    size = len(image.encode())
    assert sent(turns) == 210 * size
    assert figures(graph) == (210 * size, size, 209 * size)


def test_long_answers_echoed_system_and_tools_are_counted_in_every_turn() -> None:
    """Long questions and answers (each answer re-sent as the next request's history), a long
    system prompt and a long tool description, all sent by every turn."""
    system = "Rules. " + "s" * 3000
    tools = [{"type": "function", "function": {"name": "f", "description": "é" * 2000}}]
    turns = chat_turns(12, system=system, pad=1500)
    for k, turn in enumerate(turns):
        turn["request_tools"] = fresh(tools)
        turn["sampling_params"] = {"temperature": 0.5, "stop": ["x" * 1100]}
        if k % 3 == 2:  # a turn whose response holds no long string
            turn["response_message"] = {"role": "assistant", "content": f"short {k}"}
            if k + 1 < len(turns):  # what the next turns re-send of it
                for later in turns[k + 1 :]:
                    later["request_messages"][2 * k + 2] = fresh(turn["response_message"])
    graph = RolloutGraph()
    add_all(graph, turns)
    want_sent, want_unique = sent(turns), unique(turns)
    assert figures(graph) == (want_sent, want_unique, want_sent - want_unique)
    assert want_sent > 5 * want_unique  # (the rollout re-sends a lot)


def test_a_graph_without_repeats_saves_nothing() -> None:
    graph = RolloutGraph()
    turns = []
    for k in range(5):  # unrelated calls, each string long and its own
        turns.append(
            {
                "request_messages": [{"role": "user", "content": f"{k} " + "q" * (2000 + k)}],
                "response_message": {"role": "assistant", "content": f"{k} " + "a" * 3000},
            }
        )
    add_all(graph, turns)
    want = sent(turns)
    assert want == unique(turns) > 0
    assert figures(graph) == (want, want, 0)


def test_a_smaller_share_threshold_counts_the_strings_it_shares() -> None:
    turns = chat_turns(8, pad=40)  # questions and answers of about 60 characters
    graph = RolloutGraph(share_threshold=32)
    add_all(graph, turns)
    want_sent, want_unique = sent(turns, 32), unique(turns, 32)
    assert want_sent > want_unique > 0
    assert figures(graph) == (want_sent, want_unique, want_sent - want_unique)


def _rollout() -> list[dict[str, Any]]:
    turns = chat_turns(10, images=[image_url(3), None, image_url(4)], pad=1200)  # type: ignore[list-item]
    for turn in turns:
        turn["request_tools"] = [{"name": "t", "description": "d" * 1500}]
    return turns


def _retry_and_fork(graph: RolloutGraph, turns: list[dict[str, Any]]) -> None:
    """A retry of turn 4 (same request, another long answer) and a branch from turn 6."""
    retry = dict(turns[4], response_message={"role": "assistant", "content": "r" * 2500})
    graph.add_turn(TurnNode(node_id="retry", **fresh(retry)))
    branch = fresh(turns[6])
    branch["request_messages"].append({"role": "user", "content": "b" * 1800})
    graph.add_turn(TurnNode(node_id="branch", **branch))


@pytest.mark.parametrize("how", ["snapshot", "snapshot of references", "log"])
def test_a_graph_read_back_reports_what_its_writer_did(tmp_path: Path, how: str) -> None:
    turns = _rollout()
    path = tmp_path / "r.rls"
    store = DirectoryStore(tmp_path / "store") if how == "snapshot of references" else None
    if how == "log":
        with RolloutGraph.open(path) as graph:
            add_all(graph, turns)
            _retry_and_fork(graph, turns)
            written = graph.stats()
    else:
        graph = RolloutGraph(store=store)
        add_all(graph, turns)
        _retry_and_fork(graph, turns)
        written = graph.stats()
        graph.save(path, blobs="store" if store is not None else "inline")
    recorded = [materialized(graph, n) for n in graph.node_ids()]
    assert written["blob_bytes_sent"] == sent(recorded)
    assert written["blob_bytes_saved"] == sent(recorded) - unique(recorded) > 0
    loaded = RolloutGraph.load(path, store=store)
    read = loaded.stats()
    for key in ("blob_bytes_sent", "blob_bytes", "blob_bytes_saved"):
        assert read[key] == written[key], key


def test_a_graph_over_a_store_counts_as_one_in_memory(tmp_path: Path) -> None:
    """Over a directory store each turn's tail and response are kept there: the figure is
    worked out before, so it is the in-memory graph's."""
    turns = _rollout()
    kept = RolloutGraph(store=DirectoryStore(tmp_path / "store"))
    plain = RolloutGraph()
    for graph in (kept, plain):
        add_all(graph, turns)
        _retry_and_fork(graph, turns)
    assert figures(kept) == figures(plain)
    assert figures(plain)[2] > 0


@pytest.mark.parametrize("name", ["v1_snapshot.rls", "v1_log.rls", "v2_snapshot.rls", "v2_log.rls"])
def test_files_of_earlier_versions_report_what_their_turns_sent(name: str) -> None:
    graph = RolloutGraph.load(DATA / name)
    threshold = graph.share_threshold
    assert threshold is not None
    recorded = [materialized(graph, n) for n in graph.node_ids()]
    want_sent, want_unique = sent(recorded, threshold), unique(recorded, threshold)
    assert want_sent > want_unique
    assert figures(graph) == (want_sent, want_unique, want_sent - want_unique)


def test_a_rejected_turn_leaves_the_figures_as_they_were() -> None:
    graph = RolloutGraph()
    turns = chat_turns(3, images=[image_url(5)])
    add_all(graph, turns)
    before = figures(graph)
    bad = fresh(turns[-1])
    bad["request_messages"].append({"role": "user", "content": "n" * 5000})
    bad["response_message"] = {"bad": {1, 2}}  # a set is no JSON value
    with pytest.raises(TypeError):
        graph.add_turn(TurnNode(**bad))
    assert figures(graph) == before


@pytest.mark.parametrize("tools", [None, [{"name": "t", "description": "d" * 1500}]])
def test_raw_json_texts_count_as_the_values_they_encode(tools: Any) -> None:
    """The capture server hands each request over as its JSON text: a continuation is taken
    without decoding what it re-sends, and counted alike."""
    turns = chat_turns(15, images=[image_url(6), None, image_url(7)], pad=1100)
    decoded, raw = RolloutGraph(), RolloutGraph()
    for k, turn in enumerate(turns):
        decoded.add_turn(TurnNode(node_id=f"t{k}", request_tools=fresh(tools), **fresh(turn)))
        raw.add_turn(
            TurnNode(
                node_id=f"t{k}",
                request_messages=RawJSON(json.dumps(turn["request_messages"]).encode()),
                response_message=RawJSON(json.dumps(turn["response_message"]).encode()),
                request_tools=None if tools is None else RawJSON(json.dumps(tools).encode()),
            )
        )
    for turn in turns:
        turn["request_tools"] = tools
    want_sent, want_unique = sent(turns), unique(turns)
    assert figures(raw) == figures(decoded) == (want_sent, want_unique, want_sent - want_unique)


def test_a_long_answer_not_resent_is_not_counted_in_later_requests() -> None:
    """A harness that drops the previous answer (or rewrites it) re-sends the rest only."""
    graph = RolloutGraph()
    question = {"role": "user", "content": "q" * 2000}
    turns = []
    history: list[Any] = [question]
    for k in range(6):
        history.append({"role": "user", "content": f"step {k}"})
        answer = {"role": "assistant", "content": f"{k}" + "a" * 1500}
        turns.append({"request_messages": fresh(history), "response_message": answer})
        history.append({"role": "assistant", "content": f"summary of {k}"})  # not the answer
    add_all(graph, turns)
    want_sent = sent(turns)
    assert want_sent == 6 * 2000 + 6 * 1501
    assert figures(graph) == (want_sent, 2000 + 6 * 1501, 5 * 2000)


def test_figures_too_large_for_a_turns_entry_are_kept_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A turn's entry packs two figures into 64 bits; a response or request beyond its fields
    (16 MiB of long strings in a response) is kept apart, counted alike. Shown with the
    response's field narrowed to 4 bits."""
    turns = _rollout()
    whole = RolloutGraph()
    add_all(whole, turns)
    _retry_and_fork(whole, turns)
    want = figures(whole)
    monkeypatch.setattr(graph_module, "_SENT_SHIFT", 4)
    monkeypatch.setattr(graph_module, "_SENT_LOW", (1 << 4) - 1)
    narrow = RolloutGraph()
    add_all(narrow, turns)
    _retry_and_fork(narrow, turns)
    assert narrow._sent_apart  # (most turns: their responses hold long strings)
    assert figures(narrow) == want
    assert want[2] > 0


def _recovered_past_damage(path: Path, how: str) -> tuple[RolloutGraph, list[dict[str, Any]]]:
    """A graph of three turns written to `path` (as a snapshot or a log) whose first turn's
    record is then damaged, its long string (a blob frame before it) not, read back with
    `load(recover=True)`; and the turns as added."""
    turns = [
        {
            "request_messages": [{"role": "user", "content": f"{i}" * (8000 if i == 0 else 3000)}],
            "response_message": {"role": "assistant", "content": f"lost-or-kept-{i}"},
        }
        for i in range(3)
    ]
    turns[2]["request_messages"].append({"role": "user", "content": "2" * 3000})  # again
    if how == "log":
        with RolloutGraph.open(path) as graph:
            for i, turn in enumerate(turns):
                graph.add_turn(TurnNode(node_id=f"turn-id-{i}", **fresh(turn)))
    else:
        graph = RolloutGraph()
        for i, turn in enumerate(turns):
            graph.add_turn(TurnNode(node_id=f"turn-id-{i}", **fresh(turn)))
        graph.save(path)
    data = bytearray(path.read_bytes())
    at = data.index(b"turn-id-0")
    assert data.index(b"0" * 8000) < at  # its string comes before its record
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    kept = RolloutGraph.load(path, recover=True)
    assert kept.node_ids() == ["turn-id-1", "turn-id-2"]
    return kept, turns


@pytest.mark.parametrize("how", ["snapshot", "log"])
def test_a_graph_recovered_past_damage_counts_only_the_strings_its_turns_refer_to(
    tmp_path: Path, how: str
) -> None:
    """The first turn's record is damaged, its long string (a blob frame before it) is not:
    the recovered graph still holds that string, which no turn kept refers to. What the
    kept turns sent, less one copy of each string they refer to, is what was saved."""
    kept, turns = _recovered_past_damage(tmp_path / "r.rls", how)
    recorded = [materialized(kept, n) for n in kept.node_ids()]
    stats = kept.stats()
    assert stats["blob_bytes"] == unique(turns)  # the lost turn's string is still held
    assert stats["blob_bytes_sent"] == sent(recorded)
    assert stats["blob_bytes_saved"] == sent(recorded) - unique(recorded) == 3000
    assert stats["blob_bytes"] > stats["blob_bytes_sent"]  # (what made it negative)


@pytest.mark.parametrize("how", ["snapshot", "log"])
def test_the_blob_table_of_a_graph_recovered_past_damage_subtracts_only_the_strings_referred_to(
    tmp_path: Path, how: str
) -> None:
    """The blob table's own `blob_bytes_saved` (its references' bytes less one copy of each
    string referred to) leaves out the string only the lost turn used, as the graph's does:
    the kept turns refer to "1" * 3000 once and "2" * 3000 twice, 3000 bytes saved. A
    damaged snapshot's references are not all known (its end record's counts are of the
    turns written): never more is counted saved, nor less than nothing."""
    kept, turns = _recovered_past_damage(tmp_path / "r.rls", how)
    table = kept.blobs.stats()
    assert table["blob_bytes"] == unique(turns) == 14000
    if how == "log":
        assert table["blob_references"] == 3
        assert table["blob_bytes_saved"] == 3000
    else:
        assert 0 <= table["blob_bytes_saved"] <= 3000

"""The drift audit: turns whose messages continue a stored turn but whose token ids do not."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from rollout_store import RolloutGraph, TurnNode, export_session, write_trace_jsonl
from rollout_store.cli import main
from rollout_store.files.storage import verify
from rollout_store.viewer.app import Viewer

GEN, GEN_AGAIN, THINK = 900, 901, 950


def _render(messages: list[dict[str, str]], history_gen: int = GEN) -> list[int]:
    """A toy chat template: a user message is a role token and its text's characters; an
    assistant message the generation prompt (`history_gen`) and its text; then the
    generation prompt the model answers after."""
    out = [1]
    for m in messages:
        role = 2 if m["role"] == "user" else history_gen
        out += [role, *(ord(c) for c in m["content"])]
    return [*out, GEN]


def _conversation(turns: int, drift: str) -> RolloutGraph:
    """`turns` calls whose messages extend each other exactly. `drift` says how the token ids
    of the next call render the history: "none" (they extend), "generation" (earlier
    answers' generation prompt is rendered differently: inside the earlier call's prompt),
    "thinking" (the earlier answer's thinking is stripped: inside its sampled tokens)."""
    graph = RolloutGraph()
    messages: list[dict[str, str]] = []
    for k in range(turns):
        messages.append({"role": "user", "content": f"q{k}"})
        prompt = _render(messages, GEN_AGAIN if drift == "generation" else GEN)
        answer = {"role": "assistant", "content": f"a{k}"}
        sampled = [ord(c) for c in answer["content"]]
        if drift == "thinking":
            sampled = [THINK, 7, *sampled]
        graph.add_turn(
            TurnNode(
                request_messages=list(messages),
                response_message=answer,
                prompt_ids=prompt,
                sampled_ids=sampled,
                sampled_logprobs=[-0.5] * len(sampled),
                node_id=f"t{k}",
            )
        )
        messages.append(answer)
    return graph


def test_no_drift_when_tokens_extend() -> None:
    graph = _conversation(5, "none")
    assert graph.stats()["n_roots"] == 1 and graph.stats()["n_drift"] == 0
    assert graph.drift() == []


def test_stripped_thinking_is_recorded_in_the_response() -> None:
    graph = _conversation(30, "thinking")
    stats = graph.stats()
    assert stats["n_roots"] == 30 and stats["n_drift"] == 29  # linking unchanged: all roots
    drift = graph.drift()
    assert [d["node_id"] for d in drift] == [f"t{k}" for k in range(1, 30)]
    for k, d in enumerate(drift, start=1):
        parent = graph.get(f"t{k - 1}")
        assert d["would_be_parent"] == f"t{k - 1}"
        assert d["offset"] == len(parent.prompt_ids)  # the thinking token is gone
        assert d["region"] == "response" and d["message_index"] == 2 * k - 1
        assert d["parent_messages"] == 2 * k - 1
        assert d["parent_tokens"] == len(parent.prompt_ids) + len(parent.sampled_ids)


def test_a_rendered_generation_prompt_is_recorded_in_the_prompt() -> None:
    graph = _conversation(6, "generation")
    drift = graph.drift()
    assert len(drift) == 5
    for d in drift:
        parent = graph.get(d["would_be_parent"])
        assert d["region"] == "prompt" and d["message_index"] is None
        assert d["offset"] == len(parent.prompt_ids) - 1  # its trailing GEN became GEN_AGAIN


def test_drift_shows_in_export_trace_viewer_and_info(tmp_path: Path, capsys) -> None:
    graph = _conversation(4, "thinking")
    doc = export_session(graph)
    assert any(f.startswith("[WARN] token_drift") and "3 turn" in f for f in doc["validation"])
    assert [d["node_id"] for d in doc["drift"]] == ["t1", "t2", "t3"]
    out = io.StringIO()
    write_trace_jsonl(graph, out)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert "drift" not in records[0] and records[1]["drift"]["would_be_parent"] == "t0"
    viewer = Viewer(graph)
    assert json.loads(viewer.respond("/api/figures").body)["drift"] == 3
    rows = json.loads(viewer.respond("/api/rows").body)["rows"]
    assert [r["drift"]["offset"] if r["drift"] else None for r in rows][:2] == [
        None,
        graph.drift()[0]["offset"],
    ]
    assert json.loads(viewer.respond("/api/turn", "id=t2").body)["drift"]["node_id"] == "t2"
    graph.save(tmp_path / "g.rls")
    assert main(["info", str(tmp_path / "g.rls")]) == 0
    info = capsys.readouterr().out
    assert "token drift (roots)" in info and "3: first t1 leaves t0" in info


@pytest.mark.parametrize("kind", ["snapshot", "log"])
def test_drift_is_kept_in_files(tmp_path: Path, kind: str) -> None:
    graph = _conversation(5, "thinking")
    path = tmp_path / "g.rls"
    if kind == "snapshot":
        graph.save(path)
    else:
        with RolloutGraph.open(path) as appending:
            for node_id in graph.node_ids():
                node = graph.get(node_id)
                appending.add_turn(
                    TurnNode(
                        request_messages=node.request_messages,
                        response_message=node.response_message,
                        prompt_ids=node.prompt_ids,
                        sampled_ids=node.sampled_ids,
                        sampled_logprobs=node.sampled_logprobs,
                        node_id=node_id,
                    )
                )
    loaded = RolloutGraph.load(path)
    assert loaded.drift() == graph.drift() and loaded.stats() == graph.stats()
    assert verify(path).ok
    # a log cut inside the last turn's frames loses that turn and its drift record together
    data = path.read_bytes()
    if kind == "log":
        path.write_bytes(data[:-5])
        cut = RolloutGraph.load(path, recover=True)
        assert len(cut) == 4 and cut.drift() == graph.drift()[:3]

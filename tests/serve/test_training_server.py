"""The capture server's training routes: sessions in a group with labels, PATCH to annotate
and reward, GET /groups/{id}, and training rows per session and per group."""

from __future__ import annotations

import errno
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from capture_support import ADMIN, ADMIN_KEY, new_session, serve_app

from rollout_store import RolloutGraph, token_samples, tree_samples
from rollout_store.errors import FileWriteError, StoreUnavailableError
from rollout_store.serve import server as server_module
from rollout_store.serve.server import create_app


@pytest.fixture
def server(stub: str, tmp_path: Path) -> Iterator[tuple[str, Any]]:
    app = create_app(stub, data=tmp_path / "data", upstream_timeout=5, admin_key=ADMIN_KEY)
    with serve_app(app) as url:
        yield url, app


def _call(session: dict[str, Any], text: str) -> None:
    client = openai.OpenAI(
        base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
    )
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}])


def _graph(app: Any, session_id: str) -> RolloutGraph:
    graph: RolloutGraph = app.state.sessions.get(session_id).graph
    return graph


def test_group_labels_patch_and_rows(server: tuple[str, Any], tmp_path: Path) -> None:
    url, app = server
    made = [
        new_session(url, session_id=f"r{i}", group="grpo-1", labels=["math", f"k{i}"])
        for i in range(3)
    ]
    new_session(url, session_id="other")
    for i, session in enumerate(made):
        _call(session, "the shared question")
        _call(session, f"follow-up {i}")
    graph = _graph(app, "r0")
    assert graph.group == "grpo-1" and graph.labels == ["math", "k0"]
    leaf = graph.leaf_ids()[0]

    patch = {"annotations": {"judge": {"score": [1, 1.0, None]}}, "reward": 0.5}
    patch["rewards"] = {leaf: 2}
    answer = httpx.patch(f"{url}/sessions/r0", headers=ADMIN, json=patch)
    assert answer.status_code == 200, answer.text
    assert answer.json()["rewards"] == {leaf: 2} and answer.json()["reward"] == 0.5
    assert json.dumps(graph.annotations) == json.dumps({"judge": {"score": [1, 1.0, None]}})

    before = graph.meta
    for bad, word in (
        ({"reward": "high"}, "reward"),
        ({"rewards": {"nope": 1}}, "nope"),
        ({"labels": ["ok", 3]}, "labels[1]"),
        ({"annotate": {}}, "unknown field"),
        ({"group": "../x"}, "group"),
    ):
        refused = httpx.patch(f"{url}/sessions/r0", headers=ADMIN, json=bad)
        assert refused.status_code == 400 and word in refused.json()["error"], bad
        assert graph.meta == before  # all or nothing
    assert httpx.patch(f"{url}/sessions/missing", headers=ADMIN, json={}).status_code == 404

    group = httpx.get(f"{url}/groups/grpo-1", headers=ADMIN).json()
    assert [s["session_id"] for s in group["sessions"]] == ["r0", "r1", "r2"]
    assert all(s["group"] == "grpo-1" for s in group["sessions"])
    assert httpx.get(f"{url}/groups/none", headers=ADMIN).status_code == 404

    lines = httpx.get(f"{url}/sessions/r0/samples", headers=ADMIN).text.splitlines()
    assert [json.loads(line) for line in lines] == json.loads(json.dumps(token_samples(graph)))
    (forest,) = [
        json.loads(x)
        for x in httpx.get(
            f"{url}/groups/grpo-1/samples?format=tree", headers=ADMIN
        ).text.splitlines()
    ]
    graphs = [_graph(app, f"r{i}") for i in range(3)]
    assert forest == json.loads(json.dumps(tree_samples(graphs)[0]))
    assert forest["n_graphs"] == 3 and forest["group"] == "grpo-1"

    import pyarrow.parquet as pq

    raw = httpx.get(
        f"{url}/sessions/r1/samples", headers=ADMIN, params={"format": "tree", "output": "parquet"}
    )
    assert raw.status_code == 200
    table = pq.read_table(io.BytesIO(raw.content)).to_pylist()
    assert [row["input_ids"] for row in table] == [
        row["input_ids"] for row in tree_samples(_graph(app, "r1"))
    ]
    for query, word in (({"format": "forest"}, "path, tree"), ({"output": "csv"}, "jsonl")):
        refused = httpx.get(f"{url}/sessions/r1/samples", headers=ADMIN, params=query)
        assert refused.status_code == 400 and word in refused.json()["error"]


def test_group_and_metadata_survive_a_restart(stub: str, tmp_path: Path) -> None:
    data = tmp_path / "data"
    with serve_app(create_app(stub, data=data, upstream_timeout=5, admin_key=ADMIN_KEY)) as url:
        session = new_session(url, session_id="s", group="g", labels=["a"])
        _call(session, "q")
        assert (
            httpx.patch(
                f"{url}/sessions/s", headers=ADMIN, json={"reward": 1, "group": "g2"}
            ).status_code
            == 200
        )
        refused = httpx.post(f"{url}/sessions", json={"session_id": "t", "labels": "a"})
        assert refused.status_code == 400
        refused = httpx.post(f"{url}/sessions", json={"session_id": "t", "group": "a/b"})
        assert refused.status_code == 400
    app = create_app(stub, data=data, upstream_timeout=5, admin_key=ADMIN_KEY)
    with serve_app(app) as url:
        assert [
            s["session_id"] for s in httpx.get(f"{url}/groups/g2", headers=ADMIN).json()["sessions"]
        ] == ["s"]
        graph = _graph(app, "s")
        assert graph.group == "g2" and graph.labels == ["a"] and graph.reward == 1


def test_metadata_group_and_row_routes_need_a_key(server: tuple[str, Any]) -> None:
    """PATCH, the group routes and the rows answer only a session's own key or the admin
    key; a session's key sees its own session in a group, never the others."""
    url, _ = server
    mine = new_session(url, session_id="m0", group="grp")
    new_session(url, session_id="m1", group="grp")
    _call(mine, "q")
    own = {"authorization": f"Bearer {mine['api_key']}"}
    for method, path in (
        ("PATCH", "/sessions/m1"),
        ("GET", "/sessions/m1/samples"),
        ("GET", "/groups/grp"),
        ("GET", "/groups/grp/samples"),
    ):
        body = {"json": {"reward": 1}} if method == "PATCH" else {}
        assert httpx.request(method, f"{url}{path}", **body).status_code == 401, path
    assert httpx.patch(f"{url}/sessions/m1", json={"reward": 1}, headers=own).status_code == 403
    assert httpx.get(f"{url}/sessions/m1/samples", headers=own).status_code == 403
    seen = httpx.get(f"{url}/groups/grp", headers=own).json()["sessions"]
    assert [s["session_id"] for s in seen] == ["m0"]
    every = httpx.get(f"{url}/groups/grp", headers=ADMIN).json()["sessions"]
    assert sorted(s["session_id"] for s in every) == ["m0", "m1"]
    assert httpx.patch(f"{url}/sessions/m0", json={"reward": 1}, headers=own).status_code == 200


def test_rows_of_a_damaged_session_or_a_down_store_get_an_error_not_a_broken_stream(
    server: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, app = server
    for i in range(2):
        _call(new_session(url, session_id=f"d{i}", group="dg"), "q")
    app.state.sessions.get("d1").damaged = "object abc is damaged: run rollout-store recover"
    for path in ("/sessions/d1/samples", "/groups/dg/samples", "/groups/dg/samples?format=tree"):
        answer = httpx.get(f"{url}{path}", headers=ADMIN)
        assert answer.status_code == 500, path
        assert answer.json() == {
            "error": "object abc is damaged: run rollout-store recover",
            "damaged": True,
        }
    app.state.sessions.get("d1").damaged = None

    def down(graph: Any) -> Any:
        raise StoreUnavailableError("the store at redis://127.0.0.1:1 does not answer")

    monkeypatch.setattr(server_module, "iter_token_samples", down)
    answer = httpx.get(f"{url}/groups/dg/samples", headers=ADMIN)
    assert answer.status_code == 503 and "does not answer" in answer.json()["error"]


def test_a_failed_patch_answers_like_the_other_routes_and_changes_nothing(
    server: tuple[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, app = server
    _call(new_session(url, session_id="p", group="g1"), "q")
    graph, state = _graph(app, "p"), app.state.sessions.get("p")
    before, file_before = graph.meta, (tmp_path / "data" / "p.json").read_bytes()

    def full(self: Any, **changes: Any) -> None:
        raise FileWriteError(errno.ENOSPC, "writing the log failed: no space left")

    def down(self: Any, **changes: Any) -> None:
        raise StoreUnavailableError("the store at redis://127.0.0.1:1 does not answer")

    for failure, status, word in ((full, 507, "disk is full"), (down, 503, "does not answer")):
        monkeypatch.setattr(RolloutGraph, "update_metadata", failure)
        answer = httpx.patch(f"{url}/sessions/p", headers=ADMIN, json={"group": "g2"})
        assert answer.status_code == status and word in answer.json()["error"], answer.text
        assert graph.meta == before and state.group == "g1"
        assert (tmp_path / "data" / "p.json").read_bytes() == file_before
        assert httpx.get(f"{url}/groups/g2", headers=ADMIN).status_code == 404
    monkeypatch.undo()
    for body, word in (
        (b"[1]", "JSON object"),
        (b"{", "must be JSON"),
        (b"[" * 5000, "nests too deeply"),
    ):
        answer = httpx.patch(f"{url}/sessions/p", headers=ADMIN, content=body)
        assert answer.status_code == 400 and word in answer.json()["error"]
    state.damaged = "object abc is damaged: run rollout-store recover"
    answer = httpx.patch(f"{url}/sessions/p", headers=ADMIN, json={"reward": 1})
    assert answer.status_code == 500 and answer.json()["damaged"] is True
    state.damaged = None
    assert graph.meta == before


def test_a_failed_create_keeps_no_log_and_lets_the_id_be_made_again(
    server: tuple[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, app = server

    def full(self: Any, **changes: Any) -> None:
        raise FileWriteError(errno.ENOSPC, "writing the log failed: no space left")

    monkeypatch.setattr(RolloutGraph, "update_metadata", full)
    answer = httpx.post(f"{url}/sessions", json={"session_id": "c", "group": "g"})
    assert answer.status_code == 507, answer.text
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == []
    monkeypatch.undo()
    made = new_session(url, session_id="c", labels=["fresh"])  # the log's lock was let go
    _call(made, "q")
    assert _graph(app, "c").group is None and _graph(app, "c").labels == ["fresh"]


def test_the_logs_group_wins_over_the_session_files_after_a_restart(
    stub: str, tmp_path: Path
) -> None:
    """A crash between the session file's write and the log's meta record leaves the group
    in two places apart: the log's is the one the routes and the export show."""
    data = tmp_path / "data"
    with serve_app(create_app(stub, data=data, upstream_timeout=5, admin_key=ADMIN_KEY)) as url:
        _call(new_session(url, session_id="s", group="g1"), "q")
    doc = json.loads((data / "s.json").read_text())
    (data / "s.json").write_text(json.dumps({**doc, "group": "g2"}))
    app = create_app(stub, data=data, upstream_timeout=5, admin_key=ADMIN_KEY)
    with serve_app(app) as url:
        members = httpx.get(f"{url}/groups/g1", headers=ADMIN).json()["sessions"]
        assert [(s["session_id"], s["group"]) for s in members] == [("s", "g1")]
        assert httpx.get(f"{url}/groups/g2", headers=ADMIN).status_code == 404
        exported = httpx.get(f"{url}/sessions/s/export", headers=ADMIN).json()
        assert exported["group"] == "g1"

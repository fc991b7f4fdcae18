"""The viewer's JSON endpoints and static page, without a browser."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from importlib import resources
from typing import Any

import pytest
from viewer_support import SCRIPT_TEXT, long_rollout, small_rollout

from rollout_store import RolloutGraph, TurnNode, export_session
from rollout_store.export.figures import plain_export_bytes
from rollout_store.viewer.app import MAX_MESSAGES, Viewer, serve


def _get(viewer: Viewer, path: str, query: str = "") -> tuple[int, Any]:
    response = viewer.respond(path, query)
    return response.status, json.loads(response.body)


def test_rows_are_depth_first_with_markers() -> None:
    status, page = _get(Viewer(small_rollout()), "/api/rows", "offset=0&limit=10")
    assert status == 200 and page["total"] == 6
    rows = {r["id"]: r for r in page["rows"]}
    assert [r["id"] for r in page["rows"]] == ["t0", "t1", "t3", "t2", "shapes", "evil"]
    assert rows["t0"]["children"] == 2 and rows["t0"]["parent"] is None
    assert rows["t2"]["discarded"] and not rows["t1"]["discarded"]
    assert [r["indent"] for r in page["rows"]] == [0, 1, 1, 1, 0, 0]  # a chain keeps its indent
    assert rows["t0"]["preview"] == "-> click()"


def test_rows_page_only_what_is_asked() -> None:
    viewer = Viewer(long_rollout(300))
    status, page = _get(viewer, "/api/rows", "offset=250&limit=20")
    assert status == 200 and page["total"] == 300
    assert [r["id"] for r in page["rows"]] == [f"turn-{k}" for k in range(250, 270)]


def test_turn_shows_new_messages_and_pages_the_rest() -> None:
    viewer = Viewer(long_rollout(300))
    status, turn = _get(viewer, "/api/turn", "id=turn-299")
    assert status == 200 and turn["n_messages"] == 600 and turn["new_from"] == 598
    assert len(turn["messages"]) == MAX_MESSAGES and turn["start"] == 500
    status, page = _get(viewer, "/api/messages", "id=turn-299&start=0&stop=3")
    assert [m["role"] for m in page["messages"]] == ["system", "user", "assistant"]


def test_new_messages_follow_the_parents_request() -> None:
    _, turn = _get(Viewer(small_rollout()), "/api/turn", "id=t1")  # linked by tokens
    assert turn["n_messages"] == 5 and turn["new_from"] == 2  # echo, tool result, screenshot
    _, root = _get(Viewer(small_rollout()), "/api/turn", "id=t0")
    assert root["new_from"] == 0


def test_turn_sequence_is_the_loss_mask_as_runs() -> None:
    graph = small_rollout()
    _, turn = _get(Viewer(graph), "/api/turn", "id=t3")
    mask = graph.sequence_for("t3").loss_mask
    runs = turn["sequence"]["mask_runs"]
    assert [v for v, n in runs for _ in range(n)] == mask
    assert turn["sequence"]["n_trained"] == sum(mask) == 6


def test_values_json_parse_cannot_read_are_shown_as_text() -> None:
    graph = RolloutGraph()
    odd = {"role": "user", "content": [math.nan, -math.inf, 2**70, -0.0, (1, 2)]}
    graph.add_turn(TurnNode(request_messages=[odd], node_id="odd"))
    body = Viewer(graph).respond("/api/turn", "id=odd").body.decode()
    assert "NaN" not in body.replace('"nan"', "")  # strict JSON: no bare NaN
    content = json.loads(body)["messages"][0]["content"]
    assert content == ["nan", "-inf", str(2**70), -0.0, [1, 2]]


def test_bad_requests() -> None:
    viewer = Viewer(small_rollout())
    assert _get(viewer, "/api/turn", "id=nope") == (404, {"error": "no turn 'nope' in the graph"})
    assert _get(viewer, "/api/turn")[0] == 400
    assert _get(viewer, "/api/rows", "offset=x")[0] == 400
    assert _get(viewer, "/api/rows", "offset=-1")[0] == 400
    assert _get(viewer, "/nothing")[0] == 404


def test_figures_and_export_size() -> None:
    graph = small_rollout()
    viewer = Viewer(graph, title="x.rls", file_size=123)
    _, figures = _get(viewer, "/api/figures")
    assert figures["turns"] == 6 and figures["discarded"] == 1 and figures["file_bytes"] == 123
    _, size = _get(viewer, "/api/export-size")
    whole = json.dumps(export_session(graph, include_messages=True, include_discarded=True))
    assert size["plain_export_bytes"] == len(whole) == plain_export_bytes(graph)


def test_static_page_builds_no_html_from_content_and_needs_no_network() -> None:
    static = resources.files("rollout_store").joinpath("viewer", "static")
    page = viewer_js = ""
    for name in ("index.html", "viewer.js", "viewer.css"):
        text = static.joinpath(name).read_text()
        assert "http://" not in text and "https://" not in text and "//cdn" not in text
        if name == "viewer.js":
            viewer_js = text
        page += text
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in viewer_js
    response = Viewer(small_rollout()).respond("/")
    headers = dict(response.headers)
    assert response.status == 200 and headers["Content-Type"].startswith("text/html")
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert SCRIPT_TEXT not in page


def test_http_server_answers_loopback_hosts_only() -> None:
    with serve(Viewer(small_rollout())) as server:
        port = server.server_address[1]
        url = f"http://127.0.0.1:{port}/api/figures"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert json.loads(response.read())["turns"] == 6
        request = urllib.request.Request(url, headers={"Host": f"evil.example:{port}"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=10)
        assert info.value.code == 403


def _asgi_get(app: Any, path: str, root_path: str = "") -> tuple[int, dict[bytes, bytes], bytes]:
    import asyncio

    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    route, _, query = path.partition("?")
    scope = {
        "type": "http",
        "method": "GET",
        "path": route,
        "root_path": root_path,
        "query_string": query.encode(),
        "headers": [],
    }
    asyncio.run(app(scope, receive, send))
    start, body = sent
    return start["status"], dict(start["headers"]), body["body"]


def test_asgi_app_answers_under_a_mount_prefix() -> None:
    from rollout_store.viewer.app import asgi_app

    app = asgi_app(Viewer(small_rollout()))
    status, headers, body = _asgi_get(app, "/viewer/api/figures", root_path="/viewer")
    assert status == 200 and json.loads(body)["turns"] == 6
    assert headers[b"content-type"] == b"application/json"
    status, headers, _ = _asgi_get(app, "/viewer", root_path="/viewer")
    assert status == 307 and headers[b"location"] == b"/viewer/"
    status, _, body = _asgi_get(app, "/static/viewer.js")
    assert status == 200 and b"textContent" in body
    status, _, body = _asgi_get(app, "/api/turn?id=t0")
    assert status == 200 and json.loads(body)["summary"]["node_id"] == "t0"


def test_asgi_app_mounts_in_starlette() -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.applications import Starlette
    from starlette.routing import Mount
    from starlette.testclient import TestClient

    from rollout_store.viewer.app import asgi_app

    app = Starlette(routes=[Mount("/viewer", app=asgi_app(Viewer(small_rollout())))])
    with TestClient(app) as client:
        page = client.get("/viewer/")
        assert page.status_code == 200 and 'src="static/viewer.js"' in page.text
        rows = client.get("/viewer/api/rows", params={"offset": 0, "limit": 2}).json()
        assert [r["id"] for r in rows["rows"]] == ["t0", "t1"]


# ---------------------------------------------------------------- what a new user meets first


def test_a_response_whose_tool_calls_is_not_a_list_leaves_the_tree_whole() -> None:
    graph = RolloutGraph()
    graph.add_turn(TurnNode(node_id="ok", response_message={"role": "assistant", "content": "a"}))
    broken = {"role": "assistant", "content": None, "tool_calls": 5}
    graph.add_turn(TurnNode(node_id="bad", response_message=broken))
    graph.add_turn(TurnNode(node_id="odd", response_message={"tool_calls": [5, None]}))
    status, page = _get(Viewer(graph), "/api/rows", "offset=0&limit=10")
    assert status == 200 and [r["id"] for r in page["rows"]] == ["ok", "bad", "odd"]
    assert page["rows"][1]["preview"] == "[tool_calls: 5]"
    status, turn = _get(Viewer(graph), "/api/turn", "id=bad")
    assert status == 200 and turn["response"]["tool_calls"] == 5


def test_retries_are_siblings_and_do_not_push_the_chain_right() -> None:
    graph = RolloutGraph()
    messages: list[Any] = [{"role": "user", "content": "go"}]
    for k in range(40):
        response = {"role": "assistant", "content": f"step {k}"}
        if k % 5 == 4:  # a retry the harness dropped, then the turn that went on
            graph.add_turn(
                TurnNode(
                    node_id=f"retry-{k}",
                    request_messages=list(messages),
                    response_message={"role": "assistant", "content": "dropped"},
                )
            )
        graph.add_turn(
            TurnNode(
                node_id=f"turn-{k}", request_messages=list(messages), response_message=response
            )
        )
        messages += [response, {"role": "user", "content": f"more {k}"}]
    _, page = _get(Viewer(graph), "/api/rows", "offset=0&limit=100")
    rows = {r["id"]: r for r in page["rows"]}
    assert max(r["indent"] for r in page["rows"]) == 1  # not 8 levels deep after 8 retries
    for k in range(4, 40, 5):
        assert rows[f"retry-{k}"]["indent"] == rows[f"turn-{k}"]["indent"] == 1
        assert {rows[f"retry-{k}"]["branch"], rows[f"turn-{k}"]["branch"]} == {"sibling", "last"}
    assert rows["turn-38"]["indent"] == 1 and rows["turn-38"]["branch"] == ""


def test_a_real_branch_opens_a_lane_per_child() -> None:
    graph = RolloutGraph()
    base = [{"role": "user", "content": "go"}]
    graph.add_turn(TurnNode(node_id="root", request_messages=base, response_message={"c": 0}))
    for side in ("a", "b"):
        messages: list[Any] = [*base, {"c": 0}, {"role": "user", "content": side}]
        for k in range(2):
            graph.add_turn(
                TurnNode(node_id=f"{side}{k}", request_messages=list(messages), response_message={})
            )
            messages += [{}, {"role": "user", "content": f"{side}{k}"}]
    _, page = _get(Viewer(graph), "/api/rows", "offset=0&limit=10")
    assert [(r["id"], r["indent"]) for r in page["rows"]] == [
        ("root", 0),
        ("a0", 1),
        ("a1", 1),
        ("b0", 1),
        ("b1", 1),
    ]


def test_figures_name_the_sessions_and_labels_and_a_turn_its_row() -> None:
    graph = RolloutGraph()
    for k, session in enumerate(("s1", "s1", "s2")):
        graph.add_turn(
            TurnNode(
                node_id=f"n{k}",
                request_messages=[{"role": "user", "content": f"{session} {k}"}],
                harness_session_id=session,
            )
        )
    viewer = Viewer(graph, labels=["nightly"])
    _, figures = _get(viewer, "/api/figures")
    assert figures["labels"] == ["nightly"]
    assert figures["sessions"] == [
        {"id": "s1", "first": "n0", "turns": 2},
        {"id": "s2", "first": "n2", "turns": 1},
    ]
    _, page = _get(viewer, "/api/rows")
    assert [r["session"] for r in page["rows"]] == ["s1", "s1", "s2"]
    _, turn = _get(viewer, "/api/turn", "id=n2")
    assert turn["position"] == [r["id"] for r in page["rows"]].index("n2")


def test_the_page_links_a_favicon_that_is_served() -> None:
    viewer = Viewer(small_rollout())
    assert 'rel="icon"' in viewer.respond("/").body.decode()
    for path in ("/static/favicon.svg", "/favicon.ico"):
        response = viewer.respond(path)
        assert response.status == 200 and response.body.startswith(b"<svg")
        assert dict(response.headers)["Content-Type"] == "image/svg+xml"


def test_a_damaged_or_missing_object_costs_only_its_turn(tmp_path: Any) -> None:
    """A long string the content store cannot give: the tree and the other turns are shown,
    and that turn answers 502 naming the object (the tree failed for every page, and a
    damaged object closed the connection with no answer)."""
    from rollout_store import DirectoryStore, StringCache, content_key

    store = DirectoryStore(tmp_path / "objects")
    graph = RolloutGraph(store=store, cache=StringCache(0))
    text = "x" * 5000
    hurt = graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": text}]))
    fine = graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "other"}]))
    key = content_key(text.encode())
    path = store.object_path(key)
    for damage in ("damaged", "missing"):
        if damage == "damaged":
            path.write_bytes(b"y" * 5000)
        else:
            path.unlink()
        viewer = Viewer(graph)
        rows = viewer.respond("/api/rows", "")
        assert rows.status == 200, rows.body
        assert [r["id"] for r in json.loads(rows.body)["rows"]] == [hurt.node_id, fine.node_id]
        assert viewer.respond("/api/turn", f"id={fine.node_id}").status == 200
        answer = viewer.respond("/api/turn", f"id={hurt.node_id}")
        assert answer.status == 502 and key.hex() in answer.body.decode(), damage
    path.write_bytes(text.encode())  # (the graphs a test made are saved again at its end)

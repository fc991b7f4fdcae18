"""The capture server's security and safety: who may reach a session, which requests are
answered at all, and what concurrent, crashed, damaged or full storage does to sessions.

Each test attacks the server as a caller on the machine (or a web page in its browser) would:
open mode reaching a keyed session, session routes without a key or with another session's,
a foreign Host or Origin, a text/plain body, deleting while recreating one id, two servers
on one data directory, a damaged object of the shared store, a body nested too deeply, a
body that never ends, a client that leaves mid-body and a full disk.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from capture_support import (
    ADMIN,
    ADMIN_KEY,
    WAIT_S,
    Counting,
    new_session,
    serve_app,
    start_server_process,
    start_stub_process,
)

from rollout_store import DirectoryStore, RolloutGraph
from rollout_store.errors import FileWriteError
from rollout_store.serve.server import add_serve_arguments, create_app
from rollout_store.serve.sessions import DataDirectoryInUseError, SessionDeletedError, Sessions
from rollout_store.serve.stub_engine import create_stub_app
from rollout_store.viewer.hosts import allowed_hosts, host_allowed, host_name, origin_allowed


@pytest.fixture(scope="module")
def stub() -> Iterator[tuple[str, Counting]]:
    counting = Counting(create_stub_app())
    with serve_app(counting) as url:
        yield url, counting


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _chat(
    url: str,
    key: str,
    text: str,
    headers: dict[str, str] | None = None,
    client: httpx.Client | None = None,
) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    return (client or httpx).post(
        f"{url}/v1/chat/completions",
        json=body,
        headers={**_bearer(key), **(headers or {})},
        timeout=WAIT_S,
    )


def _turn_texts(url: str, session_id: str, client: httpx.Client | None = None) -> list[str]:
    answer = (client or httpx).get(
        f"{url}/sessions/{session_id}/export",
        params={"messages": "1"},
        headers=ADMIN,
        timeout=WAIT_S,
    )
    assert answer.status_code == 200, answer.text
    return [t["request_messages"][-1]["content"] for t in answer.json()["turns"]]


# ---------------------------------------------------------------- keys


def test_open_mode_never_opens_a_keyed_session(stub: tuple[str, Counting]) -> None:
    app = create_app(stub[0], open_mode=True)
    with serve_app(app) as url:
        keyed = new_session(url, session_id="keyed")
        default = new_session(url, session_id="default")
        before = stub[1].calls
        # the session's id (listed, guessable) is not its key
        refused = _chat(url, "keyed", "into keyed?")
        assert refused.status_code == 401, refused.text
        assert "unknown API key" in refused.json()["error"]["message"]
        # no key at all: open mode's "default" session, but that one has a key of its own
        body = {"model": "m", "messages": [{"role": "user", "content": "no key"}]}
        assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 401
        assert stub[1].calls == before  # refused before anything went upstream
        assert len(app.state.sessions.get("keyed").graph) == 0
        assert len(app.state.sessions.get("default").graph) == 0
        # their own keys still record; an unknown key still makes a new open session
        assert _chat(url, keyed["api_key"], "mine").status_code == 200
        assert _chat(url, default["api_key"], "mine").status_code == 200
        assert _chat(url, "agent-9", "open").status_code == 200
        assert _chat(url, "agent-9", "open again").status_code == 200
        assert app.state.sessions.ids() == ["agent-9", "default", "keyed"]
        assert len(app.state.sessions.get("agent-9").graph) == 2


def test_keys_are_compared_in_constant_time_and_come_from_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hmac
    import secrets

    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: Any, b: Any) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(secrets, "token_urlsafe", lambda n=None: "from-secrets-" + "x" * 20)
    sessions = Sessions(tmp_path / "data")
    try:
        session = sessions.create("s1")
        assert session.api_key.endswith("from-secrets-" + "x" * 20)
        monkeypatch.setattr(hmac, "compare_digest", counting)
        assert sessions.resolve(session.api_key) is session
        assert compared == [(session.api_key.encode(), session.api_key.encode())]
        assert sessions.resolve(session.api_key[:-1] + "y") is None
    finally:
        sessions.close()


def test_a_session_file_holding_a_key_is_readable_by_its_owner_only(
    stub: tuple[str, Counting], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    with serve_app(create_app(stub[0], data=data)) as url:
        made = new_session(url, session_id="s1")
    path = data / "s1.json"
    assert made["api_key"] in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    os.chmod(path, 0o644)  # as an earlier version wrote it
    Sessions(data).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_default_bind_is_the_loopback_address() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--upstream", "http://127.0.0.1:1"])
    assert args.host == "127.0.0.1"
    assert args.admin_key is None and args.allow_host == [] and args.body_timeout == 30.0


# ---------------------------------------------------------------- session routes


ROUTES = [
    ("GET", "/sessions/{id}"),
    ("GET", "/sessions/{id}/export"),
    ("GET", "/sessions/{id}/trace.jsonl"),
    ("GET", "/sessions/{id}/view"),
    ("GET", "/sessions/{id}/view/"),
    ("GET", "/sessions/{id}/view/api/rows"),
]


def test_every_session_route_needs_its_key_or_the_admin_key(stub: tuple[str, Counting]) -> None:
    app = create_app(stub[0], admin_key=ADMIN_KEY)
    with serve_app(app) as url:
        a, b = new_session(url, session_id="a"), new_session(url, session_id="b")
        assert _chat(url, a["api_key"], "secret of a").status_code == 200

        client = httpx.Client(timeout=WAIT_S)

        def call(method: str, path: str, headers: dict[str, str]) -> httpx.Response:
            return client.request(method, url + path, headers=headers)

        for method, route in [*ROUTES, ("DELETE", "/sessions/{id}")]:
            path = route.format(id="a")
            for headers, status in (({}, 401), (_bearer(b["api_key"]), 403)):
                answer = call(method, path, headers)
                assert answer.status_code == status, (method, path, answer.text)
                error = answer.json()["error"]
                assert "secret of a" not in answer.text
                if status == 401:
                    assert "Authorization: Bearer" in error and "admin key" in error
                    assert answer.headers["www-authenticate"] == "Bearer"
            # a session that does not exist is not told apart from one that does
            assert call(method, route.format(id="nope"), {}).status_code == 401
            assert call(method, route.format(id="nope"), _bearer(b["api_key"])).status_code == 403
        for method, route in ROUTES:
            for headers in (_bearer(a["api_key"]), {"x-api-key": a["api_key"]}, ADMIN):
                answer = call(method, route.format(id="a"), headers)
                assert answer.status_code in (200, 307), (route, answer.text)
        assert "secret of a" in call("GET", "/sessions/a/export?messages=1", ADMIN).text
        assert call("GET", "/sessions/nope", ADMIN).status_code == 404

        # the list: everything for the admin key, a session's own for its key, else nothing
        listed = call("GET", "/sessions", {})
        assert listed.status_code == 401 and "Authorization" in listed.json()["error"]
        assert call("GET", "/sessions", _bearer("rsk-guess")).status_code == 403
        own = call("GET", "/sessions", _bearer(b["api_key"])).json()["sessions"]
        assert [s["session_id"] for s in own] == ["b"]
        every = call("GET", "/sessions", ADMIN).json()["sessions"]
        assert [s["session_id"] for s in every] == ["a", "b"]

        # delete: another session's key leaves it; its own key removes it
        assert call("DELETE", "/sessions/a", _bearer(b["api_key"])).status_code == 403
        assert app.state.sessions.ids() == ["a", "b"]
        assert call("DELETE", "/sessions/a", _bearer(a["api_key"])).status_code == 200
        assert app.state.sessions.ids() == ["b"]
        client.close()


def test_without_an_admin_key_a_session_is_reached_with_its_own_key_only(
    stub: tuple[str, Counting],
) -> None:
    with serve_app(create_app(stub[0])) as url:
        a = new_session(url, session_id="a")
        assert httpx.get(f"{url}/sessions/a", headers=ADMIN).status_code == 403
        assert httpx.get(f"{url}/sessions", headers=ADMIN).status_code == 403
        assert httpx.get(f"{url}/sessions/a", headers=_bearer(a["api_key"])).status_code == 200


@pytest.mark.slow
def test_the_admin_key_comes_from_the_flag_or_the_environment(tmp_path: Path) -> None:
    stub = start_stub_process()
    try:
        for extra, env in (
            ((), {"ROLLOUT_STORE_ADMIN_KEY": ADMIN_KEY}),
            (("--admin-key", ADMIN_KEY), {"ROLLOUT_STORE_ADMIN_KEY": ""}),
        ):
            server = start_server_process(stub.url, *extra, env=env)
            try:
                made = new_session(server.url)
                listed = httpx.get(f"{server.url}/sessions", headers=ADMIN, timeout=WAIT_S)
                assert [s["session_id"] for s in listed.json()["sessions"]] == [made["session_id"]]
                assert httpx.get(f"{server.url}/sessions", timeout=WAIT_S).status_code == 401
            finally:
                server.stop()
        try:
            weak = start_server_process(stub.url, "--admin-key", "short")
        except RuntimeError as refused:
            assert "admin_key must be at least 16" in str(refused)
        else:
            weak.kill()
            pytest.fail("a server started with a 5-character admin key")
    finally:
        stub.stop()


def test_a_viewer_opened_with_its_key_keeps_it_in_a_cookie_for_its_own_path(
    stub: tuple[str, Counting],
) -> None:
    with serve_app(create_app(stub[0])) as url:
        a, b = new_session(url, session_id="a"), new_session(url, session_id="b")
        assert _chat(url, a["api_key"], "hello").status_code == 200
        opened = httpx.get(f"{url}/sessions/a/view/?key={a['api_key']}&x=1")
        assert opened.status_code == 303 and opened.headers["location"] == "/sessions/a/view/?x=1"
        cookie = opened.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie
        assert "Path=/sessions/a/view/" in cookie
        with httpx.Client(base_url=url, cookies=opened.cookies) as browser:
            assert browser.get("/sessions/a/view/").status_code == 200
            rows = browser.get("/sessions/a/view/api/rows", params={"offset": 0})
            assert rows.status_code == 200 and len(rows.json()["rows"]) == 1
            # the cookie opens the viewer only: not the export, not another session
            jar = {"rollout_store_key": a["api_key"]}
            assert httpx.get(f"{url}/sessions/a/export", cookies=jar).status_code == 401
            assert httpx.get(f"{url}/sessions/b/view/", cookies=jar).status_code == 403
        assert httpx.get(f"{url}/sessions/a/view/?key={b['api_key']}").status_code == 403


# ---------------------------------------------------------------- which requests are answered


def test_a_foreign_host_or_origin_is_refused(stub: tuple[str, Counting]) -> None:
    app = create_app(stub[0], admin_key=ADMIN_KEY)
    with serve_app(app) as url:
        made = new_session(url, session_id="a")
        before = stub[1].calls
        body = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
        for headers in (
            {"host": "attacker.example"},
            {"host": "attacker.example:8100"},
            {"origin": "http://attacker.example"},
            {"origin": "null"},
        ):
            for method, path in (
                ("GET", "/sessions/a/export"),
                ("GET", "/sessions"),
                ("GET", "/health"),
                ("POST", "/v1/chat/completions"),
                ("POST", "/v1/messages"),
                ("POST", "/sessions"),
            ):
                answer = httpx.request(
                    method,
                    url + path,
                    json=body if method == "POST" else None,
                    headers={**headers, **_bearer(made["api_key"])},
                )
                assert answer.status_code == 403, (headers, path, answer.text)
                assert "--allow-host" in answer.text
        assert stub[1].calls == before and app.state.sessions.ids() == ["a"]
        # the server's own names, and a browser page it serves, are answered
        for headers in ({"host": "localhost"}, {"origin": url}):
            answer = _chat(url, made["api_key"], "fine", headers)
            assert answer.status_code == 200, answer.text
    with serve_app(create_app(stub[0], hosts=["capture.internal"])) as url:
        health = httpx.get(f"{url}/health", headers={"host": "capture.internal:80"})
        assert health.status_code == 200
        assert httpx.get(f"{url}/health", headers={"host": "other.internal"}).status_code == 403
    with serve_app(create_app(stub[0], hosts=["*"])) as url:
        assert httpx.get(f"{url}/health", headers={"host": "any.example"}).status_code == 200


def test_the_host_check_is_the_viewers() -> None:
    assert host_name("LocalHost:8100") == "localhost" and host_name("[::1]:80") == "[::1]"
    assert host_name("[::1]") == "[::1]" and host_name(None) == ""
    # what follows the host must be a port (an empty one too, as HTTP allows)
    assert host_name("localhost:") == "localhost"
    for junk in ("[::1]evil.example", "[::1]:80x", "localhost:http", "127.0.0.1:1 2"):
        assert host_name(junk) == "", junk
    loopback = allowed_hosts()
    assert loopback is not None
    for ok in ("127.0.0.1:1", "localhost", "[::1]:8100"):
        assert host_allowed(ok, loopback)
    for bad in ("127.0.0.1.attacker.example", "", None, "attacker.example", "[::2]:1"):
        assert not host_allowed(bad, loopback)
    assert allowed_hosts("0.0.0.0") == loopback and allowed_hosts(None, ["*"]) is None
    assert host_allowed("10.0.0.5:8100", allowed_hosts("10.0.0.5"))
    assert host_allowed("[fe80::1]", allowed_hosts("fe80::1"))
    assert origin_allowed(None, loopback) and origin_allowed("http://localhost:9", loopback)
    assert not origin_allowed("http://attacker.example", loopback)
    assert not origin_allowed("null", loopback)

    from rollout_store.viewer.app import Viewer, serve

    with serve(Viewer(RolloutGraph())) as viewer:
        port = viewer.server_address[1]
        assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 200
        foreign = httpx.get(f"http://127.0.0.1:{port}/", headers={"host": "attacker.example"})
        assert foreign.status_code == 403


def _raw_status(url: str, request: bytes) -> tuple[int, bytes]:
    """The status and body of one raw HTTP/1.1 request (headers as written, no client's own)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as conn:
        conn.sendall(request)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@pytest.mark.parametrize("plane", ["python", "rust"])
def test_a_request_with_no_host_or_two_hosts_or_two_types_is_refused(
    stub: tuple[str, Counting], plane: str
) -> None:
    """Which Host would a check read of two? Neither: 400 (the planes read different ones).
    A request with no Host is refused on every route of both planes (the Rust plane passed
    one on to the app behind it with a Host of its own client's). A Host with something
    other than a port after an IPv6 literal is not a loopback name."""
    app = create_app(stub[0])
    with serve_app(app, data_plane=plane) as url:
        made = new_session(url, session_id="a")
        key = made["api_key"].encode()
        auth = b"Authorization: Bearer " + key + b"\r\n"
        chat = b'{"model": "m", "messages": [{"role": "user", "content": "q"}]}'
        post = b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(chat)
        before = stub[1].calls
        for request, status, words in (
            (b"GET /sessions/a HTTP/1.1\r\n" + auth, 403, b"does not answer the Host None"),
            (b"GET /sessions/a HTTP/1.0\r\n" + auth, 403, b"does not answer the Host None"),
            (b"POST /sessions HTTP/1.1\r\n" + post, 403, b"Host None"),
            (b"POST /v1/chat/completions HTTP/1.1\r\n" + auth + post, 403, b"Host None"),
            (
                b"GET /sessions/a HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n" + auth,
                400,
                b"one Host header, not 2",
            ),
            (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: evil.example\r\nHost: 127.0.0.1"
                b"\r\n" + auth + post,
                400,
                b"one Host header, not 2",
            ),
            (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: text/plain\r\n" + auth + post,
                400,
                b"one Content-Type header, not 2",
            ),
            (
                b"GET /sessions/a HTTP/1.1\r\nHost: [::1]evil.example\r\n" + auth,
                403,
                b"--allow-host",
            ),
        ):
            sent = request + b"Connection: close\r\n\r\n"
            if b"Content-Length" in request:
                sent += chat
            answer = _raw_status(url, sent)
            assert answer[0] == status and words in answer[1], (plane, request, answer)
        assert stub[1].calls == before and len(app.state.sessions.get("a").graph) == 0
        assert app.state.sessions.ids() == ["a"]
        # one Host and one type of each: answered
        ok = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n" + auth + post
        assert _raw_status(url, ok + b"Connection: close\r\n\r\n" + chat)[0] == 200


def test_a_request_head_dripped_line_by_line_times_out_on_the_rust_plane(
    stub: tuple[str, Counting],
) -> None:
    """The Rust plane closes a connection whose request head has not arrived within the body
    timeout (a client sending a header line now and then held it open for good). The Python
    plane's HTTP server has no such limit (see docs/server.md)."""
    app = create_app(stub[0], body_timeout=1.0)
    with serve_app(app, data_plane="rust") as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=0.2) as conn:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            start, closed = time.monotonic(), False
            while time.monotonic() - start < 8:  # a line every 0.2 s (the recv's timeout)
                try:
                    conn.sendall(b"X-Drip: a\r\n")
                    conn.recv(4096)  # an answer or the end of the connection: it is over
                except TimeoutError:
                    continue  # nothing yet
                except OSError:  # (reset by the server)
                    pass
                closed = True
                break
            assert closed and time.monotonic() - start < 4, time.monotonic() - start
        assert httpx.get(f"{url}/health").status_code == 200  # (and it still answers others)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/sessions"])
def test_a_body_that_is_not_json_is_refused_with_415(stub: tuple[str, Counting], path: str) -> None:
    app = create_app(stub[0])
    with serve_app(app) as url:
        made = new_session(url, session_id="a")
        before = stub[1].calls
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "q"}]})
        for kind in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded"):
            answer = httpx.post(
                url + path,
                content=body,
                headers={"content-type": kind, **_bearer(made["api_key"])},
            )
            assert answer.status_code == 415, (kind, answer.text)
            assert "application/json" in answer.text
        assert stub[1].calls == before and app.state.sessions.ids() == ["a"]
        assert len(app.state.sessions.get("a").graph) == 0
        answer = httpx.post(
            url + path,
            content=body,
            headers={"content-type": "Application/JSON; charset=utf-8", **_bearer(made["api_key"])},
        )
        assert answer.status_code == 200, answer.text


# ---------------------------------------------------------------- delete and recreate


@pytest.mark.slow
def test_deleting_and_recreating_one_id_mixes_nothing_and_loses_nothing(
    stub: tuple[str, Counting], tmp_path: Path
) -> None:
    """100 rounds, 4 ids at once: DELETE of a session that recorded a turn races POST of a
    new session under its id. A new session that was made never holds the deleted one's
    turn, and its acknowledged turn is in its files (read back after a restart)."""
    data = tmp_path / "data"
    acknowledged: dict[str, str] = {}
    failures: list[str] = []
    app = create_app(stub[0], data=data, fsync="never", admin_key=ADMIN_KEY)
    with serve_app(app) as url, httpx.Client(timeout=WAIT_S) as client:

        def race(session_id: str, round_: int) -> None:
            old = client.post(f"{url}/sessions", json={"session_id": session_id}).json()
            assert _chat(url, old["api_key"], f"old {round_}", client=client).status_code == 200
            results: dict[str, httpx.Response] = {}
            start = threading.Barrier(2)

            def delete() -> None:
                start.wait()
                results["delete"] = client.delete(f"{url}/sessions/{session_id}", headers=ADMIN)

            def create() -> None:
                start.wait()
                results["create"] = client.post(f"{url}/sessions", json={"session_id": session_id})

            threads = [threading.Thread(target=delete), threading.Thread(target=create)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(WAIT_S)
            assert results["delete"].status_code == 200, results["delete"].text
            made = results["create"]
            if made.status_code == 409:  # the old one was still there: nothing made
                return
            assert made.status_code == 200, made.text
            text = f"new {round_}"
            answer = _chat(url, made.json()["api_key"], text, client=client)
            if answer.status_code != 200:
                failures.append(f"{session_id}: the new session refused a call: {answer.text}")
                return
            acknowledged[session_id] = text
            turns = _turn_texts(url, session_id, client)
            if turns != [text]:
                failures.append(f"{session_id}: the new session holds {turns}")

        for round_ in range(100):
            workers = [
                threading.Thread(target=race, args=(f"id-{round_}-{k}", round_)) for k in range(4)
            ]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join(WAIT_S)
    assert not failures, failures[:5]
    assert acknowledged  # the races did make new sessions
    with serve_app(create_app(stub[0], data=data, admin_key=ADMIN_KEY)) as url:
        lost = {
            sid: turns
            for sid, text in acknowledged.items()
            if (turns := _turn_texts(url, sid)) != [text]
        }
    assert not lost, list(lost.items())[:5]


def test_a_group_saved_for_a_deleted_session_never_writes_over_its_ids_new_session(
    tmp_path: Path,
) -> None:
    """A PATCH holds the session it looked up; once that session is deleted and its id made
    again, the PATCH's write of the group is refused, and the new session's file keeps the
    new key (it wrote the old key there, which a restart then took for the new session's)."""
    data = tmp_path / "data"
    sessions = Sessions(data, fsync="never")
    try:
        old = sessions.create("x")
        assert sessions.delete("x")
        new = sessions.create("x")
        old.group = "g1"
        with pytest.raises(SessionDeletedError, match="was deleted"):
            sessions.save_group(old)
        assert json.loads((data / "x.json").read_text())["api_key"] == new.api_key
        new.group = "g2"
        sessions.save_group(new)
        assert json.loads((data / "x.json").read_text())["group"] == "g2"
    finally:
        sessions.close()


@pytest.mark.slow
def test_a_patch_racing_delete_and_recreate_never_hands_the_id_to_the_old_key(
    stub: tuple[str, Counting], tmp_path: Path
) -> None:
    """60 rounds: the old owner PATCHes its session's group while it deletes it and another
    client makes the id again. The id's file always holds the new key, so after a restart
    the new key opens the new session and the old key opens nothing."""
    data = tmp_path / "data"
    made: dict[str, tuple[str, str]] = {}
    app = create_app(stub[0], data=data, fsync="never")
    with serve_app(app) as url, httpx.Client(timeout=WAIT_S) as client:
        for round_ in range(60):
            sid = f"x{round_}"
            old = client.post(f"{url}/sessions", json={"session_id": sid}).json()["api_key"]
            new: list[str] = []

            def patch(old: str = old, sid: str = sid) -> None:
                for j in range(4):
                    client.patch(
                        f"{url}/sessions/{sid}", headers=_bearer(old), json={"group": f"g{j}"}
                    )

            def recreate(old: str = old, sid: str = sid, new: list[str] = new) -> None:
                client.delete(f"{url}/sessions/{sid}", headers=_bearer(old))
                new.append(
                    client.post(f"{url}/sessions", json={"session_id": sid}).json()["api_key"]
                )

            threads = [threading.Thread(target=patch), threading.Thread(target=recreate)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(WAIT_S)
            made[sid] = (old, new[0])
            assert json.loads((data / f"{sid}.json").read_text())["api_key"] == new[0], sid
    with serve_app(create_app(stub[0], data=data)) as url, httpx.Client(timeout=WAIT_S) as client:
        for sid, (old, new_key) in list(made.items())[:10]:
            assert client.get(f"{url}/sessions/{sid}", headers=_bearer(new_key)).status_code == 200
            assert client.get(f"{url}/sessions/{sid}", headers=_bearer(old)).status_code in (
                401,
                403,
            )


# ---------------------------------------------------------------- the data directory


def test_a_second_server_on_one_data_directory_refuses_to_start(
    stub: tuple[str, Counting], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    first = create_app(stub[0], data=data)
    with serve_app(first) as url:
        with pytest.raises(DataDirectoryInUseError, match="in use by another rollout-store"):
            create_app(stub[0], data=data)  # (no session yet: no log of one is locked)
        new_session(url, session_id="s1")
        with pytest.raises(DataDirectoryInUseError, match="in use by another rollout-store"):
            create_app(stub[0], data=data)
        with pytest.raises(DataDirectoryInUseError, match="another --data"):
            create_app(stub[0], data=str(data) + "/.")
    # stopped: the directory is free again, and the session is there
    with serve_app(create_app(stub[0], data=data, admin_key=ADMIN_KEY)) as url:
        assert httpx.get(f"{url}/sessions/s1", headers=ADMIN).status_code == 200


@pytest.mark.slow
def test_a_killed_servers_data_directory_is_free_and_a_second_one_is_refused(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    stub = start_stub_process()
    try:
        first = start_server_process(stub.url, "--data", str(data))
        try:
            try:
                second = start_server_process(stub.url, "--data", str(data))
            except RuntimeError as refused:
                assert "in use by another rollout-store server" in str(refused)
            else:
                second.kill()
                pytest.fail("a second server started on the same data directory")
            made = new_session(first.url)  # the first one is unharmed
        finally:
            first.kill()  # SIGKILL: the OS drops its lock
        again = start_server_process(stub.url, "--data", str(data))
        try:
            info = httpx.get(f"{again.url}/sessions/{made['session_id']}", headers=ADMIN)
            assert info.status_code == 200
        finally:
            again.stop()
    finally:
        stub.stop()


# ---------------------------------------------------------------- a damaged object


def _two_sessions_over_a_directory_store(
    stub: tuple[str, Counting], tmp_path: Path
) -> tuple[Path, Path, dict[str, Any], dict[str, Any], bytes, Path, bytes]:
    """Sessions "hurt" (a long string kept in the store, referenced by its log) and "fine"
    recorded and the server stopped: the data and objects folders, both sessions, and the
    key, file and content of the hurt session's object."""
    data, objects = tmp_path / "data", tmp_path / "objects"
    long_text = "a screenshot, in words. " * 400
    with serve_app(
        create_app(stub[0], data=data, store=DirectoryStore(objects), admin_key=ADMIN_KEY)
    ) as url:
        hurt, fine = new_session(url, session_id="hurt"), new_session(url, session_id="fine")
        assert _chat(url, hurt["api_key"], long_text).status_code == 200
        assert _chat(url, fine["api_key"], "short").status_code == 200
    store = DirectoryStore(objects)
    damaged = []
    for key in store.keys():  # noqa: SIM118 - a store, not a dict
        path = store.object_path(key)
        if b"a screenshot" in path.read_bytes():
            damaged.append((key, path, path.read_bytes()))
    ((key, path, original),) = damaged
    return data, objects, hurt, fine, key, path, original


def test_a_damaged_object_costs_only_the_sessions_that_reference_it(
    stub: tuple[str, Counting], tmp_path: Path
) -> None:
    data, objects, hurt, fine, key, path, original = _two_sessions_over_a_directory_store(
        stub, tmp_path
    )
    path.write_bytes(original.replace(b"screenshot", b"SCREENSHOT", 1))
    try:
        _check_damage_is_contained(stub, data, objects, hurt, fine, key, path)
    finally:  # (the graphs the test built are saved again when it ends: from the store)
        path.write_bytes(original)


def test_an_unreadable_object_costs_only_the_sessions_that_reference_it(
    stub: tuple[str, Counting], tmp_path: Path
) -> None:
    """An object that cannot be read at all (a directory where its file was: an error other
    than a missing file) damages the sessions that need it, as a damaged object does; it
    stopped the server's start (read as the store being down)."""
    data, objects, hurt, fine, key, path, original = _two_sessions_over_a_directory_store(
        stub, tmp_path
    )
    path.unlink()
    path.mkdir()
    try:
        _check_damage_is_contained(stub, data, objects, hurt, fine, key, path)
    finally:
        path.rmdir()
        path.write_bytes(original)


def _check_damage_is_contained(
    stub: tuple[str, Counting],
    data: Path,
    objects: Path,
    hurt: dict[str, Any],
    fine: dict[str, Any],
    key: bytes,
    path: Path,
) -> None:
    app = create_app(stub[0], data=data, store=DirectoryStore(objects), admin_key=ADMIN_KEY)
    with serve_app(app) as url:
        health = httpx.get(f"{url}/health").json()
        assert health["sessions"] == 2 and health["damaged"] == 1
        listed = {
            s["session_id"]: s
            for s in httpx.get(f"{url}/sessions", headers=ADMIN).json()["sessions"]
        }
        assert "damaged" in listed["hurt"] and "damaged" not in listed["fine"]
        assert listed["fine"]["turns"] == 1

        answer = httpx.get(f"{url}/sessions/hurt/export", headers=ADMIN)
        assert answer.status_code == 500 and answer.json()["damaged"] is True
        message = answer.json()["error"]
        assert key.hex() in message  # the object
        assert str(path) in message  # its file
        assert str(data / "hurt.rls") in message  # the session's log
        assert "rollout-store recover" in message and "--store" in message  # the repair
        assert "\n" not in message
        trace = httpx.get(f"{url}/sessions/hurt/trace.jsonl", headers=ADMIN)
        assert trace.status_code == 500 and key.hex() in trace.json()["error"]
        refused = _chat(url, hurt["api_key"], "more")
        assert refused.status_code == 409 and key.hex() in refused.text

        assert _turn_texts(url, "fine") == ["short"]
        assert _chat(url, fine["api_key"], "still recording").status_code == 200


# ---------------------------------------------------------------- bodies


def test_a_body_nested_too_deeply_is_refused_before_it_goes_upstream(
    stub: tuple[str, Counting],
) -> None:
    app = create_app(stub[0])
    with serve_app(app) as url:
        made = new_session(url)
        before = stub[1].calls
        deep: Any = "x"
        for _ in range(600):
            deep = [deep]
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": deep}]}),
            ("/v1/chat/completions", {"messages": [{"role": "user"}], "extra": deep}),
            ("/v1/messages", {"messages": [{"role": "user"}], "system": deep}),
            ("/v1/messages", {"messages": [{"role": "user"}], "tools": deep}),
        ):
            answer = httpx.post(url + path, json=body, headers=_bearer(made["api_key"]))
            assert stub[1].calls == before  # nothing went upstream
            assert answer.status_code == 400, answer.text
            assert "nests deeper than 500 levels" in answer.json()["error"]["message"]
        assert len(app.state.sessions.get(made["session_id"]).graph) == 0


def _raw_request(url: str, head: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(head)
    return sock


def _read_until_closed(sock: socket.socket, limit_s: float) -> bytes:
    received = b""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            return received
        received += chunk
    raise AssertionError(f"the connection was still open after {limit_s} s: {received!r}")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/sessions"])
def test_a_body_that_never_ends_is_answered_408_and_closed(
    stub: tuple[str, Counting], path: str
) -> None:
    app = create_app(stub[0], body_timeout=0.5)
    with serve_app(app) as url:
        made = new_session(url)
        before = stub[1].calls
        started = time.monotonic()
        sockets = [
            _raw_request(
                url,
                f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                f"authorization: Bearer {made['api_key']}\r\n"
                "content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
                '5\r\n{"mes\r\n'.encode(),
            )
            for _ in range(5)
        ]
        try:
            for sock in sockets:
                sock.settimeout(10)
                received = _read_until_closed(sock, 10)
                assert received.startswith(b"HTTP/1.1 408"), received[:200]
                assert b"did not arrive within 0.5 s" in received
        finally:
            for sock in sockets:
                sock.close()
        assert time.monotonic() - started < 8
        assert stub[1].calls == before and len(app.state.sessions.ids()) == 1


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/sessions"])
def test_a_client_leaving_mid_body_logs_no_traceback(stub: tuple[str, Counting], path: str) -> None:
    app = create_app(stub[0])
    with serve_app(app) as url:
        made = new_session(url)
        records = _Records()
        loggers = [logging.getLogger(n) for n in ("uvicorn.error", "uvicorn", "")]
        for logger in loggers:
            logger.addHandler(records)
        try:
            for _ in range(3):
                sock = _raw_request(
                    url,
                    f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                    f"authorization: Bearer {made['api_key']}\r\n"
                    "content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
                    '{"messages": ['.encode(),
                )
                time.sleep(0.1)
                sock.close()
            time.sleep(0.5)
            assert httpx.get(f"{url}/health").status_code == 200  # still answering
        finally:
            for logger in loggers:
                logger.removeHandler(records)
        assert [r for r in records.records if r.exc_info or r.levelno >= logging.ERROR] == []
        assert app.state.sessions.ids() == [made["session_id"]]


def test_a_full_disk_is_answered_507_with_its_reason(
    stub: tuple[str, Counting], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rollout_store.serve.sessions as sessions_module

    app = create_app(stub[0], data=tmp_path / "data", admin_key=ADMIN_KEY)
    with serve_app(app) as url:
        made = new_session(url, session_id="before")

        def full(path: Path, data: bytes) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

        monkeypatch.setattr(sessions_module, "_write_atomic", full)
        answer = httpx.post(f"{url}/sessions", json={"session_id": "after"})
        assert answer.status_code == 507, answer.text
        assert "disk is full" in answer.json()["error"]
        assert os.strerror(errno.ENOSPC) in answer.json()["error"]
        assert app.state.sessions.ids() == ["before"]
        assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [
            "before.json",
            "before.rls",
        ]

        def no_space(self: Any, node: Any) -> Any:
            raise FileWriteError(errno.ENOSPC, "writing the log failed: no space left")

        monkeypatch.setattr(RolloutGraph, "add_turn", no_space)
        with pytest.raises(openai.APIStatusError) as caught:
            openai.OpenAI(
                base_url=made["openai_base_url"], api_key=made["api_key"], max_retries=0
            ).chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        assert caught.value.status_code == 507
        assert "disk is full" in str(caught.value)


def test_a_session_reopened_over_a_damaged_object_is_marked_damaged_while_serving(
    stub: tuple[str, Counting], tmp_path: Path
) -> None:
    """An idle session lets its graph go; its object is damaged meanwhile: the reopen that its
    export causes fails with the repair, and marks it damaged; the server goes on."""
    data, objects = tmp_path / "data", tmp_path / "objects"
    long_text = "a page of logs, in words. " * 400
    app = create_app(
        stub[0], data=data, store=DirectoryStore(objects), idle_seconds=0.2, admin_key=ADMIN_KEY
    )
    with serve_app(app) as url:
        hurt, fine = new_session(url, session_id="hurt"), new_session(url, session_id="fine")
        assert _chat(url, hurt["api_key"], long_text).status_code == 200
        assert _chat(url, fine["api_key"], "short").status_code == 200
        state = app.state.sessions.get("hurt")
        deadline = time.monotonic() + 10
        while state.loaded and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not state.loaded
        store = DirectoryStore(objects)
        ((key, path, original),) = [
            (k, store.object_path(k), store.object_path(k).read_bytes())
            for k in store.keys()  # noqa: SIM118 - a store, not a dict
            if b"a page of logs" in store.object_path(k).read_bytes()
        ]
        path.write_bytes(original.replace(b"page", b"PAGE", 1))
        app.state.sessions.cache.clear()  # (strings read back are cached: forget them)
        try:
            answer = httpx.get(f"{url}/sessions/hurt/export", headers=ADMIN, timeout=WAIT_S)
            assert answer.status_code == 500, answer.text
            assert key.hex() in answer.json()["error"] and str(path) in answer.json()["error"]
            assert "rollout-store recover" in answer.json()["error"]
            assert httpx.get(f"{url}/health").json()["damaged"] == 1
            assert _turn_texts(url, "fine") == ["short"]
        finally:
            path.write_bytes(original)


def _nested(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("path", "field", "deepest"),
    [  # the deepest value the graph records there (MAX_DEPTH 500)
        ("/v1/chat/completions", "content", 499),  # inside a message: 1 + 499 levels
        ("/v1/chat/completions", "tools", 500),
        ("/v1/chat/completions", "extra", 499),  # inside the sampling parameters
        ("/v1/messages", "system", 499),  # inside the first message
    ],
)
def test_the_depth_checked_before_forwarding_is_the_one_the_graph_records(
    stub: tuple[str, Counting], path: str, field: str, deepest: int
) -> None:
    app = create_app(stub[0])
    with serve_app(app) as url:
        made = new_session(url)
        for levels, status in ((deepest, 200), (deepest + 1, 400)):
            body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
            if field == "content":
                body["messages"] = [{"role": "user", "content": _nested(levels)}]
            else:
                body[field] = _nested(levels)
            before = stub[1].calls
            answer = httpx.post(url + path, json=body, headers=_bearer(made["api_key"]))
            assert answer.status_code == status, (levels, answer.text[:300])
            assert stub[1].calls == before + (status == 200)
        assert len(app.state.sessions.get(made["session_id"]).graph) == 1

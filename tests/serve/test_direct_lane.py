"""The direct lane of `--ack fast` (`crates/gateway/src/direct.rs`): the Chat Completions calls
the Rust data plane sends upstream by itself, with no `prepare`. Only a call the control plane
would accept as it is takes it, and the lane sends the very bytes `prepare` would have sent;
every other call is prepared as before (its refusal the control plane's)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import httpx
import pytest
from capture_support import ADMIN_KEY, auth, new_session, serve_app
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_store._core import direct_tail
from rollout_store.model.timeline import CallClock
from rollout_store.serve.server import RustDataPlane, _Refusal, create_app

MESSAGES = [{"role": "user", "content": "hi \u00e9"}]
_PATHS = ("/v1/chat/completions", "/v1/messages")

_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=6,
)
#: Top-level members: the ones the lane or `prepare` judge (as they take it or not), and others.
_member = st.one_of(
    st.tuples(st.just("messages"), st.sampled_from([MESSAGES, [], [{"role": 1}], {}, "x"])),
    st.tuples(st.sampled_from(["model", "tools", "n", "stream", "stream_options"]), _values),
    st.tuples(st.sampled_from(["return_token_ids", "logprobs"]), st.booleans()),
    st.tuples(st.just("n"), st.sampled_from([1, 1.0, 2, True])),
    st.tuples(st.just("model"), st.text(max_size=3)),
    st.tuples(st.just("tools"), st.lists(_values, max_size=2)),
    st.tuples(st.just("system"), st.sampled_from(["be brief", [{"type": "text"}], 1, None])),
    st.tuples(st.text(max_size=4), _values),
)
#: Members a body the lane takes may hold, each once.
_plain = st.dictionaries(
    st.sampled_from(["temperature", "seed", "max_tokens", "user", "metadata", "caf\u00e9"]),
    _values,
    max_size=3,
).map(lambda members: list(members.items()))


def _body(members: list[tuple[str, Any]], spaced: bool) -> bytes:
    """A body of `members` in their order, repeated keys kept (as a client may send them)."""
    sep = ", " if spaced else ","
    # (keys as UTF-8: an escaped key is read by `prepare` alone)
    items = sep.join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v)}" for k, v in members)
    return f"{{{items}}}{' ' if spaced else ''}".encode()


def _chat(url: str, key: str, text: str, **extra: Any) -> httpx.Response:
    """A Chat Completions call with `key`: one user message `text`, and `extra` members."""
    body = {"model": "m", "messages": [{"role": "user", "content": text}], **extra}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=20)


@pytest.fixture(scope="module")
def servers() -> dict[bool, Any]:
    """A server asking for token ids and logprobs, and one not (`capture_tokens`)."""
    return {
        capture: create_app("http://127.0.0.1:9", capture_tokens=capture).state.server
        for capture in (True, False)
    }


@settings(max_examples=400, deadline=None)
@given(
    plain=_plain,
    members=st.lists(_member, max_size=2),
    messages_first=st.booleans(),
    spaced=st.booleans(),
    capture=st.booleans(),
    anthropic=st.booleans(),
)
def test_a_call_takes_the_lane_only_as_prepare_would_send_it(
    servers: dict[bool, Any],
    plain: list[tuple[str, Any]],
    members: list[tuple[str, Any]],
    messages_first: bool,
    spaced: bool,
    capture: bool,
    anthropic: bool,
) -> None:
    """Differential: for a body the lane takes (Chat Completions or Anthropic's messages), the
    control plane's own reading of it (every check of its own, nothing taken from the engine)
    refuses nothing, asks for no stream, and sends upstream exactly the lane's bytes; with the
    capture fields it injects (Chat Completions only)."""
    members = plain + members
    if messages_first:
        members = [("messages", MESSAGES), *members]
    raw = _body(members, spaced)
    lane = direct_tail(raw, capture, sys.get_int_max_str_digits(), anthropic)
    if lane is None:
        return
    server = servers[capture]
    try:
        session = server.sessions.create()
        plan = server.plan(anthropic, {}, session, raw, CallClock(), passthrough=True)
    except _Refusal as refused:  # pragma: no cover - the failure says what
        raise AssertionError(f"the lane took a body prepare refuses: {refused!r} {raw!r}") from None
    injected = capture and not anthropic
    assert not plan.stream and plan.injected == (injected, injected)
    assert (plan.head, plan.content) == lane, raw


def test_a_plain_call_takes_the_lane() -> None:
    head, tail = direct_tail(json.dumps({"model": "m", "messages": MESSAGES}).encode(), True, 0)
    assert tail == b', "stream": false, "return_token_ids": true, "logprobs": true}'
    assert head > 0


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    counts = {"prepare": 0, "adopt": 0}
    for name in counts:
        method = getattr(RustDataPlane, name)

        def counted(
            self: RustDataPlane, *args: Any, _name: str = name, _m: Any = method, **kwargs: Any
        ) -> Any:
            counts[_name] += 1
            return _m(self, *args, **kwargs)

        monkeypatch.setattr(RustDataPlane, name, counted)
    return counts


def test_the_calls_prepare_would_change_or_refuse_are_prepared(
    stub: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain calls take the lane (no `prepare`) and are recorded, Anthropic's too; a call
    naming `stream`, `stream_options` or an `n` of 2, and every call of `--ack durable`, are
    prepared (and refused, where `prepare` refuses)."""
    counts = _counting(monkeypatch)
    app = create_app(stub, ack="fast", admin_key=ADMIN_KEY)
    with serve_app(app, data_plane="rust") as url:
        key = new_session(url, session_id="lane")["api_key"]
        for i in range(3):
            assert _chat(url, key, f"plain {i}").status_code == 200
        # (the recorder adopts a call after its reply: a reading waits for its turns)
        httpx.get(f"{url}/sessions/lane", headers=auth("lane")).raise_for_status()
        assert counts == {"prepare": 0, "adopt": 3}
        others: list[dict[str, Any]] = [
            {"stream": False},
            {"stream_options": {"include_usage": True}},
            {"n": 2},
            {"stream": True},
        ]
        statuses = [_chat(url, key, "other", **extra).status_code for extra in others]
        # (the stream's turn taken by the recorder first: until then the session's next
        # call is prepared, to be queued after it)
        httpx.get(f"{url}/sessions/lane", headers=auth("lane")).raise_for_status()
        message = {"model": "m", "max_tokens": 5, "messages": MESSAGES}
        answer = httpx.post(f"{url}/v1/messages", json=message, headers={"x-api-key": key})
        statuses.append(answer.status_code)
        info = httpx.get(f"{url}/sessions/lane", headers=auth("lane")).json()
    assert statuses == [200, 200, 400, 200, 200]
    assert counts == {"prepare": 4, "adopt": 4}
    assert (info["turns"], info["dropped"]) == (7, 0)
    counts.update(prepare=0, adopt=0)
    app = create_app(stub, ack="durable", admin_key=ADMIN_KEY)
    with serve_app(app, data_plane="rust") as url:
        key = new_session(url, session_id="durable")["api_key"]
        assert _chat(url, key, MESSAGES[0]["content"]).status_code == 200
    assert counts == {"prepare": 1, "adopt": 0}


def test_a_call_whose_upstream_fails_is_prepared_then_and_answered_as_ever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call of the lane whose upstream cannot be reached is prepared once the failure is
    known, and answered with the control plane's 502, as a prepared call is; nothing is
    recorded or counted as dropped."""
    counts = _counting(monkeypatch)
    app = create_app("http://127.0.0.1:9", ack="fast", admin_key=ADMIN_KEY)
    with serve_app(app, data_plane="rust") as url:
        key = new_session(url, session_id="down")["api_key"]
        answer = _chat(url, key, MESSAGES[0]["content"])
        info = httpx.get(f"{url}/sessions/down", headers=auth("down")).json()
    assert answer.status_code == 502
    assert "upstream cannot be reached" in answer.json()["error"]["message"]
    assert counts == {"prepare": 1, "adopt": 0}
    assert (info["turns"], info["dropped"]) == (0, 0)


def test_the_lanes_ledger_lines_are_counted_as_the_servers_and_kept_by_a_rewrite(
    stub: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a data directory, the lane writes each call's `a` line itself, before its reply,
    through the ledger's one appender: the first line of a server (a prepared call's) opens
    the ledger, the lane's follow, and the ledger counts them as its own once the recorder
    hands the calls over; a rewrite (the ledger grown past its bound) keeps every one of
    them."""
    from rollout_store.serve import ack_ledger
    from rollout_store.serve.ack_ledger import LEDGER_NAME, read_ledger

    monkeypatch.setattr(ack_ledger, "COMPACT_BYTES", 40)
    counts = _counting(monkeypatch)
    app = create_app(stub, data=tmp_path, fsync="never", ack="fast", admin_key=ADMIN_KEY)
    with serve_app(app, data_plane="rust") as url:
        key = new_session(url, session_id="lane")["api_key"]
        for i in range(12):
            assert _chat(url, key, f"call {i}").status_code == 200
        info = httpx.get(f"{url}/sessions/lane", headers=auth("lane")).json()
        ledger = app.state.server.sessions.ledger
        text = (tmp_path / LEDGER_NAME).read_bytes()
        unapplied = ledger.file.unapplied
    assert counts == {"prepare": 1, "adopt": 11}  # (the first opened the ledger)
    assert (info["turns"], info["dropped"]) == (12, 0)
    assert unapplied == 0
    # every answered turn is in the ledger, rewritten as it grew (a `p` line sums them)
    assert read_ledger(text)["lane"].pending == 12, text
    assert b"p lane " in text and text.count(b"a lane\n") < 12
    assert not (tmp_path / LEDGER_NAME).exists()  # (a clean stop carries nothing)


def test_the_lane_sends_the_headers_and_bytes_prepare_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The upstream gets the same headers (an Anthropic call's own `anthropic-version` and
    `anthropic-beta`, the server's upstream key) and the same body from the lane as from a
    prepared call, on both routes."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    seen: list[tuple[str, dict[str, str], bytes]] = []
    kept = ("content-type", "authorization", "x-api-key", "anthropic-version", "anthropic-beta")

    async def answer(request: Request) -> JSONResponse:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k in kept}
        seen.append((request.url.path, headers, body))
        if request.url.path == "/v1/messages":
            return JSONResponse(
                {
                    "id": "msg_1",
                    "type": "message",
                    "role": "assistant",
                    "model": "m",
                    "content": [{"type": "text", "text": "ok"}],
                    "stop_reason": "end_turn",
                    "usage": {"input_tokens": 1, "output_tokens": 1},
                }
            )
        message = {"role": "assistant", "content": "ok"}
        return JSONResponse(
            {"id": "c", "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
        )

    upstream = Starlette(routes=[Route(p, answer, methods=["POST"]) for p in _PATHS])
    counts = _counting(monkeypatch)
    with serve_app(upstream) as engine:
        for lane in (True, False):
            app = create_app(
                engine,
                ack="fast",
                admin_key=ADMIN_KEY,
                upstream_api_key="the-upstream-key",
                direct_lane=lane,
            )
            with serve_app(app, data_plane="rust") as url:
                key = new_session(url, session_id="heads")["api_key"]
                chat = {"model": "m", "messages": MESSAGES}
                sent = httpx.post(
                    f"{url}/v1/chat/completions",
                    json=chat,
                    headers={"authorization": f"Bearer {key}"},
                )
                assert sent.status_code == 200
                anthropic = {"model": "m", "max_tokens": 5, "system": "s", "messages": MESSAGES}
                own = {"x-api-key": key, "anthropic-version": "2023-06-01", "anthropic-beta": "b"}
                sent = httpx.post(f"{url}/v1/messages", json=anthropic, headers=own)
                assert sent.status_code == 200
    assert counts == {"prepare": 2, "adopt": 2}  # (the lane's two, then the prepared two)
    assert seen[:2] == seen[2:]
    assert seen[1][1]["anthropic-version"] == "2023-06-01"
    assert seen[1][1]["x-api-key"] == "the-upstream-key"
    assert seen[0][1]["authorization"] == "Bearer the-upstream-key"


def test_a_lane_line_of_a_session_deleted_before_its_adoption_is_not_carried_to_its_successor(
    stub: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lane call answered (its `a` line written) whose session is deleted, and made again
    under its id, before the recorder hands the call over: the line ended with the deleted
    session (its `n` line came after it), so a rewrite of the ledger does not carry it to
    the new session, and the next start counts no turn of the new one as lost."""
    from rollout_store.serve import ack_ledger

    monkeypatch.setattr(ack_ledger, "COMPACT_BYTES", 40)
    gate, waiting = _held_adoption(monkeypatch, b"held")

    def call(url: str, key: str, text: str) -> int:
        return _chat(url, key, text).status_code

    app = create_app(stub, data=tmp_path, fsync="never", ack="fast", admin_key=ADMIN_KEY)
    with serve_app(app, data_plane="rust") as url:
        old = new_session(url, session_id="again")["api_key"]
        assert call(url, old, "first") == 200  # (the ledger opened by a prepared call)
        assert call(url, old, "held") == 200  # its line written, its adoption held
        assert waiting.wait(10)
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        assert httpx.delete(f"{url}/sessions/again", headers=admin).status_code == 200
        new = new_session(url, session_id="again")["api_key"]
        gate.set()
        for i in range(3):  # (lines past the bound: the ledger rewritten)
            assert call(url, new, f"new {i}") == 200
        info = httpx.get(f"{url}/sessions/again", headers=auth("again")).json()
    assert (info["turns"], info["dropped"]) == (3, 0)
    again = create_app(stub, data=tmp_path, admin_key=ADMIN_KEY)
    with serve_app(again, data_plane="rust") as url:
        info = httpx.get(f"{url}/sessions/again", headers=auth("again")).json()
        health = httpx.get(f"{url}/health").json()
    assert (info["turns"], info["dropped"]) == (3, 0), info
    assert health["dropped_by"]["killed"] == 0, health["dropped_by"]


def _held_adoption(monkeypatch: pytest.MonkeyPatch, marker: bytes) -> tuple[Any, Any]:
    """Hold the recorder's adoption of the lane call whose body holds `marker` until the
    returned gate is set (the other event: it is held now)."""
    import threading

    gate, waiting = threading.Event(), threading.Event()
    adopt = RustDataPlane.adopt

    def gated(self: RustDataPlane, *args: Any) -> Any:
        if args[0][4].find(marker) >= 0:  # (the body)
            waiting.set()
            gate.wait(20)
        return adopt(self, *args)

    monkeypatch.setattr(RustDataPlane, "adopt", gated)
    return gate, waiting


def test_a_rewrite_while_a_lane_line_is_not_counted_yet_keeps_it(
    stub: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger is rewritten (grown past its bound) while the recorder has not handed over
    a lane call whose line is written: the rewrite carries that line, so the file counts
    every answered turn at once, and is not put off until the lane pauses."""
    from rollout_store.serve import ack_ledger
    from rollout_store.serve.ack_ledger import LEDGER_NAME, read_ledger

    monkeypatch.setattr(ack_ledger, "COMPACT_BYTES", 40)
    gate, waiting = _held_adoption(monkeypatch, b"held")
    app = create_app(stub, data=tmp_path, fsync="never", ack="fast", admin_key=ADMIN_KEY)
    with serve_app(app, data_plane="rust") as url:
        key = new_session(url, session_id="lane")["api_key"]
        try:
            for text, extra in [
                ("first", {}),
                ("held", {}),
                *[(f"p{i}", {"stream": False}) for i in range(8)],
            ]:
                assert _chat(url, key, text, **extra).status_code == 200
                if text == "held":
                    assert waiting.wait(10)
            # (the prepared calls' lines, past the bound, rewrote the ledger meanwhile)
            text = (tmp_path / LEDGER_NAME).read_bytes()
            unapplied = app.state.server.sessions.ledger.file.unapplied
        finally:
            gate.set()
        info = httpx.get(f"{url}/sessions/lane", headers=auth("lane")).json()
    assert unapplied == 1
    assert b"p lane " in text, text  # rewritten
    assert read_ledger(text)["lane"].pending == 10, text
    assert (info["turns"], info["dropped"]) == (10, 0)


def test_a_session_found_damaged_elsewhere_leaves_the_lane_at_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session's graph is found damaged by an export (its idle graph reopened over a
    damaged object): its next call is prepared and refused before it goes upstream, not sent
    by the lane and its turn dropped."""
    from capture_support import Counting

    from rollout_store import DirectoryStore
    from rollout_store.serve.stub_engine import create_stub_app

    counts = _counting(monkeypatch)
    counting = Counting(create_stub_app())
    data, objects = tmp_path / "data", tmp_path / "objects"
    long_text = "a page of logs, in words. " * 400
    with serve_app(counting) as engine:
        app = create_app(
            engine,
            data=data,
            store=DirectoryStore(objects),
            idle_seconds=0.2,
            ack="fast",
            admin_key=ADMIN_KEY,
        )
        with serve_app(app, data_plane="rust") as url:
            key = new_session(url, session_id="hurt")["api_key"]
            assert _chat(url, key, long_text).status_code == 200
            state = app.state.sessions.get("hurt")
            for _ in range(200):
                if not state.loaded:
                    break
                time.sleep(0.05)
            assert not state.loaded
            store = DirectoryStore(objects)
            (path,) = [
                store.object_path(k)
                for k in store.keys()  # noqa: SIM118 - a store, not a dict
                if b"a page of logs" in store.object_path(k).read_bytes()
            ]
            original = path.read_bytes()
            path.write_bytes(original.replace(b"page", b"PAGE", 1))
            try:
                app.state.sessions.cache.clear()
                admin = {"authorization": f"Bearer {ADMIN_KEY}"}
                exported = httpx.get(f"{url}/sessions/hurt/export", headers=admin, timeout=20)
                assert exported.status_code == 500, exported.text
                upstream = counting.calls
                answer = _chat(url, key, "again")
                health = httpx.get(f"{url}/health").json()
            finally:
                path.write_bytes(original)  # (the graphs built are checked at teardown)
    assert answer.status_code == 409, answer.text
    assert "the session cannot record" in answer.text
    assert counting.calls == upstream  # refused before it went upstream
    # (the first call prepared: a server's first ledger line, which opens it, is Python's)
    assert counts == {"prepare": 2, "adopt": 0}
    assert health["dropped"] == 0, health


def test_a_durable_call_goes_upstream_before_any_python_and_is_answered_once_recorded(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `--ack durable`, a call of the lane goes upstream before the control plane
    prepares it (no Python on its way there); it is prepared and recorded once its answer
    is in, and its reply goes out after its turn is in the log, as a prepared call's."""
    from rollout_store.serve.stub_engine import create_stub_app

    order: list[str] = []
    stub_app = create_stub_app()

    async def upstream(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            order.append("upstream")
        await stub_app(scope, receive, send)

    prepare = RustDataPlane.prepare

    def noted(self: RustDataPlane, *args: Any, **kwargs: Any) -> Any:
        order.append("prepare")
        return prepare(self, *args, **kwargs)

    monkeypatch.setattr(RustDataPlane, "prepare", noted)
    turns = []
    with serve_app(upstream) as engine:
        for lane in (True, False):
            app = create_app(
                engine,
                data=tmp_path / str(lane),
                ack="durable",
                admin_key=ADMIN_KEY,
                direct_lane=lane,
            )
            with serve_app(app, data_plane="rust") as url:
                key = new_session(url, session_id="d")["api_key"]
                for i in range(3):
                    assert _chat(url, key, f"call {i}").status_code == 200
                    turns.append(app.state.sessions.get("d").turns())  # (no settling)
    assert order == ["upstream", "prepare"] * 3 + ["prepare", "upstream"] * 3
    assert turns == [1, 2, 3] * 2


@pytest.mark.parametrize("lane", [True, False])
def test_a_session_made_again_while_a_body_comes_takes_the_call(
    stub: str, tmp_path: Any, lane: bool
) -> None:
    """Open mode, `--ack durable`: a call's session is deleted and made again under its key
    while the call's body is still coming. The call is the new session's, lane or not: its
    key is looked up once the body is in, where `prepare` asks it (the lane's call used to keep
    the deleted session, and was refused 409 after going upstream)."""
    import socket

    app = create_app(
        stub, data=tmp_path, ack="durable", admin_key=ADMIN_KEY, open_mode=True, direct_lane=lane
    )
    with serve_app(app, data_plane="rust") as url:
        assert _chat(url, "k1", "first").status_code == 200
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "slow"}]})
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            "Authorization: Bearer k1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(head.encode() + body[:5].encode())
            time.sleep(0.3)  # (the call waits for the rest of its body)
            admin = {"authorization": f"Bearer {ADMIN_KEY}"}
            assert httpx.delete(f"{url}/sessions/k1", headers=admin).status_code == 200
            assert _chat(url, "k1", "made again").status_code == 200
            sock.sendall(body[5:].encode())
            answer = b""
            for _ in range(100):  # (bounded: the reply's head comes whole)
                if b"\r\n\r\n" in answer:
                    break
                answer += sock.recv(65536)
        info = httpx.get(f"{url}/sessions/k1", headers=admin).json()
    assert answer.split(b" ", 2)[1] == b"200", answer[:400]
    assert info["turns"] == 2, info

"""The Rust data plane passes an upstream's stream through: each event reaches the client as
the engine sends it, and the turn made of the events at the stream's end is the turn the
unstreamed answer records. A stream that breaks off ends with an error event and records
nothing; the last event waits for the turn (`--ack durable`: a turn that cannot be recorded
fails the stream); keep-alive comments until the first byte; https upstreams, their roots
from `SSL_CERT_FILE`."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from capture_support import ADMIN_KEY, auth, new_session, serve_app
from services import free_port, unavailable
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollout_store.files.storage import RolloutGraph
from rollout_store.serve.loopback import wait_for_port
from rollout_store.serve.server import RustDataPlane, create_app, listen_socket
from rollout_store.serve.sse import SSE_HEADERS, anthropic_events, chat_chunks, sse_data, sse_event
from rollout_store.serve.stub_engine import chat_response, create_stub_app

GATE_S = 10.0  # how long an upstream waits at its gate before it goes on anyway
MESSAGES = [{"role": "user", "content": "look around and say so"}]
TOOLS = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}]


class Engine:
    """An upstream answering with `answer` (whole when the call does not stream) or the events
    `events` (when it does): it waits at `gate` before event `hold_at`, then `end`s the stream
    with its last event sent ("done"), by ending it before ("eof"), or by breaking the
    connection off ("break")."""

    def __init__(
        self, answer: dict[str, Any], events: list[bytes], hold_at: int | None = None
    ) -> None:
        self.answer = answer
        self.events = events
        self.hold_at = hold_at
        self.end = "done"
        self.linger = False  # after its last event, wait at the gate before it ends
        self.gate = threading.Event()
        self.bodies: list[dict[str, Any]] = []
        self.sent_all = threading.Event()

    async def _wait(self) -> None:
        deadline = time.monotonic() + GATE_S
        while not self.gate.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def _stream(self) -> Any:
        events = self.events if self.end == "done" else self.events[:-1]
        for number, event in enumerate(events):
            if number == self.hold_at:
                await self._wait()
            yield event
        self.sent_all.set()
        if self.linger:
            await self._wait()
        if self.end == "break":
            raise RuntimeError("the engine fell over mid-stream (on purpose)")

    async def handle(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.bodies.append(body)
        if body.get("stream") is True:
            return StreamingResponse(
                self._stream(), media_type="text/event-stream", headers=SSE_HEADERS
            )
        return JSONResponse(self.answer)

    def app(self) -> Starlette:
        paths = ("/v1/chat/completions", "/v1/messages")
        return Starlette(routes=[Route(p, self.handle, methods=["POST"]) for p in paths])


def _chat_answer() -> dict[str, Any]:
    """A vLLM answer with reasoning, text, two tool calls, logprobs and token ids."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "I will look. Twice.",
                    "reasoning_content": "The user wants a look.",
                    "tool_calls": [
                        {
                            "id": "call_a",
                            "type": "function",
                            "function": {"name": "look", "arguments": '{"where": "left"}'},
                        },
                        {
                            "id": "call_b",
                            "type": "function",
                            "function": {"name": "look", "arguments": '{"where": "right"}'},
                        },
                    ],
                },
                "logprobs": {
                    "content": [
                        {"token": t, "logprob": -0.5 * i, "bytes": None, "top_logprobs": []}
                        for i, t in enumerate(["I", " will", " look", "<call>", "<call>"])
                    ]
                },
                "finish_reason": "tool_calls",
                "token_ids": [101, 102, 103, 4, 4],
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
        "prompt_token_ids": [1, 11, 12],
    }


def _chunk(choice: dict[str, Any], **top: Any) -> bytes:
    return sse_data(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1_700_000_000,
            "model": "m",
            **top,
            "choices": [{"index": 0, **choice}],
            "engine_note": "kept as sent",  # no replay of the whole answer writes this
        }
    )


def _chat_events() -> list[bytes]:
    """`_chat_answer` as vLLM streams it: deltas of a few tokens each, tool calls in pieces."""
    entries = _chat_answer()["choices"][0]["logprobs"]["content"]
    return [
        _chunk(
            {"delta": {"role": "assistant", "content": ""}, "logprobs": None},
            prompt_token_ids=[1, 11, 12],
        ),
        _chunk({"delta": {"reasoning_content": "The user "}, "logprobs": None}),
        _chunk({"delta": {"reasoning_content": "wants a look."}, "logprobs": None}),
        _chunk(
            {
                "delta": {"content": "I will"},
                "logprobs": {"content": entries[:2]},
                "token_ids": [101, 102],
            }
        ),
        _chunk(
            {
                "delta": {"content": " look. Twice."},
                "logprobs": {"content": entries[2:3]},
                "token_ids": [103],
            }
        ),
        _chunk(
            {
                "delta": {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_a",
                            "type": "function",
                            "function": {"name": "look", "arguments": ""},
                        }
                    ]
                },
                "logprobs": {"content": entries[3:4]},
                "token_ids": [4],
            }
        ),
        _chunk(
            {
                "delta": {
                    "tool_calls": [{"index": 0, "function": {"arguments": '{"where": "left"}'}}]
                }
            }
        ),
        _chunk(
            {
                "delta": {
                    "tool_calls": [
                        {
                            "index": 1,
                            "id": "call_b",
                            "type": "function",
                            "function": {"name": "look", "arguments": '{"where": '},
                        }
                    ]
                },
                "logprobs": {"content": entries[4:]},
                "token_ids": [4],
            }
        ),
        _chunk({"delta": {"tool_calls": [{"index": 1, "function": {"arguments": '"right"}'}}]}}),
        _chunk({"delta": {}, "logprobs": None, "finish_reason": "tool_calls"}),
        b"data: [DONE]\n\n",
    ]


def _messages_answer() -> dict[str, Any]:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "c",
        "content": [
            {"type": "thinking", "thinking": "Look first.", "signature": "sig-1"},
            {"type": "text", "text": "Looking now."},
            {
                "type": "tool_use",
                "id": "toolu_1",
                "name": "look",
                "input": {"where": ["left", 1.0]},
            },
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 7, "output_tokens": 9},
    }


def _messages_events() -> list[bytes]:
    """`_messages_answer` as Anthropic streams it, text and tool input in pieces."""
    whole = list(anthropic_events(_messages_answer()))
    pieces = []
    for event in whole:
        if b'"text_delta"' in event:
            for part in ("Looking", " now."):
                delta = {"type": "text_delta", "text": part}
                pieces.append(
                    sse_event(
                        "content_block_delta",
                        {"type": "content_block_delta", "index": 1, "delta": delta},
                    )
                )
        elif b'"input_json_delta"' in event:
            for part in ('{"where": ["le', 'ft", 1.0]}'):
                delta = {"type": "input_json_delta", "partial_json": part}
                pieces.append(
                    sse_event(
                        "content_block_delta",
                        {"type": "content_block_delta", "index": 2, "delta": delta},
                    )
                )
        else:
            pieces.append(event)
    return pieces


@contextlib.contextmanager
def _through(
    engine: Engine, tmp_path: Path, **options: Any
) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """The Rust plane (with a data directory) in front of `engine`; its URL, app, session."""
    with serve_app(engine.app()) as upstream:
        app = create_app(upstream, data=tmp_path / "data", admin_key=ADMIN_KEY, **options)
        with serve_app(app, data_plane="rust") as url:
            yield url, app, new_session(url)


def _turns(app: Any, session_id: str) -> list[Any]:
    graph = app.state.sessions.get(session_id).graph
    return [graph.get(node) for node in graph.node_ids()]


def _recorded(turn: Any) -> tuple[Any, ...]:
    return (
        turn.prompt_ids,
        turn.sampled_ids,
        turn.sampled_logprobs,
        turn.model,
        turn.finish_reason,
        turn.request_messages,
        turn.request_tools,
        turn.sampling_params,
        json.dumps(turn.response_message),
    )


def _post(url: str, path: str, session: dict[str, Any], body: dict[str, Any]) -> httpx.Response:
    headers = {"authorization": f"Bearer {session['api_key']}"}
    return httpx.post(url + path, json=body, headers=headers, timeout=20)


def _events(data: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in data.split(b"\n\n") if e]


def test_events_reach_the_client_as_the_engine_sends_them(tmp_path: Path) -> None:
    """The client has the engine's first events (its own bytes) while the engine holds the
    rest back; the turn made of the whole stream is the one its unstreamed answer records."""
    engine = Engine(_chat_answer(), _chat_events(), hold_at=4)
    body = {
        "model": "m",
        "messages": MESSAGES,
        "tools": TOOLS,
        "logprobs": True,
        "return_token_ids": True,
    }
    with _through(engine, tmp_path) as (url, app, session):
        received = b""
        headers = {"authorization": f"Bearer {session['api_key']}"}
        with httpx.stream(
            "POST",
            f"{url}/v1/chat/completions",
            json={**body, "stream": True},
            headers=headers,
            timeout=GATE_S / 2,  # a plane that waited for the whole answer times out here
        ) as answer:
            assert answer.status_code == 200
            assert answer.headers["content-type"].startswith("text/event-stream")
            chunks = answer.iter_raw()
            while received.count(b"\n\n") < 4:
                received += next(chunks)
            assert received == b"".join(engine.events[:4])  # as the engine sent them
            assert not engine.sent_all.is_set()
            engine.gate.set()
            received += b"".join(chunks)
        assert received == b"".join(engine.events)
        assert engine.bodies[-1]["stream"] is True
        plain = new_session(url)
        assert _post(url, "/v1/chat/completions", plain, body).json() == _chat_answer()
        (streamed,) = _turns(app, session["session_id"])
        (unstreamed,) = _turns(app, plain["session_id"])
        assert _recorded(streamed) == _recorded(unstreamed)
        assert streamed.sampled_ids == [101, 102, 103, 4, 4]
        assert streamed.response_message["tool_calls"][1]["function"]["arguments"] == (
            '{"where": "right"}'
        )


def test_capture_fields_the_client_did_not_ask_for_are_taken_out_of_the_events(
    tmp_path: Path,
) -> None:
    engine = Engine(_chat_answer(), _chat_events())
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "stream": True}
    with _through(engine, tmp_path) as (url, app, session):
        answer = _post(url, "/v1/chat/completions", session, body)
        assert answer.status_code == 200
        sent = engine.bodies[-1]
        assert sent["return_token_ids"] is True and sent["logprobs"] is True
        events = _events(answer.content)
        assert len(events) == len(engine.events)
        chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
        assert all("prompt_token_ids" not in c for c in chunks)
        assert all(c["choices"][0].get("logprobs") is None for c in chunks)
        assert all("token_ids" not in c["choices"][0] for c in chunks)
        assert all(c["engine_note"] == "kept as sent" for c in chunks)
        assert events[1] == engine.events[1]  # nothing to take out: the engine's bytes
        (turn,) = _turns(app, session["session_id"])
        assert turn.sampled_ids == [101, 102, 103, 4, 4] and turn.prompt_ids == [1, 11, 12]
        assert turn.sampled_logprobs == [-0.0, -0.5, -1.0, -1.5, -2.0]


def test_an_anthropic_stream_records_what_its_whole_answer_records(tmp_path: Path) -> None:
    engine = Engine(_messages_answer(), _messages_events(), hold_at=3)
    body = {"model": "c", "max_tokens": 64, "system": "Be brief.", "messages": MESSAGES}
    with _through(engine, tmp_path) as (url, app, session):
        headers = {"x-api-key": session["api_key"]}
        received = b""
        with httpx.stream(
            "POST", f"{url}/v1/messages", json={**body, "stream": True}, headers=headers, timeout=5
        ) as answer:
            chunks = answer.iter_raw()
            while received.count(b"\n\n") < 3:
                received += next(chunks)
            engine.gate.set()
            received += b"".join(chunks)
        assert received == b"".join(engine.events)
        plain = new_session(url)
        assert _post(url, "/v1/messages", plain, body).json() == _messages_answer()
        (streamed,) = _turns(app, session["session_id"])
        (unstreamed,) = _turns(app, plain["session_id"])
        assert _recorded(streamed) == _recorded(unstreamed)
        assert streamed.response_message["content"] == _messages_answer()["content"]


@pytest.mark.parametrize("end", ["eof", "break"])
def test_a_stream_the_engine_breaks_off_ends_with_an_error_event_and_records_nothing(
    tmp_path: Path, end: str
) -> None:
    engine = Engine(_chat_answer(), _chat_events())
    engine.end = end
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    with _through(engine, tmp_path) as (url, app, session):
        answer = _post(url, "/v1/chat/completions", session, body)
        assert answer.status_code == 200
        events = _events(answer.content)
        assert len(events) == len(engine.events)  # all but the last, then the error
        assert b"[DONE]" not in answer.content
        error = json.loads(events[-1][len(b"data: ") :])["error"]
        assert error["type"] == "api_error"
        reason = "ended before its last event" if end == "eof" else "broke off"
        assert reason in error["message"], error
        assert _turns(app, session["session_id"]) == []
        # the server goes on, and the next turn's timeline counts the failed attempt
        engine.end = "done"
        assert _post(url, "/v1/chat/completions", session, body).status_code == 200
        export = httpx.get(
            f"{url}/sessions/{session['session_id']}/export", headers=auth(session["session_id"])
        ).json()
        (turn,) = export["turns"]
        assert turn["timeline"]["failed_attempts"] == 1


def test_the_stream_ends_at_its_last_event_even_when_the_upstream_lingers(
    tmp_path: Path,
) -> None:
    engine = Engine(_chat_answer(), _chat_events())
    engine.linger = True
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    with _through(engine, tmp_path) as (url, app, session):
        headers = {"authorization": f"Bearer {session['api_key']}"}
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=GATE_S / 2
        ) as answer:
            received = b"".join(answer.iter_raw())
        assert received.endswith(b"data: [DONE]\n\n")
        assert not engine.gate.is_set()  # the engine had not ended its answer
        assert len(_turns(app, session["session_id"])) == 1
        engine.gate.set()


def test_an_upstream_error_before_the_stream_passes_through(tmp_path: Path) -> None:
    with serve_app(create_stub_app()) as upstream:
        app = create_app(upstream, data=tmp_path / "data", admin_key=ADMIN_KEY)
        with serve_app(app, data_plane="rust") as url:
            session = new_session(url)
            body = {"model": "stub-error", "messages": MESSAGES, "stream": True}
            answer = _post(url, "/v1/chat/completions", session, body)
            direct = httpx.post(f"{upstream}/v1/chat/completions", json=body)
            assert (answer.status_code, answer.content) == (400, direct.content)
            assert _turns(app, session["session_id"]) == []


@pytest.mark.parametrize("ack", ["durable", "fast"])
def test_the_last_event_waits_for_the_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ack: str
) -> None:
    """A turn that cannot be recorded: with `--ack durable` its stream ends with an error
    event in place of `[DONE]`; with `--ack fast` the stream ends as it came and the turn is
    counted as dropped."""

    def add_turn(self: RolloutGraph, node: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    engine = Engine(chat_response({"messages": MESSAGES}), [])
    engine.events = list(chat_chunks(chat_response({"messages": MESSAGES})))
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    with _through(engine, tmp_path, ack=ack) as (url, app, session):
        monkeypatch.setattr(RolloutGraph, "add_turn", add_turn)
        answer = _post(url, "/v1/chat/completions", session, body)
        assert app.state.server.plane.settle(5)
        events = _events(answer.content)
        assert events[:-1] == engine.events[:-1]
        health = httpx.get(f"{url}/health").json()
        if ack == "durable":
            error = json.loads(events[-1][len(b"data: ") :])["error"]
            assert "No space left on device" in error["message"], error
            assert health["dropped"] == 0
        else:
            assert events[-1] == b"data: [DONE]\n\n"
            assert health["dropped"] == 1


def test_keep_alive_comments_until_the_first_event(tmp_path: Path) -> None:
    engine = Engine(_chat_answer(), _chat_events(), hold_at=0)
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    with _through(engine, tmp_path, stream_keepalive=0.1) as (url, app, session):
        headers = {"authorization": f"Bearer {session['api_key']}"}
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=5
        ) as answer:
            chunks = answer.iter_raw()
            assert next(chunks) == b": keep-alive\n\n"
            engine.gate.set()
            rest = b"".join(chunks)
        assert rest.endswith(b"data: [DONE]\n\n") and b"chatcmpl-1" in rest
        assert len(_turns(app, session["session_id"])) == 1


def test_a_client_that_leaves_mid_stream_leaves_the_turn_recorded(tmp_path: Path) -> None:
    engine = Engine(_chat_answer(), _chat_events(), hold_at=3)
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    with _through(engine, tmp_path) as (url, app, session):
        headers = {"authorization": f"Bearer {session['api_key']}"}
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=5
        ) as answer:
            next(answer.iter_raw())  # then hang up
        engine.gate.set()
        for _ in range(200):
            if _turns(app, session["session_id"]):
                break
            time.sleep(0.02)
        assert engine.sent_all.is_set()  # read to its end
        assert len(_turns(app, session["session_id"])) == 1
        assert _post(url, "/v1/chat/completions", session, body).status_code == 200


def _again_before_the_streams_end(
    url: str, session: dict[str, Any], engine: Engine
) -> tuple[threading.Thread, list[int]]:
    """A client reads the stream of a call up to its last delta, leaves, and calls again at
    once, continuing it: the thread making that call (once the call went upstream) and the
    status it will get."""
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "stream": True}
    headers = {"authorization": f"Bearer {session['api_key']}"}
    received = b""
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=5
    ) as answer:
        chunks = answer.iter_raw()
        while b'"finish_reason": "tool_calls"' not in received:
            received += next(chunks)
    message = _chat_answer()["choices"][0]["message"]
    later = {
        "model": "m",
        "messages": [*MESSAGES, message, {"role": "user", "content": "and then?"}],
        "tools": TOOLS,
    }
    answered: list[int] = []
    thread = threading.Thread(
        target=lambda: answered.append(
            _post(url, "/v1/chat/completions", session, later).status_code
        )
    )
    thread.start()
    for _ in range(500):
        if len(engine.bodies) == 2:
            break
        time.sleep(0.01)
    return thread, answered


@pytest.mark.parametrize("fsync", ["turn", "never"])
def test_a_call_continuing_a_stream_whose_end_is_not_recorded_waits_for_it(
    tmp_path: Path, fsync: str
) -> None:
    """A client that stops reading at the last delta and calls again at once: its next turn
    is recorded after the stream's, which it continues (and links to). With `fsync` never,
    the engine runs its callbacks on one thread: the wait must not hold that one up."""
    engine = Engine(_chat_answer(), _chat_events(), hold_at=len(_chat_events()) - 1)
    with _through(engine, tmp_path, fsync=fsync) as (url, app, session):
        thread, answered = _again_before_the_streams_end(url, session, engine)
        assert len(engine.bodies) == 2  # the next call went upstream
        time.sleep(0.3)
        assert thread.is_alive()  # and waits for the stream's turn
        engine.gate.set()
        thread.join(10)
        assert answered == [200]
        first, second = _turns(app, session["session_id"])
        assert first.request_messages == MESSAGES
        assert len(second.request_messages) == 3


def test_a_fast_call_continuing_a_stream_is_recorded_after_the_streams_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `--ack fast`, a call continuing a stream whose turn is not recorded yet is queued
    after that turn, however late the stream's turn reaches the queue, so that it can link to
    it (recorded first, it would be a branch the agent did not take)."""
    finish_stream = RustDataPlane.finish_stream

    def queued_late(self: RustDataPlane, *args: Any) -> Any:
        out = finish_stream(self, *args)
        time.sleep(0.5)  # the stream's turn reaches the queue this late
        return out

    monkeypatch.setattr(RustDataPlane, "finish_stream", queued_late)
    engine = Engine(_chat_answer(), _chat_events(), hold_at=len(_chat_events()) - 1)
    with _through(engine, tmp_path, ack="fast") as (url, app, session):
        thread, answered = _again_before_the_streams_end(url, session, engine)
        engine.gate.set()
        thread.join(10)
        assert answered == [200]
        for _ in range(500):
            if len(_turns(app, session["session_id"])) == 2:
                break
            time.sleep(0.01)
        first, second = _turns(app, session["session_id"])
        assert first.request_messages == MESSAGES  # the stream's turn, recorded first
        assert len(second.request_messages) == 3


# ---------------------------------------------------------------------- https upstreams


@contextlib.contextmanager
def _https(app: Any, cert: Any) -> Iterator[str]:
    """`app` served over TLS with `cert` on a free loopback port; its base URL."""
    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with cert.cert_chain_pems[0].tempfile() as chain, cert.private_key_pem.tempfile() as key:
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, ssl_certfile=chain, ssl_keyfile=key
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        for _ in range(2000):
            if server.started or not thread.is_alive():
                break
            time.sleep(0.005)
        assert server.started, "the https stub did not start"
        try:
            yield f"https://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            thread.join(10)
            sock.close()


def test_an_https_upstream_is_called_with_the_roots_of_ssl_cert_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trustme = pytest.importorskip("trustme")
    authority = trustme.CA()
    with authority.cert_pem.tempfile() as roots:
        monkeypatch.setenv("SSL_CERT_FILE", roots)
        cert = authority.issue_cert("127.0.0.1")
        with _https(create_stub_app(), cert) as upstream:
            app = create_app(upstream, admin_key=ADMIN_KEY)
            with serve_app(app, data_plane="rust") as url:
                session = new_session(url)
                body = {"model": "m", "messages": MESSAGES}
                answer = _post(url, "/v1/chat/completions", session, body)
                assert answer.status_code == 200, answer.text
                assert answer.json() == chat_response(body)
                streamed = _post(url, "/v1/chat/completions", session, {**body, "stream": True})
                assert streamed.status_code == 200
                assert streamed.content.endswith(b"data: [DONE]\n\n")
                assert len(_turns(app, session["session_id"])) == 2


def test_an_untrusted_https_upstream_fails_the_call_naming_tls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trustme = pytest.importorskip("trustme")
    trusted, other = trustme.CA(), trustme.CA()
    with trusted.cert_pem.tempfile() as roots:
        monkeypatch.setenv("SSL_CERT_FILE", roots)
        with _https(create_stub_app(), other.issue_cert("127.0.0.1")) as upstream:
            app = create_app(upstream, admin_key=ADMIN_KEY)
            with serve_app(app, data_plane="rust") as url:
                session = new_session(url)
                body = {"model": "m", "messages": MESSAGES}
                answer = _post(url, "/v1/chat/completions", session, body)
                assert answer.status_code == 502
                message = answer.json()["error"]["message"]
                assert "TLS" in message and "certificate" in message, message
                assert _turns(app, session["session_id"]) == []


@pytest.mark.slow
def test_an_https_upstream_offering_http2_is_called_over_http2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HAProxy terminates TLS with ALPN `h2, http/1.1` in front of the stub; its log names
    the protocol each call came in with."""
    trustme = pytest.importorskip("trustme")
    binary = shutil.which("haproxy")
    if binary is None:
        unavailable("haproxy is not installed (apt-get install haproxy)")
    assert binary is not None
    authority = trustme.CA()
    pem = tmp_path / "upstream.pem"
    pem.write_bytes(authority.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.bytes())
    roots = tmp_path / "roots.pem"
    roots.write_bytes(authority.cert_pem.bytes())
    monkeypatch.setenv("SSL_CERT_FILE", str(roots))
    port = free_port()
    with serve_app(create_stub_app()) as stub:
        config = tmp_path / "haproxy.cfg"
        config.write_text(
            "global\n    log stdout format raw local0\n"
            "defaults\n    mode http\n    log global\n    timeout connect 5s\n"
            "    timeout client 30s\n    timeout server 30s\n"
            f"frontend tls\n    bind 127.0.0.1:{port} ssl crt {pem} alpn h2,http/1.1\n"
            '    log-format "alpn=%[ssl_fc_alpn] %HM %HU %ST"\n    default_backend stub\n'
            f"backend stub\n    server stub {stub.removeprefix('http://')}\n"
        )
        proc = subprocess.Popen(
            [binary, "-db", "-f", str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        try:
            wait_for_port(port, 20)
            app = create_app(f"https://127.0.0.1:{port}", admin_key=ADMIN_KEY)
            with serve_app(app, data_plane="rust") as url:
                session = new_session(url)
                body = {"model": "m", "messages": MESSAGES}
                answer = _post(url, "/v1/chat/completions", session, body)
                assert answer.status_code == 200 and answer.json() == chat_response(body)
                streamed = _post(url, "/v1/chat/completions", session, {**body, "stream": True})
                assert streamed.content.endswith(b"data: [DONE]\n\n")
                assert len(_turns(app, session["session_id"])) == 2
        finally:
            proc.terminate()
            log, _ = proc.communicate(timeout=20)
    calls = [line for line in log.decode().splitlines() if line.startswith("alpn=")]
    assert calls == ["alpn=h2 POST " + f"https://127.0.0.1:{port}/v1/chat/completions 200"] * 2


@pytest.mark.parametrize("ack", ["durable", "fast"])
def test_a_stream_nesting_deeper_than_python_reads_ends_as_one_that_cannot_be_read(
    tmp_path: Path, ack: str
) -> None:
    """An event too deep for Python's JSON reader makes no turn like any unreadable event:
    with `--ack durable` an error event says so in place of `[DONE]`; with `--ack fast` the
    stream ends as it came and the turn is counted as dropped (never a stream cut short of
    its last event with nothing said or counted)."""
    depth = sys.getrecursionlimit() + 100
    deep = b'data: {"id": "c1", "x": ' + b"[" * depth + b"]" * depth + b"}\n\n"
    engine = Engine(_chat_answer(), [*_chat_events()[:2], deep, b"data: [DONE]\n\n"])
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    with _through(engine, tmp_path, ack=ack) as (url, app, session):
        answer = _post(url, "/v1/chat/completions", session, body)
        assert app.state.server.plane.settle(5)
        events = _events(answer.content)
        assert len(events) == len(engine.events)
        assert events[1:-1] == engine.events[1:-1]  # (the first: capture fields taken out)
        health = httpx.get(f"{url}/health").json()
        if ack == "durable":
            error = json.loads(events[-1][len(b"data: ") :])["error"]
            assert "cannot be read: the event's data nests too deeply" in error["message"]
            assert health["dropped"] == 0
        else:
            assert events[-1] == b"data: [DONE]\n\n"
            assert health["dropped_by"]["record_error"] == health["dropped"] == 1
        assert _turns(app, session["session_id"]) == []

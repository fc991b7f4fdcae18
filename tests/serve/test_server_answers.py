"""Upstream answers and session requests the capture server must answer cleanly: an answer it
cannot hand on is refused before anything is recorded, and one it records reaches the client."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio.to_thread
import httpx
import pytest
from capture_support import ADMIN, ADMIN_KEY, new_session, serve_app
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rollout_store.serve.server import create_app
from rollout_store.serve.stub_engine import create_stub_app


@contextmanager
def _in_front_of(answers: list[bytes], tmp_path: Path) -> Iterator[tuple[str, Any, dict[str, str]]]:
    """A capture server (with a data directory) in front of an upstream that answers each
    call with the next of `answers`, as its bytes; yields its URL, app and auth headers."""

    async def answer(request: Request) -> Response:
        return Response(answers.pop(0), media_type="application/json")

    routes = [Route(p, answer, methods=["POST"]) for p in ("/v1/chat/completions", "/v1/messages")]
    with serve_app(Starlette(routes=routes)) as upstream:
        app = create_app(upstream, data=tmp_path / "data", upstream_timeout=5)
        with serve_app(app) as url:
            session = new_session(url)
            yield url, app, {"authorization": f"Bearer {session['api_key']}"}


def _files(tmp_path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((tmp_path / "data").iterdir())}


def _turns(app: Any) -> int:
    (session,) = app.state.sessions.all()
    return len(session.graph)


# answers json.loads reads that hold what a strict JSON writer refuses to write again
_ODD_ANSWERS = [
    b'{"choices": [{"message": {"role": "assistant", "content": "\\ud800 half a pair"}}]}',
    b'{"choices": [{"message": {"role": "assistant", "content": "x"}}], "usage": {"t": NaN}}',
    b'{"choices": [{"message": {"role": "assistant", "content": "x", "score": -Infinity}}]}',
]


@pytest.mark.parametrize("answer", _ODD_ANSWERS)
def test_an_answer_written_anew_reaches_the_client_as_recorded(
    answer: bytes, tmp_path: Path
) -> None:
    """The server takes out the token ids it asked for, so it writes the answer anew: a lone
    surrogate or a NaN the upstream sent is written as json.dumps writes it, not a 500 for a
    turn that was recorded."""
    with _in_front_of([answer], tmp_path) as (url, app, auth):
        body = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=10)
        assert reply.status_code == 200, reply.text
        assert json.dumps(json.loads(reply.content)) == json.dumps(json.loads(answer))
        assert _turns(app) == 1


def test_an_answer_written_anew_keeps_its_text_in_utf8(tmp_path: Path) -> None:
    """Non-ASCII text is written as UTF-8, as JSONResponse wrote it before, not as escapes."""
    text = "h\u00e9llo \u65e5\u672c \U0001f600"
    answer = json.dumps(
        {"choices": [{"message": {"role": "assistant", "content": text}}]}, ensure_ascii=False
    ).encode()
    with _in_front_of([answer], tmp_path) as (url, app, auth):
        body = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=10)
        assert reply.status_code == 200, reply.text
        assert text.encode() in reply.content
        assert b"\\u" not in reply.content
        assert json.loads(reply.content)["choices"][0]["message"]["content"] == text
        assert _turns(app) == 1


# answers whose first choice (or content) records, but that cannot be replayed as a stream
_UNREPLAYABLE = [
    ("/v1/chat/completions", b'{"choices": [{"message": {"role": "assistant"}}, "second"]}'),
    (
        "/v1/chat/completions",
        b'{"choices": [{"message": {"role": "assistant", "tool_calls": ["call"]}}]}',
    ),
    ("/v1/messages", b'{"content": ["a block that is no object"]}'),
    ("/v1/messages", b'{"content": [{"type": "tool_use", "id": "t", "name": "f"}]}'),
    ("/v1/messages", b'{"content": [], "usage": "none"}'),
]


@pytest.mark.parametrize(("path", "answer"), _UNREPLAYABLE)
def test_an_answer_that_cannot_be_streamed_is_502_and_recorded_nowhere(
    path: str, answer: bytes, tmp_path: Path
) -> None:
    """A streaming client of such an answer got a broken stream of a turn that was recorded
    (a harness then retries it: recorded twice); now it gets a 502 and nothing is recorded."""
    with _in_front_of([answer], tmp_path) as (url, app, auth):
        before = _files(tmp_path)
        body = {"model": "m", "max_tokens": 5, "stream": True}
        body["messages"] = [{"role": "user", "content": "q"}]
        reply = httpx.post(f"{url}{path}", json=body, headers=auth, timeout=10)
        assert reply.status_code == 502, reply.text
        message = reply.json()["error"]["message"]
        assert "stream" in message and "\n" not in message
        assert _turns(app) == 0 and _files(tmp_path) == before


def test_session_requests_too_deep_or_too_large_are_4xx_and_create_nothing(
    tmp_path: Path,
) -> None:
    with serve_app(create_stub_app()) as upstream:
        app = create_app(upstream, data=tmp_path / "data", max_body_bytes=200_000)
        with serve_app(app) as url:
            deep = b'{"metadata": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001
            large = json.dumps({"metadata": {"pad": "x" * 300_000}}).encode()
            for content, status in ((deep, 400), (b"[" * 100_000, 400), (large, 413)):
                reply = httpx.post(f"{url}/sessions", content=content, timeout=10)
                assert reply.status_code == status, reply.text
                assert "\n" not in reply.json()["error"]
            assert app.state.sessions.ids() == [] and list((tmp_path / "data").iterdir()) == []


def test_a_call_in_flight_when_its_session_is_deleted_records_nowhere(tmp_path: Path) -> None:
    """The call's turn reopened the deleted session's log and was recorded there: a session
    created later under the same id started with it. Now the call is refused (409)."""
    reached, release = threading.Event(), threading.Event()

    async def answer(request: Request) -> Response:
        reached.set()
        await anyio.to_thread.run_sync(release.wait, 10)
        return Response(b'{"choices": [{"message": {"role": "assistant", "content": "late"}}]}')

    routes = [Route("/v1/chat/completions", answer, methods=["POST"])]
    with serve_app(Starlette(routes=routes)) as upstream:
        app = create_app(upstream, data=tmp_path / "data", upstream_timeout=20, admin_key=ADMIN_KEY)
        with serve_app(app) as url:
            session = new_session(url, session_id="run-1")
            auth = {"authorization": f"Bearer {session['api_key']}"}
            replies: list[httpx.Response] = []
            body = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
            caller = threading.Thread(
                target=lambda: replies.append(
                    httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=20)
                )
            )
            caller.start()
            try:
                assert reached.wait(10)
                assert (
                    httpx.delete(f"{url}/sessions/run-1", headers=ADMIN, timeout=10).status_code
                    == 200
                )
            finally:
                release.set()
                caller.join(20)
            assert replies[0].status_code == 409, replies[0].text
            assert list((tmp_path / "data").iterdir()) == []
            new_session(url, session_id="run-1")
            assert (
                httpx.get(f"{url}/sessions/run-1", headers=ADMIN, timeout=10).json()["turns"] == 0
            )


def test_session_metadata_json_loads_reads_is_listed_as_json_dumps_writes_it() -> None:
    """A session made with a NaN or a lone surrogate in its metadata (json.loads reads both)
    made GET /sessions a 500 for every session, and its own GET /sessions/{id} too."""
    with (
        serve_app(create_stub_app()) as upstream,
        serve_app(create_app(upstream, admin_key=ADMIN_KEY)) as url,
    ):
        bodies = {
            "sur": b'{"session_id": "sur", "metadata": {"k": "\\ud800"}}',
            "nan": b'{"session_id": "nan", "metadata": {"k": NaN, "i": -Infinity}}',
        }
        for body in bodies.values():
            assert httpx.post(f"{url}/sessions", content=body, timeout=10).status_code == 200
        listed = httpx.get(f"{url}/sessions", headers=ADMIN, timeout=10)
        assert listed.status_code == 200, listed.text
        shown = {s["session_id"]: s["metadata"] for s in json.loads(listed.content)["sessions"]}
        for session_id, body in bodies.items():
            want = json.dumps(json.loads(body)["metadata"])
            assert json.dumps(shown[session_id]) == want
            info = httpx.get(f"{url}/sessions/{session_id}", headers=ADMIN, timeout=10)
            assert info.status_code == 200, info.text
            assert json.dumps(json.loads(info.content)["metadata"]) == want


def _with_ids(prompt_ids: str) -> bytes:
    """A vLLM answer whose `prompt_token_ids` is the text `prompt_ids`."""
    return (
        b'{"id": "c", "prompt_token_ids": ' + prompt_ids.encode() + b', "choices": [{"index": 0,'
        b' "message": {"role": "assistant", "content": "ok"}, "token_ids": [7, 8],'
        b' "logprobs": {"content": [{"token": "ok", "logprob": -0.5}]},'
        b' "finish_reason": "stop"}]}'
    )


@pytest.mark.parametrize(
    "prompt_ids",
    ["[1, 2, 4294967295]", "[ 5 ]", "[4294967296, 1]", "[-0, 3]", "[]"],
)
@pytest.mark.parametrize("stream", [False, True])
def test_an_answers_prompt_ids_reach_the_client_and_the_turn_as_sent(
    prompt_ids: str, stream: bool, tmp_path: Path
) -> None:
    """However the engine wrote its prompt ids (read as packed ids, or decoded), a client that
    asked for them gets them back with the rest written anew (the server asked for the
    logprobs), and the turn records the ids json.loads reads."""
    expected = json.loads(prompt_ids)
    with _in_front_of([_with_ids(prompt_ids)], tmp_path) as (url, app, auth):
        body = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
        body |= {"return_token_ids": True, "stream": stream}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=10)
        assert reply.status_code == 200, reply.text
        if stream:
            first = reply.text.split("\n\n")[0].removeprefix("data: ")
            got = json.loads(first)
        else:
            got = json.loads(reply.content)
            assert got["choices"][0]["logprobs"] is None  # asked by the server, taken out
        assert json.dumps(got["prompt_token_ids"]) == json.dumps(expected)
        (session,) = app.state.sessions.all()
        (turn,) = [session.graph.get(n) for n in session.graph.node_ids()]
        assert json.dumps(turn.prompt_ids) == json.dumps(expected or None)
        assert turn.sampled_ids == [7, 8]

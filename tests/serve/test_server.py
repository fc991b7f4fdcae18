"""The capture server with the official OpenAI and Anthropic SDKs, in front of the stub engine."""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from capture_support import ADMIN, ADMIN_KEY, Counting, auth, export, new_session, serve_app

from rollout_store import DirectoryStore, MemoryStore, RolloutGraph, export_session
from rollout_store.serve.server import create_app, open_store, upstream_body
from rollout_store.serve.stub_engine import (
    chat_response,
    create_stub_app,
    logprob_of,
    prompt_ids_for,
)

IMAGE = "data:image/png;base64," + "iVBORw0KGgo" * 2000


@pytest.fixture(scope="module")
def stub() -> Iterator[tuple[str, Counting]]:
    counting = Counting(create_stub_app())
    with serve_app(counting) as url:
        yield url, counting


@pytest.fixture
def server(stub: tuple[str, Counting], tmp_path: Path) -> Iterator[tuple[str, Any]]:
    app = create_app(stub[0], data=tmp_path / "data", upstream_timeout=5, admin_key=ADMIN_KEY)
    with serve_app(app) as url:
        yield url, app


def _openai(session: dict[str, Any], **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0, **kw
    )


def _anthropic(session: dict[str, Any]) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0
    )


def _graph(app: Any, session_id: str) -> RolloutGraph:
    graph: RolloutGraph = app.state.sessions.get(session_id).graph
    return graph


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in the picture?"},
            {"type": "image_url", "image_url": {"url": IMAGE}},
        ],
    },
]


# ---------------------------------------------------------------- OpenAI chat completions


def test_chat_non_streaming_records_tokens_and_answers_like_the_engine(server: Any) -> None:
    url, app = server
    session = new_session(url)
    client = _openai(session)
    reply = client.chat.completions.create(model="m", messages=CONVERSATION, temperature=0.5)
    direct = chat_response({"model": "m", "messages": CONVERSATION, "temperature": 0.5})
    assert reply.choices[0].message.content == direct["choices"][0]["message"]["content"]
    # what the server asked the engine for and the client did not is not handed back
    assert reply.choices[0].logprobs is None
    assert "prompt_token_ids" not in (reply.model_extra or {})

    graph = _graph(app, session["session_id"])
    (node_id,) = graph.node_ids()
    turn = graph.get(node_id)
    assert json.dumps(turn.request_messages) == json.dumps(CONVERSATION)
    assert turn.prompt_ids == prompt_ids_for(CONVERSATION)
    assert turn.sampled_logprobs == [logprob_of(t) for t in turn.sampled_ids or []]
    assert turn.sampling_params == {"temperature": 0.5}
    assert turn.model == "m"
    assert turn.finish_reason == "stop"


def test_chat_streaming_replays_chunks_the_sdk_parses(server: Any) -> None:
    url, app = server
    session = new_session(url)
    client = _openai(session)
    messages = copy.deepcopy(CONVERSATION)
    first = client.chat.completions.create(model="m", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "user", "content": "and now?"}]
    stream = client.chat.completions.create(
        model="m", messages=messages, stream=True, stream_options={"include_usage": True}
    )
    text, finish, usage = [], None, None
    for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    direct = chat_response({"model": "m", "messages": messages})
    assert "".join(text) == direct["choices"][0]["message"]["content"]
    assert finish == "stop"
    assert usage is not None and usage.prompt_tokens == len(prompt_ids_for(messages))

    graph = _graph(app, session["session_id"])
    first_id, second_id = graph.node_ids()
    assert graph.parent(second_id) == first_id
    assert graph.link_kind(second_id) == "tokens"
    seq = graph.sequence_for(second_id)
    assert sum(seq.loss_mask) == len(graph.get(first_id).sampled_ids or []) + len(
        graph.get(second_id).sampled_ids or []
    )


def test_chat_stream_with_tool_calls_and_client_asked_fields(server: Any) -> None:
    url, app = server
    session = new_session(url)
    client = _openai(session)
    tools = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "look around"}]
    stream = client.chat.completions.create(
        model="m",
        messages=messages,
        tools=tools,
        stream=True,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    calls, logprobs, token_ids = [], [], []
    for chunk in stream:
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            if choice.logprobs is not None and choice.logprobs.content:
                logprobs += [e.logprob for e in choice.logprobs.content]
            token_ids += (choice.model_extra or {}).get("token_ids") or []
    assert [c.function.name for c in calls if c.function] == ["look"]
    graph = _graph(app, session["session_id"])
    turn = graph.get(graph.node_ids()[0])
    # asked for by the client: handed back, and equal to what was recorded
    assert token_ids == turn.sampled_ids and logprobs == turn.sampled_logprobs
    assert turn.sampling_params == {"logprobs": True, "return_token_ids": True}
    assert turn.request_tools == tools
    assert turn.finish_reason == "tool_calls"


def test_harness_session_header_and_user_field(server: Any) -> None:
    url, app = server
    session = new_session(url)
    client = _openai(session, default_headers={"x-session-id": "ses_sub-1"})
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    plain = _openai(session)
    plain.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], user="u7")
    graph = _graph(app, session["session_id"])
    assert [graph.get(n).harness_session_id for n in graph.node_ids()] == ["ses_sub-1", "u7"]


# ---------------------------------------------------------------- Anthropic messages


def test_anthropic_messages_streaming_and_not(server: Any) -> None:
    url, app = server
    session = new_session(url)
    client = _anthropic(session)
    tools = [{"name": "look", "description": "look", "input_schema": {"type": "object"}}]
    messages: list[Any] = [{"role": "user", "content": "look at this"}]
    first = client.messages.create(
        model="claude-x", max_tokens=64, system="Be exact.", tools=tools, messages=messages
    )
    assert first.stop_reason == "tool_use" and first.content[0].type == "tool_use"
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": first.content[0].id, "content": "a cat"}
            ],
        },
    ]
    with client.messages.stream(
        model="claude-x", max_tokens=64, system="Be exact.", tools=tools, messages=messages
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn"
    assert "".join(pieces) == final.content[0].text and pieces

    graph = _graph(app, session["session_id"])
    a, b = graph.node_ids()
    assert graph.parent(b) == a and graph.link_kind(b) == "messages"
    turn = graph.get(b)
    assert turn.request_messages is not None
    assert turn.request_messages[0] == {"role": "system", "content": "Be exact."}
    assert json.dumps(turn.request_messages[1:]) == json.dumps(messages)
    content = final.model_dump(exclude_none=True)["content"]
    assert turn.response_message == {"role": "assistant", "content": content}
    assert turn.sampling_params == {"max_tokens": 64}


# ---------------------------------------------------------------- sessions


def test_sessions_create_list_info_export_delete(server: Any, tmp_path: Path) -> None:
    url, app = server
    made = new_session(url, session_id="rollout-7", metadata={"task": "t1"})
    assert made["session_id"] == "rollout-7" and made["api_key"] != "rollout-7"
    assert httpx.post(f"{url}/sessions", json={"session_id": "rollout-7"}).status_code == 409
    for bad in ("../x", "a/b", "", ".hidden", "x" * 200, 7):
        answer = httpx.post(f"{url}/sessions", json={"session_id": bad})
        assert answer.status_code == 400, bad
    _openai(made).chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])

    listed = httpx.get(f"{url}/sessions", headers=ADMIN).json()["sessions"]
    assert [s["session_id"] for s in listed] == ["rollout-7"]
    info = httpx.get(f"{url}/sessions/rollout-7", headers=ADMIN).json()
    assert info["turns"] == 1 and info["roots"] == 1 and info["metadata"] == {"task": "t1"}
    assert httpx.get(f"{url}/sessions/nope", headers=ADMIN).status_code == 404

    doc = export(url, "rollout-7")
    graph = _graph(app, "rollout-7")
    expected = export_session(
        graph,
        session_id="rollout-7",
        metadata={"task": "t1"},
        include_messages=True,
        capture_level="tokens",
    )
    raw = httpx.get(
        f"{url}/sessions/rollout-7/export", params={"messages": "1"}, headers=ADMIN
    ).content
    assert raw == json.dumps(expected).encode()
    assert doc["turns"][0]["request_messages"] == [{"role": "user", "content": "q"}]
    assert "request_messages" not in export(url, "rollout-7", messages=False)["turns"][0]
    lines = httpx.get(f"{url}/sessions/rollout-7/trace.jsonl", headers=ADMIN).text.splitlines()
    assert [json.loads(line)["prompt_ids"] for line in lines] == [
        prompt_ids_for([{"role": "user", "content": "q"}])
    ]

    data = tmp_path / "data"
    assert sorted(p.name for p in data.iterdir()) == ["rollout-7.json", "rollout-7.rls"]
    assert httpx.delete(f"{url}/sessions/rollout-7", headers=ADMIN).json() == {
        "deleted": True,
        "session_id": "rollout-7",
    }
    assert httpx.delete(f"{url}/sessions/rollout-7", headers=ADMIN).status_code == 404
    assert list(data.iterdir()) == []
    with pytest.raises(openai.AuthenticationError):
        _openai(made).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "q"}]
        )


def test_unknown_key_is_refused_unless_open(stub: Any) -> None:
    stub_url, counting = stub
    with serve_app(create_app(stub_url)) as url:
        fake = {"openai_base_url": f"{url}/v1", "anthropic_base_url": url, "api_key": "who"}
        before = counting.calls
        with pytest.raises(openai.AuthenticationError, match="unknown API key"):
            _openai(fake).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "q"}]
            )
        with pytest.raises(anthropic.AuthenticationError):
            _anthropic(fake).messages.create(
                model="m", max_tokens=5, messages=[{"role": "user", "content": "q"}]
            )
        assert counting.calls == before
    app = create_app(stub_url, open_mode=True)
    with serve_app(app) as url:
        fake = {"openai_base_url": f"{url}/v1", "anthropic_base_url": url, "api_key": "agent-3"}
        _openai(fake).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "q"}]
        )
        _anthropic(fake).messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "q"}]
        )
        assert app.state.sessions.ids() == ["agent-3"]
        assert len(_graph(app, "agent-3")) == 2
        # a key that cannot be a session id is still refused
        fake["api_key"] = "../../etc"
        with pytest.raises(openai.AuthenticationError):
            _openai(fake).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "q"}]
            )


# ---------------------------------------------------------------- durability


def test_restarted_server_reopens_sessions_and_goes_on_recording(stub: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    messages: list[Any] = [{"role": "user", "content": "start"}]
    with serve_app(create_app(stub[0], data=data, admin_key=ADMIN_KEY)) as url:
        session = new_session(url, metadata={"k": 1})
        reply = _openai(session).chat.completions.create(model="m", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "more"}]
    log = data / f"{session['session_id']}.rls"
    with open(log, "ab") as fp:  # a torn record: a crash in the middle of a write
        fp.write(b"\x03\x40\x00\x00\x00partial")
    app = create_app(stub[0], data=data, admin_key=ADMIN_KEY)
    assert app.state.sessions.reopened == [(session["session_id"], 1, 12)]
    with serve_app(app) as url:
        session["openai_base_url"] = f"{url}/v1"
        _openai(session).chat.completions.create(model="m", messages=messages)
        graph = _graph(app, session["session_id"])
        first, second = graph.node_ids()
        assert graph.parent(second) == first
        assert httpx.get(f"{url}/sessions/{session['session_id']}", headers=ADMIN).json()[
            "metadata"
        ] == {"k": 1}
    assert len(RolloutGraph.load(log)) == 2


# ---------------------------------------------------------------- bad traffic


def _post(url: str, key: str, content: bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(
        f"{url}{path}",
        content=content,
        headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
        timeout=10,
    )


BAD_BODIES = [
    (b"{not json", 400, "not JSON"),
    (b"", 400, "not JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"model": "m"}', 400, "messages"),
    (b'{"messages": []}', 400, "messages"),
    (b'{"messages": [{"role": "user", "content": "a"}, "b"]}', 400, "messages[1]"),
    (b'{"messages": [{"content": "a"}]}', 400, "messages[0]"),
    (b'{"messages": [{"role": "user"}], "tools": {}}', 400, "tools"),
    (b'{"messages": [{"role": "user"}], "stream": "yes"}', 400, "stream"),
    (b'{"messages": [{"role": "user"}], "n": 2}', 400, "n must be 1"),
    (b'{"messages": [{"role": "user"}], "model": 3}', 400, "model"),
    (b'{"messages": [{"role": "user"}], "system": 3}', 400, "system"),
    (b"[" * 100_000, 400, "deeply"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_bad_bodies_get_4xx_and_record_nothing(server: Any, stub: Any, path: str) -> None:
    url, app = server
    session = new_session(url)
    graph = _graph(app, session["session_id"])
    before = stub[1].calls
    for content, status, reason in BAD_BODIES:
        if ("system" in reason and path != "/v1/messages") or (
            "n must" in reason and path == "/v1/messages"
        ):
            continue
        answer = _post(url, session["api_key"], content, path)
        assert answer.status_code == status, content[:60]
        error = answer.json()["error"]
        assert reason in error["message"] and "\n" not in error["message"], error
    assert stub[1].calls == before and len(graph) == 0


def test_too_large_body_is_refused(stub: Any) -> None:
    app = create_app(stub[0], max_body_bytes=1000)
    with serve_app(app) as url:
        session = new_session(url)
        big = json.dumps({"messages": [{"role": "user", "content": "x" * 2000}]}).encode()
        answer = _post(url, session["api_key"], big)
        assert (
            answer.status_code == 413 and "limit of 1000 bytes" in answer.json()["error"]["message"]
        )

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield big[:500]
            yield big[500:]

        answer = httpx.post(
            f"{url}/v1/chat/completions",
            content=chunks(),
            headers={"authorization": f"Bearer {session['api_key']}"},
        )
        assert answer.status_code == 413
        with pytest.raises(openai.APIStatusError) as caught:
            _openai(session).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x" * 2000}]
            )
        assert caught.value.status_code == 413
        assert len(_graph(app, session["session_id"])) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_upstream_errors_pass_through_and_record_nothing(server: Any, stream: bool) -> None:
    url, app = server
    session = new_session(url)
    client = _openai(session)
    with pytest.raises(openai.BadRequestError, match="refused on purpose"):
        client.chat.completions.create(
            model="stub-error", messages=[{"role": "user", "content": "q"}], stream=stream
        )
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(
            model="stub-500", messages=[{"role": "user", "content": "q"}], stream=stream
        )
    assert caught.value.status_code == 500
    with pytest.raises(anthropic.BadRequestError):
        _anthropic(session).messages.create(
            model="stub-error", max_tokens=5, messages=[{"role": "user", "content": "q"}]
        )
    answer = _post(
        url, session["api_key"], b'{"model": "stub-garbage", "messages": [{"role": "user"}]}'
    )
    assert answer.status_code == 502 and "not JSON" in answer.json()["error"]["message"]
    assert len(_graph(app, session["session_id"])) == 0
    assert (
        httpx.get(f"{url}/sessions/{session['session_id']}", headers=ADMIN).json()[
            "upstream_errors"
        ]
        == 3
    )


def test_upstream_hang_times_out_with_504(stub: Any) -> None:
    app = create_app(stub[0], upstream_timeout=0.5)
    with serve_app(app) as url:
        session = new_session(url)
        with pytest.raises(openai.APIStatusError) as caught:
            _openai(session, timeout=10).chat.completions.create(
                model="stub-hang", messages=[{"role": "user", "content": "q"}]
            )
        assert caught.value.status_code == 504
        with pytest.raises(anthropic.APIStatusError) as caught_a:
            _anthropic(session).messages.create(
                model="stub-hang", max_tokens=5, messages=[{"role": "user", "content": "q"}]
            )
        assert caught_a.value.status_code == 504
        assert len(_graph(app, session["session_id"])) == 0


def test_upstream_unreachable_is_502() -> None:
    with serve_app(create_app("http://127.0.0.1:9")) as url:
        session = new_session(url)
        with pytest.raises(openai.APIStatusError) as caught:
            _openai(session).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "q"}]
            )
        assert caught.value.status_code == 502


def test_client_disconnect_mid_stream_leaves_a_consistent_session(server: Any) -> None:
    url, app = server
    session = new_session(url)
    body = {"model": "m", "messages": [{"role": "user", "content": "one two"}], "stream": True}
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {session['api_key']}"},
    ) as answer:
        assert answer.status_code == 200
        next(answer.iter_raw(1))  # read a byte, then hang up
    # the next call continues the recorded turn
    messages = body["messages"] + [chat_response(body)["choices"][0]["message"]]
    messages += [{"role": "user", "content": "three"}]
    _openai(session).chat.completions.create(model="m", messages=messages)
    graph = _graph(app, session["session_id"])
    first, second = graph.node_ids()
    assert graph.parent(second) == first
    doc = json.loads(
        httpx.get(f"{url}/sessions/{session['session_id']}/export", headers=ADMIN).text
    )
    assert doc["stats"]["n_turns"] == 2


def test_an_abandoned_export_releases_the_session(server: Any) -> None:
    url, app = server
    session = new_session(url)
    client = _openai(session)
    big = {"type": "image_url", "image_url": {"url": IMAGE * 24}}  # 512 KiB, stored once
    for i in range(30):  # a 15 MiB export: more than the pipe and the sockets hold
        content = [{"type": "text", "text": f"turn {i}"}, big]
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}])
    with httpx.stream(
        "GET",
        f"{url}/sessions/{session['session_id']}/export",
        params={"messages": "1"},
        headers=ADMIN,
    ) as answer:
        next(answer.iter_raw(10))
    done = threading.Event()

    def record() -> None:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "after"}])
        done.set()

    threading.Thread(target=record, daemon=True).start()
    assert done.wait(10), "the export left the graph locked"
    assert len(_graph(app, session["session_id"])) == 31


# ---------------------------------------------------------------- stores and upstream bodies


def test_sessions_over_a_directory_store_reopen_from_logs_of_references(
    stub: Any, tmp_path: Path
) -> None:
    data, objects = tmp_path / "data", tmp_path / "objects"
    with serve_app(create_app(stub[0], data=data, store=DirectoryStore(objects))) as url:
        sessions = [new_session(url) for _ in range(3)]
        for session in sessions:
            _openai(session).chat.completions.create(model="m", messages=CONVERSATION)
        before = [export(url, s["session_id"]) for s in sessions]
    # the logs hold references: the screenshot is in the store once, in no log
    assert all(IMAGE.encode() not in p.read_bytes() for p in data.glob("*.rls"))
    assert len(list(objects.rglob("*"))) > 0
    app = create_app(stub[0], data=data, store=DirectoryStore(objects))
    with serve_app(app) as url:
        after = [export(url, s["session_id"]) for s in sessions]
    assert json.dumps(after) == json.dumps(before)
    assert json.dumps(after[0]["turns"][0]["request_messages"]) == json.dumps(CONVERSATION)


def test_open_store_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the directory store is made where the test runs
    assert isinstance(open_store("memory"), MemoryStore)
    assert isinstance(open_store("dir:objects-here"), DirectoryStore)
    for bad in ("disk", "dir:", "s3://", "ftp://x"):
        with pytest.raises(ValueError, match="unknown content store"):
            open_store(bad)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [{"role": "user", "content": "a"}]}',
        b'{"messages":[{"role":"user","content":"a"}],"model":"m"}  \n',
        b'{"messages": [], "stream": true, "stream_options": {"include_usage": true}}',
        b'{"messages": [], "logprobs": false}',
        b'{"messages": [], "n": 1e400, "x": NaN, "s": "\\ud800"}',
        b"{}",
        b" { }\t\r\n",
        b'{"messages": [{"role": "user", "content": " } "}] \n}\n',
        # json.loads reads UTF-16 and UTF-32 too: the capture keys cannot be appended as
        # UTF-8 bytes (big-endian, the text ends in the byte of its brace)
        pytest.param(
            '{"messages": [{"role": "user", "content": "a"}]}'.encode("utf-16-be"), id="utf-16-be"
        ),
        pytest.param(
            '{"messages": [{"role": "user", "content": "a"}]}'.encode("utf-32-be"), id="utf-32-be"
        ),
        pytest.param(
            '{"messages": [{"role": "user", "content": "a"}]}'.encode("utf-16-le"), id="utf-16-le"
        ),
    ],
)
def test_upstream_body_is_the_request_with_the_capture_keys(raw: bytes) -> None:
    body = json.loads(raw)
    extra = {
        k: v
        for k, v in {"stream": False, "logprobs": True}.items()
        if k not in body or k == "stream"
    }
    sent = json.loads(upstream_body(raw, body, extra))
    expected = {k: v for k, v in body.items() if k != "stream_options"}
    expected.update(extra)
    assert json.dumps(sent) == json.dumps(expected)
    assert list(sent) == list(expected)


@pytest.mark.slow
def test_a_long_wait_streams_keep_alive_comments_then_the_answer(stub: Any) -> None:
    app = create_app(stub[0], stream_keepalive=0.2, upstream_timeout=3)
    with serve_app(app) as url:
        session = new_session(url)
        messages = [{"role": "user", "content": "think long"}]
        stream = _openai(session).chat.completions.create(
            model="stub-slow", messages=messages, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert (
            text
            == chat_response({"model": "stub-slow", "messages": messages})["choices"][0]["message"][
                "content"
            ]
        )
        with _anthropic(session).messages.stream(
            model="stub-slow", max_tokens=9, messages=messages
        ) as events:
            assert events.get_final_message().stop_reason == "end_turn"
        raw = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "stub-slow", "messages": messages, "stream": True},
            headers={"authorization": f"Bearer {session['api_key']}"},
        ).text
        assert raw.startswith(": keep-alive\n\n") and raw.endswith("data: [DONE]\n\n")
        assert len(_graph(app, session["session_id"])) == 3


def test_a_failure_after_keep_alive_arrives_as_an_error_event(stub: Any) -> None:
    app = create_app(stub[0], stream_keepalive=0.2, upstream_timeout=0.7)
    with serve_app(app) as url:
        session = new_session(url)
        messages = [{"role": "user", "content": "never"}]
        with pytest.raises(openai.APIError, match="did not answer within"):
            for _ in _openai(session).chat.completions.create(
                model="stub-hang", messages=messages, stream=True
            ):
                pass
        with (
            pytest.raises(anthropic.APIStatusError, match="did not answer within"),
            _anthropic(session).messages.stream(
                model="stub-hang", max_tokens=9, messages=messages
            ) as events,
        ):
            events.get_final_message()
        assert len(_graph(app, session["session_id"])) == 0


def test_an_idle_session_lets_its_graph_go_and_reopens_on_the_next_call(
    stub: Any, tmp_path: Path
) -> None:
    app = create_app(stub[0], data=tmp_path / "data", idle_seconds=0.2, admin_key=ADMIN_KEY)
    with serve_app(app) as url:
        session = new_session(url)
        messages: list[Any] = [{"role": "user", "content": "first"}]
        reply = _openai(session).chat.completions.create(model="m", messages=messages)
        state = app.state.sessions.get(session["session_id"])
        deadline = time.monotonic() + 10
        while state.loaded and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not state.loaded
        info = httpx.get(f"{url}/sessions/{session['session_id']}", headers=ADMIN).json()
        assert info["turns"] == 1 and info["loaded"] is False  # counted without reopening
        messages += [reply.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "second"}]
        _openai(session).chat.completions.create(model="m", messages=messages)
        graph = _graph(app, session["session_id"])
        first, second = graph.node_ids()
        assert graph.parent(second) == first and graph.link_kind(second) == "tokens"
        assert export(url, session["session_id"])["stats"]["n_turns"] == 2


def test_an_idle_session_in_memory_lets_its_caches_go_and_links_as_before(stub: Any) -> None:
    # no token ids: turns link by their messages, raw, and each leaves its conversation a tip
    app = create_app(stub[0], idle_seconds=0.2, capture_tokens=False)
    with serve_app(app) as url:
        session = new_session(url)
        sid = session["session_id"]
        messages: list[Any] = [{"role": "user", "content": "first " * 200}]
        reply = _openai(session).chat.completions.create(model="m", messages=messages)
        graph, state = _graph(app, sid), app.state.sessions.get(sid)
        tips = graph._requests.raw_tips  # the conversation's tip, a hashing state
        assert tips._order
        deadline = time.monotonic() + 10
        while graph._requests.raw_tips is tips and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not graph._requests.raw_tips._order and state.loaded  # the graph stays
        messages += [reply.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "second"}]
        _openai(session).chat.completions.create(model="m", messages=messages)
        first, second = graph.node_ids()
        assert graph.parent(second) == first and graph.link_kind(second) == "messages"
        doc = export(url, sid)
        assert doc["stats"]["n_turns"] == 2
        assert json.dumps(graph.request_messages(second)) == json.dumps(messages)


def test_serve_refuses_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    from rollout_store.cli import main

    for argv in (
        ["serve"],
        ["serve", "--upstream", "http://127.0.0.1:9", "--fsync", "0"],
        ["serve", "--upstream", "http://127.0.0.1:9", "--store", "disk"],
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
    assert "--store" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["info", "some.rls", "--upstream", "x"])  # serve's options belong to serve


def test_an_upstream_answer_of_the_wrong_shape_is_502_and_recorded_nowhere() -> None:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    answers = [
        {"choices": []},
        {"choices": [{"message": "text"}]},
        {"prompt_token_ids": ["a"], "choices": [{"message": {"role": "assistant"}}]},
        {"content": "not blocks"},
    ]

    async def answer(request: Request) -> JSONResponse:
        return JSONResponse(answers.pop(0))

    routes = [Route(p, answer, methods=["POST"]) for p in ("/v1/chat/completions", "/v1/messages")]
    with serve_app(Starlette(routes=routes)) as upstream:
        app = create_app(upstream, admin_key=ADMIN_KEY)
        with serve_app(app) as url:
            session = new_session(url)
            body = json.dumps({"messages": [{"role": "user", "content": "q"}]}).encode()
            for path in ["/v1/chat/completions"] * 3 + ["/v1/messages"]:
                reply = _post(url, session["api_key"], body, path)
                assert reply.status_code == 502, reply.text
                assert "upstream" in reply.json()["error"]["message"]
            assert len(_graph(app, session["session_id"])) == 0
            assert (
                httpx.get(f"{url}/sessions/{session['session_id']}", headers=ADMIN).json()[
                    "rejected"
                ]
                == 1
            )


# ---------------------------------------------------------------- the viewer of a live session


def test_a_live_session_is_viewed_at_its_own_route(server: Any) -> None:
    from rollout_store.viewer.app import Viewer

    url, app = server
    made = new_session(url, session_id="viewed")
    script = "<script>alert(1)</script>"
    messages = [*CONVERSATION, {"role": "user", "content": script}]
    _openai(made).chat.completions.create(model="m", messages=messages)

    moved = httpx.get(f"{url}/sessions/viewed/view", headers=ADMIN)
    assert moved.status_code == 307 and moved.headers["location"] == "/sessions/viewed/view/"
    page = httpx.get(f"{url}/sessions/viewed/view/", headers=ADMIN)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "content-security-policy" in page.headers
    assert (
        httpx.get(f"{url}/sessions/viewed/view/static/viewer.js", headers=ADMIN).status_code == 200
    )

    # every answer is the one the file viewer gives for the same graph, byte for byte
    local = Viewer(_graph(app, "viewed"), title="viewed")
    rows = httpx.get(f"{url}/sessions/viewed/view/api/rows", params={"offset": 0}, headers=ADMIN)
    assert rows.status_code == 200
    assert rows.content == local.respond("/api/rows", "offset=0").body
    (row,) = rows.json()["rows"]
    turn = httpx.get(
        f"{url}/sessions/viewed/view/api/messages", params={"id": row["id"]}, headers=ADMIN
    )
    assert turn.content == local.respond("/api/messages", f"id={row['id']}").body
    assert script in turn.text  # carried as data for textContent, never as markup
    assert httpx.get(f"{url}/sessions/viewed/view/api/nothing", headers=ADMIN).status_code == 404
    assert httpx.get(f"{url}/sessions/nope/view/", headers=ADMIN).status_code == 404


def test_a_turn_waits_off_the_loop_while_another_thread_holds_the_graph(stub: Any) -> None:
    # a memory server adds turns in its event loop, but never waits there for the graph's
    # lock: an export holding it may be waiting for the loop to take what it wrote
    app = create_app(stub[0])
    with serve_app(app) as url:
        session = new_session(url)
        graph = _graph(app, session["session_id"])
        done: list[Any] = []
        with graph.lock:
            call = threading.Thread(
                target=lambda: done.append(
                    _openai(session).chat.completions.create(model="m", messages=CONVERSATION)
                )
            )
            call.start()
            time.sleep(0.3)
            health = httpx.get(f"{url}/health", timeout=5)  # the loop still answers
            assert health.status_code == 200 and not done and len(graph) == 0
        call.join(10)
        assert len(done) == 1 and len(graph) == 1


@pytest.mark.parametrize("store", ["memory", "directory"])
def test_an_idle_session_keeps_a_bounded_few_kib(tmp_path: Path, store: str) -> None:
    """An idle session over a log holds its counts only, however long it is: its graph goes,
    and the next use reopens it from the log (which re-links as before). What stays is in
    the shared content store, counted apart (a directory store keeps it on disk). Measured
    in a child process: this suite's fixtures keep every graph a test makes alive."""
    child = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve().parents[1] / "support" / "idle_memory.py"),
            str(tmp_path),
            store,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert child.returncode == 0, child.stderr[-2000:]
    figures = {int(k): v for k, v in json.loads(child.stdout).items()}
    for turns, (loaded, retained, relinked) in figures.items():
        assert relinked, turns  # the reopened graph links its last turn by tokens
        assert loaded > 10 * retained, figures
    (_, small, _), (_, large, _) = figures[4], figures[40]
    assert large < 8 * 1024 and abs(large - small) < 2 * 1024, figures


def test_the_stub_refuses_a_bad_generation_time() -> None:
    for latency, jitter in ((-1.0, 0.0), (0.1, 1.5), (float("nan"), 0.0)):
        with pytest.raises(ValueError):
            create_stub_app(latency=latency, jitter=jitter)


class Rewritten:
    """An ASGI wrapper handing on the stub's answers rewritten by `rewrite`, which gets the
    status, the headers (without content-length) and the whole body, and returns the headers
    and body to send."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def rewrite(self, status: int, headers: list[Any], body: bytes) -> tuple[list[Any], bytes]:
        raise NotImplementedError

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent: list[Any] = []

        async def keep(message: Any) -> None:
            sent.append(message)

        await self.app(scope, receive, keep)
        start, *bodies = sent
        body = b"".join(m.get("body", b"") for m in bodies)
        headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
        headers, body = self.rewrite(start["status"], headers, body)
        headers.append((b"content-length", str(len(body)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class Reformatted(Rewritten):
    """The stub's JSON answers in a spelling of their own (indented, non-ASCII escaped), as
    an engine's own bytes can differ from a re-encoding."""

    def rewrite(self, status: int, headers: list[Any], body: bytes) -> tuple[list[Any], bytes]:
        if status == 200 and body[:1] == b"{":
            value = json.loads(body)
            value["note"] = "caf\u00e9"
            body = json.dumps(value, indent=1).encode()
        return headers, body


@dataclass
class Through:
    """A capture server in front of an upstream app, with one session made."""

    upstream: str
    url: str
    app: Any
    session: dict[str, Any]
    auth: dict[str, str]


@contextmanager
def through_server(upstream_app: Any) -> Iterator[Through]:
    """Serve `upstream_app` and a capture server in front of it, with a session made."""
    with serve_app(upstream_app) as upstream:
        app = create_app(upstream, upstream_timeout=5)
        with serve_app(app) as url:
            session = new_session(url)
            auth = {"authorization": f"Bearer {session['api_key']}"}
            yield Through(upstream, url, app, session, auth)


def test_an_answer_with_nothing_to_take_out_is_the_upstreams_own_bytes() -> None:
    with through_server(Reformatted(create_stub_app())) as served:
        messages = [{"role": "user", "content": "hello"}]
        asked = {"model": "m", "messages": messages, "return_token_ids": True, "logprobs": True}
        direct = httpx.post(f"{served.upstream}/v1/chat/completions", json=asked, timeout=10)
        through = httpx.post(
            f"{served.url}/v1/chat/completions", json=asked, headers=served.auth, timeout=10
        )
        assert through.status_code == 200 and direct.content.startswith(b"{\n")
        assert through.content == direct.content  # the client asked for everything
        anthropic_body = {"model": "m", "max_tokens": 5, "messages": messages}
        direct = httpx.post(f"{served.upstream}/v1/messages", json=anthropic_body, timeout=10)
        through = httpx.post(
            f"{served.url}/v1/messages", json=anthropic_body, headers=served.auth, timeout=10
        )
        assert through.content == direct.content
        # the capture keys the server added are taken out: the answer is written anew
        plain = {"model": "m", "messages": messages}
        through = httpx.post(
            f"{served.url}/v1/chat/completions", json=plain, headers=served.auth, timeout=10
        )
        answer = through.json()
        assert "prompt_token_ids" not in answer and answer["choices"][0]["logprobs"] is None
        assert answer["note"] == "caf\u00e9" and not through.content.startswith(b"{\n")
        graph = _graph(served.app, served.session["session_id"])
        assert len(graph) == 3


class Cookies:
    """An ASGI wrapper setting a cookie in every answer and noting the cookies each request
    brings."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.sent: list[str | None] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        self.sent.append(headers[b"cookie"].decode() if b"cookie" in headers else None)

        async def with_cookie(message: Any) -> None:
            if message["type"] == "http.response.start":
                cookie = (b"set-cookie", f"seen={len(self.sent)}; Path=/".encode())
                message = {**message, "headers": [*message["headers"], cookie]}
            await send(message)

        await self.app(scope, receive, with_cookie)


def test_a_cookie_the_upstream_sets_goes_out_with_no_later_call() -> None:
    cookies = Cookies(create_stub_app())
    with serve_app(cookies) as upstream:
        # by its name: aiohttp's default jar keeps no cookies of an IP address
        upstream = upstream.replace("127.0.0.1", "localhost")
        with serve_app(create_app(upstream)) as url:
            for _ in range(2):  # two sessions of one server, one upstream client
                session = new_session(url)
                _openai(session).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}]
                )
    assert cookies.sent == [None, None]


def test_a_client_that_leaves_a_call_that_does_not_stream_leaves_a_consistent_session(
    server: Any, stub: tuple[str, Counting]
) -> None:
    """The call, awaited in its handler's task, is not abandoned with the client: the upstream's
    answer is recorded once, and the next call continues it."""
    url, app = server
    calls = stub[1].calls
    session = new_session(url)
    body = {"model": "stub-slow", "messages": [{"role": "user", "content": "left early"}]}
    content = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\n"
            + f"authorization: Bearer {session['api_key']}\r\n".encode()
            + f"content-length: {len(content)}\r\n\r\n".encode()
            + content
        )
        for _ in range(500):  # the stub answers a second after the call reaches it
            if stub[1].calls > calls:
                break
            time.sleep(0.01)
        assert stub[1].calls == calls + 1  # hang up while the upstream works
    info = f"{url}/sessions/{session['session_id']}"
    for _ in range(100):
        if httpx.get(info, headers=ADMIN).json()["turns"]:
            break
        time.sleep(0.1)
    time.sleep(0.3)  # (nothing more arrives)
    doc = httpx.get(info, headers=ADMIN).json()
    assert doc["turns"] == 1 and doc["upstream_errors"] == 0 and doc["rejected"] == 0
    graph = _graph(app, session["session_id"])
    (first,) = graph.node_ids()
    messages = body["messages"] + [chat_response(body)["choices"][0]["message"]]
    messages += [{"role": "user", "content": "back"}]
    _openai(session).chat.completions.create(model="m", messages=messages)
    assert graph.parent(graph.node_ids()[1]) == first


class Utf16(Rewritten):
    """The stub's JSON answers in UTF-16 (which json.loads reads), saying so in their
    content type."""

    def rewrite(self, status: int, headers: list[Any], body: bytes) -> tuple[list[Any], bytes]:
        if status == 200 and body[:1] == b"{":
            body = body.decode().encode("utf-16")
            headers = [(k, v) for k, v in headers if k.lower() != b"content-type"]
            headers.append((b"content-type", b"application/json; charset=utf-16"))
        return headers, body


def test_an_answer_that_is_not_utf8_reaches_the_client_as_utf8() -> None:
    """The engine's own bytes are handed on only when they are UTF-8: the server's answer says
    no charset, so another encoding is written anew (as the server did before)."""
    with through_server(Utf16(create_stub_app())) as served:
        messages = [{"role": "user", "content": "caf\u00e9"}]
        asked = {"model": "m", "messages": messages, "return_token_ids": True, "logprobs": True}
        anthropic_body = {"model": "m", "max_tokens": 5, "messages": messages}
        for path, body in (("chat/completions", asked), ("messages", anthropic_body)):
            direct = httpx.post(f"{served.upstream}/v1/{path}", json=body, timeout=10)
            assert direct.content[:2] == b"\xff\xfe"
            through = httpx.post(
                f"{served.url}/v1/{path}", json=body, headers=served.auth, timeout=10
            )
            assert through.status_code == 200
            assert json.loads(through.content.decode("utf-8")) == direct.json()
        assert len(_graph(served.app, served.session["session_id"])) == 2


def test_root_lists_sessions_favicon_and_n_tools_counts_the_tools_sent(server: Any) -> None:
    url, _ = server
    session = new_session(url)
    tools = [{"type": "function", "function": {"name": n}} for n in ("look", "move")]
    _openai(session).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=tools
    )
    listed = httpx.get(f"{url}/sessions", headers=ADMIN).json()
    root = httpx.get(f"{url}/", headers=ADMIN)
    assert root.status_code == 200
    ignore = ("idle_s",)  # (time passes between the two calls)
    assert [{k: v for k, v in s.items() if k not in ignore} for s in root.json()["sessions"]] == [
        {k: v for k, v in s.items() if k not in ignore} for s in listed["sessions"]
    ]
    assert session["session_id"] in [s["session_id"] for s in root.json()["sessions"]]
    icon = httpx.get(f"{url}/favicon.ico")
    assert icon.status_code == 200 and icon.content.startswith(b"<svg")
    doc = httpx.get(
        f"{url}/sessions/{session['session_id']}/export", headers=auth(session["session_id"])
    ).json()
    assert [t["n_tools"] for t in doc["turns"]] == [2]
    page = httpx.get(
        f"{url}/sessions/{session['session_id']}/view/api/turn",
        params={"id": doc["turns"][0]["node_id"]},
        headers=auth(session["session_id"]),
    )
    assert page.json()["summary"]["n_tools"] == 2
    # Anthropic's tools are counted alike; the session's labels show in its viewer
    labelled = new_session(url, metadata={"labels": ["nightly", "web"]})
    _anthropic(labelled).messages.create(
        model="claude-x",
        max_tokens=64,
        system="Be exact.",
        tools=[{"name": "look", "input_schema": {"type": "object"}}],
        messages=[{"role": "user", "content": "look"}],
    )
    doc = httpx.get(f"{url}/sessions/{labelled['session_id']}/export", headers=ADMIN).json()
    assert [t["n_tools"] for t in doc["turns"]] == [1]
    figures = httpx.get(
        f"{url}/sessions/{labelled['session_id']}/view/api/figures", headers=ADMIN
    ).json()
    assert figures["labels"] == ["nightly", "web"] and figures["title"] == labelled["session_id"]


def test_a_browser_opens_the_root_with_a_key_and_gets_the_sessions_as_a_page(server: Any) -> None:
    """A browser sends no headers: `/?key=` moves the key into an HttpOnly cookie and reloads
    without it; the page lists the sessions the key opens, each linked to its viewer, which
    the same cookie opens."""
    url, _ = server
    session = new_session(url)
    _openai(session).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}]
    )
    browser = {"accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
    assert httpx.get(f"{url}/", headers=browser).status_code == 401
    with httpx.Client(base_url=url, headers=browser) as client:
        moved = client.get("/", params={"key": ADMIN["authorization"].split()[1]})
        assert moved.status_code == 303 and moved.headers["location"] == "/"
        assert "key=" not in moved.headers["location"]
        cookie = moved.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/" in cookie
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        sid = session["session_id"]
        assert f'href="/sessions/{sid}/view/"' in page.text
        viewer = client.get(f"/sessions/{sid}/view/")
        assert viewer.status_code == 200 and "<html" in viewer.text.lower()
    with httpx.Client(base_url=url, headers=browser) as other:
        other.get("/", params={"key": session["api_key"]})
        own = other.get("/")
        assert own.status_code == 200 and f"/sessions/{sid}/view/" in own.text
        # the cookie opens the root and the viewers only
        assert other.get("/sessions").status_code == 401

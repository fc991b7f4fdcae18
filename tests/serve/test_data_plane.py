"""The Rust data plane (`serve --data-plane rust`) beside the Python server: the same bytes to
the client, refusals included, and the same turns recorded, in both ack modes; its key table
follows the sessions; open mode resolves unknown keys in the control plane.
(The rest of the server's tests run against it with ROLLOUT_STORE_DATA_PLANE=rust.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from capture_support import (
    ADMIN,
    ADMIN_KEY,
    Counting,
    auth,
    new_session,
    serve_app,
    start_server_process,
    start_stub_process,
)

from rollout_store.serve import server as server_module
from rollout_store.serve.server import CALLERS, RustDataPlane, _Server, create_app
from rollout_store.serve.sessions import Sessions
from rollout_store.serve.stub_engine import create_stub_app

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something, with a float 1.0 and a \u00e9."},
]


def _calls(url: str, key: str) -> list[tuple[int, str, bytes]]:
    """A little of every call, good and bad: each answer's status, type and bytes."""
    bearer = {"authorization": f"Bearer {key}"}
    deep: Any = 1
    for _ in range(510):
        deep = [deep]
    sent: list[tuple[str, dict[str, str], bytes]] = [
        ("/v1/chat/completions", bearer, json.dumps({"model": "m", "messages": MESSAGES}).encode()),
        (
            "/v1/chat/completions",
            bearer,
            json.dumps({"model": "m", "messages": MESSAGES, "stream": True}).encode(),
        ),
        (
            "/v1/messages",
            {"x-api-key": key},
            json.dumps(
                {"model": "m", "max_tokens": 9, "system": "Be brief.", "messages": MESSAGES[1:]}
            ).encode(),
        ),
        ("/v1/chat/completions", {"authorization": "Bearer nope"}, b"{}"),
        ("/v1/chat/completions", {**bearer, "content-type": "text/plain"}, b"{}"),
        ("/v1/chat/completions", {**bearer, "host": "evil.example"}, b"{}"),
        ("/v1/chat/completions", bearer, b'{"messages": [], "x": 1'),
        ("/v1/chat/completions", bearer, json.dumps({"messages": MESSAGES, "n": 2}).encode()),
        ("/v1/messages", bearer, json.dumps({"messages": MESSAGES, "tools": deep}).encode()),
    ]
    answers = []
    for path, headers, body in sent:
        answer = httpx.post(
            url + path,
            content=body,
            headers={"content-type": "application/json", **headers},
            timeout=20,
        )
        answers.append((answer.status_code, answer.headers.get("content-type", ""), answer.content))
    return answers


def _export(url: str, session_id: str) -> dict[str, Any]:
    answer = httpx.get(
        f"{url}/sessions/{session_id}/export", params={"messages": "1"}, headers=auth(session_id)
    )
    answer.raise_for_status()
    doc: dict[str, Any] = answer.json()
    for turn in doc["turns"]:
        timeline = turn.pop("timeline")
        assert timeline["engine_ms"] > 0  # every answered call has its timeline
    return doc


@pytest.mark.parametrize("ack", ["durable", "fast"])
def test_both_planes_answer_and_record_alike(stub: str, ack: str) -> None:
    seen = {}
    for plane in ("python", "rust"):
        app = create_app(stub, ack=ack, admin_key=ADMIN_KEY)
        with serve_app(app, data_plane=plane) as url:
            session = new_session(url, session_id="same")
            answers = _calls(url, session["api_key"])
            doc = _export(url, "same")
            health = httpx.get(f"{url}/health").json()
            assert (app.state.server.plane is None) == (plane == "python")
        assert app.state.server.plane is None  # stopped with the app
        assert health["dropped"] == 0 and health["ack"] == ack
        seen[plane] = answers, doc
    python, rust = seen["python"], seen["rust"]
    assert [a[0] for a in rust[0]] == [200, 200, 200, 401, 415, 403, 400, 400, 400]
    assert rust[0] == python[0]
    assert len(rust[1]["turns"]) == 3
    assert rust[1]["turns"] == python[1]["turns"]
    assert rust[1]["sequences"] == python[1]["sequences"]


def _read_whole_or_not() -> list[bytes]:
    """Bodies on either side of what the engine's reading tells the control plane it checked
    (depth, the messages' shape, strict UTF-8)."""
    deep = "[" * 2000 + "1" + "]" * 2000
    return [
        b'{"model": "m", "messages": [{"role": "user", "content": "hi", "role": 2}]}',
        b'{"model": "m", "messages": [{"role": 2, "content": "hi", "r\\u006fle": "user"}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": "\xed\xa0\x80 caf\xc3\xa9"}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": "\xff"}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"model": "m", "messages": []}',
        b'{"model": "m", "messages": [{"role": "user"}, 1]}',
        b'{"model": "m", "messages": {"role": "user"}}',
        b'{"model": "m", "x\\ud800": 1, "messages": [{"role": "user", "content": "hi"}]}',
        b'{"model": "m", "d\\u0065ep": ' + deep.encode() + b', "messages": [{"role": "user"}]}',
        json.dumps({"model": "m", "messages": MESSAGES}).encode("utf-16"),
    ]


def test_what_the_engine_read_of_a_body_is_answered_as_the_python_plane_answers(
    stub: str,
) -> None:
    seen = _answers_of_both_planes(
        stub, [("/v1/chat/completions", body) for body in _read_whole_or_not()]
    )
    python, rust = seen["python"], seen["rust"]
    assert [a[0] for a in rust[0]] == [400, 200, 200, 400, 200, 400, 400, 400, 200, 400, 200]
    assert rust[0] == python[0]
    assert len(rust[1]) == 5 and rust[1] == python[1]


def _answers_of_both_planes(
    stub: str, bodies: list[tuple[str, bytes]], damaged: str | None = None
) -> dict[str, tuple[list[tuple[int, bytes]], list[Any]]]:
    """Each plane's answers (status, bytes) to the bodies (each with its route), one session
    (marked damaged with that reason, if given), and the turns it recorded."""
    seen = {}
    for plane in ("python", "rust"):
        app = create_app(stub, admin_key=ADMIN_KEY)
        with serve_app(app, data_plane=plane) as url:
            session = new_session(url, session_id="same")
            app.state.sessions.get("same").damaged = damaged
            bearer = {"authorization": f"Bearer {session['api_key']}"}
            answers = []
            for path, body in bodies:
                answer = httpx.post(
                    f"{url}{path}",
                    content=body,
                    headers={"content-type": "application/json", **bearer},
                    timeout=20,
                )
                answers.append((answer.status_code, answer.content))
            app.state.sessions.get("same").damaged = None
            seen[plane] = answers, _export(url, "same")["turns"]
    return seen


def _nested(n: int) -> str:
    return "[" * n + "1" + "]" * n


def _past_the_parsers_bound() -> list[bytes]:
    """Bodies nesting deeper than the engine's parser reads (its depth check then scans the
    brackets of each top-level field): a field repeated or spelled with an escape (its last
    value is the one json.loads keeps), a body that ends inside the deep field, the same in
    UTF-16 and UTF-32 (json.loads reads them; the scan must not read their bytes as UTF-8),
    and one each plane refuses as too deep."""
    deep = _nested(600)
    messages = json.dumps(MESSAGES)
    texts = [
        f'{{"model": "m", "x": {deep}, "messages": {messages}, "x": 1}}',
        f'{{"model": "m", "tools": {deep}, "t\\u006fols": [], "messages": {messages}}}',
        f'{{"model": "m", "messages": {messages}, "tools": {"[" * 600}',
        f'{{"model": "m", "messages": {messages}, "tools": {deep}}}',
    ]
    return [t.encode(codec) for t in texts for codec in ("utf-8", "utf-16-le", "utf-32-le")]


def test_a_body_past_the_parsers_bound_is_answered_as_the_python_plane_answers(
    stub: str,
) -> None:
    chat = "/v1/chat/completions"
    seen = _answers_of_both_planes(stub, [(chat, body) for body in _past_the_parsers_bound()])
    python, rust = seen["python"], seen["rust"]
    assert [a[0] for a in python[0]] == [200] * 6 + [400] * 6
    assert rust[0] == python[0]
    assert len(rust[1]) == 6 and rust[1] == python[1]


def test_a_field_too_deep_whose_key_holds_a_lone_surrogate_is_refused_by_name(
    stub: str,
) -> None:
    """The refusal names the first field too deep, in the body's order, a key json.loads
    reads with a lone surrogate too (escaped in the answer: no UTF-8 text holds it), and
    both planes name the same one."""
    messages = json.dumps(MESSAGES)
    texts = [
        f'{{"\\ud800": {_nested(501)}, "messages": {messages}}}',
        f'{{"\\ud800": {_nested(501)}, "x": {_nested(501)}, "messages": {messages}}}',
        f'{{"\\ud800": {_nested(700)}, "messages": {messages}}}',
    ]
    seen = _answers_of_both_planes(stub, [("/v1/chat/completions", t.encode()) for t in texts])
    for status, content in seen["python"][0]:
        assert status == 400, content
        reason = json.loads(content)["error"]["message"]
        assert reason.startswith("the request cannot be recorded: \ud800 nests deeper"), reason
    assert seen["rust"] == seen["python"]


def test_a_body_too_deep_and_wrong_otherwise_is_refused_as_too_deep_by_both_planes(
    stub: str,
) -> None:
    """The engine refuses a body it read whole with a field too deep before the control plane
    sees it: the Python plane checks the depth first too, so both give the same reason for a
    body also wrong in another way (the messages' shape, a field's type)."""
    messages = json.dumps(MESSAGES)
    chat, anthropic = "/v1/chat/completions", "/v1/messages"
    bodies = [
        (chat, f'{{"messages": {{"a": {_nested(501)}}}}}'),
        (chat, f'{{"messages": [{_nested(501)}]}}'),
        (chat, f'{{"messages": {messages}, "stream": "yes", "tools": {_nested(501)}}}'),
        (chat, f'{{"messages": {messages}, "n": 2, "tools": {_nested(501)}}}'),
        (chat, f'{{"model": 3, "messages": {messages}, "temperature": {_nested(500)}}}'),
        (chat, f'{{"tools": {{}}, "messages": {messages}, "temperature": {_nested(500)}}}'),
        (chat, f'{{"messages": {messages}, "stream_options": 1, "x": {_nested(500)}}}'),
        (anthropic, f'{{"messages": {messages}, "system": 5, "metadata": {_nested(500)}}}'),
        (anthropic, f'{{"messages": [], "system": {_nested(500)}}}'),
    ]
    seen = _answers_of_both_planes(stub, [(path, text.encode()) for path, text in bodies])
    named = []
    for status, content in seen["python"][0]:
        assert status == 400, content
        reason = json.loads(content)["error"]["message"]
        assert reason.startswith("the request cannot be recorded: "), reason
        named.append(reason.split(": ")[1].split(" ")[0])
    assert named == [
        "messages", "messages", "tools", "tools", "temperature", "temperature", "x",
        "metadata", "system",
    ]  # fmt: skip
    assert seen["rust"] == seen["python"]


_MESSAGES_TEXT = json.dumps(MESSAGES)
_DAMAGE = "object abc is damaged: run rollout-store recover"


@pytest.mark.parametrize(
    ("body", "damaged", "status", "reason"),
    [
        pytest.param(
            f'{{"messages": {_MESSAGES_TEXT}, "x": {_nested(600)}, "y": }}',
            None, 400, "the request cannot be recorded: x nests deeper", id="deep-then-broken",
        ),
        pytest.param(
            f'{{"y": tru, "messages": {_MESSAGES_TEXT}, "x": {_nested(510)}}}',
            None, 400, "the body is not JSON: Expecting value", id="broken-then-deep",
        ),
        pytest.param(
            f'{{"messages": {_MESSAGES_TEXT}, "seed": {"1" * 5000}, "tools": {_nested(501)}}}',
            None, 400, "the request cannot be recorded: tools nests deeper", id="deep-big-int",
        ),
        pytest.param(
            f'{{"messages": {_MESSAGES_TEXT}, "x": {_nested(1000)}}}',
            None, 400, "the request cannot be recorded: x nests deeper", id="past-json-loads",
        ),
        pytest.param(
            f'{{"messages": [{{"role": "user", "content": {_nested(3000)}}}]}}',
            None, 400, "the request cannot be recorded: messages nests deeper", id="far-past",
        ),
        pytest.param(
            f'{{"messages": {_MESSAGES_TEXT}, "tools": {_nested(600)}}}',
            _DAMAGE, 400, "the request cannot be recorded: tools nests deeper", id="damaged-deep",
        ),
        pytest.param(
            f'{{"messages": {_MESSAGES_TEXT}, "tools": {_nested(501)}}}',
            _DAMAGE, 400, "the request cannot be recorded: tools nests deeper", id="damaged-501",
        ),
        pytest.param(
            f'{{"messages": {_MESSAGES_TEXT}, "x": ', _DAMAGE, 409,
            "the session cannot record: object abc", id="damaged-broken",
        ),
    ],
)  # fmt: skip
def test_a_body_too_deep_is_refused_for_that_first_by_both_planes(
    stub: str, body: str, damaged: str | None, status: int, reason: str
) -> None:
    """A body holding a field too deep is refused for that (400) by both planes, whatever
    else is wrong with it and whatever json.loads says of it, in the order the Rust plane's
    engine checks: also when it is not JSON past the parser's bound (a fault the engine
    reads before it, it names), when it holds an int json.loads cannot convert, when
    json.loads gives up on its depth (its RecursionError), and when its session cannot
    record (409 otherwise). Before, the Python plane gave json.loads' reason, "the body
    nests too deeply to record", or 409 for these, where the Rust plane named the field."""
    seen = _answers_of_both_planes(stub, [("/v1/chat/completions", body.encode())], damaged)
    ((python_status, python_body),) = seen["python"][0]
    ((rust_status, rust_body),) = seen["rust"][0]
    python_reason = json.loads(python_body)["error"]["message"]
    rust_reason = json.loads(rust_body)["error"]["message"]
    assert (rust_status, rust_reason) == (python_status, python_reason)
    assert python_status == status and python_reason.startswith(reason), python_reason
    assert seen["python"][1] == seen["rust"][1] == []


def test_an_int_json_loads_cannot_convert_that_a_repeated_key_replaces_is_refused(
    stub: str,
) -> None:
    """json.loads decodes every value of a repeated key, and refuses an int of more digits
    than Python converts even where a later value replaces it: both planes refuse such a
    body as they refuse it without the repeat (json.loads' reason), before the upstream;
    before, the split kept only the last value and the body went upstream. An int deep in
    the messages (which stay undecoded) is refused too, alike by both planes, recording
    nothing."""
    messages = json.dumps(MESSAGES)
    big = "1" * 5000
    chat = "/v1/chat/completions"
    alone = f'{{"model": "m", "messages": {messages}, "x": {big}}}'
    top = [
        alone,
        f'{{"model": "m", "messages": {messages}, "x": {big}, "x": 1}}',
        f'{{"model": "m", "x": -{big}, "messages": {messages}, "x": 1}}',
        f'{{"model": "m", "x": [{big}], "messages": {messages}, "x": 1, "x": 2}}',
        f'{{"model": "m", "messages": {messages}, "messages": {messages}, "n": {big}, "n": 1}}',
    ]
    message = f'{{"role": "user", "content": "a", "x": {big}, "x": 1}}'
    nested = [f'{{"model": "m", "messages": [{message}]}}']
    seen = _answers_of_both_planes(stub, [(chat, t.encode()) for t in top + nested])
    python, rust = seen["python"], seen["rust"]
    refusal = python[0][0]
    assert refusal[0] == 400
    reason = json.loads(refusal[1])["error"]["message"]
    assert reason.startswith("the body is not JSON: Exceeds the limit"), reason
    assert python[0][: len(top)] == [refusal] * len(top)
    assert python[0][-1][0] == 400
    assert rust[0] == python[0]
    assert python[1] == rust[1] == []


def _digit_bodies(limit: int) -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
    """Bodies whose raw fields (messages, tools, Anthropic's system: not decoded before they
    go upstream) hold an int of more digits than `limit`, each with its route and the field
    named, streaming ones and one also wrong in another way (`n`) among them; and bodies on
    the other side of the line: an int of `limit` digits, more digits in a string and in
    floats."""
    big, most = "1" * (limit + 1), "9" * limit
    chat, anthropic = "/v1/chat/completions", "/v1/messages"
    user = '{"role": "user", "content": "x"}'

    def message(key: str, value: str) -> str:
        return f'[{{"role": "user", "content": "x", "{key}": {value}}}]'

    inner = f'{{"y": {big}}}'
    refused = [
        (chat, f'{{"model": "m", "messages": {message("n", big)}}}', "messages"),
        (chat, f'{{"model": "m", "messages": [{user}], "tools": [{{"f": [-{big}]}}]}}', "tools"),
        (chat, f'{{"messages": {message("c", f"[{big}]")}, "stream": true}}', "messages"),
        (chat, f'{{"messages": {message("x", inner)}, "n": 2}}', "messages"),
        (chat, f'{{"messages": [{user}], "messages": {message("x", big)}}}', "messages"),
        (anthropic, f'{{"max_tokens": 5, "messages": {message("n", big)}}}', "messages"),
        (anthropic, f'{{"messages": [{user}], "system": {message("n", big)}}}', "system"),
        (anthropic, f'{{"messages": [{user}], "stream": true, "tools": [{big}]}}', "tools"),
    ]
    floats, tools = f"[0.{big}, 1{big}.5, 1e{big[:3]}]", f"[{most}]"
    passed = [
        (chat, f'{{"model": "m", "messages": {message("n", most)}}}'),
        (chat, f'{{"model": "m", "messages": [{{"role": "user", "content": "{big}"}}]}}'),
        (chat, f'{{"messages": {message("f", floats)}}}'),
        (anthropic, f'{{"max_tokens": 5, "messages": [{user}], "tools": {tools}, "stream": true}}'),
    ]
    return refused, passed


def test_an_int_json_loads_cannot_convert_in_the_raw_fields_never_goes_upstream() -> None:
    """An int of more digits than Python converts inside the messages, the tools or
    Anthropic's system (kept raw: nothing decodes them before the upstream) is refused by
    both planes with the same 400, naming the field, as a field too deep is refused: before
    anything reaches the upstream (streaming or not), and no turn is recorded. Before, such
    a body went upstream and only its recording could find it cannot be. An int of as many
    digits as Python converts, and digits in a string or a float, still go upstream."""
    limit = sys.get_int_max_str_digits()
    if limit == 0:
        pytest.skip("this interpreter converts ints of any length")
    refused, passed = _digit_bodies(limit)
    seen = {}
    for plane in ("python", "rust"):
        counting = Counting(create_stub_app())
        with serve_app(counting) as stub:
            app = create_app(stub, admin_key=ADMIN_KEY)
            with serve_app(app, data_plane=plane) as url:
                session = new_session(url, session_id="same")
                bearer = {"authorization": f"Bearer {session['api_key']}"}
                answers = []
                for path, body, _ in refused:
                    answer = httpx.post(
                        f"{url}{path}",
                        content=body.encode(),
                        headers={"content-type": "application/json", **bearer},
                        timeout=20,
                    )
                    answers.append((answer.status_code, answer.content))
                assert counting.calls == 0, plane  # nothing went upstream
                assert _export(url, "same")["turns"] == []
                for path, body in passed:
                    answer = httpx.post(
                        f"{url}{path}",
                        content=body.encode(),
                        headers={"content-type": "application/json", **bearer},
                        timeout=20,
                    )
                    assert answer.status_code == 200, (plane, answer.text[:300])
                assert counting.calls == len(passed), plane
                assert len(_export(url, "same")["turns"]) == len(passed)
        seen[plane] = answers
    for (status, content), (_, _, field) in zip(seen["python"], refused, strict=True):
        assert status == 400, content[:300]
        reason = json.loads(content)["error"]["message"]
        assert reason.startswith(
            f"the request cannot be recorded: {field} holds an int of more than {limit} digits"
        ), reason
        assert reason.endswith("(refused before the call went upstream)"), reason
    assert seen["rust"] == seen["python"]


def test_the_key_table_follows_the_sessions(stub: str) -> None:
    app = create_app(stub, admin_key=ADMIN_KEY)
    body = {"model": "m", "messages": MESSAGES}
    with serve_app(app, data_plane="rust") as url:
        made = new_session(url)
        bearer = {"authorization": f"Bearer {made['api_key']}"}
        call = f"{url}/v1/chat/completions"
        assert httpx.post(call, json=body, headers=bearer).status_code == 200
        deleted = httpx.delete(f"{url}/sessions/{made['session_id']}", headers=bearer)
        assert deleted.status_code == 200
        assert httpx.post(call, json=body, headers=bearer).status_code == 401
        again = new_session(url, session_id=made["session_id"])
        assert again["api_key"] != made["api_key"]
        assert httpx.post(call, json=body, headers=bearer).status_code == 401
        fresh = {"authorization": f"Bearer {again['api_key']}"}
        assert httpx.post(call, json=body, headers=fresh).status_code == 200
        info = httpx.get(f"{url}/sessions/{again['session_id']}", headers=fresh).json()
        assert info["turns"] == 1


def test_the_key_tables_session_is_taken_only_when_the_key_is_its_own() -> None:
    sessions = Sessions()
    try:
        a, b = sessions.create("a"), sessions.create("b")
        assert sessions.by_key(a.api_key, "a") is a
        assert sessions.by_key(a.api_key, "b") is a  # a stale table: found by the key itself
        assert sessions.by_key(a.api_key, "gone") is a
        assert sessions.by_key(b.api_key + "x", "b") is None
        assert sessions.resolve(b.api_key, "a") is b
        assert sessions.resolve("nope", "a") is None
    finally:
        sessions.close()


def test_open_mode_resolves_unknown_keys_in_the_control_plane(stub: str) -> None:
    app = create_app(stub, open_mode=True, admin_key=ADMIN_KEY)
    body = {"model": "m", "messages": MESSAGES}
    with serve_app(app, data_plane="rust") as url:
        keyed = new_session(url)
        call = f"{url}/v1/chat/completions"
        made = httpx.post(call, json=body, headers={"authorization": "Bearer run-7"})
        assert made.status_code == 200
        assert app.state.sessions.get("run-7") is not None
        # a keyed session's id is never a key in open mode
        sneaking = {"authorization": f"Bearer {keyed['session_id']}"}
        assert httpx.post(call, json=body, headers=sneaking).status_code == 401


@pytest.mark.slow
def test_serve_with_the_rust_plane_stops_with_every_answered_turn_recorded(tmp_path: Any) -> None:
    stub = start_stub_process()
    data = str(tmp_path / "d")
    try:
        server = start_server_process(
            stub.url, "--data", data, "--data-plane", "rust", "--ack", "fast"
        )
        try:
            made = new_session(server.url)
            bearer = {"authorization": f"Bearer {made['api_key']}"}
            for i in range(3):
                answer = httpx.post(
                    f"{server.url}/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": f"call {i}"}]},
                    headers=bearer,
                    timeout=20,
                )
                assert answer.status_code == 200 and "server" not in answer.headers
            assert httpx.get(f"{server.url}/health").json()["ack"] == "fast"
        finally:
            server.stop()  # SIGTERM: the queued turns are recorded before it exits
        again = start_server_process(stub.url, "--data", data, "--data-plane", "python")
        try:
            info = httpx.get(f"{again.url}/sessions/{made['session_id']}", headers=bearer).json()
            assert info["turns"] == 3 and info["dropped"] == 0
        finally:
            again.stop()
    finally:
        stub.kill()


def _chat(url: str, key: str, text: str, timeout: float = 20) -> int:
    answer = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": text}]},
        headers={"authorization": f"Bearer {key}"},
        timeout=timeout,
    )
    return answer.status_code


@pytest.mark.parametrize("plane", ["python", "rust"])
@pytest.mark.parametrize("fsync", ["never", "turn"])
def test_a_session_whose_graph_is_held_holds_up_no_other_session(
    stub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plane: str, fsync: str
) -> None:
    """While a thread holds one session's graph (as an export read slowly holds it), that
    session's calls wait for it and every other session's are answered: with one thread for
    the Rust plane's callbacks (`fsync` never: a turn added without waiting on I/O), and
    with more calls waiting than it has threads (`fsync` turn)."""
    recording = [0]
    record_now = _Server.record_now

    def counted(self: _Server, session: Any, node: Any) -> str:
        recording[0] += 1
        return record_now(self, session, node)

    monkeypatch.setattr(_Server, "record_now", counted)
    waiting = 1 if fsync == "never" else CALLERS + 1
    app = create_app(stub, data=tmp_path, fsync=fsync, admin_key=ADMIN_KEY)
    with serve_app(app, data_plane=plane) as url:
        held, free = new_session(url, session_id="held"), new_session(url, session_id="free")
        statuses: list[int] = []
        with app.state.server.sessions.get("held").graph.lock:
            calls = [
                threading.Thread(
                    target=lambda i=i: statuses.append(_chat(url, held["api_key"], f"held {i}"))
                )
                for i in range(waiting)
            ]
            for call in calls:
                call.start()
            deadline = time.monotonic() + 5
            while recording[0] < waiting and time.monotonic() < deadline:
                time.sleep(0.01)  # until each waits for the graph
            assert _chat(url, free["api_key"], "free", timeout=5) == 200
            assert all(call.is_alive() for call in calls)  # still waiting: the graph is held
        for call in calls:
            call.join(20)
        assert statuses == [200] * waiting
        assert len(_export(url, "held")["turns"]) == waiting
        assert len(_export(url, "free")["turns"]) == 1


@pytest.mark.parametrize("plane", ["python", "rust"])
@pytest.mark.parametrize("fsync", ["never", "turn"])
def test_an_idle_sweep_while_a_turn_is_recorded_neither_waits_nor_loses_it(
    stub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plane: str, fsync: str
) -> None:
    """An idle sweep of a session (`release_if_idle`) that comes while one of its turns is
    being recorded: it is not held up by the recording (which would wait for it in turn),
    and the turn is recorded."""
    swept: list[bool] = []
    record_now = _Server.record_now

    def swept_first(self: _Server, session: Any, node: Any) -> str:
        sweep = threading.Thread(target=lambda: swept.append(session.release_if_idle(0)))
        sweep.start()
        sweep.join(2)
        if sweep.is_alive():  # it waits for this thread: end the call for it to go on
            raise RuntimeError("the idle sweep waits for the recording")
        return record_now(self, session, node)

    monkeypatch.setattr(_Server, "record_now", swept_first)
    app = create_app(stub, data=tmp_path, fsync=fsync, admin_key=ADMIN_KEY)
    with serve_app(app, data_plane=plane) as url:
        made = new_session(url, session_id="swept")
        assert _chat(url, made["api_key"], "recorded while swept") == 200
        monkeypatch.undo()
        assert len(swept) == 1
        assert len(_export(url, "swept")["turns"]) == 1


def test_a_stopping_rust_plane_counts_the_fast_turns_of_the_calls_it_cut(
    stub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calls in flight when the server stops are cut: a turn answered into the ack ledger
    and never queued is counted as dropped at the stop (`shutdown`), never as a turn lost
    with a killed process at the next start."""
    finished: list[bool] = []
    begun = threading.Event()
    finish = RustDataPlane.finish

    def slow(self: RustDataPlane, call: Any, *args: Any) -> Any:
        begun.set()
        time.sleep(0.3)  # the stop comes meanwhile
        answer = finish(self, call, *args)
        finished.append(answer[1])
        return answer

    monkeypatch.setattr(RustDataPlane, "finish", slow)
    # (prepared calls: the direct lane answers and queues a call at once, no `finish`)
    app = create_app(
        stub, data=tmp_path, fsync="never", ack="fast", admin_key=ADMIN_KEY, direct_lane=False
    )
    with serve_app(app, data_plane="rust") as url:
        made = new_session(url, session_id="cut")

        def cut_call(i: int) -> None:
            with contextlib.suppress(httpx.HTTPError):  # (cut: no answer)
                _chat(url, made["api_key"], f"cut {i}", 5)

        calls = [threading.Thread(target=cut_call, args=(i,)) for i in range(4)]
        for call in calls:
            call.start()
        assert begun.wait(5)
    for call in calls:
        call.join(20)
    monkeypatch.undo()
    cut = app.state.server.dropped["shutdown"]
    assert cut == sum(finished) >= 1  # answered, never queued: each counted
    again = create_app(stub, data=tmp_path, admin_key=ADMIN_KEY)
    with serve_app(again, data_plane="rust") as url:
        health = httpx.get(f"{url}/health").json()
        info = httpx.get(f"{url}/sessions/cut", headers=auth("cut")).json()
    assert health["dropped_by"]["killed"] == 0
    assert health["dropped_by"]["shutdown"] == cut == info["dropped"]
    assert info["turns"] == 0


def _asked(doc: dict[str, Any]) -> list[str]:
    return [turn["request_messages"][-1]["content"] for turn in doc["turns"]]


@pytest.mark.parametrize("plane", ["python", "rust"])
@pytest.mark.parametrize("fsync", ["never", "turn"])
def test_fast_records_the_other_sessions_while_one_sessions_graph_is_held(
    stub: str, tmp_path: Path, plane: str, fsync: str
) -> None:
    """With `--ack fast`, while a thread holds one session's graph (as an export read slowly
    holds it), the recorder goes on with every other session's turns; the held session's
    turns are recorded once its graph is free, in the order they were answered, none
    dropped: one at a time (`fsync` never) and in groups (`fsync` turn)."""
    app = create_app(stub, data=tmp_path, fsync=fsync, ack="fast", admin_key=ADMIN_KEY)
    with serve_app(app, data_plane=plane) as url:
        held, free = new_session(url, session_id="held"), new_session(url, session_id="free")
        sessions = app.state.server.sessions
        assert _chat(url, held["api_key"], "held 0") == 200
        assert len(_export(url, "held")["turns"]) == 1
        held_graph, free_graph = sessions.get("held").graph, sessions.get("free").graph
        with held_graph.lock:
            for i in range(1, 4):
                assert _chat(url, held["api_key"], f"held {i}") == 200
                assert _chat(url, free["api_key"], f"free {i}") == 200
            began = time.monotonic()
            while len(free_graph) < 3 and time.monotonic() - began < 3:
                time.sleep(0.01)
            waited = time.monotonic() - began
            assert len(free_graph) == 3, f"the free session's turns waited {waited:.1f} s"
            assert len(held_graph) == 1  # (its turns wait for its graph)
        assert _asked(_export(url, "held")) == [f"held {i}" for i in range(4)]
        assert _asked(_export(url, "free")) == [f"free {i}" for i in range(1, 4)]
        health = httpx.get(f"{url}/health").json()
        assert health["dropped"] == 0 and health["ack_queue"]["pending"] == 0


@pytest.mark.parametrize("plane", ["python", "rust"])
def test_an_export_waits_for_its_own_sessions_turns_not_for_another_sessions(
    stub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plane: str
) -> None:
    """With `--ack fast`, an export (and the info and trace) waits for its own session's
    answered turns only: while another session's turns wait for its graph (held, as by an
    export read slowly), this session's export answers at once, with every turn of its own."""
    settled = _Server.settled  # (a wait for every session's turns would outlast the export)
    monkeypatch.setattr(_Server, "settled", lambda self, timeout=60.0: settled(self, 60.0))
    app = create_app(stub, data=tmp_path, ack="fast", admin_key=ADMIN_KEY)
    with serve_app(app, data_plane=plane) as url:
        held, free = new_session(url, session_id="held"), new_session(url, session_id="free")
        assert _chat(url, held["api_key"], "held 0") == 200
        assert len(_export(url, "held")["turns"]) == 1
        held_graph = app.state.server.sessions.get("held").graph
        with held_graph.lock:
            assert _chat(url, held["api_key"], "held 1") == 200
            for i in range(3):
                assert _chat(url, free["api_key"], f"free {i}") == 200
            with httpx.Client(timeout=15) as client:
                exported = client.get(
                    f"{url}/sessions/free/export", params={"messages": "1"}, headers=auth("free")
                )
                info = client.get(f"{url}/sessions/free", headers=auth("free"))
                trace = client.get(f"{url}/sessions/free/trace.jsonl", headers=auth("free"))
            assert len(held_graph) == 1  # (still held: its second turn waits)
        assert _asked(exported.json()) == [f"free {i}" for i in range(3)]
        assert info.json()["turns"] == 3 and trace.status_code == 200
        assert _asked(_export(url, "held")) == ["held 0", "held 1"]


@pytest.mark.slow
@pytest.mark.parametrize("plane", ["python", "rust"])
def test_a_stop_while_a_sessions_graph_is_held_counts_its_set_aside_turns(
    stub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plane: str
) -> None:
    """A server stopping while one session's graph is still held (past the stop's wait for
    the queued turns): that session's turns waiting for it are counted as dropped
    (`shutdown`), every other session's turns are recorded, and the next start counts none
    as killed."""
    monkeypatch.setattr(server_module, "ACK_DRAIN_SECONDS", 0.3)
    settled = _Server.settled
    monkeypatch.setattr(_Server, "settled", lambda self, timeout=0.3: settled(self, 0.3))
    app = create_app(stub, data=tmp_path, ack="fast", admin_key=ADMIN_KEY)
    holding, release = threading.Event(), threading.Event()
    with serve_app(app, data_plane=plane) as url:
        held, free = new_session(url, session_id="held"), new_session(url, session_id="free")
        assert _chat(url, held["api_key"], "held 0") == 200
        assert len(_export(url, "held")["turns"]) == 1
        graph = app.state.server.sessions.get("held").graph

        def hold() -> None:
            with graph.lock:
                holding.set()
                release.wait(20)

        holder = threading.Thread(target=hold)
        holder.start()
        assert holding.wait(5)
        assert _chat(url, held["api_key"], "held 1") == 200
        assert _chat(url, held["api_key"], "held 2") == 200
        assert _chat(url, free["api_key"], "free 1") == 200
        time.sleep(0.3)  # (the free session's turn recorded)
        threading.Timer(1.5, release.set).start()  # (the stop closes the graph: it waits)
    holder.join(20)
    monkeypatch.undo()
    again = create_app(stub, data=tmp_path, admin_key=ADMIN_KEY)
    with serve_app(again, data_plane=plane) as url:
        health = httpx.get(f"{url}/health").json()
        infos = {
            sid: httpx.get(f"{url}/sessions/{sid}", headers=auth(sid)).json()
            for sid in ("held", "free")
        }
    counts = {sid: (info["turns"], info["dropped"]) for sid, info in infos.items()}
    assert counts == {"held": (1, 2), "free": (1, 0)}, counts
    assert health["dropped_by"]["killed"] == 0
    assert health["dropped_by"]["shutdown"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("bound", ["within", "past"])
@pytest.mark.parametrize("plane", ["python", "rust"])
def test_a_clean_stop_counts_no_turn_killed_whose_finish_outlasts_it(
    stub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plane: str, bound: str
) -> None:
    """A fast call whose answer is still being made when the server stops (the Rust plane:
    its `finish` on the blocking pool, where it waits for another call; the Python plane:
    its handler): the stop waits for it, bounded (`within`), or gives up on it (`past`); a
    clean stop never leaves it to be counted as killed at the next start."""
    begun = threading.Event()
    finish, forward = RustDataPlane.finish, _Server._forward

    def slow(self: RustDataPlane, call: Any, *args: Any) -> Any:
        begun.set()
        time.sleep(2.0)  # past the runtime's second for its blocking pool
        return finish(self, call, *args)

    async def slow_forward(self: _Server, *args: Any, **kwargs: Any) -> Any:
        answer = await forward(self, *args, **kwargs)
        begun.set()
        await asyncio.sleep(2.0)
        return answer

    monkeypatch.setattr(RustDataPlane, "waits", lambda self, call: True)  # (the pool)
    monkeypatch.setattr(RustDataPlane, "finish", slow)
    monkeypatch.setattr(_Server, "_forward", slow_forward)
    if bound == "past":
        monkeypatch.setattr(server_module, "ACK_DRAIN_SECONDS", 0.3)
    # (prepared calls, finished on the pool: the direct lane finishes none)
    app = create_app(
        stub, data=tmp_path, fsync="never", ack="fast", admin_key=ADMIN_KEY, direct_lane=False
    )
    with serve_app(app, data_plane=plane) as url:
        made = new_session(url, session_id="late")

        def late_call() -> None:
            with contextlib.suppress(httpx.HTTPError):  # (cut: no answer)
                _chat(url, made["api_key"], "late", 10)

        caller = threading.Thread(target=late_call)
        caller.start()
        assert begun.wait(5)
    caller.join(20)
    time.sleep(2.5)  # (a finish the stop gave up on ends meanwhile)
    monkeypatch.undo()
    again = create_app(stub, data=tmp_path, admin_key=ADMIN_KEY)
    with serve_app(again, data_plane=plane) as url:
        health = httpx.get(f"{url}/health").json()
        info = httpx.get(f"{url}/sessions/late", headers=auth("late")).json()
    assert health["dropped_by"]["killed"] == 0, health["dropped_by"]
    counts = (info["turns"], info["dropped"], health["dropped_by"]["shutdown"])
    if plane == "python":  # the stop waits for its handler: answered, then recorded
        assert counts == (1, 0, 0), counts
    elif bound == "within":  # waited for: answered into the ledger, never queued
        assert counts == (0, 1, 1), counts
    else:  # (its reply never goes out: counted if the sessions were still open)
        assert counts in ((0, 0, 0), (0, 1, 1)), counts


@pytest.mark.parametrize("plane", ["python", "rust"])
def test_turns_set_aside_stay_within_the_queue_bound(
    stub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plane: str
) -> None:
    """While one session's graph is held and its calls keep coming, its turns set aside
    count in the queue's bound also while the recorder tries them again: what waits stays
    within the bound (plus one batch taken from the queue that turns out held), the rest is
    dropped and counted, and what waited is recorded in each caller's order once free."""
    bound, callers, calls = 4, 6, 30
    record_group_now = _Server.record_group_now

    def slow(self: _Server, group: Any, held: Any = None, timelines: bool = False) -> Any:
        ids = record_group_now(self, group, held, timelines)
        if held:  # (a wider window for calls coming while the held turns are tried)
            time.sleep(0.02)
        return ids

    monkeypatch.setattr(_Server, "record_group_now", slow)
    app = create_app(
        stub, data=tmp_path, fsync="turn", ack="fast", ack_queue=bound, admin_key=ADMIN_KEY
    )
    with serve_app(app, data_plane=plane) as url:
        held = new_session(url, session_id="held")
        assert _chat(url, held["api_key"], "-1 0") == 200
        assert len(_export(url, "held")["turns"]) == 1  # (its graph opened)
        graph = app.state.server.sessions.get("held").graph
        waiting: list[int] = []
        statuses: list[int] = []
        with graph.lock:

            def flood(caller: int) -> None:
                statuses.extend(_chat(url, held["api_key"], f"{caller} {i}") for i in range(calls))

            threads = [threading.Thread(target=flood, args=(c,)) for c in range(callers)]
            for thread in threads:
                thread.start()
            while any(thread.is_alive() for thread in threads):
                waiting.append(httpx.get(f"{url}/health").json()["ack_queue"]["pending"])
                time.sleep(0.01)
            for thread in threads:
                thread.join()
            waiting.append(httpx.get(f"{url}/health").json()["ack_queue"]["pending"])
            assert len(graph) == 1
        assert statuses == [200] * callers * calls
        doc = _export(url, "held")
        health = httpx.get(f"{url}/health").json()
    # none could be recorded while the graph was held: those recorded since are those that
    # waited for it (at most the bound, and a batch of at most the bound taken from the
    # queue whose calls were answered meanwhile)
    waited = len(doc["turns"]) - 1
    assert waited <= 2 * bound and max(waiting) <= 2 * bound, (waited, waiting)
    assert waited + health["dropped"] == callers * calls
    assert health["dropped"] == health["dropped_by"]["queue_full"]
    asked = [tuple(map(int, text.split())) for text in _asked(doc)]
    for caller in range(callers):
        mine = [i for c, i in asked if c == caller]
        assert mine == sorted(mine), (caller, mine)


@pytest.mark.parametrize("plane", ["python", "rust"])
def test_infos_waiting_for_a_held_sessions_turns_hold_up_no_other_session(
    stub: str, tmp_path: Path, plane: str
) -> None:
    """Many requests waiting for the turns of a session whose graph is held (its info, as a
    dashboard polls it) take none of the worker threads the recorder and the exports use:
    another session's turns are recorded and its export answers while they still wait."""
    waiters = 60  # more than the worker threads there are
    app = create_app(stub, data=tmp_path, fsync="turn", ack="fast", admin_key=ADMIN_KEY)
    with serve_app(app, data_plane=plane) as url:
        held, free = new_session(url, session_id="held"), new_session(url, session_id="free")
        assert _chat(url, held["api_key"], "held 0") == 200
        assert len(_export(url, "held")["turns"]) == 1
        graph = app.state.server.sessions.get("held").graph
        infos: list[int] = []

        def info() -> None:
            infos.append(
                httpx.get(f"{url}/sessions/held", headers=auth("held"), timeout=30).json()["turns"]
            )

        with graph.lock:
            assert _chat(url, held["api_key"], "held 1") == 200
            threads = [threading.Thread(target=info) for _ in range(waiters)]
            for thread in threads:
                thread.start()
            time.sleep(0.3)  # (the infos wait for the held session's second turn)
            assert _chat(url, free["api_key"], "free 0") == 200
            exported = _export(url, "free")
            still_waiting = sum(thread.is_alive() for thread in threads)
        for thread in threads:
            thread.join(30)
    assert _asked(exported) == ["free 0"]
    assert still_waiting == waiters
    assert infos == [2] * waiters


@pytest.mark.parametrize("fsync", ["never", "turn"])
def test_the_rust_planes_threads_keep_their_interpreter_state_from_call_to_call(
    stub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: str
) -> None:
    """The threads that run the control plane's callbacks are attached to the interpreter
    once, for their life: a callback sees what an earlier one on its thread left in a
    `threading.local` (a thread attached per call would make a new interpreter thread
    state, and lose it, every time)."""
    mine = threading.local()
    seen: list[tuple[int, int]] = []
    prepare = RustDataPlane.prepare

    def counted(self: RustDataPlane, *args: Any, **kwargs: Any) -> Any:
        mine.calls = getattr(mine, "calls", 0) + 1
        seen.append((threading.get_ident(), mine.calls))
        return prepare(self, *args, **kwargs)

    monkeypatch.setattr(RustDataPlane, "prepare", counted)
    calls = CALLERS + 1  # (more than the threads: one of them runs two)
    app = create_app(stub, data=tmp_path, fsync=fsync, admin_key=ADMIN_KEY)
    with serve_app(app, data_plane="rust") as url:
        key = new_session(url, session_id="s")["api_key"]
        for i in range(calls):
            assert _chat(url, key, f"call {i}") == 200
    by_thread: dict[int, list[int]] = {}
    for ident, count in seen:
        by_thread.setdefault(ident, []).append(count)
    assert sum(map(len, by_thread.values())) == calls
    for counts in by_thread.values():
        assert counts == list(range(1, len(counts) + 1)), by_thread
    assert max(map(len, by_thread.values())) > 1, by_thread  # (a thread ran several)


@pytest.mark.parametrize("when", ["freed", "alive_at_exit"])
def test_a_rust_plane_let_go_unstopped_stops_without_waiting_on_the_interpreter(
    when: str,
) -> None:
    """A `_core.DataPlane` freed without `stop` stops its threads, which hold their
    interpreter state for life and take the GIL once more to end, without a deadlock with
    the thread freeing it (which holds the GIL); one still alive when the interpreter exits
    lets the exit go on (its threads could never take the GIL again). In a child process,
    bounded."""
    code = f"""if True:
        import gc, time
        from rollout_store._core import DataPlane

        class Control:
            pass

        plane = DataPlane(
            Control(), host="127.0.0.1", port=0, backend_port=9, upstream="http://127.0.0.1:9",
            hosts=None, open_mode=False, max_body_bytes=1 << 20, body_timeout=5.0,
            body_timeout_text="5", upstream_timeout=5.0, stream_keepalive=5.0, fast=True,
            ack_queue=8, callers=4,
        )
        time.sleep(0.2)  # (its threads attach to the interpreter)
        if {when!r} == "freed":
            del plane
            gc.collect()
        print("stopped")
    """
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stopped"


@pytest.mark.parametrize("plane", ["python", "rust"])
def test_a_call_answered_after_its_session_is_deleted_and_made_again_counts_in_neither(
    stub: str, tmp_path: Path, plane: str
) -> None:
    """With `--ack fast` and a data directory, a call of a session that is deleted, and made
    again under the same id, while the call waits for the upstream: its turn is answered
    (after the delete) and counted once, as the deleted session's (`record_error`), never
    in the ack ledger as the new session's, which the next start would count as killed."""
    app = create_app(stub, data=tmp_path, fsync="never", ack="fast", admin_key=ADMIN_KEY)
    with serve_app(app, data_plane=plane) as url:
        old = new_session(url, session_id="again")
        assert _chat(url, old["api_key"], "old 0") == 200  # (the ack ledger begun)
        statuses: list[int] = []

        def slow_call() -> None:
            answer = httpx.post(
                f"{url}/v1/chat/completions",
                json={"model": "stub-slow", "messages": [{"role": "user", "content": "old 1"}]},
                headers={"authorization": f"Bearer {old['api_key']}"},
                timeout=20,
            )
            statuses.append(answer.status_code)

        caller = threading.Thread(target=slow_call)
        caller.start()
        time.sleep(0.3)  # (it waits for the upstream's answer, a second)
        deleted = httpx.delete(f"{url}/sessions/again", headers=ADMIN, timeout=5)
        assert deleted.status_code == 200
        new = new_session(url, session_id="again")
        caller.join(20)
        assert statuses == [200]
        for i in range(2):
            assert _chat(url, new["api_key"], f"new {i}") == 200
        info = httpx.get(f"{url}/sessions/again", headers=auth("again")).json()
        health = httpx.get(f"{url}/health").json()
    assert (info["turns"], info["dropped"]) == (2, 0), info
    assert health["dropped_by"]["record_error"] == health["dropped"] == 1, health
    again = create_app(stub, data=tmp_path, admin_key=ADMIN_KEY)
    with serve_app(again, data_plane=plane) as url:
        info = httpx.get(f"{url}/sessions/again", headers=auth("again")).json()
        health = httpx.get(f"{url}/health").json()
    assert (info["turns"], info["dropped"]) == (2, 0), info
    assert health["dropped"] == 0, health["dropped_by"]


@pytest.mark.parametrize("plane", ["python", "rust"])
def test_fast_answers_a_call_continuing_a_stream_whose_graph_is_held(
    stub: str, tmp_path: Path, plane: str
) -> None:
    """With `--ack fast`, a call that continues a stream of its session whose turn the
    recorder set aside (the session's graph held, as by an export read slowly) is answered
    at once, not once the graph is free: its turn is queued after the stream's all the
    same, and both are recorded in their order once the graph is free."""
    app = create_app(stub, ack="fast", admin_key=ADMIN_KEY)
    with serve_app(app, data_plane=plane) as url:
        made = new_session(url, session_id="held")
        headers = {"authorization": f"Bearer {made['api_key']}"}
        assert _chat(url, made["api_key"], "zero") == 200
        assert len(_export(url, "held")["turns"]) == 1  # (its graph opened)
        graph = app.state.server.sessions.get("held").graph
        holding, release = threading.Event(), threading.Event()

        def hold() -> None:
            with graph.lock:
                holding.set()
                release.wait(20)

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert holding.wait(5)
            messages = [{"role": "user", "content": "first"}]
            body = {"model": "m", "messages": messages, "stream": True}
            with httpx.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=5
            ) as streamed:
                events = streamed.read().decode()
            reply = "".join(
                json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                for line in events.splitlines()
                if line.startswith("data: {")
            )
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "second"},
            ]
            began = time.monotonic()
            with contextlib.suppress(httpx.TimeoutException):
                answer = httpx.post(
                    f"{url}/v1/chat/completions",
                    json={"model": "m", "messages": messages},
                    headers=headers,
                    timeout=3,
                )
            waited = time.monotonic() - began
            assert len(graph) == 1  # (both turns wait for the graph)
        finally:
            release.set()
            holder.join(20)
        assert waited < 2.0 and answer.status_code == 200, waited
        assert _asked(_export(url, "held")) == ["zero", "first", "second"]
        assert httpx.get(f"{url}/health").json()["dropped"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("plane", ["python", "rust"])
def test_fast_accounts_for_every_answered_turn_under_mixed_traffic(
    stub: str, tmp_path: Path, plane: str, seed: int
) -> None:
    """With `--ack fast` and a queue bound of 2: four clients call four sessions at random
    (a third of the calls streamed), a thread holds one session's graph after another (as
    exports read slowly hold them), and exports are read meanwhile. Each export holds its
    session's turns answered before it (or says some are unsettled), each client's turns in
    its order, none twice; at the end each session's turns and dropped turns add up to its
    answered calls, `/health` to the sum, and a restart counts the same, none killed."""
    import random

    sids = [f"s{k}" for k in range(4)]
    problems: list[str] = []
    answered = dict.fromkeys(sids, 0)
    counted = threading.Lock()
    app = create_app(
        stub, data=tmp_path, fsync="turn", ack="fast", ack_queue=2, admin_key=ADMIN_KEY
    )

    def checked(doc: dict[str, Any], sid: str) -> None:
        asked = _asked(doc)
        if len(set(asked)) != len(asked):
            problems.append(f"{sid}: a turn twice")
        last: dict[int, int] = {}
        for text in asked:
            client, i = map(int, text.split())
            if last.get(client, -1) >= i:
                problems.append(f"{sid}: client {client}'s turn {i} after {last[client]}")
            last[client] = i

    with serve_app(app, data_plane=plane) as url:
        keys = {sid: new_session(url, session_id=sid)["api_key"] for sid in sids}
        sessions = app.state.server.sessions
        done = threading.Event()

        def client(c: int) -> None:
            rng = random.Random(seed * 100 + c)
            for i in range(40):
                sid = rng.choice(sids)
                body = {
                    "model": "m",
                    "messages": [{"role": "user", "content": f"{c} {i}"}],
                    "stream": rng.random() < 0.3,
                }
                answer = httpx.post(
                    f"{url}/v1/chat/completions",
                    json=body,
                    headers={"authorization": f"Bearer {keys[sid]}"},
                    timeout=30,
                )
                if answer.status_code != 200:
                    problems.append(f"call {c} {i}: {answer.status_code}")
                    continue
                with counted:
                    answered[sid] += 1

        def holder() -> None:
            rng = random.Random(seed * 7)
            while not done.is_set():
                with sessions.get(rng.choice(sids)).graph.lock:
                    time.sleep(rng.uniform(0.02, 0.2))
                time.sleep(rng.uniform(0.0, 0.1))

        def reader() -> None:
            rng = random.Random(seed * 13)
            while not done.is_set():
                sid = rng.choice(sids)
                with counted:
                    before = answered[sid]
                # (mid-traffic, a turn answered after the export began may be in it before
                # its timeline is: the final exports check every timeline)
                answer = httpx.get(
                    f"{url}/sessions/{sid}/export",
                    params={"messages": "1"},
                    headers=auth(sid),
                    timeout=30,
                )
                answer.raise_for_status()
                doc = answer.json()
                checked(doc, sid)
                found = " ".join(doc["validation"])
                dropped = 0
                if "dropped_turns: " in found:
                    dropped = int(found.split("dropped_turns: ")[1].split(" ")[0])
                if len(doc["turns"]) + dropped < before and "unsettled_turns" not in found:
                    problems.append(f"{sid}: {len(doc['turns'])}+{dropped} of {before}")
                time.sleep(rng.uniform(0.0, 0.05))

        def reported(work: Any, *args: Any) -> None:
            try:
                work(*args)
            except Exception as exc:  # (a thread's failure fails the test)
                problems.append(f"{work.__name__}: {exc!r}")

        clients = [threading.Thread(target=reported, args=(client, c)) for c in range(4)]
        others = [
            threading.Thread(target=reported, args=(holder,)),
            threading.Thread(target=reported, args=(reader,)),
        ]
        for thread in clients + others:
            thread.start()
        for thread in clients:
            thread.join(60)
        done.set()
        for thread in others:
            thread.join(60)
        # (an export waits 2 s at most for the timelines of calls answered before it: on a
        # loaded machine the last ones may take longer, so the end waits for them first)
        server = app.state.server
        deadline = time.monotonic() + 30
        while server._timing and time.monotonic() < deadline:
            time.sleep(0.05)
        counts = {}
        for sid in sids:
            checked(_export(url, sid), sid)
            info = httpx.get(f"{url}/sessions/{sid}", headers=ADMIN, timeout=20).json()
            counts[sid] = (info["turns"], info["dropped"])
        health = httpx.get(f"{url}/health").json()
    assert problems == []
    assert {sid: turns + dropped for sid, (turns, dropped) in counts.items()} == answered
    assert (
        health["dropped"]
        == health["dropped_by"]["queue_full"]
        == sum(dropped for _, dropped in counts.values())
    )
    again = create_app(stub, data=tmp_path, admin_key=ADMIN_KEY)
    with serve_app(again, data_plane=plane) as url:
        infos = {
            sid: httpx.get(f"{url}/sessions/{sid}", headers=ADMIN, timeout=20).json()
            for sid in sids
        }
        health = httpx.get(f"{url}/health").json()
    assert {sid: (info["turns"], info["dropped"]) for sid, info in infos.items()} == counts
    assert health["dropped_by"]["killed"] == 0


def test_a_fast_rust_plane_reads_a_complete_answer_on_its_recorder_thread(
    stub: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `--ack fast` the reply to a complete answer is made of its bytes: the answer is
    decoded (and its turn made) by the recorder thread, not by the caller thread before the
    reply goes out, and the turns are recorded as ever."""
    decoded_on: list[int] = []
    recorded_on: list[int] = []
    decoded = server_module._decoded_answer
    record = RustDataPlane.record

    def noting_decode(answer: bytes) -> Any:
        decoded_on.append(threading.get_ident())
        return decoded(answer)

    def noting_record(self: RustDataPlane, calls: Any) -> Any:
        recorded_on.append(threading.get_ident())
        return record(self, calls)

    monkeypatch.setattr(server_module, "_decoded_answer", noting_decode)
    monkeypatch.setattr(RustDataPlane, "record", noting_record)
    app = create_app(stub, ack="fast", admin_key=ADMIN_KEY)
    with serve_app(app, data_plane="rust") as url:
        session = new_session(url, session_id="later")
        bearer = {"authorization": f"Bearer {session['api_key']}"}
        for i in range(3):
            body = {"model": "m", "messages": [{"role": "user", "content": f"call {i}"}]}
            answer = httpx.post(f"{url}/v1/chat/completions", json=body, headers=bearer)
            assert answer.status_code == 200
            assert "prompt_token_ids" not in answer.json()
        info = httpx.get(f"{url}/sessions/later", headers=auth("later")).json()
        assert (info["turns"], info["dropped"]) == (3, 0)
    assert len(decoded_on) == 3 and set(decoded_on) <= set(recorded_on)

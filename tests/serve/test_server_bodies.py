"""The capture server reads a request body as json.loads would, without decoding its messages.

`split_body` splits a body with msgspec and leaves the conversation as `RawJSON` spans; for
every byte string, what it accepts must be what json.loads accepts, field for field, and the
server must answer every odd body (NaN, lone surrogates, huge ints, duplicate keys, bad UTF-8)
as it would after json.loads: the same status, the same reason, the same recorded turn.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from capture_support import export, new_session, serve_app

from rollout_store import MAX_DEPTH, RawJSON
from rollout_store._core import json_fields
from rollout_store.serve.server import (
    CHAT_RAW_FIELDS,
    _Checked,
    chat_turn,
    create_app,
    messages_turn,
    split_body,
    upstream_body,
    upstream_parts,
)
from rollout_store.serve.stub_engine import chat_response, create_stub_app

BASE = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "x", "n": 1.5}]},
    ],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "temperature": 0.5,
    "seed": 3,
}

ODD = [
    b'{"messages": [{"role": "user", "content": NaN}], "temperature": Infinity}',
    b'{"messages": [{"role": "user", "content": "\\ud800 and \\udfff"}]}',
    b'{"messages": [{"role": "\\ud83d", "content": "a"}]}',
    b'{"messages": [{"role": "user", "content": 123456789012345678901234567890}]}',
    b'{"messages": [{"role": "user", "content": -0.0, "x": 1e400}], "seed": 1e400}',
    b'{"messages": [{"role": "user", "role": 5}]}',
    b'{"messages": [{"role": 5, "role": "user"}]}',
    b'{"messages": "x", "messages": [{"role": "user"}]}',
    b'{"messages": [{"role": "user"}], "messages": "x"}',
    b'{"messages": [{"role": "user"}], "model": "a", "model": 3}',
    b'{"messages": [{"role": "user"}], "model": 3, "model": "a"}',
    b'{"messages": [{"role": "user", "content": "\xff"}]}',
    b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
    b'{"messages": [{"role": "user", "content": "caf\xc3\xa9 \xe2\x80\xa8"}]}',
    b'\xef\xbb\xbf{"messages": [{"role": "user"}]}',
    '{"messages": [{"role": "user"}]}'.encode("utf-16"),
    b'{"messages": [{"role": "user", "content": "a\tb"}]}',
    b'{"messages": [{"role": "user", "content": "\x7f"}]}',
    b'{"messages": [{"role": "user"}], "tools": []}',
    b'{"messages": [{"role": "user"}], "tools": null}',
    b'{"messages": [{"role": "user"}], "system": null}',
    b'{"messages": [{"role": "user"}], "system": "\\ud800"}',
    b'{"messages": [{"role": "user"}], "stream": true, "stream_options": {"include_usage": 1}}',
    b'  \n{"messages" : [ {"role":"user"} ] }\r\n ',
    b'{"messages": [{"role": "user", "content": "a"}], "system": "be brief", "stop": ["x"]}',
    b'{"messages": [{"role": "user", "content": [' + b"[" * 700 + b"]" * 700 + b"]}]}",
]


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _same_as_json_loads(raw: bytes, fields: dict[str, Any] | bool | None = False) -> None:
    """split_body accepts only what json.loads reads, and gives the same fields (`fields`:
    what it gave already)."""
    if fields is False:
        fields = split_body(raw)
    if fields is None or fields is True:
        return
    loaded = _loads(raw)
    assert isinstance(loaded, dict), raw[:80]
    assert list(fields) == list(loaded)
    for key, value in fields.items():
        if type(value) is RawJSON:
            assert isinstance(value.data, bytes) and value.data in raw  # a span of the body
            value = value.decode()
        assert json.dumps(value) == json.dumps(loaded[key]), key
    if type(fields.get("messages")) is RawJSON:  # checked when split
        messages = loaded["messages"]
        assert isinstance(messages, list) and messages
        assert all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)


@pytest.mark.parametrize("raw", ODD)
def test_odd_bodies_split_as_json_loads_reads_them(raw: bytes) -> None:
    _same_as_json_loads(raw)


def test_a_plain_body_keeps_its_conversation_undecoded() -> None:
    raw = json.dumps(BASE).encode()
    fields = split_body(raw)
    assert fields is not None
    messages, tools = fields["messages"], fields["tools"]
    assert type(messages) is RawJSON and messages.data == json.dumps(BASE["messages"]).encode()
    assert type(tools) is RawJSON and tools.data == json.dumps(BASE["tools"]).encode()
    assert fields["temperature"] == 0.5 and fields["model"] == "m"
    # the body sent upstream is written from the spans, the conversation's bytes as sent
    sent = upstream_body(raw, fields, {"stream": False, "model": "n"})
    assert json.dumps(BASE["messages"]).encode() in sent
    assert json.loads(sent) == {**BASE, "model": "n", "stream": False}
    assert list(json.loads(sent)) == [*BASE, "stream"]
    # and the turn the graph gets holds the spans, not decoded messages
    turn = chat_turn(fields, chat_response(BASE), None)
    assert turn.request_messages is messages and turn.request_tools is tools
    anthropic = split_body(json.dumps({"system": "s", **BASE}).encode())
    assert anthropic is not None
    answer = {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}
    spliced = messages_turn(anthropic, answer, None).request_messages
    assert type(spliced) is RawJSON
    assert spliced.decode() == [{"role": "system", "content": "s"}, *BASE["messages"]]


def test_the_upstream_body_in_parts_begins_with_the_clients_own_bytes() -> None:
    """The Rust data plane is handed the upstream body as `raw[:head] + tail`: the client's
    own bytes (not copied) and the members added; written anew (`head` 0) where the client
    sent a field the server sets."""
    raw = json.dumps(BASE).encode() + b" \n"
    fields = split_body(raw)
    assert fields is not None
    extra = {"stream": False, "logprobs": True}
    head, tail = upstream_parts(raw, fields, extra)
    assert head == len(raw) - 3 and raw[:head] + tail == upstream_body(raw, fields, extra)
    assert json.loads(raw[:head] + tail) == {**BASE, **extra}
    resent = json.dumps({**BASE, "stream": True}).encode()
    fields = split_body(resent)
    assert fields is not None
    head, tail = upstream_parts(resent, fields, extra)
    assert head == 0 and tail == upstream_body(resent, fields, extra)
    assert json.loads(tail) == {**BASE, **extra}


_PIECES = [
    b'"',
    b"\\",
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b" ",
    b"0",
    b"-",
    b"1e400",
    b"NaN",
    b"\\ud800",
    b"\\u00e9",
    b"\xff",
    b"\xed\xa0\x80",
    b"\xc3\xa9",
    b"\t",
    b"\x00",
    b'"role"',
    b'"messages"',
    b"null",
    b"true",
    b"123456789012345678901234567890",
]


def _mutants(seed: int, n: int) -> Iterator[bytes]:
    rng = random.Random(seed)
    base = json.dumps(BASE).encode()
    for _ in range(n):
        raw = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(raw) + 1)
            piece = rng.choice(_PIECES)
            cut = rng.choice((0, 0, 1, len(piece)))
            raw[at : at + cut] = piece
        yield bytes(raw)


@pytest.mark.parametrize("seed", range(4))
def test_mutated_bodies_split_as_json_loads_reads_them(seed: int) -> None:
    print(f"seed {seed}")
    accepted = 0
    for raw in _mutants(seed, 3000):
        _same_as_json_loads(raw)
        accepted += split_body(raw) is not None
    assert accepted > 100  # the mutations do leave some bodies msgspec splits


def _as_the_rust_plane_reads(raw: bytes) -> bool:
    """Whether the Rust data plane hands `split_body` the fields it found in `raw`: a body
    json.loads reads as an object, strict UTF-8 with no surrogate escaped in it."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    surrogate = re.search(rb"\\u[dD][89a-fA-F]", raw.replace(b"\\\\", b""))
    return surrogate is None and isinstance(_loads(raw), dict)


@pytest.mark.parametrize("seed", range(2))
def test_the_fields_the_rust_plane_found_split_as_json_loads_reads_them(seed: int) -> None:
    """`split_body` given the top-level fields the Rust data plane found in a body
    (`_core.json_fields`) gives what it gives splitting the body itself, and what
    json.loads reads, field for field."""
    checked = _Checked(depth=True, utf8=True)
    given = 0
    for raw in [*ODD, json.dumps(BASE).encode(), *_mutants(seed + 10, 3000)]:
        if not _as_the_rust_plane_reads(raw):
            continue
        found = json_fields(raw)
        if found is None:  # (an escaped key: the plane hands none)
            continue
        fields = split_body(raw, CHAT_RAW_FIELDS, checked, found)
        _same_as_json_loads(raw, fields)
        itself = split_body(raw, CHAT_RAW_FIELDS, checked)
        if itself is not None:
            assert fields == itself
        given += 1
    assert given > 100


# ---------------------------------------------------------------- through the server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    with serve_app(create_stub_app()) as stub:
        app = create_app(stub, data=tmp_path_factory.mktemp("data"), upstream_timeout=10)
        with serve_app(app) as url:
            yield url, app


def _expected(raw: bytes, anthropic: bool) -> tuple[int, str | None]:
    """What the server answered when it decoded every body with json.loads: the status, and
    the start of the reason for a refusal."""
    try:
        body = json.loads(raw)
    except RecursionError:
        return 400, "the body nests too deeply"
    except ValueError as exc:
        return 400, f"the body is not JSON: {str(exc).splitlines()[0]}"
    if not isinstance(body, dict):
        return 400, "the body must be a JSON object"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return 400, "messages must be a non-empty array"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return 400, f"messages[{i}] must be an object with a string role"
    for key, kind, reason in (
        ("tools", list, "tools must be an array"),
        ("stream", bool, "stream must be true or false"),
        ("model", str, "model must be a string"),
    ):
        if key in body and not isinstance(body[key], kind):
            return 400, reason
    system = body.get("system")
    if anthropic and system is not None and not isinstance(system, str | list):
        return 400, "system must be a string"
    if _depth(messages) > MAX_DEPTH:  # forwarded, then refused by the graph
        return 400, "the request cannot be recorded"
    return 200, None


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth + 1)
            stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_odd_bodies_are_answered_and_recorded_as_after_json_loads(
    server: tuple[str, Any], path: str
) -> None:
    url, app = server
    anthropic = path == "/v1/messages"
    for raw in [*ODD, json.dumps(BASE).encode(), *list(_mutants(9, 60))]:
        session = new_session(url)
        answer = httpx.post(
            f"{url}{path}",
            content=raw,
            headers={"authorization": f"Bearer {session['api_key']}"},
            timeout=20,
        )
        status, reason = _expected(raw, anthropic)
        graph = app.state.sessions.get(session["session_id"]).graph
        if status != 200:
            assert answer.status_code == status, (raw[:80], answer.text[:200])
            message = answer.json()["error"]["message"]
            assert message.startswith(reason) and "\n" not in message, (raw[:80], message)
            assert len(graph) == 0
            continue
        assert answer.status_code == 200, (raw[:80], answer.text[:300])
        (turn,) = export(url, session["session_id"])["turns"]
        body = json.loads(raw)
        messages = body["messages"]
        if anthropic and body.get("system") is not None:
            messages = [{"role": "system", "content": body["system"]}, *messages]
        assert json.dumps(turn["request_messages"]) == json.dumps(messages)
        if body.get("tools") is not None:
            assert json.dumps(turn["request_tools"]) == json.dumps(body["tools"])


def test_an_anthropic_system_is_spliced_before_the_raw_messages(
    server: tuple[str, Any], tmp_path: Path
) -> None:
    url, _ = server
    session = new_session(url)
    raw = (
        b'{"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "s\\u00e9"}],'
        b' "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},'
        b' {"role": "user", "content": "c"}]}'
    )
    answer = httpx.post(
        f"{url}/v1/messages",
        content=raw,
        headers={"x-api-key": session["api_key"]},
        timeout=20,
    )
    assert answer.status_code == 200, answer.text
    (turn,) = export(url, session["session_id"])["turns"]
    body = json.loads(raw)
    expected = [{"role": "system", "content": body["system"]}, *body["messages"]]
    assert json.dumps(turn["request_messages"]) == json.dumps(expected)


def test_an_int_json_loads_cannot_convert_is_refused_as_json_loads_refuses_it(
    server: tuple[str, Any],
) -> None:
    """A top-level field holding an int of more digits than Python converts (json.loads
    raises ValueError) is refused with json.loads' reason, before the call goes upstream;
    the body was split, and its decode raised out of the server (500)."""
    url, app = server
    raw = b'{"messages": [{"role": "user", "content": "a"}], "seed": ' + b"1" * 5000 + b"}"
    assert split_body(raw) is None
    session = new_session(url)
    answer = httpx.post(
        f"{url}/v1/chat/completions",
        content=raw,
        headers={"authorization": f"Bearer {session['api_key']}"},
        timeout=20,
    )
    status, reason = _expected(raw, anthropic=False)
    assert (answer.status_code, status) == (400, 400), answer.text[:200]
    assert reason is not None and answer.json()["error"]["message"].startswith(reason)
    assert "4300 digits" in reason
    assert len(app.state.sessions.get(session["session_id"]).graph) == 0

"""The capture server: an OpenAI / Anthropic endpoint that records every call as a turn.

An agent points its SDK at this server (base URL) with a session's API key and changes nothing
else. Each `POST /v1/chat/completions` or `POST /v1/messages` is forwarded to the upstream
engine as one complete (non-streaming) call; the answer is recorded in the session's rollout
graph and then handed back, replayed as server-sent events when the client asked for
`stream: true` (the Rust data plane passes the upstream's own stream through instead, and
records the answer its events add up to, `assemble`). Token ids and logprobs come from the
engine's own fields (vLLM's `return_token_ids` and `logprobs`, requested upstream unless the
client set them itself and removed from the reply when the client did not ask); without them
turns link by messages.
Nothing is tokenized here.

Sessions follow the capture server this library replaces: `POST /sessions` mints a session
and its API key, the key the SDK sends (`Authorization: Bearer` or `x-api-key`) names the
session, unknown keys get 401 unless the server runs in open mode (which makes new open
sessions, never opens one that has a key). `GET /sessions`, `GET /sessions/{id}`,
`GET /sessions/{id}/export` (`?messages=1`, `discarded=1`, `capture_level=...`; the level
defaults to "tokens" when some turn carries token ids, else "text", as the library's export
decides), `GET /sessions/{id}/trace.jsonl`, the viewer, `GET /` (as `GET /sessions`),
`PATCH /sessions/{id}`, `GET /groups/{id}`, the training rows and `DELETE /sessions/{id}`
manage them; each needs the session's key or the server's admin key: a route naming one
session calls `_Server._lookup`, one gathering sessions `_Server._visible` (the only checks
there are).

Every request is refused unless its `Host` is a name the server answers (`hosts`), a
browser's `Origin` too, and a body sent as anything but `application/json` is refused with
415: a page on another site can neither read nor write through the user's browser.

Anthropic's top-level `system` (a string or an array of content blocks) is recorded as a
leading `{"role": "system", "content": system}` message of the turn's request messages, so a
Messages conversation reads like a Chat Completions one in exports and in the viewer; its
`tools` are counted in each turn's `n_tools`, as Chat Completions' are.

The conversation is never decoded here: the body is split with msgspec into its top-level
fields, the messages (and tools, and Anthropic's system) reach the graph as `RawJSON` spans
of the body, and the upstream gets the body's own bytes with the capture keys added. A body
msgspec cannot read exactly as json.loads would is decoded by json.loads instead, so every
body is accepted, refused and recorded as json.loads reads it.

Each call is stamped as it passes (`timeline.CallClock`: received, sent upstream, the
upstream's first and last byte, each stream chunk sent) and its turn gets the `Timeline`
once the reply has been sent (a background task of the response): an upstream that answers
unstreamed has its first token at its first byte. With `ack="fast"` the recorder that records
the turn after the reply records its timeline too.

With `ack="durable"` (the default) a turn is acknowledged (the client gets its answer) only
after the graph accepted it, and, with a data directory and `fsync="turn"`, after it is on
disk; a turn that cannot be recorded fails the call. With `ack="fast"` the answer goes out
first and the turn is recorded right after, in this process, through a bounded queue: a turn
dropped there (the queue full, a recording error, the server stopping) is counted in
`/health`, in the session's info and in its export's validation, never silently. The
recorder never waits for a session's graph another thread holds (an export being read): it
sets that session's turns aside, in order, and records the other sessions' meanwhile. With a data
directory each such answer is preceded by its line in the ack ledger (`ack_ledger`), so the
turns a killed server answered and never recorded are counted the same way by the next start.

`rollout-store serve --data-plane rust` puts the engine's data plane (`RustDataPlane`, hyper
on tokio) on the public port in front of this app: it serves the model routes, calling back
into this module's own code to plan, record and reply, and passes every other request to the
app on a private loopback port.

Bad requests get a 4xx with a one-line reason and record nothing; upstream errors pass
through with their status and are recorded nowhere; an upstream that does not answer in time
gets 504.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import functools
import gc
import hmac
import html
import json
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import IO, Any, NamedTuple, TypeVar
from urllib.parse import quote, unquote, urlencode

import aiohttp
import anyio.to_thread
import msgspec
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .._core import DataPlane, answer_reply, body_too_deep, json_fields, json_member_ids
from ..engine.intake import MAX_DEPTH, PackedIds
from ..engine.messages import json_nesting
from ..errors import (
    InvalidArgumentError,
    InvalidValueError,
    RolloutStoreError,
    StoreError,
    StoreUnavailableError,
)
from ..export.document import CAPTURE_LEVELS, write_session_json, write_trace_jsonl
from ..export.row_files import FORMATS, KINDS, write_rows
from ..export.rows import iter_token_samples, iter_tree_samples
from ..metadata import UNCHANGED
from ..model.nodes import TurnNode
from ..model.raw import RawJSON, split_array
from ..model.timeline import CallClock, failed_after
from ..stores.content import ContentStore, StringCache
from ..stores.local import STORE_HELP, MemoryStore, open_store, store_spec
from ..viewer.app import Viewer, favicon
from ..viewer.hosts import (
    LOOPBACK_HOSTS,
    WILDCARD_BINDS,
    allowed_hosts,
    host_allowed,
    origin_allowed,
)
from .ack_ledger import KILLED
from .assemble import assembled, holds_error
from .idle_trim import with_idle_trim
from .replicas import replica_key_prefix
from .sessions import (
    Session,
    SessionDamagedError,
    SessionDeletedError,
    SessionError,
    Sessions,
    clean_session_id,
)
from .sse import SSE_HEADERS, anthropic_events, chat_chunks, sse_data, sse_event

__all__ = [
    "CHAT_RAW_FIELDS",
    "MESSAGES_RAW_FIELDS",
    "CaptureConfig",
    "DATA_PLANES",
    "RustDataPlane",
    "add_serve_arguments",
    "chat_turn",
    "create_app",
    "main",
    "messages_turn",
    "open_store",
    "split_body",
    "upstream_body",
]

#: Default cap on a request body (64 MiB); `--max-body-bytes` changes it.
MAX_BODY_BYTES = 64 << 20
#: Default seconds to wait for the upstream's answer before answering 504.
UPSTREAM_TIMEOUT = 600.0
#: Default seconds a request's whole body may take to arrive (then 408 and the connection
#: is closed); `--body-timeout` changes it.
BODY_TIMEOUT = 30.0
#: How a turn is acknowledged: after it is recorded, or before (recorded through a queue).
ACK_MODES = ("durable", "fast")
#: Default bound of the queue of turns answered but not yet recorded (`--ack fast`).
ACK_QUEUE = 1024
#: At most this many queued turns are recorded together (`--ack fast`): one worker call, each
#: session's log synced once for its turns among them.
ACK_GROUP = 64
#: Seconds a stopping server waits for the queued turns to be recorded (the rest are counted
#: as dropped), and an export waits for its session's turns answered before it.
ACK_DRAIN_SECONDS = 10.0
#: Seconds between the `--ack fast` recorder's tries of the graphs it found held (by an
#: export being read): their sessions' turns wait, set aside in order, the others go on.
ASIDE_RETRY = 0.02
#: Threads the Rust data plane runs its callbacks on when adding a turn may wait on I/O (a
#: log synced per turn, a store over the network).
CALLERS = 8
#: The environment variable `rollout-store serve` reads its admin key from.
ADMIN_KEY_ENV = "ROLLOUT_STORE_ADMIN_KEY"
#: The shortest admin key accepted.
ADMIN_KEY_MIN = 16
#: The cookie a viewer opened with `?key=` keeps its key in (for its own path only).
VIEW_COOKIE = "rollout_store_key"
#: The cookie `GET /?key=` keeps its key in: the browser's list of sessions, and the viewer of
#: every session that key opens (all of them for the admin key).
ROOT_COOKIE = "rollout_store_root_key"
#: Seconds a streaming client waits for the upstream before keep-alive comments begin.
STREAM_KEEPALIVE = 10.0
#: Seconds after which an unused session over a log lets its graph go (reopened on use), or
#: one in memory only lets its graph's caches go.
IDLE_SECONDS = 600.0
#: Seconds with no call in flight after which `rollout-store serve` gives its heap's free
#: pages back to the system (`idle_trim`); `--trim-idle` changes it.
TRIM_IDLE_SECONDS = 1.0

# Request fields that are not parameters of the call (the rest are recorded as sampling_params).
_CHAT_FIELDS = frozenset({"messages", "tools", "model", "stream", "stream_options"})
_MESSAGES_FIELDS = frozenset({"messages", "tools", "model", "stream", "system"})
_HARNESS_HEADERS = ("x-session-id", "proxy-x-session-id")
_ANTHROPIC_HEADERS = ("anthropic-version", "anthropic-beta")


#: How long an export waits for the timelines of calls answered just before it.
_TIMELINE_WAIT_S = 2.0
#: How often a request waiting for its session's answered turns (`settled_session`) looks.
_SETTLE_POLL_S = 0.002


_T = TypeVar("_T")


class _Refusal(Exception):
    """An answer other than the upstream's: status and a one-line reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class _Gone(Exception):
    """The client left before its request's body arrived: there is no one to answer."""


class _Held(Exception):
    """Another thread holds the session's graph (an export being read): the `--ack fast`
    recorder sets the turn aside rather than wait for it."""


class _Passthrough(Exception):
    """The upstream's own error answer, handed to the client as it came."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


@dataclass(frozen=True)
class CaptureConfig:
    """What `create_app` was given (kept on `app.state.config`)."""

    upstream: str
    upstream_api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    upstream_timeout: float = UPSTREAM_TIMEOUT
    capture_tokens: bool = True
    stream_keepalive: float = STREAM_KEEPALIVE
    body_timeout: float = BODY_TIMEOUT
    #: The `Host` names answered (None: any; see `hosts.allowed_hosts`).
    allowed_hosts: frozenset[str] | None = LOOPBACK_HOSTS
    #: Whether an admin key was set (the key itself is kept by the server only).
    admin: bool = False
    #: "durable" or "fast" (see `ACK_MODES`), and the fast mode's queue bound.
    ack: str = "durable"
    ack_queue: int = ACK_QUEUE
    #: This server's name behind a balancer (in the keys it mints), or None.
    replica: str | None = None
    #: Behind the Rust data plane: its direct lane is open (see `create_app`).
    direct_lane: bool = True


# ---------------------------------------------------------------------- requests to turns
# A request body arrives as bytes. `split_body` splits it with msgspec into its top-level
# fields without decoding the large ones (the conversation, the tools, Anthropic's system):
# those reach the graph as `RawJSON` spans of the body, which confirms a re-sent prefix by
# its bytes, and the upstream gets the body's own bytes. A body msgspec cannot split exactly
# as json.loads would read it is decoded by json.loads, as before.


def _token_list(value: Any) -> Any:
    # an engine without ids sends nothing or an empty list: link by messages then
    if type(value) is PackedIds:
        return value if len(value) else None
    return value if isinstance(value, list) and value else None


def _choice_logprobs(logprobs: Any) -> list[Any] | None:
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or not content:
        return None
    values = [entry.get("logprob") if isinstance(entry, dict) else None for entry in content]
    # a missing value makes the turn untrainable, not unrecordable
    return None if any(v is None for v in values) else values


def chat_turn(body: dict[str, Any], response: dict[str, Any], harness: str | None) -> TurnNode:
    """The turn for a Chat Completions request (as `split_body` gives it, or decoded) and the
    upstream's complete answer."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _Refusal(502, "the upstream's answer has no choices")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise _Refusal(502, "the upstream's answer has no choices[0].message object")
    model = body.get("model")
    finish = choice.get("finish_reason")
    params = {k: v for k, v in body.items() if k not in _CHAT_FIELDS}
    return TurnNode(
        prompt_ids=_token_list(response.get("prompt_token_ids")),
        sampled_ids=_token_list(choice.get("token_ids")),
        sampled_logprobs=_choice_logprobs(choice.get("logprobs")),
        model=model if isinstance(model, str) else None,
        finish_reason=finish if isinstance(finish, str) else None,
        harness_session_id=harness,
        request_messages=body["messages"],
        request_tools=body.get("tools"),
        sampling_params=params or None,
        response_message=message,
    )


def _with_system(system: Any, messages: Any) -> Any:
    """`[{"role": "system", "content": system}, *messages]`, spliced as text when raw."""
    if type(messages) is RawJSON and type(system) is RawJSON:
        head = b'[{"role": "system", "content": ' + _text(system) + b"}, "
        return RawJSON(head + _text(messages)[1:])  # a non-empty array: "[" then an item
    return [{"role": "system", "content": _value(system)}, *_value(messages)]


def messages_turn(body: dict[str, Any], response: dict[str, Any], harness: str | None) -> TurnNode:
    """The turn for an Anthropic Messages request and answer.

    The top-level `system` is recorded as a leading `{"role": "system", "content": system}`
    message (stored once per graph, ignored by linking); the answer's content blocks are the
    response message `{"role": "assistant", "content": [...]}`.
    """
    content = response.get("content")
    if not isinstance(content, list):
        raise _Refusal(502, "the upstream's answer has no content array")
    messages = body["messages"]
    if body.get("system") is not None:
        messages = _with_system(body["system"], messages)
    model = body.get("model")
    stop = response.get("stop_reason")
    params = {k: v for k, v in body.items() if k not in _MESSAGES_FIELDS}
    return TurnNode(
        prompt_ids=_token_list(response.get("prompt_token_ids")),
        sampled_ids=_token_list(response.get("token_ids")),
        model=model if isinstance(model, str) else None,
        finish_reason=stop if isinstance(stop, str) else None,
        harness_session_id=harness,
        request_messages=messages,
        request_tools=body.get("tools"),
        sampling_params=params or None,
        response_message={"role": response.get("role", "assistant"), "content": content},
    )


# ---------------------------------------------------------------------- request checks


class _Role(msgspec.Struct):
    """What the shape check needs of a message (msgspec skips the rest unread)."""

    role: str


_split_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_split_roles = msgspec.json.Decoder(list[_Role]).decode
#: Top-level fields handed on undecoded when they are arrays (or, for `system`, strings):
#: those of Chat Completions, and of Anthropic Messages (its `system` is the first message).
CHAT_RAW_FIELDS = frozenset({"messages", "tools"})
MESSAGES_RAW_FIELDS = frozenset({"messages", "tools", "system"})


def _text(raw: RawJSON) -> bytes:
    data = raw.data
    return data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass")


def _value(value: Any) -> Any:
    return value.decode() if type(value) is RawJSON else value


class _Checked(NamedTuple):
    """What the Rust data plane's reading of a body (`crates/gateway/src/depth.rs`) found
    already, so that it is not checked twice: `depth`, every field within its depth limit
    (`_check_depth`); `shape`, the messages a non-empty array of objects with a string role;
    `utf8`, the body strict UTF-8; `digits`, every int within the server's digit limit
    (`_check_digits`). False: not known (the check is made here)."""

    depth: bool = False
    shape: bool = False
    utf8: bool = False
    digits: bool = False


_UNCHECKED = _Checked()


def split_body(
    raw: bytes,
    raw_fields: frozenset[str] = MESSAGES_RAW_FIELDS,
    checked: _Checked = _UNCHECKED,
    found: list[tuple[str, int, int]] | None = None,
) -> dict[str, Any] | None:
    """The top-level fields of a request body, or None when only json.loads can read it.

    Every field is decoded (exactly as json.loads would) except those named in `raw_fields`
    that hold an array (or, for `system`, a string): they stay `RawJSON` spans of `raw`. A
    raw `messages` is already checked to be a non-empty array of objects with a string role
    (here, unless `checked.shape` says so already).
    None: the body is not a JSON object msgspec reads as json.loads would (not JSON at all,
    NaN, lone-surrogate escapes, a byte order mark, nesting too deep, a message whose role
    is not a plain string, an int of more digits than Python converts, in a value a repeated
    key replaces too, a key written with an escape...): decode it with json.loads, which
    accepts it or says why not.

    `found`: the fields as the Rust data plane found them in a body it read whole as strict
    UTF-8 (each key and its value's byte range, in the body's order), so that the body is
    not split again here.
    """
    spans: dict[str, Any]
    if found is not None and checked.utf8:
        spans = {}
        for key, start, end in found:  # (a repeated key: its first place, its last value)
            spans[key] = raw[start:end]
    else:
        try:
            spans = _split_fields(raw)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeError):
            return None
        # msgspec keeps a repeated key's last value only: the members say whether one was
        # (each member once, in a text msgspec read whole; None: a key with an escape,
        # which may repeat another)
        found = json_fields(raw)
        if found is None:
            return None
    if len(found) != len(spans):
        # json.loads decodes the values a repeated key's last one replaces too: one it
        # refuses (an int of more digits than Python converts) refuses the body
        last = {key: start for key, start, _ in found}
        for key, start, end in found:
            if start != last[key] and _undecodable(raw[start:end]):
                return None
    if not checked.utf8 and not raw.isascii():
        # msgspec does not check the UTF-8 of what it skips; json.loads refuses bad UTF-8
        # (and reads UTF-8-encoded surrogates, which a strict decode leaves to it)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
    fields: dict[str, Any] = {}
    for key, span in spans.items():
        data = bytes(span)
        first = data[:1]
        if key in raw_fields and (first == b"[" or (first == b'"' and key == "system")):
            if key == "messages" and not checked.shape:
                try:
                    if not _split_roles(data):
                        fields[key] = []  # refused by the shape check
                        continue
                except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                    return None
            fields[key] = RawJSON(data)
        else:
            try:
                fields[key] = RawJSON(data).decode()
            except (ValueError, RecursionError):
                # an int of more digits than Python converts (or a value nested deeper than
                # it decodes), which the split did not read: json.loads refuses the body,
                # and says why
                return None
    return fields


def _undecodable(data: bytes) -> bool:
    try:
        RawJSON(data).decode()
    except (ValueError, RecursionError):
        return True
    return False


def _check_messages(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise _Refusal(400, f"the body must be a JSON object, not {type(body).__name__}")
    messages = body.get("messages")
    if type(messages) is not RawJSON:  # raw messages were checked when split
        if not isinstance(messages, list) or not messages:
            raise _Refusal(400, "messages must be a non-empty array of message objects")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise _Refusal(400, f"messages[{i}] must be an object with a string role")
    if "tools" in body and not isinstance(body["tools"], list | RawJSON):
        raise _Refusal(400, "tools must be an array")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise _Refusal(400, "stream must be true or false")
    if "model" in body and not isinstance(body["model"], str):
        raise _Refusal(400, "model must be a string")
    return body


def _check_chat(value: Any) -> dict[str, Any]:
    body = _check_messages(value)
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise _Refusal(400, "n must be 1: the capture server records one completion per call")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _Refusal(400, "stream_options must be an object")
    return body


def _check_anthropic(value: Any) -> dict[str, Any]:
    body = _check_messages(value)
    system = body.get("system")
    if system is not None and not isinstance(system, str | list | RawJSON):
        raise _Refusal(400, "system must be a string or an array of content blocks")
    return body


def _decode(
    raw: bytes,
    anthropic: bool,
    checked: _Checked = _UNCHECKED,
    spans: list[tuple[str, int, int]] | None = None,
) -> Any:
    """The body's fields (`split_body`), or json.loads of it, or the refusal json.loads gives;
    but a body json.loads refuses that holds a field too deep is refused for that."""
    fields = split_body(raw, MESSAGES_RAW_FIELDS if anthropic else CHAT_RAW_FIELDS, checked, spans)
    if fields is not None:
        return fields
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        # json.loads stops at the first fault it reads, and gives up past its own depth
        # limit (which moves with the interpreter's stack): a field too deep is named
        # first, as the Rust data plane's engine names it before the control plane reads
        # the body
        if not checked.depth:
            _refuse_too_deep(raw, anthropic)
        if isinstance(exc, RecursionError):
            raise _Refusal(400, "the body nests too deeply to record") from None
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise _Refusal(400, f"the body is not JSON: {reason}") from None


def _refuse_too_deep(raw: bytes, anthropic: bool) -> None:
    """Refuse a body that holds a field too deep as the Rust data plane's engine does (by
    its check, `body_too_deep`), whatever else is wrong with it."""
    field = body_too_deep(raw, anthropic)
    if field is not None:
        raise _too_deep(field)


def _too_deep(field: str) -> _Refusal:
    return _Refusal(
        400,
        f"the request cannot be recorded: {field} nests deeper than {MAX_DEPTH} levels "
        "(refused before the call went upstream)",
    )


# Every byte a digit is b"0", every other a space: a run of more digits than the limit is then
# one substring search away (`_check_digits`).
_DIGIT_RUNS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))


def _check_digits(body: dict[str, Any], limit: int) -> None:
    """Refuse a body whose raw fields (the messages, the tools, Anthropic's system: not
    decoded before they go upstream) hold an int of more digits than `limit` (the server's
    `sys.get_int_max_str_digits()`, 0: none): json.loads refuses it, so the turn could not be
    recorded, and the engine must not generate for it first. The decoded fields were read by
    json.loads' rules already (such an int in one refuses the body before this). A field is
    decoded only when its text holds a run of that many digits at all (one pass over it):
    digits in a string, or in a float, are no int."""
    if limit <= 0:
        return
    run = b"0" * (limit + 1)
    for key, value in body.items():
        if type(value) is not RawJSON:
            continue
        text = _text(value)
        if len(text) > limit and run in text.translate(_DIGIT_RUNS) and _undecodable(text):
            raise _too_many_digits(key, limit)


def _too_many_digits(field: str, limit: int) -> _Refusal:
    return _Refusal(
        400,
        f"the request cannot be recorded: {field} holds an int of more than {limit} digits, "
        "which Python does not convert (sys.get_int_max_str_digits()): send it as a string, "
        "or raise the server's limit (PYTHONINTMAXSTRDIGITS) "
        "(refused before the call went upstream)",
    )


# Depth is checked before the call goes upstream: a body the graph would refuse to record
# (containers nested deeper than MAX_DEPTH) must not cost the engine a generation first. The
# text is measured in C-speed passes (`json_nesting`).
_NOT_OPENER = bytes(b for b in range(256) if b not in b"[{")


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether a field's containers nest deeper than `limit`. A `RawJSON` is measured only
    when its text holds more brackets than that at all (one pass over it)."""
    if type(value) is RawJSON:
        text = _text(value)
        return len(text.translate(None, _NOT_OPENER)) > limit and json_nesting(text) > limit
    deepest = 0
    todo = [(value, 0)]
    while todo:
        item, depth = todo.pop()
        if type(item) is RawJSON:
            deepest = max(deepest, depth + json_nesting(_text(item)))
        elif isinstance(item, dict | list):
            deepest = max(deepest, depth + 1)
            todo += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest > limit


def _messages_deeper_than(value: Any, limit: int) -> bool:
    """Whether a message of the messages array nests deeper than `limit`: a raw array with
    that many brackets is split into its messages, and only a message holding that many is
    measured (a long conversation is not). A value that is not an array (refused, but
    measured first) may nest one level more, as an array of messages may."""
    if type(value) is not RawJSON:
        if not isinstance(value, list):
            return _deeper_than(value, limit + 1)
        return any(_deeper_than(m, limit) for m in value)
    text = _text(value)
    if len(text.translate(None, _NOT_OPENER)) <= limit:
        return False
    items = split_array(text)
    if items is None:  # (a raw messages array is one msgspec has read)
        return json_nesting(text) > limit + 1
    return any(_deeper_than(RawJSON(bytes(item)), limit) for item in items)


def _check_depth(body: dict[str, Any], anthropic: bool) -> None:
    """Refuse a body that holds a value the graph would refuse as nested too deeply: the
    tools (a value of its own), the messages (each message is one: the array adds a level),
    Anthropic's system (inside the first message: one level more) and every other recorded
    field (inside the sampling parameters: one level more)."""
    recorded_apart = _MESSAGES_FIELDS if anthropic else _CHAT_FIELDS
    for key, value in body.items():
        if key == "messages":
            deep = _messages_deeper_than(value, MAX_DEPTH)  # each message is a value
        elif key == "tools":
            deep = _deeper_than(value, MAX_DEPTH)
        elif key == "system" and anthropic:
            deep = _deeper_than(value, MAX_DEPTH - 1)  # the content of the first message
        elif key in recorded_apart:
            continue  # not recorded as sent (model, stream, stream_options)
        else:
            deep = _deeper_than(value, MAX_DEPTH - 1)  # a value of the sampling parameters
        if deep:
            raise _too_deep(key)


# ---------------------------------------------------------------------- streaming exports


_END = object()


class _Pipe:
    """A file a worker thread writes an export to, read by the response as it streams.

    When the client goes away the reader closes the pipe and the writer's next write raises,
    so an abandoned export releases its session's graph at once.
    """

    CHUNK = 1 << 16

    def __init__(self) -> None:
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=16)
        self.buffer = bytearray()
        self.closed = False

    def write(self, data: bytes) -> int:
        self.buffer += data
        if len(self.buffer) >= self.CHUNK:
            self.flush()
        return len(data)

    def flush(self) -> None:
        if self.buffer:
            self.put(bytes(self.buffer))
            self.buffer.clear()

    def put(self, item: Any) -> None:
        while True:
            if self.closed:
                raise BrokenPipeError("the client stopped reading")
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def get(self) -> Any:
        while not self.closed:
            try:
                return self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
        return _END


async def _from_thread(produce: Callable[[IO[bytes]], None]) -> AsyncGenerator[bytes, None]:
    pipe = _Pipe()

    def run() -> None:
        try:
            produce(pipe)  # type: ignore[arg-type]
            pipe.flush()
            pipe.put(_END)
        except BrokenPipeError:
            pass
        except BaseException as exc:  # handed to the reader, which ends the response
            with contextlib.suppress(BrokenPipeError):
                pipe.put(exc)

    threading.Thread(target=run, name="rollout-store-export", daemon=True).start()
    try:
        while True:
            item = await anyio.to_thread.run_sync(pipe.get)
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        pipe.closed = True


# ---------------------------------------------------------------------- the app


def _error_body(anthropic: bool, status: int, reason: str) -> dict[str, Any]:
    kind = {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        408: "timeout_error",
        413: "request_too_large",
        415: "invalid_request_error",
        507: "api_error",
        502: "api_error",
        504: "timeout_error",
    }.get(status, "invalid_request_error")
    if anthropic:
        return {"type": "error", "error": {"type": kind, "message": reason}}
    return {"error": {"message": reason, "type": kind, "param": None, "code": None}}


def _failure(anthropic: bool, failed: _Refusal | _Passthrough) -> Response:
    """The answer to a call that failed before its answer began: a refusal in the error
    shape of the route's API, or the upstream's own error as it came."""
    if isinstance(failed, _Passthrough):
        return failed.response
    # a body that did not arrive in time was not read: the connection cannot be reused
    headers = {"connection": "close"} if failed.status == 408 else None
    error = _error_body(anthropic, failed.status, failed.reason)
    try:
        return JSONResponse(error, failed.status, headers=headers)
    except UnicodeEncodeError:
        # a reason naming what the client sent with a lone surrogate (a key json.loads read
        # from a \ud800 escape), which no UTF-8 text holds: written with ASCII escapes
        text = json.dumps(error, separators=(",", ":")).encode()
        return Response(text, failed.status, headers=headers, media_type="application/json")


def _api_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("x-api-key") or None


def _harness_session(
    headers: Mapping[str, str], body: dict[str, Any], anthropic: bool
) -> str | None:
    for name in _HARNESS_HEADERS:
        found = clean_session_id(headers.get(name))
        if found is not None:
            return found
    if anthropic:
        meta = body.get("metadata")
        return clean_session_id(meta.get("user_id")) if isinstance(meta, dict) else None
    return clean_session_id(body.get("user"))


_PROMPT_IDS = "prompt_token_ids"


def _decoded_answer(answer: bytes) -> Any:
    """An upstream's complete answer as json.loads reads it (msgspec's speed, json.loads's
    values), but a top-level `prompt_token_ids` of ints in [0, 2**32) written as JSON writes
    them (a long context's ids) is read straight into packed ids (`PackedIds`): one engine
    pass, not one Python int an id. `_plain_answer` makes them a list again."""
    found = json_member_ids(answer, _PROMPT_IDS) if b'"prompt_token_ids"' in answer else None
    if found is not None:
        start, end, ids = found
        # the rest decoded (and checked) with the ids out of the way
        payload = RawJSON(answer[:start] + b"null" + answer[end:]).decode()
        if type(payload) is dict:  # (no key is escaped: the null put there is the value)
            payload[_PROMPT_IDS] = PackedIds(ids)
            return payload
    return RawJSON(answer).decode()


def _plain_answer(response: dict[str, Any]) -> dict[str, Any]:
    """`response` with packed ids (`_decoded_answer`) a list again, to be written anew."""
    ids = response.get("prompt_token_ids")
    if type(ids) is PackedIds:
        return {**response, "prompt_token_ids": ids.tolist()}
    return response


def _strip_injected(response: dict[str, Any], token_ids: bool, logprobs: bool) -> None:
    """Remove from a Chat Completions answer what the server asked for and the client did not
    (choices that are not a list hold none: an answer replied to before its turn is made,
    with `--ack fast`, may have any)."""
    if token_ids:
        response.pop("prompt_token_ids", None)
    choices = response.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict):
            if token_ids:
                choice.pop("token_ids", None)
            if logprobs and "logprobs" in choice:
                choice["logprobs"] = None


def _end_of_text(raw: bytes, end: int) -> int:
    """Where the JSON whitespace before `end` in `raw` begins (`end` when there is none)."""
    while end and raw[end - 1] in b" \t\r\n":
        end -= 1
    return end


def upstream_parts(
    raw: bytes,
    body: dict[str, Any],
    extra: dict[str, Any],
    drop: tuple[str, ...] = ("stream_options",),
) -> tuple[int, bytes]:
    """The body sent upstream, as `raw[:head] + tail`: the client's with `extra` set and the
    fields `drop` names (`stream_options`, unless the upstream is to stream) dropped.

    When the client's body is UTF-8 and has none of those keys, `extra` is appended to its
    own bytes (no key repeats, nothing re-encoded): `head` is where its closing brace's
    whitespace begins, and `tail` the new members and the brace. Otherwise (json.loads also
    reads UTF-16 and UTF-32) the body is written anew (`head` 0) from its fields in their
    order, a `RawJSON` field (see `split_body`) as its own text: re-encoding a large
    conversation costs more than decoding it. The Rust data plane sends the two parts as
    they are (the client's bytes never copied here); `upstream_body` joins them.
    """
    if (
        not any(key in body for key in drop)
        and not any(key in body for key in extra)
        and json.detect_encoding(raw) in ("utf-8", "utf-8-sig")
    ):
        end = _end_of_text(raw, len(raw))
        if raw[end - 1 : end] == b"}":
            head = _end_of_text(raw, end - 1)
            items = json.dumps(extra)[1:-1].encode("ascii")
            comma = b", " if raw[head - 1 : head] != b"{" else b""
            return head, b"".join((comma, items, b"}"))
    merged = {k: v for k, v in body.items() if k not in drop}
    merged.update(extra)
    parts = [b"{"]
    for key, value in merged.items():
        if len(parts) > 1:
            parts.append(b", ")
        parts += (
            json.dumps(key).encode("ascii"),
            b": ",
            _text(value) if type(value) is RawJSON else json.dumps(value).encode("ascii"),
        )
    parts.append(b"}")
    return 0, b"".join(parts)


def upstream_body(
    raw: bytes,
    body: dict[str, Any],
    extra: dict[str, Any],
    drop: tuple[str, ...] = ("stream_options",),
) -> bytes:
    """The body sent upstream (`upstream_parts`) in one buffer, made in one `join`: each `+`
    of a large body would be a copy of its own, and each new buffer over glibc's mmap
    threshold costs a page fault per 4 KiB (measured here: three `+` of a 200 KiB body,
    140-330 us; one `join`, 2 us)."""
    head, tail = upstream_parts(raw, body, extra, drop)
    return b"".join((memoryview(raw)[:head], tail)) if head else tail


def _json_bytes(response: dict[str, Any], answer: bytes) -> Response:
    """The upstream's own JSON answer, byte for byte (nothing decoded and encoded again),
    when it is UTF-8; else `response`, its decoded value, written anew (json.loads reads
    UTF-16 and UTF-32, which an answer that names no charset cannot be)."""
    if json.detect_encoding(answer) in ("utf-8", "utf-8-sig"):
        return Response(answer, media_type="application/json")
    return _written_anew(_plain_answer(response))


def _chat_reply(
    response: dict[str, Any], answer: bytes, token_ids: bool, logprobs: bool
) -> Response:
    """The reply to a Chat Completions answer (`response` decoded, `answer` its bytes): the
    upstream's bytes when the server added no capture field (`_json_bytes`); else those
    bytes with the fields the server asked for and the client did not taken out, written
    compactly, by the engine (`answer_reply`, the edits a streamed chunk gets: the Rust data
    plane makes its replies there too, so both planes send the same bytes). An answer the
    engine leaves to Python (not strict UTF-8, a key of those fields escaped, an int of more
    than 18 digits) is taken out of its decoded value and written anew."""
    if not (token_ids or logprobs):
        return _json_bytes(response, answer)
    made = answer_reply(answer, token_ids, logprobs)
    if made is not None:
        return Response(made, media_type="application/json")
    _strip_injected(response, token_ids, logprobs)
    return _written_anew(_plain_answer(response))


def _json_reply(reply: bytes) -> _Reply:
    """A JSON reply as `_reply(Response(reply, media_type="application/json"))` makes it."""
    headers = [(b"content-length", b"%d" % len(reply)), (b"content-type", b"application/json")]
    return 200, headers, [reply], False


def _written_anew(response: dict[str, Any]) -> Response:
    """A document written as json.dumps writes it: what json.loads read (from the upstream, or
    a session's metadata), NaN and lone surrogates too, which a strict writer (JSONResponse)
    refuses. UTF-8 as JSONResponse writes it; ASCII escapes only for a document holding a lone
    surrogate, which no UTF-8 text can carry."""
    try:
        text = json.dumps(response, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        text = json.dumps(response, separators=(",", ":")).encode()
    return Response(text, media_type="application/json")


def _replayed(chunks: Iterator[bytes]) -> list[bytes]:
    """The events of a streamed answer, made before its turn is recorded: an answer of a
    shape they cannot be made of is the upstream's fault (502), and is recorded nowhere."""
    try:
        return list(chunks)
    except Exception as exc:  # any answer the replay cannot follow
        raise _Refusal(
            502, f"the upstream's answer cannot be replayed as a stream: {type(exc).__name__}"
        ) from None


def _recorder(
    turn_of: Callable[[dict[str, Any]], TurnNode],
    events_of: Callable[[dict[str, Any]], Iterator[bytes]] | None,
) -> tuple[Callable[[dict[str, Any]], TurnNode], list[bytes]]:
    """The turn maker of a call, and the list its stream's events land in (`events_of`: a
    streamed call's, None otherwise): the events are made before the turn is recorded."""
    replay: list[bytes] = []

    def make_turn(response: dict[str, Any]) -> TurnNode:
        node = turn_of(response)
        if events_of is not None:
            replay[:] = _replayed(events_of(response))
        return node

    return make_turn, replay


async def _events(
    chunks: Iterator[bytes] | AsyncIterator[bytes], clock: CallClock
) -> AsyncIterator[bytes]:
    """The chunks of a streamed answer, each stamped on `clock` as it goes out."""
    if isinstance(chunks, AsyncIterator):
        async for chunk in chunks:
            clock.chunk()
            yield chunk
        return
    for chunk in chunks:
        clock.chunk()
        yield chunk


@dataclass
class _Plan:
    """A model call ready to go upstream: its session, where and what to send, how its
    answer becomes a turn (`make_turn`, which also fills `replay` with a streamed call's
    events; `turn_of`, the turn alone) and a reply (`reply`), its clock, and the capture
    fields the server asked for that the client did not (`injected`: token ids, logprobs)."""

    session: Session
    anthropic: bool
    stream: bool
    path: str
    content: bytes
    headers: dict[str, str]
    make_turn: Callable[[dict[str, Any]], TurnNode]
    reply: Callable[[dict[str, Any], bytes], Response]
    replay: list[bytes]
    clock: CallClock
    turn_of: Callable[[dict[str, Any]], TurnNode]
    injected: tuple[bool, bool] = (False, False)
    messages: Any = None
    #: The body sent upstream is the client's `raw[:head]`, then `content` (`head` 0:
    #: `content` alone). Only a `passthrough` plan (the Rust data plane's) has a `head`.
    head: int = 0


class _Server:
    """State and handlers of one app: configuration, sessions and the upstream client."""

    def __init__(
        self, config: CaptureConfig, sessions: Sessions, admin_key: str | None = None
    ) -> None:
        self.config = config
        self.sessions = sessions
        self._admin_key = admin_key.encode("utf-8", "surrogatepass") if admin_key else None
        upstream = config.upstream.rstrip("/")
        if upstream.endswith("/v1"):
            upstream = upstream[: -len("/v1")]
        self.upstream = upstream
        #: Python's digit limit for ints (`sys.get_int_max_str_digits()`, 0: none) as the
        #: server starts: a model call whose raw fields hold a longer int is refused before
        #: it goes upstream (`_check_digits`), with the same limit for every call.
        self.max_digits = sys.get_int_max_str_digits()
        self._client: aiohttp.ClientSession | None = None
        #: Turns are added in the event loop when adding one waits for nothing (a memory
        #: store and no log to sync): a worker thread's wait for the GIL would cost more
        #: than the turn (measured in the benchmark's GRPO group: 2.7-3.0 ms of server CPU a
        #: call with the turn in a thread, 2.0-2.5 inline, side by side). With a log synced
        #: per turn or a store over the network, a thread.
        self.inline = isinstance(sessions.store, MemoryStore) and (
            sessions.data is None or sessions.fsync == "never"
        )
        #: `--ack fast`: the turns answered but not yet recorded, and their recorder (made
        #: on first use, inside the server's event loop).
        self._pending: asyncio.Queue[tuple[Session, TurnNode, CallClock]] | None = None
        self._recorder: asyncio.Task[None] | None = None
        #: The recorder's turns set aside, in their order, while their session's graph is
        #: held (counted in the queue's bound; `pending.task_done` once recorded or counted),
        #: and the timelines of recorded turns set aside likewise (a None turn).
        self._aside: list[tuple[Session, TurnNode | None, CallClock]] = []
        #: Turns taken from `_aside` to be tried again: they still count in the bound (and
        #: in `/health`) until recorded or set aside again.
        self._retrying = 0
        #: The recorder was stopped (`_drain`): a turn answered since is counted, not queued.
        self._stopped = False
        #: Turns answered with `--ack fast` and never recorded, by why (`killed`: by a server
        #: killed before recording them, counted at this start from the ack ledger).
        self.dropped = {"queue_full": 0, "record_error": 0, "shutdown": 0, KILLED: 0}
        for why, n in sessions.lost_at_start.items():
            self.dropped[why] = self.dropped.get(why, 0) + n
        #: Per session id, the calls whose timeline is still to be recorded (a task after
        #: the reply), by when each was answered: an export waits for them, bounded.
        self._timing: dict[str, dict[int, float]] = {}
        #: The Rust data plane serving the model routes, when one does (`RustDataPlane`),
        #: and the app's event loop once it runs (where that plane's queued turns are
        #: recorded, as this server's own recorder records them).
        self.plane: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def client(self) -> aiohttp.ClientSession:
        """The upstream's client: aiohttp, whose C parser costs a fraction of httpx's time
        per call (made on first use, inside the server's event loop)."""
        if self._client is None:
            self._client = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.config.upstream_timeout),
                # idle connections are dropped before a uvicorn upstream (vLLM, SGLang)
                # closes them at 5 s: reusing one it is closing fails the call
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
                auto_decompress=True,
                skip_auto_headers=("User-Agent",),
                # one client serves every session: a cookie the upstream set in one session's
                # answer must not go out with the others' calls
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._client

    async def _get(
        self, method: str, path: str, clock: CallClock | None = None, **kwargs: Any
    ) -> tuple[int, Any, bytes]:
        """One call to the upstream: status, headers and the whole body (stamped on
        `clock`: sent, first byte, last byte)."""
        if clock is not None:
            clock.upstream_sent = clock.now()
        async with self.client.request(method, self.upstream + path, **kwargs) as answer:
            if clock is not None:
                clock.first_byte = clock.now()
            body = await answer.read()
            if clock is not None:
                clock.last_byte = clock.now()
            return answer.status, answer.headers, body

    async def aclose(self) -> None:
        plane, self.plane = self.plane, None
        if plane is not None:  # its queued turns are recorded before the sessions close
            await anyio.to_thread.run_sync(plane.close)
        await self._drain()
        if self._client is not None:
            await self._client.close()
            self._client = None
        await anyio.to_thread.run_sync(self.sessions.close)

    # -- proxy

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise _Refusal(400, "Content-Length is not a number")
            if int(declared) > limit:
                raise _Refusal(
                    413, f"the body of {declared} bytes is over the limit of {limit} bytes"
                )
        parts: list[bytes] = []
        size = 0
        timeout = self.config.body_timeout
        try:
            async with asyncio.timeout(timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise _Refusal(413, f"the body is over the limit of {limit} bytes")
                    parts.append(chunk)
        except TimeoutError:
            raise _Refusal(
                408, f"the body did not arrive within {timeout:g} s (--body-timeout)"
            ) from None
        except ClientDisconnect:
            raise _Gone from None
        return b"".join(parts)

    async def _forward(
        self, path: str, content: bytes, headers: dict[str, str], clock: CallClock | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """The upstream's answer to one call, decoded and as its bytes (or _Refusal or
        _Passthrough)."""
        try:
            status, answer_headers, answer = await self._get(
                "POST", path, clock, data=content, headers=headers
            )
        except TimeoutError:
            raise _Refusal(
                504, f"the upstream did not answer within {self.config.upstream_timeout:g} s"
            ) from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise _Refusal(502, f"the upstream cannot be reached: {type(exc).__name__}") from None
        return self._upstream_answer(status, answer_headers, answer)

    def _upstream_answer(
        self, status: int, answer_headers: Mapping[str, str], answer: bytes
    ) -> tuple[dict[str, Any], bytes]:
        """The upstream's complete answer decoded (or _Refusal or _Passthrough)."""
        if not 200 <= status < 300:
            keep = {
                k: v
                for k, v in answer_headers.items()
                if k.lower() in ("content-type", "retry-after")
            }
            raise _Passthrough(Response(answer, status, headers=keep))
        try:
            payload = _decoded_answer(answer)
        except (ValueError, RecursionError):
            raise _Refusal(502, "the upstream answered with a body that is not JSON") from None
        if not isinstance(payload, dict):
            raise _Refusal(502, "the upstream answered with JSON that is not an object")
        return payload, answer

    def upstream_template(self, anthropic: bool) -> list[tuple[str, str | None]]:
        """The upstream call's headers, in order: a name with no value is the call's own
        (sent only if the call has it). What both data planes send (`_upstream_headers`;
        the Rust plane's direct lane fills it in itself)."""
        template: list[tuple[str, str | None]] = [("content-type", "application/json")]
        key = self.config.upstream_api_key
        if anthropic:
            template += [(name, None) for name in _ANTHROPIC_HEADERS]
            if key:
                template.append(("x-api-key", key))
        elif key:
            template.append(("authorization", f"Bearer {key}"))
        return template

    def _upstream_headers(self, sent: Mapping[str, str], anthropic: bool) -> dict[str, str]:
        headers = {}
        for name, value in self.upstream_template(anthropic):
            if value is not None:
                headers[name] = value
            elif name in sent:
                headers[name] = sent[name]
        return headers

    def _session(
        self, key: str | None, session_id: str | None = None, damaged: bool = False
    ) -> Session:
        """The session a model call's key opens (or the refusal); `session_id`: the one the
        Rust data plane's key table names for it; `damaged`: one that cannot record too."""
        session = self.sessions.resolve(key, session_id)
        if session is None:
            raise _Refusal(
                401, "unknown API key: create a session with POST /sessions and use its api_key"
            )
        if session.damaged is not None and not damaged:
            raise _cannot_record(session.damaged)
        return session

    async def _on_graph(self, session: Session, work: Callable[[], _T], wait: bool = True) -> _T:
        """`work()`, which uses the session's graph (held meanwhile): in the loop if no other
        thread holds the graph (an export that holds it may be waiting for this loop to take
        what it wrote), else in a worker thread, which waits for the graph, or (not `wait`)
        raises `_Held` if another thread holds it."""
        with session.use() as graph:
            if self.inline:
                if graph.lock.acquire(blocking=False):
                    try:
                        return work()
                    finally:
                        graph.lock.release()
                if not wait:
                    raise _Held
            if wait:
                return await anyio.to_thread.run_sync(work)
            return await anyio.to_thread.run_sync(_unless_held, graph, work)

    async def _record(self, session: Session, node: TurnNode) -> str:
        """`record_now`, run by `_on_graph`: the node id. With `--ack fast` only the recorder
        records, and never waits for a graph another thread holds (`_Held`)."""
        try:
            return await self._on_graph(
                session,
                functools.partial(self.record_now, session, node),
                wait=self.config.ack != "fast",
            )
        except (OSError, RolloutStoreError) as exc:  # (the session's graph not reopened)
            raise _not_recorded(session, exc) from None

    def record_now(self, session: Session, node: TurnNode) -> str:
        """Add the turn to the session's graph in the calling thread (the Rust data plane's,
        or the one `_record` picks): the node id."""
        try:
            with session.use() as graph:
                view = graph.add_turn(node)
        except (OSError, RolloutStoreError) as exc:
            raise _not_recorded(session, exc) from None
        return _recorded(session, view)

    async def _timed(self, session: Session, clock: CallClock) -> None:
        """Record a call's timeline once its reply is sent (a background task of the
        response): best effort. With `--ack fast` the turn may not be recorded yet: the
        recorder then records the timeline once it has recorded the turn."""
        try:
            clock.reply_sent = clock.now()
            if clock.node_id is not None:
                await self._record_timeline(session, clock)
        finally:
            self.timed(session, clock)

    async def _timelines_recorded(self, session: Session) -> None:
        """Wait (at most `_TIMELINE_WAIT_S`) for the timelines of the session's calls
        answered before now, so an export taken right after a call has its timeline (not
        for those answered meanwhile: under steady traffic there always are some)."""
        began = time.monotonic()
        deadline = began + _TIMELINE_WAIT_S
        while True:
            pending = self._timing.get(session.session_id)
            now = time.monotonic()
            # a reply never sent (its client gone) runs no task: its entry expires
            if not pending or now >= deadline:
                return
            if all(
                now - answered > _TIMELINE_WAIT_S or answered > began
                for answered in list(pending.values())
            ):
                return
            await asyncio.sleep(0.005)

    async def _record_timeline(self, session: Session, clock: CallClock) -> None:
        """`record_timeline_now`, run by `_on_graph`."""
        if clock.node_id is None:
            return
        with contextlib.suppress(RolloutStoreError, OSError):
            await self._on_graph(
                session, functools.partial(self.record_timeline_now, session, clock)
            )

    def record_timeline_now(self, session: Session, clock: CallClock, wait: bool = True) -> bool:
        """Set a recorded call's timeline in the calling thread (the Rust data plane's, or
        the one `_record_timeline` picks): best effort. Not `wait`: False, and nothing set,
        when another thread holds the graph."""
        if clock.node_id is None:
            return True
        with contextlib.suppress(RolloutStoreError, OSError), session.use() as graph:
            if wait:
                _apply_timeline(graph, clock)
            elif graph.lock.acquire(blocking=False):
                try:
                    _apply_timeline(graph, clock)
                finally:
                    graph.lock.release()
            else:
                return False
        return True

    def timing(self, session: Session, clock: CallClock, at: float | None = None) -> None:
        """A call whose timeline is recorded once its reply is sent (an export waits);
        answered `at` (`time.monotonic()`; None: now)."""
        at = time.monotonic() if at is None else at
        self._timing.setdefault(session.session_id, {})[id(clock)] = at

    def timed(self, session: Session, clock: CallClock) -> None:
        """That call's reply is sent and its timeline recorded (or let go)."""
        pending = self._timing.get(session.session_id)
        if pending is not None:
            pending.pop(id(clock), None)
            if not pending:
                self._timing.pop(session.session_id, None)

    # -- --ack fast: answered first, recorded right after

    def _drop(self, session: Session, why: str, turn: object) -> None:
        """A turn answered with `--ack fast` that will not be recorded (`turn`: what
        `Sessions.answered` was told, its call's clock), counted."""
        session.dropped += 1
        self.dropped[why] += 1
        self.sessions.not_recorded(session, why, turn)

    def _queue_turn(self, session: Session, node: TurnNode, clock: CallClock) -> None:
        """Hand an answered call's turn to the recorder; a full queue drops it (counted), as
        does a server whose recorder has stopped (`shutdown`)."""
        if self._pending is None:
            self._pending = asyncio.Queue(self.config.ack_queue)
        if self._recorder is None and not self._stopped:
            self._recorder = asyncio.ensure_future(self._record_queued(self._pending))
        # in the ack ledger before the answer goes out: a kill before it is recorded
        # leaves it counted by the next start
        self.sessions.answered(session, clock)
        if self._stopped:
            self._drop(session, "shutdown", clock)
            return
        aside = self._aside_turns()
        if aside and self._pending.qsize() + aside >= self.config.ack_queue:
            self._drop(session, "queue_full", clock)  # (the turns set aside count in the bound)
            return
        try:
            self._pending.put_nowait((session, node, clock))
        except asyncio.QueueFull:
            self._drop(session, "queue_full", clock)

    def _aside_turns(self) -> int:
        return self._retrying + sum(node is not None for _, node, _ in self._aside)

    async def _record_queued(
        self, pending: asyncio.Queue[tuple[Session, TurnNode, CallClock]]
    ) -> None:
        """Record the queued turns in their order (a session's turns keep the order they
        were answered in), and the timeline of each one whose reply is sent. One turn
        waiting, or turns added in the loop (`inline`), go one at a time; several waiting
        go together to one worker thread (`_record_group`): each session's log synced once
        for its turns of the group, not once a turn, so the recorder keeps up with answers
        that come faster than one sync each.

        A session whose graph another thread holds (an export being read) holds up no
        other session: its turns are set aside (`_aside`), in their order, and tried again
        before the turns queued since, every `ASIDE_RETRY` seconds; a stopping server that
        cancels this counts those still set aside as dropped (`shutdown`)."""
        aside = self._aside
        try:
            while True:
                if not aside:
                    taken = [await pending.get()]
                else:
                    if pending.empty():
                        await asyncio.sleep(ASIDE_RETRY)
                    taken = []
                while len(taken) < ACK_GROUP and not pending.empty():
                    taken.append(pending.get_nowait())
                group: list[tuple[Session, TurnNode | None, CallClock]] = [*aside, *taken]
                self._retrying = self._aside_turns()
                aside.clear()
                try:
                    if sum(node is not None for _, node, _ in group) > 1 and not self.inline:
                        await self._record_group(pending, group)
                    else:
                        await self._record_each(pending, group)
                finally:
                    self._retrying = 0
        except asyncio.CancelledError:
            for session, node, clock in aside:  # (a set-aside timeline is let go)
                if node is not None:
                    self._drop(session, "shutdown", clock)
                    pending.task_done()
            aside.clear()
            raise

    async def _record_each(
        self,
        pending: asyncio.Queue[tuple[Session, TurnNode, CallClock]],
        group: list[tuple[Session, TurnNode | None, CallClock]],
    ) -> None:
        """Record `group` one turn at a time (`_record_one`); once a session's turn is set
        aside, so are its later ones. A stopping server's cancel sets aside the turns not
        begun (`_record_queued` counts them)."""
        held: set[int] = set()
        for k, item in enumerate(group):
            session, node, clock = item
            if node is not None and id(session) in held:
                self._aside.append(item)
                continue
            set_aside, cancelled = await self._record_one(session, node, clock)
            if set_aside:
                held.add(id(session))
            elif node is not None:
                pending.task_done()
            if cancelled:
                self._aside += group[k + 1 :]
                raise asyncio.CancelledError

    async def _record_one(
        self, session: Session, node: TurnNode | None, clock: CallClock
    ) -> tuple[bool, bool]:
        """Record one queued turn (`_record`), and its timeline if its reply is sent (or
        only that timeline, a None `node`): whether the turn was set aside (its graph held),
        and whether a stopping server cancelled this meanwhile. The recording begun is
        waited for all the same, so the turn is counted as what it became, recorded or not.
        A timeline whose graph is held is set aside."""
        if node is None:
            try:
                if not await self._timeline_free(session, clock):
                    self._aside.append((session, None, clock))
            except asyncio.CancelledError:
                return False, True
            return False, False
        recording = asyncio.ensure_future(self._record(session, node))
        cancelled = False
        try:
            await asyncio.wait([recording])  # (cancelling the wait leaves the recording be)
        except asyncio.CancelledError:
            cancelled = True
            await asyncio.wait([recording])
        try:
            clock.node_id = recording.result()
        except _Held:
            self._aside.append((session, node, clock))
            return True, cancelled
        except Exception:  # any failure: the client has its answer, the turn is counted
            self._drop(session, "record_error", clock)
            return False, cancelled
        try:
            if clock.reply_sent >= 0 and not cancelled:  # sent before it was recorded: ours
                try:
                    if not await self._timeline_free(session, clock):
                        self._aside.append((session, None, clock))
                except asyncio.CancelledError:
                    return False, True
        finally:
            self.sessions.recorded(session, clock)  # (its timeline too, if its reply was sent)
        return False, cancelled

    async def _timeline_free(self, session: Session, clock: CallClock) -> bool:
        """Record a recorded call's timeline unless another thread holds the graph (then
        False); best effort."""
        try:
            await self._on_graph(
                session, functools.partial(self.record_timeline_now, session, clock), wait=False
            )
        except _Held:
            return False
        except (RolloutStoreError, OSError):
            pass
        return True

    async def _record_group(
        self,
        pending: asyncio.Queue[tuple[Session, TurnNode, CallClock]],
        group: list[tuple[Session, TurnNode | None, CallClock]],
    ) -> None:
        """Record `group`, each session's turns in a worker thread of their own
        (`record_group_now`; the sessions' logs are synced side by side), then the
        timelines of its calls whose replies are sent; a session whose graph is held has its
        turns set aside, as do timelines. A stopping server that cancels this waits for the
        threads: each turn is then counted as what it became, recorded or not."""
        parts: dict[int, list[int]] = {}
        for i, (session, node, _) in enumerate(group):
            if node is not None:
                parts.setdefault(id(session), []).append(i)

        def record_part(part: list[int]) -> tuple[list[str | None], list[int]]:
            held: list[int] = []
            turns = [(s, n, c) for s, n, c in (group[i] for i in part) if n is not None]
            return self.record_group_now(turns, held), held

        work = asyncio.gather(
            *(anyio.to_thread.run_sync(record_part, part) for part in parts.values())
        )
        cancelled = False
        try:
            done = await asyncio.shield(work)
        except asyncio.CancelledError:
            cancelled = True
            done = await work
        ids: list[str | None] = [None] * len(group)
        held_at: set[int] = set()
        for part, (part_ids, part_held) in zip(parts.values(), done, strict=True):
            for i, node_id in zip(part, part_ids, strict=True):
                ids[i] = node_id
            held_at.update(part[j] for j in part_held)
        sent: list[tuple[Session, CallClock]] = []
        recorded: list[tuple[Session, CallClock]] = []
        finished = 0
        for i, (session, node, clock) in enumerate(group):
            if node is None:  # a timeline set aside
                sent.append((session, clock))
                continue
            if i in held_at:
                self._aside.append(group[i])
                continue
            finished += 1
            node_id = ids[i]
            if node_id is None:  # any failure: the client has its answer, the turn is counted
                self._drop(session, "record_error", clock)
                continue
            clock.node_id = node_id
            recorded.append((session, clock))
            if clock.reply_sent >= 0:  # sent before the turn was recorded: ours to do
                sent.append((session, clock))
        try:
            if sent and not cancelled:
                with contextlib.suppress(Exception):  # timelines are best effort
                    held = await anyio.to_thread.run_sync(self._record_timelines_now, sent)
                    self._aside += [(session, None, clock) for session, clock in held]
        finally:
            for session, clock in recorded:  # (and its timeline, if its reply was sent)
                self.sessions.recorded(session, clock)
            for _ in range(finished):
                pending.task_done()
        if cancelled:
            raise asyncio.CancelledError

    def record_group_now(
        self,
        group: Sequence[tuple[Session, TurnNode, CallClock]],
        held: list[int] | None = None,
        timelines: bool = False,
    ) -> list[str | None]:
        """Add each turn of `group` to its session's graph in the calling thread, each
        session's turns in their order inside one `group_commit` (its log synced once for
        them): each turn's node id, or None for a turn that could not be recorded.

        With a `held` list, a session whose graph another thread holds (an export being
        read) is not waited for: its turns are left out (None) and their indices added to
        `held`. `timelines`: a turn whose reply is sent has its timeline set too, while
        its graph is held for it."""
        ids: list[str | None] = [None] * len(group)
        by_session: dict[int, list[int]] = {}
        for i, (session, _, _) in enumerate(group):
            by_session.setdefault(id(session), []).append(i)
        for turns in by_session.values():
            session = group[turns[0]][0]
            # a failed sync at the end keeps the turns written and recorded (the next
            # sync or close syncs them): only what never got in is counted
            with contextlib.suppress(Exception), session.use() as graph:
                if held is not None and not graph.lock.acquire(blocking=False):
                    held += turns
                    continue
                try:
                    with graph.group_commit():
                        for i in turns:
                            with contextlib.suppress(Exception):
                                ids[i] = self.record_now(session, group[i][1])
                            clock = group[i][2]
                            if timelines and ids[i] is not None and clock.reply_sent >= 0:
                                clock.node_id = ids[i]
                                with contextlib.suppress(RolloutStoreError, OSError):
                                    _apply_timeline(graph, clock)
                finally:
                    if held is not None:
                        graph.lock.release()
        return ids

    def _record_timelines_now(
        self, sent: list[tuple[Session, CallClock]]
    ) -> list[tuple[Session, CallClock]]:
        """Record each call's timeline unless its graph is held: those held."""
        return [
            (session, clock)
            for session, clock in sent
            if not self.record_timeline_now(session, clock, wait=False)
        ]

    async def settled(self, timeout: float = ACK_DRAIN_SECONDS) -> bool:
        """Wait (at most `timeout` seconds) until every turn answered so far is recorded or
        counted as dropped; whether it was."""
        if self.plane is not None:
            return await anyio.to_thread.run_sync(self.plane.settle, timeout)
        if self._pending is None or self._recorder is None:
            return True
        try:
            async with asyncio.timeout(timeout):
                await self._pending.join()
        except TimeoutError:
            return False
        return True

    async def settled_session(self, session: Session, timeout: float = ACK_DRAIN_SECONDS) -> bool:
        """`settled` for one session: wait (at most `timeout` seconds) until its turns
        answered so far are recorded or counted as dropped, whatever other sessions' turns
        still wait for (a session whose graph an export holds, say); whether they were."""
        # watched from the loop, not waited for in a worker thread: requests waiting for a
        # held session's turns (a dashboard polling its info) would take every thread the
        # recorder and the exports need, and hold up every other session with it
        # only those answered before it: under steady traffic some later turn of the
        # session is always on its way, and a wait for none would wait its whole bound
        deadline = time.monotonic() + timeout
        plane = self.plane
        if plane is not None:
            # the calls the engine answered itself (its direct lane) are told of by the
            # recorder: those answered before now first
            sent = plane.turns_sent()
            while not plane.handed_through(sent):
                if time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(_SETTLE_POLL_S)
        answered = self.sessions.answered_so_far()
        while not self.sessions.settled_through(session, answered):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_SETTLE_POLL_S)
        return True

    async def _drain(self) -> None:
        """On stopping: record what is queued (bounded time), count the rest as dropped, as
        every turn answered from now on."""
        await self.settled()
        self._stopped = True
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await recorder
        pending, self._pending = self._pending, None
        while pending is not None and not pending.empty():
            session, _, clock = pending.get_nowait()
            self._drop(session, "shutdown", clock)

    async def _call(
        self,
        session: Session,
        path: str,
        content: bytes,
        headers: dict[str, str],
        make_turn: Callable[[dict[str, Any]], TurnNode],
        clock: CallClock,
        stream: bool = False,
    ) -> tuple[dict[str, Any], bytes]:
        """Forward one call, record its turn; the complete response, decoded and as the
        upstream's bytes (or _Refusal/_Passthrough). A failed attempt is counted for the
        session's next turn's timeline. With `--ack fast`, an answer that makes no turn is
        answered all the same (not `stream`: a streamed reply is made of the turn's events),
        the turn counted as dropped, as the Rust data plane counts it."""
        try:
            response, answer = await self._forward(path, content, headers, clock)
        except _Passthrough as passed:
            session.upstream_errors += 1
            session.failed = failed_after(session.failed, passed.response.status_code)
            raise
        except _Refusal as refused:
            if refused.status in (502, 504):  # the upstream unreachable or too slow
                session.failed = failed_after(session.failed, refused.status)
            raise
        failed = session.failed
        try:
            node = make_turn(response)
        except _Refusal:
            if self.config.ack != "fast" or stream:
                raise
            self.sessions.answered(session, clock)
            self._drop(session, "record_error", clock)
            clock.failed, session.failed = failed, 0
            return response, answer
        if self.config.ack == "fast":
            self._queue_turn(session, node, clock)
        else:
            clock.node_id = await self._record(session, node)
        clock.failed, session.failed = failed, 0
        return response, answer

    async def _answer(
        self,
        call: Any,
        anthropic: bool,
        stream: bool,
        reply: Callable[[dict[str, Any], bytes], Response],
        events: Callable[[dict[str, Any]], Iterator[bytes]],
        session: Session,
        clock: CallClock,
    ) -> Response:
        """The answer to a call, its timeline recorded once it is sent (see `_answered`)."""
        answer = await self._answered(call, anthropic, stream, reply, events, clock)
        if clock.node_id is not None or stream or self.config.ack == "fast":
            self.timing(session, clock)
            answer.background = BackgroundTask(self._timed, session, clock)
        return answer

    async def _answered(
        self,
        call: Any,
        anthropic: bool,
        stream: bool,
        reply: Callable[[dict[str, Any], bytes], Response],
        events: Callable[[dict[str, Any]], Iterator[bytes]],
        clock: CallClock,
    ) -> Response:
        """Wait for the call; a streaming client that waits long gets keep-alive comments.

        Until `stream_keepalive` seconds have passed the answer is not begun, so an upstream
        error still reaches the client with its own status; after that the stream starts
        (200) with SSE comments, and a failure arrives as an error event. A call that does
        not stream is awaited in this task: a task of its own cost two turns of the event
        loop (one to start it, one to wake this handler when it ends), each waiting behind
        whatever else was ready; measured in the server on the loaded 2-core machine, 0.46
        and 1.14 ms at the median, 9 and 17 ms at the 90th percentile.
        """
        if not stream:
            try:
                response, answer = await call
            except (_Refusal, _Passthrough) as failed:
                return _failure(anthropic, failed)
            return reply(response, answer)
        task: asyncio.Task[tuple[dict[str, Any], bytes]] = asyncio.ensure_future(call)
        try:
            done, _ = await asyncio.wait({task}, timeout=self.config.stream_keepalive)
        except BaseException:
            task.cancel()
            raise
        if done:
            try:
                response, _ = task.result()
            except (_Refusal, _Passthrough) as failed:
                return _failure(anthropic, failed)
            return StreamingResponse(
                _events(events(response), clock),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        return StreamingResponse(
            _events(self._kept_alive(task, anthropic, events), clock),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    async def _kept_alive(
        self,
        task: asyncio.Task[tuple[dict[str, Any], bytes]],
        anthropic: bool,
        events: Callable[[dict[str, Any]], Iterator[bytes]],
    ) -> AsyncIterator[bytes]:
        try:
            while True:
                yield b": keep-alive\n\n"
                done, _ = await asyncio.wait({task}, timeout=self.config.stream_keepalive)
                if done:
                    break
            try:
                response, _ = task.result()
            except (_Refusal, _Passthrough) as failed:
                if isinstance(failed, _Refusal):
                    status, reason = failed.status, failed.reason
                else:
                    status = failed.response.status_code
                    reason = (
                        f"the upstream answered {status}: "
                        + bytes(failed.response.body)
                        .decode("utf-8", "replace")
                        .replace("\n", " ")[:500]
                    )
                error = _error_body(anthropic, status, reason)
                yield sse_event("error", error) if anthropic else sse_data(error)
                return
            for chunk in events(response):
                yield chunk
        finally:
            task.cancel()  # the client left before the answer: the call is abandoned

    async def _accept(
        self, request: Request, *, anthropic: bool
    ) -> tuple[Session, bytes] | Response:
        """The session and raw body of a model call, or the refusal to answer (in the error
        shape of the route's API) when either is wrong. A session that cannot record is
        refused once the body is read, and a body too deep for that first: in the order the
        Rust data plane's engine refuses them, before the control plane sees the session."""
        try:
            session = self._session(_api_key(request), damaged=True)
            raw = await self._read_body(request)
            if session.damaged is not None:
                _refuse_too_deep(raw, anthropic)
                raise _cannot_record(session.damaged)
            return session, raw
        except _Refusal as refusal:
            return _failure(anthropic, refusal)
        except _Gone:
            return Response(status_code=400)  # not sent: the client is gone

    def plan(
        self,
        anthropic: bool,
        headers: Mapping[str, str],
        session: Session,
        raw: bytes,
        clock: CallClock,
        passthrough: bool = False,
        checked: _Checked = _UNCHECKED,
        fields: list[tuple[str, int, int]] | None = None,
        upstream: bool = True,
    ) -> _Plan:
        """A model call's body checked and its upstream call made ready (or _Refusal).
        `passthrough`: a streaming call asks the upstream for its stream (the Rust data
        plane passes it on), with the client's `stream_options`; otherwise the upstream is
        asked for the whole answer. `checked`, `fields`: what the Rust data plane checked
        and found of the body already. `upstream` False: a call the engine sent upstream
        itself (the direct lane), whose plan only makes its turn and reply: no upstream body
        and headers are made for it (they are empty)."""
        fields = _decode(raw, anthropic, checked, fields)
        if not checked.depth and isinstance(fields, dict):
            # before the other checks, as the Rust data plane's engine makes it: a body too
            # deep and wrong in another way is refused for the same reason by both planes
            _check_depth(fields, anthropic)
        if not checked.digits and isinstance(fields, dict):
            # next, as a body json.loads refuses is: before its shape is judged
            _check_digits(fields, self.max_digits)
        body = (_check_anthropic if anthropic else _check_chat)(fields)
        harness = _harness_session(headers, body, anthropic=anthropic)
        stream = body.get("stream") is True
        streamed = stream and passthrough
        upstream_headers = self._upstream_headers(headers, anthropic=anthropic) if upstream else {}
        if anthropic:

            def message_turn(response: dict[str, Any]) -> TurnNode:
                return messages_turn(body, response, harness)

            make_turn, replay = _recorder(message_turn, anthropic_events if stream else None)
            head, content = (
                self._upstream(raw, body, {"stream": streamed}, passthrough)
                if upstream
                else (0, b"")
            )
            return _Plan(
                session,
                anthropic,
                stream,
                "/v1/messages",
                content,
                upstream_headers,
                make_turn,
                _json_bytes,
                replay,
                clock,
                message_turn,
                messages=body["messages"],
                head=head,
            )
        inject_ids = self.config.capture_tokens and "return_token_ids" not in body
        inject_logprobs = self.config.capture_tokens and "logprobs" not in body
        extra: dict[str, Any] = {"stream": streamed}
        if inject_ids:
            extra["return_token_ids"] = True
        if inject_logprobs:
            extra["logprobs"] = True
        options = body.get("stream_options") or {}

        def reply(response: dict[str, Any], answer: bytes) -> Response:
            return _chat_reply(response, answer, inject_ids, inject_logprobs)

        def events(response: dict[str, Any]) -> Iterator[bytes]:
            _strip_injected(response, inject_ids, inject_logprobs)
            return chat_chunks(
                _plain_answer(response),
                include_usage=bool(options.get("include_usage")),
                token_ids=bool(body.get("return_token_ids")),
            )

        def turn(response: dict[str, Any]) -> TurnNode:
            return chat_turn(body, response, harness)

        make_turn, replay = _recorder(turn, events if stream else None)
        drop = () if streamed else ("stream_options",)
        head, content = (
            self._upstream(raw, body, extra, passthrough, drop) if upstream else (0, b"")
        )
        return _Plan(
            session,
            anthropic,
            stream,
            "/v1/chat/completions",
            content,
            upstream_headers,
            make_turn,
            reply,
            replay,
            clock,
            turn,
            (inject_ids, inject_logprobs),
            body["messages"],
            head,
        )

    @staticmethod
    def _upstream(
        raw: bytes,
        body: dict[str, Any],
        extra: dict[str, Any],
        passthrough: bool,
        drop: tuple[str, ...] = ("stream_options",),
    ) -> tuple[int, bytes]:
        """The body sent upstream as `(head, content)` (see `_Plan.head`): in parts for the
        Rust data plane (`passthrough`), which joins them outside the GIL; else whole."""
        if passthrough:
            return upstream_parts(raw, body, extra, drop)
        return 0, upstream_body(raw, body, extra, drop)

    async def _model_call(self, request: Request, anthropic: bool) -> Response:
        clock = CallClock()
        accepted = await self._accept(request, anthropic=anthropic)
        if isinstance(accepted, Response):
            return accepted
        session, raw = accepted
        try:
            plan = self.plan(anthropic, request.headers, session, raw, clock)
        except _Refusal as refusal:
            return _failure(anthropic, refusal)
        call = self._call(
            session, plan.path, plan.content, plan.headers, plan.make_turn, clock, plan.stream
        )
        # while the upstream answers: its body and the raw fields, no third copy
        del accepted, raw
        replay = plan.replay
        return await self._answer(
            call, anthropic, plan.stream, plan.reply, lambda _: iter(replay), session, clock
        )

    async def chat(self, request: Request) -> Response:
        return await self._model_call(request, anthropic=False)

    async def messages(self, request: Request) -> Response:
        return await self._model_call(request, anthropic=True)

    async def models(self, request: Request) -> Response:
        try:
            status, headers, answer = await self._get("GET", "/v1/models")
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            return JSONResponse(
                _error_body(False, 502, f"the upstream cannot be reached: {type(exc).__name__}"),
                502,
            )
        return Response(answer, status, media_type=headers.get("content-type", "application/json"))

    # -- sessions

    async def _json_object_body(self, request: Request) -> dict[str, Any] | Response:
        """The request's body as a JSON object (an empty body is `{}`), or the answer that
        refuses it."""
        try:
            raw = await self._read_body(request)  # the model calls' limit
        except _Refusal as refusal:
            return _refused(refusal.status, refusal.reason)
        except _Gone:
            return Response(status_code=400)  # not sent: the client is gone
        try:
            payload = json.loads(raw) if raw.strip() else {}
        except RecursionError:
            return JSONResponse({"error": "the body nests too deeply"}, 400)
        except ValueError:
            return JSONResponse({"error": "the body must be JSON (or empty)"}, 400)
        if not isinstance(payload, dict):
            return JSONResponse({"error": "the body must be a JSON object"}, 400)
        return payload

    async def create_session(self, request: Request) -> Response:
        payload = await self._json_object_body(request)
        if isinstance(payload, Response):
            return payload
        metadata = payload.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            return JSONResponse({"error": "metadata must be a JSON object"}, 400)
        group, labels = payload.get("group"), payload.get("labels")
        if labels is not None and not isinstance(labels, list):
            return JSONResponse({"error": "labels must be a JSON array of strings"}, 400)
        try:
            session = await anyio.to_thread.run_sync(
                lambda: self.sessions.create(
                    payload.get("session_id"), metadata=metadata, group=group, labels=labels
                )
            )
        except SessionError as exc:
            status = 409 if "already exists" in str(exc) else 400
            return JSONResponse({"error": str(exc)}, status)
        except OSError as exc:  # the data directory is full or failing: nothing was kept
            status, reason = _storage_failure("the session cannot be stored", exc)
            return JSONResponse({"error": reason}, status)
        base = str(request.base_url).rstrip("/")
        return JSONResponse(
            {
                "session_id": session.session_id,
                "api_key": session.api_key,
                "openai_base_url": f"{base}/v1",
                "anthropic_base_url": base,
            }
        )

    # -- who may touch a session

    def _is_admin(self, key: str | None) -> bool:
        admin = self._admin_key
        return (
            admin is not None
            and key is not None
            and hmac.compare_digest(admin, key.encode("utf-8", "surrogatepass"))
        )

    def _credential(self, request: Request, view: bool = False) -> str | None:
        """The key a session route was sent: `Authorization: Bearer` or `x-api-key`, or for
        a viewer's GET the key it was opened with (`?key=`, then its cookie)."""
        key = _api_key(request)
        if key is None and view and request.method in ("GET", "HEAD"):
            key = (
                request.query_params.get("key")
                or unquote(request.cookies.get(VIEW_COOKIE, ""))
                or unquote(request.cookies.get(ROOT_COOKIE, ""))
            )
        return key or None

    def _lookup(self, request: Request, *, view: bool = False) -> Session | Response:
        """The session a route names, if the request may touch it; else the refusal.

        Every route that reads, lists or changes a session calls this: it needs the
        session's own key or the server's admin key. Without either the answer is 401 (no
        key) or 403 (another key), whether the session exists or not; with the admin key an
        unknown session is 404."""
        session_id = request.path_params["session_id"]
        key = self._credential(request, view)
        if not self._is_admin(key):
            if key is None:
                return _refused(401, _NEEDS_KEY)
            session = self.sessions.by_key(key)
            if session is None or session.session_id != session_id:
                return _refused(
                    403,
                    f"this key does not open session {session_id!r}: send that session's "
                    "api_key, or the server's admin key",
                )
            return session
        session = self.sessions.get(session_id) if clean_session_id(session_id) else None
        if session is None:
            return JSONResponse({"error": f"no session {session_id!r}"}, 404)
        return session

    def _visible(self, request: Request, *, view: bool = False) -> list[Session] | Response:
        """The sessions a request may see, for routes over many sessions (the list, and any
        route that gathers sessions): every one for the admin key, a session's own for its
        key; else the refusal."""
        key = self._credential(request, view)
        if self._is_admin(key):
            return self.sessions.all()
        if key is None:
            return _refused(401, _NEEDS_KEY)
        own = self.sessions.by_key(key)
        if own is None:
            return _refused(403, "unknown key: send a session's api_key or the admin key")
        return [own]

    async def list_sessions(self, request: Request) -> Response:
        """Every session for the admin key; a session's own key lists that session only.

        `GET /` is what a browser opens: there the key may also come as `?key=` (moved into
        an HttpOnly cookie, and the page reloaded without it in its URL), and a browser gets
        the list as a page linking each session's viewer."""
        root = request.url.path == "/"
        if root and "key" in request.query_params and _api_key(request) is None:
            moved = RedirectResponse("/", status_code=303)
            moved.set_cookie(
                ROOT_COOKIE,
                quote(request.query_params["key"], safe=""),
                path="/",
                httponly=True,
                samesite="strict",
            )
            return moved
        visible = self._visible(request, view=root)
        if isinstance(visible, Response):
            return visible
        infos = [s.info() for s in visible]
        if root and "text/html" in request.headers.get("accept", ""):
            return HTMLResponse(_sessions_page(infos))
        return _written_anew({"sessions": infos})

    async def session_info(self, request: Request) -> Response:
        found = self._lookup(request)
        if not isinstance(found, Response):
            await self.settled_session(found)
        return found if isinstance(found, Response) else _written_anew(found.info())

    def _view_key_moved(self, request: Request, session: Session, path: str) -> Response | None:
        """A viewer opened with `?key=`: the key goes into a cookie for the viewer's own path
        (HttpOnly, SameSite=Strict) and the page is reloaded without it in its URL."""
        key = request.query_params.get("key")
        if key is None or _api_key(request) is not None:
            return None
        query = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "key"])
        moved = RedirectResponse(path + (f"?{query}" if query else ""), status_code=303)
        moved.set_cookie(
            VIEW_COOKIE,
            quote(key, safe=""),
            path=f"/sessions/{session.session_id}/view/",
            httponly=True,
            samesite="strict",
        )
        return moved

    async def view_root(self, request: Request) -> Response:
        """`/sessions/{id}/view` without its slash: the page's relative URLs need one."""
        found = self._lookup(request, view=True)
        if isinstance(found, Response):
            return found
        root = f"/sessions/{found.session_id}/view/"
        return self._view_key_moved(request, found, root) or RedirectResponse(root, 307)

    async def view(self, request: Request) -> Response:
        """The viewer of a live session, answered from its graph (`rollout-store view`'s page)."""
        found = self._lookup(request, view=True)
        if isinstance(found, Response):
            return found
        session = found
        if session.damaged is not None:
            return _damaged(session.damaged)
        path = "/" + request.path_params["path"]
        moved = self._view_key_moved(request, session, request.url.path)
        if moved is not None:
            return moved
        query = request.url.query

        metadata = session.metadata
        labels = metadata.get("labels") if isinstance(metadata, dict) else None

        def answer() -> tuple[int, tuple[tuple[str, str], ...], bytes]:
            with session.use() as graph:
                viewer = Viewer(graph, title=session.session_id, labels=labels)
                page = viewer.respond(path, query)
            return page.status, page.headers, page.body

        try:
            status, headers, body = await anyio.to_thread.run_sync(answer)
        except (SessionDamagedError, StoreError) as exc:
            return self._damage_answer(session, exc)
        return Response(body, status_code=status, headers=dict(headers))

    def _damage_answer(self, session: Session, exc: BaseException) -> Response:
        """The answer for a session whose log or objects cannot be read (500, with the
        object, the file and the repair), or whose store is down (503)."""
        if isinstance(exc, StoreUnavailableError):
            return JSONResponse({"error": f"the content store is unavailable: {exc}"}, 503)
        if isinstance(exc, SessionDamagedError):
            return _damaged(str(exc))
        return _damaged(self.sessions.damage_report(session.session_id, exc))

    async def _streamed(
        self,
        sessions: Session | Sequence[Session],
        produce: Callable[[IO[bytes]], None],
        media_type: str,
    ) -> Response:
        """A document written by `produce` in a thread from `sessions`, streamed; a session
        that is or turns out damaged before the first bytes, or a store that is down, gets
        its error as the answer."""
        members = [sessions] if isinstance(sessions, Session) else list(sessions)
        for member in members:
            if member.damaged is not None:
                return _damaged(member.damaged)
        session = members[0]
        chunks = _from_thread(produce)
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except (SessionDamagedError, StoreError) as exc:
            await chunks.aclose()
            return self._damage_answer(session, exc)

        async def whole() -> AsyncIterator[bytes]:
            try:
                yield first
                async for chunk in chunks:
                    yield chunk
            finally:
                await chunks.aclose()

        return StreamingResponse(whole(), media_type=media_type)

    async def export(self, request: Request) -> Response:
        found = self._lookup(request)
        if isinstance(found, Response):
            return found
        # (--ack fast) its turns answered before it are in it, or it says how many are not
        settled = await self.settled_session(found)
        session, session_id, metadata = found, found.session_id, found.metadata
        await self._timelines_recorded(session)
        flags = request.query_params
        messages = flags.get("messages", "0") not in ("0", "false", "")
        discarded = flags.get("discarded", "0") not in ("0", "false", "")
        if session.damaged is not None:
            return _damaged(session.damaged)
        try:
            level = flags.get("capture_level") or found.capture_level()
        except (SessionDamagedError, StoreError) as exc:
            return self._damage_answer(session, exc)
        if level not in CAPTURE_LEVELS:
            message = f"capture_level must be one of {', '.join(CAPTURE_LEVELS)}"
            return JSONResponse({"error": message}, 400)
        findings = _dropped_findings(session) + ([] if settled else _unsettled_findings(session))

        def produce(fp: IO[bytes]) -> None:
            with session.use() as graph:
                write_session_json(
                    graph,
                    fp,
                    session_id=session_id,
                    metadata=metadata,
                    include_messages=messages,
                    include_discarded=discarded,
                    capture_level=level,
                    findings=findings,
                )

        return await self._streamed(session, produce, "application/json")

    async def trace(self, request: Request) -> Response:
        found = self._lookup(request)
        if isinstance(found, Response):
            return found
        # (--ack fast) as the export: its turns answered before it, or it says how many not
        settled = await self.settled_session(found)
        session = found
        await self._timelines_recorded(session)
        findings = [] if settled else _unsettled_findings(session, "trace")

        def produce(fp: IO[bytes]) -> None:
            with session.use() as graph:
                write_trace_jsonl(graph, fp, findings)

        return await self._streamed(session, produce, "application/x-ndjson")

    async def patch_session(self, request: Request) -> Response:
        """Annotate and reward a session's graph, all changes or none: a JSON object with
        any of `labels` (added), `annotations` (object), `reward` (number or null),
        `rewards` (leaf node id -> number or null), `group`."""
        found = self._lookup(request)
        if isinstance(found, Response):
            return found
        session = found
        payload = await self._json_object_body(request)
        if isinstance(payload, Response):
            return payload
        unknown = sorted(set(payload) - {"labels", "annotations", "reward", "rewards", "group"})
        if unknown:
            return JSONResponse(
                {
                    "error": f"unknown field(s) {', '.join(unknown)}: send labels, "
                    "annotations, reward, rewards or group"
                },
                400,
            )
        labels = payload.get("labels", [])
        if not isinstance(labels, list):
            return JSONResponse({"error": "labels must be a JSON array of strings"}, 400)
        group = payload.get("group", UNCHANGED)
        if group not in (UNCHANGED, None) and clean_session_id(group) is None:
            return JSONResponse(
                {"error": "group must be a valid id (as a session id) or null"}, 400
            )
        changes = {
            "labels": labels,
            "annotations": payload.get("annotations"),
            "reward": payload.get("reward", UNCHANGED),
            "rewards": payload.get("rewards"),
            "group": group,
        }

        def apply() -> dict[str, Any]:
            with session.use() as graph:
                # the session file first: a log record that fails puts it back, so a
                # failed PATCH changes nothing
                before = session.group
                if group is not UNCHANGED:
                    session.group = group
                    try:
                        self.sessions.save_group(session)
                    except BaseException:
                        session.group = before
                        raise
                try:
                    graph.update_metadata(**changes)
                except BaseException:
                    if group is not UNCHANGED:
                        session.group = before
                        # best effort: on reopen the log's group wins over the file's
                        with contextlib.suppress(OSError, SessionDeletedError):
                            self.sessions.save_group(session)
                    raise
                return {"session_id": session.session_id, **graph.meta.document()}

        if session.damaged is not None:
            return _damaged(session.damaged)
        try:
            answer = await anyio.to_thread.run_sync(apply)
        except SessionDeletedError as exc:  # deleted meanwhile: its id's new session untouched
            return JSONResponse({"error": str(exc)}, 404)
        except (SessionDamagedError, StoreError) as exc:
            return self._damage_answer(session, exc)
        except OSError as exc:  # FileWriteError too: a full disk, a quota, an I/O error
            status, reason = _storage_failure("the change cannot be stored", exc)
            return JSONResponse({"error": reason}, status)
        except (RolloutStoreError, SessionError) as exc:
            return JSONResponse({"error": str(exc)}, 400)
        return _written_anew(answer)

    async def group_info(self, request: Request) -> Response:
        """The sessions of a group (each as `GET /sessions/{id}` lists it)."""
        members = self._group(request)
        if isinstance(members, Response):
            return members
        group = request.path_params["group_id"]
        return _written_anew({"group": group, "sessions": [s.info() for s in members]})

    def _group(self, request: Request) -> list[Session] | Response:
        """The sessions of the path's group that the request may see (`_visible`: all of
        them for the admin key, a session's own for its key); 404 when there are none."""
        visible = self._visible(request)
        if isinstance(visible, Response):
            return visible
        group = request.path_params["group_id"]
        members = [s for s in visible if s.group == group] if clean_session_id(group) else []
        if not members:
            return JSONResponse({"error": f"no session in group {group!r}"}, 404)
        return members

    async def session_samples(self, request: Request) -> Response:
        """A session's training rows (`rows`): `?format=path|tree` (default path),
        `?output=jsonl|parquet` (default jsonl), streamed."""
        found = self._lookup(request)
        if isinstance(found, Response):
            return found
        return await self._samples(request, [found])

    async def group_samples(self, request: Request) -> Response:
        """The training rows of a group's sessions: `?format=tree` packs them as one forest,
        `?format=path` (the default) gives every path of every session."""
        members = self._group(request)
        if isinstance(members, Response):
            return members
        return await self._samples(request, members, forest=True)

    async def _samples(
        self, request: Request, members: list[Session], forest: bool = False
    ) -> Response:
        kind = request.query_params.get("format", "path")
        output = request.query_params.get("output", "jsonl")
        if kind not in KINDS:
            return JSONResponse({"error": f"format must be one of {', '.join(KINDS)}"}, 400)
        if output not in FORMATS.values():
            message = f"output must be one of {', '.join(FORMATS.values())}"
            return JSONResponse({"error": message}, 400)

        def produce(fp: IO[bytes]) -> None:
            with contextlib.ExitStack() as stack:
                graphs = [stack.enter_context(session.use()) for session in members]
                for graph in graphs:  # one consistent view of each: add_turn waits
                    stack.enter_context(graph.lock)
                if kind == "tree":
                    rows = iter_tree_samples(graphs if forest else graphs[0])
                else:
                    rows = (row for graph in graphs for row in iter_token_samples(graph))
                write_rows(rows, fp, kind, format=output)

        media = "application/x-ndjson" if output == "jsonl" else "application/vnd.apache.parquet"
        return await self._streamed(members, produce, media)

    async def delete_session(self, request: Request) -> Response:
        found = self._lookup(request)
        if isinstance(found, Response):
            return found
        session_id = found.session_id
        deleted = await anyio.to_thread.run_sync(self.sessions.delete, session_id)
        if not deleted:
            return JSONResponse({"error": f"no session {session_id!r}"}, 404)
        return JSONResponse({"deleted": True, "session_id": session_id})

    async def health(self, request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "upstream": self.upstream,
                "sessions": len(self.sessions.ids()),
                "damaged": len(self.sessions.damaged()),
                "open": self.sessions.open_mode,
                "data": self.sessions.data is not None,
                "replica": self.config.replica,
                "ack": self.config.ack,
                "ack_queue": {
                    "size": self.config.ack_queue,
                    "pending": (
                        self.plane.pending()
                        if self.plane is not None
                        else 0
                        if self._pending is None
                        else self._pending.qsize() + self._aside_turns()
                    ),
                },
                "dropped": sum(self.dropped.values()),
                "dropped_by": dict(self.dropped),
                "ack_ledger_errors": (
                    0 if self.sessions.ledger is None else self.sessions.ledger.errors
                ),
            }
        )


async def _favicon(request: Request) -> Response:
    return Response(favicon(), media_type="image/svg+xml")


_NEEDS_KEY = (
    "this route needs a key: send `Authorization: Bearer KEY` (or `x-api-key: KEY`) with the "
    "session's api_key, or the admin key the server was started with (--admin-key or "
    f"{ADMIN_KEY_ENV})"
)


def _sessions_page(infos: list[dict[str, Any]]) -> str:
    """The sessions as a browser's page: each linked to its viewer, with its counts."""
    rows = "".join(
        '<tr><td><a href="/sessions/{0}/view/">{0}</a></td><td>{1}</td><td>{2}</td>'
        "<td>{3}</td></tr>".format(
            html.escape(str(info["session_id"])),
            html.escape(str(info.get("turns", info.get("damaged", "")))),
            html.escape(str(info.get("capture_level", ""))),
            html.escape(json.dumps(info.get("metadata") or {})),
        )
        for info in infos
    )
    return (
        '<!doctype html><meta charset="utf-8"><title>rollout_store sessions</title>'
        '<link rel="icon" href="/favicon.ico">'
        f"<h1>Sessions ({len(infos)})</h1>"
        "<table><tr><th>session</th><th>turns</th><th>capture level</th><th>metadata</th></tr>"
        f"{rows}</table>"
    )


def _refused(status: int, reason: str) -> Response:
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    if status == 408:  # the rest of the body is not read: the connection cannot be reused
        headers = {"connection": "close"}
    return JSONResponse({"error": reason}, status, headers=headers)


def _dropped_findings(session: Session) -> list[str]:
    """The export's finding for turns answered with `--ack fast` and never recorded."""
    if not session.dropped:
        return []
    return [
        f"[WARN] dropped_turns: {session.dropped} turn(s) of this session were answered "
        "(--ack fast) but not recorded (queue full, a recording error, the server "
        "stopping, or the server killed before recording them): the rollout misses them; "
        "see the server's /health"
    ]


def _unsettled_findings(session: Session, document: str = "export") -> list[str]:
    """The finding of an export (or a trace: `document`) for turns answered with `--ack
    fast` that its wait (`settled_session`) gave up on: neither recorded nor counted as
    dropped yet."""
    waiting = session.unsettled
    if not waiting:
        return []
    return [
        f"[WARN] unsettled_turns: {waiting} turn(s) of this session were answered "
        f"(--ack fast) but not yet recorded when this {document} was taken (the recorder is "
        "held up, or the session's graph is held by another export): the rollout may miss "
        f"them; {'export' if document == 'export' else 'read it'} again later"
    ]


def _damaged(reason: str) -> Response:
    return JSONResponse({"error": reason, "damaged": True}, 500)


def _not_recorded(session: Session, exc: OSError | RolloutStoreError) -> _Refusal:
    """The refusal of a call whose turn the graph did not take."""
    if isinstance(exc, InvalidValueError):
        session.rejected += 1
        if exc.path.split(".")[0].split("[")[0] in (
            "request_messages",
            "request_tools",
            "sampling_params",
        ):
            return _Refusal(400, f"the request cannot be recorded: {exc}")
        return _Refusal(502, f"the upstream's answer cannot be recorded: {exc}")
    if isinstance(exc, OSError):  # FileWriteError too: a full disk, a quota, an I/O error
        return _Refusal(*_storage_failure("the turn cannot be recorded", exc))
    return _cannot_record(str(exc))


def _cannot_record(reason: str) -> _Refusal:
    return _Refusal(409, f"the session cannot record: {reason}")


def _recorded(session: Session, view: Any) -> str:
    session.recorded += 1
    session.last_turn_at = time.time()
    return str(view.node_id)


def _unless_held(graph: Any, work: Callable[[], _T]) -> _T:
    """`work()` holding `graph`'s lock, or `_Held` if another thread holds it."""
    if not graph.lock.acquire(blocking=False):
        raise _Held
    try:
        return work()
    finally:
        graph.lock.release()


def _apply_timeline(graph: Any, clock: CallClock) -> None:
    """Set a recorded call's timeline, with the gap since its parent's reply."""
    node_id = clock.node_id
    gap = None
    replied = graph.parent_replied(node_id)
    if replied is not None:
        gap = clock.received - replied
        gap = gap if gap >= 0 else None
    graph.set_timeline(node_id, clock.timeline(clock.reply_sent, gap))


def _storage_failure(what: str, exc: OSError) -> tuple[int, str]:
    """The status and reason for a write the disk refused: 507 for a full disk or quota,
    503 for any other I/O error."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return 507, f"{what}: the disk is full ({reason}); nothing was kept: free space, retry"
    return 503, f"{what}: writing failed ({reason}); nothing was kept"


class _CaptureApp(Starlette):
    """The app: a model call goes straight to its handler, everything else through Starlette.

    A `POST` to a model route skips Starlette's middleware, router and request wrapper (the
    handler gets its `Request`, its `Response` answers by itself): the same handler and the
    same answer, at less CPU a call, which on a machine whose cores the client and the engine
    share is queueing every other call in flight waits through. An exception a handler
    raises is answered 500 as Starlette's own error middleware answers it, and raised on to
    the server, which logs it.
    """

    def __init__(
        self,
        calls: dict[str, Callable[[Request], Awaitable[Response]]],
        hosts: frozenset[str] | None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._calls = calls
        self._hosts = hosts

    def _refusal(self, scope: Scope) -> Response | None:
        """The answer to a request no route may see: a `Host` or an `Origin` the server does
        not answer (DNS rebinding, a page on another site), or a body that is not JSON."""
        host = origin = kind = None
        hosts = kinds = 0
        for name, value in scope["headers"]:
            if name == b"host":
                host = value.decode("latin-1")
                hosts += 1
            elif name == b"origin":
                origin = value.decode("latin-1")
            elif name == b"content-type":
                kind = value.decode("latin-1")
                kinds += 1
        if hosts > 1 or kinds > 1:  # (which one would a check read? none: refused)
            status, reason = (
                400,
                f"a request has one {'Host' if hosts > 1 else 'Content-Type'} header, "
                f"not {max(hosts, kinds)}",
            )
        elif not host_allowed(host, self._hosts):
            status, reason = (
                403,
                (
                    f"this server does not answer the Host {host!r}: only its own names (a request "
                    "through another name is refused against DNS rebinding); start it with "
                    "--allow-host NAME to accept one"
                ),
            )
        elif not origin_allowed(origin, self._hosts):
            status, reason = (
                403,
                (
                    f"requests from the web origin {origin!r} are refused (a page elsewhere); "
                    "start the server with --allow-host NAME to accept that host"
                ),
            )
        elif (
            kind is not None
            and scope["method"] in ("POST", "PUT", "PATCH")
            and kind.split(";", 1)[0].strip().lower() != "application/json"
        ):
            status, reason = (
                415,
                (f"the body must be sent as Content-Type: application/json, not {kind!r}"),
            )
        else:
            return None
        path = scope["path"]
        if path.startswith("/v1/"):
            anthropic = path == "/v1/messages"
            return JSONResponse(_error_body(anthropic, status, reason), status)
        return JSONResponse({"error": reason}, status)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        handler = self._calls.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None or scope["method"] != "POST":
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        try:
            response = await handler(Request(scope, receive))
        except Exception:
            await PlainTextResponse("Internal Server Error", 500)(scope, receive, send)
            raise
        await response(scope, receive, send)  # (every response starts before its body)


def create_app(
    upstream: str,
    *,
    data: str | os.PathLike[str] | None = None,
    fsync: str | int = "turn",
    store: ContentStore | None = None,
    cache: StringCache | None = None,
    open_mode: bool = False,
    max_body_bytes: int = MAX_BODY_BYTES,
    upstream_timeout: float = UPSTREAM_TIMEOUT,
    upstream_api_key: str | None = None,
    capture_tokens: bool = True,
    stream_keepalive: float = STREAM_KEEPALIVE,
    idle_seconds: float = IDLE_SECONDS,
    admin_key: str | None = None,
    hosts: Sequence[str] | None = None,
    body_timeout: float = BODY_TIMEOUT,
    ack: str = "durable",
    ack_queue: int = ACK_QUEUE,
    replica: str | None = None,
    direct_lane: bool = True,
) -> Starlette:
    """The capture server as an ASGI app (serve it with uvicorn).

    `upstream`: base URL of an OpenAI-compatible engine (`http://host:port`, a trailing `/v1`
    is dropped); `/v1/messages` goes to the same host. `data`: directory of session logs
    (None: in memory); existing sessions there are reopened now. `fsync`: "turn", N or
    "never". `store`: the content store all sessions share (default: a new `MemoryStore`);
    `cache`: the string cache they share over an out-of-process store. `open_mode`: serve
    unknown API keys (a key that is a valid session id becomes that session).
    `capture_tokens`: ask the upstream for vLLM's token ids and logprobs when the client did
    not say. `stream_keepalive`: seconds before a streaming client that is still waiting
    gets SSE comments (and then an error event rather than a status if the call fails).
    `idle_seconds`: with `data`, a session unused this long lets its graph go (its log keeps
    everything; the next use reopens it); without, its graph lets its caches go (the tips
    that spare its next turn hashing what it re-sends, a few hundred bytes to 2 KB); 0 keeps
    everything.
    `admin_key`: a key (at least 16 characters) that opens every session route of every
    session, `GET /sessions` included; without it each session is reached with its own key
    only. `hosts`: the `Host` names answered besides the loopback names (`["*"]`: any; see
    `hosts.allowed_hosts`). `body_timeout`: seconds a request's body may take to arrive.
    `ack`: "durable" (a call is answered once its turn is recorded, on disk per `fsync`; a
    turn that cannot be recorded fails the call) or "fast" (answered first, recorded right
    after through a queue of `ack_queue` turns; a dropped turn is counted in `/health`, the
    session's info and its export's validation; the queue drains when the app stops; with
    `data`, turns lost with a killed server are counted by the next start: `ack_ledger`).
    `replica`: this server's name behind a balancer: the keys it mints carry it, so the
    balancer routes each call to the replica holding its session (`replicas`).
    `direct_lane`: behind the Rust data plane, the model calls that would go upstream as they
    came are sent by the engine before any Python: with `ack="fast"` answered by it too, with
    no Python on the way; with `ack="durable"` prepared and recorded once the answer is in
    (`docs/server.md`). False prepares every call in Python before it goes upstream.
    With `data`, the directory is locked until the app stops (`DataDirectoryInUseError` if
    another server holds it).
    """
    if max_body_bytes < 1:
        raise InvalidArgumentError("max_body_bytes must be positive")
    if not upstream_timeout > 0:
        raise InvalidArgumentError("upstream_timeout must be positive")
    if not stream_keepalive > 0:
        raise InvalidArgumentError("stream_keepalive must be positive")
    if not idle_seconds >= 0:
        raise ValueError("idle_seconds must be 0 (never) or positive")
    if not body_timeout > 0:
        raise InvalidArgumentError("body_timeout must be positive")
    if ack not in ACK_MODES:
        raise InvalidArgumentError(f"ack must be one of {', '.join(ACK_MODES)}, not {ack!r}")
    if type(ack_queue) is not int or ack_queue < 1:
        raise InvalidArgumentError("ack_queue must be a positive number of turns")
    if admin_key is not None and (
        len(admin_key) < ADMIN_KEY_MIN or not admin_key.isprintable() or " " in admin_key
    ):
        raise InvalidArgumentError(
            f"admin_key must be at least {ADMIN_KEY_MIN} printable characters without spaces "
            '(make one with: python -c "import secrets; print(secrets.token_urlsafe(32))")'
        )
    config = CaptureConfig(
        upstream=upstream,
        upstream_api_key=upstream_api_key,
        max_body_bytes=max_body_bytes,
        upstream_timeout=upstream_timeout,
        capture_tokens=capture_tokens,
        stream_keepalive=stream_keepalive,
        body_timeout=body_timeout,
        allowed_hosts=allowed_hosts(None, hosts or ()),
        admin=admin_key is not None,
        ack=ack,
        ack_queue=ack_queue,
        replica=replica,
        direct_lane=direct_lane,
    )
    sessions = Sessions(
        data,
        fsync=fsync,
        open_mode=open_mode,
        store=store,
        cache=cache,
        **({} if replica is None else {"key_prefix": replica_key_prefix(replica)}),
    )
    server = _Server(config, sessions, admin_key)

    # over a log an idle session lets its graph go; in memory only its graph's caches
    release = sessions.release_idle if data is not None else sessions.drop_idle_caches

    async def sweep() -> None:
        while True:
            await asyncio.sleep(min(idle_seconds / 4, 30.0))
            await anyio.to_thread.run_sync(release, idle_seconds)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        server.loop = asyncio.get_running_loop()
        sweeper = asyncio.ensure_future(sweep()) if idle_seconds else None
        try:
            yield
        finally:
            if sweeper is not None:
                sweeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sweeper
            await server.aclose()

    app = _CaptureApp(
        {"/v1/chat/completions": server.chat, "/v1/messages": server.messages},
        config.allowed_hosts,
        routes=[
            # (POSTs to these two are answered by `_CaptureApp` before routing; the routes
            # answer the rest: 405 to other methods, as before)
            Route("/v1/chat/completions", server.chat, methods=["POST"]),
            Route("/v1/messages", server.messages, methods=["POST"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/sessions", server.create_session, methods=["POST"]),
            Route("/sessions", server.list_sessions, methods=["GET"]),
            Route("/sessions/{session_id}", server.session_info, methods=["GET"]),
            Route("/sessions/{session_id}", server.delete_session, methods=["DELETE"]),
            Route("/sessions/{session_id}", server.patch_session, methods=["PATCH"]),
            Route("/groups/{group_id}", server.group_info, methods=["GET"]),
            Route("/sessions/{session_id}/samples", server.session_samples, methods=["GET"]),
            Route("/groups/{group_id}/samples", server.group_samples, methods=["GET"]),
            Route("/sessions/{session_id}/export", server.export, methods=["GET"]),
            Route("/sessions/{session_id}/trace.jsonl", server.trace, methods=["GET"]),
            Route("/sessions/{session_id}/view", server.view_root, methods=["GET"]),
            Route("/sessions/{session_id}/view/{path:path}", server.view, methods=["GET"]),
            Route("/health", server.health, methods=["GET"]),
            Route("/", server.list_sessions, methods=["GET"]),  # what a browser opens first
            Route("/favicon.ico", _favicon, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.config = config
    app.state.sessions = sessions
    app.state.server = server
    return app


# ---------------------------------------------------------------------- the Rust data plane
# The Rust data plane of the capture server (`rollout-store serve --data-plane rust`).
#
# The engine's `DataPlane` listens on the public port and serves the model routes
# (`POST /v1/chat/completions`, `POST /v1/messages`) with hyper on a tokio runtime of its own:
# the `Host`, `Origin` and `Content-Type` gate, the session key against a key table, the
# body's size and time bounds and its depth, then the upstream call through a pooled client.
# Every other request is proxied to the app `create_app` made, listening on a private loopback
# socket: sessions, export, trace, viewer and health stay this package's Python, unchanged.
#
# `RustDataPlane` is the control plane's side: it keeps the engine's key table current (the
# sessions' keys as they are created, reopened and deleted), and answers the engine's
# callbacks with the Python server's own code, so both planes refuse, record and reply alike:
# `prepare` resolves the session and makes the upstream call ready (`_Server.plan`; what the
# engine's reading of the body checked already, its depth, its messages' shape and its UTF-8,
# is not checked again: `_Checked`),
# `finish` turns the upstream's answer into the reply and records the turn (`--ack durable`)
# or hands it back to be queued (`--ack fast`), `finish_stream` does the same for a stream the
# engine passed through (its turn made of its events; the engine holds its last event until
# then), `record` records a queued turn on the engine's recorder thread, `dropped` counts a
# queued turn that will not be, and `sent` records a call's timeline once its reply is out.
# Each callback runs on an engine thread holding the GIL. `close` stops the engine: no new
# call, the queued turns recorded (bounded), the rest counted as dropped.

#: The data planes `rollout-store serve --data-plane` offers.
DATA_PLANES = ("python", "rust")

_Reply = tuple[int, list[tuple[bytes, bytes]], list[bytes], bool]
#: How a streaming call's stream is answered: its headers, whether it is Anthropic's, and
#: whether its events lose their token ids and their logprobs.
_Streaming = tuple[list[tuple[bytes, bytes]], bool, bool, bool]
_SSE_HEADERS = StreamingResponse(
    iter(()), media_type="text/event-stream", headers=SSE_HEADERS
).raw_headers


def _reply(response: Response) -> _Reply:
    return response.status_code, response.raw_headers, [bytes(response.body)], False


class _Call:
    """One model call between the engine's callbacks: its plan, once answered its turn, and
    (a passed-through stream) when its turn is recorded or let go."""

    __slots__ = ("_ended", "after", "answer", "held", "node", "plan")

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan
        self.node: TurnNode | None = None
        #: A `--ack fast` answer replied to from its bytes (`_answer_later`), its turn not
        #: made yet: the recorder makes it (`_made_turn`).
        self.answer: bytes | None = None
        # only a stream's end is waited for: the other calls never make their Event
        self._ended = threading.Event() if plan.stream else None
        #: The session's streams, not ended, that this call continues (`waits`).
        self.after: Sequence[_Call] = ()
        #: Its session's graph, in use and locked by `waits` for `finish` to record in
        #: (which lets it go).
        self.held: contextlib.ExitStack | None = None

    @property
    def ended(self) -> threading.Event:
        """Set once a passed-through stream's turn is recorded or let go."""
        if self._ended is None:
            self._ended = threading.Event()
        return self._ended


def _header_map(headers: list[tuple[str, bytes]]) -> dict[str, str]:
    """The engine's headers of a call (lower-case names, as hyper gives them) as `plan` reads
    them: a name's first value, decoded as Latin-1 (what Starlette's `Headers` gives), in a
    dict, not a list each lookup walks."""
    found: dict[str, str] = {}
    for name, value in headers:
        if name not in found:
            found[name] = value.decode("latin-1")
    return found


def _continues(later: Any, earlier: Any) -> bool:
    """Whether the messages `later` go on from the messages `earlier` (as their raw text, or
    their values)."""
    if type(later) is RawJSON and type(earlier) is RawJSON:
        before, after = _text(earlier), _text(later)
        head = before[: _end_of_text(before, len(before)) - 1]  # without its closing bracket
        rest = after[len(head) :].lstrip(b" \t\r\n")
        return len(head) > 1 and after.startswith(head) and rest[:1] == b","
    if isinstance(later, list) and isinstance(earlier, list):
        return 0 < len(earlier) < len(later) and later[: len(earlier)] == earlier
    return False


#: What the engine's reading of a body found (see `RustDataPlane.prepare`): `(depth, shape,
#: utf8, digits, fields)`.
_EngineRead = tuple[bool, bool, bool, int | None, list[tuple[str, int, int]] | None]


def _engine_plan(
    server: _Server,
    anthropic: bool,
    headers: list[tuple[str, bytes]],
    session: Session,
    body: bytes,
    clock: CallClock,
    read: _EngineRead,
    upstream: bool = True,
) -> _Plan:
    """`server.plan` of a call the Rust data plane read (its headers as it gives them, and
    what its reading of the body found), or its `_Refusal`; `upstream` as there."""
    depth, shape, utf8, digits, fields = read
    limit = server.max_digits
    within = digits is not None and (not limit or digits <= limit)
    return server.plan(
        anthropic,
        _header_map(headers),
        session,
        body,
        clock,
        passthrough=True,
        checked=_Checked(depth, shape, utf8, within),
        fields=fields,
        upstream=upstream,
    )


def _direct_plan(
    server: _Server,
    anthropic: bool,
    session: Session,
    clock: CallClock,
    headers: list[tuple[str, bytes]],
    body: bytes,
    read: _EngineRead,
) -> _Plan:
    """The plan of a call the engine sent upstream itself (`RustDataPlane.adopt`): its
    session and clock now; what makes its turn (`server.plan` of its body, as `prepare` would
    have made it) only when the recorder asks, off the path of the replies."""
    made: list[_Plan] = []

    def plan() -> _Plan:
        if not made:
            # (the engine sent its upstream call: only what makes its turn and reply)
            made.append(_engine_plan(server, anthropic, headers, session, body, clock, read, False))
        return made[0]

    def make_turn(response: dict[str, Any]) -> TurnNode:
        return plan().make_turn(response)

    def turn_of(response: dict[str, Any]) -> TurnNode:
        return plan().turn_of(response)

    def reply(response: dict[str, Any], answer: bytes) -> Response:
        return plan().reply(response, answer)

    capture = server.config.capture_tokens and not anthropic
    return _Plan(
        session,
        anthropic,
        False,
        "/v1/messages" if anthropic else "/v1/chat/completions",
        b"",
        {},
        make_turn,
        reply,
        [],
        clock,
        turn_of,
        (capture, capture),
    )


class RustDataPlane:
    """The engine's data plane in front of the app `create_app` made (`app`), which serves
    on loopback port `backend_port`; the public listener binds `host`:`port` (0: a free
    one, then `port` says which)."""

    def __init__(
        self, app: Starlette, *, host: str, port: int, backend_port: int, workers: int = 2
    ) -> None:
        server: _Server = app.state.server
        config = server.config
        if not server.upstream.startswith(("http://", "https://")):
            raise InvalidArgumentError(
                f"the upstream must be an http:// or https:// URL, not {server.upstream!r}"
            )
        self._server = server
        self._sessions = server.sessions
        hosts = config.allowed_hosts
        self._engine = DataPlane(
            self,
            host=host,
            port=port,
            backend_port=backend_port,
            upstream=server.upstream,
            hosts=None if hosts is None else sorted(hosts),
            open_mode=self._sessions.open_mode,
            max_body_bytes=config.max_body_bytes,
            body_timeout=config.body_timeout,
            body_timeout_text=f"{config.body_timeout:g}",
            upstream_timeout=config.upstream_timeout,
            stream_keepalive=config.stream_keepalive,
            fast=config.ack == "fast",
            # the calls the engine sends upstream before any callback: with `--ack fast`
            # answered by it too, their ledger lines written by it (see `adopt`); with
            # `--ack durable` prepared and finished once their answer is in
            direct=(
                config.capture_tokens,
                server.max_digits,
                server.upstream_template(anthropic=False),
                server.upstream_template(anthropic=True),
                self._sessions.ledger_file() if config.ack == "fast" else None,
            )
            if config.direct_lane
            else None,
            ack_queue=config.ack_queue,
            workers=workers,
            # one thread when a turn is added without waiting (as the Python plane adds it
            # in its event loop), else enough that one waiting holds up few others
            callers=1 if server.inline else CALLERS,
        )
        self.port: int = self._engine.port
        #: Per session, its streams passed through whose turn is not recorded yet.
        self._streams: dict[str, list[_Call]] = {}
        self._streams_lock = threading.Lock()
        #: Calls whose turn (`--ack fast`) is in the ack ledger and not yet taken by the
        #: recorder: those a stopping engine never queued are counted at `close`, and so is
        #: a turn answered after that (`_closed`: a `finish` the stop did not wait for).
        self._answered: set[_Call] = set()
        self._answered_lock = threading.Lock()
        self._closed = False
        self._sessions.watch_keys(self._key_changed)
        server.plane = self

    def _key_changed(self, key: str, session: Session | None) -> None:
        data = key.encode("utf-8", "surrogatepass")
        if session is None:
            self._engine.remove_key(data)
        else:
            # (the session itself: a call of the direct lane holds it until it is answered,
            # as a prepared call holds it in its plan; none for a damaged one, whose calls
            # are refused before they go upstream)
            direct = session if session.damaged is None else None
            self._engine.set_key(data, session.session_id, direct)

    # -- for the control plane

    def pending(self) -> int:
        """Turns answered (`--ack fast`) and not yet recorded."""
        return int(self._engine.pending())

    def turns_sent(self) -> int:
        """The turns the engine sent to its recorder so far (0: the engine stopped)."""
        try:
            return int(self._engine.turns_sent())
        except RuntimeError:
            return 0

    def handed_through(self, sent: int) -> bool:
        """Whether the recorder handed the first `sent` turns to the control plane (the
        direct lane's calls among them adopted: `adopt`)."""
        return bool(self._engine.handed_through(sent))

    def settle(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) for the queued turns; whether all were taken."""
        return bool(self._engine.settle(timeout))

    def close(self) -> None:
        """Stop serving; the queued turns are recorded first (bounded), the rest counted, as
        are those of calls the stop cut between their answer and its queueing."""
        self._sessions.watch_keys(None)
        self._engine.stop(ACK_DRAIN_SECONDS)
        with self._answered_lock:
            self._closed = True
            cut = list(self._answered)
        for call in cut:
            self.dropped(call, "shutdown")

    def _answer_fast(self, call: _Call) -> bool:
        """Put a `--ack fast` call's turn in the ack ledger before its reply goes out, for
        the recorder; or, once the engine stopped (a `finish` still running then, which no
        reply follows), count it at once: whether it is to be queued."""
        session, clock = call.plan.session, call.plan.clock
        with self._answered_lock:
            self._server.sessions.answered(session, clock)
            if not self._closed:
                self._answered.add(call)
                return True
        self._server._drop(session, "shutdown", clock)
        call.node = call.answer = None
        return False

    def _answer_later(self, call: _Call, reply: bytes, answer: bytes) -> tuple[_Reply, bool, bool]:
        """The reply to a `--ack fast` call whose complete answer (`answer`, 2xx) is one JSON
        object (`reply`: made of its bytes by `answer_reply`): nothing else of it is needed
        before the reply goes out, so its decoding and its turn are left to the recorder
        (`_made_turn`), off the GIL's path of the replies. A turn that cannot be made of it
        is counted as dropped there, as fail-open `--ack fast` counts a turn it cannot
        record."""
        session, clock = call.plan.session, call.plan.clock
        clock.failed, session.failed = session.failed, 0
        call.answer = answer
        return self._timed(call, _json_reply(reply), self._answer_fast(call))

    @staticmethod
    def _made_turn(call: _Call) -> TurnNode | None:
        """The turn of a call `_answer_later` answered, made on the recorder thread; None
        when its answer makes none (it is counted as dropped)."""
        answer, call.answer = call.answer, None
        if answer is None:
            return None
        try:
            response = _decoded_answer(answer)
            return call.plan.make_turn(response) if isinstance(response, dict) else None
        except Exception:  # whatever it holds: its client has its reply, the turn is counted
            return None

    # -- the engine's callbacks

    def prepare(
        self,
        anthropic: bool,
        session_id: str | None,
        key: str | None,
        headers: list[tuple[str, bytes]],
        body: bytes,
        received_us: int,
        depth: bool = False,
        shape: bool = False,
        utf8: bool = False,
        fields: list[tuple[str, int, int]] | None = None,
        digits: int | None = None,
        *,
        held: Session | None = None,
    ) -> (
        tuple[_Call, str, tuple[int, bytes], list[tuple[str, str]], _Streaming | None]
        | tuple[None, _Reply]
    ):
        """A call that passed the engine's gate: its upstream call (the body as `(head,
        content)`: the client's `body[:head]`, then `content`), or the refusal. A
        streaming call's upstream is asked to stream: the engine passes its events on (with
        the capture fields the client did not ask for taken out) and hands them to
        `finish_stream` at the end, or, for any other answer, calls `finish`. `depth`,
        `shape`, `utf8`: what the engine's reading of the body found (see `_Checked`);
        `fields`: the body's top-level fields as it found them (see `split_body`);
        `digits`: the most digits of any int in a body it read whole (None: not known).
        `held`: a call of the direct lane prepared once its answer is in (`--ack durable`,
        or an answer the lane does not reply to): the session its key opened once its body
        was read (where this would have been asked), still its own if deleted since (its
        turn then records nowhere, as a prepared call's)."""
        clock = CallClock()
        clock.received = received_us
        server = self._server
        try:
            # (a held session found damaged since is refused when its turn is recorded, as a
            # prepared call's: after its upstream's answer, whatever that was, is known)
            session = server._session(key, session_id) if held is None else held
            read = (depth, shape, utf8, digits, fields)
            plan = _engine_plan(server, anthropic, headers, session, body, clock, read)
        except _Refusal as refusal:
            return None, _reply(_failure(anthropic, refusal))
        call = _Call(plan)
        stream = None
        if plan.stream:
            stream = (_SSE_HEADERS, anthropic, *plan.injected)
            with self._streams_lock:
                self._streams.setdefault(session.session_id, []).append(call)
                # (the direct lane leaves the session's calls to `waits` meanwhile)
                with contextlib.suppress(RuntimeError):  # (the engine stopped)
                    self._engine.stream_begun(session.session_id)
        upstream = (plan.head, plan.content)
        return call, plan.path, upstream, list(plan.headers.items()), stream

    def adopt(
        self,
        args: tuple[
            bool,
            str | None,
            str | None,
            list[tuple[str, bytes]],
            bytes,
            int,
            bool,
            bool,
            bool,
            list[tuple[str, int, int]] | None,
            int | None,
        ],
        session: Session,
        answer: bytes,
        stamps: tuple[int, int, int],
        line: str,
        entry: int = 0,
    ) -> _Call | None:
        """A call of the engine's direct lane, as the recorder hands it over: with `--ack
        fast`, a model call (Chat Completions or Anthropic's) that `prepare` would send
        upstream as the client's bytes with the server's fields appended, the engine sends
        and answers itself, with no callback on the way (`crates/gateway/src/direct.rs` says
        which calls): a complete answer that is one JSON object is replied to from its bytes
        (as `_answer_later` replies), its ledger line written first (`line`: `written`,
        `failed` or `retired`, see `Sessions.answered`; `entry`: the written line's number in
        the ledger's appender), its turn queued. Here it becomes
        what a prepared call is: its clock, its plan (made from its body when its turn is,
        `_direct_plan`), the turn told of as answered; the recorder then records it as any.
        `args` are `prepare`'s; `session` is the one the call's key opened once its body was read
        (deleted since, it is still the call's, as a prepared call's plan holds it). None:
        the call could not be made one, its turn counted as dropped (`record_error`)."""
        anthropic = args[0]
        headers, body, received_us, depth, shape, utf8, fields, digits = args[3:]
        server = self._server
        clock = CallClock()
        clock.received = received_us
        clock.upstream_sent, clock.first_byte, clock.last_byte = stamps
        # told of first (its ledger line counted): whatever follows, the turn is recorded
        # or counted as dropped
        server.sessions.answered(session, clock, line, entry)
        try:
            read = (depth, shape, utf8, digits, fields)
            call = _Call(_direct_plan(server, anthropic, session, clock, headers, body, read))
            clock.failed, session.failed = session.failed, 0
            call.answer = answer
            # an export waits for its timeline from its answer on (the reply went out then)
            answered_ago = max(0.0, time.time() - (received_us + clock.last_byte) / 1e6)
            server.timing(session, clock, time.monotonic() - answered_ago)
        except Exception:  # whatever it is: the client has its reply, the turn is counted
            server._drop(session, "record_error", clock)
            return None
        return call

    def waits(self, call: _Call) -> bool:
        """Whether the call's `finish` (or `finish_stream`) is to wait first, on a thread
        where the wait holds up no other call: for the turns of the session's streams that
        it continues, not recorded yet (a client may read a stream's answer and call again
        before the stream's end is recorded, when it left early or stopped reading at the
        last delta, and its next turn must find that one in the graph to link to it; with
        `--ack fast`, until the recorder has taken that turn, recorded or set aside, so that
        this call's turn is queued after it); or,
        to record its turn (`--ack durable`), for the session's graph, which another thread
        holds (an export being read). Otherwise the graph is taken now, for `finish` to
        record in: the engine calls it next, on this thread."""
        plan = call.plan
        if self._streams:
            with self._streams_lock:
                call.after = [
                    other
                    for other in self._streams.get(plan.session.session_id, ())
                    if other is not call
                    and not other.ended.is_set()
                    and _continues(plan.messages, other.plan.messages)
                ]
            if call.after:
                return True
        if self._server.config.ack == "fast":
            return False  # its `finish` only queues the turn
        held = contextlib.ExitStack()
        try:
            # in use first, as `record_now` takes it: an idle sweep, which locks the graph
            # inside the session's own lock, then leaves it be
            graph = held.enter_context(plan.session.use())
        except (OSError, RolloutStoreError):
            return False  # (`finish` answers why it cannot record)
        if not graph.lock.acquire(blocking=False):
            held.close()
            return True
        held.callback(graph.lock.release)
        call.held = held
        return False

    def _let_go(self, call: _Call) -> None:
        """Let go of the graph `waits` took for the call."""
        held, call.held = call.held, None
        if held is not None:
            held.close()

    def _after_streams(self, call: _Call) -> None:
        """Wait (at most `--upstream-timeout`) for the streams `waits` found."""
        deadline = time.monotonic() + self._server.config.upstream_timeout
        for other in call.after:
            other.ended.wait(max(0.0, deadline - time.monotonic()))

    def _stream_ended(self, call: _Call) -> None:
        """A stream's turn is recorded (or queued, or let go)."""
        session_id = call.plan.session.session_id
        with self._streams_lock:
            streams = self._streams.get(session_id)
            if streams is not None and call in streams:
                streams.remove(call)
                if not streams:
                    del self._streams[session_id]
                with contextlib.suppress(RuntimeError):  # (the engine stopped)
                    self._engine.stream_ended(session_id)
        call.ended.set()

    def finish(
        self,
        call: _Call,
        status: int,
        error: str | None,
        content_type: bytes | None,
        retry_after: bytes | None,
        answer: bytes,
        stamps: tuple[int, int, int],
        started: bool = False,
    ) -> tuple[_Reply, bool, bool]:
        """The reply to a call the upstream answered (or failed), whether its turn is to be
        queued, and whether its timeline is to be recorded once the reply is sent.
        `started`: the reply's stream began (keep-alive comments) while the upstream had
        not answered: it goes on with the answer's events, or an error event. With `--ack
        fast` a complete answer that is one JSON object is replied to from its bytes, its
        turn made by the recorder (`_answer_later`)."""
        try:
            self._after_streams(call)
            return self._finished(
                call, status, error, content_type, retry_after, answer, stamps, started
            )
        finally:
            self._let_go(call)
            if call.plan.stream and call not in self._answered:
                self._stream_ended(call)  # (a queued turn's stream ends when the recorder takes it)

    def _finished(
        self,
        call: _Call,
        status: int,
        error: str | None,
        content_type: bytes | None,
        retry_after: bytes | None,
        answer: bytes,
        stamps: tuple[int, int, int],
        started: bool,
    ) -> tuple[_Reply, bool, bool]:
        server, plan = self._server, call.plan
        session, clock = plan.session, plan.clock
        clock.upstream_sent, clock.first_byte, clock.last_byte = stamps
        fast = server.config.ack == "fast"
        if fast and error is None and not plan.stream and 200 <= status < 300:
            made = answer_reply(answer, *plan.injected)
            if made is not None:
                return self._answer_later(call, made, answer)
        queue = False
        try:
            if error == "timeout":
                raise _Refusal(
                    504, f"the upstream did not answer within {server.config.upstream_timeout:g} s"
                )
            if error is not None:
                raise _Refusal(502, f"the upstream cannot be reached: {error}")
            headers = {}
            if content_type is not None:
                headers["content-type"] = content_type.decode("latin-1")
            if retry_after is not None:
                headers["retry-after"] = retry_after.decode("latin-1")
            response, answer = server._upstream_answer(status, headers, answer)
        except _Passthrough as passed:
            session.upstream_errors += 1
            session.failed = failed_after(session.failed, passed.response.status_code)
            return self._timed(call, self._failed(plan, passed, started), False)
        except _Refusal as refused:
            if refused.status in (502, 504):  # the upstream unreachable or too slow
                session.failed = failed_after(session.failed, refused.status)
            return self._timed(call, self._failed(plan, refused, started), False)
        try:
            failed = session.failed
            call.node = plan.make_turn(response)
            if fast:
                queue = True
            else:
                clock.node_id = server.record_now(session, call.node)
            clock.failed, session.failed = failed, 0
        except _Refusal as refused:
            if fast and not plan.stream:  # fail-open, as for a turn `_answer_later` left
                call.node = None
                clock.failed, session.failed = failed, 0
                server.sessions.answered(session, clock)
                server._drop(session, "record_error", clock)
                return self._timed(call, _reply(plan.reply(response, answer)), False)
            return self._timed(call, self._failed(plan, refused, started), False)
        reply = (
            (200, _SSE_HEADERS, list(plan.replay), True)
            if plan.stream
            else _reply(plan.reply(response, answer))
        )
        if queue:  # in the ack ledger before the engine sends the reply (`_queue_turn`)
            queue = self._answer_fast(call)
        return self._timed(call, reply, queue)

    def finish_stream(
        self, call: _Call, events: bytes, error: str | None, stamps: tuple[int, int, int]
    ) -> tuple[_Reply, bool, bool, bool]:
        """The end of a stream the engine passed on: whether its turn is to be queued, its
        timeline recorded, and the events it held back (its last) released; or the error
        event that ends the stream instead.

        `error` says why the stream did not end with its last event (see the engine's
        `Streamed`). A stream that broke off records nothing (the client got an error event
        and will call again); one whose events cannot be read or whose turn cannot be
        recorded ends with an error event in place of its last event (`--ack durable`), or
        as it came, counted as dropped (`--ack fast`)."""
        try:
            if error != "abandoned":
                self._after_streams(call)
            return self._stream_finished(call, events, error, stamps)
        finally:
            self._let_go(call)
            if call not in self._answered:
                self._stream_ended(call)  # (a queued turn's stream ends when the recorder takes it)

    def _stream_finished(
        self, call: _Call, events: bytes, error: str | None, stamps: tuple[int, int, int]
    ) -> tuple[_Reply, bool, bool, bool]:
        server, plan = self._server, call.plan
        session, clock = plan.session, plan.clock
        clock.upstream_sent, clock.first_byte, clock.last_byte = stamps
        fast = server.config.ack == "fast"
        if error == "abandoned":  # the client left before the upstream answered
            return (200, _SSE_HEADERS, [], True), False, False, False
        if error is not None:
            timeout = server.config.upstream_timeout
            refused = (
                _Refusal(504, f"the upstream's stream stopped: nothing came for {timeout:g} s")
                if error == "timeout"
                else _Refusal(502, "the upstream's stream ended before its last event")
                if error == "unfinished"
                else _Refusal(502, f"the upstream's stream broke off: {error}")
            )
            session.failed = failed_after(session.failed, refused.status)
            if holds_error(events, plan.anthropic):
                session.upstream_errors += 1  # its own error event has reached the client
                return (*self._timed(call, (200, _SSE_HEADERS, [], True), False), False)
            return (*self._timed(call, self._failed(plan, refused, True), False), False)
        try:
            try:
                response = assembled(events, plan.anthropic)
            except InvalidValueError as exc:
                raise _Refusal(502, f"the upstream's stream cannot be read: {exc}") from None
            failed = session.failed
            call.node = plan.turn_of(response)
            if not fast:
                clock.node_id = server.record_now(session, call.node)
            clock.failed, session.failed = failed, 0
        except _Refusal as refused:
            call.node = None
            if fast:  # fail-open: the stream ends as it came, the turn counted as dropped
                server.sessions.answered(session, clock)
                server._drop(session, "record_error", clock)
                return (*self._timed(call, (200, _SSE_HEADERS, [], True), False), True)
            return (*self._timed(call, self._failed(plan, refused, True), False), False)
        queue = fast and self._answer_fast(call)  # (before the last event is released)
        return (*self._timed(call, (200, _SSE_HEADERS, [], True), queue), True)

    @staticmethod
    def _failed(plan: _Plan, failed: _Refusal | _Passthrough, started: bool) -> _Reply:
        """A failed call's answer: the route's error, or an error event of a begun stream
        (as `_Server._kept_alive` sends it)."""
        if not started:
            return _reply(_failure(plan.anthropic, failed))
        if isinstance(failed, _Refusal):
            status, reason = failed.status, failed.reason
        else:
            status = failed.response.status_code
            reason = (
                f"the upstream answered {status}: "
                + bytes(failed.response.body).decode("utf-8", "replace").replace("\n", " ")[:500]
            )
        error = _error_body(plan.anthropic, status, reason)
        event = sse_event("error", error) if plan.anthropic else sse_data(error)
        return 200, _SSE_HEADERS, [event], True

    def _timed(self, call: _Call, reply: _Reply, queue: bool) -> tuple[_Reply, bool, bool]:
        plan = call.plan
        timed = plan.clock.node_id is not None or plan.stream or queue
        if timed:
            self._server.timing(plan.session, plan.clock)
        return reply, queue, timed

    def record(self, calls: list[_Call]) -> list[int]:
        """Record turns answered with `--ack fast` (on the engine's recorder thread), those
        queued meanwhile together: each session's log synced once for its turns among them
        (`record_group_now`). A turn that cannot be recorded is counted; its client has its
        answer. A session whose graph another thread holds (an export being read) is not
        waited for: the indices of its calls are returned, their turns set aside for the
        engine to hand back later, before the later ones. The turn of a call answered from
        its bytes (`_answer_later`) is made here first; one its answer cannot make is
        counted."""
        server = self._server
        group: list[tuple[int, _Call, TurnNode]] = []
        for i, call in enumerate(calls):
            self._answered.discard(call)
            if call.answer is not None:  # answered from its bytes: its turn is made here
                call.node = self._made_turn(call)
            if call.node is None:  # (its answer makes no turn)
                server._drop(call.plan.session, "record_error", call.plan.clock)
            else:
                group.append((i, call, call.node))
        held: list[int] = []
        try:
            ids = server.record_group_now(
                [(call.plan.session, node, call.plan.clock) for _, call, node in group],
                held,
                timelines=True,  # (a sent reply's: while the graph is held for its turn)
            )
        except Exception:  # any failure: each turn of the group is counted
            ids, held = [None] * len(group), []
        aside = {group[j][0] for j in held}
        for (i, call, _), node_id in zip(group, ids, strict=True):
            if i in aside:
                continue
            if node_id is None:
                server._drop(call.plan.session, "record_error", call.plan.clock)
            else:
                call.plan.clock.node_id = node_id
                server.sessions.recorded(call.plan.session, call.plan.clock)
            call.node = None
        for call in calls:
            if call.plan.stream:
                # only now: a call continuing it is queued after it (`waits`); a turn set
                # aside too, which the recorder hands back before any later one (a held
                # graph held up the continuing call's answer, past the point of --ack fast)
                self._stream_ended(call)
        return sorted(aside)

    def dropped(self, call: _Call, why: str) -> None:
        """A queued turn that will not be recorded (`queue_full`, `shutdown`)."""
        self._answered.discard(call)
        session: Session = call.plan.session
        self._server._drop(session, why, call.plan.clock)
        call.node = call.answer = None
        if call.plan.stream:
            self._stream_ended(call)

    def sent(self, call: _Call, reply_sent: int, chunks: int, max_gap: int) -> bool:
        """A timed call's reply is out: record its timeline (once its turn is recorded).
        False when another thread holds the session's graph (an export being read): the
        engine calls again later rather than wait."""
        plan = call.plan
        clock = plan.clock
        clock.reply_sent = reply_sent
        clock.chunks, clock.max_gap = chunks, max_gap
        done = True
        try:
            done = self._server.record_timeline_now(plan.session, clock, wait=False)
        finally:
            if done:
                self._server.timed(plan.session, clock)
        return done


# ---------------------------------------------------------------------- rollout-store serve


def _fsync_arg(value: str) -> str | int:
    if value in ("turn", "never"):
        return value
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise argparse.ArgumentTypeError("expected 'turn', 'never' or a positive number of turns")


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket for uvicorn (`port` 0 picks a free one).

    Made with `IPPROTO_TCP` on purpose: asyncio turns Nagle's algorithm off only on accepted
    sockets of that protocol, and without it every keep-alive request waits ~40 ms for a
    delayed ACK.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections queue from now on, before uvicorn takes over
    return sock


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `rollout-store serve`."""
    parser.add_argument("--upstream", required=True, help="base URL of the engine (vLLM, SGLang)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    parser.add_argument("--data", default=None, help="directory of session logs (default: memory)")
    parser.add_argument("--fsync", type=_fsync_arg, default="turn", help="turn, never or N")
    parser.add_argument(
        "--store",
        type=store_spec,
        default="memory",
        help=f"content store all sessions share: {STORE_HELP}",
    )
    parser.add_argument(
        "--cache-mib",
        type=int,
        default=256,
        help="one cache for strings read back from an out-of-process store (MiB)",
    )
    parser.add_argument(
        "--open",
        action="store_true",
        help="serve unknown API keys (each makes an open session; keyed sessions stay keyed)",
    )
    parser.add_argument(
        "--admin-key",
        default=None,
        help=f"a key that opens every session route, GET /sessions included (default: "
        f"${ADMIN_KEY_ENV}; prefer the variable: arguments show in ps)",
    )
    parser.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests whose Host is NAME (repeatable; '*': any); the loopback "
        "names and --host are always answered",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=BODY_TIMEOUT,
        help="seconds a request's body may take to arrive (then 408)",
    )
    parser.add_argument(
        "--ack",
        choices=ACK_MODES,
        default="durable",
        help="durable: answer once the turn is recorded (on disk per --fsync); fast: answer "
        "first, record right after through a queue (dropped turns are counted; with --data, "
        "so are those lost to a kill, by the next start)",
    )
    parser.add_argument(
        "--ack-queue",
        type=int,
        default=ACK_QUEUE,
        metavar="N",
        help="--ack fast: turns answered but not yet recorded, at most (more are dropped, counted)",
    )
    parser.add_argument(
        "--replica",
        default=None,
        metavar="NAME",
        help="this server's name behind a balancer (letters, digits): the keys it mints carry "
        "it and the balancer routes on it (see docs/replicas.md)",
    )
    parser.add_argument(
        "--data-plane",
        choices=DATA_PLANES,
        default="python",
        help="who serves the model routes: this process's Python app, or the engine's Rust "
        "listener in front of it (the other routes stay in Python; see docs/server.md)",
    )
    parser.add_argument(
        "--no-direct-lane",
        dest="direct_lane",
        action="store_false",
        help="--data-plane rust: prepare every model call in Python before it goes upstream "
        "(the engine's direct lane off; see docs/server.md)",
    )
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    parser.add_argument("--upstream-timeout", type=float, default=UPSTREAM_TIMEOUT)
    parser.add_argument(
        "--stream-keepalive",
        type=float,
        default=STREAM_KEEPALIVE,
        help="seconds before a waiting streaming client gets keep-alive comments",
    )
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=IDLE_SECONDS,
        help="a session unused this long is closed until its next call (with --data), or "
        "lets its caches go (without); 0: never",
    )
    parser.add_argument(
        "--trim-idle",
        type=float,
        default=TRIM_IDLE_SECONDS,
        metavar="S",
        help="when no call has been in flight for S seconds, give the heap's free pages back "
        "to the system (glibc's malloc_trim; see docs/server.md); 0: never",
    )
    parser.add_argument(
        "--no-token-capture",
        dest="capture_tokens",
        action="store_false",
        help="do not ask the upstream for token ids and logprobs (hosted providers)",
    )


def serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted; prints its address first."""
    import uvicorn

    app = create_app(
        args.upstream,
        data=args.data,
        fsync=args.fsync,
        store=open_store(args.store),
        cache=StringCache(max_bytes=args.cache_mib << 20),
        open_mode=args.open,
        max_body_bytes=args.max_body_bytes,
        upstream_timeout=args.upstream_timeout,
        upstream_api_key=os.environ.get("ROLLOUT_STORE_UPSTREAM_KEY") or None,
        capture_tokens=args.capture_tokens,
        stream_keepalive=args.stream_keepalive,
        idle_seconds=args.idle_seconds,
        admin_key=args.admin_key or os.environ.get(ADMIN_KEY_ENV) or None,
        hosts=[*([] if args.host in WILDCARD_BINDS else [args.host]), *args.allow_host],
        body_timeout=args.body_timeout,
        ack=args.ack,
        ack_queue=args.ack_queue,
        replica=args.replica,
        direct_lane=args.direct_lane,
    )
    if not args.trim_idle >= 0:
        raise InvalidArgumentError("--trim-idle must be 0 (never) or a number of seconds")
    served = with_idle_trim(app, args.trim_idle)  # the process's own allocator: not the app's
    if getattr(args, "data_plane", "python") == "rust":
        # the app listens on a private loopback port; the engine on the public one
        sock = listen_socket("127.0.0.1", 0)
        try:
            plane = RustDataPlane(
                app, host=args.host, port=args.port, backend_port=sock.getsockname()[1]
            )
        except BaseException:
            sock.close()
            app.state.sessions.close()
            raise
        host, port = args.host, plane.port
    else:
        sock = listen_socket(args.host, args.port)
        host, port = sock.getsockname()[:2]
    # what was made at start (modules, the reopened sessions' graphs) lives as long as the
    # process: out of the collector's way, a full collection no longer walks all of it
    gc.collect()
    gc.freeze()
    sessions: Sessions = app.state.sessions
    print(
        f"rollout-store serve: http://{host}:{port} -> {args.upstream} "
        f"({len(sessions.ids())} sessions reopened)"
        if sessions.ids()
        else f"rollout-store serve: http://{host}:{port} -> {args.upstream}",
        flush=True,
    )
    config = uvicorn.Config(served, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`rollout-store serve ...` (also `python -m rollout_store.serve.server ...`)."""
    parser = argparse.ArgumentParser(
        prog="rollout-store serve", description=__doc__.splitlines()[0]
    )
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return serve(args)
    except (RolloutStoreError, OSError, ValueError, ImportError) as exc:
        print(f"rollout-store serve: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""The capture server: an OpenAI / Anthropic endpoint that records every call as a turn.

An agent points its SDK at this server (base URL) with a session's API key and changes nothing
else. Each `POST /v1/chat/completions` or `POST /v1/messages` is forwarded to the upstream
engine as one complete (non-streaming) call; the answer is recorded in the session's rollout
graph and then handed back, replayed as server-sent events when the client asked for
`stream: true`. Token ids and logprobs come from the engine's own fields (vLLM's
`return_token_ids` and `logprobs`, requested upstream unless the client set them itself and
removed from the reply when the client did not ask); without them turns link by messages.
Nothing is tokenized here.

Sessions follow the capture server this library replaces: `POST /sessions` mints a session
and its API key, the key the SDK sends (`Authorization: Bearer` or `x-api-key`) names the
session, unknown keys get 401 unless the server runs in open mode. `GET /sessions`,
`GET /sessions/{id}`, `GET /sessions/{id}/export` (`?messages=1`, `discarded=1`,
`capture_level=...`; the level defaults to "tokens" when every turn carries token ids, else
"text"), `GET /sessions/{id}/trace.jsonl` and `DELETE /sessions/{id}` manage them.

The conversation is never decoded here: the body is split with msgspec into its top-level
fields, the messages (and tools, and Anthropic's system) reach the graph as `RawJSON` spans
of the body, and the upstream gets the body's own bytes with the capture keys added. A body
msgspec cannot read exactly as json.loads would is decoded by json.loads instead, so every
body is accepted, refused and recorded as json.loads reads it.

A turn is acknowledged (the client gets its answer) only after the graph accepted it, and,
with a data directory and `fsync="turn"`, after it is on disk. Bad requests get a 4xx with a
one-line reason and record nothing; upstream errors pass through with their status and are
recorded nowhere; an upstream that does not answer in time gets 504.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

import aiohttp
import anyio.to_thread
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .content import ContentStore, StringCache
from .errors import InvalidArgumentError, InvalidValueError, RolloutStoreError
from .export import write_session_json, write_trace_jsonl
from .idle_trim import with_idle_trim
from .metadata import UNCHANGED
from .nodes import TurnNode
from .raw import RawJSON
from .row_files import FORMATS, KINDS, write_rows
from .rows import iter_token_samples, iter_tree_samples
from .sessions import Session, SessionError, Sessions, clean_session_id
from .sse import SSE_HEADERS, anthropic_events, chat_chunks, sse_data, sse_event
from .stores import STORE_HELP, MemoryStore, open_store, store_spec
from .viewer import Viewer

__all__ = [
    "CHAT_RAW_FIELDS",
    "MESSAGES_RAW_FIELDS",
    "CaptureConfig",
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


class _Refusal(Exception):
    """An answer other than the upstream's: status and a one-line reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


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


# ---------------------------------------------------------------------- requests to turns
# A request body arrives as bytes. `split_body` splits it with msgspec into its top-level
# fields without decoding the large ones (the conversation, the tools, Anthropic's system):
# those reach the graph as `RawJSON` spans of the body, which confirms a re-sent prefix by
# its bytes, and the upstream gets the body's own bytes. A body msgspec cannot split exactly
# as json.loads would read it is decoded by json.loads, as before.


def _token_list(value: Any) -> Any:
    # an engine without ids sends nothing or an empty list: link by messages then
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


def split_body(
    raw: bytes, raw_fields: frozenset[str] = MESSAGES_RAW_FIELDS
) -> dict[str, Any] | None:
    """The top-level fields of a request body, or None when only json.loads can read it.

    Every field is decoded (exactly as json.loads would) except those named in `raw_fields`
    that hold an array (or, for `system`, a string): they stay `RawJSON` spans of `raw`. A
    raw `messages` is already checked to be a non-empty array of objects with a string role.
    None: the body is not a JSON object msgspec reads as json.loads would (not JSON at all,
    NaN, lone-surrogate escapes, a byte order mark, nesting too deep, a message whose role
    is not a plain string...): decode it with json.loads, which accepts it or says why not.
    """
    try:
        spans = _split_fields(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeError):
        return None
    if not raw.isascii():
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
            if key == "messages":
                try:
                    if not _split_roles(data):
                        fields[key] = []  # refused by the shape check
                        continue
                except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                    return None
            fields[key] = RawJSON(data)
        else:
            fields[key] = RawJSON(data).decode()
    return fields


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


def _decode(raw: bytes, raw_fields: frozenset[str]) -> Any:
    """The body's fields (`split_body`), or json.loads of it, or the refusal json.loads gives."""
    fields = split_body(raw, raw_fields)
    if fields is not None:
        return fields
    try:
        return json.loads(raw)
    except RecursionError:
        raise _Refusal(400, "the body nests too deeply to record") from None
    except ValueError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise _Refusal(400, f"the body is not JSON: {reason}") from None


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


async def _from_thread(produce: Callable[[IO[bytes]], None]) -> AsyncIterator[bytes]:
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
        404: "not_found_error",
        413: "request_too_large",
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
    return JSONResponse(_error_body(anthropic, failed.status, failed.reason), failed.status)


def _api_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("x-api-key") or None


def _harness_session(request: Request, body: dict[str, Any], anthropic: bool) -> str | None:
    for name in _HARNESS_HEADERS:
        found = clean_session_id(request.headers.get(name))
        if found is not None:
            return found
    if anthropic:
        meta = body.get("metadata")
        return clean_session_id(meta.get("user_id")) if isinstance(meta, dict) else None
    return clean_session_id(body.get("user"))


def _strip_injected(response: dict[str, Any], token_ids: bool, logprobs: bool) -> None:
    """Remove from a Chat Completions answer what the server asked for and the client did not."""
    if token_ids:
        response.pop("prompt_token_ids", None)
    for choice in response.get("choices") or ():
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


def upstream_body(raw: bytes, body: dict[str, Any], extra: dict[str, Any]) -> bytes:
    """The body sent upstream: the client's with `extra` set and `stream_options` dropped.

    When the client's body is UTF-8 and has none of those keys, `extra` is appended to its
    own bytes (no key repeats, nothing re-encoded); otherwise (json.loads also reads UTF-16
    and UTF-32) the body is written anew from its fields in their order, a `RawJSON` field
    (see `split_body`) as its own text: re-encoding a large conversation costs more than
    decoding it. Either way the body is made in one `join`:
    each `+` of a large body would be a copy of its own, and each new buffer over glibc's
    mmap threshold costs a page fault per 4 KiB (measured here: three `+` of a 200 KiB
    body, 140-330 us; one `join`, 2 us).
    """
    if (
        "stream_options" not in body
        and not any(key in body for key in extra)
        and json.detect_encoding(raw) in ("utf-8", "utf-8-sig")
    ):
        end = _end_of_text(raw, len(raw))
        if raw[end - 1 : end] == b"}":
            head = _end_of_text(raw, end - 1)
            items = json.dumps(extra)[1:-1].encode("ascii")
            comma = b", " if raw[head - 1 : head] != b"{" else b""
            return b"".join((memoryview(raw)[:head], comma, items, b"}"))
    merged = {k: v for k, v in body.items() if k != "stream_options"}
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
    return b"".join(parts)


def _json_bytes(response: dict[str, Any], answer: bytes) -> Response:
    """The upstream's own JSON answer, byte for byte (nothing decoded and encoded again),
    when it is UTF-8; else `response`, its decoded value, written anew (json.loads reads
    UTF-16 and UTF-32, which an answer that names no charset cannot be)."""
    if json.detect_encoding(answer) in ("utf-8", "utf-8-sig"):
        return Response(answer, media_type="application/json")
    return _written_anew(response)


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


async def _events(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


class _Server:
    """State and handlers of one app: configuration, sessions and the upstream client."""

    def __init__(self, config: CaptureConfig, sessions: Sessions) -> None:
        self.config = config
        self.sessions = sessions
        upstream = config.upstream.rstrip("/")
        if upstream.endswith("/v1"):
            upstream = upstream[: -len("/v1")]
        self.upstream = upstream
        self._client: aiohttp.ClientSession | None = None
        #: Turns are added in the event loop when adding one waits for nothing (a memory
        #: store and no log to sync): a worker thread's wait for the GIL would cost more
        #: than the turn (measured in the benchmark's GRPO group: 2.7-3.0 ms of server CPU a
        #: call with the turn in a thread, 2.0-2.5 inline, side by side). With a log synced
        #: per turn or a store over the network, a thread.
        self.inline = isinstance(sessions.store, MemoryStore) and (
            sessions.data is None or sessions.fsync == "never"
        )

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

    async def _get(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any, bytes]:
        """One call to the upstream: status, headers and the whole body."""
        async with self.client.request(method, self.upstream + path, **kwargs) as answer:
            return answer.status, answer.headers, await answer.read()

    async def aclose(self) -> None:
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
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _Refusal(413, f"the body is over the limit of {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def _forward(
        self, path: str, content: bytes, headers: dict[str, str]
    ) -> tuple[dict[str, Any], bytes]:
        """The upstream's answer to one call, decoded and as its bytes (or _Refusal or
        _Passthrough)."""
        try:
            status, answer_headers, answer = await self._get(
                "POST", path, data=content, headers=headers
            )
        except TimeoutError:
            raise _Refusal(
                504, f"the upstream did not answer within {self.config.upstream_timeout:g} s"
            ) from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise _Refusal(502, f"the upstream cannot be reached: {type(exc).__name__}") from None
        if not 200 <= status < 300:
            keep = {
                k: v
                for k, v in answer_headers.items()
                if k.lower() in ("content-type", "retry-after")
            }
            raise _Passthrough(Response(answer, status, headers=keep))
        try:
            payload = RawJSON(answer).decode()  # msgspec's speed, json.loads's values
        except (ValueError, RecursionError):
            raise _Refusal(502, "the upstream answered with a body that is not JSON") from None
        if not isinstance(payload, dict):
            raise _Refusal(502, "the upstream answered with JSON that is not an object")
        return payload, answer

    def _upstream_headers(self, request: Request, anthropic: bool) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        key = self.config.upstream_api_key
        if anthropic:
            for name in _ANTHROPIC_HEADERS:
                if name in request.headers:
                    headers[name] = request.headers[name]
            if key:
                headers["x-api-key"] = key
        elif key:
            headers["authorization"] = f"Bearer {key}"
        return headers

    def _session(self, request: Request) -> Session:
        session = self.sessions.resolve(_api_key(request))
        if session is None:
            raise _Refusal(
                401, "unknown API key: create a session with POST /sessions and use its api_key"
            )
        return session

    async def _record(self, session: Session, node: TurnNode) -> None:
        try:
            with session.use() as graph:
                # in the loop only if no other thread holds the graph: an export that holds
                # it may be waiting for this loop to take what it wrote
                if self.inline and graph.lock.acquire(blocking=False):
                    try:
                        graph.add_turn(node)
                    finally:
                        graph.lock.release()
                else:
                    await anyio.to_thread.run_sync(graph.add_turn, node)
        except InvalidValueError as exc:
            session.rejected += 1
            if exc.path.split(".")[0].split("[")[0] in (
                "request_messages",
                "request_tools",
                "sampling_params",
            ):
                raise _Refusal(400, f"the request cannot be recorded: {exc}") from None
            raise _Refusal(502, f"the upstream's answer cannot be recorded: {exc}") from None
        except RolloutStoreError as exc:
            raise _Refusal(409, f"the session cannot record: {exc}") from None
        session.recorded += 1
        session.last_turn_at = time.time()

    async def _call(
        self,
        session: Session,
        path: str,
        content: bytes,
        headers: dict[str, str],
        make_turn: Callable[[dict[str, Any]], TurnNode],
    ) -> tuple[dict[str, Any], bytes]:
        """Forward one call, record its turn; the complete response, decoded and as the
        upstream's bytes (or _Refusal/_Passthrough)."""
        try:
            response, answer = await self._forward(path, content, headers)
        except _Passthrough:
            session.upstream_errors += 1
            raise
        await self._record(session, make_turn(response))
        return response, answer

    async def _answer(
        self,
        call: Any,
        anthropic: bool,
        stream: bool,
        reply: Callable[[dict[str, Any], bytes], Response],
        events: Callable[[dict[str, Any]], Iterator[bytes]],
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
                _events(events(response)), media_type="text/event-stream", headers=SSE_HEADERS
            )
        return StreamingResponse(
            self._kept_alive(task, anthropic, events),
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
        self, request: Request, check: Callable[[Any], dict[str, Any]], *, anthropic: bool
    ) -> tuple[Session, bytes, dict[str, Any]] | Response:
        """The session, raw body and checked body of a model call, or the refusal to answer
        (in the error shape of the route's API) when any of them is wrong."""
        try:
            session = self._session(request)
            raw = await self._read_body(request)
            raw_fields = MESSAGES_RAW_FIELDS if anthropic else CHAT_RAW_FIELDS
            return session, raw, check(_decode(raw, raw_fields))
        except _Refusal as refusal:
            return _failure(anthropic, refusal)

    async def chat(self, request: Request) -> Response:
        accepted = await self._accept(request, _check_chat, anthropic=False)
        if isinstance(accepted, Response):
            return accepted
        session, raw, body = accepted
        inject_ids = self.config.capture_tokens and "return_token_ids" not in body
        inject_logprobs = self.config.capture_tokens and "logprobs" not in body
        extra: dict[str, Any] = {"stream": False}
        if inject_ids:
            extra["return_token_ids"] = True
        if inject_logprobs:
            extra["logprobs"] = True
        harness = _harness_session(request, body, anthropic=False)
        stream = body.get("stream") is True
        options = body.get("stream_options") or {}

        def reply(response: dict[str, Any], answer: bytes) -> Response:
            if not (inject_ids or inject_logprobs):  # nothing to take out: the engine's bytes
                return _json_bytes(response, answer)
            _strip_injected(response, inject_ids, inject_logprobs)
            return _written_anew(response)

        def events(response: dict[str, Any]) -> Iterator[bytes]:
            _strip_injected(response, inject_ids, inject_logprobs)
            return chat_chunks(
                response,
                include_usage=bool(options.get("include_usage")),
                token_ids=bool(body.get("return_token_ids")),
            )

        make_turn, replay = _recorder(
            lambda response: chat_turn(body, response, harness), events if stream else None
        )
        call = self._call(
            session,
            "/v1/chat/completions",
            upstream_body(raw, body, extra),
            self._upstream_headers(request, anthropic=False),
            make_turn,
        )
        del accepted, raw  # while the upstream answers: its body and the raw fields, no third copy
        return await self._answer(call, False, stream, reply, lambda _: iter(replay))

    async def messages(self, request: Request) -> Response:
        accepted = await self._accept(request, _check_anthropic, anthropic=True)
        if isinstance(accepted, Response):
            return accepted
        session, raw, body = accepted
        harness = _harness_session(request, body, anthropic=True)
        stream = body.get("stream") is True
        make_turn, replay = _recorder(
            lambda response: messages_turn(body, response, harness),
            anthropic_events if stream else None,
        )
        call = self._call(
            session,
            "/v1/messages",
            upstream_body(raw, body, {"stream": False}),
            self._upstream_headers(request, anthropic=True),
            make_turn,
        )
        del accepted, raw  # (as in `chat`)
        return await self._answer(call, True, stream, _json_bytes, lambda _: iter(replay))

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

    async def create_session(self, request: Request) -> Response:
        try:
            raw = await self._read_body(request)  # the model calls' limit
        except _Refusal as refusal:
            return JSONResponse({"error": refusal.reason}, refusal.status)
        try:
            payload = json.loads(raw) if raw.strip() else {}
        except RecursionError:
            return JSONResponse({"error": "the body nests too deeply"}, 400)
        except ValueError:
            return JSONResponse({"error": "the body must be JSON (or empty)"}, 400)
        if not isinstance(payload, dict):
            return JSONResponse({"error": "the body must be a JSON object"}, 400)
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
        base = str(request.base_url).rstrip("/")
        return JSONResponse(
            {
                "session_id": session.session_id,
                "api_key": session.api_key,
                "openai_base_url": f"{base}/v1",
                "anthropic_base_url": base,
            }
        )

    def _lookup(self, request: Request) -> Session | Response:
        session_id = request.path_params["session_id"]
        session = self.sessions.get(session_id) if clean_session_id(session_id) else None
        if session is None:
            return JSONResponse({"error": f"no session {session_id!r}"}, 404)
        return session

    async def list_sessions(self, request: Request) -> Response:
        return _written_anew({"sessions": [s.info() for s in self.sessions.all()]})

    async def session_info(self, request: Request) -> Response:
        found = self._lookup(request)
        return found if isinstance(found, Response) else _written_anew(found.info())

    async def view_root(self, request: Request) -> Response:
        """`/sessions/{id}/view` without its slash: the page's relative URLs need one."""
        found = self._lookup(request)
        if isinstance(found, Response):
            return found
        return RedirectResponse(f"/sessions/{found.session_id}/view/", status_code=307)

    async def view(self, request: Request) -> Response:
        """The viewer of a live session, answered from its graph (`rollout-store view`'s page)."""
        found = self._lookup(request)
        if isinstance(found, Response):
            return found
        session = found
        path = "/" + request.path_params["path"]
        query = request.url.query

        def answer() -> tuple[int, tuple[tuple[str, str], ...], bytes]:
            with session.use() as graph:
                page = Viewer(graph, title=session.session_id).respond(path, query)
            return page.status, page.headers, page.body

        status, headers, body = await anyio.to_thread.run_sync(answer)
        return Response(body, status_code=status, headers=dict(headers))

    async def export(self, request: Request) -> Response:
        found = self._lookup(request)
        if isinstance(found, Response):
            return found
        session, session_id, metadata = found, found.session_id, found.metadata
        flags = request.query_params
        messages = flags.get("messages", "0") not in ("0", "false", "")
        discarded = flags.get("discarded", "0") not in ("0", "false", "")
        level = flags.get("capture_level") or found.capture_level()
        if level not in ("tokens", "logprobs", "text"):
            return JSONResponse({"error": "capture_level must be tokens, logprobs or text"}, 400)

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
                )

        return StreamingResponse(_from_thread(produce), media_type="application/json")

    async def trace(self, request: Request) -> Response:
        found = self._lookup(request)
        if isinstance(found, Response):
            return found
        session = found

        def produce(fp: IO[bytes]) -> None:
            with session.use() as graph:
                write_trace_jsonl(graph, fp)

        return StreamingResponse(_from_thread(produce), media_type="application/x-ndjson")

    async def patch_session(self, request: Request) -> Response:
        """Annotate and reward a session's graph, all changes or none: a JSON object with
        any of `labels` (added), `annotations` (object), `reward` (number or null),
        `rewards` (leaf node id -> number or null), `group`."""
        found = self._lookup(request)
        if isinstance(found, Response):
            return found
        session = found
        try:
            raw = await self._read_body(request)
        except _Refusal as refusal:
            return JSONResponse({"error": refusal.reason}, refusal.status)
        try:
            payload = json.loads(raw) if raw.strip() else {}
        except RecursionError:
            return JSONResponse({"error": "the body nests too deeply"}, 400)
        except ValueError:
            return JSONResponse({"error": "the body must be JSON"}, 400)
        if not isinstance(payload, dict):
            return JSONResponse({"error": "the body must be a JSON object"}, 400)
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
                graph.update_metadata(**changes)
                if group is not UNCHANGED:
                    session.group = group
                    self.sessions.save_group(session)
                return {"session_id": session.session_id, **graph.meta.document()}

        try:
            answer = await anyio.to_thread.run_sync(apply)
        except (RolloutStoreError, SessionError) as exc:
            return JSONResponse({"error": str(exc)}, 400)
        return _written_anew(answer)

    async def group_info(self, request: Request) -> Response:
        """The sessions of a group (each as `GET /sessions/{id}` lists it)."""
        group = request.path_params["group_id"]
        members = self.sessions.in_group(group) if clean_session_id(group) else []
        if not members:
            return JSONResponse({"error": f"no session in group {group!r}"}, 404)
        return _written_anew({"group": group, "sessions": [s.info() for s in members]})

    async def session_samples(self, request: Request) -> Response:
        """A session's training rows (`rows`): `?format=path|tree` (default path),
        `?output=jsonl|parquet` (default jsonl), streamed."""
        found = self._lookup(request)
        if isinstance(found, Response):
            return found
        return self._samples(request, [found])

    async def group_samples(self, request: Request) -> Response:
        """The training rows of a group's sessions: `?format=tree` packs them as one forest,
        `?format=path` (the default) gives every path of every session."""
        group = request.path_params["group_id"]
        members = self.sessions.in_group(group) if clean_session_id(group) else []
        if not members:
            return JSONResponse({"error": f"no session in group {group!r}"}, 404)
        return self._samples(request, members, forest=True)

    def _samples(self, request: Request, members: list[Session], forest: bool = False) -> Response:
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
                if kind == "tree":
                    rows = iter_tree_samples(graphs if forest else graphs[0])
                else:
                    rows = (row for graph in graphs for row in iter_token_samples(graph))
                write_rows(rows, fp, kind, format=output)

        media = "application/x-ndjson" if output == "jsonl" else "application/vnd.apache.parquet"
        return StreamingResponse(_from_thread(produce), media_type=media)

    async def delete_session(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        if clean_session_id(session_id) is None:
            return JSONResponse({"error": f"no session {session_id!r}"}, 404)
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
                "open": self.sessions.open_mode,
                "data": self.sessions.data is not None,
            }
        )


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
        self, calls: dict[str, Callable[[Request], Awaitable[Response]]], **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self._calls = calls

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
    that spare its next turn hashing what it re-sends, about 2 KB); 0 keeps everything.
    """
    if max_body_bytes < 1:
        raise InvalidArgumentError("max_body_bytes must be positive")
    if not upstream_timeout > 0:
        raise InvalidArgumentError("upstream_timeout must be positive")
    if not stream_keepalive > 0:
        raise InvalidArgumentError("stream_keepalive must be positive")
    if not idle_seconds >= 0:
        raise ValueError("idle_seconds must be 0 (never) or positive")
    config = CaptureConfig(
        upstream=upstream,
        upstream_api_key=upstream_api_key,
        max_body_bytes=max_body_bytes,
        upstream_timeout=upstream_timeout,
        capture_tokens=capture_tokens,
        stream_keepalive=stream_keepalive,
    )
    sessions = Sessions(data, fsync=fsync, open_mode=open_mode, store=store, cache=cache)
    server = _Server(config, sessions)

    # over a log an idle session lets its graph go; in memory only its graph's caches
    release = sessions.release_idle if data is not None else sessions.drop_idle_caches

    async def sweep() -> None:
        while True:
            await asyncio.sleep(min(idle_seconds / 4, 30.0))
            await anyio.to_thread.run_sync(release, idle_seconds)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
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
        ],
        lifespan=lifespan,
    )
    app.state.config = config
    app.state.sessions = sessions
    return app


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
    parser.add_argument("--open", action="store_true", help="serve unknown API keys")
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
        "to the system (glibc's malloc_trim; see the README); 0: never",
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
    )
    if not args.trim_idle >= 0:
        raise InvalidArgumentError("--trim-idle must be 0 (never) or a number of seconds")
    served = with_idle_trim(app, args.trim_idle)  # the process's own allocator: not the app's
    sock = listen_socket(args.host, args.port)
    # what was made at start (modules, the reopened sessions' graphs) lives as long as the
    # process: out of the collector's way, a full collection no longer walks all of it
    gc.collect()
    gc.freeze()
    host, port = sock.getsockname()[:2]
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
    """`rollout-store serve ...` (also `python -m rollout_store.server ...`)."""
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

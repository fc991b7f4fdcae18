"""A small deterministic inference engine for tests, demos and benchmarks.

It answers `POST /v1/chat/completions` like vLLM (with `return_token_ids: true`: top-level
`prompt_token_ids` and per-choice `token_ids`; with `logprobs: true`:
`choices[i].logprobs.content[j].logprob`) and `POST /v1/messages` like Anthropic's Messages
API, each streaming or not. Its "tokenizer" is a fixed chat template over hashed words, so
turn k+1's prompt ids extend turn k's prompt + sampled ids exactly, as a real engine's do.
Replies depend only on the request: the same request always gets the same answer.

The requested model name selects test behaviour: `stub-hang` answers only once the caller
has given up, `stub-slow` answers after a second, `stub-error` answers 400 with an
OpenAI-style error, `stub-500` answers 500, `stub-garbage` answers 200 with a body that is
not JSON. `stub-tools` (or any request with `tools` whose last message is a user message)
answers with a tool call.

    python -m rollout_store.serve.stub_engine --port 8000 [--latency-ms 100 [--jitter 0.5]]
        [--fill-max-tokens] [--ms-per-token 2]

For benchmarks shaped like real traffic, `--fill-max-tokens` makes a plain-text reply exactly
the request's `max_tokens` words long, and `--ms-per-token` adds that many milliseconds of
generation time per sampled token, so a call takes as long as its output makes it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import xxhash
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .server import listen_socket
from .sse import SSE_HEADERS, anthropic_events, chat_chunks

__all__ = ["create_stub_app", "main", "prompt_ids_for", "text_ids"]

BOS, END, IMAGE, TOOL_CALL = 1, 2, 3, 4
ROLE_IDS = {"system": 10, "developer": 10, "user": 11, "assistant": 12, "tool": 13}
WORD_BASE, WORD_SPAN = 1000, 60_000


def text_ids(text: str) -> list[int]:
    """Token ids of a text: one id per whitespace-separated word."""
    return [
        WORD_BASE + xxhash.xxh32_intdigest(word.encode("utf-8", "surrogatepass")) % WORD_SPAN
        for word in text.split()
    ]


def _digest_ids(data: str, n: int = 4) -> list[int]:
    digest = xxhash.xxh3_128_digest(data.encode("utf-8", "surrogatepass"))
    return [
        WORD_BASE + int.from_bytes(digest[4 * i : 4 * i + 4], "little") % WORD_SPAN
        for i in range(n)
    ]


def _arguments_ids(arguments: Any) -> list[int]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return text_ids(arguments)
    return text_ids(json.dumps(arguments, sort_keys=True))


def _content_ids(content: Any) -> list[int]:
    if content is None:
        return []
    if isinstance(content, str):
        return text_ids(content)
    if not isinstance(content, list):
        return text_ids(json.dumps(content, sort_keys=True))
    ids: list[int] = []
    for part in content:
        if not isinstance(part, dict):
            ids += text_ids(str(part))
            continue
        kind = part.get("type")
        if kind == "text":
            ids += text_ids(str(part.get("text", "")))
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url", "") if isinstance(url, dict) else str(url)
            ids += [IMAGE, *_digest_ids(url)]
        elif kind == "image":
            ids += [IMAGE, *_digest_ids(json.dumps(part.get("source"), sort_keys=True))]
        elif kind == "tool_use":
            ids += [TOOL_CALL, *text_ids(str(part.get("name"))), *_arguments_ids(part.get("input"))]
        elif kind == "tool_result":
            ids += [ROLE_IDS["tool"], *_content_ids(part.get("content"))]
        else:
            ids += text_ids(json.dumps(part, sort_keys=True))
    return ids


def _message_body_ids(message: dict[str, Any]) -> list[int]:
    ids = _content_ids(message.get("content"))
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {} if isinstance(call, dict) else {}
        ids += [TOOL_CALL, *text_ids(str(fn.get("name"))), *_arguments_ids(fn.get("arguments"))]
    return ids + [END]


def prompt_ids_for(messages: list[Any], system: Any = None) -> list[int]:
    """The prompt the stub's template renders for a conversation, ending with the assistant
    header the reply is sampled after."""
    ids = [BOS]
    if system is not None:
        ids += [ROLE_IDS["system"], *_content_ids(system), END]
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        ids.append(ROLE_IDS.get(role, 14) if isinstance(role, str) else 14)
        ids += _message_body_ids(message) if isinstance(message, dict) else [END]
    ids.append(ROLE_IDS["assistant"])
    return ids


def logprob_of(token: int) -> float:
    """The stub's deterministic logprob of a sampled token."""
    return -((token * 7919) % 4000 + 1) / 1000.0


def _reply(prompt: list[int], body: dict[str, Any]) -> tuple[str, str | None, dict[str, Any]]:
    """(text, tool name or None, tool arguments) for a request, from its prompt ids alone."""
    digest = xxhash.xxh3_64_hexdigest(repr((prompt, body.get("seed"))).encode())[:10]
    n = sum(1 for t in prompt if t == ROLE_IDS["user"])
    tools = body.get("tools") or []
    messages = body.get("messages") or []
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    last_is_user = last.get("role") == "user" and not (
        isinstance(last.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "tool_result" for p in last["content"])
    )
    if tools and (body.get("model") == "stub-tools" or last_is_user):
        tool = tools[0] if isinstance(tools[0], dict) else {}
        name = (tool.get("function") or {}).get("name") or tool.get("name") or "tool"
        return "", str(name), {"step": n, "key": digest}
    return f"Step {n} done, reply {digest}.", None, {}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": None}},
        status_code=status,
    )


async def _behaviour(request: Request, body: dict[str, Any]) -> Response | None:
    model = body.get("model")
    if model == "stub-hang":  # until the caller gives up (at most an hour)
        for _ in range(72_000):
            if await request.is_disconnected():
                break
            await asyncio.sleep(0.05)
        return Response(status_code=499)
    if model == "stub-slow":  # a long generation
        await asyncio.sleep(1.0)
    if model == "stub-error":
        return _error(400, "stub: this request is refused on purpose")
    if model == "stub-500":
        return _error(500, "stub: internal failure on purpose")
    if model == "stub-garbage":
        return Response(b"<html>not json</html>", status_code=200, media_type="text/html")
    return None


FILL_WORDS = [
    "the",
    "function",
    "returns",
    "a",
    "value",
    "that",
    "the",
    "caller",
    "checks",
    "before",
    "it",
    "writes",
    "the",
    "file",
    "to",
    "disk",
    "and",
    "then",
    "runs",
    "tests",
    "again",
    "after",
    "reading",
    "its",
    "output",
    "carefully",
]


def _filled(text: str, body: dict[str, Any]) -> str:
    """`text` made exactly `max_tokens` words long (the `--fill-max-tokens` option)."""
    wanted = body.get("max_tokens")
    if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted <= 0:
        return text
    words = text.split()[:wanted]
    start = xxhash.xxh32_intdigest(text.encode())
    words += [FILL_WORDS[(start + 7 * i) % len(FILL_WORDS)] for i in range(wanted - len(words))]
    return " ".join(words)


def chat_response(body: dict[str, Any], fill: bool = False) -> dict[str, Any]:
    """The stub's Chat Completions answer to `body` (a decoded request); with `fill`, a
    plain-text reply is `max_tokens` words long."""
    messages = body.get("messages") or []
    prompt = prompt_ids_for(messages)
    text, tool, arguments = _reply(prompt, body)
    if fill and tool is None:
        text = _filled(text, body)
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if tool is not None:
        call_id = "call_" + xxhash.xxh3_64_hexdigest(json.dumps(arguments).encode())[:12]
        message["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": tool, "arguments": json.dumps(arguments)},
            }
        ]
    sampled = _message_body_ids(message)
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": "tool_calls" if tool is not None else "stop",
    }
    if body.get("logprobs"):
        choice["logprobs"] = {
            "content": [
                {"token": f"<{t}>", "logprob": logprob_of(t), "bytes": None, "top_logprobs": []}
                for t in sampled
            ]
        }
    response: dict[str, Any] = {
        "id": "chatcmpl-" + xxhash.xxh3_64_hexdigest(repr(prompt).encode())[:16],
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": body.get("model") or "stub",
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(sampled),
            "total_tokens": len(prompt) + len(sampled),
        },
    }
    if body.get("return_token_ids"):
        response["prompt_token_ids"] = prompt
        choice["token_ids"] = sampled
    return response


def messages_response(body: dict[str, Any], fill: bool = False) -> dict[str, Any]:
    """The stub's Anthropic Messages answer to `body` (a decoded request); with `fill`, a
    plain-text reply is `max_tokens` words long."""
    messages = body.get("messages") or []
    prompt = prompt_ids_for(messages, body.get("system"))
    text, tool, arguments = _reply(prompt, body)
    if fill and tool is None:
        text = _filled(text, body)
    content: list[dict[str, Any]]
    if tool is not None:
        tool_id = "toolu_" + xxhash.xxh3_64_hexdigest(json.dumps(arguments).encode())[:16]
        content = [{"type": "tool_use", "id": tool_id, "name": tool, "input": arguments}]
    else:
        content = [{"type": "text", "text": text}]
    sampled = _content_ids(content)
    return {
        "id": "msg_" + xxhash.xxh3_64_hexdigest(repr(prompt).encode())[:16],
        "type": "message",
        "role": "assistant",
        "model": body.get("model") or "stub",
        "content": content,
        "stop_reason": "tool_use" if tool is not None else "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": len(prompt), "output_tokens": len(sampled) + 1},
    }


async def _body(request: Request) -> dict[str, Any] | Response:
    try:
        body = json.loads(await request.body())
    except ValueError:
        return _error(400, "stub: body is not JSON")
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return _error(400, "stub: body must be an object with a messages list")
    return body


async def _generation(request: Request, response: dict[str, Any]) -> None:
    """Wait as long as the app's engine takes to generate this answer: `latency` seconds,
    give or take `jitter` of it, fixed by the answer, plus `per_token` seconds per sampled
    token (`create_stub_app(latency, jitter, per_token)`)."""
    latency: float = request.app.state.latency
    usage = response.get("usage") or {}
    tokens = usage.get("completion_tokens", usage.get("output_tokens", 0))
    wait = request.app.state.per_token * tokens
    if latency > 0:
        spread = xxhash.xxh32_intdigest(response["id"].encode()) / 0xFFFFFFFF * 2 - 1
        wait += latency * (1 + request.app.state.jitter * spread)
    if wait > 0:
        await asyncio.sleep(wait)


async def _answer(
    request: Request, respond: Callable[[dict[str, Any], bool], dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]] | Response:
    """The request body and the answer `respond` makes of it, after the generation time; or
    the response that ends the call first (a bad body, or a behaviour the body asks for)."""
    body = await _body(request)
    if isinstance(body, Response):
        return body
    special = await _behaviour(request, body)
    if special is not None:
        return special
    response = respond(body, request.app.state.fill)
    await _generation(request, response)
    return body, response


async def _chat(request: Request) -> Response:
    answer = await _answer(request, chat_response)
    if isinstance(answer, Response):
        return answer
    body, response = answer
    if body.get("stream") is True:
        options = body.get("stream_options") or {}
        chunks = chat_chunks(
            response,
            include_usage=bool(options.get("include_usage")),
            token_ids=bool(body.get("return_token_ids")),
        )
        return StreamingResponse(chunks, media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(response)


async def _messages(request: Request) -> Response:
    answer = await _answer(request, messages_response)
    if isinstance(answer, Response):
        return answer
    body, response = answer
    if body.get("stream") is True:
        return StreamingResponse(
            anthropic_events(response), media_type="text/event-stream", headers=SSE_HEADERS
        )
    return JSONResponse(response)


async def _models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": "stub", "object": "model"}]})


def create_stub_app(
    latency: float = 0.0, jitter: float = 0.0, per_token: float = 0.0, fill: bool = False
) -> Starlette:
    """The stub engine as an ASGI app. Each model call waits `latency` seconds before it
    answers (an engine's generation time; 0 answers at once), varied by up to `jitter` times
    that either way, by a fraction fixed by the answer (generation time varies with it), plus
    `per_token` seconds per sampled token. With `fill`, a plain-text reply is the request's
    `max_tokens` words long."""
    if not per_token >= 0:
        raise ValueError("per_token must be 0 or positive")
    if not latency >= 0:
        raise ValueError("latency must be 0 or positive")
    if not 0 <= jitter <= 1:
        raise ValueError("jitter must be between 0 and 1")
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", _chat, methods=["POST"]),
            Route("/v1/messages", _messages, methods=["POST"]),
            Route("/v1/models", _models, methods=["GET"]),
        ]
    )
    app.state.latency = latency
    app.state.jitter = jitter
    app.state.per_token = per_token
    app.state.fill = fill
    return app


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the stub: `python -m rollout_store.serve.stub_engine [--host H] [--port N]`.

    With `--port 0` a free port is chosen; the first line on stdout names the address.
    """
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m rollout_store.serve.stub_engine")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--latency-ms", type=float, default=0.0, help="each model call's generation time"
    )
    parser.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="vary each call's time by up to this fraction of --latency-ms either way",
    )
    parser.add_argument(
        "--ms-per-token",
        type=float,
        default=0.0,
        help="generation time added per sampled token (a call lasts as its output makes it)",
    )
    parser.add_argument(
        "--fill-max-tokens",
        action="store_true",
        help="make a plain-text reply exactly the request's max_tokens words long",
    )
    args = parser.parse_args(argv)
    sock = listen_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    print(f"stub engine on http://{host}:{port}", flush=True)
    app = create_stub_app(
        latency=args.latency_ms / 1000,
        jitter=args.jitter,
        per_token=args.ms_per_token / 1000,
        fill=args.fill_max_tokens,
    )
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())

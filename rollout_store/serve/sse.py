"""Replaying one complete model response as the server-sent events a streaming client expects.

The capture server always asks its upstream for a whole response (token ids and logprobs
arrive complete, never reassembled from deltas) and, when the client asked for
`stream: true`, replays that response as a stream: OpenAI Chat Completions chunks ending with
`data: [DONE]`, or Anthropic Messages events (`message_start` ... `message_stop`). Both are
shapes the official SDKs parse into the same objects a real stream gives.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

__all__ = ["SSE_HEADERS", "anthropic_events", "chat_chunks", "sse_data", "sse_event"]

#: Response headers for an event stream (no caching, no proxy buffering).
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_data(payload: Any) -> bytes:
    """One `data:` event holding `payload` as JSON."""
    return b"data: " + json.dumps(payload).encode("ascii") + b"\n\n"


def sse_event(name: str, payload: Any) -> bytes:
    """One named event (`event: name`) holding `payload` as JSON."""
    return f"event: {name}\ndata: ".encode("ascii") + json.dumps(payload).encode("ascii") + b"\n\n"


def _chunk(response: dict[str, Any], choices: list[Any], **extra: Any) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": response.get("id", "chatcmpl-replay"),
        "object": "chat.completion.chunk",
        "created": response.get("created", 0),
        "model": response.get("model", ""),
    }
    if response.get("system_fingerprint") is not None:
        chunk["system_fingerprint"] = response["system_fingerprint"]
    chunk["choices"] = choices
    chunk.update(extra)
    return chunk


def chat_chunks(
    response: dict[str, Any], *, include_usage: bool = False, token_ids: bool = False
) -> Iterator[bytes]:
    """A Chat Completions response as `chat.completion.chunk` events, then `[DONE]`.

    Per choice: a role delta, one delta with the content (and reasoning, tool calls and
    logprobs when present), then a delta carrying `finish_reason`. `include_usage` adds the
    final usage chunk (`stream_options.include_usage`); `token_ids` keeps vLLM's
    `prompt_token_ids` (first chunk) and per-choice `token_ids`.
    """
    choices = response.get("choices") or []
    first_extra: dict[str, Any] = {}
    if token_ids and "prompt_token_ids" in response:
        first_extra["prompt_token_ids"] = response["prompt_token_ids"]
    for position, choice in enumerate(choices):
        index = choice.get("index", position)
        message = choice.get("message") or {}
        role_delta = {"role": message.get("role", "assistant"), "content": ""}
        yield sse_data(
            _chunk(
                response,
                [{"index": index, "delta": role_delta, "logprobs": None, "finish_reason": None}],
                **(first_extra if position == 0 else {}),
            )
        )
        delta: dict[str, Any] = {}
        for key in ("reasoning_content", "reasoning"):
            if message.get(key):
                delta[key] = message[key]
        if message.get("content"):
            delta["content"] = message["content"]
        if message.get("refusal"):
            delta["refusal"] = message["refusal"]
        calls = message.get("tool_calls") or []
        if calls:
            delta["tool_calls"] = [
                {
                    "index": i,
                    "id": call.get("id"),
                    "type": call.get("type", "function"),
                    "function": call.get("function") or {},
                }
                for i, call in enumerate(calls)
            ]
        body: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None}
        if choice.get("logprobs") is not None:
            body["logprobs"] = choice["logprobs"]
        if token_ids and "token_ids" in choice:
            body["token_ids"] = choice["token_ids"]
        body["finish_reason"] = None
        if delta or body["logprobs"] is not None or "token_ids" in body:
            yield sse_data(_chunk(response, [body]))
        yield sse_data(
            _chunk(
                response,
                [
                    {
                        "index": index,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": choice.get("finish_reason"),
                    }
                ],
            )
        )
    if include_usage:
        yield sse_data(_chunk(response, [], usage=response.get("usage")))
    yield b"data: [DONE]\n\n"


def _block_start(block: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The `content_block_start` shape of a block and the deltas that fill it."""
    kind = block.get("type")
    if kind == "text":
        return {**block, "text": ""}, [{"type": "text_delta", "text": block.get("text", "")}]
    if kind in ("tool_use", "server_tool_use"):
        start = {**block, "input": {}}
        return start, [{"type": "input_json_delta", "partial_json": json.dumps(block["input"])}]
    if kind == "thinking":
        deltas: list[dict[str, Any]] = [
            {"type": "thinking_delta", "thinking": block.get("thinking", "")}
        ]
        if block.get("signature"):
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        return {**block, "thinking": "", "signature": ""}, deltas
    return block, []  # redacted thinking and other blocks arrive whole in their start event


def anthropic_events(message: dict[str, Any]) -> Iterator[bytes]:
    """An Anthropic Messages response as its stream of events, ending with `message_stop`."""
    usage = dict(message.get("usage") or {})
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**usage, "output_tokens": 0} if usage else {},
    }
    yield sse_event("message_start", {"type": "message_start", "message": start})
    for index, block in enumerate(message.get("content") or []):
        opening, deltas = _block_start(block)
        yield sse_event(
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": opening},
        )
        for delta in deltas:
            yield sse_event(
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": delta},
            )
        yield sse_event("content_block_stop", {"type": "content_block_stop", "index": index})
    yield sse_event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {
                "stop_reason": message.get("stop_reason"),
                "stop_sequence": message.get("stop_sequence"),
            },
            "usage": {"output_tokens": usage.get("output_tokens", 0)},
        },
    )
    yield sse_event("message_stop", {"type": "message_stop"})

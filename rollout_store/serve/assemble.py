"""The complete response a streamed answer adds up to, made from its server-sent events.

The capture server's Rust data plane passes an upstream's stream to the client as it arrives
and keeps its bytes; at the stream's end this module makes them the response the upstream
would have answered unstreamed, and that response is recorded as the turn (`chat_turn`,
`messages_turn`), exactly as an unstreamed answer is:

- OpenAI Chat Completions (`chat.completion.chunk` events, then `data: [DONE]`): per choice,
  the deltas' text fields (`content`, `reasoning_content`, `reasoning`, `refusal`) joined,
  `tool_calls` merged by their `index` (`function.arguments` joined), `logprobs.content`
  joined, vLLM's `token_ids` joined, the last `finish_reason`; the top-level `id`, `model`,
  `created`, `system_fingerprint`, `usage` and vLLM's `prompt_token_ids` as they came. A
  message whose text is empty has `content: null`, as an unstreamed answer has.
- Anthropic Messages: `message_start`'s message, each `content_block_start` block filled by
  its `content_block_delta` events (`text_delta`, `input_json_delta` parsed into `input` at
  the block's end, `thinking_delta`, `signature_delta`, `citations_delta`), and
  `message_delta`'s `stop_reason`, `stop_sequence` and `usage`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from ..errors import InvalidValueError

__all__ = ["assembled", "events_of", "holds_error"]

_CHAT_TEXT = ("content", "reasoning_content", "reasoning", "refusal")


def events_of(data: bytes) -> Iterator[tuple[str, str]]:
    """The events of an SSE stream as (event name, data), comments and empty events left
    out; an event's `data:` lines are joined with newlines, as the SSE grammar says."""
    text = data.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")
    for block in text.split("\n\n"):
        name, lines = "message", []
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                lines.append(value)
        if lines:
            yield name, "\n".join(lines)


def holds_error(data: bytes, anthropic: bool) -> bool:
    """Whether the stream's events include an error the upstream sent (an Anthropic `error`
    event, or a Chat Completions chunk holding `error`)."""
    for name, payload in events_of(data):
        if anthropic and name == "error":
            return True
        if not anthropic and payload.startswith("{") and '"error"' in payload:
            try:
                if "error" in json.loads(payload):
                    return True
            except (ValueError, RecursionError):  # not an error event of the upstream's
                continue
    return False


def assembled(data: bytes, anthropic: bool) -> dict[str, Any]:
    """The complete response the stream `data` adds up to (or InvalidValueError naming the
    event that cannot be read)."""
    return _messages(data) if anthropic else _chat(data)


def _payloads(data: bytes) -> Iterator[tuple[int, str, Any]]:
    for number, (name, payload) in enumerate(events_of(data)):
        if payload == "[DONE]":
            continue
        try:
            value = json.loads(payload)
        except ValueError:
            raise InvalidValueError("the event's data is not JSON", f"event {number}") from None
        except RecursionError:
            raise InvalidValueError(
                "the event's data nests too deeply to be read", f"event {number}"
            ) from None
        if not isinstance(value, dict):
            raise InvalidValueError("the event's data is not an object", f"event {number}")
        yield number, name, value


def _join(into: dict[str, Any], key: str, value: Any) -> None:
    """A delta's field added to what it continues: text joined, anything else replaced."""
    if value is None:
        into.setdefault(key, None)
    elif isinstance(value, str) and isinstance(into.get(key), str):
        into[key] += value
    else:
        into[key] = value


def _tool_calls(calls: list[Any], deltas: Any, where: str) -> None:
    if not isinstance(deltas, list):
        raise InvalidValueError("tool_calls is not a list", where)
    for position, delta in enumerate(deltas):
        if not isinstance(delta, dict):
            raise InvalidValueError("a tool call delta is not an object", f"{where}[{position}]")
        index = delta.get("index", position)
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index <= len(calls):
            raise InvalidValueError("a tool call's index is out of order", f"{where}[{position}]")
        if index == len(calls):
            calls.append({})
        call = calls[index]
        for key, value in delta.items():
            if key == "index":
                continue
            if key == "function" and isinstance(value, dict):
                function = call.setdefault("function", {})
                for name, part in value.items():
                    if name == "arguments":
                        _join(function, name, part)
                    elif part is not None or name not in function:
                        function[name] = part
            elif value is not None or key not in call:
                call[key] = value  # an id or type some engines send again with each delta


def _chat(data: bytes) -> dict[str, Any]:
    response: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    for number, _, chunk in _payloads(data):
        for key in ("id", "created", "model", "system_fingerprint", "prompt_token_ids", "usage"):
            if chunk.get(key) is not None:
                response[key] = chunk[key]
        parts = chunk.get("choices") or []
        if not isinstance(parts, list):
            raise InvalidValueError("choices is not a list", f"event {number}.choices")
        for position, part in enumerate(parts):
            where = f"event {number}.choices[{position}]"
            if not isinstance(part, dict):
                raise InvalidValueError("a choice is not an object", where)
            index = part.get("index", position)
            if not isinstance(index, int) or isinstance(index, bool):
                raise InvalidValueError("a choice's index is not an integer", where)
            choice = choices.setdefault(
                index,
                {
                    "index": index,
                    "message": {},
                    "logprobs": None,
                    "finish_reason": None,
                    "calls": [],
                },
            )
            delta = part.get("delta") or {}
            if not isinstance(delta, dict):
                raise InvalidValueError("a delta is not an object", f"{where}.delta")
            message = choice["message"]
            for key, value in delta.items():
                if key == "tool_calls":
                    if value is not None:
                        message.setdefault("tool_calls", None)
                        _tool_calls(choice["calls"], value, f"{where}.delta.tool_calls")
                elif key in _CHAT_TEXT:
                    _join(message, key, value)
                elif value is not None or key not in message:
                    message[key] = value
            logprobs = part.get("logprobs")
            if isinstance(logprobs, dict):
                kept = choice["logprobs"] if isinstance(choice["logprobs"], dict) else {}
                for key, value in logprobs.items():
                    if isinstance(value, list) and isinstance(kept.get(key), list):
                        kept[key] = kept[key] + value
                    else:
                        kept[key] = value
                choice["logprobs"] = kept
            ids = part.get("token_ids")
            if isinstance(ids, list):
                choice["token_ids"] = choice.get("token_ids", []) + ids
            if part.get("finish_reason") is not None:
                choice["finish_reason"] = part["finish_reason"]
    if not choices:
        raise InvalidValueError("the stream holds no choice", "choices")
    finished = []
    for index in sorted(choices):
        choice = choices[index]
        message = {"role": "assistant", **choice.pop("message")}
        if not message.get("content"):
            message["content"] = None
        calls = choice.pop("calls")
        if calls:
            message["tool_calls"] = calls
        elif message.get("tool_calls") is None:
            message.pop("tool_calls", None)
        finished.append({"index": index, "message": message, **choice})
    whole: dict[str, Any] = {
        "id": response.get("id"),
        "object": "chat.completion",
        "created": response.get("created"),
        "model": response.get("model"),
        "choices": finished,
    }
    for key in ("system_fingerprint", "usage", "prompt_token_ids"):
        if key in response:
            whole[key] = response[key]
    return whole


def _messages(data: bytes) -> dict[str, Any]:
    message: dict[str, Any] | None = None
    blocks: dict[int, dict[str, Any]] = {}
    inputs: dict[int, str] = {}
    for number, name, event in _payloads(data):
        kind = event.get("type", name)
        where = f"event {number} ({kind})"
        if kind == "message_start":
            start = event.get("message")
            if not isinstance(start, dict):
                raise InvalidValueError("message_start holds no message object", where)
            message = dict(start)
        elif kind == "content_block_start":
            index, block = event.get("index"), event.get("content_block")
            if not isinstance(index, int) or not isinstance(block, dict):
                raise InvalidValueError("a block start without its index or block", where)
            blocks[index] = dict(block)
        elif kind == "content_block_delta":
            index, delta = event.get("index"), event.get("delta")
            if index not in blocks or not isinstance(delta, dict):
                raise InvalidValueError("a delta of a block that did not start", where)
            block = blocks[index]
            step = delta.get("type")
            if step == "text_delta":
                block["text"] = str(block.get("text") or "") + str(delta.get("text", ""))
            elif step == "input_json_delta":
                inputs[index] = inputs.get(index, "") + str(delta.get("partial_json", ""))
            elif step == "thinking_delta":
                block["thinking"] = str(block.get("thinking") or "") + str(
                    delta.get("thinking", "")
                )
            elif step == "signature_delta":
                block["signature"] = delta.get("signature")
            elif step == "citations_delta":
                block["citations"] = [*(block.get("citations") or []), delta.get("citation")]
        elif kind == "content_block_stop":
            index = event.get("index")
            if isinstance(index, int) and inputs.get(index):
                try:
                    blocks[index]["input"] = json.loads(inputs.pop(index))
                except (ValueError, KeyError):
                    raise InvalidValueError("a tool input is not JSON", where) from None
                except RecursionError:
                    raise InvalidValueError(
                        "a tool input nests too deeply to be read", where
                    ) from None
        elif kind == "message_delta" and message is not None:
            delta = event.get("delta")
            if isinstance(delta, dict):
                message.update(delta)
            usage = event.get("usage")
            if isinstance(usage, dict):
                message["usage"] = {**(message.get("usage") or {}), **usage}
    if message is None:
        raise InvalidValueError("the stream holds no message_start", "message_start")
    message["content"] = [blocks[index] for index in sorted(blocks)]
    return message

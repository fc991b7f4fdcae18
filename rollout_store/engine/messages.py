"""What makes two chat messages 'the same turn of a conversation' when linking turns.

Request messages are re-sent verbatim and compared exactly. A response is compared with its
echo in the next request loosely: role, text content and tool calls (name and parsed JSON
arguments) must agree, so provider-added null fields, null vs "" content and whitespace in
argument JSON do not break the link. Storage never uses this looseness: it is for linking only.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["SYSTEM_ROLES", "leading_system_count", "link_key", "response_link_key"]

SYSTEM_ROLES = frozenset({"system", "developer"})


def leading_system_count(messages: list[Any] | tuple[Any, ...]) -> int:
    """How many messages at the start are system (or developer) messages."""
    n = 0
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if isinstance(role, str) and role in SYSTEM_ROLES:
            n += 1
        else:
            break
    return n


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_without_nulls(v) for v in value]
    return value


def _content_key(content: Any) -> Any:
    if content is None:
        return ""
    if isinstance(content, list | tuple):
        parts = [_without_nulls(p) for p in content]
        if all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
            return "".join(str(p.get("text", "")) for p in parts)
        return parts
    return content


def _arguments_key(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return ("json", json.loads(arguments))
        except ValueError:
            return ("text", arguments)
    return ("json", _without_nulls(arguments))


def _tool_calls_key(calls: Any) -> Any:
    if not calls:
        return ()
    if not isinstance(calls, list | tuple):
        return _without_nulls(calls)
    out = []
    for call in calls:
        if isinstance(call, dict) and isinstance(call.get("function"), dict):
            fn = call["function"]
            out.append((fn.get("name"), _arguments_key(fn.get("arguments"))))
        else:
            out.append(_without_nulls(call))
    return tuple(out)


def link_key(message: Any) -> Any:
    """A comparable summary of a message: equal for a response and its echo."""
    if not isinstance(message, dict):
        return ("value", message)
    return (
        message.get("role"),
        _content_key(message.get("content")),
        _tool_calls_key(message.get("tool_calls")),
    )


def response_link_key(message: Any) -> Any:
    """`link_key` of a response: one without a role is the assistant's.

    Engines and replayed streams often leave the role out of the message they return,
    while the harness always names it when it sends the message back.
    """
    if isinstance(message, dict) and message.get("role") is None:
        message = {**message, "role": "assistant"}
    return link_key(message)

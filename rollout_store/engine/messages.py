"""What makes two chat messages 'the same turn of a conversation' when linking turns.

Request messages are re-sent verbatim and compared exactly. A response is compared with its
echo in the next request loosely: role, text content and tool calls (name and parsed JSON
arguments) must agree, so provider-added null fields, null vs "" content and whitespace in
argument JSON do not break the link. Storage never uses this looseness: it is for linking only.

A link key holds values nested at most `LINK_DEPTH` levels, the message counting as the first:
a message nested deeper has none (only an exact echo links it), and tool-call arguments whose
JSON would reach deeper are compared as text; the bound is fixed, far below what Python's
recursion limit lets the key be built and compared in, so whether two turns link never depends
on how deep in its caller's stack `add_turn` runs.
"""

from __future__ import annotations

import itertools
import json
from array import array
from typing import Any

__all__ = [
    "LINK_DEPTH",
    "SYSTEM_ROLES",
    "json_nesting",
    "leading_system_count",
    "link_key",
    "response_link_key",
]

SYSTEM_ROLES = frozenset({"system", "developer"})

#: How deeply the values of a link key may nest, counting the message as the first level.
LINK_DEPTH = 100

# A JSON text's nesting measured in C-speed passes: escaped backslashes, then escaped quotes,
# go; what is left of strings lies between quotes; outside them, brackets are +1 and -1.
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
_SIGNS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def json_nesting(data: bytes) -> int:
    """How deeply the containers of the UTF-8 JSON text `data` nest (0 for a scalar). Exact
    for JSON; for other text, at least as deep as a parser gets before it fails."""
    plain = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    outside = b"".join(plain.split(b'"')[::2]).translate(_SIGNS)
    return max(itertools.accumulate(array("b", outside)), default=0)


class _TooDeep(ValueError):
    """A message nested deeper than `LINK_DEPTH`: it has no link key."""


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


def _without_nulls(value: Any, depth: int) -> Any:
    """`value` without the null members of its dicts, tuples as lists (`depth`: the levels
    around it; `_TooDeep` when it would reach deeper than `LINK_DEPTH`)."""
    if isinstance(value, dict):
        if depth >= LINK_DEPTH:
            raise _TooDeep
        depth += 1
        return {
            k: v if type(v) is str else _without_nulls(v, depth)
            for k, v in value.items()
            if v is not None
        }
    if isinstance(value, list | tuple):
        if depth >= LINK_DEPTH:
            raise _TooDeep
        depth += 1
        return [v if type(v) is str else _without_nulls(v, depth) for v in value]
    return value


def _bounded(value: Any, depth: int) -> Any:
    """`value` itself, kept as it is (`_TooDeep` when it would reach deeper than
    `LINK_DEPTH`)."""
    if type(value) is not str and isinstance(value, dict | list | tuple):
        _without_nulls(value, depth)
    return value


def _content_key(content: Any) -> Any:
    if content is None:
        return ""
    if isinstance(content, list | tuple):
        parts = [_without_nulls(p, 2) for p in content]
        if all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
            return "".join(str(p.get("text", "")) for p in parts)
        return parts
    return _bounded(content, 1)


def _arguments_key(arguments: Any) -> Any:
    """The arguments of a call (at the fifth level of its message)."""
    if isinstance(arguments, str):
        room = LINK_DEPTH - 4
        # (only text with that many brackets at all is measured)
        if (
            len(arguments) > room
            and arguments.count("[") + arguments.count("{") > room
            and json_nesting(arguments.encode("utf-8", "surrogatepass")) > room
        ):
            return ("text", arguments)
        try:
            return ("json", json.loads(arguments))
        except ValueError:
            return ("text", arguments)
    return ("json", _without_nulls(arguments, 4))


def _tool_calls_key(calls: Any) -> Any:
    if not isinstance(calls, list | tuple):
        return _without_nulls(calls, 1)
    out = []
    for call in calls:
        if isinstance(call, dict) and isinstance(call.get("function"), dict):
            fn = call["function"]
            name = fn.get("name")
            if type(name) is not str:
                name = _bounded(name, 4)
            out.append((name, _arguments_key(fn.get("arguments"))))
        else:
            out.append(_without_nulls(call, 2))
    return tuple(out)


def link_key(message: Any) -> Any:
    """A comparable summary of a message: equal for a response and its echo. `ValueError`
    for a message nested deeper than `LINK_DEPTH` (it links only by an exact echo)."""
    if not isinstance(message, dict):
        return ("value", _bounded(message, 0))
    role = message.get("role")
    content = message.get("content")
    calls = message.get("tool_calls")
    return (
        role if type(role) is str else _bounded(role, 1),
        content if type(content) is str else _content_key(content),
        _tool_calls_key(calls) if calls else (),
    )


def response_link_key(message: Any) -> Any:
    """`link_key` of a response: one without a role is the assistant's.

    Engines and replayed streams often leave the role out of the message they return,
    while the harness always names it when it sends the message back.
    """
    if isinstance(message, dict) and message.get("role") is None:
        message = {**message, "role": "assistant"}
    return link_key(message)

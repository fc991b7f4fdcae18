"""Helpers shared by the tests: exact comparison, JSON-like strategies, rollout builders."""

from __future__ import annotations

import base64
import gc
import json
import random
import struct
import types
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st

from rollout_store import RolloutGraph, TurnNode

# ---------------------------------------------------------------- exact comparison

_CONTAINERS = (list, tuple, dict)


def same(a: Any, b: Any) -> bool:
    """Type-exact equality: 1 / 1.0 / True apart, float bits (NaN, -0.0), key order.

    Iterative, so values nested hundreds deep compare without recursion.
    """
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if type(x) is not type(y):
            return False
        t = type(x)
        if t is float:
            if struct.pack("<d", x) != struct.pack("<d", y):
                return False
        elif t is list or t is tuple:
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y, strict=True))
        elif t is dict:
            if len(x) != len(y):
                return False
            for (kx, vx), (ky, vy) in zip(x.items(), y.items(), strict=True):
                stack.append((kx, ky))
                stack.append((vx, vy))
        elif x != y:
            return False
    return True


def diff(a: Any, b: Any, path: str = "") -> str | None:
    """Where `same(a, b)` first fails, for assertion messages (shallow values only)."""
    if type(a) is not type(b):
        return f"{path}: type {type(a).__name__} != {type(b).__name__} ({a!r:.80} vs {b!r:.80})"
    if type(a) in (list, tuple):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = diff(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    if type(a) is dict:
        if list(a) != list(b) and len(a) == len(b) and not same(list(a), list(b)):
            return f"{path}: keys {list(a)!r:.200} != {list(b)!r:.200}"
        for (kx, x), (_, y) in zip(a.items(), b.items(), strict=False):
            found = diff(x, y, f"{path}[{kx!r}]")
            if found:
                return found
        return None if same(a, b) else f"{path}: differs"
    return None if same(a, b) else f"{path}: {a!r:.80} != {b!r:.80}"


def assert_same(got: Any, want: Any) -> None:
    assert same(got, want), diff(got, want) or "values differ"


DUMPS_OPTIONS: list[dict[str, Any]] = [
    {},
    {"sort_keys": True},
    {"indent": 2},
    {"ensure_ascii": False},
    {"separators": (",", ":")},
    {"indent": "\t", "ensure_ascii": False, "sort_keys": True, "separators": (",", ": ")},
]


def dumps_or_error(value: Any, **options: Any) -> tuple[str, str]:
    """json.dumps output, or the error type when json.dumps refuses (mixed key types)."""
    try:
        return ("ok", json.dumps(value, **options))
    except (TypeError, ValueError) as exc:
        return ("error", type(exc).__name__)


def assert_same_json(got: Any, want: Any) -> None:
    """json.dumps(got) == json.dumps(want) under every option set in DUMPS_OPTIONS."""
    for options in DUMPS_OPTIONS:
        assert dumps_or_error(got, **options) == dumps_or_error(want, **options), options


# ---------------------------------------------------------------- strategies

_text_chars = st.one_of(
    st.characters(min_codepoint=0, max_codepoint=0x7F),
    st.characters(min_codepoint=0x80, max_codepoint=0xFFFF),  # includes lone surrogates
    st.characters(categories=["Cs"]),
    st.characters(min_codepoint=0x10000, max_codepoint=0x10FFFF),
)
short_text = st.text(_text_chars, max_size=12)
medium_text = st.text(_text_chars, min_size=8, max_size=90)
long_text = st.builds(
    lambda piece, n, tail: piece * n + tail,
    st.text(_text_chars, min_size=1, max_size=4),
    st.integers(min_value=260, max_value=700),
    short_text,
)
texts = st.one_of(short_text, short_text, medium_text, long_text)

ints = st.one_of(
    st.integers(min_value=-300, max_value=300),
    st.integers(),
    st.integers(min_value=-(2**90), max_value=2**90),
    st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 2**70, -(2**65)]),
)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e308]),
)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
keys = st.one_of(short_text, short_text, medium_text, ints, floats, st.booleans(), st.none())


def _extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
    )


json_like = st.recursive(scalars, _extend, max_leaves=24)
small_json = st.recursive(scalars, _extend, max_leaves=8)

messages = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
        optional={"content": small_json, "name": texts, "tool_calls": small_json},
    ),
    small_json,
)

#: More examples for the slow (fuzz) variants of property tests, whatever the profile.
FUZZ = settings(max_examples=5 * settings().max_examples)


# ---------------------------------------------------------------- builders


def fresh(value: Any) -> Any:
    """A deep copy made the way a server decodes a request body: json.loads(json.dumps())."""
    return json.loads(json.dumps(value))


def image_url(seed: int, size: int = 64 * 1024) -> str:
    """A distinct base64 PNG data URL of exactly `size` characters."""
    prefix = "data:image/png;base64,"
    n_raw = (size - len(prefix)) * 3 // 4 + 3
    data = base64.b64encode(random.Random(seed).randbytes(n_raw)).decode("ascii")
    return (prefix + data)[:size]


def chat_turns(
    n: int,
    *,
    tag: str = "",
    system: str | None = "You are a careful assistant.",
    images: list[str] | None = None,
    pad: int = 0,
) -> list[dict[str, Any]]:
    """A linear chat rollout: each request re-sends every earlier message plus a new one.

    Returns the fields of each turn (request_messages, response_message), fresh copies.
    `images[k]`, when given, is attached to the user message of turn k.
    """
    history: list[Any] = []
    if system is not None:
        history.append({"role": "system", "content": system})
    turns = []
    filler = ("lorem ipsum dolor sit amet " * (pad // 27 + 1))[:pad]
    for k in range(n):
        text = f"{tag} question {k} {filler}"
        if images is not None and k < len(images):
            content: Any = [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": images[k]}},
            ]
        else:
            content = text
        history.append({"role": "user", "content": content})
        response = {"role": "assistant", "content": f"{tag} answer {k} {filler}"}
        turns.append({"request_messages": fresh(history), "response_message": fresh(response)})
        history.append(response)
    return turns


def token_turns(
    n: int,
    *,
    start: int = 1000,
    n_prompt: int = 5,
    n_new: int = 4,
    n_sampled: int = 3,
    root_prompt: list[int] | None = None,
) -> list[dict[str, Any]]:
    """A linear token rollout: prompt_k = prompt_{k-1} + sampled_{k-1} + new tokens."""
    counter = iter(range(start, start + 10**9))
    full = (
        list(root_prompt) if root_prompt is not None else [next(counter) for _ in range(n_prompt)]
    )
    turns = []
    for k in range(n):
        if k:
            full += [next(counter) for _ in range(n_new)]
        sampled = [next(counter) for _ in range(n_sampled)]
        logprobs = [-0.25 * (i + 1) - k for i in range(n_sampled)]
        turns.append(
            {"prompt_ids": list(full), "sampled_ids": sampled, "sampled_logprobs": logprobs}
        )
        full += sampled
    return turns


def add_all(graph: RolloutGraph, turns: list[dict[str, Any]], prefix: str = "t") -> list[str]:
    """Add turns with node ids prefix0, prefix1, ...; returns the ids."""
    ids = []
    for k, fields in enumerate(turns):
        node = graph.add_turn(TurnNode(node_id=f"{prefix}{k}", **fields))
        ids.append(node.node_id)
    return ids


def materialized(graph: RolloutGraph, node_id: str) -> dict[str, Any]:
    """The recorded fields of a turn as get() rebuilds them."""
    node = graph.get(node_id)
    return {
        "request_messages": node.request_messages,
        "request_tools": node.request_tools,
        "response_message": node.response_message,
        "sampling_params": node.sampling_params,
        "prompt_ids": node.prompt_ids,
        "sampled_ids": node.sampled_ids,
        "sampled_logprobs": node.sampled_logprobs,
    }


# ---------------------------------------------------------------- memory

_OPAQUE = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.CodeType,
    types.FrameType,
)


def reachable(root: Any) -> dict[int, Any]:
    """Objects reachable from `root` through gc.get_referents, by id.

    Does not descend into classes, modules, functions or code: those lead to the whole
    interpreter, not to data the object holds.
    """
    seen: dict[int, Any] = {id(root): root}
    stack = [root]
    while stack:
        obj = stack.pop()
        for ref in gc.get_referents(obj):
            if id(ref) in seen or isinstance(ref, _OPAQUE):
                continue
            seen[id(ref)] = ref
            stack.append(ref)
    return seen

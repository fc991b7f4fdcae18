"""The stored form of a turn, and the small pieces every layer above shares.

A `Turn` holds references and packed bytes only; its `flags` say how its packed parts must be
compared. The index keys and chain helpers here are used by request storage, linking and files.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from enum import IntEnum
from typing import Any, NamedTuple

import msgpack
import xxhash

from .encoding import EXT_ECHO, array_header, plain_default
from .nodes import TurnNode
from .tokens import TokenRun, block_digests, run_bytes

__all__ = [
    "TurnNode",
    "ECHO_PACKED",
    "EMPTY_PROMPT",
    "HEADS",
    "IndexKeys",
    "LinkKind",
    "LINK_EXPLICIT",
    "LINK_MESSAGES",
    "LINK_NAMES",
    "LINK_NONE",
    "LINK_TOKENS",
    "LOGPROBS_PACKED",
    "MESSAGES_TUPLE",
    "NO_MESSAGES",
    "RESPONSE_REFS",
    "RESPONSE_SPECIAL",
    "SCALAR_NAMES",
    "TAIL_ECHO",
    "TAIL_REFS",
    "TAIL_SLOW",
    "TAIL_SPECIAL",
    "Turn",
    "TurnMeta",
    "add_child",
    "finish_tail",
    "full_run",
    "index_add",
    "index_members",
    "index_remove",
    "is_above",
    "new_packer",
    "no_echo",
    "request_key",
    "root_token_keys",
    "sampled_any",
    "seg_list",
    "short_key",
]


SCALAR_NAMES = ("model", "finish_reason", "harness_session_id", "system_digest")


ECHO_PACKED = msgpack.packb(msgpack.ExtType(EXT_ECHO, b""))
assert len(ECHO_PACKED) == 3  # the inline comparison in _request_matches counts on it


class LinkKind(IntEnum):
    """How a turn was linked to its parent (its value is what a file stores)."""

    NONE = 0
    TOKENS = 1
    MESSAGES = 2
    EXPLICIT = 3


LINK_NONE, LINK_TOKENS, LINK_MESSAGES, LINK_EXPLICIT = LinkKind
LINK_NAMES = tuple(kind.name.lower() for kind in LinkKind)


class TurnMeta(NamedTuple):
    """A turn's scalar fields; equal ones are one interned tuple per graph."""

    model: str | None
    finish_reason: str | None
    harness_session_id: str | None
    system_digest: str | None
    n_tools: int | None


class IndexKeys(NamedTuple):
    """The keys a turn is filed under in the graph's indexes (None: not filed there)."""

    request: int | None  # digest of its non-system request
    token: int | None  # block digest of prompt + sampled tokens
    prompt: int | None  # digest of its whole prompt
    roots: list[int] | None  # request keys of its shorter prefixes, while a message root


# Turn.flags bits
TAIL_REFS = 1  # the tail holds blob references (or other ext types): compare after expanding
RESPONSE_REFS = 2
MESSAGES_TUPLE = 4  # request_messages was a tuple
LOGPROBS_PACKED = 8  # sampled_logprobs kept as a packed JSON value, not array('d')
NO_MESSAGES = 16  # request_messages was None
TAIL_ECHO = 32  # the tail starts with a placeholder for the base turn's response
# the packing holds tuples, big ints or lone surrogates: a byte match is trusted only after
# the fresh value passes the validating walk (a caller's msgpack.ExtType could imitate them)
TAIL_SPECIAL = 64
RESPONSE_SPECIAL = 128
# derived, not stored: the tail cannot be compared by bytes alone (see finish_tail)
TAIL_SLOW = 256
EMPTY_PROMPT = 512  # prompt_ids was an empty list: no token ids (turn.prompt is None)


#: Token roots are also found by their first 16, 32 or 48 tokens (for continuations of
#: turns with fewer than BLOCK tokens).
HEADS = (16, 32, 48)


class Turn:
    """The stored form of a turn: references and packed bytes only."""

    __slots__ = (
        "base",
        "body_start",
        "children",
        "first",
        "flags",
        "full",
        "index",
        "link",
        "logprobs",
        "meta",
        "n_rest",
        "node_id",
        "parent",
        "prompt",
        "requested",
        "response",
        "sampled",
        "sampling",
        "system",
        "tail",
        "tools",
    )

    node_id: str
    index: int
    parent: Turn | None
    children: tuple[Turn, ...] | None  # a tuple: smaller than a list, and rarely changed
    link: LinkKind
    flags: int
    meta: TurnMeta  # interned per graph
    system: bytes | None  # packed leading system messages (a stream), shared via ValueTable
    base: Turn | None  # the turn whose non-system request this one extends
    tail: bytes  # packed non-system messages after the base's
    n_rest: int  # number of non-system request messages
    first: int  # the first of them that the tail holds (the base holds those before)
    body_start: int  # where in the tail the packed messages after the echo begin
    response: bytes | None
    tools: bytes | None
    sampling: bytes | None
    requested: bytes | None  # requested_sampling_params, shared via ValueTable
    prompt: TokenRun | None
    sampled: Any  # array | tuple | None
    full: TokenRun | None  # prompt + sampled, the prefix a child's prompt extends
    logprobs: Any  # array('d') | packed bytes | None


def short_key(data: bytes, n_tokens: int) -> int:
    """Index key of exactly the first `n_tokens` tokens of `data` (array('I') bytes)."""
    return xxhash.xxh3_64_intdigest(memoryview(data)[: n_tokens * 4], seed=n_tokens + 1)


def new_packer() -> Callable[[Any], bytes]:
    packer = msgpack.Packer(
        use_bin_type=True, strict_types=True, default=plain_default, buf_size=256
    )
    return packer.pack


def no_echo() -> None:
    return None


def is_above(ancestor: Turn, turn: Turn) -> bool:
    """Whether `ancestor` is on the path from the root down to `turn`."""
    node = turn.parent
    while node is not None:
        if node is ancestor:
            return True
        node = node.parent
    return False


def root_token_keys(prompt: TokenRun) -> list[int]:
    if not prompt.compact or prompt.length < HEADS[0]:
        return []
    data = run_bytes(prompt)
    keys = [short_key(data, head) for head in HEADS if head <= prompt.length]
    return keys + block_digests(data)[1:]


def sampled_any(turn: Turn) -> bool:
    """A turn that sampled nothing is a failed call: one with its very prompt is a retry
    (a sibling), not a continuation."""
    return turn.sampled is not None and len(turn.sampled) > 0


def finish_tail(turn: Turn) -> None:
    """Derive what the byte comparison of a tail needs from the stored fields."""
    base = turn.base
    turn.first = base.n_rest if base is not None else 0
    echo = turn.flags & TAIL_ECHO
    turn.body_start = len(array_header(turn.n_rest - turn.first)) + (
        len(ECHO_PACKED) if echo else 0
    )
    slow = turn.flags & (TAIL_REFS | TAIL_SPECIAL) or (
        echo and (base is None or base.flags & (RESPONSE_REFS | RESPONSE_SPECIAL))
    )
    turn.flags = (turn.flags & ~TAIL_SLOW) | (TAIL_SLOW if slow else 0)


def request_key(plains: list[bytes | None] | list[bytes], n: int) -> int:
    """Index key of the first `n` messages of a non-system request: `n` and the last one.

    Cheap on purpose (one message hashed): a hit is confirmed against every message anyway.
    """
    return xxhash.xxh3_64_intdigest(plains[n - 1] if n else b"", seed=n)  # type: ignore[arg-type]


def full_run(prompt: TokenRun | None, sampled: Any) -> TokenRun | None:
    """The run a child's prompt extends: prompt + sampled (the prompt itself if none)."""
    return TokenRun(prompt, sampled) if sampled is not None and len(sampled) else prompt


def index_members(found: Any) -> tuple[Any, ...] | list[Any]:
    if found is None:
        return ()
    return found if isinstance(found, list) else (found,)


def index_add(index: dict[int, Any], key: int, item: Any) -> None:
    found = index.get(key)
    if found is None:
        index[key] = item
    elif isinstance(found, list):
        found.append(item)
    else:
        index[key] = [found, item]


def index_remove(index: dict[int, Any], key: int, item: Any) -> None:
    found = index.get(key)
    if found is item:
        del index[key]
    elif isinstance(found, list) and item in found:
        found.remove(item)
        if len(found) == 1:
            index[key] = found[0]


def add_child(parent: Turn, child: Turn) -> None:
    children = parent.children
    if children is None:
        parent.children = (child,)
    else:
        parent.children = tuple(sorted((*children, child), key=lambda t: t.index))


def seg_list(seg: Any) -> list[int] | None:
    if seg is None:
        return None
    return seg.tolist() if isinstance(seg, array) else list(seg)

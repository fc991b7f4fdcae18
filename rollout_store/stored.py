"""The stored form of a turn and what it is made of: flags, link kinds, scalar fields.

A `Turn` holds references and packed bytes only; its `flags` say how its packed parts must be
compared. Request storage, linking, the graph and its files all work on these.
"""

from __future__ import annotations

from array import array
from enum import IntEnum
from typing import Any, NamedTuple

from .encoding import ECHO_PACKED, array_header
from .tokens import TokenRun

__all__ = [
    "SCALAR_NAMES",
    "IndexKeys",
    "LinkKind",
    "Turn",
    "TurnFlag",
    "TurnMeta",
    "add_child",
    "finish_tail",
    "full_run",
    "is_above",
    "sampled_any",
    "seg_list",
]

#: The string fields of `TurnMeta` (checked on intake), in order.
SCALAR_NAMES = ("model", "finish_reason", "harness_session_id", "system_digest")


class TurnFlag(IntEnum):
    """The bits of `Turn.flags`.

    An IntEnum of single bits rather than an IntFlag: IntFlag's operators run in Python
    (about 25 times slower than int's), and flags are tested on every comparison of a
    stored request. `flags & TurnFlag.X` is a plain int.
    """

    TAIL_REFS = 1  # the tail holds blob references (or other ext types): compare expanded
    RESPONSE_REFS = 2  # the same for the response
    MESSAGES_TUPLE = 4  # request_messages was a tuple
    LOGPROBS_PACKED = 8  # sampled_logprobs kept as a packed JSON value, not array('d')
    NO_MESSAGES = 16  # request_messages was None
    TAIL_ECHO = 32  # the tail starts with a placeholder for the base turn's response
    # the packing holds tuples, big ints or lone surrogates: a byte match is trusted only
    # after the fresh value passes the validating walk (a caller's ExtType could imitate one)
    TAIL_SPECIAL = 64
    RESPONSE_SPECIAL = 128
    # derived, never stored: the tail cannot be compared by bytes alone (see finish_tail)
    TAIL_SLOW = 256
    EMPTY_PROMPT = 512  # prompt_ids was an empty list: no token ids (turn.prompt is None)


class LinkKind(IntEnum):
    """How a turn was linked to its parent (its value is what a file stores)."""

    NONE = 0
    TOKENS = 1
    MESSAGES = 2
    EXPLICIT = 3

    @property
    def label(self) -> str:
        """The name queries report: none, tokens, messages or explicit."""
        return _LINK_LABELS[self]


_LINK_LABELS = {kind: kind.name.lower() for kind in LinkKind}


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
    flags: int  # TurnFlag bits
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


def is_above(ancestor: Turn, turn: Turn) -> bool:
    """Whether `ancestor` is on the path from the root down to `turn`."""
    node = turn.parent
    while node is not None:
        if node is ancestor:
            return True
        node = node.parent
    return False


def sampled_any(turn: Turn) -> bool:
    """A turn that sampled nothing is a failed call: one with its very prompt is a retry
    (a sibling), not a continuation."""
    return turn.sampled is not None and len(turn.sampled) > 0


def finish_tail(turn: Turn) -> None:
    """Derive what the byte comparison of a tail needs from the stored fields."""
    base = turn.base
    turn.first = base.n_rest if base is not None else 0
    echo = turn.flags & TurnFlag.TAIL_ECHO
    turn.body_start = len(array_header(turn.n_rest - turn.first)) + (
        len(ECHO_PACKED) if echo else 0
    )
    slow = turn.flags & (TurnFlag.TAIL_REFS | TurnFlag.TAIL_SPECIAL) or (
        echo and (base is None or base.flags & (TurnFlag.RESPONSE_REFS | TurnFlag.RESPONSE_SPECIAL))
    )
    turn.flags = (turn.flags & ~TurnFlag.TAIL_SLOW) | (TurnFlag.TAIL_SLOW if slow else 0)


def full_run(prompt: TokenRun | None, sampled: Any) -> TokenRun | None:
    """The run a child's prompt extends: prompt + sampled (the prompt itself if none)."""
    return TokenRun(prompt, sampled) if sampled is not None and len(sampled) else prompt


def add_child(parent: Turn, child: Turn) -> None:
    """Add `child` to the children of `parent`, kept in arrival order."""
    children = parent.children
    if children is None:
        parent.children = (child,)
    else:
        parent.children = tuple(sorted((*children, child), key=lambda t: t.index))


def seg_list(seg: Any) -> list[int] | None:
    """A stored token segment as a fresh list (None stays None)."""
    if seg is None:
        return None
    return seg.tolist() if isinstance(seg, array) else list(seg)

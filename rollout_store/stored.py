"""The stored form of a turn and what it is made of: flags, link kinds, scalar fields.

A `Turn` holds references and packed bytes only; its `flags` say how its packed parts must be
compared. Request storage, linking, the graph and its files all work on these.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from enum import IntEnum
from typing import Any, NamedTuple

from .encoding import ECHO_PACKED, array_header
from .errors import RolloutStoreError
from .tokens import TokenRun

__all__ = [
    "SCALAR_NAMES",
    "IndexKeys",
    "LinkKind",
    "Turn",
    "TurnFlag",
    "TurnMeta",
    "TurnTokens",
    "add_child",
    "finish_tail",
    "full_run",
    "is_above",
    "sampled_any",
    "seg_list",
]

#: Bytes of a request digest (BLAKE3, see confirm.prefix_digest).
DIGEST_SIZE = 32

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
    # derived, never stored: the request (this tail or a base's) holds tuples, big ints or
    # lone surrogates, so a digest match is trusted only after the fresh messages pass the
    # validating walk
    PREFIX_SPECIAL = 1024
    # derived, never stored: `Turn.data` ends with the request's digest (see Turn.digest)
    HAS_DIGEST = 2048


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


_NO_REQUEST = bytes(4)  # no tail, no digest, n_rest 0 (immutable: every new turn starts so)


def _n_rest_bytes(n_rest: int) -> bytes:
    if not 0 <= n_rest < 1 << 32:
        raise RolloutStoreError(f"a request of {n_rest} messages cannot be stored")
    return n_rest.to_bytes(4, "little")


def _trailer_size(flags: int) -> int:
    """Bytes of `Turn.data` after the tail."""
    return 4 + DIGEST_SIZE if flags & TurnFlag.HAS_DIGEST else 4


class TurnTokens:
    """A turn's token fields, kept apart: most message-linked turns have none."""

    __slots__ = ("full", "logprobs", "prompt", "sampled")

    def __init__(self) -> None:
        self.prompt: TokenRun | None = None
        self.sampled: Any = None
        self.full: TokenRun | None = None
        self.logprobs: Any = None


_NO_VALUES: tuple[bytes | None, bytes | None, bytes | None, bytes | None] = (None,) * 4


def _with(values: tuple[Any, ...] | None, i: int, value: Any) -> tuple[Any, ...] | None:
    """`values` (the shared packed values) with item `i` set to `value`."""
    old = values if values is not None else _NO_VALUES
    if old[i] is value:
        return values
    new = (*old[:i], value, *old[i + 1 :])
    return None if new == _NO_VALUES else new


class Turn:
    """The stored form of a turn: references and packed bytes only.

    Kept small, since a graph holds one per turn: the id is derived from the index unless
    the caller chose another (`ident`); a single child is held bare; the shared packed values
    (system part, tools, sampling and requested sampling parameters) are one tuple that the
    graph interns, so turns with the same values share it; the token fields live in a
    `TurnTokens` only when the turn has some. The fields of both are read and written
    through properties of the same names.
    """

    __slots__ = (
        "base",
        "data",
        "flags",
        "ident",
        "index",
        "kids",
        "link",
        "meta",
        "parent",
        "response",
        "rkey",
        "tokens",
        "values",
    )

    ident: str | None  # the node id when it is not the default `turn-{index}`
    index: int
    parent: Turn | None
    kids: Turn | tuple[Turn, ...] | None  # the children: one bare, several as a tuple
    link: LinkKind
    flags: int  # TurnFlag bits
    meta: TurnMeta  # interned per graph
    base: Turn | None  # the turn whose non-system request this one extends
    response: bytes | None
    # system, tools, sampling, requested: packed values shared via ValueTable, interned
    values: tuple[bytes | None, bytes | None, bytes | None, bytes | None] | None
    tokens: TurnTokens | None
    # the tail (packed non-system messages after the base's), the digest if known and the
    # number of non-system messages: one bytes object where there were two bytes objects and
    # an int (see the `tail`, `digest` and `n_rest` properties)
    data: bytes
    rkey: int | None  # the key its request is filed under (None: not filed)

    def __init__(self) -> None:
        self.data = _NO_REQUEST
        self.ident = None
        self.kids = None
        self.values = None
        self.tokens = None
        self.rkey = None

    # -- identity and children

    @property
    def node_id(self) -> str:
        ident = self.ident
        return ident if ident is not None else f"turn-{self.index}"

    @node_id.setter
    def node_id(self, node_id: str) -> None:
        # `index` is set first
        self.ident = None if node_id == f"turn-{self.index}" else node_id

    @property
    def children(self) -> tuple[Turn, ...] | None:
        kids = self.kids
        if kids is None or isinstance(kids, tuple):
            return kids
        return (kids,)

    @children.setter
    def children(self, children: tuple[Turn, ...] | None) -> None:
        self.kids = children[0] if children is not None and len(children) == 1 else children

    # -- the tail, the digest and n_rest, kept as one bytes object:
    #    tail + digest (DIGEST_SIZE bytes, when HAS_DIGEST) + n_rest (4 bytes, little-endian)

    @property
    def tail(self) -> bytes:
        """The packed non-system messages after the base's."""
        return self.data[: -_trailer_size(self.flags)]

    @tail.setter
    def tail(self, tail: bytes) -> None:
        data = self.data
        self.data = tail + data[len(data) - _trailer_size(self.flags) :]

    def set_request(self, tail_parts: Sequence[bytes], n_rest: int) -> None:
        """Set the tail (`tail_parts` joined) and `n_rest` in one copy; no digest (set it
        afterwards)."""
        self.flags &= ~TurnFlag.HAS_DIGEST
        self.data = b"".join((*tail_parts, _n_rest_bytes(n_rest)))

    @property
    def n_rest(self) -> int:
        """The number of non-system request messages."""
        data = self.data
        return int.from_bytes(data[len(data) - 4 :], "little")

    @n_rest.setter
    def n_rest(self, n_rest: int) -> None:
        self.data = self.data[:-4] + _n_rest_bytes(n_rest)

    @property
    def digest(self) -> bytes | None:
        """BLAKE3 of the plain packing of the non-system messages; None until known (a turn
        read from a file gets it when a byte comparison first confirms it)."""
        if self.flags & TurnFlag.HAS_DIGEST:
            return self.data[-4 - DIGEST_SIZE : -4]
        return None

    @digest.setter
    def digest(self, digest: bytes | None) -> None:
        data = self.data
        tail, n_rest = data[: -_trailer_size(self.flags)], data[-4:]
        if digest is None:
            self.data = tail + n_rest
            self.flags &= ~TurnFlag.HAS_DIGEST
        else:
            if len(digest) != DIGEST_SIZE:  # it would cut the tail short
                raise RolloutStoreError(
                    f"a request digest has {DIGEST_SIZE} bytes, not {len(digest)}"
                )
            self.data = tail + digest + n_rest
            self.flags |= TurnFlag.HAS_DIGEST

    # -- derived from the request's fields (see finish_tail)

    @property
    def first(self) -> int:
        """The first non-system message the tail holds (the base holds those before)."""
        base = self.base
        return base.n_rest if base is not None else 0

    @property
    def body_start(self) -> int:
        """Where in the tail the packed messages after the echo begin."""
        if self.flags & TurnFlag.NO_MESSAGES:
            return 0
        return len(array_header(self.n_rest - self.first)) + (
            len(ECHO_PACKED) if self.flags & TurnFlag.TAIL_ECHO else 0
        )

    # -- shared packed values

    @property
    def system(self) -> bytes | None:
        """Packed leading system messages (a stream)."""
        values = self.values
        return values[0] if values is not None else None

    @system.setter
    def system(self, value: bytes | None) -> None:
        self.values = _with(self.values, 0, value)

    @property
    def tools(self) -> bytes | None:
        values = self.values
        return values[1] if values is not None else None

    @tools.setter
    def tools(self, value: bytes | None) -> None:
        self.values = _with(self.values, 1, value)

    @property
    def sampling(self) -> bytes | None:
        values = self.values
        return values[2] if values is not None else None

    @sampling.setter
    def sampling(self, value: bytes | None) -> None:
        self.values = _with(self.values, 2, value)

    @property
    def requested(self) -> bytes | None:
        """requested_sampling_params."""
        values = self.values
        return values[3] if values is not None else None

    @requested.setter
    def requested(self, value: bytes | None) -> None:
        self.values = _with(self.values, 3, value)

    def share_values(
        self, tools: bytes | None, sampling: bytes | None, requested: bytes | None
    ) -> None:
        """Set tools, sampling and requested at once (the system part is kept)."""
        system = self.system
        if system is None and tools is None and sampling is None and requested is None:
            self.values = None
        else:
            self.values = (system, tools, sampling, requested)

    # -- token fields

    def _tokens(self) -> TurnTokens:
        tokens = self.tokens
        if tokens is None:
            tokens = self.tokens = TurnTokens()
        return tokens

    @property
    def prompt(self) -> TokenRun | None:
        tokens = self.tokens
        return tokens.prompt if tokens is not None else None

    @prompt.setter
    def prompt(self, value: TokenRun | None) -> None:
        if value is not None or self.tokens is not None:
            self._tokens().prompt = value

    @property
    def sampled(self) -> Any:
        """array | tuple | None."""
        tokens = self.tokens
        return tokens.sampled if tokens is not None else None

    @sampled.setter
    def sampled(self, value: Any) -> None:
        if value is not None or self.tokens is not None:
            self._tokens().sampled = value

    @property
    def full(self) -> TokenRun | None:
        """prompt + sampled, the prefix a child's prompt extends."""
        tokens = self.tokens
        return tokens.full if tokens is not None else None

    @full.setter
    def full(self, value: TokenRun | None) -> None:
        if value is not None or self.tokens is not None:
            self._tokens().full = value

    @property
    def logprobs(self) -> Any:
        """array('d') | packed bytes | None."""
        tokens = self.tokens
        return tokens.logprobs if tokens is not None else None

    @logprobs.setter
    def logprobs(self, value: Any) -> None:
        if value is not None or self.tokens is not None:
            self._tokens().logprobs = value


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
    echo = turn.flags & TurnFlag.TAIL_ECHO
    slow = turn.flags & (TurnFlag.TAIL_REFS | TurnFlag.TAIL_SPECIAL) or (
        echo and (base is None or base.flags & (TurnFlag.RESPONSE_REFS | TurnFlag.RESPONSE_SPECIAL))
    )
    special = (
        turn.flags & TurnFlag.TAIL_SPECIAL
        or (echo and base is not None and base.flags & TurnFlag.RESPONSE_SPECIAL)
        or (base is not None and base.flags & TurnFlag.PREFIX_SPECIAL)
    )
    derived = TurnFlag.TAIL_SLOW | TurnFlag.PREFIX_SPECIAL
    turn.flags = (
        (turn.flags & ~derived)
        | (TurnFlag.TAIL_SLOW if slow else 0)
        | (TurnFlag.PREFIX_SPECIAL if special else 0)
    )


def full_run(prompt: TokenRun | None, sampled: Any) -> TokenRun | None:
    """The run a child's prompt extends: prompt + sampled (the prompt itself if none)."""
    return TokenRun(prompt, sampled) if sampled is not None and len(sampled) else prompt


def add_child(parent: Turn, child: Turn) -> None:
    """Add `child` to the children of `parent`, kept in arrival order."""
    kids = parent.kids
    if kids is None:
        parent.kids = child
    else:
        siblings = kids if isinstance(kids, tuple) else (kids,)
        parent.kids = tuple(sorted((*siblings, child), key=lambda t: t.index))


def seg_list(seg: Any) -> list[int] | None:
    """A stored token segment as a fresh list (None stays None)."""
    if seg is None:
        return None
    return seg.tolist() if isinstance(seg, array) else list(seg)

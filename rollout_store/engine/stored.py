"""The stored form of a turn and what it is made of: flags, link kinds, scalar fields.

A `Turn` holds references and packed bytes only; its `flags` say how its packed parts must be
compared. It is kept small (a graph holds one per turn): its request, response, digest and
message count are one bytes object, and what turns alike have in common is one shared
`TurnSide`. Request storage, linking, the graph and its files all work on these.
"""

from __future__ import annotations

import struct
from array import array
from bisect import bisect_right
from collections.abc import Sequence
from enum import IntEnum
from operator import attrgetter
from typing import Any, Final, NamedTuple, Protocol, TypeVar, overload

from ..errors import RolloutStoreError
from .confirm import digest_key
from .encoding import ECHO_PACKED, array_header
from .tokens import ArrayRun, PackedFull, PackedRun, TokenRun, packed_full_length, packed_size

__all__ = [
    "EMPTY_PROMPT",
    "FULL_APART",
    "HAS_IDENT",
    "HAS_DIGEST",
    "HAS_KEY",
    "HAS_RESPONSE",
    "HAS_TOKENS",
    "LOGPROBS_PACKED",
    "MESSAGES_TUPLE",
    "NO_MESSAGES",
    "PREFIX_SPECIAL",
    "RESPONSE_REFS",
    "RESPONSE_SPECIAL",
    "TAIL_ECHO",
    "TAIL_REFS",
    "TAIL_SLOW",
    "TAIL_SPECIAL",
    "SCALAR_NAMES",
    "IndexKeys",
    "LinkKind",
    "Turn",
    "TurnFlag",
    "TurnMeta",
    "TurnSide",
    "MANY_KIDS",
    "Kids",
    "add_child",
    "longer_requests",
    "prompts_from",
    "prompts_of",
    "remove_child",
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
    # derived, never stored: `Turn.data` holds the request's digest (see Turn.digest)
    HAS_DIGEST = 2048
    # `Turn.data` holds an index key that the digest does not give (a file's, see Turn.rkey)
    HAS_KEY = 4096
    # the link kind (`Turn.link`), two bits: a file stores it in a field of its own
    LINK_LOW = 8192
    LINK_HIGH = 16384
    # `Turn.data` holds a response (see Turn.response)
    HAS_RESPONSE = 32768
    # `Turn.data` starts with the turn's packed token ids (the turn is a packed run: see
    # Turn.pack_tokens)
    HAS_TOKENS = 65536
    # derived, never stored: the turn's full run is not its prompt (it sampled ids): a
    # packed turn's is a view over it, another turn's is kept in `after` (see Turn.full)
    FULL_APART = 131072
    # `Turn.data` holds the node id after the packed tokens (see Turn.ident)
    HAS_IDENT = 262144


# The TurnFlag bits as plain ints, defined here once for the code that tests them on every
# turn (this module, request storage, linking): a module global costs about a fifth of an
# enum attribute (measured: 12 ns against 57 for `flags & TurnFlag.X`), and an int operand
# takes no enum type into the arithmetic.
TAIL_REFS: Final = int(TurnFlag.TAIL_REFS)
RESPONSE_REFS: Final = int(TurnFlag.RESPONSE_REFS)
MESSAGES_TUPLE: Final = int(TurnFlag.MESSAGES_TUPLE)
LOGPROBS_PACKED: Final = int(TurnFlag.LOGPROBS_PACKED)
NO_MESSAGES: Final = int(TurnFlag.NO_MESSAGES)
TAIL_ECHO: Final = int(TurnFlag.TAIL_ECHO)
TAIL_SPECIAL: Final = int(TurnFlag.TAIL_SPECIAL)
RESPONSE_SPECIAL: Final = int(TurnFlag.RESPONSE_SPECIAL)
TAIL_SLOW: Final = int(TurnFlag.TAIL_SLOW)
EMPTY_PROMPT: Final = int(TurnFlag.EMPTY_PROMPT)
PREFIX_SPECIAL: Final = int(TurnFlag.PREFIX_SPECIAL)
HAS_DIGEST: Final = int(TurnFlag.HAS_DIGEST)
HAS_KEY: Final = int(TurnFlag.HAS_KEY)
HAS_RESPONSE: Final = int(TurnFlag.HAS_RESPONSE)
HAS_TOKENS: Final = int(TurnFlag.HAS_TOKENS)
FULL_APART: Final = int(TurnFlag.FULL_APART)
HAS_IDENT: Final = int(TurnFlag.HAS_IDENT)
# what `Turn.data` holds before the tail: packed tokens, the node id
_LEAD: Final = HAS_TOKENS | HAS_IDENT


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


T = TypeVar("T")  # a side field's type

_NO_REQUEST = bytes(4)  # no tail, no digest, n_rest 0 (immutable: every new turn starts so)
_KEY_SIZE = 8  # an index key kept in `Turn.data` (unsigned, little-endian)
_U32 = struct.Struct("<I")
_DIGEST_AND_KEY = TurnFlag.HAS_DIGEST | TurnFlag.HAS_KEY
_PARTS_AFTER_TAIL = TurnFlag.HAS_DIGEST | TurnFlag.HAS_KEY | TurnFlag.HAS_RESPONSE
_KEY_AND_RESPONSE = TurnFlag.HAS_KEY | TurnFlag.HAS_RESPONSE
_DIGEST_AND_RESPONSE = TurnFlag.HAS_DIGEST | TurnFlag.HAS_RESPONSE
# bytes after the digest in `Turn.data`, by the HAS_KEY and HAS_RESPONSE bits: the key (if
# any), the response length (if any) and n_rest
_TRAILER = {0: 4, TurnFlag.HAS_KEY: _KEY_SIZE + 4, TurnFlag.HAS_RESPONSE: 8}
_TRAILER[_KEY_AND_RESPONSE] = _KEY_SIZE + 8
_DIGEST_SHIFT = 11  # HAS_DIGEST, and HAS_KEY right above it
# bytes of digest and key in `Turn.data`, by those two flags shifted down
_EXTRA = (0, DIGEST_SIZE, _KEY_SIZE, DIGEST_SIZE + _KEY_SIZE)


def _n_rest_bytes(n_rest: int) -> bytes:
    if not 0 <= n_rest < 1 << 32:
        raise RolloutStoreError(f"a request of {n_rest} messages cannot be stored")
    return n_rest.to_bytes(4, "little")


_LINK_SHIFT = 13  # TurnFlag.LINK_LOW
_LINK_MASK = TurnFlag.LINK_LOW | TurnFlag.LINK_HIGH
_LINK_KINDS = tuple(LinkKind)


class TurnSide:
    """What a turn holds besides its place, its request and its token runs: the scalar
    fields, the shared packed values, the sampled ids and the logprobs (`PACKED` when its
    prompt holds them: see `Turn.pack_tokens`).

    Turns have equal sides, mostly (one model, one session, one system prompt, one tool
    list; sampled ids and logprobs packed in the prompt, or none): the graph interns those at
    commit, and an interned side is `shared` and never changed again (a `Turn` setter copies
    it first).
    """

    __slots__ = (
        "logprobs",
        "meta",
        "requested",
        "sampled",
        "sampling",
        "shared",
        "system",
        "tools",
    )

    def __init__(self) -> None:
        self.meta: TurnMeta | None = None  # interned per graph
        self.system: bytes | None = None  # packed leading system messages, via ValueTable
        self.tools: bytes | None = None
        self.sampling: bytes | None = None
        self.requested: bytes | None = None  # requested_sampling_params
        self.sampled: Any = None  # array | tuple | None
        self.logprobs: Any = None  # array('d') | packed bytes | None
        self.shared = False

    def copy(self) -> TurnSide:
        side = TurnSide()
        side.meta, side.system, side.tools = self.meta, self.system, self.tools
        side.sampling, side.requested = self.sampling, self.requested
        side.sampled, side.logprobs = self.sampled, self.logprobs
        return side

    def same_as(self, other: TurnSide) -> bool:
        """Whether this side holds the very objects `other` holds, and no token ids of its
        own (a packed turn's are in its prompt)."""
        return (
            self.meta is other.meta
            and self.system is other.system
            and self.tools is other.tools
            and self.sampling is other.sampling
            and self.requested is other.requested
            and self.sampled is other.sampled
            and self.logprobs is other.logprobs
            and _no_ids_of_its_own(self.sampled)
            and _no_ids_of_its_own(self.logprobs)
        )

    def sharing_key(self) -> tuple[Any, ...] | None:
        """What makes sides interchangeable, for one without token ids of its own (None: has
        some). Empty token segments are never mutated, so one stands for any of its kind; a
        packed turn's are in its prompt (`PACKED` here)."""
        shape = []
        for segment in (self.sampled, self.logprobs):
            if segment is None:
                shape.append("none")
            elif segment is PACKED:
                shape.append("packed")
            elif type(segment) is array and not segment:
                shape.append(segment.typecode)
            elif type(segment) is tuple and not segment:
                shape.append("tuple")
            else:
                return None
        return (self.meta, self.system, self.tools, self.sampling, self.requested, *shape)


class _SideField(Protocol[T]):
    """What a side property of `Turn` is, for type checkers (see `_side_property`)."""

    @overload
    def __get__(self, turn: None, owner: type | None = None) -> _SideField[T]: ...
    @overload
    def __get__(self, turn: Turn, owner: type | None = None) -> T: ...
    def __set__(self, turn: Turn, value: T) -> None: ...


def _side_property(name: str, doc: str) -> Any:
    """A `Turn` property kept in its side: read at C speed (`attrgetter`), written there after
    copying a shared side."""
    field = getattr(TurnSide, name)  # the slot's descriptor

    def set_(turn: Turn, value: Any) -> None:
        side = turn.side
        if side.shared:
            side = turn.side = side.copy()
        field.__set__(side, value)

    return property(attrgetter(f"side.{name}"), set_, doc=doc)


class _Packed:
    __slots__ = ()

    def __repr__(self) -> str:
        return "PACKED"


#: What a side holds for sampled ids and logprobs that its turn holds packed (see `Turn`).
PACKED: Any = _Packed()


def _no_ids_of_its_own(segment: Any) -> bool:
    """A side's sampled ids or logprobs that other turns may share: none, its turn's prompt's
    (`PACKED`) or an empty segment (never mutated)."""
    return segment is None or segment is PACKED or (type(segment) in (array, tuple) and not segment)


def _unpack(turn: Turn) -> TurnSide:
    """The turn's own side, holding its sampled ids and logprobs: a packed turn's moved there
    from its packed bytes (as fresh arrays), before either changes."""
    side = turn.side
    if side.shared:
        side = turn.side = side.copy()
    if side.sampled is PACKED:
        side.sampled, side.logprobs = turn.sampled_ids(), turn.sampled_logprobs()
    return side


def _token_property(name: str, doc: str) -> Any:
    """A `Turn` token field kept in its side; marked `PACKED` there, it is read from the
    turn's packed bytes (as a fresh array)."""
    field = getattr(TurnSide, name)  # the slot's descriptor
    read = {"sampled": PackedRun.sampled_ids, "logprobs": PackedRun.sampled_logprobs}[name]

    def get(turn: Turn) -> Any:
        value = field.__get__(turn.side)
        if value is PACKED:
            return read(turn)
        return value

    def set_(turn: Turn, value: Any) -> None:
        field.__set__(_unpack(turn), value)

    return property(get, set_, doc=doc)


class Turn(PackedRun):
    """The stored form of a turn: references and packed bytes only.

    Kept small, since a graph holds one per turn (10 slots): the id is derived from the index
    unless the caller chose another (`ident`); a single child is held bare; the link kind is
    two bits of `flags`; the tail, the response, the request's digest, its index key and its
    message count are one bytes object (`data`); the scalar fields, shared values and token
    fields are a
    `TurnSide`, one for every turn alike; its token runs (`prompt`, and `full`: prompt +
    sampled) are its own, so turns alike but for their tokens share a side. All of them read
    and write through properties of the names they had as fields.

    A token turn is its own prompt's chain node: a `PackedRun` packed by `pack_tokens`, its
    new prompt ids, sampled ids and logprobs at the start of `data` (HAS_TOKENS), the run
    before them in `after` (a root's: no new ids, its prompt's run in `after`); so `prompt`
    is the turn itself and neither a node nor a bytes object is kept apart from it. Any
    other turn's prompt run (an `ArrayRun`, another turn's prompt, or None) is kept in
    `after` (or under its full run there: see `full`): such a turn is never a node of a
    chain.
    """

    __slots__ = (
        "base",
        "data",
        "flags",
        "index",
        "kids",
        "parent",
        "side",
    )

    index: int
    parent: Turn | None
    # the children: one bare, a few as a tuple, many as `Kids`
    kids: Turn | tuple[Turn, ...] | Kids | None
    flags: int  # TurnFlag bits, and the link kind
    base: Turn | None  # the turn whose non-system request this one extends
    # packed tokens, tail, response, digest, index key, n_rest (see the properties of those
    # names)
    data: bytes
    side: TurnSide

    def __init__(self) -> None:
        self.data = _NO_REQUEST
        self.flags = 0
        self.kids = None
        self.after = None
        self.side = TurnSide()  # its own until the graph finds one alike (see TurnSide)

    def pack_tokens(
        self, before: TokenRun | None, new: array[int], sampled: Any, logprobs: Any
    ) -> None:
        """Make the turn its own prompt: the tokens of `before`, then `new`, with the sampled
        ids and logprobs packed in it too (`packable` says which fit); its full run is a
        `PackedFull` over it, or itself when nothing was sampled.

        While its side says `PACKED`, its sampled ids and logprobs are the packed ones:
        setting either moves them into a side of its own first, and its tokens are not
        changed after this."""
        if self.flags & HAS_TOKENS:
            raise RolloutStoreError("a turn's prompt is packed once")
        self.data = b"".join((*self.pack(before, new, sampled, logprobs), self.data))
        self.flags |= HAS_TOKENS
        side = self.side
        if side.shared:
            side = self.side = side.copy()
        side.sampled = side.logprobs = PACKED
        if sampled is not None and len(sampled):
            self.flags |= FULL_APART
        else:
            self.flags &= ~FULL_APART

    def _lead_end(self) -> int:
        """Where the tail starts in `data`: after the packed tokens and the node id."""
        flags, data = self.flags, self.data
        at = packed_size(data) if flags & HAS_TOKENS else 0
        if flags & HAS_IDENT:
            at += 4 + _U32.unpack_from(data, at)[0]
        return at

    def _lead(self) -> memoryview:
        """The packed token ids and the node id at the start of `data`, a view (for a turn
        that has either: `_LEAD`)."""
        return memoryview(self.data)[: self._lead_end()]

    @property
    def prompt(self) -> TokenRun | None:
        """The prompt's token run (None: no token ids): the turn itself when packed."""
        flags = self.flags
        if flags & HAS_TOKENS:
            return self
        if flags & FULL_APART:  # `after` holds the full run, over the prompt
            return self.after.prev  # type: ignore[union-attr]
        return self.after  # type: ignore[return-value]

    @prompt.setter
    def prompt(self, run: TokenRun | None) -> None:
        """Set the prompt run of a turn not packed; its full run is that prompt until set."""
        if self.flags & HAS_TOKENS:
            raise RolloutStoreError("a packed turn's prompt is not replaced")
        self.after = run
        self.flags &= ~FULL_APART

    @property
    def full(self) -> TokenRun | None:
        """Prompt + sampled, what a child's prompt extends (the prompt when nothing was
        sampled). No slot holds it (FULL_APART says whether it is the prompt): a packed
        turn's is a `PackedFull` view made here; another turn's is the `ArrayRun` of its
        sampled ids over its prompt, kept in `after` (the prompt is that run's `prev`)."""
        flags = self.flags
        if flags & HAS_TOKENS:
            return PackedFull(self) if flags & FULL_APART else self
        return self.after  # type: ignore[return-value]  # the full run or the prompt

    @full.setter
    def full(self, full: TokenRun | None) -> None:
        """Set the full run: the prompt itself, or (a turn not packed) an `ArrayRun` over the
        prompt, or (a packed turn) the `PackedFull` view over it (see `full_run`)."""
        flags = self.flags
        if flags & HAS_TOKENS:
            if full is self:
                self.flags = flags & ~FULL_APART
            elif type(full) is PackedFull and full.prompt is self:
                self.flags = flags | FULL_APART
            else:
                raise RolloutStoreError("a packed turn's full run is a view over it")
            return
        prompt = self.prompt
        if full is prompt:
            self.after = prompt
            self.flags = flags & ~FULL_APART
        elif type(full) is ArrayRun and full.prev is prompt:
            self.after = full
            self.flags = flags | FULL_APART
        else:
            raise RolloutStoreError("a turn's full run is its prompt, or a run over it")

    @property
    def full_length(self) -> int | None:
        """The tokens of `full` (None: no token ids), read without making a packed turn's
        view."""
        flags = self.flags
        if flags & HAS_TOKENS:
            return packed_full_length(self.data) if flags & FULL_APART else self.length
        full: TokenRun | None = self.after  # type: ignore[assignment]  # the full run or the prompt
        return None if full is None else full.length

    # -- identity, link and children

    @property
    def ident(self) -> str | None:
        """The node id when it is not the default `turn-{index}` (None: the default): kept
        in `data` (its UTF-8 length, then its UTF-8, after the packed tokens), for most turns
        have none and a slot for it would cost each of them 8 bytes."""
        flags = self.flags
        if not flags & HAS_IDENT:
            return None
        data = self.data
        at = packed_size(data) if flags & HAS_TOKENS else 0
        size: int = _U32.unpack_from(data, at)[0]
        return data[at + 4 : at + 4 + size].decode("utf-8", "surrogatepass")

    @ident.setter
    def ident(self, ident: str | None) -> None:
        flags = self.flags
        if ident is None and not flags & HAS_IDENT:
            return
        data = self.data
        start = packed_size(data) if flags & HAS_TOKENS else 0
        view = memoryview(data)
        rest = view[self._lead_end() :]
        if ident is None:
            self.data = b"".join((view[:start], rest))
            self.flags = flags & ~HAS_IDENT
            return
        if type(ident) is not str:
            raise RolloutStoreError(f"a node id is a str, not {type(ident).__name__}")
        text = ident.encode("utf-8", "surrogatepass")
        if len(text) >= 1 << 32:
            raise RolloutStoreError("a node id of 4 GiB or more cannot be stored")
        self.data = b"".join((view[:start], _U32.pack(len(text)), text, rest))
        self.flags = flags | HAS_IDENT

    @property
    def node_id(self) -> str:
        if self.flags & HAS_IDENT:
            return self.ident  # type: ignore[return-value]
        return f"turn-{self.index}"

    @node_id.setter
    def node_id(self, node_id: str) -> None:
        # `index` is set first
        self.ident = None if node_id == f"turn-{self.index}" else node_id

    @property
    def link(self) -> LinkKind:
        """How the turn was linked to its parent."""
        return _LINK_KINDS[(self.flags & _LINK_MASK) >> _LINK_SHIFT]

    @link.setter
    def link(self, link: LinkKind) -> None:
        self.flags = (self.flags & ~_LINK_MASK) | (int(link) << _LINK_SHIFT)

    @property
    def children(self) -> Sequence[Turn] | None:
        """The children in arrival order (read only: `add_child` and `remove_child` change
        them)."""
        kids = self.kids
        if kids is None or isinstance(kids, tuple | Kids):
            return kids
        return (kids,)

    # -- the packed tokens, the request and the response in one bytes object, `data`:
    #    packed tokens (HAS_TOKENS) | tail | response | digest (32, HAS_DIGEST) | key (8,
    #    HAS_KEY: only one the digest does not give) | response length (4, HAS_RESPONSE) |
    #    n_rest (4); integers little-endian

    def _ends(self) -> tuple[int, int]:
        """Where the tail ends and where the response ends (= where the trailer begins)."""
        data, flags = self.data, self.flags
        if flags & HAS_RESPONSE:
            end = len(data) - 8
            size = _U32.unpack_from(data, end)[0]
        else:
            end, size = len(data) - 4, 0
        end -= _EXTRA[(flags & _DIGEST_AND_KEY) >> _DIGEST_SHIFT]
        return end - size, end

    def build(
        self,
        tail_parts: Sequence[bytes | memoryview],
        n_rest: int,
        response: bytes | memoryview | None = None,
        digest: bytes | memoryview | None = None,
        key: int | None = None,
    ) -> None:
        """Set every part of `data` at once, in one copy: the tail (`tail_parts` joined), the
        response (None: none), the request's digest and index key (None: not filed; a key the
        digest gives is not kept twice) and the message count. What add_turn and a file's
        reader call once per turn; the setters below rebuild `data` for one part each."""
        self._store(tail_parts, response, digest, key, _n_rest_bytes(n_rest))

    def _store(
        self,
        tail_parts: Sequence[bytes | memoryview],
        response: bytes | memoryview | None,
        digest: bytes | memoryview | None,
        key: int | None,
        n_rest: bytes | memoryview,
    ) -> None:
        """Build `data` from its parts (views of the old data are copied once, here)."""
        if (
            response is not None
            and type(digest) is bytes
            and len(digest) == DIGEST_SIZE
            and key == int.from_bytes(digest[:_KEY_SIZE], "little")
        ):  # the common case: a fresh turn with a response, filed under its digest's key
            size = len(response).to_bytes(4, "little")
            lead = self._lead() if self.flags & _LEAD else b""
            self.data = b"".join((lead, *tail_parts, response, digest, size, n_rest))
            self.flags = (self.flags & ~_PARTS_AFTER_TAIL) | _DIGEST_AND_RESPONSE
            return
        flags = self.flags & ~_PARTS_AFTER_TAIL
        parts = [self._lead() if flags & _LEAD else b"", *tail_parts]
        if response is not None:
            parts.append(response)
            flags |= HAS_RESPONSE
        if digest is not None:
            if len(digest) != DIGEST_SIZE:  # it would cut the tail short
                raise RolloutStoreError(
                    f"a request digest has {DIGEST_SIZE} bytes, not {len(digest)}"
                )
            parts.append(digest)
            flags |= HAS_DIGEST
        if key is not None and (digest is None or digest_key(bytes(digest)) != key):
            if not 0 <= key < 1 << (8 * _KEY_SIZE):
                raise RolloutStoreError(f"index key {key} is not a 64-bit key")
            parts.append(key.to_bytes(_KEY_SIZE, "little"))
            flags |= HAS_KEY
        if response is not None:
            parts.append(len(response).to_bytes(4, "little"))
        parts.append(n_rest)
        self.data = b"".join(parts)
        self.flags = flags

    def _parts(
        self,
    ) -> tuple[memoryview, memoryview | None, memoryview | None, int | None, memoryview]:
        """tail, response, digest, key and n_rest (views of `data`; a key the digest gives
        is None)."""
        view, flags = memoryview(self.data), self.flags
        tail_end, end = self._ends()
        response = view[tail_end:end] if flags & HAS_RESPONSE else None
        digest = view[end : end + DIGEST_SIZE] if flags & HAS_DIGEST else None
        key = None
        if flags & HAS_KEY:
            start = end + (DIGEST_SIZE if digest is not None else 0)
            key = int.from_bytes(view[start : start + _KEY_SIZE], "little")
        start = self._lead_end() if flags & _LEAD else 0
        return view[start:tail_end], response, digest, key, view[len(view) - 4 :]

    def set_request(self, tail_parts: Sequence[bytes], n_rest: int) -> None:
        """Set the tail (`tail_parts` joined) and `n_rest`; no digest and no key (set them
        afterwards). One copy: the response, if any, comes after."""
        if self.flags & HAS_RESPONSE:
            _, response, _, _, _ = self._parts()
            self._store(tail_parts, response, None, None, _n_rest_bytes(n_rest))
            return
        self.flags &= ~(HAS_DIGEST | HAS_KEY)
        lead = self._lead() if self.flags & _LEAD else b""
        self.data = b"".join((lead, *tail_parts, _n_rest_bytes(n_rest)))

    def file_under(self, key: int | None, digest: bytes | None) -> None:
        """Set the index key and the digest at once (one copy)."""
        flags = self.flags
        if (
            digest is not None
            and not flags & _DIGEST_AND_KEY
            and len(digest) == DIGEST_SIZE
            and key == digest_key(digest)
        ):  # the common case: a fresh turn filed under its digest's key
            data = self.data
            at = len(data) - (8 if flags & HAS_RESPONSE else 4)
            view = memoryview(data)
            self.data = b"".join((view[:at], digest, view[at:]))
            self.flags = flags | HAS_DIGEST
            return
        tail, response, _, _, n_rest = self._parts()
        self._store((tail,), response, digest, key, n_rest)

    @property
    def tail(self) -> bytes:
        """The packed non-system messages after the base's."""
        if self.flags & _LEAD:
            return self.data[self._lead_end() : self._ends()[0]]
        return self.data[: self._ends()[0]]

    @tail.setter
    def tail(self, tail: bytes) -> None:
        _, response, digest, key, n_rest = self._parts()
        self._store((tail,), response, digest, key, n_rest)

    @property
    def response(self) -> bytes | None:
        """The packed response message (None: none)."""
        flags = self.flags
        if not flags & HAS_RESPONSE:
            return None
        data = self.data
        end = len(data) - 8
        start = end - _U32.unpack_from(data, end)[0]
        shift = _EXTRA[(flags & _DIGEST_AND_KEY) >> _DIGEST_SHIFT]
        return data[start - shift : end - shift]

    @response.setter
    def response(self, response: bytes | None) -> None:
        flags = self.flags
        if response is not None and not flags & _PARTS_AFTER_TAIL:
            # the common case: a fresh turn's response, right after its tail (one copy)
            view = memoryview(self.data)
            at = len(view) - 4
            size = len(response).to_bytes(4, "little")
            self.data = b"".join((view[:at], response, size, view[at:]))
            self.flags = flags | HAS_RESPONSE
            return
        tail, _, digest, key, n_rest = self._parts()
        self._store((tail,), response, digest, key, n_rest)

    @property
    def n_rest(self) -> int:
        """The number of non-system request messages."""
        data = self.data
        return _U32.unpack_from(data, len(data) - 4)[0]  # type: ignore[no-any-return]

    @n_rest.setter
    def n_rest(self, n_rest: int) -> None:
        self.data = self.data[:-4] + _n_rest_bytes(n_rest)

    @property
    def digest(self) -> bytes | None:
        """BLAKE3 of the plain packing of the non-system messages; None until known (a turn
        read from a file gets it when a byte comparison first confirms it)."""
        flags = self.flags
        if not flags & HAS_DIGEST:
            return None
        # counted from the end: the digest comes before the key (if any) and the trailer
        data = self.data
        end = len(data) - _TRAILER[flags & _KEY_AND_RESPONSE]
        return data[end - DIGEST_SIZE : end]

    @digest.setter
    def digest(self, digest: bytes | None) -> None:
        tail, response, _, _, n_rest = self._parts()
        self._store((tail,), response, digest, self.rkey, n_rest)

    @property
    def rkey(self) -> int | None:
        """The key its request is filed under (None: not filed): the digest's key, unless
        another was given (a file's)."""
        flags = self.flags
        if not flags & _DIGEST_AND_KEY:
            return None
        data = self.data
        end = len(data) - _TRAILER[flags & _KEY_AND_RESPONSE]  # where the digest ends
        if flags & HAS_KEY:  # the key right after it
            return int.from_bytes(data[end : end + _KEY_SIZE], "little")
        return int.from_bytes(data[end - DIGEST_SIZE : end - DIGEST_SIZE + 8], "little")

    @rkey.setter
    def rkey(self, key: int | None) -> None:
        tail, response, digest, _, n_rest = self._parts()
        self._store((tail,), response, digest, key, n_rest)

    # -- derived from the request's fields (see finish_tail)

    @property
    def first(self) -> int:
        """The first non-system message the tail holds (the base holds those before)."""
        base = self.base
        return base.n_rest if base is not None else 0

    @property
    def body_start(self) -> int:
        """Where in the tail the packed messages after the echo begin."""
        if self.flags & NO_MESSAGES:
            return 0
        return len(array_header(self.n_rest - self.first)) + (
            len(ECHO_PACKED) if self.flags & TAIL_ECHO else 0
        )

    # -- the side: scalar fields, shared values, token fields

    meta: _SideField[TurnMeta] = _side_property("meta", "The scalar fields (interned).")
    system: _SideField[bytes | None] = _side_property("system", "Packed leading system messages.")
    tools: _SideField[bytes | None] = _side_property("tools", "Packed request tools, shared.")
    sampling: _SideField[bytes | None] = _side_property("sampling", "Packed sampling parameters.")
    requested: _SideField[bytes | None] = _side_property(
        "requested", "Packed requested_sampling_params, shared."
    )
    sampled: _SideField[Any] = _token_property("sampled", "Sampled ids: array | tuple | None.")
    logprobs: _SideField[Any] = _token_property("logprobs", "array('d') | packed bytes | None.")

    def share_values(
        self, tools: bytes | None, sampling: bytes | None, requested: bytes | None
    ) -> None:
        """Set tools, sampling and requested at once."""
        side = self.side
        if side.shared:
            side = self.side = side.copy()
        side.tools, side.sampling, side.requested = tools, sampling, requested


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
    sampled = turn.side.sampled
    if sampled is PACKED:  # counted in its packed head: no array made to be measured
        return turn.n_sampled > 0
    return sampled is not None and len(sampled) > 0


def finish_tail(turn: Turn) -> None:
    """Derive what the byte comparison of a tail needs from the stored fields."""
    base = turn.base
    echo = turn.flags & TAIL_ECHO
    slow = turn.flags & (TAIL_REFS | TAIL_SPECIAL) or (
        echo and (base is None or base.flags & (RESPONSE_REFS | RESPONSE_SPECIAL))
    )
    special = (
        turn.flags & TAIL_SPECIAL
        or (echo and base is not None and base.flags & RESPONSE_SPECIAL)
        or (base is not None and base.flags & PREFIX_SPECIAL)
    )
    derived = TAIL_SLOW | PREFIX_SPECIAL
    turn.flags = (
        (turn.flags & ~derived) | (TAIL_SLOW if slow else 0) | (PREFIX_SPECIAL if special else 0)
    )


def full_run(prompt: TokenRun | None, sampled: Any) -> TokenRun | None:
    """The run a child's prompt extends: prompt + sampled (the prompt itself if none)."""
    return ArrayRun(prompt, sampled) if sampled is not None and len(sampled) else prompt


#: A turn with more children than this keeps them as `Kids`.
MANY_KIDS = 8

_index_of = attrgetter("index")


def _insert(kids: list[Turn], kid: Turn) -> None:
    """Insert `kid` into a list kept in arrival order (mostly: appended)."""
    if not kids or kids[-1].index < kid.index:
        kids.append(kid)
    else:
        kids.insert(bisect_right(kids, kid.index, key=_index_of), kid)


def _ungroup(groups: dict[int, list[Turn]], length: int, kid: Turn) -> None:
    group = groups[length]
    group.remove(kid)
    if not group:
        del groups[length]


class Kids(list["Turn"]):
    """The children of a turn that has many, in arrival order, grouped by the length of their
    requests (`n_rest`) and of their prompts: linking a new child visits only the siblings
    whose lengths let them continue it, so a call sampled thousands of times at one step of a
    conversation costs each sample the same. Lengths never change once a turn is a child."""

    __slots__ = ("by_prompt", "by_rest")

    def __init__(self, kids: Sequence[Turn]) -> None:
        super().__init__()
        self.by_rest: dict[int, list[Turn]] = {}
        self.by_prompt: dict[int, list[Turn]] = {}
        for kid in kids:
            self.add(kid)

    def add(self, kid: Turn) -> None:
        _insert(self, kid)
        _insert(self.by_rest.setdefault(kid.n_rest, []), kid)
        prompt = kid.prompt
        if prompt is not None:
            _insert(self.by_prompt.setdefault(prompt.length, []), kid)

    def discard(self, kid: Turn) -> None:
        prompt = kid.prompt
        _ungroup(self.by_rest, kid.n_rest, kid)
        if prompt is not None:
            _ungroup(self.by_prompt, prompt.length, kid)
        self.remove(kid)

    def longer_requests(self, n_rest: int) -> list[Turn]:
        """The children whose requests hold more than `n_rest` messages, in arrival order."""
        found = [kid for n, group in self.by_rest.items() if n > n_rest for kid in group]
        return sorted(found, key=_index_of) if len(self.by_rest) > 1 else found

    def prompts_from(self, length: int) -> list[Turn]:
        """The children whose prompts hold at least `length` tokens, in arrival order."""
        found = [kid for n, group in self.by_prompt.items() if n >= length for kid in group]
        return sorted(found, key=_index_of) if len(self.by_prompt) > 1 else found

    def prompts_of(self, length: int) -> list[Turn]:
        """The children whose prompts hold exactly `length` tokens, in arrival order."""
        return self.by_prompt.get(length, [])


def longer_requests(parent: Turn, n_rest: int) -> Sequence[Turn]:
    """The children of `parent` that may hold more than `n_rest` request messages (all of a
    few: the caller checks each)."""
    kids = parent.kids
    if type(kids) is Kids:
        return kids.longer_requests(n_rest)
    return parent.children or ()


def prompts_from(parent: Turn, length: int) -> Sequence[Turn]:
    """The children of `parent` that may have prompts of at least `length` tokens (all of a
    few: the caller checks each)."""
    kids = parent.kids
    if type(kids) is Kids:
        return kids.prompts_from(length)
    return parent.children or ()


def prompts_of(parent: Turn, length: int) -> Sequence[Turn]:
    """The children of `parent` that may have prompts of exactly `length` tokens."""
    kids = parent.kids
    if type(kids) is Kids:
        return kids.prompts_of(length)
    return parent.children or ()


def _siblings(kids: Turn | tuple[Turn, ...]) -> tuple[Turn, ...]:
    return kids if isinstance(kids, tuple) else (kids,)


def add_child(parent: Turn, child: Turn) -> None:
    """Add `child` to the children of `parent`, kept in arrival order."""
    kids = parent.kids
    if kids is None:
        parent.kids = child
    elif isinstance(kids, Kids):
        kids.add(child)
    else:
        siblings = _siblings(kids)
        if len(siblings) >= MANY_KIDS:
            parent.kids = Kids((*siblings, child))  # (sorted by `add`)
        elif siblings[-1].index < child.index:
            parent.kids = (*siblings, child)
        else:
            parent.kids = tuple(sorted((*siblings, child), key=_index_of))


def remove_child(parent: Turn, child: Turn) -> None:
    """Take `child` out of the children of `parent` (it moves under another turn)."""
    kids = parent.kids
    if kids is None:
        return
    if isinstance(kids, Kids):
        kids.discard(child)
        if len(kids) > MANY_KIDS:
            return
        rest = tuple(kids)
    else:
        rest = tuple(c for c in _siblings(kids) if c is not child)
    parent.kids = rest[0] if len(rest) == 1 else (rest or None)


def seg_list(seg: Any) -> list[int] | None:
    """A stored token segment as a fresh list (None stays None)."""
    if seg is None:
        return None
    return seg.tolist() if isinstance(seg, array) else list(seg)

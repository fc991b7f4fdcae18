"""Request storage: a turn's messages as an earlier turn's request plus a packed tail.

Fresh messages are packed at C speed and compared byte for byte with what is stored; only new
content takes the validating walk. Shared values (system messages, tools, sampling parameters)
are stored once per graph.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from operator import attrgetter
from typing import Any, Final

import msgpack
import xxhash

from .._core import Blake3, Packer, PendingTip, RequestTable, Unconfirmed
from ..errors import InvalidValueError
from ..model.nodes import TurnNode
from ..model.raw import RawJSON, decode_array, decode_raw, resolve_raw, utf8_text
from .blobs import BlobTable
from .confirm import (
    HOLE_MIN,
    Hole,
    RawTip,
    RawTips,
    array_items,
    digest_key,
    holes_of,
    hollow_text,
    prefix_digest,
    raw_end,
    text_holes,
)
from .encoding import (
    ECHO_PACKED,
    array_header,
    no_echo,
    unpack,
)
from .index import NOT_YET, SMALL, index_add, index_members, index_remove
from .intake import MAX_DEPTH, Encoder
from .materialize import Messages, rest_values, value
from .messages import leading_system_count, link_key, response_link_key
from .stored import (
    HAS_RESPONSE,
    MESSAGES_TUPLE,
    NO_MESSAGES,
    RESPONSE_REFS,
    RESPONSE_SPECIAL,
    TAIL_ECHO,
    TAIL_REFS,
    TAIL_SLOW,
    TAIL_SPECIAL,
    IndexKeys,
    LinkKind,
    Turn,
    TurnFlag,
    finish_tail,
)
from .turn_records import RemoteTurn, echo_by_key
from .values import ValueTable

__all__ = ["FreshRequest", "RequestStore", "Scratch"]


_new_tuple: Final = tuple.__new__

#: Strings this long are never a decoded tip's holes: a graph whose long strings are not
#: its own blobs (no share threshold, or a content store's blob table) keeps no decoded tips,
#: which would hold strings the graph does not.
_NO_HOLES: Final = 1 << 62

#: msgpack type bytes of ext and bin values, which JSON values never pack to by themselves
_NOT_JSON = bytes((*range(0xC4, 0xCA), *range(0xD4, 0xD9)))


#: The one thing a refusing unpack (`_refusing_unpack`) lets through: an empty bin
_EMPTY_BIN = b"\xc4\x00"
_BIN8 = b"\xc4"  # its type byte: looked for first (one byte is a memchr, two are not)


def _no_empty_bin(data: bytes) -> bool:
    """Whether `data` holds no empty bin's bytes (`_EMPTY_BIN not in data`, mostly faster)."""
    return _BIN8 not in data or _EMPTY_BIN not in data


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError("an ext type")


#: Unpack at C speed, refusing every ext type and every non-empty bin: ext types with data by
#: their length (msgpack's timestamps too, which never reach the hook), empty ones by the hook.
#: Strings stay bytes: their UTF-8 is the packer's, and not decoding them halves the time. (A
#: partial, not a function: one Python call fewer on every turn.)
_refusing_unpack: Final = functools.partial(
    msgpack.unpackb,
    max_bin_len=0,
    max_ext_len=0,
    ext_hook=_refuse_ext,
    strict_map_key=False,
    raw=True,
)


#: Packings shorter than this are unpacked at once, not scanned first: the scan costs about
#: what the unpack does there, and short messages often hold those bytes anyway (a string of
#: 196-201 bytes has one as its length: measured 0.5 us a scan, 0.55 an unpack of 1 KB)
_SCAN_FROM = 4096


def _json_only(plain: bytes) -> bool:
    """Whether a plain packing holds no ext and no bin type (JSON values never pack to them:
    a tuple, a big int, `bytes` or a caller's `msgpack.ExtType` does).

    In a long packing the bytes that begin those types are looked for first; where some
    occur (often a length byte or a letter, not a type), and in a short one at once, unpacking
    at C speed tells, refusing every ext type and every non-empty bin; the bytes of an empty
    bin anywhere send the value to the walk.
    """
    if len(plain) >= _SCAN_FROM and len(plain.translate(None, _NOT_JSON)) == len(plain):
        return True  # none of them (a C scan)
    try:
        _refusing_unpack(plain)
    except Exception:  # an ext or bin type (or too deep for the unpacker): the walk decides
        return False
    return _no_empty_bin(plain)


#: msgpack type bytes of containers (fixmap, fixarray, array 16/32, map 16/32): a packing
#: holds at least as many of these bytes as its containers nest deep (as data bytes too)
_CONTAINER_BYTES = bytes((*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF))


def _long_string_types(threshold: int | None) -> bytes | None:
    """The msgpack type bytes of the strings that can hold `threshold` bytes or more (any
    string of `threshold` characters or more, which the validating walk makes a blob, packs
    under one of them); None when a fixstr can (threshold below 32: no scan tells).
    No threshold: no string is ever a blob."""
    if threshold is None:
        return b""
    if threshold > 0xFFFF:
        return b"\xdb"  # str32
    if threshold > 0xFF:
        return b"\xda\xdb"  # str16, str32
    if threshold > 31:
        return b"\xd9\xda\xdb"  # str8 too
    return None


def _walk_free(plain: bytes, long_types: bytes | None) -> bool:
    """Whether a plain packing of any length is what the validating walk would build (as
    `_json_only` tells of a short one): no byte that begins a long string's type
    (`long_types`, see `_long_string_types`: so no string the walk makes a blob), no ext or
    bin type, and fewer container type bytes than MAX_DEPTH (so no nesting that deep). Each
    is a byte scan at C speed; a byte that only looks like one (a length, a letter) sends
    the value to the walk, which decides."""
    if long_types is None:
        return False
    for byte in long_types:  # mostly found at once where a long string is (memchr)
        if byte in plain:
            return False
    size = len(plain)
    if len(plain.translate(None, _NOT_JSON)) != size:
        return False
    return size - len(plain.translate(None, _CONTAINER_BYTES)) < MAX_DEPTH


def _built_as_is(plain: bytes, limit: int, long_types: bytes | None) -> bool:
    """Whether the validating walk would build exactly `plain`, so it is skipped: a short
    packing (below `limit`) by `_json_only`, a longer one by `_walk_free`."""
    return _json_only(plain) if len(plain) < limit else _walk_free(plain, long_types)


def _all_json(plains: Sequence[bytes | None], limit: int) -> bool:
    """Whether every plain packing is shorter than `limit` and holds no ext and no bin type
    (`_json_only` of each, in one pass: a few C calls for all)."""
    if not plains:
        return True
    if None in plains or max(map(len, plains)) >= limit:  # type: ignore[arg-type]
        return False
    header = array_header(len(plains))
    # each packing is one whole item: as an array they unpack item by item
    data = b"".join((header, *plains))  # type: ignore[arg-type]
    start = len(header)
    if len(data) - start >= _SCAN_FROM and len(data.translate(None, _NOT_JSON)) == len(data):
        return True  # none of them, header included (a C scan)
    try:
        _refusing_unpack(data)
    except Exception:
        return False
    # (`_no_empty_bin` of the packings, after the header)
    return data.find(_BIN8, start) < 0 or data.find(_EMPTY_BIN, start) < 0


_NOT_FAST = object()  # _prepare_raw: decode the whole text instead

#: A latest turn whose request `_continuation` leaves to the usual path: its prefix or its
#: response needs more than bytes compared, or it has no messages
_NOT_CONTINUED: Final = (
    TurnFlag.NO_MESSAGES
    | TurnFlag.PREFIX_SPECIAL
    | TurnFlag.RESPONSE_REFS
    | TurnFlag.RESPONSE_SPECIAL
    | TurnFlag.MESSAGES_TUPLE
)

#: The longest chain of bases walked to find the long strings of a request (`_chain_holes`).
_MAX_CHAIN = 4096
#: The turns of a chain `_long_blobs` walks at most (see there).
_RAW_HOLES_CHAIN = 64


def _has_ext(packed: bytes) -> bool:
    """Whether a stored packing may hold an ext type (a blob reference): a quick filter."""
    return len(packed.translate(None, _NOT_JSON)) != len(packed)


#: Raw texts of shared values remembered per graph (the least recently used is dropped first).
MAX_RAW_SHARED = 16
#: Longer raw texts are never remembered: a graph keeps each long string once, and a kept
#: text would be a second copy of what it stands for; decoding such a text again is cheap
#: next to its size.
MAX_RAW_SHARED_TEXT = 16 * 1024


class Scratch:
    """What add_turn works out before committing a turn; dropped afterwards."""

    __slots__ = (
        "full_data",
        "message_parent",
        "moves",
        "n_rest",
        "pending",
        "prompt_key",
        "raw_found",
        "raw_seen",
        "raw_text",
        "raw_tip",
        "request",
        "request_digest",
        "request_sum",
        "root_keys",
        "tail_parts",
        "token_key",
        "token_parent",
        "twins",
    )

    def __init__(self) -> None:
        self.pending: list[tuple[bytes, bytes]] = []
        # raw texts of shared values the graph holds, remembered at commit (`remember_raw`):
        # remembered earlier, one could push out a text this very turn was taken by
        self.raw_seen: list[tuple[bytes | str, Any, int | None]] = []
        self.token_parent: Turn | None = None
        self.full_data: bytes | None = None  # prompt + sampled as array('I') bytes
        self.token_key: int | None = None  # block digest of prompt+sampled at its last block
        self.prompt_key: int | None = None
        self.message_parent: Turn | None = None
        self.request_digest: int | None = None  # the request's index key
        self.request_sum: bytes | None = None  # its digest, when known without `request`
        # the stored request, built into the turn once with its response (see `build`)
        self.tail_parts: Sequence[bytes] = (b"",)
        self.n_rest = 0
        # keys of this request's shorter prefixes, under which it waits as a message root
        # for an earlier turn that arrives late
        self.root_keys: list[int] | None = None
        self.request: FreshRequest | None = None  # its non-system messages, if any
        self.raw_tip: tuple[RawTip, RawTip | None] | None = None  # filed at commit
        # a raw text decoded whole: its tip is made once its long strings are known
        self.raw_text: tuple[bytes, int, Any, bytes | None, int] | None = None
        # the raw tip such a text continues (found, but not taken by `_prepare_raw`): its
        # tip replaces that one, as a turn taken there replaces the tip it continues
        self.raw_found: RawTip | None = None
        self.twins = False  # stored turns with exactly this request have children a twin may take
        self.moves: list[tuple[Turn, LinkKind]] = []  # earlier turns it adopts

    def keys(self) -> IndexKeys:
        keys = (self.request_digest, self.token_key, self.prompt_key, self.root_keys)
        return _new_tuple(IndexKeys, keys)  # IndexKeys(*keys) without its Python-level __new__


class FreshRequest:
    """The non-system messages of a request being added, its base as the graph's request
    table found it, and which stored requests it was found to extend (each checked once,
    however many questions ask).

    The table packs the messages in one walk and finds the base by the BLAKE3 digests of the
    packings at the boundaries where filed requests end (`RequestTable.find_messages`): the
    packings before the base's message count are not kept, since the stored tail holds only
    those after it; a question about an earlier boundary (linking off the common path) packs
    them then. A request with a message that does not pack plainly is found by the packings
    before that message. A turn read from a file is known by its key alone: the table asks
    (`Unconfirmed`), its stored tails are compared byte for byte, and it is confirmed or
    refuted.
    """

    __slots__ = (
        "_confirmed",
        "_digests",
        "_first",
        "_plains",
        "_prefixes",
        "_store",
        "base",
        "base_len",
        "full_digest",
        "messages",
        "n_valid",
        "tip",
        "unique",
    )

    def __init__(
        self,
        store: RequestStore,
        messages: Messages,
        found: tuple[int, list[bytes], Any, PendingTip | None] | None,
    ) -> None:
        """`found`: what `RequestStore.find` found of `messages` (None: one does not pack
        plainly)."""
        self._store = store
        self.messages = messages
        self._confirmed: dict[int, bool] = {}
        self._prefixes: dict[int, list[Turn] | tuple[Turn, ...]] | None = None
        self._digests: dict[int, bytes] = {}
        turns = store.turns
        plains: list[bytes | None]
        base_found: tuple[int | None, int, bool, bytes]
        self.tip: PendingTip | None = None  # the decoded tip it leaves, filed with it
        if found is not None:
            first, packed, base_found, self.tip = found
            plains = packed  # type: ignore[assignment]
            self.n_valid = len(messages)
        else:  # a message the walk must judge
            first = 0
            plains = [store.plain(m) for m in messages]
            # the messages before the first without a plain packing (only those can match)
            self.n_valid = plains.index(None) if None in plains else len(plains)
            base_found = store.find_plains(plains[: self.n_valid], messages)  # type: ignore[arg-type]
        self._first = first
        self._plains = plains
        base_no, base_len, _, digest = base_found
        self.base: Turn | None = None if base_no is None else turns[base_no]
        self.base_len = base_len
        self._digests[self.n_valid] = digest
        self.full_digest: bytes | None = digest if self.n_valid == len(messages) else None
        if base_no is not None:
            self._confirmed[base_no] = True
            self._digests[base_len] = store.table.digest(base_no) or b""
        # no filed request is this very one: no twins
        self.unique = base_len < self.n_valid or self.base is None

    def _all(self) -> list[bytes | None]:
        """The plain packings of every message (those before the base's packed now)."""
        first = self._first
        if first:
            pack = self._store.plain
            self._plains[:0] = [pack(m) for m in self.messages[:first]]
            self._first = 0
        return self._plains

    def plain(self, i: int) -> bytes | None:
        """The plain packing of message `i` (None when it has none)."""
        first = self._first
        if i >= first:
            return self._plains[i - first]
        return self._all()[i]

    def plain_slice(self, start: int, stop: int) -> list[bytes | None]:
        """The plain packings of messages `start` to `stop` (None for one that has none)."""
        first = self._first
        if start >= first:
            return self._plains[start - first : stop - first]
        return self._all()[start:stop]

    def plains(self) -> list[bytes | None]:
        return self._all()

    def digest_at(self, n: int) -> bytes:
        """The digest of the first `n` messages (n <= n_valid)."""
        digest = self._digests.get(n)
        if not digest:
            digest = prefix_digest(b"".join(self.plain_slice(0, n)))  # type: ignore[arg-type]
            self._digests[n] = digest
        return digest

    def key(self, n: int) -> int:
        """The index key of the first `n` messages (n <= n_valid)."""
        return digest_key(self.digest_at(n))

    def confirmed(self, stored: Turn) -> None:
        """Note that this request is known to extend `stored` (see `extends`)."""
        self._confirmed[stored.index] = True

    def extends(self, stored: Turn) -> bool:
        """Whether this request starts with exactly the non-system request of `stored`."""
        confirmed = self._confirmed
        ok = confirmed.get(stored.index)
        if ok is not None:
            return ok
        n = stored.n_rest
        digest = self._store.table.digest(stored.index)
        if n > self.n_valid:
            ok = False
        elif digest is not None:
            ok = digest == self.digest_at(n)
        else:  # compare bytes with the stored tails (a turn read from a file, once)
            ok = self._store.matches(stored, self.plains(), self.messages)
            if ok:
                self._store.confirm(stored, self.digest_at(n))
        confirmed[stored.index] = ok
        return ok

    def twins(self) -> bool:
        """Whether stored turns filed under this request's key have children a twin may
        take (not confirmed: `Linker._twin_moves` finds and confirms them)."""
        if self.unique or self.n_valid != len(self.messages):
            return False
        return self._store.twins(self.key(self.n_valid))

    def _prefix_map(self) -> dict[int, list[Turn] | tuple[Turn, ...]]:
        found = self._prefixes
        if found is None:
            store = self._store
            turns = store.turns
            plains = self.plain_slice(0, self.n_valid)
            found = {}
            # (two turns at most a boundary: several are a group, which holds them all)
            for n, digest, numbers in store.table.prefixes(plains, most=2):  # type: ignore[arg-type]
                self._digests[n] = digest
                found[n] = store.group_of([turns[t] for t in numbers])
            self._prefixes = found
        return found

    def boundaries(self, high: int) -> Iterable[int]:
        """Message counts from `high` down to 0 where a filed request ends that this one may
        extend, longest first."""
        return [n for n in self._prefix_map() if n <= high]

    def stored_prefixes(self, n: int) -> list[Turn] | tuple[Turn, ...]:
        """Stored turns whose non-system request may be the first `n` messages (a turn read
        from a file is not confirmed yet: see `extends`)."""
        return self._prefix_map().get(n, ())

    def root_keys(self) -> list[int]:
        """Keys of every shorter prefix, the empty one too (a root waits under them)."""
        return RequestTable.keys(self.plain_slice(0, self.n_valid))[:-1]  # type: ignore[arg-type]

    def digest(self) -> bytes | None:
        """The digest of the whole request, when every message has a plain packing."""
        return self.full_digest


class _Bucket(list[Turn]):
    """Turns filed under one request key (identical requests, barring a collision), and
    those of them that have had children, so twins are found without a scan.

    A large bucket (a group of rollouts sampled from one request) also holds its turns by
    their responses, made at its first lookup (`RequestStore.echo_candidates`): a
    continuation finds the sample whose response it echoes without comparing every one."""

    __slots__ = ("by_response", "loose", "parents")

    def __init__(self, turns: tuple[Turn, ...]) -> None:
        super().__init__(turns)
        self.parents: list[Turn] = []
        self.by_response: dict[Any, Any] | None = None
        # its turns' children linked to them by a loose echo (the only ones a twin may take:
        # see `Linker._twin_moves`), made at the first lookup of twins, then kept current
        self.loose: dict[int, Any] | None = None  # by the xxh3 of the echo


#: Where a bucket's turns whose responses are kept in a store are held by response: always
#: candidates (their responses are not fetched to be held by them).
_UNKEYED: Final = ("unkeyed",)


_index_of = attrgetter("index")


def _frozen(value: Any) -> Any:
    """A hashable stand-in for a link key, equal where the keys are equal (`==`)."""
    if isinstance(value, dict):
        return ("dict", frozenset((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("list", tuple(_frozen(v) for v in value))
    if isinstance(value, tuple):
        return ("tuple", tuple(_frozen(v) for v in value))
    return value


class _NoRawTips(RawTips):
    """The raw tips of a graph that has kept none yet: one object for every such graph (its
    dicts would cost 248 bytes a graph, a capture session), never changed: a graph makes its
    own before it adds a tip."""

    __slots__ = ()

    def add(self, tip: RawTip, replaces: RawTip | None) -> None:
        raise AssertionError("the shared empty raw tips are never changed")


_NO_RAW_TIPS: Final = _NoRawTips()


class RequestStore:
    """The request messages, responses and shared values of a graph's turns.

    Owns the packers, the shared-value table and the index of stored requests; rebuilds
    what it stores. Not thread-safe: the graph uses it under its lock.
    """

    __slots__ = (
        "_encoder",
        "_long_types",
        "_plain_limit",
        "_plain_packer",
        "_tipped",
        "blobs",
        "groups",
        "raw_shared",
        "raw_tips",
        "table",
        "turns",
        "values",
    )

    def __init__(self, blobs: BlobTable, share_threshold: int | None, turns: list[Turn]) -> None:
        self.blobs = blobs
        # the plain packer (the engine's canonical packing: every string inline), made at
        # first use (`_packer`) and let go after each turn by `reset_packer`: a graph keeps
        # no packer or buffer between turns
        self._plain_packer: Packer | None = None
        self._encoder = Encoder(blobs, share_threshold)
        # over an out-of-process store: values holding blob references are matched by the
        # SHA-256 of their plain packings, never by fetching (requests by their digests)
        self.values = ValueTable(self.expand, share_threshold, hashed=blobs.fetches)
        # the graph's turns (its own list), which the table names by their numbers
        self.turns = turns
        # every filed request: the one index and base-finder (a request is filed under its
        # digest; a turn read from a file under its key until it is confirmed)
        # (a decoded tip holds a conversation's long strings, those of the request that first
        # held them: the blobs of a graph's own table, which interned them from it. Graphs
        # over one store share one object of a string that each got from its own requests:
        # their tips would hold a copy each, so they keep none; see `_NO_HOLES`)
        holes = (
            share_threshold if share_threshold is not None and type(blobs) is BlobTable else None
        )
        self.table = RequestTable(hole_min=_NO_HOLES if holes is None else holes)
        self._tipped = holes is not None
        # keys under which several turns are filed (twins, the samples of a group), with
        # what linking keeps of them (a dict at the first one)
        self.groups: dict[int, _Bucket] = NOT_YET
        # plain packings shorter than this can hold no blob and no nesting beyond MAX_DEPTH
        self._plain_limit = min(share_threshold or MAX_DEPTH, MAX_DEPTH)
        # longer ones, where they hold no long string's type byte (see `_walk_free`)
        self._long_types = _long_string_types(share_threshold)
        # the latest raw turns, for raw continuations (the graph's own at the first one)
        self.raw_tips: RawTips = _NO_RAW_TIPS
        # raw texts of shared values (tools, sampling parameters) the graph holds, and their
        # stored form and item count: a capture server re-sends the same tools text each
        # call, taken then without decoding or packing it (`shared_value`)
        # (a dict at the first one)
        self.raw_shared: dict[bytes | str, tuple[Any, int | None]] = NOT_YET

    def add_raw_tip(self, tip: RawTip, replaces: RawTip | None) -> None:
        """Keep a committed raw turn as a tip (see `RawTips.add`)."""
        if self.raw_tips is _NO_RAW_TIPS:
            self.raw_tips = RawTips()
        self.raw_tips.add(tip, replaces)

    def reset_packer(self) -> None:
        """Let the packers go (a turn is done): the next use makes new ones."""
        self._plain_packer = None
        self._encoder.release()

    def _packer(self) -> Packer:
        """The plain packer, made at first use since the last `reset_packer`."""
        packer = self._plain_packer
        if packer is None:
            packer = self._plain_packer = Packer(None, None)
        return packer

    @property
    def buckets(self) -> int:
        """Keys under which several turns are filed."""
        return len(self.groups)

    def drop_caches(self) -> None:
        """Let go of the tips, decoded (the table's) and raw (a compact BLAKE3 state, a few
        hundred bytes, each), and of the raw texts of shared values remembered
        (`raw_shared`): they only spare the next turn hashing again what it re-sends, or
        decoding a tool list again."""
        self.table.drop_tips()
        self.raw_tips = _NO_RAW_TIPS
        self.raw_shared = NOT_YET

    # ------------------------------------------------------------------ the table

    def find(self, messages: list[Any]) -> tuple[int, list[bytes], Any, PendingTip | None]:
        """`RequestTable.find_tipped` of non-system messages (the decoded tip the request
        leaves, filed with it at commit), a turn read from a file that the table asks about
        compared byte for byte and confirmed or refuted."""
        table, packer = self.table, self._packer()
        refuted: list[int] = []
        while True:
            try:
                if self._tipped:
                    return table.find_tipped(packer, messages, refuted=refuted)
                return (*table.find_messages(packer, messages, refuted=refuted), None)
            except Unconfirmed as ask:
                self._decide(ask, messages, [self.plain(m) for m in messages], refuted)

    def _found(self, messages: Messages) -> tuple[int, list[bytes], Any, PendingTip | None] | None:
        """`find` of non-system messages; None when one of them does not pack plainly (the
        validating walk judges it)."""
        try:
            return self.find(messages if type(messages) is list else list(messages))
        except (ValueError, TypeError, RecursionError):
            return None

    def find_plains(
        self, plains: list[bytes], messages: Messages
    ) -> tuple[int | None, int, bool, bytes]:
        """`RequestTable.find` of the packings of a request's first messages (those before
        one that does not pack plainly), as `find`."""
        refuted: list[int] = []
        while True:
            try:
                return self.table.find(plains, refuted=refuted)
            except Unconfirmed as ask:
                self._decide(ask, messages, plains, refuted)  # type: ignore[arg-type]

    def _decide(
        self, ask: Unconfirmed, messages: Messages, plains: list[bytes | None], refuted: list[int]
    ) -> None:
        """Compare the turn the table asks about with the request's messages; confirm it or
        refute it."""
        number, digest = ask.args[1], ask.args[3]
        stored = self.turns[number]
        if self.matches(stored, plains, messages):
            self.confirm(stored, digest)
        else:
            refuted.append(number)

    def confirm(self, stored: Turn, digest: bytes) -> None:
        """A turn read from a file (filed by its key) was found to be the request whose
        digest is `digest`: found by it from now on (the table keeps it)."""
        self.table.confirm(stored.index, digest)

    def group_of(self, members: list[Turn]) -> list[Turn] | _Bucket:
        """The turns filed alike at a boundary, given the first two (or the one) of them:
        several are the group filed under their key, which holds them all and their links
        (a turn under that key that is not filed alike is refused by `extends`)."""
        if len(members) > 1 and self.groups:
            group = self.groups.get(members[0].rkey)  # type: ignore[arg-type]
            if group is not None:
                return group
        return members

    # ------------------------------------------------------------------ intake

    def encode(self, value: Any, path: str) -> tuple[bytes, bool]:
        """The stored packing of a fresh value and whether it holds forgeable ext types."""
        return self._encoder.encode(value, path)

    def stored_form(self, value: Any, plain: bytes | None, path: str) -> tuple[bytes, bool]:
        """`encode(value, path)`, taking the plain packing as it is where it must be equal.

        A plain packing that is short (no string long enough to be a blob, no nesting as deep
        as MAX_DEPTH) and holds no ext or bin type (no tuple, big int, bytes or caller's
        `msgpack.ExtType`) is what the validating walk would build: the walk is skipped.
        """
        if plain is not None and _built_as_is(plain, self._plain_limit, self._long_types):
            return plain, False
        return self._encoder.encode(value, path)

    def encode_response(self, value: Any, turn: Turn) -> bytes | None:
        if value is None:
            return None
        try:
            plain: bytes | None = self._packer().pack(value)
        except ValueError:  # the validating walk says what is wrong
            plain = None
        packed, special = self.stored_form(value, plain, "response_message")
        if packed is plain:
            return packed
        if self._encoder.last_refs:  # else the packing is the plain one, nothing to expand
            turn.flags |= RESPONSE_REFS
        if special:
            turn.flags |= RESPONSE_SPECIAL
        return packed

    def _shared(
        self,
        items: Messages,
        path: str,
        plains: list[bytes | None],
        pending: list[tuple[bytes, bytes]],
        as_array: bool,
    ) -> bytes:
        """Items packed (as one array, or the single item), stored once per graph.

        Found again by the plain packing. Values holding tuples, big ints or lone surrogates
        are never shared this way, so a hit can never be imitated by a caller's own
        `msgpack.ExtType` objects.
        """
        header = array_header(len(items)) if as_array else b""
        plain = None if None in plains else header + b"".join(plains)  # type: ignore[arg-type]
        if plain is not None:
            found = self.values.find(plain)
            if found is None:
                found = next((stored for p, stored in pending if p == plain), None)
            if found is not None:
                return found
        # (`stored_form`: a short plain packing of JSON values is what the walk would build)
        if as_array:
            form = self.stored_form
            packed = [form(item, plains[i], f"{path}[{i}]") for i, item in enumerate(items)]
        else:
            packed = [self.stored_form(items[0], plains[0], path)]
        stored = header + b"".join(b for b, _ in packed)
        if plain is not None and not any(special for _, special in packed):
            if stored == plain:  # no blob references: other graphs may share it
                stored = self.blobs.share_packed(stored)
            pending.append((plain, stored))
        return stored

    def shared_value(
        self,
        value: Any,
        path: str,
        pending: list[tuple[bytes, bytes]],
        given: Any = None,
        seen: list[tuple[bytes | str, Any, int | None]] | None = None,
    ) -> Any:
        """The stored form of a shared value (found, or stored once at commit). `given` is
        the field as the caller gave it: when `RawJSON` and the graph holds its value, its
        text is added to `seen` (remembered at commit: `remember_raw`), and a text
        remembered so (`raw_shared`) stands for its value."""
        if value is None:
            return None
        if type(value) is RawJSON:  # a text remembered so (see `raw_shared`)
            stored, n_items = self.raw_shared[value.data]
            if seen is not None:  # used again: remembered anew at commit, so kept longest
                seen.append((value.data, stored, n_items))
            return stored
        plain = self.plain(value)
        if plain is not None:  # the common case first: a value the graph holds already
            found = self.values.find(plain)
            if found is not None:
                if (
                    type(given) is RawJSON
                    and seen is not None
                    and len(given.data) <= MAX_RAW_SHARED_TEXT
                ):
                    seen.append((given.data, found, len(value) if type(value) is list else None))
                return found
        return self._shared([value], path, [plain], pending, as_array=False)

    def remember_raw(self, seen: list[tuple[bytes | str, Any, int | None]]) -> None:
        """Remember each JSON text of `seen` as the stored shared value it decoded to (one
        committed before, so byte for byte the same text decodes to it again), with its item
        count; a text used again moves to the end, and the least recently used texts are
        dropped past MAX_RAW_SHARED."""
        known, share = self.raw_shared, self.blobs.share_text
        if known is NOT_YET:
            known = self.raw_shared = {}
        for text, stored, n_items in seen:
            known.pop(text, None)
            # graphs over one memory store keep one object of a text they all remember
            known[share(text) if type(text) is bytes else text] = (stored, n_items)
        while len(known) > MAX_RAW_SHARED:
            del known[next(iter(known))]

    def add_values(self, pending: list[tuple[bytes, bytes]] | tuple[()]) -> None:
        """Remember the shared values a committed turn stored first."""
        for plain, stored in pending:
            self.values.add(plain, stored)

    def prepare(self, turn: Turn, node: TurnNode, scratch: Scratch) -> bytes | None:
        """Store the request as system part + base turn + tail; return the system plain.

        Sets `scratch.request` (the fresh request, for linking) and `scratch.request_digest`.
        One path stores every decoded request: its base is what the request table finds.
        A raw text that continues a raw tip is taken before any decoding (`_prepare_raw`),
        its base found in the same table from the tip's state.
        """
        messages = node.request_messages
        raw: bytes | None = None
        if type(messages) is not list:  # (a list is the common case)
            if type(messages) is RawJSON:
                # (a turn with token ids is linked by them: it takes this path once its
                # tokens found their parent, so no drift audit asks for its messages; a str
                # is read as its UTF-8, the same path as bytes)
                data = (
                    utf8_text(messages)
                    if node.parent_id is None
                    and (turn.prompt is None or scratch.token_parent is not None)
                    else None
                )
                if data is not None:
                    done = self._prepare_raw(turn, scratch, data)
                    if done is not _NOT_FAST:
                        return done  # type: ignore[return-value]
                    raw = data
                messages = decode_raw(messages, "request_messages")
            if messages is None:
                turn.system, turn.base = None, None  # the tail b"" and no messages: Scratch
                turn.flags |= NO_MESSAGES
                return None
            if not isinstance(messages, list | tuple):
                raise InvalidValueError(
                    f"expected a list of messages, got {type(messages).__name__}",
                    "request_messages",
                )
            if isinstance(messages, tuple):
                turn.flags |= MESSAGES_TUPLE
                if type(messages) is not tuple:
                    messages = tuple(messages)  # a subclass: what json.dumps writes of it
            elif type(messages) is not list:
                messages = list(messages)  # a subclass: what iterating it yields, as json.dumps
        if not messages and turn.prompt is not None:
            # a token turn without messages (the default []): linked by its tokens, and no
            # base of anything, so it stays out of the request index (which would otherwise
            # hold every such turn under one key)
            turn.system, turn.base = None, None
            scratch.tail_parts = (array_header(0),)
            finish_tail(turn)
            return None
        n_sys = leading_system_count(messages)
        rest = messages[n_sys:]
        walked = self._found(rest)
        if walked is None and any(type(m) is RawJSON for m in messages):
            messages = resolve_raw(messages, "request_messages")
            n_sys = leading_system_count(messages)
            rest = messages[n_sys:]
            walked = self._found(rest)
        pack = self._packer().pack
        try:
            plains: list[bytes | None] = [pack(m) for m in messages[:n_sys]]
        except Exception:  # some message needs the slow path: find which
            plains = [self.plain(m) for m in messages[:n_sys]]

        # system part: shared whole through the value table
        system_plain = None
        turn.system = None
        if n_sys:
            turn.system = self._shared(
                messages[:n_sys], "request_messages", plains, scratch.pending, True
            )
            if None not in plains:
                system_plain = b"".join(plains)  # type: ignore[arg-type]  # (one: itself)

        request = FreshRequest(self, rest, walked)
        scratch.request = request
        if request.n_valid == len(rest):
            scratch.request_sum = request.full_digest
            scratch.request_digest = request.key(request.n_valid)
        self._store_tail(turn, request, request.base, n_sys, scratch)
        if raw is not None and rest and isinstance(messages, list):
            end = raw_end(raw)
            if end is not None and request.full_digest is not None:
                # later raw turns of this conversation start here (`build`): the state of
                # its packings' BLAKE3 (one object for the system part of a conversation's
                # tips, and of the conversations of graphs sharing a cache)
                state = Blake3()
                for plain in request.plains():
                    state.update(plain)  # type: ignore[arg-type]
                found = scratch.raw_found
                if found is not None and found.system_plain == system_plain:
                    system_plain = found.system_plain
                elif system_plain is not None:
                    system_plain = self.blobs.share_plain(system_plain)
                scratch.raw_text = (raw, end, state, system_plain, n_sys)
        return system_plain

    def _prepare_raw(self, turn: Turn, scratch: Scratch, data: bytes) -> bytes | object | None:
        """Store a raw messages text that continues a raw tip, decoding only what is new.

        The re-sent part is confirmed by the BLAKE3 digest of its bytes; the new messages
        are split out with msgspec and decoded as json.loads would. Returns the system plain,
        or `_NOT_FAST` when the text must be decoded whole (no tip it continues, no echo of
        the tip's response right after it, or anything unusual)."""
        found = self.raw_tips.find(data)
        if found is None:
            return _NOT_FAST
        tip, hasher = found
        scratch.raw_found = tip
        base = tip.turn
        end = raw_end(data)
        if end is None or end <= tip.end or not base.n_rest or base.flags & MESSAGES_TUPLE:
            return _NOT_FAST
        tail_text = data[tip.end : end].lstrip(b" \t\r\n")
        # the new messages decoded in one call, exactly as json.loads would where msgspec
        # accepts the text (else the whole text's decode says what is wrong, and where)
        try:
            fresh = decode_array(b"[" + tail_text[1:] + b"]")
            pack = self._packer().pack
            plains = [pack(message) for message in fresh]
        except Exception:
            return _NOT_FAST
        if not fresh:
            return _NOT_FAST
        # the base's response echoed right after its request: exactly (kept as an echo), or
        # loosely (a harness that drops null fields; kept as sent), as the decoded path links
        exact = self.is_echo(base, fresh[0], plains[0])
        if not exact and not self.echoes(base, fresh[0], plains[0]):
            return _NOT_FAST
        # the base must be the longest stored request this one extends, and the only one
        # with its request (else the decoded path's choices apply): no stored request at any
        # boundary after it, and no twin of it
        if base.rkey is None or (self.groups and base.rkey in self.groups):
            return _NOT_FAST
        start = base.n_rest
        try:
            number, base_len, _, digest = self.table.find_after(tip.plain_state, start, plains)
        except Unconfirmed:  # a turn read from a file may be a longer base: decoded whole
            return _NOT_FAST
        if number != base.index or base_len != start:
            return _NOT_FAST
        n = start + len(plains)
        state = tip.plain_state.copy()
        for plain in plains:
            state.update(plain)
        first = tip.n_sys + base.n_rest
        skip = 0  # fresh messages kept as an echo reference: the first, when exact
        if exact:
            turn.flags |= TAIL_ECHO
            skip = 1
            self.blobs.heal_strings(fresh[0])  # (kept as a reference: its strings not put)
        limit = self._plain_limit
        # packings holding long blob strings (in-process blobs only: over a store they would
        # be fetched)
        long: list[bytes] | None = None if self.blobs.fetches else []
        if long is not None and base.flags & RESPONSE_REFS and base.response:
            long.append(base.response)
        pieces = [ECHO_PACKED] if exact else []
        if _all_json(plains[skip:], limit):
            # the common case: each short enough for no blob and no nesting beyond
            # MAX_DEPTH, no ext type (a big int): the walk would agree
            pieces.extend(plains[skip:])
        else:
            encoder, long_types = self._encoder, self._long_types
            for i in range(skip, len(fresh)):
                plain = plains[i]
                if _built_as_is(plain, limit, long_types):
                    pieces.append(plain)
                    continue
                packed, special = encoder.encode(fresh[i], f"request_messages[{first + i}]")
                if packed != plain:
                    turn.flags |= TAIL_REFS
                    if long is not None and encoder.last_longest >= HOLE_MIN:
                        long.append(packed)
                if special:
                    turn.flags |= TAIL_SPECIAL
                pieces.append(packed)
        turn.system = base.system
        turn.base = base
        scratch.tail_parts = (array_header(len(pieces)), *pieces)
        scratch.n_rest = n
        finish_tail(turn)
        scratch.request_sum = digest
        scratch.request_digest = digest_key(digest)
        scratch.message_parent = base
        blobs = [blob for packed in long or () for _, blob in holes_of(packed, self.blobs.string)]
        holes = text_holes(data, tip.end, end, blobs) if blobs else []
        hollow = hollow_text(data, tip.end, end, holes, hasher)
        if hollow is None:  # (never: the holes were found there) hashed whole then
            holes = []
            hasher.update(memoryview(data)[tip.end : end])
        new_tip = RawTip(turn, data, end, hasher.digest(), state, tip.system_plain, tip.n_sys)
        new_tip.holes = tip.holes + holes if holes else tip.holes
        scratch.raw_tip = (new_tip, tip)
        return tip.system_plain

    def _store_tail(
        self,
        turn: Turn,
        request: FreshRequest,
        base: Turn | None,
        n_sys: int,
        scratch: Scratch,
        echoed: int | None = None,
    ) -> None:
        """Pack the messages after the base's (the echo of its response as a placeholder;
        `echoed`: the base's message count, given when the message after them is known to
        be that echo)."""
        rest = request.messages
        n = len(rest)
        start = echoed if echoed is not None else base.n_rest if base is not None else 0
        first = start  # the first message packed (after the echo)
        pieces: list[bytes] = [b""]  # the array header, set below
        if echoed is not None or (
            base is not None and start < n and self.is_echo(base, rest[start], request.plain(start))
        ):
            pieces.append(ECHO_PACKED)
            turn.flags |= TAIL_ECHO
            first += 1
            self.blobs.heal_strings(rest[start])  # (kept as a reference: its strings not put)
        plains = request.plain_slice(first, n)
        limit = self._plain_limit
        if _all_json(plains, limit):  # the common case: every packing as `stored_form` keeps it
            pieces += plains  # type: ignore[arg-type]
        else:
            for i, p in enumerate(plains, first):
                if p is not None and _built_as_is(p, limit, self._long_types):  # `stored_form`
                    pieces.append(p)
                    continue
                encoder = self._encoder
                packed, special = encoder.encode(rest[i], f"request_messages[{n_sys + i}]")
                if packed != p:
                    turn.flags |= TAIL_REFS
                if special:
                    turn.flags |= TAIL_SPECIAL
                pieces.append(packed)
        pieces[0] = array_header(len(pieces) - 1)
        turn.base = base
        scratch.tail_parts, scratch.n_rest = pieces, n
        finish_tail(turn)

    def build(self, turn: Turn, scratch: Scratch, response: bytes | None) -> None:
        """Build the turn's stored request and response at once (one copy), with the digest
        and key it will be filed under at commit (`file` then finds them there)."""
        key = scratch.request_digest
        if turn.flags & NO_MESSAGES:
            key = None
        request = scratch.request
        if request is not None and request.tip is not None:
            # its long strings are interned by now: the tip holds the graph's own objects
            # (taken before the commit, which nothing may fail)
            request.tip.adopt(self.blobs.canonical)
        # (the digest is the table's, filed at commit: the turn keeps the key alone)
        turn.build(scratch.tail_parts, scratch.n_rest, response, None, key)
        if scratch.raw_text is not None:
            raw, end, plain_state, system_plain, n_sys = scratch.raw_text
            blobs = self._long_blobs(turn)
            text = text_holes(raw, 0, end, blobs) if blobs else []
            hollow = hollow_text(raw, 0, end, text)
            if hollow is not None:  # (it always is: the holes were found there)
                raw_tip = RawTip(turn, raw, end, hollow.digest(), plain_state, system_plain, n_sys)
                raw_tip.holes = text
                scratch.raw_tip = (raw_tip, scratch.raw_found)

    def _long_blobs(self, turn: Turn) -> list[str]:
        """The long blob strings of a stored turn's non-system messages, in their order: the
        holes of the raw tip a raw text decoded whole leaves, where no decoded tip is kept
        (one is only from TIP_MIN_BYTES of long strings on). Each later raw turn of the
        conversation then compares them in place and hashes only the text around them,
        where it would hash them too (a screenshot re-sent each turn: BLAKE3 runs at a
        tenth of a comparison's speed). None over a store whose strings are fetched."""
        if self.blobs.fetches:
            return []
        # (a bounded walk: a conversation whose raw texts keep being decoded whole must not
        # walk its whole chain each turn; past the bound its text is hashed whole, as before)
        chain = self._chain_holes(turn, _RAW_HOLES_CHAIN)
        return [text for _, holes in chain or () for _, text in holes]

    def _chain_holes(
        self, turn: Turn, most: int = _MAX_CHAIN
    ) -> list[tuple[int, list[Hole]]] | None:
        """The holes of the request of a stored turn, from its tails and its bases' (None:
        a chain longer than `most` turns, or something unusual)."""
        found: list[list[tuple[int, list[Hole]]]] = []  # each tail's, the latest first
        node: Turn | None = turn
        steps = 0
        while node is not None:
            steps += 1
            if steps > most or node.flags & NO_MESSAGES:
                return None
            base = node.base
            echo_refs = node.flags & TAIL_ECHO and base is not None and base.flags & RESPONSE_REFS
            if node.flags & TAIL_REFS or echo_refs:
                items = array_items(node.tail)
                first = node.first
                here = []
                for k, item in enumerate(items):
                    stored: bytes | None = item
                    if k == 0 and node.flags & TAIL_ECHO:
                        stored = base.response if echo_refs else None  # type: ignore[union-attr]
                    if stored is not None and _has_ext(stored):
                        holes = holes_of(stored, self.blobs.string)
                        if holes:
                            here.append((first + k, holes))
                found.append(here)
            node = base
        return [hole for here in reversed(found) for hole in here]

    def file(
        self,
        turn: Turn,
        key: int | None,
        request: FreshRequest | None = None,
        digest: bytes | None = None,
    ) -> None:
        """File a committed turn's request under `key` (its `digest`'s), if it has messages:
        by its digest when it is known (a turn just added), else by the key alone (a turn
        read from a file, confirmed when a later request is found to extend it)."""
        if key is None or turn.flags & NO_MESSAGES:
            return
        table = self.table
        groups = self.groups
        group = groups.get(key) if groups else None
        # (no group: at most one turn is filed under the key)
        others = table.filed_under(key) if group is None else None
        if turn.rkey != key:
            turn.file_under(key, None)
        if digest is not None and digest_key(digest) == key:
            tip = request.tip if request is not None else None
            table.file(turn.index, turn.n_rest, digest, tip=tip)
        else:
            table.file_key(turn.index, turn.n_rest, key)
        if others:  # a second turn under this key: a group that tracks its parents
            if groups is NOT_YET:
                groups = self.groups = {}
            turns = self.turns
            group = groups[key] = _Bucket(tuple(turns[t] for t in others))
            group.parents.extend(t for t in group if t.children)
        if group is not None:
            group.append(turn)
            if group.by_response is not None:
                self._hold_by_response(group.by_response, turn)

    def note_parent(self, turn: Turn) -> None:
        """`turn` got its first child (a group of identical requests lists its parents)."""
        group = self._bucket_of(turn)
        if group is not None:
            group.parents.append(turn)

    def echo_candidates(
        self, members: Sequence[Turn], message: Any, plain: bytes | None, loose: bool
    ) -> Sequence[Turn]:
        """Of the turns filed under one request key, in order, those whose response may be
        echoed by `message` (packed as `plain`) exactly, or (`loose`) loosely: all of a few;
        of a large bucket those held under its exact or its loose key, and those whose
        responses are kept in a store (`is_echo` and `echoes` decide)."""
        if type(members) is not _Bucket or len(members) <= SMALL:
            return members
        held = members.by_response
        if held is None:
            held = {}
            for turn in members:
                self._hold_by_response(held, turn)
            members.by_response = held  # (only once whole: the next lookup trusts it)
        keys: list[Any] = [_UNKEYED]
        if plain is not None:
            keys.append(("exact", xxhash.xxh3_64_intdigest(plain)))
        if loose:  # (an exact echo is a loose one too)
            try:
                key = ("loose", _frozen(link_key(message)))
                hash(key)
            except Exception:  # (nested deeper than LINK_DEPTH) every turn, as without the
                return members  # index: `echoes` decides each, as it does
            keys.append(key)
        found = {id(turn): turn for key in keys for turn in index_members(held.get(key))}
        return sorted(found.values(), key=_index_of) if len(found) > 1 else [*found.values()]

    def _hold_by_response(self, held: dict[Any, Any], turn: Turn) -> None:
        """Hold a bucket's turn under the keys of its response (none without one)."""
        if not turn.flags & HAS_RESPONSE:
            return
        if type(turn) is RemoteTurn and turn.echo_key() is not None:  # kept in a store
            index_add(held, _UNKEYED, turn)
            return
        plain = self.response_plain(turn)
        if plain is not None:
            index_add(held, ("exact", xxhash.xxh3_64_intdigest(plain)), turn)
        try:
            key = ("loose", _frozen(response_link_key(value(turn.response, self.blobs))))
            hash(key)
        except Exception:  # (nested deeper than LINK_DEPTH) always a candidate: `echoes`
            index_add(held, _UNKEYED, turn)  # decides, as it does without the index
            return
        index_add(held, key, turn)

    def twins(self, key: int) -> bool:
        """Whether stored turns filed under `key` have children a twin may take (of a
        group: children linked to them by a loose echo)."""
        group = self.groups.get(key) if self.groups else None
        if group is None:
            # (a child linked by tokens is no twin's to take: then the twin's response,
            # which may be fetched, is not asked for)
            return any(
                c.link == LinkKind.MESSAGES and c.prompt is None
                for t in self.table.filed_under(key)
                for c in self.turns[t].children or ()
            )
        return bool(self._loose_of(group))

    def echoing_children(self, key: int, echo: bytes) -> Sequence[Turn]:
        """Children of stored turns filed under `key` that a twin of theirs whose response
        packs as `echo` may take: of a group those linked loosely whose echo may be `echo`
        (by its digest); of a single turn, all its children (the caller checks each)."""
        group = self.groups.get(key) if self.groups else None
        if group is None:
            return [c for t in self.table.filed_under(key) for c in self.turns[t].children or ()]
        return index_members(self._loose_of(group).get(xxhash.xxh3_64_intdigest(echo)))

    def note_linked(
        self,
        parent: Turn,
        child: Turn,
        request: FreshRequest | None = None,
        echo: bytes | None = None,
    ) -> None:
        """`child` was linked under `parent` (committed, or moved there): a bucket holding
        `parent` that keeps its loosely linked children notes it if it is one (`echo`: the
        plain packing of the message of `child` that echoes `parent`, when known)."""
        bucket = self._bucket_of(parent)
        loose = None if bucket is None else bucket.loose
        if loose is not None:
            echo = self._loose_echo(parent, child, request, echo)
            if echo is not None:
                index_add(loose, xxhash.xxh3_64_intdigest(echo), child)

    def note_unlinked(self, parent: Turn, child: Turn) -> None:
        """`child` moved away from `parent`."""
        bucket = self._bucket_of(parent)
        loose = None if bucket is None else bucket.loose
        if loose is not None:
            for key, children in list(loose.items()):
                if any(c is child for c in index_members(children)):
                    index_remove(loose, key, child)

    def _bucket_of(self, turn: Turn) -> _Bucket | None:
        groups = self.groups
        key = turn.rkey if groups else None
        return None if key is None else groups.get(key)

    def _loose_of(self, bucket: _Bucket) -> dict[int, Any]:
        loose = bucket.loose
        if loose is None:
            loose = bucket.loose = {}
            for parent in bucket.parents:
                for child in parent.children or ():
                    echo = self._loose_echo(parent, child)
                    if echo is not None:
                        index_add(loose, xxhash.xxh3_64_intdigest(echo), child)
        return loose

    def _loose_echo(
        self,
        parent: Turn,
        child: Turn,
        request: FreshRequest | None = None,
        known: bytes | None = None,
    ) -> bytes | None:
        """The plain packing of the echo by which `child` is linked to `parent`, when that
        is a message link by an echo that is not exactly the response of `parent` (else
        None; `request`: the child's, when it was just added; `known`: that echo's plain
        packing, when the caller has it: the child's tail, which may be in a store, is not
        read)."""
        if child.link != LinkKind.MESSAGES or child.prompt is not None:
            return None
        if child.flags & TAIL_ECHO and child.base is parent:
            return None  # its tail starts with the echo of that very response
        n = parent.n_rest
        if known is not None:
            echo: bytes | None = known
        elif request is not None and n < request.n_valid:
            echo = request.plain(n)
        else:
            values = rest_values(child, self.blobs)
            echo = self.plain(values[n]) if n < len(values) else None
        if echo is None:
            return None
        by_key = echo_by_key(parent, echo)  # a response kept in a store: not fetched
        exact = by_key if by_key is not None else echo == self.response_plain(parent)
        return None if exact else echo

    # ------------------------------------------------------------------ matching

    def valid(self, value: Any, plain: bytes | None) -> bool:
        """Whether `plain` is the packing of `value` by the validating walk."""
        try:
            return plain is not None and self._packer().pack(value) == plain
        except ValueError:
            return False

    def is_echo(self, base: Turn, message: Any, plain: bytes | None) -> bool:
        """Whether `message` is exactly the response of `base`."""
        if plain is None:
            return False
        flags = base.flags
        by_key = echo_by_key(base, plain)  # a response kept in a store: no fetch
        if by_key is not None:
            return by_key and (not flags & RESPONSE_SPECIAL or self.valid(message, plain))
        response = base.response
        if response is None:
            return False
        if flags & RESPONSE_REFS:
            response = self.expand(response)
        if plain != response:
            return False
        return not flags & RESPONSE_SPECIAL or self.valid(message, plain)

    def echoes(self, turn: Turn, message: Any, plain: bytes | None) -> bool:
        """Whether `message` is the echo of the turn's response (exactly or loosely)."""
        if not turn.flags & HAS_RESPONSE:  # (no fetch for a response in a store)
            return False
        if self.is_echo(turn, message, plain):
            return True
        response = turn.response  # (may be fetched from a store: its errors propagate)
        try:
            return bool(response_link_key(value(response, self.blobs)) == link_key(message))
        except Exception:  # a malformed fresh message simply does not match
            return False

    def matches(self, turn: Turn, plains: list[bytes | None], messages: Messages) -> bool:
        """Whether the non-system request of `turn` is exactly `messages[:turn.n_rest]`.

        `plains` are the messages' plain packings; the stored tails are compared with them
        byte for byte, after rebuilding tails that hold blob references.
        """
        end = turn.n_rest
        if end > len(plains):
            return False
        join = b"".join
        slow_bit, echo_bit = TAIL_SLOW, TAIL_ECHO
        node: Turn | None = turn
        try:
            while node is not None:
                start = node.first
                if node.flags & slow_bit:
                    if not self._tail_matches(node, plains, messages, start, end):
                        return False
                else:
                    # the common case inline: a plain tail, maybe after the echo of the
                    # base's plain response
                    if node.flags & echo_bit:
                        if start >= end or plains[start] != node.base.response:  # type: ignore[union-attr]
                            return False
                        body = join(plains[start + 1 : end])  # type: ignore[arg-type]
                    else:
                        body = join(plains[start:end])  # type: ignore[arg-type]
                    tail = node.tail
                    if len(body) + node.body_start != len(tail) or not tail.endswith(body):
                        return False
                end = start
                node = node.base
        except TypeError:  # a message with no plain packing never matches
            return False
        return end == 0

    def _tail_matches(
        self,
        turn: Turn,
        plains: list[bytes | None],
        messages: Messages,
        start: int,
        end: int,
    ) -> bool:
        """Whether the tail of `turn` is exactly `messages[start:end]`."""
        tail = turn.tail
        i = start
        echo = turn.flags & TAIL_ECHO
        if echo:
            base = turn.base
            if i >= end or base is None or not self.is_echo(base, messages[i], plains[i]):
                return False
            i += 1
        if turn.flags & TAIL_REFS:
            # blob references: rebuild the values (blobs are the table's own strings, no
            # copy) and pack them with every string inline, then compare bytes
            try:
                values = unpack(tail, self.blobs.string, no_echo)
            except ValueError:  # a stored value that cannot be rebuilt never matches
                return False
            if echo:
                del values[0]
            if len(values) != end - i:
                return False
            plain = self.plain
            if any(plain(value) != plains[k] for k, value in enumerate(values, i)):
                return False
        else:
            try:
                joined = b"".join(plains[i:end])  # type: ignore[arg-type]
            except TypeError:  # a message with no plain packing
                return False
            overhead = len(array_header(end - start)) + (i - start) * len(ECHO_PACKED)
            if len(joined) + overhead != len(tail) or not tail.endswith(joined):
                return False
        if turn.flags & TAIL_SPECIAL:
            return all(self.valid(messages[k], plains[k]) for k in range(i, end))
        return True

    def plain(self, value: Any) -> bytes | None:
        """The exact packing of a value with every string inline (the engine's canonical
        packing), or None if it is invalid."""
        try:
            packed: bytes = self._packer().pack(value)
        except ValueError:  # (the engine's RefusedValue)
            return None
        return packed

    def expand(self, stored: bytes) -> bytes | None:
        """The plain packing of a stored value: its blobs inline again."""
        try:
            return self.plain(unpack(stored, self.blobs.string))
        except ValueError:
            return None

    def response_plain(self, turn: Turn) -> bytes | None:
        response = turn.response
        if response is None or not turn.flags & RESPONSE_REFS:
            return response
        return self.expand(response)

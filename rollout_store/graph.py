"""The rollout graph: turns stored as references, linked to their parents by prefix.

A turn keeps small references, never copies: its request is the request of an earlier turn
plus a packed tail of what is new, its prompt is its parent's tokens plus new ones, and long
strings are handles into the graph's blob table. Parents are found through prefix-digest
indexes, every hit confirmed by exact comparison.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import operator
import threading
from array import array
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

import xxhash

from .engine import materialize
from .engine.blobs import BlobTable
from .engine.encoding import blob_ref_bytes, unpack
from .engine.index import NOT_YET, OneOrMany, index_add, index_members
from .engine.intake import packed_ids, real_numbers
from .engine.linking import Linker
from .engine.requests import FreshRequest, RequestStore, Scratch
from .engine.shared_blobs import StoreBlobTable
from .engine.stored import (
    LOGPROBS_PACKED,
    NO_MESSAGES,
    RESPONSE_REFS,
    SCALAR_NAMES,
    TAIL_ECHO,
    TAIL_REFS,
    IndexKeys,
    LinkKind,
    Turn,
    TurnFlag,
    TurnMeta,
    TurnSide,
    add_child,
    is_above,
)
from .engine.tokens import TokenRun, run_list
from .engine.turn_records import TurnRecords, tail_bytes
from .errors import (
    DuplicateNodeError,
    InvalidArgumentError,
    InvalidValueError,
    RolloutStoreError,
    UnknownNodeError,
)
from .metadata import NO_META, UNCHANGED, GraphMeta
from .model.drift import REGIONS, Drift
from .model.nodes import COUNT_TOOLS, TurnNode
from .model.raw import RawJSON, resolve_raw, utf8_text
from .model.timeline import Timeline, TimelineTable
from .model.training import TrainingSequence
from .stores.content import ContentStore, StringCache
from .views import NodeView

__all__ = [
    "Graph",
    "GraphRestorer",
    "Journal",
    "JournalEntry",
]


_F = TypeVar("_F", bound=Callable[..., Any])

#: Fields whose value may be `RawJSON` (or, for lists, hold `RawJSON` items); the request
#: messages are left to request storage, which confirms what a raw text re-sends without
#: decoding it, and finds raw items without a scan.
_RAW_FIELDS = (
    "prompt_ids",
    "sampled_ids",
    "sampled_logprobs",
    "request_tools",
    "sampling_params",
    "requested_sampling_params",
    "response_message",
)


#: The fields stored as shared values: a raw text of one that the graph stored before is taken
#: as that value without decoding it
_SHARED_FIELDS = frozenset(("request_tools", "sampling_params", "requested_sampling_params"))
#: The token id fields: a raw text of one is read straight into packed ids (`packed_ids`)
_ID_FIELDS = frozenset(("prompt_ids", "sampled_ids"))
_copy_node = copy.copy
_raw_fields = operator.attrgetter(*_RAW_FIELDS)
_scalar_fields = operator.attrgetter(*SCALAR_NAMES)
_STR_OR_NONE = frozenset((str, type(None)))

#: A turn's entry in `Graph._sent`: the long-string bytes of its non-system request messages
#: (those it inherits from its base included) above `_SENT_SHIFT` bits, those of its response
#: below; a turn whose figures do not fit gets `_SENT_APART` and keeps them in `_sent_apart`.
_SENT_SHIFT = 24
_SENT_LOW = (1 << _SENT_SHIFT) - 1
_SENT_HIGH = (1 << (64 - _SENT_SHIFT)) - 1
_SENT_APART = (1 << 64) - 1


#: What a built turn sent in long strings (see `Graph._sent_by`): in its non-system request
#: messages (inherited ones included), in its response, in all; and its shared values with
#: their long-string bytes; the blobs its own packings refer to (those it inherits were
#: listed for the turn they came from). (A plain tuple: a NamedTuple's `__new__` runs in
#: Python.)
_Sent = tuple[int, int, int, tuple[Any, Any, Any, Any, int], list[int]]
#: The blobs a turn's tail and its response refer to, each reference once (see `_sent_by`).
_Refs = tuple[Sequence[int], Sequence[int]]


def _without_raw(node: TurnNode, known: Container[bytes | str] = ()) -> TurnNode:
    """`node`, or a copy of it with every `RawJSON` field decoded as `json.loads` would, but
    those of the shared fields whose text is `known` (stored before, byte for byte: see
    `RequestStore.raw_shared`), which stay `RawJSON`."""
    values = _raw_fields(node)  # one C call for all of them
    tools: Any = node.request_tools  # (a list or RawJSON as typed; a tuple or subclass too)
    if type(tools) is not list and type(tools) is not tuple and isinstance(tools, list | tuple):
        # a subclass: what iterating it yields (json.dumps writes that; and its tools counted)
        tools = tuple(tools) if isinstance(tools, tuple) else list(tools)
    elif RawJSON not in map(type, values) and (
        type(tools) is not list or RawJSON not in map(type, tools)
    ):
        return node  # the common case: no raw field, no raw item in a tool list
    changes: dict[str, Any] = {}
    if tools is not node.request_tools:
        changes["request_tools"] = resolve_raw(tools, "request_tools")
    for name, value in zip(_RAW_FIELDS, values, strict=True):
        if name in changes:
            continue
        if type(value) is RawJSON and name in _SHARED_FIELDS and value.data in known:
            continue
        if type(value) is RawJSON and name in _ID_FIELDS:
            # read into packed ids (None: decoded below, which says what is wrong)
            text = utf8_text(value)
            ids = None if text is None else packed_ids(text)
            if ids is not None:
                changes[name] = ids
                continue
        if type(value) is RawJSON or (name == "request_tools" and type(value) is list):
            decoded = resolve_raw(value, name)
            if decoded is not value:
                changes[name] = decoded
    if not changes:
        return node
    copied = _copy_node(node)  # (dataclasses.replace runs __init__: four times the cost)
    for name, value in changes.items():
        setattr(copied, name, value)
    return copied


def _locked(method: _F) -> _F:
    """Run a query under the graph's lock, so it sees no turn half added."""

    @functools.wraps(method)
    def locked(self: Graph, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


class JournalEntry(NamedTuple):
    """One turn as a file records it: the stored turn and what it changed in the graph."""

    turn: Turn
    keys: IndexKeys  # where the turn is filed in the graph's indexes
    moves: list[tuple[Turn, LinkKind]]  # earlier turns it re-linked under itself
    blobs_end: int  # blobs stored once the turn was committed (its new ones are below this)
    references: tuple[int, int] | None  # blob references and their bytes so far; None in a
    # snapshot, which counts them once at its end
    drift: Drift | None = None  # the drift audit's record of the turn, if any (see `drift`)


class Journal(Protocol):
    """Where an appending graph writes each turn (the file writer of `storage`).

    `append` runs under the graph's lock before the turn is committed: raising rejects the
    turn, and the graph stays exactly as it was. `close` flushes and releases the file.
    """

    @property
    def path(self) -> str | None:
        """The real path of the file appended to, or None."""

    def append(self, entry: JournalEntry) -> None: ...

    def write_meta(self, meta: GraphMeta) -> None:
        """Record the graph's new metadata (raising keeps the old, as `append` does)."""

    def write_timeline(self, index: int, packed: bytes) -> None:
        """Record the timeline of the turn at `index` (raising keeps the old one)."""

    def hold_sync(self) -> None:
        """Leave the syncs of the writes from now on to `release_sync` (nested: counted)."""

    def release_sync(self) -> None:
        """End a `hold_sync`: the last one syncs what its policy says is due (raising an
        `OSError`-based error if that fails: what was written stays written)."""

    def close(self) -> None: ...


class Graph:
    """Turns of one or many rollouts, with memory proportional to unique content.

    `share_threshold`: strings of at least this many characters are stored once in the
    graph's blob table (`None` disables string sharing; messages and tokens are still
    shared). Safe to use from many threads: `add_turn` is serialized by a lock.

    This is the in-memory graph; `RolloutGraph` (in `storage`, the layer above) adds
    `save`, `load` and `open`.

    `store`: a `ContentStore` shared with other graphs, processes or machines; the graph's
    long strings are kept there and the graph holds references (see `shared_blobs`).
    Without it the graph owns a private in-memory blob table. `cache`: the `StringCache` of
    strings read from an out-of-process store (share one between graphs to bound them all;
    default: a private cache of `shared_blobs.DEFAULT_GRAPH_CACHE_BYTES`).
    """

    def __init__(
        self,
        share_threshold: int | None = 1024,
        *,
        store: ContentStore | None = None,
        cache: StringCache | None = None,
    ) -> None:
        if share_threshold is not None and (
            not isinstance(share_threshold, int) or not 1 <= share_threshold < 2**64
        ):
            # (the engine counts in 64 bits: a larger threshold, sharing nothing, is 2**64 - 1)
            raise InvalidArgumentError("share_threshold must be a positive int below 2**64 or None")
        self.share_threshold = share_threshold
        self.store = store
        self._turns: list[Turn] = []
        # blobs stored once each turn was committed, for save: the last len(_blob_marks)
        # turns' (the turns before them stored none: a graph without blobs keeps no entry)
        self._blob_marks = array("I")
        # the long-string bytes the turns sent (`stats`), counted as each is committed: a
        # turn's entry (8 bytes, see `_SENT_SHIFT`) says what a turn extending its request
        # inherits; the total counts every field of every turn, inherited messages included
        # (turns past its end have entry 0: a graph whose turns send no long string keeps none)
        self._sent = array("Q")
        self._sent_apart: dict[int, tuple[int, int]] | None = None  # made when needed
        self._sent_total = 0
        # the last turn's shared values (system, tools, sampling, requested) and their
        # long-string bytes: most turns send the same objects again, counted without a scan
        self._sent_values: tuple[Any, Any, Any, Any, int] | None = None
        # turns whose id is not the default `turn-{index}`, by the id's `hash` (see `_find`):
        # a turn keeps its id in its own bytes, so the index keeps no string of it
        self._by_id: OneOrMany[int, Turn] = NOT_YET  # a dict at the first such turn
        # what the graph interns, in one table (a capture server's session holds a few of
        # each kind, and one dict costs less than three): scalar fields (a TurnMeta, to
        # itself), flag values (an int, to itself) and sides (a side's sharing key, to the
        # one side of every turn alike: see TurnSide). Keys of two kinds never compare
        # equal: a TurnMeta is a tuple of 5, a sharing key one of 7, a flag value an int.
        self._interned: dict[Any, Any] = {}
        self._last_side: TurnSide | None = None  # the one the last such turn got
        self._use_blobs(BlobTable() if store is None else StoreBlobTable(store, cache))
        self._lock = threading.RLock()
        self._journal: Journal | None = None  # the file an appending graph writes to
        self._closed = False  # the file behind an appending graph was closed
        #: Set by `load` and `open`: how much of the file was good (a storage.LoadReport).
        self.load_report: Any = None
        self._meta = NO_META  # labels, annotations, rewards, group (see `metadata`)
        # the drift audit, by turn index (see `drift`); a dict at its first record
        self._drift: dict[int, Drift] = NOT_YET
        self._timelines: TimelineTable | None = None  # call timings (see `set_timeline`)

    @property
    def lock(self) -> threading.RLock:
        """The graph's lock: hold it to read through many queries as one consistent snapshot
        while other threads record (every query and `add_turn` take it too)."""
        return self._lock

    @property
    def blobs(self) -> BlobTable:
        """The graph's blob table (its `stats()` are part of `stats()`)."""
        return self._blobs

    @blobs.setter
    def blobs(self, table: BlobTable) -> None:
        # allowed on an empty graph only: for a table with another hasher (tests inject
        # colliding hashes this way)
        with self._lock:
            if self._turns or len(self._blobs):
                raise InvalidArgumentError(
                    "the blob table of a graph that holds turns cannot change"
                )
            self.store = table.store if isinstance(table, StoreBlobTable) else None
            self._use_blobs(table)

    def _use_blobs(self, table: BlobTable) -> None:
        """Own `table` and the parts built on it (the graph is empty)."""
        self._blobs = table
        # messages and values
        self._requests = RequestStore(table, self.share_threshold, self._turns)
        self._linker = Linker(self._requests, self._turns)  # parents and adoptions
        # over an out-of-process store, each turn's tail and response too (turn_records)
        self._records = (
            TurnRecords(table.store, table.cache)
            if isinstance(table, StoreBlobTable) and table.fetches
            else None
        )

    # ------------------------------------------------------------------ the file door
    # The file layer (`storage`) sits above this module and drives it through these:
    # `attach_journal` and `journal_entries` to write, `_restorer` to read a file back.

    def attach_journal(self, journal: Journal) -> None:
        """Write every turn added from now on to `journal` before committing it."""
        with self._lock:
            if self._journal is not None or self._closed:
                raise RolloutStoreError("this graph already appends to a file")
            self._journal = journal

    @property
    def journal_path(self) -> str | None:
        """The real path of the file this graph appends to, while it is open."""
        journal = self._journal
        return journal.path if journal is not None else None

    @contextlib.contextmanager
    def group_commit(self) -> Iterator[None]:
        """Turns added in the block are written to an appending graph's file one by one, as
        ever, and synced together when it ends: one `fsync` for the group where
        `fsync="turn"` would make one per turn (with N, when the count is due). The block
        holds the graph's lock (other threads' turns wait, so theirs are never left
        unsynced). A sync that fails at the end raises `FileSyncError`; the turns stay
        added and written, and the next synced write or `close` syncs them. A no-op for a
        graph without a file.
        """
        with self._lock:
            journal = self._journal
            if journal is None:
                yield
                return
            journal.hold_sync()
            try:
                yield
            finally:
                journal.release_sync()

    def close(self) -> None:
        """Flush and close the file behind an appending graph (a no-op otherwise).

        Afterwards `add_turn` raises: a turn added then would never reach the file.
        """
        with self._lock:
            journal, self._journal = self._journal, None
            if journal is not None:
                self._closed = True
                journal.close()

    def drop_caches(self) -> None:
        """Let go of what only speeds up the next turn of a conversation (its tips, decoded
        and raw, and the raw texts of tool lists it has seen): that turn then confirms what
        it re-sends by hashing all of it. The turns, their links and every query are
        unchanged (a capture server calls this for sessions left idle)."""
        with self._lock:
            self._requests.drop_caches()

    def __enter__(self) -> Graph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @_locked
    def journal_entries(self) -> list[JournalEntry]:
        """Every turn as a snapshot file records it, in arrival order.

        Moves are the children that arrived before their parent; index keys are where each
        turn is filed now. Hold `lock` while writing them, so no turn is added meanwhile.
        """
        later_children: dict[int, list[tuple[Turn, LinkKind]]] = {}
        for turn in self._turns:
            parent = turn.parent
            if parent is not None and parent.index > turn.index:
                later_children.setdefault(parent.index, []).append((turn, turn.link))
        keys = self._inverted_keys()
        marks = self._blob_marks
        first = len(self._turns) - len(marks)  # the turns before stored no blob
        drift = self._drift
        return [
            JournalEntry(
                turn,
                keys[i],
                later_children.get(i, []),
                marks[i - first] if i >= first else 0,
                None,
                drift.get(i),
            )
            for i, turn in enumerate(self._turns)
        ]

    def _inverted_keys(self) -> list[IndexKeys]:
        """Each turn's index keys (request, token, prompt, root prefixes)."""
        keys: list[list[Any]] = [[None, None, None, None] for _ in self._turns]
        linker = self._linker
        for turn in self._turns:
            if not turn.flags & NO_MESSAGES:
                keys[turn.index][0] = turn.rkey
        if linker.token_index is not None:
            for key, numbers in linker.token_index.items():
                for number in numbers:
                    keys[number][1] = key
        for key, found in linker.message_roots.items():
            for turn in index_members(found):
                root_keys = keys[turn.index][3]
                if root_keys is None:
                    keys[turn.index][3] = root_keys = []
                root_keys.append(key)
        prompt_keys = {
            id(run): key
            for key, found in linker.prompt_index.items()
            for run in index_members(found)
        }
        for turn in self._turns:
            if turn.prompt is not None:
                keys[turn.index][2] = prompt_keys.get(id(turn.prompt))
        return [IndexKeys(*k) for k in keys]

    def _restorer(self) -> GraphRestorer:
        """THE RESTORE DOOR: the one private name another module may use (`storage`).

        A file reader rebuilds an empty graph through the returned object, turn by turn,
        as `add_turn` once built it; everything else it needs is public API.
        """
        if self._turns or len(self._blobs):
            raise RolloutStoreError("only an empty graph can be restored from a file")
        return GraphRestorer(self)

    # ------------------------------------------------------------------ intake

    def add_turn(self, node: TurnNode) -> TurnNode:
        """Record one turn; sets `index` and `parent_id` on `node` and returns a view of it.

        The view (a read-only `TurnNode`) follows later re-linking: a late ancestor that
        adopts this turn shows as its `parent_id`. Raises `InvalidValueError` (a `TypeError`
        and `ValueError`) naming the path of a bad value, or `DuplicateNodeError`; on any
        error the graph is exactly as before.
        """
        if type(node) is not TurnNode:
            if not isinstance(node, TurnNode):  # (an ABC check: the common case skips it)
                raise InvalidArgumentError(
                    f"add_turn expects a TurnNode, got {type(node).__name__}"
                )
            # a node that cannot be given its place (a view is read-only) says so now, before
            # anything is recorded, rather than after
            node.index = node.index
            node.parent_id = node.parent_id
        with self._lock:
            if self._closed:
                raise RolloutStoreError("the graph's file is closed: reopen it to add turns")
            blobs = self._blobs
            mark = blobs.mark()
            try:
                turn, scratch = self._prepare(node)
                drift = (
                    self._audit(turn, scratch)
                    if turn.parent is None and turn.prompt is not None
                    else None
                )
                sent = self._sent_by(turn)  # (before its record is sealed: nothing fetched)
                moves = self._linker.find_moves(turn, scratch)
                if moves:  # a turn never moves under its own descendant (no cycles)
                    moves = [move for move in moves if not is_above(move[0], turn)]
                scratch.moves = moves
                keys = scratch.keys()
                # the turn passed every check of its input: only now is the store changed
                blobs.flush()
                records = self._records
                sealed = (
                    records.put(turn, lambda: self._response_plain(node))
                    if records is not None
                    else None
                )
                journal = self._journal
                if journal is not None:
                    references = self._blobs.mark()
                    entry = JournalEntry(
                        turn, keys, scratch.moves, references[0], references[1:], drift
                    )
                    journal.append(entry)
            except BaseException:
                blobs.rollback(mark)
                raise
            finally:
                self._requests.reset_packer()
            if records is not None:
                records.seal(turn, sealed)
            self._commit(
                turn,
                keys,
                scratch.moves,
                sent,
                scratch.pending,
                scratch.request,
                scratch.raw_tip,
                scratch.request_sum,
            )
            if scratch.raw_seen:  # only now: the turn's own texts stay known until here
                self._requests.remember_raw(scratch.raw_seen)
            if drift is not None:
                if self._drift is NOT_YET:
                    self._drift = {}
                self._drift[turn.index] = drift
            # as the capture graph does: the node given gets its place in the graph
            node.index = turn.index
            node.parent_id = turn.parent.node_id if turn.parent is not None else None
            return NodeView.of(self, turn)

    def _prepare(self, node: TurnNode) -> tuple[Turn, Scratch]:
        """Check `node` and build its stored turn, linked; nothing in the graph changes."""
        requests, linker = self._requests, self._linker
        given = node
        node = _without_raw(node, requests.raw_shared)
        turn, explicit = self._new_turn(node)
        scratch = Scratch()
        pending = scratch.pending
        linker.prepare_tokens(turn, node, scratch)
        system_plain = requests.prepare(turn, node, scratch)
        linker.prepare_messages(turn, node, scratch)
        requests.build(turn, scratch, requests.encode_response(node.response_message, turn))
        shared, seen = requests.shared_value, scratch.raw_seen
        tools, sampling = node.request_tools, node.sampling_params
        requested = node.requested_sampling_params
        turn.share_values(  # (`shared_value` of None is None)
            None
            if tools is None
            else shared(tools, "request_tools", pending, given.request_tools, seen),
            None
            if sampling is None
            else shared(sampling, "sampling_params", pending, given.sampling_params, seen),
            None
            if requested is None
            else shared(
                requested,
                "requested_sampling_params",
                pending,
                given.requested_sampling_params,
                seen,
            ),
        )
        turn.side.meta = self._turn_meta(node, system_plain)  # its own side until commit
        self._link(turn, explicit, scratch)
        return turn, scratch

    def _audit(self, turn: Turn, scratch: Scratch) -> Drift | None:
        """The drift audit of a turn with token ids that found no parent (see `drift`): the
        stored turn its messages continue, if that one has token ids its prompt leaves."""
        request = scratch.request
        if request is None or not request.messages:
            return None
        parent = self._linker.message_continued(request)
        if parent is None or parent.full is None or parent.prompt is None:
            return None
        context = run_list(parent.full)
        prompt = run_list(turn.prompt)  # type: ignore[arg-type]
        n = min(len(context), len(prompt))
        offset = next((i for i in range(n) if context[i] != prompt[i]), n)
        if offset == len(context):
            return None  # its tokens extend the parent's: not drift (ids beyond 32 bits)
        n_messages = len(materialize.request_messages(parent, self._blobs) or ())
        in_response = offset >= parent.prompt.length
        return Drift(
            turn.index,
            parent.index,
            offset,
            int(in_response),
            n_messages if in_response else None,
            len(context),
            n_messages,
        )

    def _response_plain(self, node: TurnNode) -> bytes | None:
        """The plain packing of the response of `node` (every string inline)."""
        return self._requests.plain(resolve_raw(node.response_message, "response_message"))

    def _blank_turn(self) -> Turn:
        """An empty turn of the kind this graph keeps (over an out-of-process store, one whose
        record can be kept there: see `turn_records`)."""
        return Turn() if self._records is None else self._records.new_turn()

    def _new_turn(self, node: TurnNode) -> tuple[Turn, Turn | None]:
        """A turn with its id and place, and the explicit parent named; the scalar fields
        checked."""
        node_id = node.node_id
        if node_id is None:
            node_id = self._fresh_id() if self._by_id else None
        elif not isinstance(node_id, str):
            raise InvalidValueError(f"expected str, got {type(node_id).__name__}", "node_id")
        else:
            if type(node_id) is not str:  # a subclass: its text (`_find` and the turn take str)
                node_id = str.__str__(node_id)
            if self._find(node_id) is not None:
                raise DuplicateNodeError(f"node_id {node_id!r} is already in the graph")
        turn = self._blank_turn()
        turn.index = len(self._turns)
        turn.flags = 0  # (before the node id, which sets a flag)
        if node_id is not None:  # else the default id of its index, free (no chosen ids)
            turn.node_id = node_id
        explicit = None
        if node.parent_id is not None:
            explicit = self._find(node.parent_id)
            if explicit is None:
                raise InvalidValueError(f"unknown parent {node.parent_id!r}", "parent_id")
        scalars = _scalar_fields(node)
        if not _STR_OR_NONE.issuperset(map(type, scalars)):  # str subclasses are checked here
            for name, scalar in zip(SCALAR_NAMES, scalars, strict=True):
                if scalar is not None and not isinstance(scalar, str):
                    raise InvalidValueError(
                        f"expected str or None, got {type(scalar).__name__}", name
                    )
        n_tools = node.n_tools
        if (
            n_tools is not None
            and n_tools is not COUNT_TOOLS
            and not (type(n_tools) is int and 0 <= n_tools < 2**63)
        ):
            raise InvalidValueError(
                f"expected a non-negative int below 2**63 or None, got {n_tools!r}", "n_tools"
            )
        return turn, explicit

    def _turn_meta(self, node: TurnNode, system_plain: bytes | None) -> TurnMeta:
        """The scalar fields, with n_tools and system_digest filled in when not given."""
        n_tools = node.n_tools
        if n_tools is None or n_tools is COUNT_TOOLS:
            counted = n_tools
            tools = node.request_tools
            if isinstance(tools, list | tuple):
                n_tools = len(tools)
            elif type(tools) is RawJSON:  # a text stored before (see `_without_raw`)
                n_tools = self._requests.raw_shared[tools.data][1]
            if n_tools is COUNT_TOOLS or (n_tools is None and counted is COUNT_TOOLS):
                n_tools = 0  # none sent
        system_digest = node.system_digest
        if system_digest is None and system_plain is not None:
            system_digest = xxhash.xxh3_128_hexdigest(system_plain)
        meta = (node.model, node.finish_reason, node.harness_session_id, system_digest, n_tools)
        # the graph's interned TurnMeta when there is one (most turns), else a new one, its
        # names shared with the other graphs over one memory store (the session id is the
        # graph's own)
        found: TurnMeta | None = self._interned.get(meta)
        if found is not None:
            return found
        share = self._blobs.share_name
        model, finish, digest = node.model, node.finish_reason, system_digest
        return TurnMeta(
            share(model) if type(model) is str else model,
            share(finish) if type(finish) is str else finish,
            node.harness_session_id,
            share(digest) if type(digest) is str else digest,
            n_tools,
        )

    def _link(self, turn: Turn, explicit: Turn | None, scratch: Scratch) -> None:
        """Link the turn: an explicit parent wins, then tokens, then messages. A root
        without token ids waits under its request's prefixes for a late ancestor."""
        if explicit is not None:
            turn.parent, turn.link = explicit, LinkKind.EXPLICIT
        elif scratch.token_parent is not None:
            turn.parent, turn.link = scratch.token_parent, LinkKind.TOKENS
        elif turn.prompt is None and scratch.message_parent is not None:
            turn.parent, turn.link = scratch.message_parent, LinkKind.MESSAGES
        else:
            turn.parent, turn.link = None, LinkKind.NONE
            request = scratch.request
            if (
                request is not None
                and request.n_valid == len(request.messages)
                and turn.prompt is None
            ):
                # every shorter prefix, the empty one too (a request of system messages only)
                scratch.root_keys = request.root_keys()

    def _fresh_id(self) -> str:
        # derived from the turn count, so a rejected turn uses up no id
        n = len(self._turns)
        while self._find(f"turn-{n}") is not None:
            n += 1
        return f"turn-{n}"

    def _find(self, node_id: object) -> Turn | None:
        """The turn with this id, if any: one named by its caller, or one with the default
        id of its index (kept as None in the turn, so that it costs no string)."""
        if type(node_id) is not str:
            return None
        named = self._by_id
        if named:
            # an in-memory index only, never stored: the str hash, randomized per process,
            # cannot be made to collide by chosen ids; a hit is confirmed by the id itself
            for found in index_members(named.get(hash(node_id))):
                if found.ident == node_id:
                    return found
        digits = node_id[5:]
        if node_id.startswith("turn-") and digits.isdigit() and digits.isascii():
            index = int(digits)
            if index < len(self._turns) and str(index) == digits:
                turn = self._turns[index]
                if turn.ident is None:
                    return turn
        return None

    # -- values

    # -- tokens

    # -- request messages

    # ------------------------------------------------------------------ commit

    def _sent_by(self, turn: Turn, refs: _Refs | None = None) -> _Sent:
        """What a built turn sent in long strings (blob-sized): its non-system request
        messages (its base's, an echo of the base's response, then its tail's), its response,
        and in all (those, the system messages, tools, sampling parameters, logprobs).

        Worked out from the base's entry and the turn's own packings (their blob references'
        sizes: no string is read), before its record may be sealed in a store. `refs`: the
        blobs its tail and its response refer to, when the caller found them (a file's
        reader, checking those packings): they are not walked again."""
        sizes, flags = self._blobs.size, turn.flags
        used: list[int] = []

        def size(index: int) -> int:
            used.append(index)
            return sizes(index)

        rest = 0
        base = turn.base
        if base is not None:
            sent = self._sent
            entry = sent[base.index] if base.index < len(sent) else 0
            if entry == _SENT_APART:
                rest, echoed = self._sent_apart[base.index]  # type: ignore[index]
            else:
                rest, echoed = entry >> _SENT_SHIFT, entry & _SENT_LOW
            if flags & TAIL_ECHO:
                rest += echoed
        if flags & TAIL_REFS:
            rest += blob_ref_bytes(turn.tail, size) if refs is None else sum(map(size, refs[0]))
        response = 0
        if flags & RESPONSE_REFS:
            if refs is None:
                response = blob_ref_bytes(turn.response, size)  # type: ignore[arg-type]
            else:
                response = sum(map(size, refs[1]))
        side = turn.side
        system, tools, sampling, requested = side.system, side.tools, side.sampling, side.requested
        values = self._sent_values
        if (
            values is None
            or values[0] is not system
            or values[1] is not tools
            or values[2] is not sampling
            or values[3] is not requested
        ):
            in_values = sum(
                blob_ref_bytes(value, size)
                for value in (system, tools, sampling, requested)
                if value is not None
            )
            values = (system, tools, sampling, requested, in_values)
        total = rest + response + values[4]
        if flags & LOGPROBS_PACKED:
            total += blob_ref_bytes(turn.logprobs, size)
        return rest, response, total, values, used

    def _note_sent(self, sent: _Sent) -> None:
        """File a committed turn's `_sent_by` figures."""
        rest, response, total, values, used = sent
        index = len(self._turns) - 1  # the turn's (committed: in the list)
        if rest <= _SENT_HIGH and response < _SENT_LOW:
            entry = rest << _SENT_SHIFT | response
        else:
            if self._sent_apart is None:
                self._sent_apart = {}
            self._sent_apart[index] = (rest, response)
            entry = _SENT_APART
        if entry:  # (0 past the end: see `__init__`)
            entries = self._sent
            if len(entries) < index:
                entries.frombytes(bytes(entries.itemsize * (index - len(entries))))
            entries.append(entry)
        self._sent_total += total
        self._sent_values = values
        if used:
            # the blobs `blob_bytes_saved` subtracts one copy of (a graph recovered past
            # damage also holds blobs read for turns it lost, which no turn refers to)
            self._blobs.note_used(used)

    def _commit(
        self,
        turn: Turn,
        keys: IndexKeys,
        moves: list[tuple[Turn, LinkKind]],
        sent: _Sent,
        pending: list[tuple[bytes, bytes]] | tuple[()] = (),
        request: FreshRequest | None = None,
        raw_tip: Any = None,
        digest: bytes | None = None,
    ) -> None:
        requests = self._requests
        if pending:
            requests.add_values(pending)
        side, meta = turn.side, turn.meta  # its own side: sides are shared below
        interned = self._interned
        side.meta = interned.setdefault(meta, meta)
        self._turns.append(turn)
        n_blobs = len(self._blobs)
        if n_blobs or self._blob_marks:  # (see `__init__`)
            self._blob_marks.append(n_blobs)
        self._note_sent(sent)
        ident = turn.ident
        if ident is not None:
            if self._by_id is NOT_YET:
                self._by_id = {}
            index_add(self._by_id, hash(ident), turn)
        last = self._last_side
        if last is not None and side.same_as(last):  # mostly: what the turn before had
            turn.side = last
        else:
            key = side.sharing_key()
            if key is not None:  # no token ids: one side for every turn alike
                found = interned.get(key)
                if found is None:
                    side.shared = True
                    found = interned[key] = side
                turn.side = self._last_side = found
        parent = turn.parent
        if parent is not None:
            if parent.kids is None:
                if requests.buckets:  # (a bucket of identical requests lists its parents)
                    requests.note_parent(parent)
                parent.kids = turn  # `add_child` of a first child
            else:
                add_child(parent, turn)
            if requests.buckets:  # (a bucket keeps its turns' loosely linked children)
                requests.note_linked(parent, turn, request)
        requests.file(turn, keys.request, request, digest)
        # flags above 256 are int objects of their own: one per distinct value, not per turn
        turn.flags = interned.setdefault(turn.flags, turn.flags)
        if raw_tip is not None:
            requests.add_raw_tip(*raw_tip)
        linker = self._linker
        if keys.token is not None or keys.prompt is not None:  # (else `file` files nothing)
            linker.file(turn, keys.token, keys.prompt)
        if moves:
            for other, link in moves:
                linker.move(other, turn, link)
            requests.note_parent(turn)
        if parent is None:
            linker.register_root(turn, keys.roots)

    # ------------------------------------------------------------------ materialize

    def _view(self, turn: Turn) -> TurnNode:
        return NodeView.of(self, turn)

    @_locked
    def field_value(self, node_id: str, name: str) -> Any:
        """One field of a turn rebuilt from storage (fresh containers); what views read."""
        turn = self._turn(node_id)
        rebuild = _FIELDS.get(name)
        if rebuild is not None:
            return rebuild(self, turn)
        return getattr(NodeView.of(self, turn), name)  # a scalar field

    # ------------------------------------------------------------------ queries

    def _turn(self, node_id: str) -> Turn:
        turn = self._find(node_id)
        if turn is None:
            raise UnknownNodeError(f"no turn {node_id!r} in the graph")
        return turn

    def __len__(self) -> int:
        return len(self._turns)

    def __contains__(self, node_id: object) -> bool:
        return self._find(node_id) is not None

    @_locked
    def get(self, node_id: str) -> TurnNode:
        """A read-only view of the turn; each field is rebuilt from storage as it is read."""
        return self._view(self._turn(node_id))

    @_locked
    def request_messages(self, node_id: str) -> list[Any] | tuple[Any, ...] | None:
        return materialize.request_messages(self._turn(node_id), self._blobs)

    @_locked
    def response_message(self, node_id: str) -> Any:
        return materialize.value(self._turn(node_id).response, self._blobs)

    @_locked
    def request_tools(self, node_id: str) -> Any:
        return materialize.value(self._turn(node_id).tools, self._blobs)

    @_locked
    def sampling_params(self, node_id: str) -> Any:
        return materialize.value(self._turn(node_id).sampling, self._blobs)

    @_locked
    def requested_sampling_params(self, node_id: str) -> Any:
        return materialize.value(self._turn(node_id).requested, self._blobs)

    @_locked
    def summary(self, node_id: str) -> dict[str, Any]:
        """The turn's scalar fields and sizes, without rebuilding its messages."""
        turn = self._turn(node_id)
        model, finish_reason, session, system_digest, n_tools = turn.meta
        return {
            "node_id": turn.node_id,
            "index": turn.index,
            "parent_id": turn.parent.node_id if turn.parent is not None else None,
            "link": turn.link.label,
            "n_prompt": turn.prompt.length if turn.prompt is not None else 0,
            "n_sampled": len(turn.sampled) if turn.sampled is not None else 0,
            "n_tools": n_tools,
            "model": model,
            "finish_reason": finish_reason,
            "harness_session_id": session,
            "system_digest": system_digest,
        }

    @_locked
    def node_ids(self) -> list[str]:
        """Node ids in arrival order."""
        return [t.node_id for t in self._turns]

    @_locked
    def root_ids(self) -> list[str]:
        return [t.node_id for t in self._turns if t.parent is None]

    @_locked
    def leaf_ids(self) -> list[str]:
        return [t.node_id for t in self._turns if not t.children]

    @_locked
    def child_ids(self, node_id: str) -> list[str]:
        return [c.node_id for c in self._turn(node_id).children or ()]

    @_locked
    def parent(self, node_id: str) -> str | None:
        parent = self._turn(node_id).parent
        return parent.node_id if parent is not None else None

    @_locked
    def link_kind(self, node_id: str) -> str:
        """How the turn is linked to its parent: none, tokens, messages or explicit."""
        return self._turn(node_id).link.label

    @_locked
    def root_of(self, node_id: str) -> str:
        turn = self._turn(node_id)
        while turn.parent is not None:
            turn = turn.parent
        return turn.node_id

    @_locked
    def path_ids(self, node_id: str) -> list[str]:
        """Node ids from the root down to `node_id`."""
        return [t.node_id for t in self._path(self._turn(node_id))]

    def _path(self, turn: Turn) -> list[Turn]:
        path = []
        node: Turn | None = turn
        while node is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    @_locked
    def path_id_lists(self) -> list[list[str]]:
        """One path (root to leaf) per leaf, in the leaves' arrival order."""
        return [self.path_ids(leaf) for leaf in self.leaf_ids()]

    @_locked
    def fork_ids(self) -> list[str]:
        """Turns with more than one child."""
        return [t.node_id for t in self._turns if t.children and len(t.children) > 1]

    @_locked
    def discarded_ids(self) -> list[str]:
        """Childless turns with a sibling that continued (retries that were dropped).

        Roots with an identical prompt (token ids or, without them, request messages) count as
        siblings, so a retried first call is found too.
        """
        discarded: set[int] = set()
        groups: list[list[Turn]] = [list(t.children) for t in self._turns if t.children]
        by_prompt: dict[Any, list[Turn]] = {}
        for root in self._turns:
            if root.parent is None:
                by_prompt.setdefault(self._prompt_identity(root), []).append(root)
        groups.extend(by_prompt.values())
        for group in groups:
            if len(group) > 1 and any(t.children for t in group):
                discarded.update(t.index for t in group if not t.children)
        return [t.node_id for t in self._turns if t.index in discarded]

    # The capture graph's query API: node views (see `views`), paths of them, fork pairs.

    @_locked
    def nodes(self) -> list[TurnNode]:
        """Every turn in arrival order, as read-only views."""
        return [NodeView.of(self, t) for t in self._turns]

    @_locked
    def roots(self) -> list[TurnNode]:
        return [NodeView.of(self, t) for t in self._turns if t.parent is None]

    @_locked
    def leaves(self) -> list[TurnNode]:
        return [NodeView.of(self, t) for t in self._turns if not t.children]

    @_locked
    def children(self, node_id: str) -> list[TurnNode]:
        return [NodeView.of(self, c) for c in self._turn(node_id).children or ()]

    @_locked
    def path_to(self, leaf_id: str) -> list[TurnNode]:
        """The turns from the root down to `leaf_id`."""
        return [NodeView.of(self, t) for t in self._path(self._turn(leaf_id))]

    @_locked
    def paths(self) -> Iterator[list[TurnNode]]:
        """Every root-to-leaf path, in the leaves' arrival order (a snapshot)."""
        return iter([self.path_to(leaf) for leaf in self.leaf_ids()])

    @_locked
    def forks(self) -> list[tuple[str, list[str]]]:
        """(parent id, child ids) of every turn with more than one child."""
        return [
            (t.node_id, [c.node_id for c in t.children])
            for t in self._turns
            if t.children and len(t.children) > 1
        ]

    @_locked
    def discarded_nodes(self) -> list[TurnNode]:
        """The turns `discarded_ids` names, as views."""
        return [NodeView.of(self, self._turn(n)) for n in self.discarded_ids()]

    def _prompt_identity(self, turn: Turn) -> Any:
        if turn.prompt is not None:
            return ("tokens", tuple(run_list(turn.prompt)))
        messages = materialize.request_messages(turn, self._blobs)
        return ("messages", self._requests.plain(messages) if messages else b"")

    @_locked
    def sequence_for(self, node_id: str) -> TrainingSequence:
        """The training sequence ending at `node_id`: its tokens, loss mask and logprobs.

        Sampled tokens of every turn on the path whose prompt + sampled tokens are a prefix
        of this turn's get mask 1 and their logprobs when logprobs are aligned with them;
        everything else is context (mask 0, logprob 0.0).
        """
        leaf = self._turn(node_id)
        path = self._path(leaf)
        full = leaf.full
        input_ids = run_list(full) if full is not None else []
        n = len(input_ids)
        mask = [0] * n
        logprobs = [0.0] * n
        for turn in self._prefix_turns(path, input_ids):
            if turn.sampled is None:
                continue
            end = turn.full.length  # type: ignore[union-attr]
            start = turn.prompt.length  # type: ignore[union-attr]
            if end == start:
                continue
            values = self._aligned_logprobs(turn, end - start)
            if values is None:
                continue
            mask[start:end] = [1] * (end - start)
            logprobs[start:end] = values
        root = path[0]
        return TrainingSequence(
            input_ids=input_ids,
            loss_mask=mask,
            logprobs=logprobs,
            node_ids=[t.node_id for t in path],
            prompt_len=root.prompt.length if root.prompt is not None else 0,
            root_id=root.node_id,
            n_turns=len(path),
        )

    def _prefix_turns(self, path: list[Turn], input_ids: list[int]) -> Iterator[Turn]:
        """The turns of `path` whose prompt + sampled tokens begin `input_ids` (its last
        turn's), in order: the ones whose tokens are in its row (a drifted prompt, or an
        explicit parent with other tokens, is not)."""
        leaf_full = path[-1].full if path else None
        # the runs themselves, not their ids: a packed turn's full run is a view made when
        # asked for (`Turn.full`), equal to every other view over its prompt
        chain_runs: set[TokenRun] = set()
        run = leaf_full
        while run is not None:
            chain_runs.add(run)
            run = run.prev
        n = len(input_ids)
        for turn in path:
            full = turn.full
            if full is None or turn.prompt is None or full.length > n:
                continue
            if full in chain_runs or input_ids[: full.length] == run_list(full):
                yield turn

    @_locked
    def token_spans(self, node_id: str) -> list[tuple[str, int, int]]:
        """Whose tokens each part of the token row ending at `node_id` is (its training
        sequence's `input_ids`): `(turn id, start, end)` of each turn on the path whose
        prompt + sampled tokens begin the row, its part from where the turn before it ends
        to its own end (turns whose tokens are not a prefix of the row hold none of it)."""
        leaf = self._turn(node_id)
        path = self._path(leaf)
        input_ids = run_list(leaf.full) if leaf.full is not None else []
        spans: list[tuple[str, int, int]] = []
        start = 0
        for turn in self._prefix_turns(path, input_ids):
            end = turn.full.length  # type: ignore[union-attr]
            if end > start or not spans:
                spans.append((turn.node_id, start, end))
                start = max(start, end)
        return spans

    def _aligned_logprobs(self, turn: Turn, n: int) -> list[Any] | None:
        """The turn's logprobs if there is one real number per sampled token, else None.

        Judged by count and kind, not by Python type: ints (a 0 from a JavaScript client)
        count, bools and non-numbers do not. The values are the recorded ones, exactly.
        """
        lp = turn.logprobs
        if lp is None:
            return None
        if not turn.flags & TurnFlag.LOGPROBS_PACKED:
            return lp.tolist() if len(lp) == n else None
        values = unpack(lp, self._blobs.string)
        if isinstance(values, list) and len(values) == n and real_numbers(values):
            return values
        return None

    @_locked
    def sequences(self) -> list[TrainingSequence]:
        """One training sequence per leaf."""
        return [self.sequence_for(leaf) for leaf in self.leaf_ids()]

    @_locked
    def stats(self) -> dict[str, int]:
        """The graph's shape, then what it stores, as a dict of ints:

        - `n_turns`, `n_roots`, `n_leaves`, `n_forks` (turns with more than one child),
          `n_discarded` (retries the harness dropped): the capture graph's five counts;
        - `messages_received`: request messages over all turns, each counted in every turn
          that sent it; `message_bytes_stored`: bytes of the stored message tails (what each
          turn adds to the request it extends);
        - `shared_values`: distinct values kept once for many turns (system prompts, tools);
        - `tokens_received`: prompt and sampled token ids over all turns;
          `tokens_stored`: token ids kept (a prompt that extends another is kept once);
        - long strings (those of at least `share_threshold` characters, kept once each in
          the blob table): `blobs` (distinct ones), `blob_bytes` (their UTF-8 bytes: what is
          stored for them), `blob_references` (times the graph met a long string in what it
          stored anew: strings a turn inherits from the request it extends, or re-sends in a
          shared value stored before, are not met again), `blob_bytes_saved`
          (`blob_bytes_sent` minus the UTF-8 bytes of the distinct long strings the turns
          refer to: what content-addressing and turns stored as references saved; never
          negative, as each string counted once was sent at least once), `collisions`
          (strings beyond the first under one xxh3 digest),
          `blob_bytes_sent` (UTF-8 bytes of the long strings of every turn, as a store that
          keeps each turn whole would hold them: each request with every message it re-sends,
          its system messages, tools and sampling parameters, the response and logprobs);
        - `n_drift`: roots the drift audit recorded (see `drift()`).

        `blob_bytes_sent` is counted as turns are added or read from a file (8 bytes a turn):
        no stored turn is fetched for it. A 20-turn conversation whose first message holds
        an image sends it 20 times: `blob_bytes_sent` is 20 times the image's bytes,
        `blob_bytes_saved` 19 times.

        A graph read with `load(recover=True)` past damage keeps in its blob table the long
        strings read for turns that were then lost or dropped (a later turn may use them):
        `blobs` and `blob_bytes` count them; `blob_bytes_sent` and `blob_bytes_saved` count
        only what the turns kept refer to.
        """
        stored_tokens = 0
        seen: set[TokenRun] = set()  # runs, not ids: views of packed full runs are equal
        system_counts: dict[int, int] = {}
        messages_received = tokens_received = 0
        for turn in self._turns:
            if turn.system is not None:
                count = system_counts.get(id(turn.system))
                if count is None:
                    count = len(unpack(turn.system, _no_string))  # (no blob is read)
                    system_counts[id(turn.system)] = count
                messages_received += count
            messages_received += turn.n_rest
            if turn.prompt is not None:
                tokens_received += turn.prompt.length
                tokens_received += len(turn.sampled) if turn.sampled is not None else 0
            run = turn.full
            while run is not None and run not in seen:
                seen.add(run)
                stored_tokens += len(run.seg)
                run = run.prev
        out = {
            "n_turns": len(self._turns),
            "n_roots": sum(1 for t in self._turns if t.parent is None),
            "n_leaves": sum(1 for t in self._turns if not t.children),
            "n_forks": sum(1 for t in self._turns if t.children and len(t.children) > 1),
            "n_discarded": len(self.discarded_ids()),
            "messages_received": messages_received,
            "message_bytes_stored": tail_bytes(self._turns, self._records),
            "shared_values": len(self._requests.values),
            "tokens_received": tokens_received,
            "tokens_stored": stored_tokens,
            "n_drift": sum(1 for i in self._drift if self._turns[i].parent is None),
        }
        blob_stats = self.blobs.stats()
        sent = self._sent_total
        blob_stats["blob_bytes_saved"] = sent - self._blobs.used_bytes
        out.update(blob_stats)
        out["blob_bytes_sent"] = sent
        return out

    # ------------------------------------------------------------------ training metadata
    # Labels, annotations, rewards and a group id (see `metadata`): replaced whole on each
    # change, written to an appending graph's file first, so a failed change alters nothing.

    @property
    def meta(self) -> GraphMeta:
        """The graph's metadata as one immutable value (`GraphMeta`)."""
        return self._meta

    @property
    def labels(self) -> list[str]:
        """The graph's labels (strings), in the order first added."""
        return list(self._meta.labels)

    def add_labels(self, *labels: str) -> None:
        """Add labels (non-empty strings; one already held is kept once)."""
        self._set_meta(lambda meta: meta.with_labels(labels, add=True))

    def set_labels(self, labels: Iterable[str]) -> None:
        """Replace every label with `labels`."""
        given = list(labels) if not isinstance(labels, str) else [labels]
        self._set_meta(lambda meta: meta.with_labels(given, add=False))

    @property
    def annotations(self) -> dict[str, Any]:
        """Every annotation, rebuilt: `json.dumps` of each equals that of the value given."""
        return self._meta.annotation_values()

    def annotate(self, values: Mapping[str, Any] | None = None, /, **more: Any) -> None:
        """Set annotations: any JSON values by string key (a key set again is replaced).

        `graph.annotate(judge="gpt", scores=[0.5, 1])` or `graph.annotate({"a b": 1})`. A
        value JSON cannot carry raises `InvalidValueError` naming `annotations['key']` and
        the place inside it; the graph is then unchanged.
        """
        merged: dict[Any, Any] = {}
        if values is not None:
            if not isinstance(values, Mapping):
                raise InvalidArgumentError(
                    f"annotate expects a mapping, got {type(values).__name__}"
                )
            merged.update(values)
        merged.update(more)
        self._set_meta(lambda meta: meta.with_annotations(merged))

    def remove_annotations(self, *keys: str) -> None:
        """Drop the annotations under `keys` (keys not held are ignored)."""
        self._set_meta(lambda meta: meta.without_annotations(keys))

    @property
    def reward(self) -> int | float | None:
        """The graph's reward (one number for the whole rollout), or None."""
        return self._meta.reward

    @property
    def rewards(self) -> dict[str, int | float]:
        """Per-leaf rewards, by the leaf's node id (see `set_reward`)."""
        return dict(self._meta.leaf_rewards)

    def set_reward(self, value: float | None, leaf: str | None = None) -> None:
        """Set the graph's reward, or with `leaf` (a node id) the reward of the path ending
        there; None clears it. A reward is an int or a finite float.

        Training rows take a leaf's own reward, else the graph's (`reward_for`). A reward
        given to a turn that later gets children stays recorded but ends no path.
        """
        if leaf is not None:
            if not isinstance(leaf, str):
                raise InvalidValueError(
                    f"a leaf is named by its node id (a str), got {type(leaf).__name__}", "leaf"
                )
            with self._lock:
                if self._find(leaf) is None:
                    raise UnknownNodeError(f"no turn {leaf!r} in the graph to reward")
        self._set_meta(lambda meta: meta.with_reward(value, leaf))

    def reward_for(self, leaf_id: str) -> int | float | None:
        """The reward of the path ending at `leaf_id`: its own, else the graph's, else None."""
        return self._meta.reward_for(leaf_id)

    @property
    def group(self) -> str | None:
        """The id of the group (a GRPO group, say) this rollout belongs to, or None."""
        return self._meta.group

    def set_group(self, group: str | None) -> None:
        """Set the group id (a non-empty str) or clear it (None)."""
        self._set_meta(lambda meta: meta.with_group(group))

    def update_metadata(
        self,
        *,
        labels: Iterable[str] = (),
        annotations: Mapping[str, Any] | None = None,
        reward: Any = UNCHANGED,
        rewards: Mapping[str, Any] | None = None,
        group: Any = UNCHANGED,
    ) -> None:
        """Several changes at once, all or none: `labels` added, `annotations` set,
        `reward` (the graph's; None clears), `rewards` (leaf node id -> reward or None) and
        `group` (None clears). Arguments left out change nothing. Any bad value raises
        naming it (`annotations['k']`, `rewards['leaf']`, `labels[2]`) and changes nothing.
        """
        if annotations is not None and not isinstance(annotations, Mapping):
            raise InvalidValueError(
                f"expected a mapping, got {type(annotations).__name__}", "annotations"
            )
        if rewards is not None and not isinstance(rewards, Mapping):
            raise InvalidValueError(f"expected a mapping, got {type(rewards).__name__}", "rewards")
        given_labels = [labels] if isinstance(labels, str) else list(labels)
        leaf_rewards = dict(rewards or {})
        with self._lock:
            for leaf in leaf_rewards:
                if not isinstance(leaf, str) or self._find(leaf) is None:
                    raise UnknownNodeError(f"no turn {leaf!r} in the graph to reward")

            def change(meta: GraphMeta) -> GraphMeta:
                if given_labels:
                    meta = meta.with_labels(given_labels, add=True)
                if annotations:
                    meta = meta.with_annotations(annotations)
                if reward is not UNCHANGED:
                    meta = meta.with_reward(reward, None)
                for leaf, value in leaf_rewards.items():
                    meta = meta.with_reward(value, leaf)
                if group is not UNCHANGED:
                    meta = meta.with_group(group)
                return meta

            self._set_meta(change)

    def _set_meta(self, change: Callable[[GraphMeta], GraphMeta]) -> None:
        with self._lock:
            if self._closed:
                raise RolloutStoreError("the graph's file is closed: reopen it to change it")
            meta = change(self._meta)  # raises on a bad value: nothing changed
            if meta == self._meta:
                return
            journal = self._journal
            if journal is not None:
                journal.write_meta(meta)
            self._meta = meta

    def set_timeline(self, node_id: str, timeline: Timeline) -> None:
        """Record when `node_id`'s call was received, sent upstream, answered and replied to
        (see `timeline.Timeline`); a timeline set again replaces the one before. An appending
        graph writes it to its file as a `timeline` record."""
        if not isinstance(timeline, Timeline):
            raise InvalidArgumentError(
                f"set_timeline expects a Timeline, got {type(timeline).__name__}"
            )
        with self._lock:
            if self._closed:
                raise RolloutStoreError("the graph's file is closed: reopen it to change it")
            turn = self._find(node_id)
            if turn is None:
                raise UnknownNodeError(f"no turn {node_id!r} in the graph to time")
            packed = timeline.pack()
            if self._journal is not None:
                self._journal.write_timeline(turn.index, packed)
            self._restore_timeline(turn.index, packed)

    def _restore_timeline(self, index: int, packed: bytes) -> None:
        if self._timelines is None:
            self._timelines = TimelineTable()
        self._timelines.set(index, packed)

    def timeline(self, node_id: str) -> Timeline | None:
        """The timeline of `node_id`'s call, or None if it has none."""
        with self._lock:
            turn = self._find(node_id)
            if turn is None:
                raise UnknownNodeError(f"no turn {node_id!r} in the graph")
            return None if self._timelines is None else self._timelines.get(turn.index)

    def parent_replied(self, node_id: str) -> int | None:
        """When the reply to the call `node_id` continues was sent (its parent's `received`
        plus `reply_sent`, microseconds since the epoch), or None: a root, or a parent
        without a timeline. What `set_timeline`'s `gap_before` is measured from."""
        with self._lock:
            parent = self._turn(node_id).parent
            table = self._timelines
            return None if parent is None or table is None else table.replied(parent.index)

    def timelines(self) -> dict[str, Timeline]:
        """Every timeline held, by node id, in arrival order."""
        with self._lock:
            table = self._timelines
            if table is None:
                return {}
            out: dict[str, Timeline] = {}
            for index in table.indexes():
                if index < len(self._turns):
                    found = table.get(index)
                    if found is not None:
                        out[self._turns[index].node_id] = found
            return out

    def timeline_records(self) -> list[tuple[int, bytes]]:
        """(turn index, packed timeline) of every turn that has one (for `save`)."""
        with self._lock:
            table = self._timelines
            if table is None:
                return []
            out = []
            for index in table.indexes():
                packed = table.packed(index)
                if packed is not None and index < len(self._turns):
                    out.append((index, packed))
            return out

    @_locked
    def drift(self) -> list[dict[str, Any]]:
        """The drift audit: each root whose request messages continue a stored turn but
        whose token ids do not extend that turn's prompt + sampled ids (see `drift`).

        Each entry: `node_id`, `would_be_parent`, `offset` (the first differing token),
        `parent_tokens`, `region` ("prompt" or "response"), `message_index` (the request
        message the offset falls in; None inside the prompt, whose token-to-message
        boundaries the graph does not know) and `parent_messages`.
        """
        out = []
        for index in sorted(self._drift):
            found = self._drift[index]
            turn = self._turns[index]
            if turn.parent is not None:  # adopted by a late ancestor since
                continue
            out.append(
                {
                    "node_id": turn.node_id,
                    "would_be_parent": self._turns[found.parent].node_id,
                    "offset": found.offset,
                    "parent_tokens": found.parent_tokens,
                    "region": REGIONS[found.region],
                    "message_index": found.message_index,
                    "parent_messages": found.parent_messages,
                }
            )
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.node_ids())


class GraphRestorer:
    """Rebuilds an empty graph from a file, turn by turn (see `Graph._restorer`).

    The reader decodes and checks each record; this object files what it built in the
    graph's tables and indexes exactly as `add_turn` would have.
    """

    __slots__ = ("_graph",)

    def __init__(self, graph: Graph) -> None:
        self._graph = graph

    def turn(self, index: int) -> Turn:
        """The stored turn at `index` (arrival order); the caller checks the range."""
        return self._graph._turns[index]

    def add_value(self, stored: bytes, plain: bytes | None) -> None:
        """A shared value read back, found again by its plain packing (every string inline;
        the reader splices it from the stored bytes), or never found again if None."""
        graph = self._graph
        requests = graph._requests
        if plain is not None and requests.values.find(plain) is None:
            requests.values.add(plain, stored)

    def meta(self, meta: TurnMeta) -> TurnMeta:
        """The graph's interned copy of `meta`."""
        interned: TurnMeta = self._graph._interned.setdefault(meta, meta)
        return interned

    def set_metadata(self, meta: GraphMeta) -> None:
        """The graph's metadata as a file's last `meta` record gives it."""
        self._graph._meta = meta

    def add_drift(self, drift: Drift) -> None:
        """A drift audit record read back (its turn is restored)."""
        graph = self._graph
        if graph._drift is NOT_YET:
            graph._drift = {}
        graph._drift[drift.turn] = drift

    def set_timeline(self, index: int, packed: bytes) -> None:
        """A timeline record read back (its turn is restored)."""
        self._graph._restore_timeline(index, packed)

    def new_turn(self) -> Turn:
        """A fresh turn for the reader to build (over an out-of-process store, one whose
        record can be kept there: see `turn_records`)."""
        return self._graph._blank_turn()

    def commit(
        self,
        turn: Turn,
        keys: IndexKeys,
        moves: list[tuple[Turn, LinkKind]],
        refs: _Refs | None = None,
    ) -> None:
        """File a fully built turn: indexes, children, re-links, as `add_turn` does. Over an
        out-of-process store its record is put there first (a store error propagates: the
        graph being read is dropped). `refs`: the blobs its tail and its response refer to,
        each reference once, as the reader's check of them found (else they are walked)."""
        graph = self._graph
        sent = graph._sent_by(turn, refs)  # (before its record is sealed: nothing fetched)
        records = graph._records
        if records is not None:
            records.seal(turn, records.put(turn))
        graph._commit(turn, keys, moves, sent)


_FIELDS: dict[str, Callable[[Graph, Turn], Any]] = {
    "prompt_ids": lambda g, t: materialize.prompt_ids(t),
    "sampled_ids": lambda g, t: materialize.sampled_ids(t),
    "sampled_logprobs": lambda g, t: materialize.logprobs(t, g.blobs),
    "request_messages": lambda g, t: materialize.request_messages(t, g.blobs),
    "request_tools": lambda g, t: materialize.value(t.tools, g.blobs),
    "sampling_params": lambda g, t: materialize.value(t.sampling, g.blobs),
    "requested_sampling_params": lambda g, t: materialize.value(t.requested, g.blobs),
    "response_message": lambda g, t: materialize.value(t.response, g.blobs),
}


def _no_string(index: int) -> str:
    """A blob lookup for counting messages: what the strings are does not matter."""
    return ""

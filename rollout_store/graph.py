"""The rollout graph: turns stored as references, linked to their parents by prefix.

A turn keeps small references, never copies: its request is the request of an earlier turn
plus a packed tail of what is new, its prompt is its parent's tokens plus new ones, and long
strings are handles into the graph's blob table. Parents are found through prefix-digest
indexes, every hit confirmed by exact comparison.
"""

from __future__ import annotations

import functools
import os
import threading
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import msgpack
import xxhash

from .blobs import BlobTable
from .encoding import EXT_ECHO, NotPackable, array_header, plain_default, unpack
from .errors import DuplicateNodeError, InvalidValueError, RolloutStoreError
from .intake import Encoder, float_array, token_array
from .messages import leading_system_count, link_key
from .tokens import (
    BLOCK,
    TokenRun,
    block_digests,
    prefix_digest,
    run_bytes,
    run_list,
    run_matches,
)
from .values import ValueTable

__all__ = ["RolloutGraph", "TurnNode", "Sequence"]

_ECHO_PACKED = msgpack.packb(msgpack.ExtType(EXT_ECHO, b""))
assert len(_ECHO_PACKED) == 3  # the inline comparison in _request_matches counts on it

# How a turn was linked to its parent.
LINK_NONE, LINK_TOKENS, LINK_MESSAGES, LINK_EXPLICIT = 0, 1, 2, 3
LINK_NAMES = ("none", "tokens", "messages", "explicit")

_SCALAR_NAMES = ("model", "finish_reason", "harness_session_id", "system_digest")

# Turn.flags bits
_TAIL_REFS = 1  # the tail holds blob references (or other ext types): compare after expanding
_RESPONSE_REFS = 2
_MESSAGES_TUPLE = 4  # request_messages was a tuple
_LOGPROBS_PACKED = 8  # sampled_logprobs kept as a packed JSON value, not array('d')
_NO_MESSAGES = 16  # request_messages was None
_TAIL_ECHO = 32  # the tail starts with a placeholder for the base turn's response
# the packing holds tuples, big ints or lone surrogates: a byte match is trusted only after
# the fresh value passes the validating walk (a caller's msgpack.ExtType could imitate them)
_TAIL_SPECIAL = 64
_RESPONSE_SPECIAL = 128
# derived, not stored: the tail cannot be compared by bytes alone (see finish_tail)
_TAIL_SLOW = 256


_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    """Run a query under the graph's lock, so it sees no turn half added."""

    @functools.wraps(method)
    def locked(self: RolloutGraph, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


@dataclass(slots=True)
class TurnNode:
    """One model call of a rollout: what the harness sent and what came back.

    Pass it to `RolloutGraph.add_turn`; `RolloutGraph.get` returns one rebuilt from storage.
    `index` and, unless given, `node_id`, `parent_id`, `n_tools` and `system_digest` are set
    by the graph.
    """

    node_id: str | None = None
    prompt_ids: list[int] | None = None
    sampled_ids: list[int] | None = None
    sampled_logprobs: list[float] | None = None
    parent_id: str | None = None
    index: int | None = None
    model: str | None = None
    finish_reason: str | None = None
    harness_session_id: str | None = None
    system_digest: str | None = None
    n_tools: int | None = None
    request_messages: list[Any] | None = None
    request_tools: list[Any] | None = None
    sampling_params: dict[str, Any] | None = None
    response_message: dict[str, Any] | None = None


Sequence = dict[str, Any]


assert [f.name for f in fields(TurnNode)] == [
    "node_id",
    "prompt_ids",
    "sampled_ids",
    "sampled_logprobs",
    "parent_id",
    "index",
    *_SCALAR_NAMES,
    "n_tools",
    "request_messages",
    "request_tools",
    "sampling_params",
    "response_message",
], "add_turn builds TurnNode positionally"


class _Scratch:
    """What add_turn works out before committing a turn; dropped afterwards."""

    __slots__ = (
        "message_parent",
        "moves",
        "pending",
        "prompt_key",
        "request_digest",
        "rest_plains",
        "root_keys",
        "token_key",
        "token_parent",
        "twins",
    )

    def __init__(self) -> None:
        self.pending: list[tuple[bytes, bytes]] = []
        self.token_parent: _Turn | None = None
        self.token_key: int | None = None  # block digest of prompt+sampled at its last block
        self.prompt_key: int | None = None
        self.message_parent: _Turn | None = None
        self.request_digest: int | None = None
        # keys of this request's shorter prefixes, under which it waits as a message root
        # for an earlier turn that arrives late
        self.root_keys: list[int] | None = None
        self.rest_plains: list[bytes | None] | None = None
        self.twins: list[_Turn] = []  # stored turns with exactly this request, and children
        self.moves: list[tuple[_Turn, int]] = []


class _Turn:
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
        "response",
        "sampled",
        "sampling",
        "system",
        "tail",
        "tools",
    )

    node_id: str
    index: int
    parent: _Turn | None
    children: tuple[_Turn, ...] | None  # a tuple: smaller than a list, and rarely changed
    link: int
    flags: int
    # meta: (model, finish_reason, harness_session_id, system_digest, n_tools), interned
    meta: tuple[Any, ...]
    system: bytes | None  # packed leading system messages (a stream), shared via ValueTable
    base: _Turn | None  # the turn whose non-system request this one extends
    tail: bytes  # packed non-system messages after the base's
    n_rest: int  # number of non-system request messages
    first: int  # the first of them that the tail holds (the base holds those before)
    body_start: int  # where in the tail the packed messages after the echo begin
    response: bytes | None
    tools: bytes | None
    sampling: bytes | None
    prompt: TokenRun | None
    sampled: Any  # array | tuple | None
    full: TokenRun | None  # prompt + sampled, the prefix a child's prompt extends
    logprobs: Any  # array('d') | packed bytes | None


class RolloutGraph:
    """Turns of one or many rollouts, with memory proportional to unique content.

    `share_threshold`: strings of at least this many characters are stored once in the
    graph's blob table (`None` disables string sharing; messages and tokens are still
    shared). Safe to use from many threads: `add_turn` is serialized by a lock.
    """

    def __init__(self, share_threshold: int | None = 1024) -> None:
        if share_threshold is not None and (
            not isinstance(share_threshold, int) or share_threshold < 1
        ):
            raise ValueError("share_threshold must be a positive int or None")
        self.share_threshold = share_threshold
        self._blobs = BlobTable()
        # a reusable packer (packb builds one per call); used under the lock only, and
        # replaced after each turn so a large message's buffer is not kept
        self._pack_plain = _packer()
        self._encoder = Encoder(self._blobs, share_threshold)
        self._canonical = Encoder(None, None)  # plain packing by the validating walk
        self._values = ValueTable(self._expand, share_threshold)
        self._turns: list[_Turn] = []
        self._blob_marks = array("I")  # blobs stored once each turn was committed, for save
        self._by_id: dict[str, _Turn] = {}
        self._meta: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self._request_index: dict[int, Any] = {}  # digest of non-system request -> turn(s)
        self._token_index: dict[int, Any] = {}  # block digest of prompt+sampled -> turn(s)
        self._prompt_index: dict[int, Any] = {}  # digest of a whole prompt -> TokenRun(s)
        self._token_roots: dict[int, Any] = {}  # block digests of token roots' prompts
        self._short_lengths: set[int] = set()  # lengths under one block that turns have
        self._message_roots: dict[int, Any] = {}  # request keys of message roots' prefixes
        self._lock = threading.RLock()
        # Called with (turn, first new blob index, scratch) before a turn is committed; a
        # listener that raises rejects the turn (the append-mode file writer is one).
        self._listeners: list[Callable[[_Turn, int, _Scratch], None]] = []
        self._closers: list[Callable[[], None]] = []
        self._closed = False  # the file behind an appending graph was closed
        self._log_path: str | None = None  # that file, while it is open
        #: Set by `load` and `open`: how much of the file was good (a storage.LoadReport).
        self.load_report: Any = None

    @property
    def blobs(self) -> BlobTable:
        """The graph's blob table (its `stats()` are part of `RolloutGraph.stats()`)."""
        return self._blobs

    @blobs.setter
    def blobs(self, table: BlobTable) -> None:
        # allowed on an empty graph only: for a table with another hasher (tests inject
        # colliding hashes this way)
        with self._lock:
            if self._turns or len(self._blobs):
                raise ValueError("the blob table of a graph that holds turns cannot change")
            self._blobs = table
            self._encoder = Encoder(table, self.share_threshold)

    # ------------------------------------------------------------------ files
    # Thin doors to `storage`, which sits above this module; imported late on purpose.

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the graph to `path` atomically (temporary file, fsync, rename)."""
        from . import storage

        storage.save(self, path)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        recover: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> RolloutGraph:
        """Read a file written by `save` or `open`; see `storage.load`."""
        from . import storage

        return storage.load(path, recover=recover, progress=progress)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        share_threshold: int | None = 1024,
        fsync: str | int = "turn",
        repair: bool = False,
    ) -> RolloutGraph:
        """A graph that appends every added turn to `path` durably; see `storage.open_append`.

        `fsync`: "turn" (every turn), an int N (every N turns) or "never". Close it (or use
        it as a context manager) to flush the last turns.
        """
        from . import storage

        return storage.open_append(
            path, share_threshold=share_threshold, fsync=fsync, repair=repair
        )

    def close(self) -> None:
        """Flush and close the file behind an appending graph (a no-op otherwise).

        Afterwards `add_turn` raises: a turn added then would never reach the file.
        """
        with self._lock:
            closers, self._closers = self._closers, []
            if closers:
                self._closed = True
            self._listeners.clear()
            for close in closers:
                close()

    def __enter__(self) -> RolloutGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _inverted_keys(self) -> dict[int, list[Any]]:
        """Each turn's index keys (request, token, prompt, root prefixes), for `save`."""
        keys: dict[int, list[Any]] = {t.index: [None, None, None, None] for t in self._turns}
        for slot, index in ((0, self._request_index), (1, self._token_index)):
            for key, found in index.items():
                for turn in _members(found):
                    keys[turn.index][slot] = key
        for key, found in self._message_roots.items():
            for turn in _members(found):
                root_keys = keys[turn.index][3]
                if root_keys is None:
                    keys[turn.index][3] = root_keys = []
                root_keys.append(key)
        prompt_keys = {
            id(run): key for key, found in self._prompt_index.items() for run in _members(found)
        }
        for turn in self._turns:
            if turn.prompt is not None:
                keys[turn.index][2] = prompt_keys.get(id(turn.prompt))
        return keys

    # ------------------------------------------------------------------ intake

    def add_turn(self, node: TurnNode) -> TurnNode:
        """Record one turn; returns a copy of `node` with `index`, `node_id`, `parent_id` set.

        Raises `InvalidValueError` (a `TypeError` and `ValueError`) naming the path of a bad
        value, or `DuplicateNodeError`; on any error the graph is exactly as before.
        """
        if not isinstance(node, TurnNode):
            raise TypeError(f"add_turn expects a TurnNode, got {type(node).__name__}")
        with self._lock:
            if self._closed:
                raise RolloutStoreError("the graph's file is closed: reopen it to add turns")
            mark = self.blobs.mark()
            try:
                turn, scratch = self._prepare(node)
                # a turn never moves under its own descendant (no cycles, whatever links)
                scratch.moves = [
                    move for move in self._find_moves(turn, scratch) if not _above(move[0], turn)
                ]
                for listener in self._listeners:
                    listener(turn, mark[0], scratch)
            except BaseException:
                self.blobs.rollback(mark)
                raise
            finally:
                self._pack_plain = _packer()
            self._commit(turn, scratch)
            meta = turn.meta
            parent = turn.parent
            # positional: dataclasses.replace costs more than the rest of a small turn
            return TurnNode(
                turn.node_id,
                node.prompt_ids,
                node.sampled_ids,
                node.sampled_logprobs,
                parent.node_id if parent is not None else None,
                turn.index,
                node.model,
                node.finish_reason,
                node.harness_session_id,
                meta[3],
                meta[4],
                node.request_messages,
                node.request_tools,
                node.sampling_params,
                node.response_message,
            )

    def _prepare(self, node: TurnNode) -> tuple[_Turn, _Scratch]:
        turn = _Turn()
        scratch = _Scratch()
        pending = scratch.pending
        node_id = node.node_id
        if node_id is None:
            node_id = self._fresh_id()
        elif not isinstance(node_id, str):
            raise InvalidValueError(f"expected str, got {type(node_id).__name__}", "node_id")
        elif node_id in self._by_id:
            raise DuplicateNodeError(f"node_id {node_id!r} is already in the graph")
        turn.node_id = node_id
        turn.index = len(self._turns)
        turn.children = None
        turn.flags = 0
        explicit = None
        if node.parent_id is not None:
            explicit = self._by_id.get(node.parent_id) if isinstance(node.parent_id, str) else None
            if explicit is None:
                raise InvalidValueError(f"unknown parent {node.parent_id!r}", "parent_id")
        scalars = (node.model, node.finish_reason, node.harness_session_id, node.system_digest)
        for name, value in zip(_SCALAR_NAMES, scalars, strict=True):
            if value is not None and not isinstance(value, str):
                raise InvalidValueError(f"expected str or None, got {type(value).__name__}", name)
        n_tools = node.n_tools
        if n_tools is not None and not (type(n_tools) is int and 0 <= n_tools < 2**63):
            raise InvalidValueError(
                f"expected a non-negative int below 2**63 or None, got {n_tools!r}", "n_tools"
            )

        self._prepare_tokens(turn, node, scratch)
        system_plain = self._prepare_request(turn, node, scratch)
        turn.response = self._encode_response(node.response_message, turn)
        turn.tools = self._shared_value(node.request_tools, "request_tools", pending)
        turn.sampling = self._shared_value(node.sampling_params, "sampling_params", pending)

        if n_tools is None and isinstance(node.request_tools, list | tuple):
            n_tools = len(node.request_tools)
        system_digest = node.system_digest
        if system_digest is None and system_plain is not None:
            system_digest = xxhash.xxh3_128_hexdigest(system_plain)
        meta = (node.model, node.finish_reason, node.harness_session_id, system_digest, n_tools)
        turn.meta = meta  # interned at commit

        # Linking: an explicit parent wins, then tokens, then messages.
        if explicit is not None:
            turn.parent, turn.link = explicit, LINK_EXPLICIT
        elif scratch.token_parent is not None:
            turn.parent, turn.link = scratch.token_parent, LINK_TOKENS
        elif turn.prompt is None and scratch.message_parent is not None:
            turn.parent, turn.link = scratch.message_parent, LINK_MESSAGES
        else:
            turn.parent, turn.link = None, LINK_NONE
            plains = scratch.rest_plains
            if plains is not None and turn.prompt is None:
                scratch.root_keys = [request_key(plains, m) for m in range(1, len(plains))]
        return turn, scratch

    def _fresh_id(self) -> str:
        # derived from the turn count, so a rejected turn uses up no id
        n = len(self._turns)
        while f"turn-{n}" in self._by_id:
            n += 1
        return f"turn-{n}"

    # -- values

    def _encode(self, value: Any, path: str) -> tuple[bytes, bool]:
        return self._encoder.encode(value, path)

    def _encode_response(self, value: Any, turn: _Turn) -> bytes | None:
        if value is None:
            return None
        packed, special = self._encode(value, "response_message")
        if packed != self._plain(value):
            turn.flags |= _RESPONSE_REFS
        if special:
            turn.flags |= _RESPONSE_SPECIAL
        return packed

    def _shared(
        self,
        items: list[Any] | tuple[Any, ...],
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
            found = self._values.find(plain)
            if found is None:
                found = next((stored for p, stored in pending if p == plain), None)
            if found is not None:
                return found
        if as_array:
            packed = [self._encode(item, f"{path}[{i}]") for i, item in enumerate(items)]
        else:
            packed = [self._encode(items[0], path)]
        stored = header + b"".join(b for b, _ in packed)
        if plain is not None and not any(special for _, special in packed):
            pending.append((plain, stored))
        return stored

    def _shared_value(self, value: Any, path: str, pending: list[tuple[bytes, bytes]]) -> Any:
        if value is None:
            return None
        return self._shared([value], path, [self._plain(value)], pending, as_array=False)

    def _valid(self, value: Any, plain: bytes | None) -> bool:
        """Whether `plain` is the packing of `value` by the validating walk."""
        try:
            return plain is not None and self._canonical.encode(value, "")[0] == plain
        except InvalidValueError:
            return False

    def _is_echo(self, base: _Turn, message: Any, plain: bytes | None) -> bool:
        """Whether `message` is exactly the response of `base`."""
        if plain is None or base.response is None or plain != self._response_plain(base):
            return False
        return not base.flags & _RESPONSE_SPECIAL or self._valid(message, plain)

    # -- tokens

    def _prepare_tokens(self, turn: _Turn, node: TurnNode, scratch: _Scratch) -> None:
        prompt = None if node.prompt_ids is None else token_array(node.prompt_ids, "prompt_ids")
        sampled = None if node.sampled_ids is None else token_array(node.sampled_ids, "sampled_ids")
        logprobs = node.sampled_logprobs
        if logprobs is None:
            turn.logprobs = None
        else:
            packed_floats = float_array(logprobs, "sampled_logprobs")
            if packed_floats is not None:
                turn.logprobs = packed_floats
            else:
                turn.logprobs = self._encode(logprobs, "sampled_logprobs")[0]
                turn.flags |= _LOGPROBS_PACKED
        turn.sampled = sampled
        if prompt is None:
            turn.prompt = None
            turn.full = full_run(None, sampled)
            return
        compact = isinstance(prompt, array) and prompt.typecode == "I"
        run: TokenRun | None = None
        if compact:
            data = prompt.tobytes()
            digests = block_digests(data)
            parent = self._find_token_parent(data, digests, len(prompt))
            scratch.token_parent = parent
            key = xxhash.xxh3_64_intdigest(data)
            scratch.prompt_key = key
            for candidate in _members(self._prompt_index.get(key)):
                if candidate.length == len(prompt) and run_matches(candidate, data):
                    run = candidate
                    break
            if run is None:
                if parent is not None:
                    run = TokenRun(parent.full, prompt[parent.full.length :])
                else:
                    run = TokenRun(None, prompt)
        else:
            run = TokenRun(None, prompt)
        turn.prompt = run
        turn.full = full_run(run, sampled)
        if compact and turn.full.compact:
            full_data = data if turn.full is run else data + sampled.tobytes()  # type: ignore[union-attr]
            length = turn.full.length
            if length < BLOCK:
                scratch.token_key = short_key(full_data, length)
            elif turn.full is run:
                scratch.token_key = digests[length // BLOCK]
            else:
                scratch.token_key = prefix_digest(full_data, length)

    def _find_token_parent(self, data: bytes, digests: list[int], n: int) -> _Turn | None:
        # Turns whose tokens fill j whole blocks are found by the digest of those blocks,
        # deepest first; shorter ones (under one block) by their exact length.
        buckets = [(digests[j], j * BLOCK, (j + 1) * BLOCK) for j in range(len(digests) - 1, 0, -1)]
        buckets += [
            (short_key(data, length), length, length + 1)
            for length in sorted(self._short_lengths, reverse=True)
            if length <= n
        ]
        for key, low, high in buckets:
            best: _Turn | None = None
            for candidate in _members(self._token_index.get(key)):
                full = candidate.full
                if (
                    full is not None
                    and low <= full.length < high
                    and (full.length < n or _sampled_any(candidate))
                    and (best is None or full.length > best.full.length)  # type: ignore[union-attr]
                    and run_matches(full, data)
                ):
                    best = candidate
            if best is not None:
                return best
        return None

    # -- request messages

    def _prepare_request(self, turn: _Turn, node: TurnNode, scratch: _Scratch) -> bytes | None:
        """Store the request as system part + base turn + tail; return the system plain."""
        messages = node.request_messages
        pending = scratch.pending
        if messages is None:
            turn.system, turn.base, turn.tail, turn.n_rest = None, None, b"", 0
            turn.first = turn.body_start = 0
            turn.flags |= _NO_MESSAGES
            return None
        if not isinstance(messages, list | tuple):
            raise InvalidValueError(
                f"expected a list of messages, got {type(messages).__name__}", "request_messages"
            )
        if isinstance(messages, tuple):
            turn.flags |= _MESSAGES_TUPLE
        n_sys = leading_system_count(messages)
        try:
            pack = self._pack_plain
            plains: list[bytes | None] = [pack(m) for m in messages]
        except Exception:  # some message needs the slow path: find which
            plains = [self._plain(m) for m in messages]

        # system part: shared whole through the value table
        system_plain = None
        turn.system = None
        if n_sys:
            turn.system = self._shared(
                messages[:n_sys], "request_messages", plains[:n_sys], pending, as_array=True
            )
            if None not in plains[:n_sys]:
                system_plain = b"".join(plains[:n_sys])  # type: ignore[arg-type]

        rest = messages[n_sys:]
        rest_plains = plains[n_sys:]
        n_valid = rest_plains.index(None) if None in rest_plains else len(rest_plains)
        scratch.request_digest = request_key(rest_plains, n_valid) if n_valid == len(rest) else None
        if n_valid == len(rest):
            scratch.rest_plains = rest_plains  # for root_keys, if this turn stays a root

        want_parent = node.parent_id is None and node.prompt_ids is None
        base: _Turn | None = None
        parent: _Turn | None = None
        confirmed: dict[int, bool] = {}

        def exact(candidate: _Turn) -> bool:
            ok = confirmed.get(candidate.index)
            if ok is None:
                ok = self._request_matches(candidate, rest_plains, rest)
                if ok:  # so are the requests this one extends
                    ancestor = candidate.base
                    while ancestor is not None and ancestor.index not in confirmed:
                        confirmed[ancestor.index] = True
                        ancestor = ancestor.base
                confirmed[candidate.index] = ok
            return ok

        # Deepest first: the storage base is the longest stored request that this one
        # extends; the parent, the longest whose response is echoed next (an exact echo
        # preferred to a loose one).
        for j in range(n_valid, -1, -1):
            can_link = want_parent and j < len(rest)
            if base is not None and not can_link:
                if not want_parent:
                    break
                continue
            key = request_key(rest_plains, j)
            members = [c for c in _members(self._request_index.get(key)) if c.n_rest == j]
            if not members:
                continue
            if base is None:
                base = next((c for c in members if exact(c)), None)
                if base is None:
                    continue
                if j == len(rest):  # identical requests whose continuations may move here
                    scratch.twins = [c for c in members if c.children and exact(c)]
            if not can_link:
                continue
            message, plain = rest[j], rest_plains[j]
            parent = next(
                (c for c in members if self._is_echo(c, message, plain) and exact(c)), None
            ) or next((c for c in members if self._echoes(c, message, plain) and exact(c)), None)
            if parent is not None:
                break
        scratch.message_parent = parent

        start = base.n_rest if base is not None else 0
        pieces: list[bytes] = []
        for i in range(start, len(rest)):
            p = rest_plains[i]
            if i == start and base is not None and self._is_echo(base, rest[i], p):
                pieces.append(_ECHO_PACKED)
                turn.flags |= _TAIL_ECHO
                continue
            packed, special = self._encode(rest[i], f"request_messages[{n_sys + i}]")
            if packed != p:
                turn.flags |= _TAIL_REFS
            if special:
                turn.flags |= _TAIL_SPECIAL
            pieces.append(packed)
        turn.base = base
        turn.tail = array_header(len(pieces)) + b"".join(pieces)
        turn.n_rest = len(rest)
        finish_tail(turn)
        return system_plain

    def _request_matches(
        self, turn: _Turn, plains: list[bytes | None], messages: list[Any] | tuple[Any, ...]
    ) -> bool:
        """Whether the non-system request of `turn` is exactly `messages[:turn.n_rest]`.

        `plains` are the messages' plain packings; the stored tails are compared with them
        byte for byte, after rebuilding tails that hold blob references.
        """
        end = turn.n_rest
        if end > len(plains):
            return False
        join = b"".join
        node: _Turn | None = turn
        try:
            while node is not None:
                start = node.first
                if node.flags & _TAIL_SLOW:
                    if not self._tail_matches(node, plains, messages, start, end):
                        return False
                else:
                    # the common case inline: a plain tail, maybe after the echo of the
                    # base's plain response
                    if node.flags & _TAIL_ECHO:
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
        turn: _Turn,
        plains: list[bytes | None],
        messages: list[Any] | tuple[Any, ...],
        start: int,
        end: int,
    ) -> bool:
        """Whether the tail of `turn` is exactly `messages[start:end]`."""
        tail = turn.tail
        i = start
        echo = turn.flags & _TAIL_ECHO
        if echo:
            base = turn.base
            if i >= end or base is None or not self._is_echo(base, messages[i], plains[i]):
                return False
            i += 1
        if turn.flags & _TAIL_REFS:
            # blob references: rebuild the values (blobs are the table's own strings, no
            # copy) and pack them with every string inline, then compare bytes
            try:
                values = unpack(tail, self.blobs.string, _no_echo)
            except ValueError:  # a stored value that cannot be rebuilt never matches
                return False
            if echo:
                del values[0]
            if len(values) != end - i:
                return False
            plain = self._plain
            if any(plain(value) != plains[k] for k, value in enumerate(values, i)):
                return False
        else:
            try:
                joined = b"".join(plains[i:end])  # type: ignore[arg-type]
            except TypeError:  # a message with no plain packing
                return False
            overhead = len(array_header(end - start)) + (i - start) * len(_ECHO_PACKED)
            if len(joined) + overhead != len(tail) or not tail.endswith(joined):
                return False
        if turn.flags & _TAIL_SPECIAL:
            return all(self._valid(messages[k], plains[k]) for k in range(i, end))
        return True

    def _plain(self, value: Any) -> bytes | None:
        """The exact packing of a value with every string inline, or None if it is invalid.

        msgpack packs almost every value at C speed; lone surrogates, subclasses and very deep
        tuples take the validating walk (with no blob table) instead.
        """
        try:
            return self._pack_plain(value)
        except (NotPackable, ValueError, TypeError, OverflowError, RecursionError, BufferError):
            pass
        try:
            return self._canonical.encode(value, "")[0]
        except (InvalidValueError, RecursionError):
            return None

    def _expand(self, stored: bytes) -> bytes | None:
        """The plain packing of a stored value: its blobs inline again."""
        try:
            return self._plain(unpack(stored, self.blobs.string))
        except ValueError:
            return None

    def _response_value(self, turn: _Turn) -> Any:
        return None if turn.response is None else unpack(turn.response, self.blobs.string)

    def _response_plain(self, turn: _Turn) -> bytes | None:
        if turn.response is None:
            return None
        if not turn.flags & _RESPONSE_REFS:
            return turn.response
        return self._expand(turn.response)

    def _echoes(self, turn: _Turn, message: Any, plain: bytes | None) -> bool:
        """Whether `message` is the echo of the turn's response (exactly or loosely)."""
        if turn.response is None:
            return False
        if self._is_echo(turn, message, plain):
            return True
        try:
            return bool(link_key(self._response_value(turn)) == link_key(message))
        except Exception:  # a malformed fresh message simply does not match
            return False

    # ------------------------------------------------------------------ commit

    def _commit(self, turn: _Turn, scratch: _Scratch) -> None:
        for plain, stored in scratch.pending:
            self._values.add(plain, stored)
        turn.meta = self._meta.setdefault(turn.meta, turn.meta)
        self._turns.append(turn)
        self._blob_marks.append(len(self.blobs))
        self._by_id[turn.node_id] = turn
        if turn.parent is not None:
            _add_child(turn.parent, turn)
        if scratch.request_digest is not None and not turn.flags & _NO_MESSAGES:
            _index_add(self._request_index, scratch.request_digest, turn)
        if scratch.token_key is not None and turn.full is not None and turn.full.length:
            _index_add(self._token_index, scratch.token_key, turn)
            if turn.full.length < BLOCK:
                self._short_lengths.add(turn.full.length)
        if scratch.prompt_key is not None and turn.prompt is not None:
            members = _members(self._prompt_index.get(scratch.prompt_key))
            if not any(m is turn.prompt for m in members):
                _index_add(self._prompt_index, scratch.prompt_key, turn.prompt)
        for other, link in scratch.moves:
            self._move(other, turn, link)
        if turn.parent is None:
            self._register_root(turn, scratch.root_keys)

    def _register_root(self, turn: _Turn, root_keys: list[int] | None) -> None:
        if turn.prompt is not None:
            for key in _root_token_keys(turn.prompt):
                _index_add(self._token_roots, key, turn)
        elif root_keys:
            for key in root_keys:
                _index_add(self._message_roots, key, turn)

    def _unregister_root(self, turn: _Turn) -> None:
        if turn.prompt is not None:
            for key in _root_token_keys(turn.prompt):
                _index_remove(self._token_roots, key, turn)
        elif turn.n_rest > 1:
            plains = [self._plain(m) for m in self._rest_values(turn)]
            for m in range(1, len(plains)):
                _index_remove(self._message_roots, request_key(plains, m), turn)

    def _find_moves(self, new: _Turn, scratch: _Scratch) -> list[tuple[_Turn, int]]:
        """Turns that arrived before `new` but continue it: they move under it at commit."""
        moves: list[tuple[_Turn, int]] = []
        if new.link == LINK_EXPLICIT:
            return moves
        moves.extend(self._token_moves(new, scratch))
        moves.extend(self._message_moves(new, scratch))
        return moves

    def _token_moves(self, new: _Turn, scratch: _Scratch) -> list[tuple[_Turn, int]]:
        """Turns whose prompt extends the tokens of `new` and that hang shallower."""
        moves: list[tuple[_Turn, int]] = []
        parent = new.parent
        if new.prompt is not None:
            if new.full is None or not new.full.compact or not new.full.length:
                return moves
            data = run_bytes(new.full)
            if parent is not None:
                candidates = list(parent.children or ())
            elif new.full.length >= BLOCK:
                candidates = list(_members(self._token_roots.get(scratch.token_key)))
            elif new.full.length >= _HEADS[0]:
                head = max(h for h in _HEADS if h <= new.full.length)
                candidates = list(_members(self._token_roots.get(short_key(data, head))))
            else:  # fewer tokens than the shortest head: every root is a candidate
                candidates = [t for t in self._turns if t.parent is None]
            # and children of turns whose tokens end inside this turn's sampled ones (a
            # shorter retry of the same call): their continuations may continue this one
            for shorter in self._prefixes_within(new, data):
                candidates.extend(shorter.children or ())
            for other in candidates:
                if (
                    other is new
                    or other.link not in (LINK_TOKENS, LINK_NONE)
                    or other.prompt is None
                    or other.prompt.length < new.full.length
                    or (other.prompt.length == new.full.length and not _sampled_any(new))
                    or not other.prompt.compact
                ):
                    continue
                if run_bytes(other.prompt).startswith(data):
                    moves.append((other, LINK_TOKENS))
        return moves

    def _prefixes_within(self, new: _Turn, data: bytes) -> list[_Turn]:
        """Stored turns whose prompt + sampled tokens are a prefix of `new`'s, longer than its
        prompt and shorter than its prompt + sampled tokens."""
        low = new.prompt.length  # type: ignore[union-attr]
        high = new.full.length  # type: ignore[union-attr]
        if high <= low:
            return []
        found: list[_Turn] = []
        first = max(low // BLOCK, 1)
        view = memoryview(data)
        hasher = xxhash.xxh3_64()
        hasher.update(view[: first * BLOCK * 4])  # one pass over the tokens, not one a block
        keys = [(hasher.intdigest(), first * BLOCK, (first + 1) * BLOCK)]
        for j in range(first + 1, high // BLOCK + 1):
            hasher.update(view[(j - 1) * BLOCK * 4 : j * BLOCK * 4])
            keys.append((hasher.intdigest(), j * BLOCK, (j + 1) * BLOCK))
        if first * BLOCK > high:
            keys = []
        keys += [(short_key(data, n), n, n + 1) for n in self._short_lengths if low < n < high]
        for key, start, stop in keys:
            for other in _members(self._token_index.get(key)):
                full = other.full
                if (
                    other is not new
                    and full is not None
                    and low < full.length < high
                    and start <= full.length < stop
                    and run_matches(full, data)
                ):
                    found.append(other)
        return found

    def _message_moves(self, new: _Turn, scratch: _Scratch) -> list[tuple[_Turn, int]]:
        """Message-linked turns whose request continues `new` and that hang shallower.

        For a turn linked by tokens only message roots are candidates (its place among
        message-linked turns is not worked out)."""
        moves: list[tuple[_Turn, int]] = []
        parent = new.parent
        if new.flags & _NO_MESSAGES:
            return moves
        if parent is not None and new.prompt is None:
            candidates = list(parent.children or ())
        elif scratch.request_digest is not None:
            candidates = list(_members(self._message_roots.get(scratch.request_digest)))
        else:
            return moves
        mine = None
        for twin in scratch.twins:
            # a continuation linked loosely to a twin moves here if it echoes this response
            # exactly and the twin's only loosely
            for other in list(twin.children or ()):
                if other.link != LINK_MESSAGES or other.prompt is not None:
                    continue
                echo = _plain_or_none(self, self._rest_values(other), new.n_rest)
                exact_here = echo is not None and echo == self._response_plain(new)
                if exact_here and echo != self._response_plain(twin):
                    moves.append((other, LINK_MESSAGES))
        for other in candidates:
            if (
                other is new
                or other.link not in (LINK_MESSAGES, LINK_NONE)
                or other.prompt is not None
                or other.n_rest <= new.n_rest
            ):
                continue
            if mine is None:
                mine = self._rest_values(new)
            theirs = self._rest_values(other)
            if self._plain(theirs[: new.n_rest]) == self._plain(mine):
                echo = theirs[new.n_rest]
                if self._echoes(new, echo, self._plain(echo)):
                    moves.append((other, LINK_MESSAGES))
        return moves

    def _move(self, turn: _Turn, parent: _Turn, link: int) -> None:
        old = turn.parent
        if old is not None and old.children is not None:
            old.children = tuple(c for c in old.children if c is not turn) or None
        else:
            self._unregister_root(turn)
        turn.parent = parent
        turn.link = link
        _add_child(parent, turn)

    # ------------------------------------------------------------------ materialize

    def _rest_values(self, turn: _Turn) -> list[Any]:
        chain: list[_Turn] = []
        node: _Turn | None = turn
        while node is not None:
            chain.append(node)
            node = node.base
        out: list[Any] = []
        for owner in reversed(chain):
            base = owner.base
            echo = (lambda b=base: self._response_value(b)) if base is not None else None
            out.extend(unpack(owner.tail, self.blobs.string, echo))
        return out

    def _request_messages(self, turn: _Turn) -> list[Any] | tuple[Any, ...] | None:
        if turn.flags & _NO_MESSAGES:
            return None
        messages: list[Any] = []
        if turn.system is not None:
            messages.extend(unpack(turn.system, self.blobs.string))
        messages.extend(self._rest_values(turn))
        return tuple(messages) if turn.flags & _MESSAGES_TUPLE else messages

    def _value(self, packed: bytes | None) -> Any:
        return None if packed is None else unpack(packed, self.blobs.string)

    def _logprobs(self, turn: _Turn) -> Any:
        lp = turn.logprobs
        if lp is None:
            return None
        if turn.flags & _LOGPROBS_PACKED:
            return unpack(lp, self.blobs.string)
        return lp.tolist()

    def _view(self, turn: _Turn) -> TurnNode:
        model, finish_reason, session, system_digest, n_tools = turn.meta
        return TurnNode(
            node_id=turn.node_id,
            prompt_ids=run_list(turn.prompt) if turn.prompt is not None else None,
            sampled_ids=_seg_list(turn.sampled),
            sampled_logprobs=self._logprobs(turn),
            parent_id=turn.parent.node_id if turn.parent is not None else None,
            index=turn.index,
            model=model,
            finish_reason=finish_reason,
            harness_session_id=session,
            system_digest=system_digest,
            n_tools=n_tools,
            request_messages=self._request_messages(turn),
            request_tools=self._value(turn.tools),
            sampling_params=self._value(turn.sampling),
            response_message=self._value(turn.response),
        )

    # ------------------------------------------------------------------ queries

    def _turn(self, node_id: str) -> _Turn:
        try:
            return self._by_id[node_id]
        except (KeyError, TypeError):
            raise KeyError(f"no turn {node_id!r} in the graph") from None

    def __len__(self) -> int:
        return len(self._turns)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._by_id

    @_locked
    def get(self, node_id: str) -> TurnNode:
        """The turn rebuilt from storage: fresh containers, equal to what was recorded."""
        return self._view(self._turn(node_id))

    @_locked
    def request_messages(self, node_id: str) -> list[Any] | tuple[Any, ...] | None:
        return self._request_messages(self._turn(node_id))

    @_locked
    def response_message(self, node_id: str) -> Any:
        return self._value(self._turn(node_id).response)

    @_locked
    def request_tools(self, node_id: str) -> Any:
        return self._value(self._turn(node_id).tools)

    @_locked
    def sampling_params(self, node_id: str) -> Any:
        return self._value(self._turn(node_id).sampling)

    @_locked
    def summary(self, node_id: str) -> dict[str, Any]:
        """The turn's scalar fields and sizes, without rebuilding its messages."""
        turn = self._turn(node_id)
        model, finish_reason, session, system_digest, n_tools = turn.meta
        return {
            "node_id": turn.node_id,
            "index": turn.index,
            "parent_id": turn.parent.node_id if turn.parent is not None else None,
            "link": LINK_NAMES[turn.link],
            "n_prompt": turn.prompt.length if turn.prompt is not None else 0,
            "n_sampled": len(turn.sampled) if turn.sampled is not None else 0,
            "n_tools": n_tools,
            "model": model,
            "finish_reason": finish_reason,
            "harness_session_id": session,
            "system_digest": system_digest,
        }

    @_locked
    def nodes(self) -> list[str]:
        """Node ids in arrival order."""
        return [t.node_id for t in self._turns]

    @_locked
    def roots(self) -> list[str]:
        return [t.node_id for t in self._turns if t.parent is None]

    @_locked
    def leaves(self) -> list[str]:
        return [t.node_id for t in self._turns if not t.children]

    @_locked
    def children(self, node_id: str) -> list[str]:
        return [c.node_id for c in self._turn(node_id).children or ()]

    @_locked
    def parent(self, node_id: str) -> str | None:
        parent = self._turn(node_id).parent
        return parent.node_id if parent is not None else None

    @_locked
    def link_kind(self, node_id: str) -> str:
        """How the turn is linked to its parent: none, tokens, messages or explicit."""
        return LINK_NAMES[self._turn(node_id).link]

    @_locked
    def root_of(self, node_id: str) -> str:
        turn = self._turn(node_id)
        while turn.parent is not None:
            turn = turn.parent
        return turn.node_id

    @_locked
    def path_to(self, node_id: str) -> list[str]:
        """Node ids from the root down to `node_id`."""
        return [t.node_id for t in self._path(self._turn(node_id))]

    def _path(self, turn: _Turn) -> list[_Turn]:
        path = []
        node: _Turn | None = turn
        while node is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    @_locked
    def paths(self) -> list[list[str]]:
        """One path (root to leaf) per leaf, in the leaves' arrival order."""
        return [self.path_to(leaf) for leaf in self.leaves()]

    @_locked
    def forks(self) -> list[str]:
        """Turns with more than one child."""
        return [t.node_id for t in self._turns if t.children and len(t.children) > 1]

    @_locked
    def discarded_nodes(self) -> list[str]:
        """Childless turns with a sibling that continued (retries that were dropped).

        Roots with an identical prompt (token ids or, without them, request messages) count as
        siblings, so a retried first call is found too.
        """
        discarded: set[int] = set()
        groups: list[list[_Turn]] = [list(t.children) for t in self._turns if t.children]
        by_prompt: dict[Any, list[_Turn]] = {}
        for root in self._turns:
            if root.parent is None:
                by_prompt.setdefault(self._prompt_identity(root), []).append(root)
        groups.extend(by_prompt.values())
        for group in groups:
            if len(group) > 1 and any(t.children for t in group):
                discarded.update(t.index for t in group if not t.children)
        return [t.node_id for t in self._turns if t.index in discarded]

    def _prompt_identity(self, turn: _Turn) -> Any:
        if turn.prompt is not None:
            return ("tokens", tuple(run_list(turn.prompt)))
        messages = self._request_messages(turn)
        return ("messages", self._plain(messages) if messages else b"")

    @_locked
    def sequence_for(self, node_id: str) -> Sequence:
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
        chain_runs: set[int] = set()
        run = full
        while run is not None:
            chain_runs.add(id(run))
            run = run.prev
        for turn in path:
            if turn.full is None or turn.prompt is None or turn.sampled is None:
                continue
            end = turn.full.length
            start = turn.prompt.length
            if end > n or end == start:
                continue
            if id(turn.full) not in chain_runs and input_ids[:end] != run_list(turn.full):
                continue
            lp = turn.logprobs
            if lp is None or turn.flags & _LOGPROBS_PACKED or len(lp) != end - start:
                continue
            mask[start:end] = [1] * (end - start)
            logprobs[start:end] = lp.tolist()
        root = path[0]
        return {
            "input_ids": input_ids,
            "loss_mask": mask,
            "logprobs": logprobs,
            "node_ids": [t.node_id for t in path],
            "prompt_len": root.prompt.length if root.prompt is not None else 0,
            "root_id": root.node_id,
            "n_turns": len(path),
        }

    @_locked
    def sequences(self) -> list[Sequence]:
        """One training sequence per leaf."""
        return [self.sequence_for(leaf) for leaf in self.leaves()]

    @_locked
    def stats(self) -> dict[str, int]:
        """Counts of turns, structure and storage."""
        stored_tokens = 0
        seen: set[int] = set()
        system_counts: dict[int, int] = {}
        messages_received = tokens_received = 0
        for turn in self._turns:
            if turn.system is not None:
                count = system_counts.get(id(turn.system))
                if count is None:
                    count = len(unpack(turn.system, self.blobs.string))
                    system_counts[id(turn.system)] = count
                messages_received += count
            messages_received += turn.n_rest
            if turn.prompt is not None:
                tokens_received += turn.prompt.length
                tokens_received += len(turn.sampled) if turn.sampled is not None else 0
            run = turn.full
            while run is not None and id(run) not in seen:
                seen.add(id(run))
                stored_tokens += len(run.seg)
                run = run.prev
        out = {
            "turns": len(self._turns),
            "roots": sum(1 for t in self._turns if t.parent is None),
            "leaves": sum(1 for t in self._turns if not t.children),
            "forks": sum(1 for t in self._turns if t.children and len(t.children) > 1),
            "messages_received": messages_received,
            "message_bytes_stored": sum(len(t.tail) for t in self._turns),
            "shared_values": len(self._values),
            "tokens_received": tokens_received,
            "tokens_stored": stored_tokens,
        }
        out.update(self.blobs.stats())
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.nodes())


def _plain_or_none(graph: RolloutGraph, values: list[Any], index: int) -> bytes | None:
    return graph._plain(values[index]) if index < len(values) else None


def _packer() -> Callable[[Any], bytes]:
    packer = msgpack.Packer(
        use_bin_type=True, strict_types=True, default=plain_default, buf_size=512
    )
    return packer.pack


def _no_echo() -> None:
    return None


def _above(ancestor: _Turn, turn: _Turn) -> bool:
    """Whether `ancestor` is on the path from the root down to `turn`."""
    node = turn.parent
    while node is not None:
        if node is ancestor:
            return True
        node = node.parent
    return False


#: Token roots are also found by their first 16, 32 or 48 tokens (for continuations of
#: turns with fewer than BLOCK tokens).
_HEADS = (16, 32, 48)


def short_key(data: bytes, n_tokens: int) -> int:
    """Index key of exactly the first `n_tokens` tokens of `data` (array('I') bytes)."""
    return xxhash.xxh3_64_intdigest(memoryview(data)[: n_tokens * 4], seed=n_tokens + 1)


def _root_token_keys(prompt: TokenRun) -> list[int]:
    if not prompt.compact or prompt.length < _HEADS[0]:
        return []
    data = run_bytes(prompt)
    keys = [short_key(data, head) for head in _HEADS if head <= prompt.length]
    return keys + block_digests(data)[1:]


def _sampled_any(turn: _Turn) -> bool:
    """A turn that sampled nothing is a failed call: one with its very prompt is a retry
    (a sibling), not a continuation."""
    return turn.sampled is not None and len(turn.sampled) > 0


def finish_tail(turn: _Turn) -> None:
    """Derive what the byte comparison of a tail needs from the stored fields."""
    base = turn.base
    turn.first = base.n_rest if base is not None else 0
    echo = turn.flags & _TAIL_ECHO
    turn.body_start = len(array_header(turn.n_rest - turn.first)) + (
        len(_ECHO_PACKED) if echo else 0
    )
    slow = turn.flags & (_TAIL_REFS | _TAIL_SPECIAL) or (
        echo and (base is None or base.flags & (_RESPONSE_REFS | _RESPONSE_SPECIAL))
    )
    turn.flags = (turn.flags & ~_TAIL_SLOW) | (_TAIL_SLOW if slow else 0)


def request_key(plains: list[bytes | None] | list[bytes], n: int) -> int:
    """Index key of the first `n` messages of a non-system request: `n` and the last one.

    Cheap on purpose (one message hashed): a hit is confirmed against every message anyway.
    """
    return xxhash.xxh3_64_intdigest(plains[n - 1] if n else b"", seed=n)  # type: ignore[arg-type]


def full_run(prompt: TokenRun | None, sampled: Any) -> TokenRun | None:
    """The run a child's prompt extends: prompt + sampled (the prompt itself if none)."""
    return TokenRun(prompt, sampled) if sampled is not None and len(sampled) else prompt


def _members(found: Any) -> tuple[Any, ...] | list[Any]:
    if found is None:
        return ()
    return found if isinstance(found, list) else (found,)


def _index_add(index: dict[int, Any], key: int, item: Any) -> None:
    found = index.get(key)
    if found is None:
        index[key] = item
    elif isinstance(found, list):
        found.append(item)
    else:
        index[key] = [found, item]


def _index_remove(index: dict[int, Any], key: int, item: Any) -> None:
    found = index.get(key)
    if found is item:
        del index[key]
    elif isinstance(found, list) and item in found:
        found.remove(item)
        if len(found) == 1:
            index[key] = found[0]


def _add_child(parent: _Turn, child: _Turn) -> None:
    children = parent.children
    if children is None:
        parent.children = (child,)
    else:
        parent.children = tuple(sorted((*children, child), key=lambda t: t.index))


def _seg_list(seg: Any) -> list[int] | None:
    if seg is None:
        return None
    return seg.tolist() if isinstance(seg, array) else list(seg)

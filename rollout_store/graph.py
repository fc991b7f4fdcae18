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
from typing import Any, TypeVar

import xxhash

from .blobs import BlobTable
from .encoding import unpack
from .errors import DuplicateNodeError, InvalidValueError, RolloutStoreError
from .intake import Encoder
from .linking import Linking
from .requests import RequestStore
from .tokens import BLOCK, run_list
from .turns import (
    LINK_EXPLICIT,
    LINK_MESSAGES,
    LINK_NAMES,
    LINK_NONE,
    LINK_TOKENS,
    LOGPROBS_PACKED,
    NO_MESSAGES,
    SCALAR_NAMES,
    Scratch,
    Turn,
    TurnNode,
    add_child,
    index_add,
    index_members,
    is_above,
    new_packer,
    seg_list,
)
from .values import ValueTable

__all__ = ["RolloutGraph", "TurnNode", "Sequence"]


_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    """Run a query under the graph's lock, so it sees no turn half added."""

    @functools.wraps(method)
    def locked(self: RolloutGraph, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


Sequence = dict[str, Any]


class RolloutGraph(RequestStore, Linking):
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
        self._pack_plain = new_packer()
        self._encoder = Encoder(self._blobs, share_threshold)
        self._canonical = Encoder(None, None)  # plain packing by the validating walk
        self._message_size = 256  # a running mean of packed message sizes, to chunk requests
        self._values = ValueTable(self._expand, share_threshold)
        self._turns: list[Turn] = []
        self._blob_marks = array("I")  # blobs stored once each turn was committed, for save
        self._by_id: dict[str, Turn] = {}
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
        self._listeners: list[Callable[[Turn, int, Scratch], None]] = []
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
                for turn in index_members(found):
                    keys[turn.index][slot] = key
        for key, found in self._message_roots.items():
            for turn in index_members(found):
                root_keys = keys[turn.index][3]
                if root_keys is None:
                    keys[turn.index][3] = root_keys = []
                root_keys.append(key)
        prompt_keys = {
            id(run): key
            for key, found in self._prompt_index.items()
            for run in index_members(found)
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
                    move for move in self._find_moves(turn, scratch) if not is_above(move[0], turn)
                ]
                for listener in self._listeners:
                    listener(turn, mark[0], scratch)
            except BaseException:
                self.blobs.rollback(mark)
                raise
            finally:
                self._pack_plain = new_packer()
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

    def _prepare(self, node: TurnNode) -> tuple[Turn, Scratch]:
        turn = Turn()
        scratch = Scratch()
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
        for name, value in zip(SCALAR_NAMES, scalars, strict=True):
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
            prefixes = scratch.prefixes
            if prefixes is not None and turn.prompt is None:
                # every shorter prefix, the empty one too (a request of system messages only)
                scratch.root_keys = prefixes.root_keys()
        return turn, scratch

    def _fresh_id(self) -> str:
        # derived from the turn count, so a rejected turn uses up no id
        n = len(self._turns)
        while f"turn-{n}" in self._by_id:
            n += 1
        return f"turn-{n}"

    # -- values

    # -- tokens

    # -- request messages

    # ------------------------------------------------------------------ commit

    def _commit(self, turn: Turn, scratch: Scratch) -> None:
        for plain, stored in scratch.pending:
            self._values.add(plain, stored)
        turn.meta = self._meta.setdefault(turn.meta, turn.meta)
        self._turns.append(turn)
        self._blob_marks.append(len(self.blobs))
        self._by_id[turn.node_id] = turn
        if turn.parent is not None:
            add_child(turn.parent, turn)
        if scratch.request_digest is not None and not turn.flags & NO_MESSAGES:
            index_add(self._request_index, scratch.request_digest, turn)
            if scratch.prefixes is not None:
                turn.digest = scratch.prefixes.own_digest()
        if scratch.token_key is not None and turn.full is not None and turn.full.length:
            index_add(self._token_index, scratch.token_key, turn)
            if turn.full.length < BLOCK:
                self._short_lengths.add(turn.full.length)
        if scratch.prompt_key is not None and turn.prompt is not None:
            members = index_members(self._prompt_index.get(scratch.prompt_key))
            if not any(m is turn.prompt for m in members):
                index_add(self._prompt_index, scratch.prompt_key, turn.prompt)
        for other, link in scratch.moves:
            self._move(other, turn, link)
        if turn.parent is None:
            self._register_root(turn, scratch.root_keys)

    # ------------------------------------------------------------------ materialize

    def _logprobs(self, turn: Turn) -> Any:
        lp = turn.logprobs
        if lp is None:
            return None
        if turn.flags & LOGPROBS_PACKED:
            return unpack(lp, self.blobs.string)
        return lp.tolist()

    def _view(self, turn: Turn) -> TurnNode:
        model, finish_reason, session, system_digest, n_tools = turn.meta
        return TurnNode(
            node_id=turn.node_id,
            prompt_ids=run_list(turn.prompt) if turn.prompt is not None else None,
            sampled_ids=seg_list(turn.sampled),
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

    def _turn(self, node_id: str) -> Turn:
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
        return LINK_NAMES[self._turn(node_id).link]

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

    # The names below are the query API of the capture graph this library replaces; they return
    # ids today and become node-returning views in the drop-in work. The *_ids names stay.
    def nodes(self) -> list[str]:
        return self.node_ids()

    def roots(self) -> list[str]:
        return self.root_ids()

    def leaves(self) -> list[str]:
        return self.leaf_ids()

    def children(self, node_id: str) -> list[str]:
        return self.child_ids(node_id)

    def path_to(self, node_id: str) -> list[str]:
        return self.path_ids(node_id)

    def paths(self) -> list[list[str]]:
        return self.path_id_lists()

    def forks(self) -> list[str]:
        return self.fork_ids()

    def discarded_nodes(self) -> list[str]:
        return self.discarded_ids()

    def _prompt_identity(self, turn: Turn) -> Any:
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
            if lp is None or turn.flags & LOGPROBS_PACKED or len(lp) != end - start:
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
        return [self.sequence_for(leaf) for leaf in self.leaf_ids()]

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
        return iter(self.node_ids())

"""Linking turns: token prompts stored as chains, parents found by prefix digests, and
turns that arrived early moved under an ancestor that arrives late.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from operator import itemgetter
from typing import Any

import xxhash

from .._core import SizedIndex
from ..model.nodes import TurnNode
from . import index
from .index import NOT_YET, index_add, index_members, index_remove
from .intake import float_array, plain_numbers, token_array
from .keys import HEADS, request_keys, root_token_keys, short_key
from .materialize import rest_values
from .requests import FreshRequest, RequestStore, Scratch
from .stored import (
    EMPTY_PROMPT,
    LOGPROBS_PACKED,
    NO_MESSAGES,
    TAIL_ECHO,
    LinkKind,
    Turn,
    add_child,
    full_run,
    longer_requests,
    prompts_from,
    prompts_of,
    remove_child,
    sampled_any,
)
from .tokens import (
    BLOCK,
    ArrayRun,
    TokenRun,
    deep_block_digests,
    packable,
    prefix_digest,
    run_bytes,
    run_matches,
)

__all__ = ["Linker"]


#: How many block digests of a prompt, below its deepest two, are computed together when
#: those two find no parent (see `deep_block_digests`).
TOKEN_WINDOW = 64

Move = tuple[Turn, LinkKind]


def _sibling_prompt(parent: Turn, data: bytes, n: int) -> TokenRun | None:
    """The prompt of a child of `parent` holding exactly these `n` tokens, if any."""
    for child in prompts_of(parent, n):
        run = child.prompt
        if run is not None and run.length == n and run_matches(run, data):
            return run
    return None


def _sized_index() -> SizedIndex:
    """A token index of the engine's (turn numbers under keys, found by length), grouping
    from `index.SMALL` turns a key as the package's other indexes do."""
    return SizedIndex(index.SMALL)


def _head(length: int) -> int:
    """The longest head a run of `length` tokens (fewer than a block) has."""
    return max(h for h in HEADS if h <= length)


#: A ranked candidate's length.
_first = itemgetter(0)

#: The short lengths of a graph none of whose turns has one (immutable, so shared).
_NO_LENGTHS: frozenset[int] = frozenset()


class Linker:
    """Finds each new turn's parent and the earlier turns it adopts; owns the token
    indexes and the roots waiting for a late ancestor.

    Given the graph's request store (to compare messages) and its list of turns (read only,
    for the rare scan of every root). Not thread-safe: the graph uses it under its lock.
    """

    __slots__ = (
        "_move_echoes",
        "_no_ids",
        "_no_logprobs",
        "_unindexed_roots",
        "message_roots",
        "prompt_index",
        "requests",
        "short_lengths",
        "token_blocks",
        "token_index",
        "token_roots",
        "turns",
    )

    def __init__(self, requests: RequestStore, turns: list[Turn]) -> None:
        self.requests = requests
        self.turns = turns
        # block digest of prompt+sampled -> turn numbers (the engine's, by length); digest
        # of a whole prompt -> TokenRun(s): made at the first token turn (a graph of messages
        # alone never makes them)
        self.token_index: SizedIndex | None = None
        self.prompt_index: dict[int, Any] = NOT_YET
        # heads and block digests of token roots' prompts -> turn numbers, by prompt length,
        # built at the first lookup that has a root to find (see `_token_roots`): until then
        # only counted
        self.token_roots: SizedIndex | None = None
        self._unindexed_roots = 0
        # lengths under one block that turns have: one empty frozenset for every graph (an
        # empty set costs 216 bytes) until a turn has one
        self.short_lengths: set[int] | frozenset[int] = _NO_LENGTHS
        # the whole blocks of the turns filed in the token index (bit j: some turn's tokens
        # fill j blocks and part of the next): a search for a parent looks up only those,
        # where each block of a prompt would be one lookup (a tool output of a thousand
        # tokens is 16 blocks between a turn and its parent). Never cleared: a bit set for a
        # turn no longer filed costs one lookup. (b"", one object for every graph, until a
        # token turn is filed)
        self.token_blocks: bytes | bytearray = b""
        self.message_roots: dict[int, Any] = {}  # request keys of message roots' prefixes
        # the echo (plain) by which each turn found to move by messages continues the new
        # turn, by the moving turn's id: `move` hands it on, so that committing a move reads
        # no stored tail (one may be kept in a store); set by each `find_moves`
        self._move_echoes: dict[int, bytes] | None = None
        # one empty array of each kind for every turn that sampled nothing (never mutated),
        # made at the first such turn (see `_empty`)
        self._no_ids: array[int] | None = None
        self._no_logprobs: array[float] | None = None

    # ------------------------------------------------------------------ tokens

    def _full_content(self, number: int) -> int:
        """The digest turn `number` is held by in a large length group of the token index:
        xxh3 of its prompt + sampled tokens (compact: only such turns are filed there)."""
        return xxhash.xxh3_64_intdigest(run_bytes(self.turns[number].full))  # type: ignore[arg-type]

    def _empty_ids(self) -> array[int]:
        """The graph's one empty array of token ids (see `__init__`)."""
        ids = self._no_ids
        if ids is None:
            ids = self._no_ids = array("I")
        return ids

    def prepare_tokens(self, turn: Turn, node: TurnNode, scratch: Scratch) -> None:
        """Store the turn's token fields as shared runs; find its parent by tokens.

        `turn` is fresh: its side has no token fields yet."""
        if node.prompt_ids is None and node.sampled_ids is None and node.sampled_logprobs is None:
            return  # no token fields at all: nothing to set, nothing to link by
        prompt = None if node.prompt_ids is None else token_array(node.prompt_ids, "prompt_ids")
        sampled = None if node.sampled_ids is None else token_array(node.sampled_ids, "sampled_ids")
        if prompt is not None and not len(prompt):
            # no token ids came back (a hosted provider): link by messages, keep the []
            prompt = None
            turn.flags |= EMPTY_PROMPT
        logprobs: object = node.sampled_logprobs
        if logprobs is not None:
            logprobs = plain_numbers(logprobs, "sampled_logprobs")
        if logprobs is None:
            turn.logprobs = None
        else:
            packed_floats = float_array(logprobs, "sampled_logprobs")
            if packed_floats is not None:
                turn.logprobs = packed_floats
            else:
                turn.logprobs = self.requests.encode(logprobs, "sampled_logprobs")[0]
                turn.flags |= LOGPROBS_PACKED
        if type(sampled) is array and not sampled:
            sampled = self._empty_ids()
        if type(turn.logprobs) is array and not turn.logprobs:
            if self._no_logprobs is None:
                self._no_logprobs = array("d")
            turn.logprobs = self._no_logprobs
        turn.sampled = sampled
        if prompt is None:
            turn.prompt = None
            turn.full = full_run(None, sampled)
            return
        if not (isinstance(prompt, array) and prompt.typecode == "I"):
            # ids beyond 32 bits: stored exactly, never linked by tokens
            turn.prompt = ArrayRun(None, prompt)
            turn.full = full_run(turn.prompt, sampled)
            return
        data = prompt.tobytes()
        parent = self._token_parent_in(data, self._token_buckets(data, len(prompt)), len(prompt))
        scratch.token_parent = parent
        key = xxhash.xxh3_64_intdigest(data)
        run = self._stored_prompt(key, data, len(prompt))
        if parent is None or run is not None:  # filed at commit (a root's), or found filed
            scratch.prompt_key = key
        elif parent.children is not None:
            # a retry of a continuation finds its prompt among its parent's children: only
            # prompts without a token parent are filed (a key and a slot fewer a turn)
            run = _sibling_prompt(parent, data, len(prompt))
        packed = False
        # (a packed parent's full run is a view made on each read: read once)
        before = parent.full if run is None and parent is not None else None
        if before is not None:
            new = prompt[before.length :]
            kept = turn.logprobs
            if packable(new, sampled, kept, len(prompt)):
                # the common case: new ids, sampled ids and logprobs in the turn itself
                turn.pack_tokens(before, new, sampled, kept)
                run, packed = turn, True
            else:
                run = ArrayRun(before, new)
        elif run is None:  # a root prompt: graphs over one memory store share it
            run = ArrayRun(None, self.requests.blobs.share_tokens(prompt))
            kept = turn.logprobs
            no_ids = self._empty_ids()
            if packable(no_ids, sampled, kept, len(prompt)):
                # its sampled ids and logprobs in the turn itself, a packed run of no new
                # ids over the shared root run (no side, arrays or full run of its own)
                turn.pack_tokens(run, no_ids, sampled, kept)
                run, packed = turn, True
        full: TokenRun | None
        if packed:
            full = turn.full
        else:
            turn.prompt = run
            full = turn.full = full_run(run, sampled)
        # compact (what `full.compact` finds, with no walk of the chain) unless its sampled
        # ids are not array('I'): its prompt's run is, its ids array('I') over none or over a
        # run that `run_matches` found (which only a compact run passes)
        if full is not None and (
            not sampled or (isinstance(sampled, array) and sampled.typecode == "I")
        ):
            full_data = data if full is run else data + sampled.tobytes()  # type: ignore[union-attr]
            scratch.full_data = full_data
            length = full.length
            if length < BLOCK:
                scratch.token_key = short_key(full_data, length)
            else:
                scratch.token_key = prefix_digest(full_data, length)

    def _stored_prompt(self, key: int, data: bytes, n: int) -> TokenRun | None:
        """A stored run holding exactly these prompt tokens (roots with one prompt share)."""
        for candidate in index_members(self.prompt_index.get(key)):
            if candidate.length == n and run_matches(candidate, data):
                return candidate  # type: ignore[no-any-return]
        return None

    def _token_buckets(self, data: bytes, n: int) -> Iterator[tuple[int, int, int]]:
        """Where a parent of these `n` prompt tokens may be filed, deepest first (key, low,
        high: its tokens' length in [low, high)): turns whose tokens fill j whole blocks by
        the digest of those blocks, shorter ones (under one block) by their exact length.
        Lazy: a parent ends within the last blocks, mostly, and the others are not hashed."""
        for j, key in deep_block_digests(data, TOKEN_WINDOW, self.token_blocks):
            yield key, j * BLOCK, (j + 1) * BLOCK
        for length in sorted(self.short_lengths, reverse=True):
            if length <= n:
                yield short_key(data, length), length, length + 1

    def _token_parent_in(
        self, data: bytes, buckets: Iterator[tuple[int, int, int]], n: int
    ) -> Turn | None:
        """The deepest turn filed under one of `buckets` (key, low, high: its tokens'
        length in [low, high)) whose prompt + sampled tokens start `data`. Of two as deep, one
        that sampled wins over a failed call of its run (which it would have adopted had the
        failed call come first: see `_token_moves`), so the parent is the same in any order."""
        view = memoryview(data)

        def content_at(length: int) -> int:
            return xxhash.xxh3_64_intdigest(view[: length * 4])

        token_index = self.token_index
        if token_index is None:
            return None
        turns = self.turns
        for key, low, high in buckets:
            # (a parent's tokens are a prefix of the prompt: n of them at most; of a large
            # group of one length only those whose tokens are the prompt's first ones)
            ranked: list[tuple[int, Turn]] = []
            for number in token_index.exact(key, low, min(high, n + 1), content_at):
                candidate = turns[number]
                length = candidate.full_length
                if (
                    length is not None
                    and low <= length < high
                    and (length < n or sampled_any(candidate))
                ):
                    ranked.append((length, candidate))
            if not ranked:
                continue
            if len(ranked) > 1:  # deepest first; as filed among those as deep (a stable sort)
                ranked.sort(key=_first, reverse=True)
            # the deepest that matches; of those as deep, the first that sampled, else the first
            best: Turn | None = None
            best_length = -1
            for length, candidate in ranked:
                if best is not None:
                    if length < best_length:
                        break
                    if not sampled_any(candidate):
                        continue
                if run_matches(candidate.full, data):  # type: ignore[arg-type]
                    if sampled_any(candidate):
                        return candidate
                    best, best_length = candidate, length
            if best is not None:
                return best
        return None

    # ------------------------------------------------------------------ messages

    def prepare_messages(self, turn: Turn, node: TurnNode, scratch: Scratch) -> None:
        """Find the parent by messages (for a turn without token ids or explicit parent),
        and the stored turns with exactly this request (their continuations may move)."""
        request = scratch.request
        if request is None:
            return
        rest = request.messages
        if request.n_valid == len(rest):
            scratch.twins = request.twins()
        if node.parent_id is None and turn.prompt is None:  # no token ids
            base = turn.base
            if base is not None and turn.flags & TAIL_ECHO:
                # the common case: its storage base is the longest stored request it extends
                # (the first of its bucket that it extends), and that one's response comes
                # right after, exactly: what `_message_parent` would find first
                scratch.message_parent = base
            else:
                scratch.message_parent = self._message_parent(request)

    def message_continued(self, request: FreshRequest) -> Turn | None:
        """The stored turn this request continues by messages (asked by the drift audit
        only for a turn with token ids that found no token parent)."""
        return self._message_parent(request)

    def _message_parent(self, request: FreshRequest) -> Turn | None:
        """The longest stored request that this one extends and whose response is echoed
        right after it (an exact echo preferred to a loose one)."""
        store = self.requests
        if not len(store.table):  # nothing filed (a graph's first request)
            return None
        for n in request.boundaries(min(request.n_valid, len(request.messages) - 1)):
            members = request.stored_prefixes(n)
            if not members:
                continue
            message, plain = request.messages[n], request.plain(n)
            for c in store.echo_candidates(members, message, plain, loose=False):
                if store.is_echo(c, message, plain) and request.extends(c):
                    return c
            for c in store.echo_candidates(members, message, plain, loose=True):
                if store.echoes(c, message, plain) and request.extends(c):
                    return c
        return None

    # ------------------------------------------------------------------ filing

    def file(self, turn: Turn, token_key: int | None, prompt_key: int | None) -> None:
        """File a committed turn's tokens under their keys."""
        length = turn.full_length
        if token_key is not None and length:
            token_index = self.token_index
            if token_index is None:
                token_index = self.token_index = _sized_index()
            token_index.add(token_key, turn.index, length, self._full_content)
            j = length // BLOCK
            blocks = self.token_blocks
            if not isinstance(blocks, bytearray):  # the first: a bitmap of its own
                blocks = self.token_blocks = bytearray()
            if (j >> 3) >= len(blocks):
                blocks.extend(bytes((j >> 3) + 1 - len(blocks)))
            blocks[j >> 3] |= 1 << (j & 7)
            if length < BLOCK:
                lengths = self.short_lengths
                if not isinstance(lengths, set):  # the first: a set of its own
                    lengths = self.short_lengths = set()
                lengths.add(length)
        if prompt_key is not None and turn.prompt is not None:
            members = index_members(self.prompt_index.get(prompt_key))
            if not any(m is turn.prompt for m in members):
                if self.prompt_index is NOT_YET:
                    self.prompt_index = {}
                index_add(self.prompt_index, prompt_key, turn.prompt)

    def register_root(self, turn: Turn, root_keys: list[int] | None) -> None:
        """File a root under its prefixes, for a later turn it continues to find it."""
        if turn.prompt is not None:
            if self.token_roots is None:  # filed when a lookup first needs the index
                self._unindexed_roots += 1
                return
            self.token_roots.add_all(root_token_keys(turn.prompt), turn.index, turn.prompt.length)
        elif root_keys:
            for key in root_keys:
                index_add(self.message_roots, key, turn)

    def _unregister_root(self, turn: Turn) -> None:
        if turn.prompt is not None:
            if self.token_roots is None:
                self._unindexed_roots -= 1
                return
            keys = root_token_keys(turn.prompt)
            self.token_roots.remove_all(keys, turn.index, turn.prompt.length)
        elif turn.n_rest > 0:
            plain = self.requests.plain
            plains = [plain(m) for m in rest_values(turn, self.requests.blobs)]
            if None not in plains:
                for key in request_keys(plains[:-1]):  # type: ignore[arg-type]
                    index_remove(self.message_roots, key, turn)

    # ------------------------------------------------------------------ late ancestors

    def find_moves(self, new: Turn, scratch: Scratch) -> list[Move]:
        """Turns that arrived before `new` but continue it: they move under it at commit."""
        moves: list[Move] = []
        self._move_echoes = None
        parent = new.parent
        if new.prompt is None and not scratch.twins and parent is not None and parent.kids is None:
            return moves  # the common case: no token ids, no twin, its parent's first child
        if new.link == LinkKind.EXPLICIT:
            return moves
        moves.extend(self._token_moves(new, scratch))
        moves.extend(self._message_moves(new, scratch))
        return moves

    def _token_moves(self, new: Turn, scratch: Scratch) -> list[Move]:
        """Turns whose prompt extends the tokens of `new` and that hang shallower."""
        moves: list[Move] = []
        if new.prompt is None:
            return moves
        data = scratch.full_data  # set when the tokens are all array('I'), else no moves
        length = new.full_length
        if data is None or not length:
            return moves
        parent = new.parent
        if parent is not None and not sampled_any(new) and parent.full_length == length:
            # a failed call of its parent's very run adds no token: what continues that run
            # stays under the parent, where it is linked when it comes after this one
            return moves
        for other in self._token_candidates(new, scratch, data):
            prompt = other.prompt
            if (
                other is new
                or other.link not in (LinkKind.TOKENS, LinkKind.NONE)
                or prompt is None
                or prompt.length < length
                or (prompt.length == length and not sampled_any(new))
                or not prompt.compact
            ):
                continue
            if run_bytes(prompt).startswith(data):
                moves.append((other, LinkKind.TOKENS))
        return moves

    def _token_candidates(self, new: Turn, scratch: Scratch, data: bytes) -> list[Turn]:
        """Turns that may continue `new`: its siblings (or the roots sharing its first
        tokens), and children of shorter retries of the same call."""
        parent, length = new.parent, len(data) // 4
        if parent is not None:
            # (a candidate's prompt is at least as long as this turn's tokens: `_token_moves`)
            candidates = list(prompts_from(parent, length))
        elif (roots := self._token_roots()) is None:
            candidates = []  # no root committed yet: none to move
        else:
            # a root continues `new` only with a prompt at least as long as its tokens
            key = scratch.token_key if length >= BLOCK else short_key(data, _head(length))
            turns = self.turns
            candidates = [turns[i] for i in roots.members(key, length)]  # type: ignore[arg-type]
        # and children of turns whose tokens end inside this turn's sampled ones (a
        # shorter retry of the same call): their continuations may continue this one
        for shorter in self._prefixes_within(new, data):
            candidates.extend(shorter.children or ())
        # and children of failed calls of this turn's very run (nothing sampled; a prompt as
        # long as this turn's prompt + sampled ids): a failed call adopts nothing (see
        # `_token_moves`), so what continues the run hangs under one only when it came first
        for other in candidates[:]:
            prompt = other.prompt
            kids = other.children
            if kids and prompt is not None and prompt.length == length and not sampled_any(other):
                candidates.extend(kids)
        return candidates

    def _token_roots(self) -> SizedIndex | None:
        """The token roots by the keys of their prompts' heads and whole blocks (None while
        no root with token ids is committed). Built at the first lookup that has one to find,
        from the committed roots in order, as registering them one by one would have: a
        graph of one rollout has one root, which no lookup of its own turns needs, and keeps
        no index of it (its heads and blocks were about 20 keys a graph)."""
        roots = self.token_roots
        if roots is None:
            if not self._unindexed_roots:
                return None
            roots = _sized_index()  # kept only once whole (a lookup that fails leaves none)
            for turn in self.turns:
                prompt = turn.prompt
                if turn.parent is None and prompt is not None:
                    roots.add_all(root_token_keys(prompt), turn.index, prompt.length)
            self.token_roots = roots
            self._unindexed_roots = 0
        return roots

    def _prefixes_within(self, new: Turn, data: bytes) -> list[Turn]:
        """Stored turns whose prompt + sampled tokens are a prefix of `new`'s, longer than its
        prompt and shorter than its prompt + sampled tokens, and failed calls (nothing
        sampled) of its very prompt: their continuations may continue `new`."""
        low = new.prompt.length  # type: ignore[union-attr]
        high: int = new.full_length  # type: ignore[assignment]
        if high <= low:
            return []
        found: list[Turn] = []
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
        keys += [(short_key(data, n), n, n + 1) for n in self.short_lengths if low <= n < high]
        token_index, turns = self.token_index, self.turns
        if token_index is None:
            return found
        for key, start, stop in keys:
            for number in token_index.members(key, max(start, low), min(stop, high)):
                other = turns[number]
                length = other.full_length
                if (
                    other is not new
                    and length is not None
                    and low <= length < high
                    # longer than the prompt, or a failed call of the very prompt
                    and (length > low or not sampled_any(other))
                    and start <= length < stop
                    and run_matches(other.full, data)  # type: ignore[arg-type]  # (it has a length)
                ):
                    found.append(other)
        return found

    def _message_moves(self, new: Turn, scratch: Scratch) -> list[Move]:
        """Message-linked turns whose request continues `new` and that hang shallower.

        For a turn linked by tokens only message roots are candidates (its place among
        message-linked turns is not worked out)."""
        moves: list[Move] = []
        parent = new.parent
        if new.flags & NO_MESSAGES:
            return moves
        if parent is not None and new.prompt is None:
            candidates = list(longer_requests(parent, new.n_rest))
        elif scratch.request_digest is not None:
            candidates = list(index_members(self.message_roots.get(scratch.request_digest)))
        else:
            return moves
        moves.extend(self._twin_moves(new, scratch.request))
        store = self.requests
        mine = None
        for other in candidates:
            if (
                other is new
                or other.link not in (LinkKind.MESSAGES, LinkKind.NONE)
                or other.prompt is not None
                or other.n_rest <= new.n_rest
            ):
                continue
            if mine is None:
                mine = rest_values(new, store.blobs)
            theirs = rest_values(other, store.blobs)
            if store.plain(theirs[: new.n_rest]) == store.plain(mine):
                echo = theirs[new.n_rest]
                echo_plain = store.plain(echo)
                if store.echoes(new, echo, echo_plain):
                    moves.append((other, LinkKind.MESSAGES))
                    self._note_move_echo(other, echo_plain)
        return moves

    def _twin_moves(self, new: Turn, request: FreshRequest | None) -> list[Move]:
        """Continuations linked loosely to a stored turn with exactly this request (a twin)
        that echo this turn's response exactly and the twin's only loosely: they move here."""
        moves: list[Move] = []
        store = self.requests
        if request is None or not request.twins():
            return moves
        echo_here = store.response_plain(new)  # (asked only now: it may be fetched)
        if echo_here is None:
            return moves
        key, n = request.key(request.n_valid), new.n_rest
        for other in list(store.echoing_children(key, echo_here)):
            twin = other.parent
            if (
                twin is None
                or twin.n_rest != n
                or other.link != LinkKind.MESSAGES
                or other.prompt is not None
                or not request.extends(twin)
            ):
                continue
            values = rest_values(other, store.blobs)
            echo = store.plain(values[n]) if n < len(values) else None
            if echo is not None and echo == echo_here and echo != store.response_plain(twin):
                moves.append((other, LinkKind.MESSAGES))
                self._note_move_echo(other, echo)
        return moves

    def _note_move_echo(self, turn: Turn, echo: bytes | None) -> None:
        """Keep the echo by which `turn`, found to move by messages, continues the new turn."""
        if echo is not None:
            if self._move_echoes is None:
                self._move_echoes = {}
            self._move_echoes[id(turn)] = echo

    def move(self, turn: Turn, parent: Turn, link: LinkKind) -> None:
        """Re-link `turn` under `parent` (it arrived before its ancestor)."""
        old = turn.parent
        if old is not None and old.kids is not None:
            remove_child(old, turn)
            self.requests.note_unlinked(old, turn)
        else:
            self._unregister_root(turn)
        turn.parent = parent
        turn.link = link
        add_child(parent, turn)
        echoes = self._move_echoes
        echo = echoes.get(id(turn)) if echoes is not None else None
        self.requests.note_linked(parent, turn, echo=echo)

"""Linking turns: token prompts stored as chains, parents found by prefix digests, and
turns that arrived early moved under an ancestor that arrives late.
"""

from __future__ import annotations

from array import array
from typing import Any

import xxhash

from .confirm import prefix_keys
from .intake import float_array, token_array
from .tokens import BLOCK, TokenRun, block_digests, prefix_digest, run_bytes, run_matches
from .turns import (
    HEADS,
    LINK_EXPLICIT,
    LINK_MESSAGES,
    LINK_NONE,
    LINK_TOKENS,
    LOGPROBS_PACKED,
    NO_MESSAGES,
    Scratch,
    Turn,
    TurnNode,
    add_child,
    full_run,
    index_add,
    index_members,
    index_remove,
    root_token_keys,
    sampled_any,
    short_key,
)


class Linking:
    """The linking half of `RolloutGraph` (a mixin: it uses the graph's indexes)."""

    def _prepare_tokens(self, turn: Turn, node: TurnNode, scratch: Scratch) -> None:
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
                turn.flags |= LOGPROBS_PACKED
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
            for candidate in index_members(self._prompt_index.get(key)):
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
            scratch.full_data = full_data
            length = turn.full.length
            if length < BLOCK:
                scratch.token_key = short_key(full_data, length)
            elif turn.full is run:
                scratch.token_key = digests[length // BLOCK]
            else:
                scratch.token_key = prefix_digest(full_data, length)

    def _find_token_parent(self, data: bytes, digests: list[int], n: int) -> Turn | None:
        # Turns whose tokens fill j whole blocks are found by the digest of those blocks,
        # deepest first; shorter ones (under one block) by their exact length.
        buckets = [(digests[j], j * BLOCK, (j + 1) * BLOCK) for j in range(len(digests) - 1, 0, -1)]
        buckets += [
            (short_key(data, length), length, length + 1)
            for length in sorted(self._short_lengths, reverse=True)
            if length <= n
        ]
        for key, low, high in buckets:
            best: Turn | None = None
            for candidate in index_members(self._token_index.get(key)):
                full = candidate.full
                if (
                    full is not None
                    and low <= full.length < high
                    and (full.length < n or sampled_any(candidate))
                    and (best is None or full.length > best.full.length)  # type: ignore[union-attr]
                    and run_matches(full, data)
                ):
                    best = candidate
            if best is not None:
                return best
        return None

    def _register_root(self, turn: Turn, root_keys: list[int] | None) -> None:
        if turn.prompt is not None:
            for key in root_token_keys(turn.prompt):
                index_add(self._token_roots, key, turn)
        elif root_keys:
            for key in root_keys:
                index_add(self._message_roots, key, turn)

    def _unregister_root(self, turn: Turn) -> None:
        if turn.prompt is not None:
            for key in root_token_keys(turn.prompt):
                index_remove(self._token_roots, key, turn)
        elif turn.n_rest > 0:
            plains = [self._plain(m) for m in self._rest_values(turn)]
            if None not in plains:
                for key in prefix_keys(plains[:-1]):  # type: ignore[arg-type]
                    index_remove(self._message_roots, key, turn)

    def _find_moves(self, new: Turn, scratch: Scratch) -> list[tuple[Turn, int]]:
        """Turns that arrived before `new` but continue it: they move under it at commit."""
        moves: list[tuple[Turn, int]] = []
        if new.link == LINK_EXPLICIT:
            return moves
        moves.extend(self._token_moves(new, scratch))
        moves.extend(self._message_moves(new, scratch))
        return moves

    def _token_moves(self, new: Turn, scratch: Scratch) -> list[tuple[Turn, int]]:
        """Turns whose prompt extends the tokens of `new` and that hang shallower."""
        moves: list[tuple[Turn, int]] = []
        parent = new.parent
        if new.prompt is not None:
            data = scratch.full_data  # set when the tokens are all array('I'), else no moves
            if data is None or new.full is None or not new.full.length:
                return moves
            if parent is not None:
                candidates = list(parent.children or ())
            elif new.full.length >= BLOCK:
                candidates = list(index_members(self._token_roots.get(scratch.token_key)))
            elif new.full.length >= HEADS[0]:
                head = max(h for h in HEADS if h <= new.full.length)
                candidates = list(index_members(self._token_roots.get(short_key(data, head))))
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
                    or (other.prompt.length == new.full.length and not sampled_any(new))
                    or not other.prompt.compact
                ):
                    continue
                if run_bytes(other.prompt).startswith(data):
                    moves.append((other, LINK_TOKENS))
        return moves

    def _prefixes_within(self, new: Turn, data: bytes) -> list[Turn]:
        """Stored turns whose prompt + sampled tokens are a prefix of `new`'s, longer than its
        prompt and shorter than its prompt + sampled tokens, and failed calls (nothing
        sampled) of its very prompt: their continuations may continue `new`."""
        low = new.prompt.length  # type: ignore[union-attr]
        high = new.full.length  # type: ignore[union-attr]
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
        keys += [(short_key(data, n), n, n + 1) for n in self._short_lengths if low <= n < high]
        for key, start, stop in keys:
            for other in index_members(self._token_index.get(key)):
                full = other.full
                if (
                    other is not new
                    and full is not None
                    and full.length < high
                    # longer than the prompt, or a failed call of the very prompt
                    and (full.length > low or (full.length == low and not sampled_any(other)))
                    and start <= full.length < stop
                    and run_matches(full, data)
                ):
                    found.append(other)
        return found

    def _message_moves(self, new: Turn, scratch: Scratch) -> list[tuple[Turn, int]]:
        """Message-linked turns whose request continues `new` and that hang shallower.

        For a turn linked by tokens only message roots are candidates (its place among
        message-linked turns is not worked out)."""
        moves: list[tuple[Turn, int]] = []
        parent = new.parent
        if new.flags & NO_MESSAGES:
            return moves
        if parent is not None and new.prompt is None:
            candidates = list(parent.children or ())
        elif scratch.request_digest is not None:
            candidates = list(index_members(self._message_roots.get(scratch.request_digest)))
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

    def _move(self, turn: Turn, parent: Turn, link: int) -> None:
        old = turn.parent
        if old is not None and old.children is not None:
            old.children = tuple(c for c in old.children if c is not turn) or None
        else:
            self._unregister_root(turn)
        turn.parent = parent
        turn.link = link
        add_child(parent, turn)


def _plain_or_none(graph: Any, values: list[Any], index: int) -> bytes | None:
    return graph._plain(values[index]) if index < len(values) else None

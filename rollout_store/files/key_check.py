"""Recomputing the index keys a file's turn records carry, from the content they hold.

A turn record names the keys its turn is filed under in the graph's indexes (`IndexKeys`):
the request key (BLAKE3 of its non-system messages' plain packings), the token key (the
block digest of its prompt + sampled ids), the prompt key (xxh3-64 of its prompt ids) and,
for a root without token ids, the keys of its request's shorter prefixes (under which it
waits for an ancestor that arrives late). `load` trusts them, so a file is read without
computing a key (blobs are hashed once, to check their digests); a key changed in a crafted
or damaged file whose frames are consistent would then file the turn where no later turn
finds it, and a turn added to the loaded graph would link to an older ancestor than its
true parent.

`verify` recomputes every one (`KeyCheck`, given each turn as it is read) and rejects a
mismatch with `IndexKeyMismatch` naming the record, the field, both values and what to do.
Each turn's request is hashed from its base's BLAKE3 state and its own tail, and its tokens
from its prompt's xxh3 state and its own ids. The states of the latest turns are kept
(`KEPT_STATES`); an older one is hashed again from the turn's content when a later turn
needs it. So the check costs time linear in the file while at most `KEPT_STATES`
conversations are interleaved; past that, a turn whose base's state was let go hashes its
chain again (measured: 300 conversations x 100 turns, about 11x `load`).

What is exact: the request and token keys (None exactly where `add_turn` files no key),
the prefix keys of a root when given, at the end of the file that every turn still a root
without token ids is filed under its prefixes, and the prompt key where `add_turn` names one:
it files a root prompt (one that extends no earlier turn's tokens: a record's prompt that is
new, or the same as such a turn's) of ids that all fit 32 bits under their xxh3-64 digest,
and no other (a prompt that extends its token parent's is reached through that parent), so
a record shows where the key belongs and one dropped there is refused. (A record gives such
a prompt as extending that parent's tokens: the writer always can, the parent's record
coming first; one it could not name would be written whole, as new, and refused here.)

A prompt key on a prompt that extends another's is checked against its content but allowed:
files of earlier versions name it, and filing such a prompt changes no link (it is only
found again by a later turn of exactly that prompt, which then shares its ids). A dropped
root prompt key changes no link either (a root is found by its token key): a retry of that
prompt would keep its ids a second time.

A key that cannot be recomputed at all (a record the check cannot follow, though the load
accepts it) raises `IndexKeyRecomputeError` in `check`; `rekeyed` keeps such a turn under
the keys its record names and lists it in `unkeyed` (a load never drops an intact turn, and
every turn after it, over a key).

`rekeyed` gives the keys to file a turn under instead, recomputed the same way (a load with
`recover=True`, which so repairs such a file, and every load of a version-1 file, whose keys
are of an earlier scheme), and counts the turns whose records named others.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Any, Final, NamedTuple

import blake3
import msgpack
import xxhash

from .._core import splice
from ..engine.blobs import BlobTable
from ..engine.confirm import digest_key
from ..engine.encoding import ECHO_PACKED, array_header
from ..engine.intake import MAX_DEPTH
from ..engine.keys import short_key
from ..engine.stored import NO_MESSAGES, RESPONSE_REFS, TAIL_ECHO, TAIL_REFS, IndexKeys, Turn
from ..engine.tokens import BLOCK, TokenRun, holds_all
from ..errors import IndexKeyMismatch, IndexKeyRecomputeError, StoreError
from .packed import MESSAGES_DEPTH, check_packed

__all__ = ["KeyCheck", "UnkeyedTurn"]

#: Hash states kept for the latest turns (requests) and token runs; an older one is
#: hashed again from its content when a later turn extends it.
KEPT_STATES = 256

_BLOCK_BYTES: Final = BLOCK * 4
_EMPTY: Final = blake3.blake3()  # never updated: copied

# (xxh3-64 state over the run's whole blocks, the bytes after them) or None: not compact
_RunState = tuple[Any, bytes] | None


class UnkeyedTurn(NamedTuple):
    """A turn whose index keys could not be recomputed from its content (`KeyCheck.rekeyed`):
    kept, filed under the keys its record names. `cause` says what failed."""

    node_id: str
    record: int  # its turn record's index in the file
    offset: int  # and the record's offset
    cause: str


class KeyCheck:
    """Recomputes the index keys of each turn read from one file (see the module docstring).

    `check` is given every turn, in file order, once it is built and before it is filed;
    `finish` once the last record is read. Both raise `IndexKeyMismatch`. Where keys are
    recomputed rather than checked, `rekeyed` and `finish_rekeyed` take their places."""

    def __init__(self, blobs: BlobTable) -> None:
        self.blobs = blobs
        # turn index -> BLAKE3 state of its non-system messages' plain packings
        self.requests: OrderedDict[int, Any] = OrderedDict()
        # run -> its state (runs compare by identity, but for the views of packed full runs
        # that `Turn.full` makes: all views over one prompt are one key)
        self.runs: OrderedDict[TokenRun, _RunState] = OrderedDict()
        # roots without token ids whose records name no prefix keys: (turn, offset, record);
        # such a turn must be re-linked under a later one by the end of the file
        self.unfiled_roots: list[tuple[Turn, int, int]] = []
        self.rekeyed_turns = 0  # (see `rekeyed`)
        self.unkeyed: list[UnkeyedTurn] = []  # (see `rekeyed`)

    # ------------------------------------------------------------------ the checks

    def check(self, turn: Turn, keys: IndexKeys, offset: int, record: int) -> None:
        """Compare the keys a turn record carries with those its content gives: a mismatch
        raises `IndexKeyMismatch`, a key that cannot be recomputed `IndexKeyRecomputeError`
        (a content store's error propagates: it is not the file's)."""
        try:
            self._check(turn, keys, offset, record)
        except (IndexKeyMismatch, StoreError):
            raise
        except Exception as exc:
            raise _unrecomputable(turn, exc, offset, record) from exc

    def _check(self, turn: Turn, keys: IndexKeys, offset: int, record: int) -> None:
        request = self.request_key(turn)
        if keys.request != request:
            raise _mismatch(turn, "request", keys.request, request, offset, record)
        prompt_run = turn.prompt
        token = None if prompt_run is None else self._token_key(turn)
        if keys.token != token:
            raise _mismatch(turn, "token", keys.token, token, offset, record)
        prompt = self.prompt_key(turn, keys.prompt is not None)
        if keys.prompt != prompt:
            raise _mismatch(turn, "prompt", keys.prompt, prompt, offset, record)
        roots = keys.roots
        waits = _waits(turn, request)
        if roots is None:
            if waits:
                self.unfiled_roots.append((turn, offset, record))
            return
        if not waits:
            if roots:  # (an empty list files nothing: a root of no non-system message)
                raise _mismatch(turn, "roots", roots, None, offset, record)
            return
        expected = self.prefix_keys(turn)
        if sorted(roots) != sorted(expected):
            raise _mismatch(turn, "roots", roots, expected, offset, record)

    def rekeyed(self, turn: Turn, keys: IndexKeys, offset: int, record: int) -> IndexKeys:
        """The keys to file a turn under when they are recomputed rather than checked (a
        version-1 file, whose keys are of an earlier scheme, or a load with `recover=True`):
        each from the turn's content, the prompt key of a root prompt and of any prompt whose
        record names one, and the prefix keys of every root without token ids (a root
        re-linked later leaves them again, as when it was added). `rekeyed_turns` counts the
        turns whose records named other keys.

        A turn whose keys cannot be recomputed (`IndexKeyRecomputeError` from the check) is
        kept all the same, filed under the keys its record names (what a plain `load`
        trusts), and listed in `unkeyed`: it is intact, and dropping it would drop every
        later turn with it."""
        try:
            self.check(turn, keys, offset, record)
            changed = False
        except IndexKeyMismatch:
            changed = True
        except IndexKeyRecomputeError as error:
            self.unkeyed.append(UnkeyedTurn(turn.node_id, record, offset, error.cause))
            return keys
        try:
            request = self.request_key(turn)
            prompt_run = turn.prompt
            token = None if prompt_run is None else self._token_key(turn)
            prompt = self.prompt_key(turn, keys.prompt is not None)
            roots = self.prefix_keys(turn) if _waits(turn, request) else None
        except StoreError:
            raise
        except Exception as exc:  # (the check recomputed all but a root's prefix keys)
            self.unkeyed.append(UnkeyedTurn(turn.node_id, record, offset, _cause(exc)))
            return keys
        self.rekeyed_turns += changed
        return IndexKeys(request, token, prompt, roots)

    def finish_rekeyed(self) -> int:
        """`finish` for keys recomputed: the number of turns whose records named other keys
        (a root that stayed one without its prefix keys is filed under them: counted)."""
        roots = self.unfiled_roots
        self.rekeyed_turns += sum(1 for turn, _, _ in roots if turn.parent is None)
        roots.clear()
        return self.rekeyed_turns

    def finish(self) -> None:
        """Every root without token ids whose record named no prefix keys was re-linked
        under a later turn (a snapshot leaves them out of such a turn only)."""
        for turn, offset, record in self.unfiled_roots:
            if turn.parent is None:
                try:
                    expected = self.prefix_keys(turn)
                except StoreError:
                    raise
                except Exception as exc:
                    raise _unrecomputable(turn, exc, offset, record) from exc
                raise _mismatch(turn, "roots", None, expected, offset, record)
        self.unfiled_roots.clear()

    # ------------------------------------------------------------------ request keys

    def request_key(self, turn: Turn) -> int | None:
        """The key `add_turn` files the turn's request under (None: not filed)."""
        if turn.flags & NO_MESSAGES:
            return None
        if turn.n_rest == 0 and turn.system is None and turn.prompt is not None:
            return None  # a token turn without messages: linked by its tokens only
        return digest_key(self._request_state(turn).digest())

    def prefix_keys(self, turn: Turn) -> list[int]:
        """The keys of every shorter prefix of the turn's non-system messages (a root
        waits under them)."""
        chain: list[Turn] = []
        node: Turn | None = turn
        while node is not None:
            chain.append(node)
            node = node.base
        hasher = blake3.blake3()
        keys = [digest_key(hasher.digest())]
        left = turn.n_rest - 1  # messages to hash: the whole request's key is not among them
        for owner in reversed(chain):
            base = owner.base
            count = min(owner.n_rest - (base.n_rest if base is not None else 0), left)
            if count <= 0:
                continue
            left -= count
            parts = self._tail_plain(owner)
            body = memoryview(parts[0] if len(parts) == 1 else b"".join(parts))
            for span in _spans(body, count):
                hasher.update(span)
                keys.append(digest_key(hasher.digest()))
        return keys

    def _request_state(self, turn: Turn) -> Any:
        """The BLAKE3 state of the turn's non-system messages' plain packings: its base's
        state (kept, or hashed again along the chain of bases) and its tail."""
        states = self.requests
        chain: list[Turn] = []
        node: Turn | None = turn
        state: Any = _EMPTY
        while node is not None:
            found = states.get(node.index)
            if found is not None:
                state = found
                break
            chain.append(node)
            node = node.base
        for node in reversed(chain):
            state = state.copy()
            for part in self._tail_plain(node):
                state.update(part)
            # kept: the turn's state and its base's (its siblings', a retry's, may follow);
            # an older base's only where there is room: making room for it would push out
            # the state of another conversation's latest turn, whose next turn would then
            # hash its whole chain again, and so on
            if node is turn or node is turn.base or len(states) < KEPT_STATES:
                states[node.index] = state
                if len(states) > KEPT_STATES:
                    states.popitem(last=False)
        return state

    def _tail_plain(self, turn: Turn) -> tuple[bytes | memoryview, ...]:
        """The plain packings of the messages of the turn's tail, one after the other (in
        parts, not copied): its packed form with each blob reference replaced by the
        string's plain packing, and the echo placeholder by the base's response."""
        tail = turn.tail
        flags, base = turn.flags, turn.base
        if flags & TAIL_REFS:
            tail = self._spliced(tail, True)
        start = len(array_header(turn.n_rest - (base.n_rest if base is not None else 0)))
        if flags & TAIL_ECHO and base is not None:
            echo = base.response
            if echo is not None and base.flags & RESPONSE_REFS:
                echo = self._spliced(echo, False)
            return (echo or b"", memoryview(tail)[start + len(ECHO_PACKED) :])
        return (memoryview(tail)[start:],)

    def _spliced(self, packed: bytes, echo_ok: bool) -> bytes:
        """A stored value's plain packing: each blob reference (6 bytes) replaced by the plain
        packing of its string (a lone surrogate packs as it does inline); an echo placeholder
        stays. Spliced by the engine where `check_packed` finds the references, never decoded
        (a crafted value could allocate many times its size, and a decoded screenshot would
        be packed again only to be hashed)."""
        blobs = self.blobs
        depth = MESSAGES_DEPTH if echo_ok else MAX_DEPTH  # a tail, or a response
        info = check_packed(
            packed, len(blobs), depth, blob_surrogates=self._surrogates, echo_ok=echo_ok
        )
        refs = info.blob_refs
        return splice(packed, refs.tobytes() if isinstance(refs, array) else b"", blobs.string)

    def _surrogates(self, index: int) -> bool:
        return self.blobs.surrogates(index)

    # ------------------------------------------------------------------ token keys

    def _token_key(self, turn: Turn) -> int | None:
        """The block digest of prompt + sampled ids `add_turn` files the turn under."""
        full = turn.full
        state = None if full is None or not full.length else self._run_state(full)
        if state is None or full is None:
            return None
        hasher, rest = state
        length = full.length
        if length < BLOCK:
            return short_key(rest, length)
        key: int = hasher.intdigest()
        return key

    def prompt_key(self, turn: Turn, named: bool = False) -> int | None:
        """The key `add_turn` files the turn's prompt under (None: not filed): that of a root
        prompt (one that extends no earlier turn's tokens) of ids that all fit 32 bits, and,
        where the record names one (`named`), that of any prompt (earlier versions filed a
        prompt that extends another's too; filing one changes no link, see the module
        docstring)."""
        prompt = turn.prompt
        if prompt is None or not (named or holds_all(prompt)):
            return None
        return self._prompt_key(prompt)

    def _prompt_key(self, prompt: TokenRun) -> int | None:
        """The xxh3-64 digest of the prompt ids (a root's prompt is filed under it)."""
        state = self._run_state(prompt)
        if state is None:
            return None
        hasher = state[0].copy()
        hasher.update(state[1])
        key: int = hasher.intdigest()
        return key

    def _run_state(self, run: TokenRun) -> _RunState:
        """The xxh3-64 state of the run's ids (array('I') bytes) over its whole blocks, and
        the bytes after them; None when some segment is not array('I') (no key then)."""
        runs = self.runs
        chain: list[TokenRun] = []
        node: TokenRun | None = run
        state: _RunState = (xxhash.xxh3_64(), b"")
        while node is not None:
            if node in runs:
                state = runs[node]
                break
            chain.append(node)
            node = node.prev
        for node in reversed(chain):
            seg = node.seg
            if state is None or not len(seg):
                pass
            elif type(seg) is not array or seg.typecode != "I":
                state = None
            else:
                hasher = state[0].copy()
                data = state[1] + seg.tobytes()
                whole = len(data) - len(data) % _BLOCK_BYTES
                hasher.update(memoryview(data)[:whole])
                state = (hasher, data[whole:])
            # (as for requests; a turn's prompt is a node of its own, whose state its siblings
            # do not need: they extend its parent's full run)
            if node is run or len(runs) < KEPT_STATES:
                runs[node] = state
                if len(runs) > KEPT_STATES:
                    runs.popitem(last=False)
        return state


#: Bytes fed to the unpacker that finds message boundaries at a time (it holds at most one
#: message more than this).
_SPAN_CHUNK = 1 << 16


def _spans(body: memoryview, count: int) -> list[memoryview]:
    """The first `count` packed values of `body`, each as a view of its bytes (the unpacker
    skips them without building them, fed a chunk at a time)."""
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(body), 1))
    spans: list[memoryview] = []
    start = fed = 0
    while len(spans) < count:
        try:
            unpacker.skip()
        except msgpack.OutOfData:
            if fed >= len(body):
                raise ValueError("a request tail holds fewer messages than its turn") from None
            unpacker.feed(body[fed : fed + _SPAN_CHUNK])
            fed += _SPAN_CHUNK
            continue
        end = unpacker.tell()
        spans.append(body[start:end])
        start = end
    return spans


def _waits(turn: Turn, request: int | None) -> bool:
    """Whether `add_turn` files the turn under its request's shorter prefixes: a root
    without token ids, of at least one non-system message, all with plain packings."""
    return (
        turn.parent is None
        and turn.prompt is None
        and request is not None
        and turn.n_rest > 0
        and not turn.flags & NO_MESSAGES
    )


def _shown(key: Any) -> str:
    if key is None:
        return "none"
    if isinstance(key, list):
        return f"{len(key)} prefix keys"
    return f"{key:#018x}"


def _cause(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _unrecomputable(
    turn: Turn, exc: BaseException, offset: int, record: int
) -> IndexKeyRecomputeError:
    return IndexKeyRecomputeError(
        node_id=turn.node_id, cause=_cause(exc), offset=offset, record=record
    )


def _mismatch(
    turn: Turn, field: str, recorded: Any, expected: Any, offset: int, record: int
) -> IndexKeyMismatch:
    return IndexKeyMismatch(
        f"turn {turn.node_id!r}: its {field} index key is {_shown(recorded)}, its content "
        f"gives {_shown(expected)}",
        field=field,
        node_id=turn.node_id,
        recorded=recorded,
        expected=expected,
        offset=offset,
        record=record,
    )

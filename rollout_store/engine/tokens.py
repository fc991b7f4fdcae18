"""Token ids in compact, shared storage, and exact prefix matching over them.

A turn's prompt is a chain of runs: its parent's prompt + sampled tokens, then the tokens
that are new. Ids are kept as array('I') (4 bytes each) when they fit; prefix digests are
taken every `BLOCK` tokens so a parent is found without scanning stored turns.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator
from typing import Any, TypeAlias, cast

import xxhash

from ..errors import RolloutStoreError

__all__ = [
    "BLOCK",
    "MAX_PACKED_LENGTH",
    "MAX_PACKED_NEW",
    "MAX_PACKED_SAMPLED",
    "ArrayRun",
    "PackedFull",
    "PackedPrompt",
    "PackedRun",
    "PromptAlone",
    "Segment",
    "TokenRun",
    "block_digests",
    "deep_block_digests",
    "holds_all",
    "packable",
    "packed_full_length",
    "packed_size",
    "run_bytes",
    "run_list",
]

#: Tokens per prefix-digest block.
BLOCK = 64
_BLOCK_BYTES = BLOCK * 4

#: A run's tokens: array('I') (or 'q') when they fit, else a tuple of exact ints.
Segment: TypeAlias = "array[int] | tuple[int, ...]"


class TokenRun:
    """A node of a token chain: the tokens of `prev`, then its own `seg`. Shared between turns.

    Two kinds: an `ArrayRun` holds its segment as it came; a turn's packed runs
    (`PackedRun`, `PackedFull`) keep its new prompt ids, sampled ids and logprobs in one
    bytes object (see `pack_turn`), for a graph holds one chain node per turn.
    """

    __slots__ = ()

    @property
    def prev(self) -> TokenRun | None:
        """The chain node before this one (None: the first)."""
        raise NotImplementedError

    @property
    def length(self) -> int:
        """The number of tokens of the chain up to and including this node."""
        raise NotImplementedError

    @property
    def seg(self) -> Segment:
        """This node's own tokens."""
        raise NotImplementedError

    def segments(self) -> list[Segment]:
        """The segments of the chain, first to last."""
        out: list[Segment] = []
        run: TokenRun | None = self
        while run is not None:
            seg = run.seg
            if len(seg):
                out.append(seg)
            run = run.prev
        out.reverse()
        return out

    @property
    def compact(self) -> bool:
        """True when every segment is array('I'), so the run can be matched by bytes."""
        run: TokenRun | None = self
        while run is not None:
            kind = type(run)
            if kind is ArrayRun:
                seg = run.seg
                if len(seg) and not (isinstance(seg, array) and seg.typecode == "I"):
                    return False
                run = run.prev
            elif isinstance(run, PackedRun):  # packed ids are array('I'): no view is made
                after = run.after
                run = after.prompt if isinstance(after, PromptAlone) else after
            else:
                run = run.prev
        return True


class ArrayRun(TokenRun):
    """A chain node holding its own segment (array('I'), array('q') or a tuple)."""

    __slots__ = ("length", "prev", "seg")

    length: int
    prev: TokenRun | None
    seg: Segment

    def __init__(self, prev: TokenRun | None, seg: Segment) -> None:
        self.prev = prev
        self.seg = seg
        self.length = (prev.length if prev is not None else 0) + len(seg)


# A packed turn's bytes: its prompt's length, how many of those tokens are new (after
# `prev`), the counts of sampled ids and logprobs (-1: None), then the new prompt ids and
# the sampled ids as array('I') bytes and the logprobs as array('d') bytes. The head is
# 10 bytes (a graph holds one a turn): a turn whose counts do not fit it is not packed
# (see `packable`), and keeps its runs and arrays as they came.
_HEAD = struct.Struct("<IHhh")
_HEAD_SIZE = _HEAD.size
_LENGTH = struct.Struct("<I")
#: The most tokens a packed prompt may hold, new ids it may add, and sampled ids (and
#: logprobs) it may hold.
MAX_PACKED_LENGTH = (1 << 32) - 1
MAX_PACKED_NEW = (1 << 16) - 1
MAX_PACKED_SAMPLED = (1 << 15) - 1


def _ids(data: bytes, start: int, n: int) -> array[int]:
    out = array("I")
    out.frombytes(data[start : start + 4 * n])
    return out


class PackedRun(TokenRun):
    """A turn's prompt as one chain node (the tokens of `prev`, then its new ids), with the
    turn's sampled ids and logprobs in the same bytes object: one object per turn, not five
    (a run, an array of new ids, a run for prompt + sampled, the sampled and logprob
    arrays). `PackedFull` is the turn's prompt + sampled run over it, a view made when asked
    for: nothing keeps one.

    `after` is the run before its new ids as kept: a `PackedRun` there stands for that
    prompt's full run (its tokens, then its sampled ids), which is what a continuation
    extends; `prev` gives the run itself (a `PackedFull` over it when it sampled ids).

    Two kinds: a `PackedPrompt` holds its packed bytes alone in `data`; a graph's stored turn
    is a packed run itself (`stored.Turn`), its packed bytes the start of its own `data`, so
    a token turn keeps no chain node and no token bytes object apart from its turn. Code that
    asks whether a node is packed asks `isinstance(node, PackedRun)`, never `type(...) is`.
    """

    __slots__ = ("after",)

    after: TokenRun | PromptAlone | None
    # starts with the head, the new ids, the sampled ids and the logprobs (see `pack`): a
    # subclass's slot, which a packed run reads only as far as its head says
    data: bytes

    def pack(
        self, prev: TokenRun | None, new: array[int], sampled: Any, logprobs: Any
    ) -> list[Any]:
        """Continue `prev` with `new` (sets `after`) and return the parts of the packed bytes
        (the head, then buffers of `new`, the sampled ids and the logprobs), for the subclass
        to join once at the start of its `data`."""
        after: TokenRun | PromptAlone | None
        if type(prev) is PackedFull:
            after = prev.prompt  # its full, kept as the prompt it is over
        elif isinstance(prev, PackedRun) and prev.n_sampled:
            # the prompt alone, not its full (a retry that sampled nothing shares its
            # sibling's prompt as its full): marked so
            after = PromptAlone(prev)
        else:
            after = prev
        length = (prev.length if prev is not None else 0) + len(new)
        if not packable(new, sampled, logprobs, length):
            raise RolloutStoreError("these token ids do not fit a packed run (see packable)")
        n_sampled = -1 if sampled is None else len(sampled)
        n_logprobs = -1 if logprobs is None else len(logprobs)
        parts: list[Any] = [_HEAD.pack(length, len(new), n_sampled, n_logprobs), new]
        if sampled is not None:
            parts.append(sampled)
        if logprobs is not None:
            parts.append(logprobs)
        self.after = after
        return parts

    @property
    def prev(self) -> TokenRun | None:
        after = self.after
        if isinstance(after, PackedRun):
            return PackedFull(after) if after.n_sampled else after
        if type(after) is PromptAlone:
            return after.prompt
        return after  # type: ignore[return-value]

    @property
    def length(self) -> int:
        length: int = _LENGTH.unpack_from(self.data)[0]
        return length

    @property
    def seg(self) -> array[int]:
        _, n_new, _, _ = _HEAD.unpack_from(self.data)
        return _ids(self.data, _HEAD_SIZE, n_new)

    @property
    def n_sampled(self) -> int:
        """The number of sampled ids (0 when there are none)."""
        n_sampled: int = _HEAD.unpack_from(self.data)[2]
        return max(n_sampled, 0)

    def sampled_ids(self) -> array[int] | None:
        """The turn's sampled ids (a fresh array), or None."""
        _, n_new, n_sampled, _ = _HEAD.unpack_from(self.data)
        return None if n_sampled < 0 else _ids(self.data, _HEAD_SIZE + 4 * n_new, n_sampled)

    def sampled_logprobs(self) -> array[float] | None:
        """The turn's logprobs (a fresh array('d')), or None."""
        _, n_new, n_sampled, n_logprobs = _HEAD.unpack_from(self.data)
        if n_logprobs < 0:
            return None
        start = _HEAD_SIZE + 4 * (n_new + max(n_sampled, 0))
        out = array("d")
        out.frombytes(self.data[start : start + 8 * n_logprobs])
        return out


class PackedPrompt(PackedRun):
    """A packed run that keeps its bytes in a slot of its own."""

    __slots__ = ("data",)

    data: bytes

    def __init__(self, prev: TokenRun | None, new: array[int], sampled: Any, logprobs: Any) -> None:
        self.data = b"".join(self.pack(prev, new, sampled, logprobs))


class PromptAlone:
    """What a `PackedRun` keeps as `after` for a packed prompt that sampled ids when it
    continues that prompt alone, not its full run (rare: see `PackedRun.pack`)."""

    __slots__ = ("prompt",)

    def __init__(self, prompt: PackedRun) -> None:
        self.prompt = prompt


class PackedFull(TokenRun):
    """A packed turn's prompt + sampled run: its segment is the sampled ids its prompt holds.

    A view over the prompt, made when asked for (see `PackedRun`): two views over one
    prompt are equal and hash alike, so that they stand for one run wherever runs are keys
    (views over two prompts of equal tokens are two runs, as every other run)."""

    __slots__ = ("prompt",)

    prompt: PackedRun

    def __init__(self, prompt: PackedRun) -> None:
        self.prompt = prompt

    def __eq__(self, other: object) -> bool:
        return type(other) is PackedFull and other.prompt is self.prompt

    def __hash__(self) -> int:
        return hash((PackedFull, id(self.prompt)))

    @property
    def prev(self) -> PackedRun:
        return self.prompt

    @property
    def length(self) -> int:
        length, _, n_sampled, _ = _HEAD.unpack_from(self.prompt.data)
        return length + max(n_sampled, 0)  # type: ignore[no-any-return]

    @property
    def seg(self) -> array[int]:
        return self.prompt.sampled_ids() or array("I")


def holds_all(run: TokenRun) -> bool:
    """Whether a prompt run extends no earlier turn's tokens (a root's prompt): a first run,
    or a packed run of no new ids over one (a root as add_turn packs it)."""
    prev = run.prev
    if prev is None:
        return True
    return isinstance(run, PackedRun) and not len(run.seg) and prev.prev is None


def packable(new: Any, sampled: Any, logprobs: Any, length: int) -> bool:
    """Whether a turn's new prompt ids, sampled ids and logprobs fit a `PackedRun` whose
    prompt holds `length` tokens (its kinds of arrays, and counts its head can hold)."""
    return (
        type(new) is array
        and new.typecode == "I"
        and len(new) <= MAX_PACKED_NEW
        and length <= MAX_PACKED_LENGTH
        and (
            sampled is None
            or (
                type(sampled) is array
                and sampled.typecode == "I"
                and len(sampled) <= MAX_PACKED_SAMPLED
            )
        )
        and (
            logprobs is None
            or (
                type(logprobs) is array
                and logprobs.typecode == "d"
                and len(logprobs) <= MAX_PACKED_SAMPLED
            )
        )
    )


def packed_full_length(data: bytes) -> int:
    """The tokens of the full run of the packed prompt at the start of `data` (its prompt's,
    then its sampled ids): `PackedFull(...).length`, with no view made."""
    length: int
    n_sampled: int
    length, _, n_sampled, _ = _HEAD.unpack_from(data)
    return length + max(n_sampled, 0)


def packed_size(data: bytes | memoryview) -> int:
    """The bytes of the packed run at the start of `data` (see `PackedRun.pack`)."""
    n_new: int
    n_sampled: int
    n_logprobs: int
    _, n_new, n_sampled, n_logprobs = _HEAD.unpack_from(data)
    return _HEAD_SIZE + 4 * (n_new + max(n_sampled, 0)) + 8 * max(n_logprobs, 0)


def run_list(run: TokenRun) -> list[int]:
    out: list[int] = []
    for seg in run.segments():
        out.extend(seg.tolist() if isinstance(seg, array) else seg)
    return out


def run_bytes(run: TokenRun) -> bytes:
    """The run as array('I') bytes; the caller checks `compact` first."""
    return b"".join(cast("array[int]", seg).tobytes() for seg in run.segments())


def run_matches(run: TokenRun, data: bytes) -> bool:
    """Whether `data` (array('I') bytes) starts with exactly the tokens of `run`."""
    end = run.length * 4
    if end > len(data):
        return False
    node: Any = run
    startswith = data.startswith  # a memcmp in place: no slice of `data` is copied
    unpack = _HEAD.unpack_from
    while node is not None:
        kind = type(node)
        if kind is PackedFull:  # its prompt, after the sampled ids that prompt holds
            node, kind, sampled = node.prompt, PackedRun, True
        else:
            sampled = False
        if kind is PackedRun or isinstance(node, PackedRun):
            while True:  # packed prompts, each standing for its full run when `sampled`
                packed = node.data
                _, n_new, n_sampled, _ = unpack(packed)
                # its new ids, then its sampled ids when its full run is meant: one span,
                # in its bytes as in the tokens
                n = 4 * (n_new + n_sampled) if sampled and n_sampled > 0 else 4 * n_new
                if n:
                    ids = packed[_HEAD_SIZE : _HEAD_SIZE + n]
                    if len(ids) != n or not startswith(ids, end - n):
                        return False
                    end -= n
                node = node.after
                if isinstance(node, PackedRun):
                    sampled = True
                elif type(node) is PromptAlone:
                    node, sampled = node.prompt, False
                else:
                    break
            continue
        seg = node.seg
        n = len(seg) * 4
        if n:
            if not (isinstance(seg, array) and seg.typecode == "I"):
                return False
            if not data.startswith(seg, end - n):
                return False
        end -= n
        node = node.prev
    return True


def block_digests(data: bytes | memoryview) -> list[int]:
    """Digest of the first j*BLOCK tokens, for j = 0 .. len(tokens) // BLOCK."""
    view = memoryview(data)
    hasher = xxhash.xxh3_64()
    out = [hasher.intdigest()]
    for start in range(0, len(view) - _BLOCK_BYTES + 1, _BLOCK_BYTES):
        hasher.update(view[start : start + _BLOCK_BYTES])
        out.append(hasher.intdigest())
    return out


def deep_block_digests(
    data: bytes | memoryview, window: int, filed: bytes | bytearray | None = None
) -> Iterator[tuple[int, int]]:
    """(j, the digest of the first j blocks of `data`), for j from its whole blocks down to 1:
    `block_digests(data)` deepest first, each hashed only when asked for; with `filed` (a
    bitmap: bit j for j blocks), only the j whose bit is set, and no digest of the others
    taken. The deepest two come from one pass over the tokens; the `window` blocks before
    them go on from where that pass crossed them (a copy of its state); the blocks before the
    window take a pass of their own."""
    view = memoryview(data)
    top = len(view) // _BLOCK_BYTES
    if not top:
        return

    bits = -1 if filed is None else int.from_bytes(filed, "little")

    def wanted(j: int) -> bool:
        return bits >> j & 1 == 1

    first = max(top - window, 1)  # the window: blocks first .. top
    near = max(top - 1, first)
    hasher = xxhash.xxh3_64()
    hasher.update(view[: first * _BLOCK_BYTES])
    at_first = hasher.copy()
    hasher.update(view[first * _BLOCK_BYTES : near * _BLOCK_BYTES])
    at_near = hasher.intdigest()
    if top > near:
        hasher.update(view[near * _BLOCK_BYTES : top * _BLOCK_BYTES])
        if wanted(top):
            yield top, hasher.intdigest()
    if wanted(near):
        yield near, at_near
    if near > first:
        yield from _digests_at(_ones(bits, first, near), at_first, first, view)
    if first > 1:
        below = _ones(bits, 1, first)
        if below:
            yield from _digests_at(below, xxhash.xxh3_64(), 0, view)


def _ones(bits: int, low: int, high: int) -> list[int]:
    """The set bits of `bits` from `low` to below `high`, ascending (all of them for -1)."""
    if bits == -1:
        return list(range(low, high))
    found = []
    rest = bits >> low & ((1 << (high - low)) - 1)
    while rest:
        lowest = rest & -rest
        found.append(low + lowest.bit_length() - 1)
        rest ^= lowest
    return found


def _digests_at(
    ends: list[int], hasher: Any, at: int, view: memoryview
) -> Iterator[tuple[int, int]]:
    """(j, digest of the first j blocks) for the ascending `ends`, deepest first: `hasher`
    has seen the first `at` blocks (at most the first end), and goes on to each end once."""
    digests = []
    for j in ends:
        hasher.update(view[at * _BLOCK_BYTES : j * _BLOCK_BYTES])
        digests.append(hasher.intdigest())
        at = j
    for j, digest in zip(reversed(ends), reversed(digests), strict=True):
        yield j, digest


def prefix_digest(data: bytes | memoryview, n_tokens: int) -> int:
    """The block digest of the first `n_tokens // BLOCK` blocks of `data`."""
    blocks = n_tokens // BLOCK
    return xxhash.xxh3_64_intdigest(memoryview(data)[: blocks * _BLOCK_BYTES])

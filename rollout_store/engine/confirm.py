"""Confirming re-sent messages: one packing of a request, prefix keys at its message
boundaries, and cryptographic digests of packed prefixes.

A request re-sends, byte for byte, an earlier request plus a few new messages. The request's
non-system messages before its last few are packed and hashed by the engine in one call
(`Packer.hash_prefix`: no buffer of the whole prefix is made); the last few are packed one by
one, so the digests at their boundaries are known. Plain packings are the engine's canonical
packing (`Packer(None, None)`: every string inline), the same bytes msgpack writes for plain
JSON values. A stored request is found by the BLAKE3 digest of its whole packed prefix (never of
one message: buckets would grow with content that many rollouts share): its first 8 bytes are
the index key, and all 32 confirm the match. xxh3 collisions can be crafted, BLAKE3 collisions
cannot, so a digest match stands for a byte comparison. Packed msgpack items are
self-delimiting, so equal prefix bytes mean equal leading messages.

Long strings need not be hashed again on every turn: the latest turn of a conversation is a
`Tip` that remembers where its blobs are (message and path, and the blob's own string) and a
BLAKE3 digest of its request "hollowed" (each blob string replaced by a placeholder). A fresh
request is confirmed against a tip by comparing each such string with the blob (`==` on two
`str`: memcmp speed) and the digest of its own hollowed packing with the tip's; its plain
digest then continues from the tip's BLAKE3 state, so only the new messages are hashed whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import xxhash

from .._core import Blake3, Packer
from .encoding import array_header, no_echo, unpack

__all__ = [
    "HOLE_MIN",
    "MAX_RAW_TIPS",
    "MAX_TIPS",
    "TIP_MIN_BYTES",
    "RAW_HEAD",
    "WINDOW",
    "Hole",
    "Probe",
    "RawTip",
    "RawTips",
    "TextHole",
    "Tip",
    "Tips",
    "array_items",
    "digest_key",
    "hollow_hasher",
    "hollowed",
    "holes_of",
    "hollow_text",
    "text_holes",
    "mark_length",
    "marked_between",
    "prefix_digest",
    "prefix_keys",
    "raw_end",
]

#: How many trailing message boundaries are probed, at most, before every boundary is.
WINDOW = 8


def prefix_digest(data: bytes | memoryview) -> bytes:
    """The BLAKE3 digest (32 bytes) of a packed request prefix."""
    return Blake3(data).digest()


def digest_key(digest: bytes) -> int:
    """The index key of a prefix: the first 8 bytes of its digest."""
    return int.from_bytes(digest[:8], "little")


def prefix_keys(plains: Sequence[bytes]) -> list[int]:
    """Index keys of every prefix of a request: keys[m] is that of its first m messages."""
    hasher = Blake3()
    keys = [digest_key(hasher.digest())]
    for plain in plains:
        hasher.update(plain)
        keys.append(digest_key(hasher.digest()))
    return keys


def mark_length(lengths: bytearray, n: int) -> None:
    """Set bit `n` of a bitmap of message counts (what `Probe` takes as `lengths`)."""
    if n >> 3 >= len(lengths):
        lengths.extend(bytes((n >> 3) + 1 - len(lengths)))
    lengths[n >> 3] |= 1 << (n & 7)


def marked_between(lengths: bytearray, low: int, n: int) -> list[int]:
    """The offsets j, lowest first, of the counts low + j strictly between `low` and `n`
    that the bitmap `lengths` marks (see `mark_length`): mostly none. One int is cut from
    the bitmap and its set bits taken lowest first, so the cost is that of the marks."""
    if n - low < 2:
        return []
    first = (low + 1) >> 3
    bits = int.from_bytes(lengths[first : (n >> 3) + 1], "little") >> (low + 1 - (first << 3))
    bits &= (1 << (n - low - 1)) - 1
    offsets = []
    while bits:
        bit = bits & -bits
        bits ^= bit
        offsets.append(bit.bit_length())  # bit b stands for the count low + 1 + b
    return offsets


class Probe:
    """One request's non-system messages, packed once, with keys and digests of its prefixes.

    The messages before the last `window` (at most `WINDOW`) are packed as arrays of many
    messages (a few C calls) and hashed as they go; the last ones are packed one by one, so
    the digest at each of their boundaries is known (given `lengths`, a bitmap of the message
    counts of stored requests, see `mark_length`: only at those boundaries and at the end, as
    no other boundary can match). `plains[i]` is the packing of message i where known (from
    `low` on), `digests[j]` the digest of the first j messages where known. Raises what the
    packer raises when some message cannot be packed plainly (the caller then takes the
    validating path). `size` is the bytes of all the plain packings, where known (None: a
    probe that continues a tip).
    """

    __slots__ = (
        "_pack",
        "digests",
        "hasher",
        "hollow",
        "low",
        "messages",
        "n",
        "plains",
        "size",
        "tip",
    )

    def __init__(
        self,
        messages: Sequence[Any],
        packer: Packer,
        window: int = WINDOW,
        lengths: bytearray | None = None,
        last: list[bytes] | None = None,
    ) -> None:
        if type(messages) is not list:
            messages = list(messages)
        n = len(messages)
        low = n - window if n > window else 0
        self.n = n
        self.messages = messages
        pack: Callable[[Any], bytes] = packer.pack
        self._pack = pack
        self.tip: Tip | None = None  # the tip it continues (see `continuing`)
        self.hollow: Any = None  # then: the BLAKE3 state of its hollowed packing
        if last is None:  # the last messages one by one (their packings are needed anyway)
            last = [pack(message) for message in messages[low:]]
        size = sum(map(len, last))
        hasher, hashed = packer.hash_prefix(messages, low)
        self.size: int | None = size + hashed
        update = hasher.update
        plains: list[bytes | None] = [None] * low
        plains.extend(last)
        digest = hasher.digest
        join = b"".join
        if lengths is None:
            digests: list[bytes | None] = [None] * low
            digests.append(digest())
            for plain in last:
                update(plain)
                digests.append(digest())
        else:  # digests only where a stored request may end, and at the end
            digests = [None] * (n + 1)
            if low >> 3 < len(lengths) and lengths[low >> 3] >> (low & 7) & 1:
                digests[low] = digest()
            done = 0  # packings of `last` hashed so far: one update per digest
            for j in marked_between(lengths, low, n):
                update(join(last[done:j]))
                done = j
                digests[low + j] = digest()
            update(join(last[done:]))
            digests[n] = digest()
        self.plains = plains
        self.digests = digests
        self.low = low
        self.hasher = hasher  # has seen every message: where a continuation's digest starts

    @classmethod
    def continuing(
        cls,
        tips: Tips,
        messages: list[Any],
        packer: Packer,
        window: int,
        lengths: bytearray,
    ) -> Probe:
        """A probe of `messages` that continues a tip with holes (confirmed as `Tip` says),
        else a usual one.

        Only the messages after the tip's are packed and hashed whole; `low` is the tip's
        message count, so every boundary below it takes `extend`, as in a usual probe."""
        n = len(messages)
        low = n - window if n > window else 0
        pack = packer.pack
        last = [pack(message) for message in messages[low:]]
        for j in range(n, low, -1):
            for tip in tips.find(j, last[j - 1 - low]):
                hollow = tip.confirm(messages, pack)
                if hollow is None:
                    continue
                probe = cls.__new__(cls)
                probe.n, probe.messages, probe._pack = n, messages, pack
                probe.tip, probe.hollow = tip, hollow
                probe.size = None  # (what the tip stands for is not packed)
                plains: list[bytes | None] = [None] * low
                plains.extend(last)
                digests: list[bytes | None] = [None] * (n + 1)
                digests[j] = tip.turn.digest
                hasher = tip.plain_state.copy()
                # boundaries after the tip where a stored request may end, and the end
                done = j
                for k in range(j + 1, n + 1):
                    if k == n or (k >> 3 < len(lengths) and lengths[k >> 3] >> (k & 7) & 1):
                        hasher.update(b"".join(last[done - low : k - low]))
                        done = k
                        digests[k] = hasher.digest()
                probe.plains, probe.digests, probe.low, probe.hasher = plains, digests, j, hasher
                return probe
        return cls(messages, packer, window, lengths, last)

    @classmethod
    def at_base(
        cls,
        messages: list[Any],
        pack: Callable[[Any], bytes],
        hasher: Any,
        last: list[bytes],
        low: int,
        marks: Sequence[int],
        size: int,
    ) -> Probe:
        """A probe of `messages` whose first `low` a BLAKE3 `hasher` has seen packed (see
        `Packer.hash_prefix`) and the others packed in `last`, one by one: the digest at `low`
        is known, as are those at the end and at every count low + j between for j in
        `marks` (the counts stored requests have there, lowest first: `marked_between`); a
        turn's base at `low`, found by other means, is then confirmed by it. `size`: the
        bytes of all the plain packings."""
        n = len(messages)
        probe = cls.__new__(cls)
        probe.n, probe.messages, probe._pack = n, messages, pack
        probe.tip, probe.hollow, probe.size = None, None, size
        digests: list[bytes | None] = [None] * (n + 1)
        digest = hasher.digest
        digests[low] = digest()
        join = b"".join
        if marks:
            update = hasher.update
            done = 0  # packings of `last` hashed so far
            for j in marks:
                update(join(last[done:j]))
                done = j
                digests[low + j] = digest()
            update(join(last[done:]))
        else:  # the common case: no stored request ends between
            hasher.update(join(last))
        digests[n] = digest()
        plains: list[bytes | None] = [None] * low
        plains += last
        probe.plains, probe.digests, probe.low, probe.hasher = plains, digests, low, hasher
        return probe

    def extend(self) -> None:
        """Know the plains and digests of every boundary."""
        digests = self.digests
        if not self.low and None not in digests:
            return
        pack, plains, messages = self._pack, self.plains, self.messages
        for i in range(self.low):
            if plains[i] is None:
                plains[i] = pack(messages[i])
        # hashed only up to the last boundary whose digest is not known (mostly the one
        # before the last message: a root's keys need every prefix but the whole request,
        # whose digest is known, and its last message is often its longest, a screenshot)
        last = len(digests) - 1
        while digests[last] is not None:
            last -= 1
            if last < 0:
                self.low = 0
                return
        hasher = Blake3()
        digests[0] = hasher.digest()
        for i in range(last):
            hasher.update(plains[i])  # type: ignore[arg-type]
            digests[i + 1] = hasher.digest()
        self.low = 0

    def key(self, j: int) -> int:
        """The index key of the first `j` messages."""
        return digest_key(self.digest(j))

    def plain(self, i: int) -> bytes:
        """The packing of message `i`."""
        if i < self.low:
            self.extend()
        return self.plains[i]  # type: ignore[return-value]

    def digest(self, j: int) -> bytes:
        """The BLAKE3 digest of the packing of the first `j` messages."""
        found = self.digests[j] if j >= self.low else None
        if found is None:
            self.extend()
            found = self.digests[j]
        return found  # type: ignore[return-value]

    def all_plains(self) -> list[bytes]:
        """Every message's packing."""
        self.extend()
        return self.plains  # type: ignore[return-value]

    def keys(self) -> list[int]:
        """The index keys of every prefix."""
        self.extend()
        return [digest_key(d) for d in self.digests]  # type: ignore[arg-type]


#: A raw request is found among stored ones by the xxh3 key of its first bytes.
RAW_HEAD = 4096
#: Raw tips kept per graph (the latest raw turn of each conversation, oldest dropped first).
MAX_RAW_TIPS = 64
_CHECK = 64  # bytes before a tip's end whose xxh3 filters candidates before BLAKE3 confirms

_WS = b" \t\r\n"


def raw_end(data: bytes) -> int | None:
    """Where the last item of a JSON array text ends (before its closing bracket), or None
    when the text does not end with a bracket after an item. Looks at the last bytes only."""
    end = len(data)
    while end and data[end - 1] in _WS:
        end -= 1
    if end < 2 or data[end - 1] != 0x5D:  # "]"
        return None
    end -= 1
    while end and data[end - 1] in _WS:
        end -= 1
    return end if end > 1 else None


#: A long blob string in a messages text: where its UTF-8 bytes are, and the blob's string.
TextHole = tuple[int, int, str]


def text_holes(data: bytes, start: int, end: int, blobs: Sequence[str]) -> list[TextHole]:
    """Where the UTF-8 bytes of these long blob strings (in the order they are written)
    occur in `data[start:end]`, each looked for after the one before (one pass over the
    text); a string written with escapes is not found, and stays hashed."""
    holes: list[TextHole] = []
    at = start
    for blob in blobs:
        if len(blob) < HOLE_MIN:
            continue
        try:
            needle = blob.encode("utf-8")
        except UnicodeEncodeError:
            continue
        found = _find_long(data, needle, at, end)
        if found >= 0:
            at = found + len(needle)
            holes.append((found, at, blob))
    return holes


#: A long string is looked for by its first bytes, and compared whole (a memcmp) where they
#: occur: `bytes.find` of the whole string first reads all of it through (the preprocessing
#: of its two-way search, which costs more than the search itself in a short text). After a
#: few places that begin alike but differ, `bytes.find` decides (so no crafted text makes
#: the search quadratic).
_PROBE = 64
_PROBE_TRIES = 8


def _find_long(data: bytes, needle: bytes, start: int, end: int) -> int:
    """`data.find(needle, start, end)`, mostly in a memchr-like scan and one memcmp."""
    probe = needle[:_PROBE]
    found = data.find(probe, start, end)
    for _ in range(_PROBE_TRIES):
        if found < 0 or data.startswith(needle, found, end):
            return found
        found = data.find(probe, found + 1, end)
    return data.find(needle, found, end) if found >= 0 else -1


def hollow_text(
    data: bytes, start: int, end: int, holes: list[TextHole], hasher: Any = None
) -> Any:
    """A BLAKE3 state that has seen `data[start:end]` but the holes (continuing `hasher`),
    or None when a hole does not hold its blob's very bytes. The holes' places are fixed, so
    equal digests and equal holes mean equal texts.

    Every hole is checked first (a mismatch hashes nothing), in place by the engine (no
    copy of an ASCII blob's text), then the bytes between them are hashed."""
    if hasher is None:
        hasher = Blake3()
    return hasher if hasher.update_hollow(data, start, end, holes) else None


class RawTip:
    """The latest raw turn of a conversation: where its messages text ended, the digest of
    that text (its long blob strings cut out, at `holes`: they are compared), and the BLAKE3
    state after its plain packing (so a raw continuation gets its plain digest, and is found
    by decoded turns, without packing what it re-sends)."""

    __slots__ = (
        "check",
        "digest",
        "end",
        "head",
        "holes",
        "n_sys",
        "plain_state",
        "system_plain",
        "turn",
    )

    def __init__(
        self,
        turn: Any,
        data: bytes,
        end: int,
        digest: bytes,
        plain_state: Any,
        system_plain: bytes | None,
        n_sys: int,
        holes: list[TextHole] | None = None,
    ) -> None:
        self.turn = turn
        self.n_sys = n_sys
        self.end = end
        self.holes: list[TextHole] = holes or []
        self.head = xxhash.xxh3_64_intdigest(memoryview(data)[: min(end, RAW_HEAD)])
        self.check = xxhash.xxh3_64_intdigest(memoryview(data)[max(end - _CHECK, 0) : end])
        self.digest = digest
        self.plain_state = plain_state
        self.system_plain = system_plain


class RawTips:
    """A graph's raw tips (at most MAX_RAW_TIPS), found by the key of the first bytes of a
    messages text: its first RAW_HEAD bytes, or all of a shorter tip's text."""

    __slots__ = ("_by_head", "_order", "_short_ends")

    def __init__(self) -> None:
        self._by_head: dict[int, list[RawTip]] = {}
        self._order: dict[int, RawTip] = {}  # by id, oldest first
        self._short_ends: dict[int, int] = {}  # ends below RAW_HEAD -> how many tips

    def find(self, data: bytes) -> tuple[RawTip, Any] | None:
        """The longest tip whose messages text `data` extends by at least one item, and a
        BLAKE3 hasher that has seen `data` up to that tip's end but its holes (confirmed by
        its digest and the holes' bytes)."""
        view = memoryview(data)
        n = len(data)
        sizes = sorted((e for e in self._short_ends if e < n), reverse=True)
        if n > RAW_HEAD:
            sizes.insert(0, RAW_HEAD)
        for size in sizes:
            best: tuple[RawTip, Any] | None = None
            for tip in self._by_head.get(xxhash.xxh3_64_intdigest(view[:size]), ()):
                end = tip.end
                if end >= n or (best is not None and end <= best[0].end):
                    continue
                if not data[end : end + 64].lstrip(_WS).startswith(b","):
                    continue
                if xxhash.xxh3_64_intdigest(view[max(end - _CHECK, 0) : end]) != tip.check:
                    continue
                hasher = hollow_text(data, 0, end, tip.holes)  # no holes: all of it hashed
                if hasher is None:
                    continue
                if hasher.digest() == tip.digest:
                    best = (tip, hasher)
            if best is not None:
                return best
        return None

    def add(self, tip: RawTip, replaces: RawTip | None) -> None:
        if replaces is not None:
            self._drop(replaces)
        self._by_head.setdefault(tip.head, []).append(tip)
        self._order[id(tip)] = tip
        if tip.end < RAW_HEAD:
            self._short_ends[tip.end] = self._short_ends.get(tip.end, 0) + 1
        while len(self._order) > MAX_RAW_TIPS:
            self._drop(next(iter(self._order.values())))

    def _drop(self, tip: RawTip) -> None:
        if self._order.pop(id(tip), None) is None:
            return
        tips = self._by_head[tip.head]
        tips.remove(tip)
        if not tips:
            del self._by_head[tip.head]
        if tip.end < RAW_HEAD:
            left = self._short_ends[tip.end] - 1
            if left:
                self._short_ends[tip.end] = left
            else:
                del self._short_ends[tip.end]


#: Tips kept per graph (the latest decoded turn of each conversation, oldest dropped first).
MAX_TIPS = 64
#: A conversation gets a tip only once its long blob strings hold this many characters in
#: all: a tip keeps a BLAKE3 state of about 2 KB, and below this size hashing the strings
#: again costs no measurable time (measured: add_turn of a GRPO group whose rollouts share
#: one 200 KiB screenshot, 590 us median with tips, 599 without; of one with a new 100 KiB
#: screenshot each turn, up to 1.2 MiB a request, no faster with them either).
TIP_MIN_BYTES = 1 << 20
#: What stands for a blob string in a hollowed packing (never stored: only hashed). Any
#: fixed value does: the string at each hole is compared with its blob before the digests.
_HOLE = None
#: Plain packings of at most this many messages at a time while hashing a hollowed request.
_RUN = 256
#: Blob strings shorter than this stay in the hollowed packing (hashed whole): comparing one
#: costs a few Python calls, which hashing saves only on long strings (measured: a 64 KiB
#: screenshot gains several microseconds, an 8 KiB tool output none).
HOLE_MIN = 1 << 14

#: One blob string of a message: the path to it (keys and indexes) and the blob's string.
Hole = tuple[tuple[Any, ...], str]


def holes_of(stored: bytes, string: Callable[[int], str]) -> list[Hole]:
    """The blob strings of one stored packing (a message or a response) at least HOLE_MIN
    long, and their paths.

    Others (shorter ones, and blob strings as dict keys) are not listed: a hollowed packing
    keeps them whole, which is exact too."""
    blobs: dict[int, str] = {}

    def lookup(index: int) -> str:
        text = string(index)
        blobs[id(text)] = text
        return text

    value = unpack(stored, lookup, no_echo)
    found: list[Hole] = []
    if type(value) is not dict and type(value) is not list:
        return found
    # in the order they are written (a stack of iterators: no recursion)
    stack: list[tuple[Any, tuple[Any, ...]]] = [(_items(value), ())]
    while stack:
        items, path = stack[-1]
        for key, child in items:
            kind = type(child)
            if kind is str:
                if id(child) in blobs and len(child) >= HOLE_MIN:
                    found.append(((*path, key), child))
            elif kind is dict or kind is list:
                stack.append((_items(child), (*path, key)))
                break
        else:
            stack.pop()
    return found


def _items(node: Any) -> Any:
    return iter(node.items()) if type(node) is dict else enumerate(node)


def hollowed(message: Any, holes: list[Hole]) -> Any:
    """A copy of `message` with each hole's string replaced by the placeholder, copying only
    the containers on the way; None unless every hole holds exactly its blob's string."""
    copies: dict[int, Any] = {}
    root = _copy(message, copies)
    if root is None:
        return None
    for path, blob in holes:
        node, copy = message, root
        last = len(path) - 1
        for depth, key in enumerate(path):
            try:
                child = node[key]
            except (KeyError, IndexError, TypeError):
                return None
            if depth == last:
                if type(child) is not str or child != blob:
                    return None
                copy[key] = _HOLE
                break
            child_copy = _copy(child, copies)
            if child_copy is None:
                return None
            copy[key] = child_copy
            node, copy = child, child_copy
    return root


def _copy(node: Any, copies: dict[int, Any]) -> Any:
    found = copies.get(id(node))
    if found is None:
        kind = type(node)
        if kind is dict:
            found = dict(node)
        elif kind is list:
            found = list(node)
        else:
            return None
        copies[id(node)] = found
    return found


class Tip:
    """The latest decoded turn of a conversation whose request holds long blob strings, and
    what confirms a request that re-sends it: its message count, where those strings are
    (`holes`: message index and that message's holes, in order), the BLAKE3 digest of its
    hollowed packing and the BLAKE3 state after its plain packing (the turn's digest; one
    state a tip, about 2 KB: a continuation's hollowed state is its own)."""

    __slots__ = ("holes", "hollow_digest", "key", "n", "plain_state", "turn")

    def __init__(
        self,
        turn: Any,
        n: int,
        last_plain: bytes,
        holes: list[tuple[int, list[Hole]]],
        hollow_state: Any,
        plain_state: Any,
    ) -> None:
        self.turn = turn
        self.n = n
        self.holes = holes
        self.plain_state = plain_state
        self.key = (n, xxhash.xxh3_64_intdigest(last_plain))  # a filter: `confirm` decides
        self.hollow_digest = hollow_state.digest()

    def confirm(self, messages: list[Any], pack: Callable[[Any], bytes]) -> Any:
        """The BLAKE3 state after the hollowed packing of `messages[:n]` when it equals this
        tip's (each blob string compared whole, the rest by the digest), else None."""
        if self.n > len(messages):
            return None
        hasher = hollow_hasher(messages, self.n, self.holes, pack)
        return hasher if hasher is not None and hasher.digest() == self.hollow_digest else None


def hollow_hasher(
    messages: list[Any], n: int, holes: list[tuple[int, list[Hole]]], pack: Callable[[Any], bytes]
) -> Any:
    """The BLAKE3 state after the hollowed packing of `messages[:n]` with these holes (the
    messages between them packed plainly), or None when a hole does not hold its blob's very
    string or something does not pack plainly."""
    hasher = Blake3()
    update = hasher.update
    start = 0
    try:
        for i, message_holes in (*holes, (n, None)):
            while start < i:  # the messages between holes, packed plainly in runs
                stop = min(i, start + _RUN)
                run = pack(messages[start:stop])
                update(memoryview(run)[len(array_header(stop - start)) :])
                start = stop
            if message_holes is None:
                break
            hollow = hollowed(messages[i], message_holes)
            if hollow is None:
                return None
            update(pack(hollow))
            start = i + 1
    except ValueError:  # something that does not pack plainly: not this request
        return None
    return hasher


def array_items(data: bytes) -> list[bytes]:
    """The packed items of a packed array (a stored tail), each as its bytes."""
    unpacker = msgpack.Unpacker(raw=True, strict_map_key=False, max_buffer_size=len(data) + 1)
    unpacker.feed(data)
    items = []
    start = 0
    for _ in range(unpacker.read_array_header()):
        start = start or unpacker.tell()
        unpacker.skip()
        end = unpacker.tell()
        items.append(data[start:end])
        start = end
    return items


class Tips:
    """A graph's tips (at most MAX_TIPS), found by message count and the xxh3 of the last
    message's plain packing (a filter only: a tip confirms), and by their turn."""

    __slots__ = ("_by_key", "_by_turn")

    def __init__(self) -> None:
        self._by_key: dict[tuple[int, int], list[Tip]] = {}
        self._by_turn: dict[int, Tip] = {}  # by the turn's index, oldest first

    def __bool__(self) -> bool:
        return bool(self._by_turn)

    def find(self, n: int, last_plain: bytes) -> list[Tip]:
        """Tips of `n` messages whose last message may pack as `last_plain`."""
        found = self._by_key.get((n, xxhash.xxh3_64_intdigest(last_plain)))
        return found if found is not None else []

    def of(self, turn: Any) -> Tip | None:
        """The tip of this very turn, if it is one."""
        return self._by_turn.get(turn.index)

    def add(self, tip: Tip, replaces: Tip | None) -> None:
        if replaces is not None:
            self._drop(replaces)
        self._by_key.setdefault(tip.key, []).append(tip)
        self._by_turn[tip.turn.index] = tip
        while len(self._by_turn) > MAX_TIPS:
            self._drop(next(iter(self._by_turn.values())))

    def _drop(self, tip: Tip) -> None:
        if self._by_turn.get(tip.turn.index) is not tip:
            return
        del self._by_turn[tip.turn.index]
        tips = self._by_key[tip.key]
        tips.remove(tip)
        if not tips:
            del self._by_key[tip.key]

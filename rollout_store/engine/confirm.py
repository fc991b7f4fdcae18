"""Digests of packed request prefixes, and the raw tips: a raw text that re-sends an earlier
one is known by the BLAKE3 of its bytes, its long strings compared in place.

A stored request is found by the BLAKE3 digest of its non-system messages' plain packings
(the engine's canonical packing, `Packer(None, None)`: every string inline): its first 8
bytes are the index key, and all 32 confirm the match. xxh3 collisions can be crafted,
BLAKE3 collisions cannot, so a digest match stands for a byte comparison. The graph's
request table (`_core.RequestTable`) finds bases by these digests; this module gives them
to the Python side (prefix keys of a root, the digest of a turn read from a file).

A raw text of messages mostly re-sends the text of its conversation's latest raw turn and
adds a few items: that turn is a `RawTip`, which keeps the BLAKE3 of its text up to its last
item with its long blob strings cut out (they are compared with the blobs in place, at
memcmp speed, where hashing them again would cost ten times more) and the BLAKE3 state of
its packings there, so the table goes on from that state and only the new items are read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import xxhash

from .._core import Blake3
from .encoding import no_echo, unpack

__all__ = [
    "HOLE_MIN",
    "MAX_RAW_TIPS",
    "RAW_HEAD",
    "Hole",
    "RawTip",
    "RawTips",
    "TextHole",
    "array_items",
    "digest_key",
    "holes_of",
    "hollow_text",
    "text_holes",
    "prefix_digest",
    "raw_end",
]


def prefix_digest(data: bytes | memoryview) -> bytes:
    """The BLAKE3 digest (32 bytes) of a packed request prefix."""
    return Blake3(data).digest()


def digest_key(digest: bytes) -> int:
    """The index key of a prefix: the first 8 bytes of its digest."""
    return int.from_bytes(digest[:8], "little")


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


#: Blob strings shorter than this stay in a raw tip's hashed text (hashed whole): comparing
#: one costs a few Python calls, which hashing saves only on long strings.
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

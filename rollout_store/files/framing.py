"""Frames of format version 2, read and written by the engine (`rollout_store._core`).

Every frame is the 5-byte sync marker, a kind byte, the payload length on disk, the chain
value of the frame before it and its own chain value, then the payload (`docs/format.md`).
The engine encodes frames, verifies a file's frames in order with the GIL released, finds
the next whole frame past damage (linear in the damaged bytes) and says what a damaged
stretch held (`read_gap`); this module gives those results the library's shapes and errors.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .._core import (
    DIGEST_SIZE,
    ESCAPE,
    ESCAPED,
    HEADER_LAYOUT,
    MAGIC_V2,
    MAX_PAYLOAD,
    SYNC,
    AsciiText,
    FrameScan,
    FrameTooLarge,
    frame_chain_value,
)
from .._core import encode_blob_frame as _encode_blob_frame
from .._core import encode_frame as _encode_frame
from .._core import next_frame as _next_frame
from .._core import read_gap as _read_gap
from ..errors import ChecksumMismatch, CorruptFileError, RecordTooLargeError

__all__ = [
    "DIGEST_SIZE",
    "ESCAPE",
    "ESCAPED",
    "HEADER",
    "MAGIC_V2",
    "MAX_PAYLOAD",
    "SYNC",
    "Frame",
    "FrameReader",
    "Gap",
    "Part",
    "ScanCounters",
    "chain_value",
    "damage_error",
    "encode_frame",
    "encode_blob_frame",
    "new_file_id",
    "next_frame",
    "read_gap",
]

# The format's constants are the engine's (`MAGIC_V2`; `ESCAPE`, bytes valid UTF-8 never
# holds, which a payload holding them is written escaped for; `SYNC`, the marker; the kind
# bit `ESCAPED`; `MAX_PAYLOAD`; a blob's `DIGEST_SIZE`).
HEADER = struct.Struct(HEADER_LAYOUT)  # sync, kind, length on disk, previous chain, chain
#: A part of a frame as the encoders give it: bytes, or a blob's ASCII text as the str's own
#: storage (`AsciiText`, a buffer `os.writev` and `bytes.join` take as they take bytes).
Part = bytes | AsciiText

#: (kind, payload, offset, record, end, chain): a frame as `FrameReader.tuples` yields it
FrameTuple = tuple[int, memoryview, int, int, int, int]
#: (message, offset, record, checksum): the damage a `FrameScan` stopped at
Damage = tuple[str, int, int, tuple[str, int, int] | tuple[str, bytes, bytes] | None]


def new_file_id() -> int:
    """A random 64-bit id for a new file's header: its frames' chain starts there."""
    return int.from_bytes(os.urandom(8), "little")


def chain_value(kind_byte: int, length: int, prev: int, hashed: bytes | memoryview) -> int:
    """The chain value of a frame: `hashed` is its payload (a blob's: its digest)."""
    return frame_chain_value(kind_byte, length, prev, bytes(hashed))


def encode_frame(kind: int, payload: bytes, prev: int) -> tuple[bytes, int]:
    """(frame bytes, its chain value) for a record of `kind` after the frame valued `prev`."""
    try:
        return _encode_frame(kind, payload, prev)
    except FrameTooLarge as exc:
        raise RecordTooLargeError(str(exc)) from None


def encode_blob_frame(
    kind: int, digest: bytes, data: bytes | str, prev: int
) -> tuple[list[Part], int]:
    """A blob frame as parts (the text is never copied into a joined payload) and its chain
    value. `data`: UTF-8, or the str itself (an ASCII str's storage is its UTF-8: it is the
    part, as `AsciiText`; any other is encoded with `surrogatepass`). UTF-8 never holds
    `ESCAPE`; only the digest may need escaping."""
    try:
        return _encode_blob_frame(kind, digest, data, prev)
    except FrameTooLarge as exc:
        raise RecordTooLargeError(str(exc)) from None


def _mask(kinds: Iterable[int]) -> int:
    """The engine's form of a set of record kinds: bit k for kind k."""
    return sum(1 << kind for kind in kinds)


@dataclass
class Frame:
    """One verified frame: its kind, unescaped payload, place in the file and chain value."""

    kind: int
    payload: memoryview
    offset: int
    end: int
    record: int
    chain: int


@dataclass
class ScanCounters:
    """Work done while scanning, for tests that check it grows linearly with the input."""

    hashed_bytes: int = 0
    searched_bytes: int = 0
    candidates: int = 0

    def add(self, hashed: int, searched: int, candidates: int) -> None:
        self.hashed_bytes += hashed
        self.searched_bytes += searched
        self.candidates += candidates


def next_frame(
    data: bytes,
    after: int,
    *,
    digest_kinds: frozenset[int] = frozenset(),
    max_kind: int = 0x7F,
    counters: ScanCounters | None = None,
) -> int | None:
    """The offset of the first whole frame that verifies by itself and starts after `after`,
    or None. Linear in `len(data) - after`."""
    found, hashed, searched, candidates = _next_frame(data, after, _mask(digest_kinds), max_kind)
    if counters is not None:
        counters.add(hashed, searched, candidates)
    return found


class FrameReader:
    """Reads the frames of a version-2 file in order, each verified and bound to the one
    before it. Iterating stops at the end of the file or raises `CorruptFileError` at the
    first frame that does not verify; `cut` then says whether the damage is a torn tail
    (no whole frame follows it), and `resync` where the next whole frame starts."""

    def __init__(
        self,
        data: bytes,
        start: int,
        *,
        digest_kinds: frozenset[int] = frozenset(),
        max_kind: int = 0x7F,
        counters: ScanCounters | None = None,
    ) -> None:
        self.data = data
        self.offset = start
        self.digest_kinds = _mask(digest_kinds)
        self.max_kind = max_kind
        self.counters = counters
        self.chain = 0  # the header frame follows a chain value of 0
        self.records = 0
        self.cut = False
        self.resync: int | None = None

    def __iter__(self) -> Iterator[Frame]:
        for kind, payload, offset, record, end, chain in self.tuples():
            yield Frame(kind, payload, offset, end, record, chain)

    def tuples(self) -> Iterator[FrameTuple]:
        """What iterating yields, as plain tuples (kind, payload, offset, record, end,
        chain): a loader's fast path. The engine verifies every frame up to the end or the
        first damage before the first is yielded."""
        scan = FrameScan(
            self.data, self.offset, self.chain, self.records, self.digest_kinds, self.max_kind
        )
        if self.counters is not None:
            self.counters.add(*scan.counters)
        for frame in scan:
            yield frame
            self.offset, self.chain, self.records = frame[4], frame[5], frame[3] + 1
        damage = scan.damage
        if damage is None:
            return
        self.resync = scan.resync
        self.cut = self.resync is None
        raise damage_error(damage)


def damage_error(damage: Damage) -> CorruptFileError:
    """The library's error for the damage a `FrameScan` stopped at."""
    message, offset, record, checksum = damage
    if checksum is None:
        return CorruptFileError(message, offset=offset, record=record)
    what, expected, actual = checksum
    return ChecksumMismatch(what, expected, actual, offset=offset, record=record)


@dataclass
class Gap:
    """Damaged bytes `[start, end)` between the last frame that verifies and the next one.

    `repaired`: the one frame there, whole (only its header was damaged: it is rebuilt from
    its neighbours and verified by its chain value). Otherwise `kinds` are the kinds of the
    frames lost there, in order, where their headers still link the chain value before the
    damage to the one after it; None when that cannot be told."""

    start: int
    end: int
    kinds: list[int] | None
    repaired: Frame | None = None


def read_gap(
    data: bytes,
    start: int,
    end: int,
    prev: int,
    record: int,
    *,
    digest_kinds: frozenset[int] = frozenset(),
    max_kind: int = 0x7F,
    counters: ScanCounters | None = None,
) -> Gap:
    """What the damaged bytes `[start, end)` held: `prev` is the chain value of the frame
    before them (the header's predecessor: 0), `end` the offset of the next frame that
    verifies by itself, `record` the index the first damaged frame has."""
    start, end, kinds, repaired, hashed = _read_gap(
        data, start, end, prev, record, _mask(digest_kinds), max_kind
    )
    if counters is not None:
        counters.add(hashed, 0, 0)
    if repaired is None:
        return Gap(start, end, kinds)
    kind, payload, offset, number, frame_end, chain = repaired
    return Gap(start, end, kinds, Frame(kind, payload, offset, frame_end, number, chain))

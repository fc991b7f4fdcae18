"""Frames of format version 2: a sync marker, escaped payloads and a checksum chain.

Every frame is the 5-byte sync marker, a kind byte, the payload length on disk (4 bytes LE),
the chain value of the frame before it (8 bytes LE) and its own chain value (8 bytes LE),
then the payload. A frame's chain value is xxh3-64 of its payload seeded with xxh3-64 of its
kind, length and predecessor's value, so each frame is bound to everything before it (the
first frame, the header, carries a random file id: frames cannot move between files).

The marker's first four bytes (`ESCAPE`) never occur in UTF-8 text; a payload that holds them
anywhere else is written escaped (each occurrence followed by a zero byte, the kind's high bit
set), so the marker never occurs inside a payload and no content can pass for a frame
boundary. After damage, the next frame is found by searching for the marker: a candidate's
payload must hold no marker and must hash to its chain value, so every byte is searched a
bounded number of times and hashed at most once: resync is linear in the damaged bytes.

A blob frame's payload is a 16-byte content digest and the UTF-8 text; its chain value hashes
the digest, and the text is hashed once, for the digest (one pass over each stored byte).

Between the last frame that verifies and the next one (found as above), `read_gap` says what
the damaged bytes held: the frame that follows names the chain value of the frame before it,
and the frame before damage gives the chain value the first damaged frame must name. So the
damaged stretch is one frame whose header alone was hit (rebuilt from its neighbours and
verified by its chain value: nothing is lost), or frames whose headers still link from one
chain value to the other (their kinds are known: a reader keeps every later reference to the
records around them right), or unknown (how many records it held cannot be told). Each
damaged byte is hashed a bounded number of times: still linear.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from ..engine.blobs import content_digest
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
    "ScanCounters",
    "chain_value",
    "encode_frame",
    "encode_blob_frame",
    "escape",
    "new_file_id",
    "next_frame",
    "read_gap",
    "unescape",
]

MAGIC_V2 = b"RLSTORE\x02"
#: Bytes that valid UTF-8 never holds (F5-FF), the first one not repeated: occurrences
#: cannot overlap, and a blob's text never needs escaping.
ESCAPE = b"\xfe\xf7\xfb\xfd"
SYNC = ESCAPE + b"\x02"
ESCAPED = 0x80  # kind bit: the payload is escaped on disk
HEADER = struct.Struct("<5sBIQQ")  # sync, kind, length on disk, previous chain, chain
_LINK = struct.Struct("<BIQ")  # what seeds a frame's hash: kind byte, length, previous chain
MAX_PAYLOAD = (1 << 31) - 1
DIGEST_SIZE = 16
_ESCAPED_PAIR = ESCAPE + b"\x00"


def new_file_id() -> int:
    """A random 64-bit id for a new file's header: its frames' chain starts there."""
    return int.from_bytes(os.urandom(8), "little")


def escape(payload: bytes) -> bytes:
    return payload.replace(ESCAPE, _ESCAPED_PAIR)


def unescape(stored: bytes | memoryview) -> bytes:
    return bytes(stored).replace(_ESCAPED_PAIR, ESCAPE)


_hash64 = xxhash.xxh3_64_intdigest


def chain_value(kind_byte: int, length: int, prev: int, hashed: bytes | memoryview) -> int:
    """The chain value of a frame: `hashed` is its payload (a blob's: its digest)."""
    return _hash64(hashed, seed=_hash64(_LINK.pack(kind_byte, length, prev)))


def encode_frame(kind: int, payload: bytes, prev: int) -> tuple[bytes, int]:
    """(frame bytes, its chain value) for a record of `kind` after the frame valued `prev`."""
    kind_byte = kind
    stored = payload
    if ESCAPE in payload:
        stored, kind_byte = escape(payload), kind | ESCAPED
    if len(stored) > MAX_PAYLOAD:
        raise RecordTooLargeError(
            f"a record of {len(stored)} bytes is larger than a frame can hold"
        )
    value = chain_value(kind_byte, len(stored), prev, payload)
    return HEADER.pack(SYNC, kind_byte, len(stored), prev, value) + stored, value


def encode_blob_frame(kind: int, digest: bytes, data: bytes, prev: int) -> tuple[list[bytes], int]:
    """A blob frame as parts (the text is never copied into a joined payload) and its chain
    value. `data` is UTF-8, which never holds `ESCAPE`; only the digest may need escaping."""
    if ESCAPE in digest:  # rare (about 13 in 2**32 digests): escape the payload
        stored = escape(digest + data)
        if len(stored) > MAX_PAYLOAD:
            raise RecordTooLargeError(
                f"a string of {len(data)} bytes is larger than a frame can hold"
            )
        kind_byte = kind | ESCAPED
        value = chain_value(kind_byte, len(stored), prev, digest)
        return [HEADER.pack(SYNC, kind_byte, len(stored), prev, value) + stored], value
    length = DIGEST_SIZE + len(data)
    if length > MAX_PAYLOAD:
        raise RecordTooLargeError(f"a string of {len(data)} bytes is larger than a frame can hold")
    value = chain_value(kind, length, prev, digest)
    return [HEADER.pack(SYNC, kind, length, prev, value), digest, data], value


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


class _Damage(Exception):
    """A frame that does not verify."""

    def __init__(self, error: CorruptFileError) -> None:
        super().__init__(str(error))
        self.error = error


def _damage(message: str, offset: int, record: int) -> _Damage:
    return _Damage(CorruptFileError(message, offset=offset, record=record))


def _check(
    data: bytes,
    view: memoryview,
    offset: int,
    record: int,
    reader: _Options,
    whole: bool,
) -> tuple[Frame, int]:
    """The frame at `offset`, verified by itself (not against its predecessor), and the chain
    value it names for its predecessor. Raises `_Damage`.

    `whole`: search a blob's text for the marker too (resync needs it to stay linear; in
    order, the loader's UTF-8 check of the text stands for it)."""
    kind_byte, length, prev, expected, start = _header(data, offset, record, reader)
    end = start + length
    is_blob = kind_byte & 0x7F in reader.digest_kinds
    searched = end if whole or not is_blob else min(end, start + DIGEST_SIZE + len(SYNC))
    counters = reader.counters
    if counters is not None:
        counters.searched_bytes += searched - start
    if data.find(SYNC, start, searched) != -1:
        raise _damage(
            "a frame marker inside a record (records run into each other)", offset, record
        )
    payload = view[start:end]
    if kind_byte & ESCAPED:
        payload = memoryview(unescape(payload))
    if is_blob and len(payload) < DIGEST_SIZE:
        raise _damage("blob record shorter than its digest", offset, record)
    hashed = payload[:DIGEST_SIZE] if is_blob else payload
    if counters is not None:
        counters.hashed_bytes += len(hashed) + (len(payload) - DIGEST_SIZE if is_blob else 0)
    actual = chain_value(kind_byte, length, prev, hashed)
    if actual != expected:
        raise _Damage(ChecksumMismatch("record", expected, actual, offset=offset, record=record))
    if is_blob:
        _check_digest(payload, offset, record)
    return Frame(kind_byte & 0x7F, payload, offset, end, record, expected), prev


def _header(
    data: bytes, offset: int, record: int, reader: _Options
) -> tuple[int, int, int, int, int]:
    """(kind byte, length, previous chain, chain, payload start) of the frame header at
    `offset`, which must be whole, start with the marker, name a known kind and a payload
    the file holds. Raises `_Damage`."""
    size = len(data)
    if size - offset < HEADER.size:
        raise _damage("file ends inside a frame header", offset, record)
    sync, kind_byte, length, prev, expected = HEADER.unpack_from(data, offset)
    if sync != SYNC:
        raise _damage("no frame marker where a frame must start", offset, record)
    if kind_byte & 0x7F > reader.max_kind:
        raise _damage(f"unknown record kind {kind_byte & 0x7F}", offset, record)
    start = offset + HEADER.size
    if start + length > size:
        message = f"file ends inside a record: {size - start} of {length} bytes present"
        raise _damage(message, offset, record)
    return kind_byte, length, prev, expected, start


def _check_digest(payload: memoryview, offset: int, record: int) -> None:
    """A blob's text must hash to the digest its payload starts with."""
    stored = bytes(payload[:DIGEST_SIZE])
    digest = content_digest(payload[DIGEST_SIZE:])
    if digest != stored:
        raise _Damage(ChecksumMismatch("blob", stored, digest, offset=offset, record=record))


@dataclass
class _Options:
    digest_kinds: frozenset[int]
    max_kind: int
    counters: ScanCounters | None


def next_frame(
    data: bytes,
    after: int,
    *,
    digest_kinds: frozenset[int] = frozenset(),
    max_kind: int = 0x7F,
    counters: ScanCounters | None = None,
) -> int | None:
    """The offset of the first whole frame that verifies by itself and starts after `after`,
    or None. Linear in `len(data) - after`: a candidate is a marker whose payload holds no
    other marker, so the payloads hashed never overlap."""
    view = memoryview(data)
    options = _Options(digest_kinds, max_kind, counters)
    pos = after + 1
    while True:
        found = data.find(SYNC, pos)
        if counters is not None:
            counters.searched_bytes += (found if found != -1 else len(data)) - pos
        if found == -1:
            return None
        if counters is not None:
            counters.candidates += 1
        try:
            _check(data, view, found, -1, options, whole=True)
        except _Damage:
            pos = found + 1
            continue
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
        self.options = _Options(digest_kinds, max_kind, counters)
        self.chain = 0  # the header frame follows a chain value of 0
        self.records = 0
        self.cut = False
        self.resync: int | None = None

    def __iter__(self) -> Iterator[Frame]:
        for kind, payload, offset, record, end, chain in self.tuples():
            yield Frame(kind, payload, offset, end, record, chain)

    def tuples(self) -> Iterator[tuple[int, memoryview, int, int, int, int]]:
        """What iterating yields, as plain tuples (kind, payload, offset, record, end,
        chain): a loader's fast path.

        A frame that is plainly whole (marker, known kind, unescaped payload the file holds
        with no marker inside, chained to the frame before, hashing to its chain value, a
        blob's digest right) is taken here in one step; any other goes through `_check`,
        which decides and names the damage."""
        data, view, size = self.data, memoryview(self.data), len(self.data)
        options = self.options
        digest_kinds, max_kind = options.digest_kinds, options.max_kind
        fast = options.counters is None  # counting work: every frame through `_check`
        unpack, find, link, hash64 = HEADER.unpack_from, data.find, _LINK.pack, _hash64
        header_size, digest_end = HEADER.size, DIGEST_SIZE + len(SYNC)
        offset, chain, record = self.offset, self.chain, self.records
        while offset < size:
            frame = None
            if fast and size - offset >= header_size:
                sync, kind, length, prev, expected = unpack(data, offset)
                start = offset + header_size
                end = start + length
                if sync == SYNC and kind <= max_kind and end <= size and prev == chain:
                    if kind in digest_kinds:
                        if (
                            length >= DIGEST_SIZE
                            and find(SYNC, start, min(end, start + digest_end)) == -1
                            and hash64(
                                view[start : start + DIGEST_SIZE],
                                seed=hash64(link(kind, length, prev)),
                            )
                            == expected
                            and content_digest(view[start + DIGEST_SIZE : end])
                            == data[start : start + DIGEST_SIZE]
                        ):
                            frame = view[start:end]
                    elif (
                        find(SYNC, start, end) == -1
                        and hash64(view[start:end], seed=hash64(link(kind, length, prev)))
                        == expected
                    ):
                        frame = view[start:end]
            if frame is not None:
                yield kind, frame, offset, record, end, expected
                chain, offset = expected, end
            else:
                self.offset, self.chain, self.records = offset, chain, record
                checked = self._checked(view)
                yield (
                    checked.kind,
                    checked.payload,
                    checked.offset,
                    checked.record,
                    checked.end,
                    checked.chain,
                )
                chain, offset = checked.chain, checked.end
            record += 1
            self.offset, self.chain, self.records = offset, chain, record

    def _checked(self, view: memoryview) -> Frame:
        """The frame at `offset`, checked in full; on damage, where the next whole frame
        starts (`resync`) and `CorruptFileError`."""
        try:
            frame, prev = _check(self.data, view, self.offset, self.records, self.options, False)
            if prev != self.chain:
                message = (
                    "record out of place: it does not follow the record before it "
                    "(frames reordered, duplicated, dropped or taken from another file)"
                )
                raise _damage(message, self.offset, self.records)
        except _Damage as damage:
            options = self.options
            self.resync = next_frame(
                self.data,
                self.offset,
                digest_kinds=options.digest_kinds,
                max_kind=options.max_kind,
                counters=options.counters,
            )
            self.cut = self.resync is None
            raise damage.error from None
        return frame


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
) -> Gap:
    """What the damaged bytes `[start, end)` held: `prev` is the chain value of the frame
    before them (the header's predecessor: 0), `end` the offset of the next frame that
    verifies by itself, `record` the index the first damaged frame has."""
    _, _, _, after, _ = HEADER.unpack_from(data, end)  # the chain value that frame names
    options = _Options(digest_kinds, max_kind, None)
    repaired = _rebuilt(data, start, end, prev, after, record, options)
    if repaired is not None:
        return Gap(start, end, [], repaired)
    kinds: list[int] = []
    pos, chain = start, prev
    while pos < end and end - pos >= HEADER.size:
        sync, kind_byte, length, named, value = HEADER.unpack_from(data, pos)
        nxt = pos + HEADER.size + length
        if sync != SYNC or kind_byte & 0x7F > max_kind or named != chain or nxt > end:
            break
        kinds.append(kind_byte & 0x7F)
        pos, chain = nxt, value
    else:
        if pos == end and chain == after:
            return Gap(start, end, kinds)
    if end - start >= HEADER.size:
        # one frame whose neighbours vouch for both its chain fields, its marker or length
        # hit as well as its payload: its kind byte is all that is left to go by
        _, kind_byte, _, named, value = HEADER.unpack_from(data, start)
        if named == prev and value == after and kind_byte & 0x7F <= max_kind:
            return Gap(start, end, [kind_byte & 0x7F])
    return Gap(start, end, None)


def _rebuilt(
    data: bytes, start: int, end: int, prev: int, value: int, record: int, options: _Options
) -> Frame | None:
    """The frame `[start, end)` if its payload is intact: marker, length and chain fields as
    its neighbours give them, and the kind that makes its payload hash to `value` (the one
    its header names tried first)."""
    length = end - start - HEADER.size
    if length < 0 or data.find(SYNC, start + HEADER.size, end) != -1:
        return None
    named = data[start + len(SYNC)]
    kinds = [k | flag for flag in (0, ESCAPED) for k in range(options.max_kind + 1)]
    if named in kinds:  # the kind its header names first: most damage spares it
        kinds.remove(named)
        kinds.insert(0, named)
    view = memoryview(data)[start + HEADER.size : end]
    escaped = data.find(ESCAPE, start + HEADER.size, end) != -1
    unescaped = memoryview(unescape(view)) if escaped else view
    for kind_byte in kinds:
        payload = unescaped if kind_byte & ESCAPED else view
        is_blob = kind_byte & 0x7F in options.digest_kinds
        if is_blob and len(payload) < DIGEST_SIZE:
            continue
        hashed = payload[:DIGEST_SIZE] if is_blob else payload
        if chain_value(kind_byte, length, prev, hashed) != value:
            continue
        if is_blob and content_digest(payload[DIGEST_SIZE:]) != bytes(payload[:DIGEST_SIZE]):
            return None
        return Frame(kind_byte & 0x7F, payload, start, end, record, value)
    return None

"""The timeline of one model call: where its time went, packed in 40 bytes.

The capture server stamps each call as it passes: the request received, the request sent
upstream, the upstream's first byte, first token and last byte, the reply sent; the number
of stream chunks sent to the client and the largest gap between two of them; the failed
upstream answers the client got since the session's previous turn (its SDK's retries); and
the gap since the call this turn continues (its parent's reply sent to this request
received: the time the agent and its tools took). A graph keeps each turn's timeline as
one 40-byte slot of one bytearray (`TimelineTable`), and a file as one `timeline` record
(see the file format's page).

Packed layout, little-endian: `received` as u64 microseconds since the Unix epoch; five
u32 microsecond offsets from it (upstream sent, first byte, first token, last byte, reply
sent); u32 largest chunk gap (us); u32 gap before (us; `0xFFFFFFFF`: none); u16 chunks
(saturating); u16 failed attempts: the last failed status in the low 10 bits, their count
(saturating at 63) in the high 6.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidValueError

__all__ = ["TIMELINE_SIZE", "CallClock", "Timeline", "TimelineTable", "failed_after"]

_PACK = struct.Struct("<Q5III2H")
#: `received` and `reply_sent` of a packed timeline (the first and the sixth field).
_REPLIED = struct.Struct("<Q16xI")
#: Bytes of one packed timeline.
TIMELINE_SIZE = _PACK.size
_U32 = 0xFFFFFFFF
_NONE = _U32  # gap_before: no parent (or none measured)
_OFFSETS = ("upstream_sent", "first_byte", "first_token", "last_byte", "reply_sent")


@dataclass(frozen=True, slots=True)
class Timeline:
    """One call's timeline; times in integer microseconds.

    `received` is since the Unix epoch; the five stamps after it are offsets from it, in
    order (upstream sent <= first byte <= first token <= last byte <= reply sent).
    `gap_before` is None for a root (or a turn whose parent has no timeline).
    """

    received: int
    upstream_sent: int
    first_byte: int
    first_token: int
    last_byte: int
    reply_sent: int
    chunks: int = 0
    max_chunk_gap: int = 0
    gap_before: int | None = None
    failed_attempts: int = 0
    last_failed_status: int | None = None

    def __post_init__(self) -> None:
        if type(self.received) is not int or not 0 < self.received < 1 << 64:
            raise InvalidValueError(
                "must be an int of microseconds since the epoch, above 0", "timeline.received"
            )
        before = 0
        for name in _OFFSETS:
            value = getattr(self, name)
            if type(value) is not int or not before <= value <= _U32 - 1:
                raise InvalidValueError(
                    "must be an int of microseconds after the stamp before it (and at most"
                    f" {_U32 - 1}), got {value!r}",
                    f"timeline.{name}",
                )
            before = value
        for name, top in (("chunks", 0xFFFF), ("max_chunk_gap", _U32), ("failed_attempts", 63)):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise InvalidValueError(f"must be an int >= 0, got {value!r}", f"timeline.{name}")
            object.__setattr__(self, name, min(value, top))  # saturate, as stored
        gap = self.gap_before
        if gap is not None and (type(gap) is not int or not 0 <= gap < _NONE):
            raise InvalidValueError(
                f"must be None or an int of microseconds >= 0, got {gap!r}", "timeline.gap_before"
            )
        status = self.last_failed_status
        if status is not None and (type(status) is not int or not 100 <= status <= 999):
            raise InvalidValueError(
                f"must be None or an HTTP status, got {status!r}", "timeline.last_failed_status"
            )
        if (status is None) != (self.failed_attempts == 0):
            raise InvalidValueError(
                "a failed attempt needs its status, and a status a failed attempt",
                "timeline.last_failed_status",
            )

    @property
    def engine(self) -> int:
        """Microseconds the upstream took: request sent to its last byte."""
        return self.last_byte - self.upstream_sent

    def pack(self) -> bytes:
        status = self.last_failed_status or 0
        return _PACK.pack(
            self.received,
            self.upstream_sent,
            self.first_byte,
            self.first_token,
            self.last_byte,
            self.reply_sent,
            self.max_chunk_gap,
            _NONE if self.gap_before is None else self.gap_before,
            self.chunks,
            (self.failed_attempts << 10) | (status & 0x3FF),
        )

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> Timeline:
        """The timeline packed in `data` (InvalidValueError if it is not one)."""
        if len(data) != TIMELINE_SIZE:
            raise InvalidValueError(
                f"a packed timeline is {TIMELINE_SIZE} bytes, got {len(data)}", "timeline"
            )
        received, sent, first, token, last, reply, gap, before, chunks, failed = _PACK.unpack(data)
        count, status = failed >> 10, failed & 0x3FF
        return cls(
            received,
            sent,
            first,
            token,
            last,
            reply,
            chunks=chunks,
            max_chunk_gap=gap,
            gap_before=None if before == _NONE else before,
            failed_attempts=count,
            last_failed_status=status or None,
        )

    def document(self) -> dict[str, Any]:
        """The `timeline` object of trace records and export turns: `received` in seconds
        since the epoch, the rest in milliseconds (microsecond precision) from it."""
        out: dict[str, Any] = {"received": self.received / 1e6}
        for name in _OFFSETS:
            out[f"{name}_ms"] = getattr(self, name) / 1000
        out["engine_ms"] = self.engine / 1000
        out["chunks"] = self.chunks
        out["max_chunk_gap_ms"] = self.max_chunk_gap / 1000
        out["gap_before_ms"] = None if self.gap_before is None else self.gap_before / 1000
        out["failed_attempts"] = self.failed_attempts
        out["last_failed_status"] = self.last_failed_status
        return out


class TimelineTable:
    """Every turn's packed timeline in one bytearray, a 40-byte slot by turn index; a slot of
    zeros holds none (a real `received` is never 0). Turns without a timeline after the
    last one that has one cost nothing."""

    __slots__ = ("_data", "count")

    def __init__(self) -> None:
        self._data = bytearray()
        self.count = 0

    def set(self, index: int, packed: bytes) -> None:
        start = index * TIMELINE_SIZE
        data = self._data
        if len(data) < start + TIMELINE_SIZE:
            data.extend(bytes(start + TIMELINE_SIZE - len(data)))
        if not any(data[start : start + 8]):
            self.count += 1
        data[start : start + TIMELINE_SIZE] = packed

    def packed(self, index: int) -> bytes | None:
        start = index * TIMELINE_SIZE
        slot = bytes(self._data[start : start + TIMELINE_SIZE])
        return slot if len(slot) == TIMELINE_SIZE and any(slot[:8]) else None

    def get(self, index: int) -> Timeline | None:
        slot = self.packed(index)
        return None if slot is None else Timeline.unpack(slot)

    def replied(self, index: int) -> int | None:
        """When turn `index`'s reply was sent (microseconds since the epoch), if it has a
        timeline: read in place, no `Timeline` made."""
        start = index * TIMELINE_SIZE
        if len(self._data) < start + TIMELINE_SIZE:
            return None
        received, reply_sent = _REPLIED.unpack_from(self._data, start)
        return received + reply_sent if received else None

    def indexes(self) -> list[int]:
        data = self._data
        return [
            i
            for i in range(len(data) // TIMELINE_SIZE)
            if any(data[i * TIMELINE_SIZE : i * TIMELINE_SIZE + 8])
        ]

    @property
    def nbytes(self) -> int:
        return len(self._data)


class CallClock:
    """The stamps of one call as the capture server takes them: a wall-clock base when the
    request is received, then monotonic microsecond offsets from it."""

    __slots__ = (
        "_last_chunk",
        "_t0",
        "chunks",
        "failed",
        "first_byte",
        "last_byte",
        "max_gap",
        "node_id",
        "received",
        "reply_sent",
        "upstream_sent",
    )

    def __init__(self) -> None:
        self.received = time.time_ns() // 1000
        self._t0 = time.perf_counter_ns()
        self.upstream_sent = self.first_byte = self.last_byte = 0
        self.chunks = self.max_gap = self._last_chunk = 0
        self.node_id: str | None = None  # the turn recorded, once it is
        self.reply_sent = -1  # once the reply is sent (before or after the turn is recorded)
        self.failed = 0  # the session's failed attempts before it: count << 10 | status

    def now(self) -> int:
        return min((time.perf_counter_ns() - self._t0) // 1000, _U32 - 1)

    def chunk(self) -> None:
        """A stream chunk is being sent to the client."""
        now = self.now()
        if self.chunks:
            self.max_gap = max(self.max_gap, now - self._last_chunk)
        self.chunks += 1
        self._last_chunk = now

    def timeline(self, reply_sent: int, gap_before: int | None) -> Timeline:
        """The timeline of the call; the upstream answered unstreamed, so its first token
        came with its first byte."""
        sent = self.upstream_sent
        first = max(self.first_byte, sent)
        last = max(self.last_byte, first)
        return Timeline(
            self.received,
            sent,
            first,
            first,
            last,
            max(reply_sent, last),
            chunks=self.chunks,
            max_chunk_gap=min(self.max_gap, _U32),
            gap_before=gap_before if gap_before is None else min(gap_before, _NONE - 1),
            failed_attempts=self.failed >> 10,
            last_failed_status=(self.failed & 0x3FF) or None,
        )


def failed_after(failed: int, status: int) -> int:
    """A session's failed-attempts word after one more failed attempt with `status`."""
    return (min((failed >> 10) + 1, 63) << 10) | (status & 0x3FF)

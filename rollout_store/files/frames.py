"""Version-1 frames of a rollout file, and the encodings inside records of both versions.

A version-1 frame is kind (1 byte), payload length (4 bytes LE), xxh3-64 of the payload
seeded with kind and length (8 bytes LE), then the payload; it is read, and written only to
extend a version-1 log (version 2 is in `framing`). The engine (`rollout_store._core`)
encodes and verifies these frames and tells damage from a torn tail in time linear in the
damaged bytes; this module gives its results the library's shapes and errors. Record kinds,
the msgpack packing of records, and token and logprob arrays (little-endian bytes) are shared
by both versions.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterator
from enum import IntEnum
from typing import Any

import msgpack

from .._core import BLOB_PREFIX_V1, HEADER_LAYOUT_V1, MAGIC_V1, AsciiText, FrameScan, FrameTooLarge
from .._core import encode_blob_frame_v1 as _encode_blob_frame
from .._core import encode_frame_v1 as _encode_frame
from .._core import intact_end_after_v1 as _intact_end_after
from ..engine.encoding import EXT_BIGINT, int_digits, int_from_digits
from ..errors import RecordTooLargeError
from .framing import FrameTuple, ScanCounters, damage_error

__all__ = [
    "BLOB_PREFIX",
    "FRAME",
    "KIND_BLOB",
    "KIND_BLOB_REF",
    "KIND_DRIFT",
    "KIND_META",
    "KIND_TIMELINE",
    "KIND_END",
    "KIND_HEADER",
    "KIND_NAMES",
    "KIND_TURN",
    "KIND_VALUE",
    "MAGIC",
    "MODE_LOG",
    "MODE_SNAPSHOT",
    "FrameReader",
    "RecordKind",
    "blob_frame",
    "decode_segment",
    "encode_segment",
    "frame",
    "intact_end_after",
    "pack",
    "unpack_payload",
]

MAGIC = MAGIC_V1
FRAME = struct.Struct(HEADER_LAYOUT_V1)  # kind, payload length, xxh3-64 seeded by kind+length


class RecordKind(IntEnum):
    """The kind byte of a frame."""

    HEADER = 0
    BLOB = 1
    VALUE = 2
    TURN = 3
    END = 4
    BLOB_REF = 5  # a blob kept in a content store: its digest, store key, size (version 2)
    META = 6  # the graph's labels, annotations, rewards and group (version 2; the last wins)
    DRIFT = 7  # the drift audit of the turn record just before it (version 2)
    TIMELINE = 8  # one turn's call timeline: [turn number, 40 bytes] (version 2; the last wins)


(
    KIND_HEADER,
    KIND_BLOB,
    KIND_VALUE,
    KIND_TURN,
    KIND_END,
    KIND_BLOB_REF,
    KIND_META,
    KIND_DRIFT,
    KIND_TIMELINE,
) = RecordKind
KIND_NAMES = {kind.value: kind.name.lower() for kind in RecordKind}
MODE_LOG, MODE_SNAPSHOT = "log", "snapshot"

_LITTLE = sys.byteorder == "little"


def frame(kind: int, payload: bytes) -> bytes:
    """The version-1 frame of a record of `kind`."""
    try:
        return _encode_frame(kind, payload)
    except FrameTooLarge as exc:
        raise RecordTooLargeError(str(exc)) from None


# A blob payload is the msgpack array [digest (bin 16), data (bin)]: this prefix, then data.
BLOB_PREFIX = BLOB_PREFIX_V1


def blob_frame(digest: bytes, data: bytes | str) -> list[bytes | AsciiText]:
    """A blob frame as parts, so the (large) data is never copied into a joined payload
    (`data`: UTF-8, or the str itself, as `framing.encode_blob_frame` takes it)."""
    try:
        return _encode_blob_frame(KIND_BLOB, digest, data)
    except FrameTooLarge as exc:
        raise RecordTooLargeError(str(exc)) from None


def intact_end_after(data: bytes, start: int, *, counters: ScanCounters | None = None) -> bool:
    """Whether intact records follow the damaged version-1 frame at `start`: whether the
    file ends with a frame whose checksum holds (zero bytes may follow it) that starts after
    `start`. If not, the damage is a torn last write (a cut, garbage or zeros to the end).
    Linear in the bytes after `start`; a tail crafted to hold more candidate frames than a
    bounded multiple of its size is taken as followed by records."""
    intact, hashed, searched, candidates = _intact_end_after(data, start)
    if counters is not None:
        counters.add(hashed, searched, candidates)
    return intact


class FrameReader:
    """Reads the frames of a version-1 file in order, each verified by its own checksum.
    Iterating stops at the end of the file or raises `CorruptFileError` at the first frame
    that does not verify; `cut` then says whether the damage is a torn tail (no intact
    frame ends the file after it)."""

    def __init__(self, data: bytes, start: int, *, counters: ScanCounters | None = None) -> None:
        self.data = data
        self.offset = start
        self.counters = counters
        self.records = 0
        self.cut = False

    def tuples(self) -> Iterator[FrameTuple]:
        """(kind, payload, offset, record, end, 0) of each frame: the engine verifies every
        frame up to the end or the first damage before the first is yielded."""
        scan = FrameScan.v1(self.data, self.offset, self.records)
        if self.counters is not None:
            self.counters.add(*scan.counters)
        for frame in scan:
            yield frame
            self.offset, self.records = frame[4], frame[3] + 1
        damage = scan.damage
        if damage is not None:
            self.cut = scan.torn
            raise damage_error(damage)


#: First buffer of the packer `pack` makes (it grows as a record needs): msgpack's default,
#: 256 KiB, makes a packer for a record of a few hundred bytes cost half as much again.
_PACK_BUFFER = 1024


def pack(obj: Any) -> bytes:
    # record fields are str (node ids, model names) that may hold lone surrogates
    packer = msgpack.Packer(
        use_bin_type=True, unicode_errors="surrogatepass", buf_size=_PACK_BUFFER
    )
    packed: bytes = packer.pack(obj)
    return packed


# ---------------------------------------------------------------- token segments


def _array_bytes(arr: array[Any]) -> bytes:
    if _LITTLE:
        return arr.tobytes()
    swapped = array(arr.typecode, arr)
    swapped.byteswap()
    return swapped.tobytes()


def _bytes_array(typecode: str, data: bytes) -> array[Any]:
    arr = array(typecode)
    if len(data) % arr.itemsize:
        raise ValueError(f"{len(data)} bytes is not a whole number of '{typecode}' items")
    arr.frombytes(data)
    if not _LITTLE:
        arr.byteswap()
    return arr


def _big_default(obj: object) -> msgpack.ExtType:
    if type(obj) is int:
        return msgpack.ExtType(EXT_BIGINT, int_digits(obj).encode("ascii"))
    raise TypeError(type(obj).__name__)


def encode_segment(seg: Any) -> Any:
    if seg is None:
        return None
    if isinstance(seg, array):
        return [seg.typecode, _array_bytes(seg)]
    return ["t", msgpack.packb(list(seg), default=_big_default)]


def _big_hook(code: int, data: bytes) -> int:
    if code == EXT_BIGINT:
        return int_from_digits(data)
    raise ValueError(f"unexpected extension type {code} in token ids")


def decode_segment(spec: Any, kinds: str = "Iqt") -> Any:
    if spec is None:
        return None
    if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[1], bytes)):
        raise ValueError("bad segment")
    kind, data = spec
    if kind not in tuple(kinds):
        raise ValueError(f"segment kind {kind!r} is not allowed here")
    if kind in ("I", "q", "d"):
        return _bytes_array(kind, data)
    if kind == "t":
        values = msgpack.unpackb(data, ext_hook=_big_hook)
        if not isinstance(values, list) or any(type(v) is not int for v in values):
            raise ValueError("token ids must be ints")
        return tuple(values)
    raise ValueError(f"unknown segment kind {kind!r}")


def unpack_payload(payload: bytes | memoryview) -> Any:
    return msgpack.unpackb(payload, raw=False, strict_map_key=False, unicode_errors="surrogatepass")

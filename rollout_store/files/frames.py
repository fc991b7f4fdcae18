"""Version-1 frames of a rollout file, and the encodings inside records of both versions.

A version-1 frame is kind (1 byte), payload length (4 bytes LE), xxh3-64 of the payload
seeded with kind and length (8 bytes LE), then the payload; it is read, and written only to
extend a version-1 log (version 2 is in `framing`). Damage in a version-1 log is told from a
torn tail by `intact_end_after` in time linear in the damaged bytes. Record kinds, the msgpack
packing of records, and token and logprob arrays (little-endian bytes) are shared by both
versions.
"""

from __future__ import annotations

import re
import struct
import sys
from array import array
from enum import IntEnum
from typing import Any

import msgpack
import xxhash

from ..engine.encoding import EXT_BIGINT, int_digits, int_from_digits

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
    "RecordKind",
    "bin_header",
    "blob_frame",
    "checksum",
    "decode_segment",
    "encode_segment",
    "frame",
    "intact_end_after",
    "pack",
    "unpack_payload",
]

MAGIC = b"RLSTORE\x00"  # version 1
FRAME = struct.Struct("<BIQ")  # kind, payload length, xxh3-64 of payload seeded by kind+length


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


def checksum(kind: int, payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload, seed=(kind << 32) | len(payload))


def frame(kind: int, payload: bytes) -> bytes:
    return FRAME.pack(kind, len(payload), checksum(kind, payload)) + payload


#: Bytes that may start a version-1 frame (its kind).
_KIND_BYTE = re.compile(b"[\\x00-\\x04]")
#: What `intact_end_after` may hash before it takes the damage as followed by records: this
#: many times the bytes after it, plus a constant.
_HASH_BUDGET = (2, 1 << 20)


def _zeros_from(data: bytes | memoryview, start: int) -> int:
    """The offset from which `data` holds only zero bytes to its end (at least `start`)."""
    end = len(data)
    while end > start:
        chunk = bytes(data[max(start, end - (64 << 10)) : end])
        kept = len(chunk.rstrip(b"\0"))
        if kept:
            return end - len(chunk) + kept
        end -= len(chunk)
    return start


def intact_end_after(data: bytes | memoryview, start: int) -> bool:
    """Whether intact records follow the damaged version-1 frame at `start`: whether the
    file ends with a frame whose checksum holds (zero bytes may follow it) that starts after
    `start`. If not, the damage is a torn last write (a cut, garbage or zeros to the end).

    Linear in the bytes after `start`: each offset is looked at once, and only a frame that
    would end at the end of the file (or where only zeros follow) is hashed. A tail crafted
    to hold more such candidates than a bounded multiple of its size is taken as followed by
    records (so `repair` refuses rather than cut what might be intact)."""
    size = len(data)
    zeros_from = _zeros_from(data, start + 1)
    budget = _HASH_BUDGET[0] * (size - start) + _HASH_BUDGET[1]
    header = FRAME
    for match in _KIND_BYTE.finditer(data, start + 1, size - header.size + 1):
        pos = match.start()
        kind, length, expected = header.unpack_from(data, pos)
        end = pos + header.size + length
        if end < zeros_from or end > size:
            continue
        budget -= length
        if budget < 0:
            return True
        if checksum(kind, data[pos + header.size : end]) == expected:
            return True
    return False


def bin_header(n: int) -> bytes:
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


# A blob payload is the msgpack array [digest (bin 16), data (bin)]: this prefix, then data.
BLOB_PREFIX = b"\x92\xc4\x10"


def blob_frame(digest: bytes, data: bytes) -> list[bytes]:
    """A blob frame as parts, so the (large) data is never copied into a joined payload."""
    prefix = BLOB_PREFIX + digest + bin_header(len(data))
    length = len(prefix) + len(data)
    hasher = xxhash.xxh3_64(seed=(KIND_BLOB << 32) | length)
    hasher.update(prefix)
    hasher.update(data)
    return [FRAME.pack(KIND_BLOB, length, hasher.intdigest()), prefix, data]


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

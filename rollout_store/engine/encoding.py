"""The packed form of recorded JSON values: msgpack plus a few extension types.

Exact where JSON is exact: ints, floats and bools pack differently, key order is kept,
floats keep all 64 bits. Extension types carry what msgpack cannot say by itself: tuples,
ints beyond 64 bits, strings with lone surrogates, and references to blobs.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import msgpack

# the rebuild of a packed value is the engine's: fresh containers, a tuple where one was
# recorded, blobs as the table's own `str` objects (ValueError for bytes it cannot read)
from .._core import unpack

__all__ = [
    "ECHO_PACKED",
    "EXT_BIGINT",
    "EXT_BLOB",
    "EXT_ECHO",
    "EXT_SURROGATE",
    "EXT_TUPLE",
    "array_header",
    "blob_ref_bytes",
    "int_digits",
    "int_from_digits",
    "no_echo",
    "unpack",
]

EXT_TUPLE = 1  # empty payload; first item of an array that is a tuple
EXT_BIGINT = 2  # payload: ASCII decimal text
EXT_SURROGATE = 3  # payload: UTF-8 with surrogatepass
EXT_BLOB = 4  # payload: blob index, 4 bytes big-endian
EXT_ECHO = 5  # payload: empty; the response of the turn a message segment extends


#: Digits converted by one `int()`/`str()` call: below the lowest limit Python allows
#: (`sys.set_int_max_str_digits` refuses 1..639), so the conversions below never depend on
#: the process's setting and never change it.
_CHUNK_DIGITS = 600
_DECIMAL = re.compile(rb"-?[0-9]+")


def int_from_digits(data: bytes) -> int:
    """The int an EXT_BIGINT payload spells, whatever `sys.get_int_max_str_digits()` is.

    A file written in a process that raised the limit holds ints with more digits than a
    default process converts in one call; it is read in pieces (high * 10**k + low), so an
    intact file never reads as damaged. Anything but an optional minus and ASCII digits
    raises ValueError, as damage."""
    if len(data) <= _CHUNK_DIGITS:
        return int(data)
    if _DECIMAL.fullmatch(data) is None:
        raise ValueError("a big int that is not a decimal number")
    if data[0] == 0x2D:  # b"-"
        return -_from_digits(data[1:])
    return _from_digits(data)


def _from_digits(digits: bytes) -> int:
    if len(digits) <= _CHUNK_DIGITS:
        return int(digits)
    low = len(digits) // 2
    scale: int = 10**low
    return _from_digits(digits[:-low]) * scale + _from_digits(digits[-low:])


def int_digits(n: int) -> str:
    """`str(n)` for an int of any size, whatever `sys.get_int_max_str_digits()` is: what
    `int_from_digits` reads back (a recorded int is written as it was recorded)."""
    if n < 0:
        return "-" + _digits(-n)
    return _digits(n)


def _digits(n: int) -> str:
    # 3.32 bits a digit: a bit length under 1,900 is at most 572 digits
    if n.bit_length() < 1900:
        return str(n)
    low = int(n.bit_length() * 0.30103) // 2
    scale: int = 10**low
    high, rest = divmod(n, scale)
    return _digits(high) + _digits(rest).rjust(low, "0")


def no_echo() -> None:
    """The echo placeholder rebuilt as None (where its value does not matter)."""
    return None


#: How a blob reference starts in a packing (a fixext 4 of type EXT_BLOB): a packing without
#: these bytes references no blob.
_BLOB_REF = bytes((0xD6, EXT_BLOB))


def blob_ref_bytes(data: bytes, size: Callable[[int], int]) -> int:
    """The bytes of the blobs a packing references, each reference counted (`size` gives a
    blob's UTF-8 bytes by its index: no string is read). A C scan finds most packings free
    of references; the rest are unpacked at C speed, strings left undecoded."""
    if _BLOB_REF not in data:
        return 0
    total = 0

    def hook(code: int, payload: bytes) -> None:
        nonlocal total
        if code == EXT_BLOB:
            total += size(int.from_bytes(payload, "big"))

    msgpack.unpackb(data, raw=True, strict_map_key=False, ext_hook=hook)
    return total


def array_header(n: int) -> bytes:
    """The msgpack header of an array of `n` items (its items follow it, packed)."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


#: The packed echo placeholder (3 bytes: the request comparison counts on its length).
ECHO_PACKED: bytes = msgpack.packb(msgpack.ExtType(EXT_ECHO, b""))

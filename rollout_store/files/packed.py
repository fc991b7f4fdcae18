"""Checking a stored packed value without building it: what a file's loader trusts.

`check_packed` (the engine's, `_core.check_packed`) walks the msgpack bytes of one value and
refuses anything the library could not hand back as JSON later: malformed or trailing bytes,
nesting deeper than `MAX_DEPTH`, bytes (JSON has none), containers or markers as dict keys, a
tuple marker anywhere but first in an array, unknown extension types, blob references out of
range, big ints and strings that would not decode. It allocates nothing per item, so memory
stays flat whatever the value holds, and it records where blob references are, so a value's
plain packing is spliced from bytes instead of decoded.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable, Sequence

from .._core import check_packed as _check
from ..engine.encoding import EXT_BIGINT
from ..engine.intake import MAX_DEPTH

__all__ = [
    "MESSAGES_DEPTH",
    "PackedInfo",
    "blob_indexes",
    "check_int_array",
    "check_packed",
    "splice_blobs",
]

#: The nesting a packed array of request messages (a turn's tail, its system part) may
#: reach: intake bounds each message by `MAX_DEPTH`, and the array adds a level.
MESSAGES_DEPTH = MAX_DEPTH + 1

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_EXTLEN = {0xC7: 1, 0xC8: 2, 0xC9: 4}


class PackedInfo:
    """What `check_packed` found in one value."""

    __slots__ = ("blob_refs", "echoes", "refs", "special", "top_items")

    def __init__(
        self,
        top_items: int,
        blob_refs: Sequence[int] | None = None,
        special: bool = False,
        echoes: int = 0,
    ) -> None:
        self.top_items = top_items  # items of the top-level array, or -1 if not an array
        self.special = special  # a tuple, big int, lone surrogate, or a blob holding surrogates
        self.echoes = echoes
        self.refs = len(blob_refs) if blob_refs else 0  # number of blob references
        self.blob_refs = blob_refs  # their offsets (`array('I')`; an empty tuple for none)


def _length(data: bytes | memoryview, pos: int, width: int) -> int:
    if width == 1:
        return data[pos]
    if width == 2:
        return int(_U16.unpack_from(data, pos)[0])
    return int(_U32.unpack_from(data, pos)[0])


def check_packed(
    data: bytes | memoryview,
    n_blobs: int,
    max_depth: int,
    *,
    blob_surrogates: Callable[[int], bool] | None = None,
    echo_ok: bool = False,
    record: bool = False,
    max_containers: int | None = None,
) -> PackedInfo:
    """Check one packed value (see the module docstring); raises ValueError naming the byte
    offset inside the value. `n_blobs`: blob references must be below it.

    `data` may be a memoryview (of a file's bytes: no copy).

    `record=True` checks a file's own record instead of a JSON value: bytes are allowed,
    extension types are not, strings are not decoded (ids may hold lone surrogates), and at
    most `max_containers` containers may open, so decoding it afterwards stays bounded."""
    if type(data) is not bytes and not isinstance(data, bytes | memoryview):
        raise ValueError("a packed value must be bytes")
    if record or max_containers is not None:
        found = _check(
            data,
            n_blobs,
            max_depth,
            blob_surrogates=blob_surrogates,
            echo_ok=echo_ok,
            record=record,
            max_containers=max_containers,
        )
    else:  # (the engine's defaults for the rest: each keyword passed costs)
        found = _check(data, n_blobs, max_depth, blob_surrogates=blob_surrogates, echo_ok=echo_ok)
    top_items, special, echoes, refs = found
    return PackedInfo(top_items, array("I", refs) if refs else (), special, echoes)


def blob_indexes(data: bytes, offsets: Sequence[int] | None) -> list[int]:
    """The blob each reference at `offsets` (a checked value's `blob_refs`) names, in order."""
    out: list[int] = []
    # a plain loop: most values hold one or two, which a comprehension's own call outweighs
    for at in offsets or ():
        out.append(_U32.unpack_from(data, at + 2)[0])
    return out


def splice_blobs(data: bytes, refs: Sequence[int] | None, text_of: Callable[[int], bytes]) -> bytes:
    """The plain packing of a checked value: each blob reference (6 bytes at an offset in
    `refs`) replaced by the packed string `text_of(index)` returns (its UTF-8 bytes)."""
    if not refs:
        return data
    parts: list[bytes] = []
    pos = 0
    for at in refs:
        parts.append(data[pos:at])
        text = text_of(int.from_bytes(data[at + 2 : at + 6], "big"))
        n = len(text)
        if n < 32:
            parts.append(bytes((0xA0 | n,)))
        elif n < 1 << 8:
            parts.append(b"\xd9" + n.to_bytes(1, "big"))
        elif n < 1 << 16:
            parts.append(b"\xda" + n.to_bytes(2, "big"))
        else:
            parts.append(b"\xdb" + n.to_bytes(4, "big"))
        parts.append(text)
        pos = at + 6
    parts.append(data[pos:])
    return b"".join(parts)


_INT_SIZES = {0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}


def check_int_array(data: bytes) -> None:
    """Check that `data` packs one array of ints (big ones as EXT_BIGINT), before it is
    decoded: nothing else can make it allocate more than a list of ints."""
    size = len(data)
    try:
        b = data[0]
        if 0x90 <= b <= 0x9F:
            n, pos = b & 0x0F, 1
        elif b in (0xDC, 0xDD):
            width = 2 if b == 0xDC else 4
            n, pos = _length(data, 1, width), 1 + width
        else:
            raise ValueError("token ids must be an array")
        for _ in range(n):
            b = data[pos]
            if b <= 0x7F or b >= 0xE0:
                pos += 1
            elif b in _INT_SIZES:
                pos += _INT_SIZES[b]
            elif b in _EXTLEN and data[pos + 1 + _EXTLEN[b]] == EXT_BIGINT:
                width = _EXTLEN[b]
                pos += 2 + width + _length(data, pos + 1, width)
            else:
                raise ValueError("token ids must be ints")
    except (IndexError, struct.error):
        raise ValueError("token ids cut short") from None
    if pos != size:
        raise ValueError("token ids cut short or followed by bytes")

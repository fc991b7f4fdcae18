"""Checking a stored packed value without building it: what a file's loader trusts.

`check_packed` walks the msgpack bytes of one value and refuses anything the library could not
hand back as JSON later: malformed or trailing bytes, nesting deeper than `MAX_DEPTH`, bytes
(JSON has none), containers or markers as dict keys, a tuple marker anywhere but first in an
array, unknown extension types, blob references out of range, big ints and strings that would
not decode. It allocates no Python object per item (a count is checked against the bytes left
before anything is read), so memory stays flat whatever the value holds, and it records where
blob references are, so a value's plain packing is spliced from bytes instead of decoded.

`quick_check` answers the same question for a short value at C speed, or says it cannot tell:
msgpack decodes it (bounded by its size) and packs it again, and only a value that comes back
byte for byte, with nothing it would have to look at more closely, is accepted there; every
other value goes through `check_packed`, which decides.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable

import msgpack

from ..engine.encoding import (
    EXT_BIGINT,
    EXT_BLOB,
    EXT_ECHO,
    EXT_SURROGATE,
    EXT_TUPLE,
    int_from_digits,
)
from ..engine.intake import MAX_DEPTH

__all__ = [
    "MESSAGES_DEPTH",
    "QUICK_LIMIT",
    "PackedInfo",
    "QuickCheck",
    "check_int_array",
    "check_packed",
    "quick_check",
    "splice_blobs",
]

#: The nesting a packed array of request messages (a turn's tail, its system part) may
#: reach: intake bounds each message by `MAX_DEPTH`, and the array adds a level.
MESSAGES_DEPTH = MAX_DEPTH + 1

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
# ext headers: type byte -> (bytes of the length field, fixed payload length)
_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}
_EXTLEN = {0xC7: 1, 0xC8: 2, 0xC9: 4}
_STRLEN = {0xD9: 1, 0xDA: 2, 0xDB: 4}
_BINLEN = {0xC4: 1, 0xC5: 2, 0xC6: 4}
# scalars of a fixed size: type byte -> total bytes
_FIXED = {
    0xC0: 1,
    0xC2: 1,
    0xC3: 1,
    0xCA: 5,
    0xCB: 9,
    0xCC: 2,
    0xCD: 3,
    0xCE: 5,
    0xCF: 9,
    0xD0: 2,
    0xD1: 3,
    0xD2: 5,
    0xD3: 9,
}


# what each type byte starts
_K_ONE, _K_STR, _K_FIXMAP, _K_FIXARRAY, _K_CONTAINER = 0, 1, 2, 3, 4
_K_FIXED, _K_LONGSTR, _K_BIN, _K_EXT, _K_BAD = 5, 6, 7, 8, 9


def _kind(b: int) -> int:
    if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
        return _K_ONE
    if 0xA0 <= b <= 0xBF:
        return _K_STR
    if b <= 0x8F:
        return _K_FIXMAP
    if b <= 0x9F:
        return _K_FIXARRAY
    if b in (0xDC, 0xDD, 0xDE, 0xDF):
        return _K_CONTAINER
    if b in _FIXED:
        return _K_FIXED
    if b in _STRLEN:
        return _K_LONGSTR
    if b in _BINLEN:
        return _K_BIN
    if b in _FIXEXT or b in _EXTLEN:
        return _K_EXT
    return _K_BAD


_KINDS = tuple(_kind(b) for b in range(256))


class PackedInfo:
    """What `check_packed` found in one value."""

    __slots__ = ("blob_refs", "echoes", "refs", "special", "top_items")

    def __init__(self, top_items: int, blob_refs: array[int] | None = None) -> None:
        self.top_items = top_items  # items of the top-level array, or -1 if not an array
        self.special = False  # a tuple, big int, lone surrogate, or a blob holding surrogates
        self.echoes = 0
        self.refs = 0  # number of blob references
        self.blob_refs = blob_refs  # their offsets, where recorded (`check_packed` does)


#: Strings checked as UTF-8 together (their views are then freed: memory stays flat).
_SPANS = 256


def _utf8(spans: list[memoryview]) -> None:
    """Check many strings' bytes as UTF-8 with one decode: a NUL between two can neither
    complete a sequence the first leaves open nor continue one."""
    if spans:
        b"\0".join(spans).decode("utf-8")
        spans.clear()


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
    if not isinstance(data, bytes | memoryview):
        raise ValueError("a packed value must be bytes")
    walk = _Walk(data, n_blobs, max_depth, blob_surrogates, echo_ok, record, max_containers)
    try:
        walk.run()
    except (IndexError, struct.error):
        raise ValueError(f"the value is cut short (at byte {walk.pos})") from None
    except UnicodeDecodeError:
        raise ValueError(f"a string that is not UTF-8 (at byte {walk.pos})") from None
    except ValueError as exc:
        if "at byte" in str(exc):
            raise
        raise ValueError(f"{exc} (at byte {walk.pos})") from None
    return walk.info


class _Walk:
    """The state of one `check_packed` walk: the position, and the strings to check."""

    __slots__ = (
        "containers",
        "data",
        "echo_ok",
        "info",
        "max_depth",
        "n_blobs",
        "offsets",
        "pos",
        "record",
        "spans",
        "surrogates",
        "view",
    )

    def __init__(
        self,
        data: bytes | memoryview,
        n_blobs: int,
        max_depth: int,
        surrogates: Callable[[int], bool] | None,
        echo_ok: bool,
        record: bool,
        max_containers: int | None,
    ) -> None:
        self.data, self.view, self.pos = data, memoryview(data), 0
        self.n_blobs, self.max_depth, self.surrogates = n_blobs, max_depth, surrogates
        self.echo_ok, self.record, self.containers = echo_ok, record, max_containers
        self.offsets: array[int] = array("I")  # of blob references
        self.info = PackedInfo(-1, self.offsets)
        self.spans: list[memoryview] = []  # strings' bytes, checked as UTF-8 in batches

    def run(self) -> None:
        """Walk the items in order. Strings, one-byte items and containers (most items) are
        taken here; the rest in `scalar`. On error `pos` is where the item starts."""
        data, size, kinds, record = self.data, len(self.data), _KINDS, self.record
        max_depth, counted = self.max_depth, self.containers is not None
        # per open container: items still to read there (a map counts keys and values)
        remaining: list[int] = []
        is_map: list[bool] = []
        left, in_map, first, pos = 1, False, False, 0  # first: the first item of an array
        try:
            while True:
                while left == 0:
                    if not remaining:
                        return self.finish(pos)
                    left, in_map = remaining.pop(), is_map.pop()
                key = in_map and not left & 1
                left -= 1
                b = data[pos]
                kind = kinds[b]
                if kind == _K_STR:  # fixstr, the most common item
                    end = pos + 1 + (b & 0x1F)
                    if end - pos > 1 and not record:
                        self.string(pos + 1, end)
                    pos, first = end, False
                elif kind == _K_ONE:  # fixint, nil, bool
                    pos, first = pos + 1, False
                elif _K_FIXMAP <= kind <= _K_CONTAINER:
                    if key:
                        raise ValueError("a container as a dict key")
                    if kind == _K_CONTAINER:
                        n, start, map_ = self.long_container(b, pos)
                    else:
                        n, start, map_ = b & 0x0F, pos + 1, kind == _K_FIXMAP
                    items, depth = 2 * n if map_ else n, len(remaining)
                    if items > size - start or depth >= max_depth or counted or not depth:
                        self.open(n, map_, start, depth)
                    pos, first = start, items > 0 and not map_  # an empty one: no first
                    if items:
                        remaining.append(left)
                        is_map.append(in_map)
                        left, in_map = items, map_
                else:
                    pos = self.scalar(b, kind, pos, key, first)
                    first = False
        except Exception:
            self.pos = pos
            raise

    def long_container(self, b: int, pos: int) -> tuple[int, int, bool]:
        """(items, position after the header, is a map) of an array 16/32 or map 16/32."""
        width = 2 if b in (0xDC, 0xDE) else 4
        return _length(self.data, pos + 1, width), pos + 1 + width, b >= 0xDE

    def open(self, n: int, map_: bool, pos: int, depth: int) -> None:
        """Checks before a container of `n` items (pairs for a map) is entered."""
        if (2 * n if map_ else n) > len(self.data) - pos:  # every item takes a byte at least
            raise ValueError("a container claims more items than bytes are left")
        if depth >= self.max_depth:
            raise ValueError(f"nesting deeper than {self.max_depth} levels")
        if self.containers is not None:
            self.containers -= 1
            if self.containers < 0:
                raise ValueError("more containers than the record can hold")
        if depth == 0 and not map_:
            self.info.top_items = n

    def string(self, start: int, end: int) -> None:
        """A string's bytes, to check as UTF-8 with the next ones."""
        spans = self.spans
        spans.append(self.view[start:end])
        if len(spans) >= _SPANS:
            _utf8(spans)

    def scalar(self, b: int, kind: int, pos: int, key: bool, at_first: bool) -> int:
        """A number, a long string or bytes, or an extension type: the position after it."""
        data, size = self.data, len(self.data)
        if kind == _K_FIXED:
            pos += _FIXED[b]
            if pos > size:
                raise ValueError("a number runs past the end")
            return pos
        if kind == _K_LONGSTR or (kind == _K_BIN and self.record):
            width = _STRLEN[b] if kind == _K_LONGSTR else _BINLEN[b]
            start = pos + 1 + width
            end = start + _length(data, pos + 1, width)
            if end > size:
                raise ValueError("a string runs past the end")
            if end > start and not self.record:
                self.string(start, end)
            return end
        if kind == _K_EXT and not self.record:
            return self.ext(b, pos, key, at_first)
        if kind == _K_BIN:
            raise ValueError("bytes, which JSON cannot carry")
        if kind == _K_EXT:
            raise ValueError("an extension type is not allowed in a record")
        raise ValueError(f"type byte {b:#04x} is not msgpack")

    def ext(self, b: int, pos: int, key: bool, at_first: bool) -> int:
        """An extension type (only those the library writes, where it writes them)."""
        data = self.data
        if b in _FIXEXT:
            n, start = _FIXEXT[b], pos + 2
        else:
            width = _EXTLEN[b]
            n = _length(data, pos + 1, width)
            start = pos + 2 + width
        end = start + n
        if end > len(data):
            raise ValueError("an extension runs past the end")
        code = data[start - 1]
        payload = bytes(data[start:end])
        info = self.info
        if code == EXT_BLOB:
            self.blob(payload, pos)
        elif code == EXT_TUPLE and n == 0 and at_first and not key:
            info.special = True
        elif code == EXT_ECHO and n == 0 and self.echo_ok and not key:
            info.echoes += 1
        elif code == EXT_BIGINT and n:
            if not payload.lstrip(b"-").isdigit():
                raise ValueError("a big int that is not a decimal number")
            int_from_digits(payload)
            info.special = True
        elif code == EXT_SURROGATE:
            payload.decode("utf-8", "surrogatepass")
            info.special = True
        else:
            raise ValueError(f"extension type {code} is not allowed here")
        return end

    def blob(self, payload: bytes, pos: int) -> None:
        """A blob reference at `pos`: in range, and noted (a blob with surrogates is special)."""
        index = int.from_bytes(payload, "big")
        if len(payload) != 4 or index >= self.n_blobs:
            raise ValueError(f"blob reference {index} out of range ({self.n_blobs} blobs)")
        info = self.info
        self.offsets.append(pos)
        info.refs += 1
        if self.surrogates is not None and self.surrogates(index):
            info.special = True

    def finish(self, pos: int) -> None:
        """The end of the top value: nothing may follow it, and its strings must decode."""
        if pos > len(self.data):
            raise ValueError("a string runs past the end")
        if pos != len(self.data):
            raise ValueError(f"{len(self.data) - pos} bytes after the value")
        _utf8(self.spans)


#: Longest value `quick_check` decodes: what it allocates stays below a fixed bound (a
#: decoded object costs at most about 80 bytes per packed byte).
QUICK_LIMIT = 16 << 10
#: Every byte but those that start a container: deleting them leaves at most as many bytes
#: as the value opens containers, a bound on its nesting.
_NOT_CONTAINER = bytes(b for b in range(256) if not (0x80 <= b <= 0x9F or 0xDC <= b <= 0xDF))
#: An empty bin: the only bytes object `max_bin_len=0` lets through.
_EMPTY_BIN = b"\xc4\x00"


class _Unsure(Exception):
    """`quick_check` cannot tell: the value holds something `check_packed` must look at."""


class QuickCheck:
    """`quick_check` with what it reuses from one value to the next (a packer; not
    thread-safe: one per reader)."""

    __slots__ = ("_echo_ok", "_exts", "_info", "_n_blobs", "_pack", "blob_surrogates")

    def __init__(self, blob_surrogates: Callable[[int], bool] | None = None) -> None:
        self.blob_surrogates = blob_surrogates
        # a small buffer to start with (it grows to QUICK_LIMIT at most)
        self._pack = msgpack.Packer(use_bin_type=True, buf_size=1024).pack
        self._info = PackedInfo(-1)
        self._n_blobs = 0
        self._echo_ok = False
        # the blob references met so far, made once each (what the packer packs back)
        self._exts: dict[bytes, msgpack.ExtType] = {}

    def __call__(
        self, data: bytes, n_blobs: int, max_depth: int, echo_ok: bool = False
    ) -> PackedInfo | None:
        """What `check_packed` would find in `data` (`blob_refs` not recorded), or None when
        this quick look cannot tell (then `check_packed` must decide).

        Accepted here only: a value of at most `QUICK_LIMIT` bytes, with fewer container
        bytes than `max_depth`, holding no bytes, that msgpack decodes with blob references
        in range and at most one echo (where `echo_ok`) as its only extension types, and that
        packs back to exactly `data`: its bytes are then canonical msgpack of a tree
        `check_packed` passes. The echo must be the first item of a top-level array (where
        a request tail holds it)."""
        if type(data) is not bytes or len(data) > QUICK_LIMIT or _EMPTY_BIN in data:
            return None
        if len(data) > max_depth and len(data.translate(None, _NOT_CONTAINER)) > max_depth:
            return None
        info = self._info = PackedInfo(-1)
        self._n_blobs, self._echo_ok = n_blobs, echo_ok
        try:
            # timestamp=1: a msgpack timestamp (ext -1, which no hook sees) decodes as a float,
            # which never packs back to its bytes
            value = msgpack.unpackb(
                data,
                raw=False,
                strict_map_key=False,
                ext_hook=self._ext,
                max_bin_len=0,
                timestamp=1,
            )
            if self._pack(value) != data:
                return None
        except Exception:  # malformed, or something to look at closely: check_packed decides
            return None
        if type(value) is list:
            info.top_items = len(value)
            if info.echoes and value[0] is not _ECHO:
                return None  # an echo elsewhere (a dict key, say): check_packed decides
        elif info.echoes:
            return None
        return info

    def _ext(self, code: int, payload: bytes) -> msgpack.ExtType:
        info = self._info
        if code == EXT_BLOB and len(payload) == 4:
            index = int.from_bytes(payload, "big")
            if index >= self._n_blobs:
                raise _Unsure
            info.refs += 1
            if self.blob_surrogates is not None and self.blob_surrogates(index):
                info.special = True
        elif code == EXT_ECHO and self._echo_ok and not payload and not info.echoes:
            info.echoes = 1
        else:
            raise _Unsure
        ext = self._exts.get(payload) if code == EXT_BLOB else _ECHO
        if ext is None:
            if len(self._exts) >= _MAX_EXTS:  # memory stays flat, whatever the file holds
                self._exts.clear()
            ext = self._exts[payload] = msgpack.ExtType(code, payload)
        return ext


_ECHO = msgpack.ExtType(EXT_ECHO, b"")
#: Blob references `QuickCheck` keeps made at most.
_MAX_EXTS = 4096


def quick_check(
    data: bytes,
    n_blobs: int,
    max_depth: int,
    *,
    blob_surrogates: Callable[[int], bool] | None = None,
    echo_ok: bool = False,
) -> PackedInfo | None:
    """`check_packed` at C speed for a short value, or None when it cannot tell (see
    `QuickCheck.__call__`)."""
    return QuickCheck(blob_surrogates)(data, n_blobs, max_depth, echo_ok)


def splice_blobs(data: bytes, refs: array[int] | None, text_of: Callable[[int], bytes]) -> bytes:
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

"""JSON text handed over undecoded (`RawJSON`), decoded exactly as `json.loads` would.

A capture server receives request bodies as bytes. Decoding them with `json.loads` first costs
more than recording the turn, although a re-sent conversation is, byte for byte, the previous
request's prefix. `RawJSON` lets the server pass the JSON text of a field (or of single
messages) instead; the graph decodes only what it needs.

msgspec is the fast scanner. Where it differs from `json.loads` (NaN and Infinity literals,
lone-surrogate escapes, numbers beyond float range such as ``1e400``, a UTF-8 byte order mark,
UTF-16/32 bytes) it refuses the text, and the text is decoded by `json.loads` instead, so the
value is always exactly what `json.loads` gives, and text that is not JSON fails with
`json.loads`'s own message.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from ..errors import InvalidValueError

__all__ = ["RawJSON", "decode_array", "decode_raw", "resolve_raw", "split_array", "utf8_text"]


class RawJSON:
    """JSON text standing for the value it encodes: `bytes` (any encoding `json.loads`
    detects) or `str`.

    Accepted in every JSON field of `TurnNode`: as the whole field (a `request_messages`
    array, a tool list, a response message...) or as single items of a list field (one
    message of `request_messages`). The graph stores and rebuilds exactly what
    `json.loads(data)` gives; text that is not JSON raises `InvalidValueError` naming the
    field, with `json.loads`'s message.
    """

    __slots__ = ("data",)

    data: bytes | str

    def __init__(self, data: bytes | bytearray | memoryview | str) -> None:
        if type(data) is not bytes and type(data) is not str:
            # kept as the bytes or characters themselves: a subclass's methods (its `decode`,
            # `encode`) may say otherwise than what it holds
            if isinstance(data, str):
                data = str.__str__(data)
            elif isinstance(data, bytes):
                data = bytes.__getitem__(data, slice(None))  # (not its own buffer or bytes)
            elif isinstance(data, bytearray | memoryview):
                data = bytes(data)
            else:
                raise TypeError(f"RawJSON expects bytes or str, got {type(data).__name__}")
        self.data = data

    def decode(self) -> Any:
        """The value `json.loads(self.data)` gives (raises what `json.loads` raises)."""
        return _loads(self.data)

    def __repr__(self) -> str:
        text = self.data if len(self.data) <= 60 else self.data[:57]
        suffix = "" if len(self.data) <= 60 else "..."
        return f"RawJSON({text!r}{suffix})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RawJSON) and other.data == self.data

    def __hash__(self) -> int:
        return hash((RawJSON, self.data))


_decode = msgspec.json.decode
_split = msgspec.json.Decoder(list[msgspec.Raw]).decode
_decode_list = msgspec.json.Decoder(list[Any]).decode


def _loads(data: bytes | str) -> Any:
    try:
        return _decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeError):
        # msgspec refuses what it cannot decode exactly as json.loads would; json.loads then
        # either decodes it (NaN, 1e400, lone surrogates, other encodings) or raises
        pass
    return json.loads(data)


def decode_raw(raw: RawJSON, path: str) -> Any:
    """Decode `raw` as `json.loads` would; text that is not JSON raises `InvalidValueError`
    naming `path` with `json.loads`'s message (the `json` error is the cause)."""
    try:
        return _loads(raw.data)
    except RecursionError as exc:
        raise InvalidValueError(f"JSON text nested too deeply to decode: {exc}", path) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidValueError(f"invalid JSON text: {exc}", path) from exc


def utf8_text(raw: RawJSON) -> bytes | None:
    """The bytes the graph reads `raw` from, which `json.loads` decodes to what it decodes
    `raw.data` to: bytes as given; a str as its UTF-8 (each lone surrogate as itself), which
    the byte path reads at the speed of bytes (a re-sent prefix confirmed, not decoded).

    None for a str whose UTF-8 `json.loads` would read otherwise: one that begins with
    U+FEFF (refused in a str, a byte order mark taken off bytes), or with a NUL in its first
    two characters (bytes read as UTF-16 or UTF-32 then). The caller decodes the str."""
    data = raw.data
    if type(data) is bytes:
        return data
    text = data.encode("utf-8", "surrogatepass")  # type: ignore[union-attr]
    return text if json.detect_encoding(text) == "utf-8" else None


def decode_array(data: bytes) -> list[Any]:
    """The items of a JSON array text, decoded by msgspec in one call; raises where msgspec
    refuses the text (not an array, or text it leaves to `json.loads`). Where it accepts,
    the items are exactly what `json.loads` gives."""
    return _decode_list(data)


def split_array(data: bytes | str) -> list[msgspec.Raw] | None:
    """The items of a JSON array text as raw spans (each exactly as written), or None when
    msgspec cannot split it (not an array, or text it leaves to `json.loads`)."""
    try:
        return _split(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeError):
        return None


def resolve_raw(value: Any, path: str) -> Any:
    """`value` with `RawJSON` decoded: the whole value, or items of a top-level list or tuple
    (the container is copied only when it holds one)."""
    if type(value) is RawJSON:
        return decode_raw(value, path)
    if type(value) is list or type(value) is tuple:
        for item in value:
            if type(item) is RawJSON:
                break
        else:
            return value
        items = [
            decode_raw(item, f"{path}[{i}]") if type(item) is RawJSON else item
            for i, item in enumerate(value)
        ]
        return tuple(items) if type(value) is tuple else items
    return value

"""Writing JSON documents piece by piece, byte-identical to one `json.dumps` call.

`json.dumps` of a dict is its keys and values joined by ", " and ": " inside braces; a
list is its items joined by ", " inside brackets. `write_document` produces exactly that
while pulling list items from iterators, so only one item is alive at a time. Each piece is
written by the engine's `dumps` (`_core.dumps`, equal to `json.dumps` for JSON values and
several times as fast).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

from .._core import dumps

__all__ = ["Streamed", "write_document", "writer_for"]


#: The nesting the engine's writer takes in a document's pieces: a recorded value (at most
#: `MAX_DEPTH`) inside the few levels of the document around it. A deeper piece (a caller's
#: metadata) is written by `json.dumps`, which goes up to the interpreter's recursion limit.
_DEPTH = 900


class Streamed:
    """A list value whose items are produced lazily while the document is written."""

    __slots__ = ("items",)

    def __init__(self, items: Iterable[Any]) -> None:
        self.items = items


def writer_for(fp: IO[Any]) -> Callable[[str], Any]:
    """A function writing str to a text stream, or ASCII bytes to a binary one."""
    mode = getattr(fp, "mode", None)
    text = isinstance(fp, io.TextIOBase) or (
        not isinstance(fp, io.RawIOBase | io.BufferedIOBase)
        and isinstance(mode, str)
        and "b" not in mode
    )
    if text:
        return fp.write
    write = fp.write
    # json.dumps output is ASCII with the default ensure_ascii=True.
    return lambda text: write(text.encode("ascii"))


def _chunks(value: Any) -> Iterator[str]:
    """JSON text of `value` in pieces; only `Streamed` lists and the dicts holding them are
    written piece by piece, everything else by one `json.dumps` call."""
    if isinstance(value, Streamed):
        yield "["
        sep = ""
        for item in value.items:
            yield sep
            yield from _chunks(item)
            sep = ", "
        yield "]"
    elif isinstance(value, dict) and any(isinstance(v, Streamed) for v in value.values()):
        # only the library's own records hold Streamed values, and their keys are str
        yield "{"
        sep = ""
        for key, item in value.items():
            yield sep
            yield dumps(key, max_depth=_DEPTH)
            yield ": "
            yield from _chunks(item)
            sep = ", "
        yield "}"
    else:
        try:
            text = dumps(value, max_depth=_DEPTH)
        except (TypeError, ValueError):
            # what the engine's writer refuses (a caller's value nested deeper than it goes,
            # or not JSON at all): json.dumps decides, so the bytes or the error are its own
            text = json.dumps(value)
        yield text


def write_document(fp: IO[Any], document: Any) -> None:
    """Write `document` as `json.dumps(document)` would, expanding `Streamed` lists lazily."""
    write = writer_for(fp)
    for chunk in _chunks(document):
        if chunk:
            write(chunk)

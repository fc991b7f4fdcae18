"""Every graph a test builds is saved and loaded back, and must come back the same; the check
runs once per graph shape.

The guarantee: `load(save(graph))` answers every query as `graph` does (its export with
messages and discarded turns, token fields, links and stats: `graph_snapshot`). What a save
and a load do to a graph depends on its shape, not on the text of its strings or the values
of its numbers: which records the file holds, in which order, how they refer to each other,
the flags of each turn, which extension types each packed value holds (tuples, big ints, lone
surrogates, blob references, echoes), which token encodings it uses, which payloads needed
escaping. `shape_of` reads exactly that from the saved file, so a graph whose shape was
checked in this session is only saved and read, not loaded and compared.
`ROLLOUT_STORE_ROUND_TRIP=every` checks every graph (`.ci/run` sets it).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Hashable, Iterable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from rollout_store import RolloutGraph, export_session
from rollout_store.engine.blobs import content_digest

__all__ = ["RoundTrips", "graph_snapshot", "same_answers", "shape_of"]

_MAGIC_V2 = b"RLSTORE\x02"
_FRAME = struct.Struct("<5sBIQQ")
_ESCAPE = b"\xfe\xf7\xfb\xfd"
_BLOB, _VALUE, _TURN = 1, 2, 3


def graph_snapshot(graph: RolloutGraph) -> str:
    """Everything a graph answers, as one string: equal strings, equal graphs."""
    doc, *rest = _answers(graph)
    return json.dumps(doc) + "".join(rest)


def _answers(graph: RolloutGraph) -> tuple[Any, str, str, str]:
    """What `graph_snapshot` joins: the export (a JSON value), then its token fields, links
    and stats written out."""
    doc = export_session(graph, include_messages=True, include_discarded=True)
    turns = [graph.get(n) for n in graph.node_ids()]
    tokens = [(t.prompt_ids, t.sampled_ids, t.sampled_logprobs) for t in turns]
    links = [(graph.parent(n), graph.link_kind(n)) for n in graph.node_ids()]
    return doc, repr(tokens), repr(links), repr(graph.stats())


def same_answers(loaded: RolloutGraph, graph: RolloutGraph) -> bool:
    """`graph_snapshot(loaded) == graph_snapshot(graph)`, without writing out the exports
    (those of a deep conversation repeat its history at every turn: hundreds of MB)."""
    (doc, *rest), (other, *other_rest) = _answers(loaded), _answers(graph)
    if rest != other_rest:
        return False
    return _same_json(doc, other) or json.dumps(doc) == json.dumps(other)


_EXACT = (str, int, bool, type(None))
_SCALARS = {*_EXACT, float}


def _same_json(a: Any, b: Any) -> bool:
    """True only if `json.dumps(a) == json.dumps(b)`: the same built-in types all the way
    down, floats written alike, dicts with the same keys in the same order. False may still
    dump alike (a tuple against a list, a subclass): the caller then compares the text.
    A loop, not recursion: values nest as deep as intake takes."""
    pending = [(a, b)]
    while pending:
        a, b = pending.pop()
        kind = type(a)
        if kind is not type(b):
            return False
        if kind in _EXACT:
            if a != b:
                return False
        elif kind is float:
            if repr(a) != repr(b):
                return False
        elif kind is dict:
            if len(a) != len(b):
                return False
            for (k, x), (j, y) in zip(a.items(), b.items(), strict=True):
                if type(k) is not str or type(j) is not str or k != j:
                    return False
                pending.append((x, y))
        elif kind is list or kind is tuple:
            if len(a) != len(b):
                return False
            kinds = set(map(type, a))
            if kinds <= _SCALARS:  # token ids, say: compared in C, a million at a time
                if list(map(type, a)) != list(map(type, b)):
                    return False
                if a != b if float not in kinds else list(map(repr, a)) != list(map(repr, b)):
                    return False
            else:
                pending.extend(zip(a, b, strict=True))
        else:
            return False
    return True


def _ext_codes(packed: bytes | None) -> Hashable:
    """The extension types a packed value holds, and whether it is empty."""
    if packed is None:
        return None
    if not packed:  # a request without messages has no tail
        return "empty"
    codes: set[int] = set()

    def hook(code: int, data: bytes) -> None:
        codes.add(code)

    msgpack.unpackb(
        packed, ext_hook=hook, raw=False, strict_map_key=False, unicode_errors="surrogatepass"
    )
    return (len(packed) > 1, tuple(sorted(codes)))


def _segment(spec: Any) -> Hashable:
    if spec is None:
        return None
    if spec[0] == "j":
        return ("j", _ext_codes(spec[1]))
    return spec[0]


def _prompt(spec: Any) -> Hashable:
    """[0, turn] the same as a turn's; [1, turn, segment] extending one; [2, segment] new."""
    if spec is None:
        return None
    if spec[0] == 2:
        return (2, _segment(spec[1]))
    return (spec[0], spec[1], *(_segment(s) for s in spec[2:]))


def _relative(index: int, other: int | None) -> Hashable:
    """Where a turn's parent or base is: none, the turn just before, or an earlier one."""
    if other is None:
        return None
    return "previous" if other == index - 1 else "earlier"


def _few(n: int | None) -> Hashable:
    return n if n is None or n < 2 else "many"


def _turn_shape(index: int, record: list[Any], values: int) -> Hashable:
    """A turn record's shape; `values` is the number of value records before this turn's
    own new ones (a reference below it reuses a value, one at or above it is new)."""
    node_id, parent, link, flags, meta, system, base, tail, n_rest, response = record[:10]
    tools, sampling, prompt, sampled, logprobs, keys, refs, moves = record[10:18]
    requested = record[18] if len(record) > 18 else None
    shared = [
        None if ordinal is None else ordinal >= values
        for ordinal in (system, tools, sampling, requested)
    ]
    return (
        len(record),
        node_id == f"turn-{index}",  # a default id or a chosen one
        _relative(index, parent),
        link,
        flags,
        tuple(field is None for field in meta),
        _few(meta[4]),  # n_tools
        _relative(index, base),
        _ext_codes(tail),
        _few(n_rest),
        _ext_codes(response),
        tuple(shared),
        _prompt(prompt),
        _segment(sampled),
        _segment(logprobs),
        tuple(key is None for key in keys),
        None if keys[3] is None else _few(len(keys[3])),
        refs[0] > 0,
        tuple(sorted({(_relative(index, turn), link) for turn, link in moves})),
    )


def shape_of(data: bytes) -> Hashable:
    """The shape of a version-2 file saved by `RolloutGraph.save`: its header without the
    file id, then per frame its kind byte (escaping included) and what the record's path
    through save and load depends on (see the module's docstring), runs of equal frames
    as one."""
    assert data[:8] == _MAGIC_V2
    shape: list[Hashable] = []
    offset, turns, values, turn_values = 8, 0, 0, 0
    while offset < len(data):
        _, kind_byte, length, _, _ = _FRAME.unpack_from(data, offset)
        stored = data[offset + _FRAME.size : offset + _FRAME.size + length]
        payload = stored.replace(_ESCAPE + b"\x00", _ESCAPE) if kind_byte & 0x80 else stored
        offset += _FRAME.size + length
        kind = kind_byte & 0x7F
        if kind == _BLOB:
            shape.append((kind_byte, b"\xed" in payload[16:]))  # surrogates (or not)
            continue
        body = msgpack.unpackb(
            payload, raw=False, strict_map_key=False, unicode_errors="surrogatepass"
        )
        if kind == _VALUE:
            shape.append((kind_byte, _ext_codes(body)))
            values += 1
        elif kind == _TURN:
            shape.append((kind_byte, _turn_shape(turns, body, turn_values)))
            turns += 1
            turn_values = values
        elif isinstance(body, dict) and "format" in body:  # the header, without the file id
            shape.append(
                (kind_byte, tuple((k, repr(v)) for k, v in body.items() if k != "file_id"))
            )
        elif isinstance(body, dict):  # the end: its counts follow from the frames before
            shape.append((kind_byte, tuple(body)))
        else:
            shape.append((kind_byte, repr(body)))
    return _runs(shape)


def _runs(shape: list[Hashable]) -> Hashable:
    """Consecutive equal records as one, marked once or repeated: the tenth turn of a chain
    takes the path through save and load that the second took."""
    runs: list[tuple[Hashable, bool]] = []
    for item in shape:
        if runs and runs[-1][0] == item:
            runs[-1] = (item, True)
        else:
            runs.append((item, False))
    return tuple(runs)


class RoundTrips:
    """The graphs of one test session checked so far, by shape (no state outside it)."""

    def __init__(self, every: bool = False) -> None:
        self.every = every
        self.shapes: set[Hashable] = set()
        self.checked = 0
        self.skipped = 0

    def check(self, graphs: Iterable[RolloutGraph], folder: Path) -> None:
        """Save each graph into `folder`; load and compare it unless its shape was checked.

        A graph may hold ints a default process cannot write as text (read from a file
        written where the limit was raised): the comparison writes them, so the limit is
        lifted meanwhile. Saves skip fsync (durability is not what is checked)."""
        limit = sys.get_int_max_str_digits()
        sys.set_int_max_str_digits(0)
        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(os, "fsync", lambda fd: None)
                for graph in graphs:
                    self._check(graph, folder)
        finally:
            sys.set_int_max_str_digits(limit)

    def _check(self, graph: RolloutGraph, folder: Path) -> None:
        # graphs read from files, empty ones, and ones with an injected (colliding) hasher
        # whose digests a file cannot verify are left out
        if graph.load_report is not None or not len(graph):
            return
        if graph.blobs._hasher is not content_digest:
            return
        path = folder / f"{self.checked + self.skipped}.rls"
        graph.save(path)
        shape = shape_of(path.read_bytes())
        if shape in self.shapes and not self.every:
            self.skipped += 1
            return
        assert same_answers(RolloutGraph.load(path), graph), f"{path} loads back different"
        self.shapes.add(shape)
        self.checked += 1

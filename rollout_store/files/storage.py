"""The rollout file: framed, chained msgpack records, each blob once, turns as references.

A file is a magic string and a sequence of frames; version 2 (`framing`) binds every frame
to the ones before it, version 1 (`frames`) is still read (and appended to). Saving writes a
temporary file, fsyncs and renames it (`atomic`); append mode writes one turn's frames with
one write call and fsyncs by policy. Loading checks every frame, blob digest and stored value
(`packed`) and stops at the first damage, naming its offset; it trusts the index keys turn
records carry, which `verify` recomputes from their content (`key_check`). Recovering
(`load(recover=True)`, `rewrite_intact`) reads a version-2 file on past damage and keeps every
turn whose record and referents are intact: records refer to earlier ones by their place in
the file, and `framing.read_gap` says how many records of each kind the damage held, so
those places stay right. Opening a log damaged before intact records refuses, saying what
to run. The format is specified in docs/format.md.
"""

from __future__ import annotations

import contextlib
import os
import sys
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from functools import partial
from pathlib import Path
from typing import IO, Annotated, Any, NamedTuple

import msgspec

from ..engine.blobs import BlobTable, content_digest
from ..engine.encoding import ECHO_PACKED, array_header
from ..engine.intake import MAX_DEPTH, compact_ids
from ..engine.shared_blobs import StoreBlobTable
from ..engine.stored import (
    HAS_RESPONSE,
    LOGPROBS_PACKED,
    MESSAGES_TUPLE,
    NO_MESSAGES,
    PACKED,
    RESPONSE_REFS,
    RESPONSE_SPECIAL,
    TAIL_ECHO,
    TAIL_REFS,
    TAIL_SPECIAL,
    IndexKeys,
    LinkKind,
    Turn,
    TurnFlag,
    TurnMeta,
    TurnSide,
    finish_tail,
    full_run,
    is_above,
)
from ..engine.tokens import ArrayRun, PackedFull, TokenRun, packable, run_list
from ..errors import (
    ChecksumMismatch,
    CorruptFileError,
    CorruptObjectError,
    DamagedStoreObjectError,
    FileLockedError,
    FileSyncError,
    InvalidArgumentError,
    MissingObjectError,
    MissingStoreObjectError,
    StoreError,
    StoreObjectError,
    StoreRequiredError,
    UnsupportedVersionError,
)
from ..graph import Graph, GraphRestorer, JournalEntry
from ..metadata import GraphMeta
from ..model.drift import Drift
from ..model.timeline import TIMELINE_SIZE, Timeline
from ..stores.content import ContentStore, StringCache
from . import framing
from .atomic import create_private, fsync_dir, lock_log, replace_file, write_error
from .frames import (
    BLOB_PREFIX,
    KIND_BLOB,
    KIND_BLOB_REF,
    KIND_DRIFT,
    KIND_END,
    KIND_HEADER,
    KIND_META,
    KIND_NAMES,
    KIND_TIMELINE,
    KIND_TURN,
    KIND_VALUE,
    MAGIC,
    MODE_LOG,
    MODE_SNAPSHOT,
    FrameReader,
    blob_frame,
    decode_segment,
    encode_segment,
    frame,
    pack,
    unpack_payload,
)
from .framing import Part
from .key_check import KeyCheck, UnkeyedTurn
from .packed import (
    MESSAGES_DEPTH,
    PackedInfo,
    blob_indexes,
    check_int_array,
    check_packed,
    splice_blobs,
)

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "DroppedTurn",
    "FileLockedError",
    "LoadReport",
    "PromptKind",
    "RolloutGraph",
    "TurnRecord",
    "UnkeyedTurn",
    "load",
    "open_append",
    "rewrite_intact",
    "save",
    "verify",
]


class PromptKind(IntEnum):
    """How a turn record gives its prompt tokens."""

    SAME = 0  # [SAME, turn]: the very prompt of an earlier turn
    EXTENDS = 1  # [EXTENDS, turn, segment]: an earlier turn's prompt + sampled, then more
    NEW = 2  # [NEW, segment]: the tokens whole


#: A position in the file (of a turn or a value record) or a count: never negative.
_Index = Annotated[int, msgspec.Meta(ge=0)]


class TurnRecord(NamedTuple):
    """The payload of a turn frame: an array of these 19 fields, in this order.

    Files written before `requested` existed have the first 18; it reads as None.

    Written by `_Writer.turn_frames` and read by `_Loader.turn`, which decodes it into this
    type with msgspec (so the field types below are checked in C). Turns, values and blobs
    are referred to by their position in the file.
    """

    node_id: str
    parent: _Index | None  # an earlier turn (a later parent re-links its child by `moves`)
    link: int  # LinkKind, 0 without parent
    flags: int  # Turn.flags without the derived bits (`_DERIVED_FLAGS`)
    meta: tuple[str | None, str | None, str | None, str | None, int | None]  # TurnMeta
    system: _Index | None  # value holding the leading system messages
    base: _Index | None  # the turn whose request this one extends
    tail: bytes  # packed request messages after the base's
    n_rest: _Index  # number of non-system request messages
    response: bytes | None
    tools: _Index | None  # value
    sampling: _Index | None  # value
    prompt: list[Any] | None  # [PromptKind, ...]
    sampled: list[Any] | None  # segment
    logprobs: list[Any] | None  # segment, or ["j", packed JSON value]
    keys: tuple[int | None, int | None, int | None, list[int] | None]  # IndexKeys
    refs: tuple[_Index, _Index]  # blob references and their bytes since the last turn record
    moves: list[tuple[_Index, int]]  # (turn, link) of earlier turns re-linked under this one
    requested: _Index | None = None  # value holding requested_sampling_params


_RECORD_DECODER = msgspec.msgpack.Decoder(TurnRecord)


#: Bits of Turn.flags that say what the packed tail and response hold: derived on load from
#: those fields, never written (records written before they were derived carry them).
_CONTENT_FLAGS = (
    TurnFlag.TAIL_REFS | TurnFlag.RESPONSE_REFS | TurnFlag.TAIL_SPECIAL | TurnFlag.RESPONSE_SPECIAL
)
#: Bits of Turn.flags that the other fields of a turn record give (logprobs tagged "j", an
#: empty tail, an echo in the tail): derived on load, and written only to extend a file whose
#: header lacks `derived_flags` (whose every record carries them, agreeing with its fields).
_FIELD_FLAGS = TurnFlag.LOGPROBS_PACKED | TurnFlag.NO_MESSAGES | TurnFlag.TAIL_ECHO
#: Bits derived on load, never written (a version-1 writer also wrote TurnFlag.TAIL_SLOW).
_DERIVED_FLAGS = TurnFlag.TAIL_SLOW | TurnFlag.PREFIX_SPECIAL | _CONTENT_FLAGS
# bits of Turn.flags that say how the turn is kept in memory (its link is a field of the
# record): never written, and a file that has them is damaged
_IN_MEMORY_FLAGS = (
    TurnFlag.HAS_DIGEST
    | TurnFlag.HAS_KEY
    | TurnFlag.HAS_RESPONSE
    | TurnFlag.HAS_TOKENS
    | TurnFlag.FULL_APART
    | TurnFlag.HAS_IDENT
    | TurnFlag.LINK_LOW
    | TurnFlag.LINK_HIGH
)
#: Bits of Turn.flags a turn record holds (in a file whose records carry `_FIELD_FLAGS`).
_WRITTEN_CARRYING = ~(_DERIVED_FLAGS | _IN_MEMORY_FLAGS)
_WRITTEN = _WRITTEN_CARRYING & ~_FIELD_FLAGS
#: Bits a turn record's flags may hold (`_FIELD_FLAGS` only where its file says so), and
#: those of them a loaded turn keeps as they are (the others are derived from the fields).
_STORED_FLAGS = TurnFlag.MESSAGES_TUPLE | TurnFlag.EMPTY_PROMPT | _FIELD_FLAGS
_KEPT_FLAGS = TurnFlag.MESSAGES_TUPLE | TurnFlag.EMPTY_PROMPT
_LINK_KINDS = tuple(LinkKind)
_EXPLICIT = int(LinkKind.EXPLICIT)

#: How a file holds long strings: inline (self-contained) or as keys into a content store.
BLOBS_INLINE, BLOBS_STORE = "inline", "store"

#: `_scan(check_keys=...)`: index keys recomputed from each turn's content and used.
_REKEY = "rekey"

#: The version this library writes; it reads 1 and 2.
FORMAT_VERSION = 2
_V1 = 1
#: Timelines a log writes in one record (`_AppendLog.write_timeline`).
TIMELINE_BATCH = 16
_MAGICS = {MAGIC: _V1, framing.MAGIC_V2: FORMAT_VERSION}
_DIGEST_KINDS = frozenset({KIND_BLOB})
#: Turn records shorter than this are decoded without a first walk (what a crafted one can
#: allocate is then bounded by a constant); longer ones are walked and bounded first.
_SMALL_RECORD = 1024
#: Nesting of a turn record: record, field, segment or move.
_RECORD_DEPTH = 3


# ---------------------------------------------------------------- writing


class _Writer:
    """What has been written so far, so each turn record refers back instead of copying.

    `version` 2 chains every frame to the one before (`chain`, the last frame's value);
    version 1 frames are written only to extend a version-1 log."""

    def __init__(
        self, version: int = FORMAT_VERSION, chain: int = 0, blobs: str = BLOBS_INLINE
    ) -> None:
        self.version = version
        # write `_FIELD_FLAGS` into turn records: only to extend a file whose records carry
        # them (its header has no `derived_flags`), so that every record of a file agrees
        self.carry_flags = version == _V1
        self.chain = chain
        self.blobs_mode = blobs  # BLOBS_STORE: blob records name store keys, no text
        self.blobs_written = 0
        self.values: dict[int, int] = {}  # id(stored value bytes) -> ordinal
        self.value_objects: list[bytes] = []  # keeps the ids above valid
        # a TokenRun (by identity: runs define no equality; keyed by the run, not its id,
        # so no int is kept per turn) -> index of the first turn whose prompt / full it is;
        # a PackedFull is not kept (see `_full_index`)
        self.prompt_of: dict[TokenRun, int] = {}
        self.full_of: dict[TokenRun, int] = {}
        self.refs = (0, 0)  # blob references and their bytes counted so far

    def header(self, graph: Graph, mode: str) -> bytes:
        """The magic and header frame of a new file (which starts this writer's chain)."""
        fields: dict[str, Any] = {
            "format": "rollout_store",
            "version": self.version,
            "mode": mode,
            "share_threshold": graph.share_threshold,
        }
        if self.blobs_mode == BLOBS_STORE:
            fields["blobs"] = BLOBS_STORE
        if self.version == _V1:
            return MAGIC + frame(KIND_HEADER, pack(fields))
        fields["file_id"] = framing.new_file_id()
        if not self.carry_flags:
            fields["derived_flags"] = True
        data, self.chain = framing.encode_frame(KIND_HEADER, pack(fields), 0)
        return framing.MAGIC_V2 + data

    def frame(self, kind: int, payload: bytes, chain: list[int]) -> bytes:
        """One frame after the frame valued `chain[0]`, which becomes this one's value."""
        if self.version == _V1:
            return frame(kind, payload)
        data, chain[0] = framing.encode_frame(kind, payload, chain[0])
        return data

    def blob_frames(self, blobs: BlobTable, end: int, chain: list[int]) -> list[Part]:
        frames: list[Part] = []
        if self.blobs_mode == BLOBS_STORE:
            if not isinstance(blobs, StoreBlobTable):
                raise InvalidArgumentError(
                    'blobs="store" needs a graph over a content store (RolloutGraph(store=...))'
                )
            for index in range(self.blobs_written, end):
                ref = [
                    blobs.digest(index),
                    blobs.key(index),
                    blobs.size(index),
                    blobs.surrogates(index),
                ]
                frames.append(self.frame(KIND_BLOB_REF, pack(ref), chain))
            return frames
        string, digest, v1 = blobs.string, blobs.digest, self.version == _V1
        encode_blob, prev = framing.encode_blob_frame, chain[0]
        for index in range(self.blobs_written, end):
            text = string(index)  # (its UTF-8 made only where its storage is not that)
            if v1:
                frames.extend(blob_frame(digest(index), text))
            else:
                parts, prev = encode_blob(KIND_BLOB, digest(index), text, prev)
                frames.extend(parts)
        chain[0] = prev
        return frames

    def turn_frames(
        self, blobs: BlobTable, entry: JournalEntry
    ) -> tuple[list[Part], Callable[[], None]]:
        """Frames (as byte parts) for the turn's new blobs, new values and the turn itself,
        and a function to call once they are written."""
        turn = entry.turn
        refs = self.refs if entry.references is None else entry.references
        chain = [self.chain]  # advanced frame by frame; kept only once the frames are written
        frames = (
            self.blob_frames(blobs, entry.blobs_end, chain)
            if entry.blobs_end > self.blobs_written
            else []
        )
        new_values: list[bytes] = []
        known, value_ref, side = self.values, self._value_ref, turn.side
        values = [
            known.get(id(stored))
            if stored is not None and id(stored) in known
            # (a value written before is found by its id; the rest go through _value_ref)
            else value_ref(stored, new_values, frames, chain)
            for stored in (side.system, side.tools, side.sampling, side.requested)
        ]
        record = self._record(entry, values, refs)
        if entry.drift is not None and self.version != _V1:  # (a version-1 log keeps none)
            # before its turn, as blobs are: a turn cut short leaves no drift of itself
            frames.append(self.frame(KIND_DRIFT, pack(entry.drift.to_record()), chain))
        frames.append(self.frame(KIND_TURN, pack(list(record)), chain))
        return frames, partial(self._commit, chain, entry.blobs_end, new_values, refs, turn)

    def write_snapshot(self, blobs: BlobTable, entries: list[JournalEntry], out: _Gather) -> None:
        """Every turn's frames (version 2) into `out`, doing what `turn_frames` and its commit
        do for each, in one loop: a snapshot is written whole or not at all (its temporary
        file is dropped on error), so no turn needs undoing. References are counted in the
        end record."""
        chain = [self.chain]
        known, objects, refs = self.values, self.value_objects, self.refs
        encode, encode_blob = framing.encode_frame, framing.encode_blob_frame
        record_of, note_runs, parts = self._record, self.note_runs, out.parts
        string, digest, inline = blobs.string, blobs.digest, self.blobs_mode == BLOBS_INLINE
        values: list[int | None] = [None, None, None, None]
        last_side: TurnSide | None = None  # whose shared values `values` holds
        prev, written = self.chain, self.blobs_written
        for entry in entries:
            turn, end = entry.turn, entry.blobs_end
            if end > written:
                if inline:
                    for index in range(written, end):
                        blob, prev = encode_blob(KIND_BLOB, digest(index), string(index), prev)
                        parts += blob
                        out.size += len(blob[-1])
                else:
                    chain[0] = prev
                    parts += self.blob_frames(blobs, end, chain)
                    prev = chain[0]
                written = self.blobs_written = end
            side = turn.side
            if side is not last_side:  # (turns alike share one side: most share the last one)
                last_side = side
                for i, stored in enumerate(
                    (side.system, side.tools, side.sampling, side.requested)
                ):
                    ordinal = None
                    if stored is not None:
                        ordinal = known.get(id(stored))
                        if ordinal is None:
                            ordinal = known[id(stored)] = len(objects)
                            objects.append(stored)
                            value, prev = encode(KIND_VALUE, pack(stored), prev)
                            parts.append(value)
                    values[i] = ordinal
            if entry.drift is not None:
                drift, prev = encode(KIND_DRIFT, pack(entry.drift.to_record()), prev)
                parts.append(drift)
            record, prev = encode(KIND_TURN, pack(list(record_of(entry, values, refs))), prev)
            parts.append(record)
            if turn.prompt is not None or turn.full is not None:
                note_runs(turn)
            if len(parts) >= out.MAX_PARTS or out.size >= out.MAX_BYTES:
                out.flush()
        self.chain = prev

    def _value_ref(
        self, stored: bytes | None, new: list[bytes], frames: list[Part], chain: list[int]
    ) -> int | None:
        """The ordinal of a shared value; a value not written yet gets its frame."""
        if stored is None:
            return None
        ordinal = self.values.get(id(stored))
        if ordinal is not None:
            return ordinal
        for i, pending in enumerate(new):
            if pending is stored:
                return len(self.value_objects) + i
        new.append(stored)
        frames.append(self.frame(KIND_VALUE, pack(stored), chain))
        return len(self.value_objects) + len(new) - 1

    def _record(
        self, entry: JournalEntry, values: list[int | None], refs: tuple[int, int]
    ) -> TurnRecord:
        """The turn record of `entry`, its shared values at `values` (system, tools,
        sampling, requested)."""
        turn = entry.turn
        parent, base, side = turn.parent, turn.base, turn.side
        parent_index = parent.index if parent is not None and parent.index < turn.index else None
        logprobs, sampled = side.logprobs, side.sampled
        if sampled is PACKED or logprobs is PACKED:  # kept packed in the turn
            logprobs, sampled = turn.logprobs, turn.sampled
        if isinstance(logprobs, array):
            logprobs = encode_segment(logprobs)
        elif logprobs is not None:
            logprobs = ["j", logprobs]
        return TurnRecord(
            turn.node_id,
            parent_index,
            int(turn.link) if parent_index is not None else 0,
            turn.flags & (_WRITTEN_CARRYING if self.carry_flags else _WRITTEN),
            turn.meta,  # a NamedTuple: packed as an array
            values[0],
            base.index if base is not None else None,
            turn.tail,
            turn.n_rest,
            turn.response,
            values[1],
            values[2],
            None if turn.prompt is None else self._prompt_spec(turn),
            None if sampled is None else encode_segment(sampled),
            logprobs,
            entry.keys,  # a NamedTuple: packed as an array
            (refs[0] - self.refs[0], refs[1] - self.refs[1]),
            [(other.index, int(link)) for other, link in entry.moves] if entry.moves else [],
            values[3],
        )

    def _commit(
        self,
        chain: list[int],
        blobs_end: int,
        new_values: list[bytes],
        refs: tuple[int, int],
        turn: Turn,
    ) -> None:
        """The turn's frames are written: what later records refer back to."""
        self.chain = chain[0]
        self.blobs_written = blobs_end
        for stored in new_values:
            self.values[id(stored)] = len(self.value_objects)
            self.value_objects.append(stored)
        self.refs = refs
        self.note_runs(turn)

    def note_runs(self, turn: Turn) -> None:
        if turn.prompt is not None:
            self.prompt_of.setdefault(turn.prompt, turn.index)
        full = turn.full
        if full is not None and type(full) is not PackedFull:
            self.full_of.setdefault(full, turn.index)

    def _full_index(self, run: TokenRun) -> int | None:
        """The index of the first turn whose full run is `run`. A `PackedFull` is the full of
        the one turn that packed its prompt, the first turn whose prompt that is (a retry
        that shares the prompt has a full of its own): found through `prompt_of`, so a log
        keeps no entry for it (most turns' fulls)."""
        if type(run) is PackedFull:
            return self.prompt_of.get(run.prev)
        return self.full_of.get(run)

    def _prompt_spec(self, turn: Turn) -> list[Any] | None:
        run = turn.prompt
        if run is None:
            return None
        same = self.prompt_of.get(run)
        if same is not None:
            return [int(PromptKind.SAME), same]
        if run.prev is not None:
            extends = self._full_index(run.prev)
            if extends is not None:
                return [int(PromptKind.EXTENDS), extends, encode_segment(run.seg)]
        # a chain this file cannot name: write the tokens whole (exact, just not shared)
        return [int(PromptKind.NEW), encode_segment(compact_ids(run_list(run)))]


class _Gather:
    """Frames' parts written with few `writev` calls: no copy of a blob's text into a joined
    buffer (an ASCII text is written from the str itself: `AsciiText`), and no system call
    per part."""

    MAX_PARTS = 512  # below every system's IOV_MAX
    # written and freed by the MiB: the encoded text's memory is reused from one batch to the
    # next instead of faulted in afresh for the whole file, and a save holds about 1 MiB of it
    MAX_BYTES = 1 << 20

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.parts: list[Part] = []
        self.size = 0

    def add(self, parts: list[Part]) -> None:
        self.parts.extend(parts)
        self.size += sum(map(len, parts))
        if len(self.parts) >= self.MAX_PARTS or self.size >= self.MAX_BYTES:
            self.flush()

    def flush(self) -> None:
        parts, done, n = self.parts, 0, len(self.parts)
        while done < n:
            batch = parts[done : done + self.MAX_PARTS]
            written = os.writev(self.fd, batch)
            if written == sum(map(len, batch)):  # mostly: the whole batch at once
                done += len(batch)
                continue
            for part in batch:
                size = len(part)
                if written < size:
                    break
                written -= size
                done += 1
            if written:  # a part written in part
                parts[done] = bytes(memoryview(parts[done])[written:])  # (rare: a short write)
        parts.clear()
        self.size = 0


def _blobs_mode(blobs: str) -> str:
    if blobs not in (BLOBS_INLINE, BLOBS_STORE):
        raise InvalidArgumentError(f'blobs must be "inline" or "store", got {blobs!r}')
    return blobs


def save(graph: Graph, path: str | os.PathLike[str], *, blobs: str = "inline") -> None:
    """Write the whole graph to `path` atomically, as a version-2 snapshot: a temporary file
    with a unique name, fsync, rename, fsync of the folder. Refused with `FileLockedError`
    while another graph or process appends to the file at `path`.

    `blobs="inline"` (the default) writes a self-contained file. `blobs="store"` writes each
    long string as a reference (its key) into the content store of the graph, which must
    have one; `load(path, store=...)` reads such a file back.
    """
    mode = _blobs_mode(blobs)
    if mode == BLOBS_STORE and not isinstance(graph.blobs, StoreBlobTable):
        raise InvalidArgumentError('save(blobs="store") needs a graph over a content store')
    target = Path(path)
    log_path = graph.journal_path
    if log_path is not None and os.path.realpath(target) == log_path:
        raise InvalidArgumentError(
            f"{target} is the log this graph appends to; save to another path"
        )

    def write(fp: IO[bytes]) -> None:
        writer = _Writer(blobs=mode)
        out = _Gather(fp.fileno())
        out.add([writer.header(graph, MODE_SNAPSHOT)])
        entries = graph.journal_entries()
        writer.write_snapshot(graph.blobs, entries, out)
        references = list(graph.blobs.mark()[1:])
        timelines = graph.timeline_records()
        if timelines:  # one record holds them all
            chain = [writer.chain]
            out.add([writer.frame(KIND_TIMELINE, timeline_payload(timelines), chain)])
            writer.chain = chain[0]
        if not graph.meta.empty:
            chain = [writer.chain]
            out.add([writer.frame(KIND_META, pack(graph.meta.to_record()), chain)])
            writer.chain = chain[0]
        end = {"turns": len(entries), "blobs": len(graph.blobs), "references": references}
        out.add([writer.frame(KIND_END, pack(end), [writer.chain])])
        out.flush()

    with graph.lock:
        replace_file(target, write)


# ---------------------------------------------------------------- reading


class DroppedTurn(NamedTuple):
    """An intact turn record that `load(recover=True)` left out: a record it refers to (its
    parent, its base, a turn whose tokens it extends, a shared value or a blob) was lost to
    damage, or the record itself does not check. `cause` says which."""

    node_id: str | None  # None when the record does not say
    record: int  # its index in the file
    offset: int
    cause: str


@dataclass
class LoadReport:
    """What a load or verify found: how far the file is good, and the first damage."""

    path: str
    file_size: int
    good_bytes: int  # offset just past the last complete, verified frame
    records: int
    turns: int
    blobs: int
    error: str | None = None
    error_offset: int | None = None
    # the damage is a torn tail: no intact frame follows it (a cut, garbage or zeros to the
    # end), which `open(repair=True)` may cut off
    truncated: bool = False
    mode: str | None = None  # "log" (append mode) or "snapshot" (save)
    # the first damage; or the object the file names that its content store does not have
    exception: CorruptFileError | StoreObjectError | None = None
    version: int | None = None  # the file's format version
    resync_offset: int | None = None  # where the next intact frame after the damage starts
    good_chain: int = 0  # version 2: the chain value of the frame ending at good_bytes
    # turns whose records named other index keys than their content gives, filed under the
    # recomputed ones (`load(recover=True)`, and every load of a version-1 file)
    keys_recomputed: int = 0
    # turns whose keys could not be recomputed there (each with its record and the cause):
    # kept, filed under the keys their records name, as a plain load files every turn
    unkeyed: list[UnkeyedTurn] = field(default_factory=list)
    # `load(recover=True)` of a version-2 file reads on past damage: the damaged stretches
    # it read past ([start, end) offsets; one frame whose header alone was hit is rebuilt,
    # nothing of it lost), the turn records lost inside them, whether one of them could not
    # be read as frames (how many turns it held is then unknown), and the intact turn
    # records dropped because a record they refer to was lost (or they do not check)
    damaged: list[tuple[int, int]] = field(default_factory=list)
    turns_before_damage: int = 0  # of the turns kept, those read before the first damage
    lost_turns: int = 0
    lost_unknown: bool = False
    dropped: list[DroppedTurn] = field(default_factory=list)
    # (the long strings read for the turns lost or dropped stay in the graph's blob table:
    # its `stats()` count them in `blob_bytes`, not in `blob_bytes_saved`)
    # past damage a timeline or drift record names turns by their places in the file, which
    # are mapped to the turns kept: the entries naming a turn that was lost (or one past a
    # stretch of unknown content, whose place is unknown) are left out, and counted here
    timelines_lost: int = 0
    drifts_lost: int = 0
    # the node ids of the leaf rewards of a `meta` record left out past damage, because the
    # turn they name was lost (the rest of the metadata is kept)
    rewards_lost: list[str] = field(default_factory=list)
    # `meta` and `timeline` records lost whole inside damaged stretches: the graph's labels,
    # annotations, rewards and group as that record set them (a log's earlier meta record
    # stands instead, if one was read), and the timelines it held
    meta_records_lost: int = 0
    timeline_records_lost: int = 0

    def fail(self, exc: CorruptFileError | StoreObjectError, truncated: bool = False) -> None:
        if self.error is None:
            self.turns_before_damage = self.turns
        # the report outlives the read: its error keeps no frames (they hold the file's bytes)
        link: BaseException | None = exc
        for _ in range(8):  # the chain is short; a bound keeps a cycle from looping
            if link is None:
                break
            link.__traceback__ = None
            link = link.__cause__ or link.__context__
        self.exception = exc
        self.error = str(exc)
        self.error_offset = exc.offset
        self.truncated = truncated

    @property
    def ok(self) -> bool:
        return self.error is None


class _Loader:
    """Rebuilds a graph from the records of a file, through the graph's restore door."""

    def __init__(
        self,
        share_threshold: int | None,
        store: ContentStore | None = None,
        cache: StringCache | None = None,
        check_keys: bool = False,
    ) -> None:
        self.graph = RolloutGraph(share_threshold=share_threshold, store=store, cache=cache)
        self.restore: GraphRestorer = self.graph._restorer()
        self.writer = _Writer()
        self.value_is_list: list[bool] = []  # system parts must be arrays of messages
        # asks which blobs hold lone surrogates once one does (`surrogate_blob`)
        self.surrogates: Callable[[int], bool] | None = None
        self.ids: set[str] = set()  # of the turns read: the graph's node ids
        self.blobs = self.graph.blobs  # (the graph's own table: never replaced)
        # the graph's interned TurnMeta of each meta field read so far (most turns share one)
        self.metas: dict[tuple[Any, ...], TurnMeta] = {}
        self.unfiled: list[tuple[bytes, bytes | None]] = []  # values of the turn being read
        # the file's turn records carry `_FIELD_FLAGS` (its header has no `derived_flags`)
        self.carries_flags = False
        # `verify`: each turn's index keys recomputed from its content (`load` trusts them)
        self.key_check = KeyCheck(self.graph.blobs) if check_keys else None
        # keys recomputed rather than checked: a version-1 file (an earlier scheme of keys)
        # or a load with recover=True
        self.rekey = False
        self.node_id: str | None = None  # of the turn record being read
        # recovering past damage: records refer to earlier ones by their place in the file,
        # so once one is lost, these map places to what was kept (None: lost; identity while
        # the map itself is None). Past a stretch of unknown content (`frozen`) the places
        # of later records are unknown: only references to records before it resolve.
        self.turn_map: list[Turn | None] | None = None
        self.blob_map: list[int | None] | None = None
        self.frozen: tuple[int, int, int] | None = None  # (turns, blobs, values) known
        self.values_lost = False  # a value's place holds `_LOST_VALUE`

    def check(
        self, packed: Any, n_blobs: int, echo_ok: bool = False, depth: int = MAX_DEPTH
    ) -> PackedInfo:
        """Check a stored value once, without building it (see `packed.check_packed`):
        nested at most `depth` levels (`MESSAGES_DEPTH` for an array of messages)."""
        if not isinstance(packed, bytes):
            raise ValueError("a packed value must be bytes")
        return check_packed(
            packed, n_blobs, depth, blob_surrogates=self.surrogates, echo_ok=echo_ok
        )

    def blob_surrogates(self, index: int) -> bool:
        return self.blobs.surrogates(index)

    def blob_v2(self, payload: memoryview) -> None:
        """A version-2 blob frame's payload: digest, then text (the frame reader checked the
        digest, the only hash over the text)."""
        self._add_blob(payload[framing.DIGEST_SIZE :], bytes(payload[: framing.DIGEST_SIZE]))

    def _add_blob(self, data: memoryview, digest: bytes) -> None:
        try:
            text, surrogates = str(data, "utf-8"), False
        except UnicodeDecodeError:
            text, surrogates = str(data, "utf-8", "surrogatepass"), True
            self.surrogate_blob()
        self.blobs.add_verified(text, digest, len(data), surrogates)

    def surrogate_blob(self) -> None:
        """A blob with lone surrogates is read: from now on the check asks which blobs hold
        them (a value referring to one is special). Until then none does."""
        self.surrogates = self.blob_surrogates

    def blob(self, payload: memoryview, offset: int, record: int) -> None:
        """A blob frame's payload, read in place: prefix, digest, bin header, data."""
        n = len(payload)
        if n < 21 or payload[:3] != BLOB_PREFIX:
            raise ValueError("blob record must be [digest, data]")
        digest = bytes(payload[3:19])
        tag = payload[19]
        width = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(tag)
        if width is None or n < 20 + width:
            raise ValueError("blob record must hold its data as bin")
        size = int.from_bytes(payload[20 : 20 + width], "big")
        if 20 + width + size != n:
            raise ValueError("blob data length does not match its record")
        data = payload[20 + width :]
        actual = content_digest(data)
        if actual != digest:
            raise ChecksumMismatch("blob", digest, actual, offset=offset, record=record)
        self._add_blob(data, digest)

    def blob_ref(self, body: Any, offset: int, record: int) -> None:
        """A blob kept in the content store: fetched, verified against its key and its
        digest, then referenced. A missing or damaged object names its key and record."""
        blobs = self.graph.blobs
        if not isinstance(blobs, StoreBlobTable):
            raise ValueError("a blob reference in a file without a store")
        if not (
            isinstance(body, list)
            and len(body) == 4
            and type(body[0]) is bytes
            and len(body[0]) == 16
            and type(body[1]) is bytes
            and len(body[1]) == 32
            and type(body[2]) is int
            and type(body[3]) is bool
        ):
            raise ValueError("blob reference must be [digest, key, size, surrogates]")
        digest, key, size, surrogates = body
        try:
            data = blobs.store.get(key)
        except MissingObjectError:
            raise MissingStoreObjectError(
                key=key, store=str(blobs.store), offset=offset, record=record
            ) from None
        except CorruptObjectError as error:
            raise DamagedStoreObjectError(
                f"the object for this blob is damaged in {blobs.store!r}: {error.reason}",
                key=key,
                offset=offset,
                record=record,
            ) from error
        actual = content_digest(data)
        if actual != digest or len(data) != size:
            raise ChecksumMismatch("blob", digest, actual, offset=offset, record=record)
        try:
            text = data.decode("utf-8")
            has_surrogates = False
        except UnicodeDecodeError:
            text, has_surrogates = data.decode("utf-8", "surrogatepass"), True
        if has_surrogates != surrogates:
            raise ValueError("blob reference's surrogate flag does not match its object")
        if surrogates:
            self.surrogate_blob()
        blobs.add_reference(key, digest, size, surrogates)
        if blobs.cache is not None:
            blobs.cache.put(key, text, size)

    # ---- recovering past damage (`_Records` with `resync`)

    @property
    def lossy(self) -> bool:
        """Whether a record was lost: places in the file no longer match the graph's."""
        return self.turn_map is not None or self.blob_map is not None or self.frozen is not None

    def lose(self, kind: int) -> None:
        """A record of `kind` is lost (damaged, or it does not check): its place is kept."""
        if self.frozen is not None:
            return  # places are unknown from here on: nothing refers to this one
        if kind == KIND_TURN:
            if self.turn_map is None:
                self.turn_map = [self.restore.turn(i) for i in range(len(self.graph))]
            self.turn_map.append(None)
        elif kind in (KIND_BLOB, KIND_BLOB_REF):
            if self.blob_map is None:
                self.blob_map = list(range(len(self.graph.blobs)))
            self.blob_map.append(None)
        elif kind == KIND_VALUE:
            self.writer.value_objects.append(_LOST_VALUE)
            self.value_is_list.append(False)
            self.values_lost = True

    def places(self) -> int | None:
        """How many turn records were read so far (kept or lost), None once unknown."""
        if self.frozen is not None:
            return None
        return len(self.turn_map) if self.turn_map is not None else len(self.graph)

    def kept_index(self, place: int) -> int | None:
        """The graph's index of the turn read from the `place`th turn record of the file
        (the caller checks that one was read there), or None if it was lost or its place
        is past a stretch of unknown content."""
        places, frozen = self.turn_map, self.frozen
        if frozen is not None and place >= frozen[0]:
            return None
        if places is None:
            return place
        turn = places[place]
        return None if turn is None else turn.index

    def freeze(self) -> None:
        """A damaged stretch of unknown content: no later record's place is known."""
        if self.frozen is None:
            turns = len(self.turn_map) if self.turn_map is not None else len(self.graph)
            blobs = len(self.blob_map) if self.blob_map is not None else len(self.graph.blobs)
            self.frozen = (turns, blobs, len(self.writer.value_objects))

    def placed_blob(self) -> None:
        """A blob record was read into the graph's table (its last blob)."""
        if self.blob_map is not None and self.frozen is None:
            self.blob_map.append(len(self.graph.blobs) - 1)

    def _remapped(self, packed: Any, depth: int) -> Any:
        """`packed` with each blob reference (a place in the file) turned into the graph's
        index of that blob; `_LostReference` for a blob that was lost."""
        if not isinstance(packed, bytes) or (self.blob_map is None and self.frozen is None):
            return packed
        places = self.blob_map
        n_places = self.frozen[1] if self.frozen is not None else len(places or ())
        info = check_packed(packed, 1 << 32, depth, echo_ok=True)
        if not info.refs or info.blob_refs is None:
            return packed
        out = bytearray(packed)
        for at in info.blob_refs:
            place = int.from_bytes(out[at + 2 : at + 6], "big")
            index = (place if places is None else places[place]) if place < n_places else None
            if index is None:
                raise _LostReference(f"it refers to blob {place}, which was lost")
            out[at + 2 : at + 6] = index.to_bytes(4, "big")
        return bytes(out)

    def _remapped_record(self, record: TurnRecord) -> TurnRecord:
        logprobs = record.logprobs
        if logprobs is not None and len(logprobs) == 2 and logprobs[0] == "j":
            logprobs = ["j", self._remapped(logprobs[1], MAX_DEPTH)]
        return record._replace(
            tail=self._remapped(record.tail, MESSAGES_DEPTH),
            response=self._remapped(record.response, MAX_DEPTH),
            logprobs=logprobs,
        )

    def value(self, payload: Any) -> None:
        # a value may hold a request's leading system messages: an array of messages
        if self.blob_map is not None or self.frozen is not None:
            payload = self._remapped(payload, MESSAGES_DEPTH)
        info = self.check(payload, len(self.graph.blobs), depth=MESSAGES_DEPTH)
        if info.refs and not info.blob_refs:  # where they are, to splice them
            n_blobs, surrogates = len(self.graph.blobs), self.blob_surrogates
            info = check_packed(payload, n_blobs, MESSAGES_DEPTH, blob_surrogates=surrogates)
        self.value_is_list.append(info.top_items >= 0)
        self.writer.values[id(payload)] = len(self.writer.value_objects)
        self.writer.value_objects.append(payload)
        blobs = self.graph.blobs
        plain = None
        if not info.special:  # its plain packing, spliced: the value is never decoded
            plain = splice_blobs(payload, info.blob_refs, lambda i: blobs.string(i).encode())
        self.unfiled.append((payload, plain))

    def mark(self) -> tuple[tuple[int, int, int], int]:
        """Where the blobs and values stand before a turn's records are applied."""
        return self.blobs.mark(), len(self.writer.value_objects)

    def rollback(self, mark: tuple[tuple[int, int, int], int]) -> None:
        """Forget the blobs and values of a turn whose record failed: a recovered graph
        keeps only what its turns refer to (else a later turn could share a value whose
        blob references name blobs that are gone)."""
        blobs_mark, n_values = mark
        self.graph.blobs.rollback(blobs_mark)
        writer = self.writer
        for stored in writer.value_objects[n_values:]:
            del writer.values[id(stored)]
        del writer.value_objects[n_values:], self.value_is_list[n_values:]
        self.unfiled.clear()

    def turn(self, payload: memoryview, offset: int = 0, index: int = 0) -> None:
        """Check one turn record (at `offset`, record `index` of the file), build the stored
        turn and commit it to the graph.

        The record is decoded into `TurnRecord` by msgspec, which checks every field's type
        in C; what it refuses (lone surrogates in an id, say) is decoded by msgpack and its
        fields checked one by one (`_untyped_record`). Then each reference is checked against
        what came before, and the turn is built once and committed."""
        try:
            record = _RECORD_DECODER.decode(payload)
        except msgspec.DecodeError:
            record = _untyped_record(unpack_payload(payload))
        self.node_id = record.node_id
        if self.blob_map is not None or self.frozen is not None:
            record = self._remapped_record(record)
        blobs = self.blobs
        n_blobs = len(blobs)
        turn = self._identity(record)
        side = turn.side
        self._values(side, record)
        blob_refs = self._request(turn, record, n_blobs)
        tokens = (
            record.prompt is not None or record.sampled is not None or record.logprobs is not None
        )
        if tokens:
            self._tokens(turn, side, record, n_blobs)
        stored_flags = record.flags
        if self.carries_flags or stored_flags & _CONTENT_FLAGS:  # (else nothing to check)
            _check_carried(stored_flags, turn.flags, self.carries_flags)
        moves = self._moves(turn, record.moves) if record.moves else []
        keys, refs, node_id = record.keys, record.refs, record.node_id
        del record  # the turn holds copies of the record's bytes: let them go before filing it
        if refs[0] or refs[1]:  # (a snapshot counts them in its end record)
            blobs.count_references(refs[0], refs[1])
        restore = self.restore
        index_keys = IndexKeys._make(keys)
        key_check = self.key_check
        if key_check is not None:
            if self.rekey:
                index_keys = key_check.rekeyed(turn, index_keys, offset, index)
            else:
                key_check.check(turn, index_keys, offset, index)
        restore.commit(turn, index_keys, moves, blob_refs)
        if self.turn_map is not None and self.frozen is None:
            self.turn_map.append(turn)
        self.ids.add(node_id)
        if tokens:  # (a turn without token fields has no runs)
            self.writer.note_runs(turn)
        unfiled = self.unfiled
        if unfiled:
            for stored, plain in unfiled:  # the values it brought, found again from now on
                restore.add_value(stored, plain)
            unfiled.clear()

    def _identity(self, record: TurnRecord) -> Turn:
        """A new turn with its id, position, parent, link, stored flags and scalar fields
        (the derived flags are set from the other fields)."""
        graph, node_id, flags = self.graph, record.node_id, record.flags
        if node_id in self.ids:
            raise ValueError(f"bad or repeated node id {node_id!r}")
        if flags < 0 or flags & ~(_STORED_FLAGS | _DERIVED_FLAGS):
            raise ValueError("bad flags")
        if flags & _FIELD_FLAGS and not self.carries_flags:
            raise ValueError("a turn record carries flags that its file derives")
        link, parent = record.link, record.parent
        if not 0 <= link <= _EXPLICIT:
            raise ValueError("bad link kind")
        turn = self.restore.new_turn()
        index = turn.index = len(graph)
        turn.flags = flags & _KEPT_FLAGS  # (before the node id, which sets a flag)
        if node_id != f"turn-{index}":
            turn.ident = node_id
        if parent is not None:
            turn.parent = self._ref(parent)
            turn.link = _LINK_KINDS[link]  # two bits of the flags
        else:
            turn.parent = None
        meta = self.metas.get(record.meta)
        if meta is None:
            meta = self.metas[record.meta] = self.restore.meta(TurnMeta(*record.meta))
        turn.side.meta = meta
        return turn

    def _values(self, side: TurnSide, record: TurnRecord) -> None:
        """The shared values the record refers to (value records read before it)."""
        values = self.writer.value_objects  # value records in file order
        n_values = len(values) if self.frozen is None else self.frozen[2]
        system, tools, sampling, requested = (
            record.system,
            record.tools,
            record.sampling,
            record.requested,
        )
        if (
            (system is not None and system >= n_values)
            or (tools is not None and tools >= n_values)
            or (sampling is not None and sampling >= n_values)
            or (requested is not None and requested >= n_values)
        ):
            if self.frozen is not None:
                raise _LostReference("it refers to a shared value after unreadable damage")
            raise ValueError("value reference out of range")
        side.system = None if system is None else values[system]
        side.tools = None if tools is None else values[tools]
        side.sampling = None if sampling is None else values[sampling]
        side.requested = None if requested is None else values[requested]
        if self.values_lost and _LOST_VALUE in (
            side.system,
            side.tools,
            side.sampling,
            side.requested,
        ):
            raise _LostReference("it refers to a shared value that was lost")

    def _request(self, turn: Turn, record: TurnRecord, n_blobs: int) -> tuple[list[int], list[int]]:
        """The system part, the base, the tail and the response: the turn's bytes built once,
        filed under the record's request key. What the tail and the response hold (blob
        references, special values, an echo) sets the flags that say so; a request without
        messages has an empty tail (NO_MESSAGES). Returns the blobs the tail and the response
        refer to (the check found them: the commit does not walk them again).

        The record's decoder gave the tail and the response as bytes."""
        tail, n_rest, system, response = record.tail, record.n_rest, record.system, record.response
        flags = turn.flags
        surrogates = self.surrogates
        response_refs: list[int] = []
        if response is not None:
            info = check_packed(response, n_blobs, MAX_DEPTH, blob_surrogates=surrogates)
            if info.refs:
                flags |= RESPONSE_REFS
                response_refs = blob_indexes(response, info.blob_refs)
            if info.special:
                flags |= RESPONSE_SPECIAL
        base_index = record.base
        base = turn.base = None if base_index is None else self._ref(base_index)
        first = base.n_rest if base is not None else 0  # the first message the tail holds
        if base is not None and (not tail or base.flags & NO_MESSAGES):
            raise ValueError("a request without messages has no base, and is no base")
        if n_rest < first:
            raise ValueError("request shorter than its base")
        if system is not None and not self.value_is_list[system]:
            raise ValueError("system messages must be an array")
        if not tail:  # no messages
            if n_rest or system is not None or flags & MESSAGES_TUPLE:
                raise ValueError("a request without messages has messages")
            turn.flags = flags | NO_MESSAGES
            turn.build((tail,), n_rest, response)
            finish_tail(turn)
            return [], response_refs
        info = check_packed(tail, n_blobs, MESSAGES_DEPTH, blob_surrogates=surrogates, echo_ok=True)
        if info.top_items != n_rest - first:
            raise ValueError("request tail does not hold its messages")
        tail_refs: list[int] = []
        if info.refs:
            flags |= TAIL_REFS
            tail_refs = blob_indexes(tail, info.blob_refs)
        if info.special:
            flags |= TAIL_SPECIAL
        if info.echoes:  # one, the first message: right after the array header
            start = len(array_header(n_rest - first))
            if info.echoes > 1 or base is None or not tail.startswith(ECHO_PACKED, start):
                raise ValueError("misplaced echo in a request tail")
            if not base.flags & HAS_RESPONSE:
                raise ValueError("an echo of a base turn that has no response")
            flags |= TAIL_ECHO
        turn.flags = flags
        turn.build((tail,), n_rest, response, None, record.keys[0])
        finish_tail(turn)
        return tail_refs, response_refs

    def _tokens(self, turn: Turn, side: TurnSide, record: TurnRecord, n_blobs: int) -> None:
        """Prompt, sampled ids and logprobs (packed if tagged "j": LOGPROBS_PACKED)."""
        prompt = turn.prompt = self._prompt(record.prompt)
        sampled = record.sampled
        if sampled is not None:
            sampled = _segment(sampled)
            if not (type(sampled) is tuple or sampled.typecode in "Iq"):
                raise ValueError("bad sampled ids")
        side.sampled = sampled
        turn.full = full_run(prompt, sampled)
        logprobs = record.logprobs
        if logprobs is not None:
            if len(logprobs) != 2:
                raise ValueError("bad logprobs")
            if logprobs[0] == "j":
                self.check(logprobs[1], n_blobs)
                side.logprobs = logprobs[1]
                turn.flags |= LOGPROBS_PACKED
            elif logprobs[0] == "d":
                side.logprobs = decode_segment(logprobs, "d")
            else:
                raise ValueError("bad logprobs")
        spec = record.prompt
        if (
            type(prompt) is ArrayRun
            and spec is not None
            and spec[0] == PromptKind.EXTENDS  # a run of its own, shared with no turn
            and isinstance(prompt.seg, array)
            and packable(prompt.seg, sampled, side.logprobs, prompt.length)
        ):  # as add_turn keeps it: new ids, sampled ids and logprobs in the turn itself
            turn.pack_tokens(prompt.prev, prompt.seg, sampled, side.logprobs)
        elif (
            type(prompt) is ArrayRun
            and spec is not None
            and spec[0] == PromptKind.NEW  # a root's whole prompt
            and packable(_NO_IDS, sampled, side.logprobs, prompt.length)
        ):  # as add_turn keeps a root: no new ids over its prompt's run, the rest packed
            turn.pack_tokens(prompt, _NO_IDS, sampled, side.logprobs)

    def _moves(self, turn: Turn, moves: list[tuple[int, int]]) -> list[tuple[Turn, LinkKind]]:
        """Earlier turns that this one re-linked under itself (a lost one is left out: the
        turn itself is intact)."""
        out: list[tuple[Turn, LinkKind]] = []
        for other_index, link in moves:
            try:
                other = self._ref(other_index)
            except _LostReference:
                continue
            if other is None or not 0 < link <= LinkKind.EXPLICIT or is_above(other, turn):
                raise ValueError("bad move")
            out.append((other, _LINK_KINDS[link]))
        return out

    def _ref(self, index: Any) -> Turn | None:
        """The earlier turn at `index` (its place in the file), or None."""
        if index is None:
            return None
        places, frozen = self.turn_map, self.frozen
        if places is None and frozen is None:
            if not isinstance(index, int) or not 0 <= index < len(self.graph):
                raise ValueError(f"turn reference {index!r} out of range")
            return self.restore.turn(index)
        limit = frozen[0] if frozen is not None else len(places or ())
        if not isinstance(index, int) or index < 0 or (index >= limit and frozen is None):
            raise ValueError(f"turn reference {index!r} out of range")
        turn = None
        if index < limit:
            turn = places[index] if places is not None else self.restore.turn(index)
        if turn is None:
            raise _LostReference(f"it refers to turn record {index}, which was lost")
        return turn

    def _prompt(self, spec: Any) -> TokenRun | None:
        if spec is None:
            return None
        kind = spec[0]
        if kind == PromptKind.SAME and len(spec) == 2:
            other = self._ref(spec[1])
            if other is None or other.prompt is None:
                raise ValueError("prompt reference to a turn without prompt")
            return other.prompt
        if kind == PromptKind.EXTENDS and len(spec) == 3:
            other = self._ref(spec[1])
            if other is None or other.full is None:
                raise ValueError("prompt extends a turn without tokens")
            return ArrayRun(other.full, _segment(spec[2]))
        if kind == PromptKind.NEW and len(spec) == 2:
            return ArrayRun(None, _segment(spec[1]))
        raise ValueError("bad prompt spec")


class _LostReference(ValueError):
    """A record refers to one that was lost to damage (`load(recover=True)` drops it)."""


#: The place of a shared value lost to damage (compared by identity: no record is this).
_LOST_VALUE = bytes.fromhex("c1") + b" lost value"

#: The new ids of a packed root (none: see `_Restorer._tokens`); never changed.
_NO_IDS: array[int] = array("I")


def _segment(spec: Any) -> Any:
    """Token ids of a record; packed ids (beyond 64 bits) are checked before decoding."""
    if isinstance(spec, list) and len(spec) == 2 and spec[0] == "t":
        if not isinstance(spec[1], bytes):
            raise ValueError("bad segment")
        check_int_array(spec[1])
    return decode_segment(spec)


_INT = frozenset({int})
_INT_OR_NONE = frozenset({int, type(None)})
_STR_OR_NONE = frozenset({str, type(None)})


def _check_carried(stored: int, derived: int, carries: bool) -> None:
    """Flags a turn record carries must agree with those derived from its fields: exactly
    for `_FIELD_FLAGS` (where its file carries them), and covering what the fields hold for
    `_CONTENT_FLAGS` (records written before those were derived carry them all)."""
    if carries and derived & _FIELD_FLAGS != stored & _FIELD_FLAGS:
        raise ValueError("the flags of a turn record do not agree with its fields")
    carried = stored & _CONTENT_FLAGS
    if carried and derived & _CONTENT_FLAGS & ~carried:
        raise ValueError("the flags of a turn record do not say what its request holds")


def _is_index(value: Any) -> bool:
    return value is None or (type(value) is int and value >= 0)


def _untyped_record(body: Any) -> TurnRecord:
    """A turn record that msgpack decoded (strings may hold lone surrogates), its fields
    checked to the types `TurnRecord` declares, as msgspec checks them."""
    n_fields = len(TurnRecord._fields)
    if not (isinstance(body, list) and len(body) in (n_fields - 1, n_fields)):
        raise ValueError(f"turn record must be a list of {n_fields} fields")
    record = TurnRecord(*body)
    if type(record.node_id) is not str:
        raise ValueError(f"bad node id {record.node_id!r}")
    if type(record.link) is not int or type(record.flags) is not int:
        raise ValueError("bad link kind or flags")
    meta = record.meta
    if not (isinstance(meta, list) and len(meta) == len(TurnMeta._fields)):
        raise ValueError("bad meta")
    if not set(map(type, meta[:4])) <= _STR_OR_NONE or type(meta[4]) not in _INT_OR_NONE:
        raise ValueError("bad meta")
    positions = (record.parent, record.system, record.base, record.tools, record.sampling)
    if not all(map(_is_index, (*positions, record.requested))):
        raise ValueError("bad reference to an earlier record")
    if type(record.tail) is not bytes or type(record.n_rest) is not int or record.n_rest < 0:
        raise ValueError("bad request tail")
    if record.response is not None and type(record.response) is not bytes:
        raise ValueError("a packed value must be bytes")
    for spec in (record.prompt, record.sampled, record.logprobs):
        if spec is not None and type(spec) is not list:
            raise ValueError("bad token ids or logprobs")
    keys = record.keys
    if not (isinstance(keys, list) and len(keys) == len(IndexKeys._fields)):
        raise ValueError("bad index keys")
    if not {type(keys[0]), type(keys[1]), type(keys[2])} <= _INT_OR_NONE:
        raise ValueError("bad index keys")
    roots = keys[3]
    if roots is not None and not (isinstance(roots, list) and set(map(type, roots)) <= _INT):
        raise ValueError("bad index keys")
    refs, moves = record.refs, record.moves
    if not (isinstance(refs, list) and len(refs) == 2 and all(map(_is_index, refs))):
        raise ValueError("bad reference counts")
    if None in refs or not isinstance(moves, list):
        raise ValueError("bad moves or reference counts")
    for move in moves:
        if not (isinstance(move, list) and len(move) == 2 and _is_index(move[0])):
            raise ValueError("bad move")
        if move[0] is None or type(move[1]) is not int:
            raise ValueError("bad move")
    # the shapes msgspec gives (a meta field is a key of `_Loader.metas`)
    return record._replace(
        meta=tuple(meta), keys=tuple(keys), refs=tuple(refs), moves=[tuple(m) for m in moves]
    )


_Frames = Iterator[tuple[int, memoryview, int, int, int, int]]


def _frames_v1(data: bytes, report: LoadReport) -> _Frames:
    """(kind, payload, offset, record, end, 0) of each version-1 frame whose checksum holds;
    on damage the report says what (and whether it is a torn tail) and stops."""
    reader = FrameReader(data, len(MAGIC))
    try:
        yield from reader.tuples()
    except CorruptFileError as exc:
        report.fail(exc, truncated=reader.cut)


def _frames_v2(
    data: bytes, report: LoadReport, on_gap: Callable[[framing.Gap], bool] | None = None
) -> _Frames:
    """The same for a version-2 file: each frame verified and bound to the one before.

    With `on_gap`, reading goes on past damage at the next frame that verifies (each damaged
    stretch goes to `on_gap` first, unless it was one frame whose header alone was hit: that
    frame is rebuilt and read); `on_gap` returns False to stop there."""
    reader = framing.FrameReader(
        data, len(framing.MAGIC_V2), digest_kinds=_DIGEST_KINDS, max_kind=KIND_TIMELINE
    )
    while True:
        try:
            yield from reader.tuples()
            return
        except CorruptFileError as exc:
            resync = reader.resync
            if resync is None and _out_of_place(data, reader.offset, reader.chain):
                # a whole frame whose place lost frames held (none follows it): damage
                # before it, read on from it, never a torn tail to cut
                resync, reader.cut = reader.offset, False
            if resync is not None:
                resync = _confirmed(data, resync)
            if report.error is None:
                report.fail(exc, truncated=reader.cut)
                report.resync_offset = resync
            if on_gap is None or resync is None:
                return
        gap = framing.read_gap(
            data,
            reader.offset,
            resync,
            reader.chain,
            reader.records,
            digest_kinds=_DIGEST_KINDS,
            max_kind=KIND_TIMELINE,
        )
        report.damaged.append((gap.start, gap.end))
        records = reader.records
        if gap.repaired is not None:
            frame = gap.repaired
            yield frame.kind, frame.payload, frame.offset, frame.record, frame.end, frame.chain
            records += 1
        elif not on_gap(gap):
            return
        else:
            records += len(gap.kinds) if gap.kinds is not None else 1
        chain = framing.HEADER.unpack_from(data, resync)[3]
        reader = framing.FrameReader(
            data, resync, digest_kinds=_DIGEST_KINDS, max_kind=KIND_TIMELINE
        )
        reader.chain, reader.records = chain, records


def _verifies_alone(data: bytes, at: int) -> bool:
    """Whether a whole frame that verifies by itself starts at `at`."""
    found = framing.next_frame(data, at - 1, digest_kinds=_DIGEST_KINDS, max_kind=KIND_TIMELINE)
    return found == at


def _out_of_place(data: bytes, at: int, chain: int) -> bool:
    """Whether the frame at `at`, where reading stopped, is whole but names another frame
    before it than the one read last (`chain`): not the frame before it again."""
    return (
        at + framing.HEADER.size <= len(data)
        and framing.HEADER.unpack_from(data, at)[4] != chain
        and _verifies_alone(data, at)
    )


def _confirmed(data: bytes, at: int) -> int:
    """Where to read on past damage: `at`, the next frame that verifies by itself, unless
    the frame right after it verifies too and names another frame before it: then the frame
    at `at` is not this file's frame in that place (another file's, spliced in) and is
    damage too; the next one is tried. A frame last in the file, or followed by damage, has
    nothing to tell it by: it is read."""
    header = framing.HEADER
    while True:
        _, _, length, _, chain = header.unpack_from(data, at)
        end = at + header.size + length
        if end + header.size > len(data) or header.unpack_from(data, end)[3] == chain:
            return at
        if not _verifies_alone(data, end):
            return at
        at = end


def _decode(payload: memoryview, max_containers: int) -> Any:
    """A record's msgpack body; one long enough to allocate much is walked and bounded first
    (nesting, number of containers), so decoding it costs a bounded multiple of its size."""
    if len(payload) > _SMALL_RECORD:
        check_packed(payload, 0, _RECORD_DEPTH, record=True, max_containers=max_containers)
    return unpack_payload(payload)


class _Records:
    """Applies a file's records, in order, to the loader that the header record makes.

    Blob and value records wait for the turn record after them, so a turn cut short leaves
    nothing of itself behind. `at` is the (offset, index) of the record an error is about.
    """

    def __init__(
        self,
        report: LoadReport,
        version: int,
        path: str,
        store: ContentStore | None,
        cache: StringCache | None,
        check_keys: bool | str = False,
    ) -> None:
        self.report = report
        self.version = version
        self.path = path
        self.store = store
        self.cache = cache
        self.check_keys = check_keys
        self.loader: _Loader | None = None
        self.ended = False
        self.pending: list[tuple[int, Any, int, int]] = []  # (kind, body, offset, record)
        self.at = (0, 0)
        self.at_kind: int = KIND_HEADER  # the kind of the record at `at`
        # `load(recover=True)` of a version-2 file: read on past damage (see `gap`)
        self.resync = check_keys == _REKEY and version >= 2
        self.kept_mark: tuple[int, int, int] = (0, 0, 0)  # blobs when the last turn was kept

    def gap(self, gap: framing.Gap) -> bool:
        """Damaged frames read past (`_frames_v2`): the records that waited for a turn are
        read, then each lost record keeps its place, so that later references stay right. A
        stretch of unknown content leaves every later record's place unknown (`freeze`):
        only turns that refer to nothing after it are kept. False: stop (no header)."""
        loader = self.loader
        if loader is None:
            return False
        try:
            self.apply_pending(loader)
        except StoreError:
            raise
        except Exception:  # an intact record that does not check: stop, as at any such one
            return False
        if gap.kinds is None:
            loader.freeze()
            self.report.lost_unknown = True
            return True
        report = self.report
        for kind in gap.kinds:
            if kind == KIND_END:
                self.ended = True
            elif kind != KIND_HEADER:
                loader.lose(kind)
                report.lost_turns += kind == KIND_TURN
                report.meta_records_lost += kind == KIND_META
                report.timeline_records_lost += kind == KIND_TIMELINE
        return True

    def apply(self, kind: int, payload: memoryview, start: int, record: int) -> None:
        self.at, self.at_kind = (start, record), kind
        if kind == KIND_BLOB:
            body: Any = payload
        elif kind == KIND_TURN:  # decoded by the loader, once bounded
            # a turn holds at most its fixed containers plus one per earlier turn moved
            if len(payload) > _SMALL_RECORD:
                check_packed(
                    payload, 0, _RECORD_DEPTH, record=True, max_containers=16 + self.report.turns
                )
            body = payload
        elif kind == KIND_META:  # one container an annotation: bounded by the record's size
            body = _decode(payload, len(payload))
        else:
            body = _decode(payload, 16 + self.report.turns)
        if self.ended:
            raise ValueError("records after the end record")
        if record == 0:
            self.loader, self.report.mode = _read_header(
                kind,
                body,
                start,
                self.version,
                self.path,
                self.store,
                self.cache,
                self.check_keys,
            )
            return
        loader = self.loader
        if loader is None or kind == KIND_HEADER:
            raise ValueError("a second header record")
        if kind in (KIND_BLOB, KIND_VALUE, KIND_BLOB_REF):
            self.pending.append((kind, body, start, record))
        elif kind == KIND_TURN:
            mark = loader.mark()
            loader.node_id = None
            try:
                drift = self.apply_pending(loader)
                self.at, self.at_kind = (start, record), kind
                loader.turn(body, start, record)
            except _LostReference as exc:
                # (only past damage) dropped, its place kept; the blobs and values read with
                # it stay: they are intact, and a later turn may refer to them
                loader.unfiled.clear()
                loader.lose(KIND_TURN)
                self.report.dropped.append(DroppedTurn(loader.node_id, record, start, str(exc)))
                return
            except BaseException:
                loader.rollback(mark)
                raise
            if drift is not None:
                loader.restore.add_drift(drift)
            self.report.turns += 1
            if self.resync:
                self.kept_mark = loader.graph.blobs.mark()
        elif kind == KIND_DRIFT:  # the turn record after it holds its turn
            if self.version == _V1 or any(p[0] == KIND_DRIFT for p in self.pending):
                raise ValueError("a drift record out of place")
            places = loader.places()
            if places is None:
                # past a stretch of unknown content the drifted turn's place is unknown:
                # its audit entry cannot be checked against it (the turn itself is kept)
                self.report.drifts_lost += 1
                return
            drift = Drift.from_record(body, places)
            parent = loader.kept_index(drift.parent)
            if parent is None:  # the would-be parent was lost: the entry names nothing kept
                self.report.drifts_lost += 1
                return
            # past damage places are mapped to indexes; the turn is the next one kept
            drift = drift._replace(turn=self.report.turns, parent=parent)
            self.pending.append((kind, drift, start, record))
        elif kind == KIND_META:
            if self.pending or self.version == _V1:
                raise ValueError("a meta record out of place (between a turn's records)")
            contains = loader.graph.__contains__
            if loader.lossy:
                # past damage a leaf reward may name a turn that was lost: it is left out
                # (and reported), the rest of the metadata kept
                body = _without_lost_rewards(body, contains, self.report)
            meta = GraphMeta.from_record(
                body, contains, partial(check_packed, n_blobs=0, max_depth=MAX_DEPTH)
            )
            loader.restore.set_metadata(meta)
        elif kind == KIND_TIMELINE:
            if self.pending or self.version == _V1:
                raise ValueError("a timeline record out of place (between a turn's records)")
            places = loader.places()
            # (past a stretch of unknown content the places read are unknown: any is taken)
            timelines = _timeline_record(body, (1 << 32) if places is None else places)
            for place, packed in timelines:
                # past damage a turn keeps its place in the file, not its index
                index = loader.kept_index(place)
                if index is None:
                    self.report.timelines_lost += 1
                else:
                    loader.restore.set_timeline(index, packed)
        elif kind == KIND_END:
            self.ended = True
            if self.resync and (loader.lossy or self.pending):
                return  # its counts are of the records written, not of those read
            _check_end(body, self.pending, self.report)
            loader.graph.blobs.count_references(*body["references"])
        else:
            raise ValueError(f"unknown record kind {kind}")

    def apply_pending(self, loader: _Loader) -> Drift | None:
        """The blobs and values that waited for the turn record now read; the turn's drift
        record, if one waited too (the caller files it once the turn is). Recovering, a
        blob whose object the content store lacks or has damaged is lost (its place kept:
        the turns that use it are dropped, not the rest), and so is a value that refers to a
        lost blob."""
        drift = None
        for kind, body, start, record in self.pending:
            self.at, self.at_kind = (start, record), kind  # an error names this record
            if kind == KIND_DRIFT:
                drift = body
                continue
            try:
                self.apply_one(loader, kind, body, start, record)
            except _LostReference:
                loader.lose(kind)
            except StoreObjectError as exc:
                if not self.resync:
                    raise
                loader.lose(kind)
                if self.report.error is None:
                    self.report.fail(exc)
        self.pending.clear()
        return drift

    def apply_one(self, loader: _Loader, kind: int, body: Any, start: int, record: int) -> None:
        if kind == KIND_BLOB and self.version != _V1:
            loader.blob_v2(body)
        elif kind == KIND_BLOB_REF:
            loader.blob_ref(body, start, record)
        elif kind != KIND_BLOB:
            loader.value(body)
            return
        else:
            loader.blob(body, start, record)
        self.report.blobs += 1
        if loader.blob_map is not None:  # (recovering past damage)
            loader.placed_blob()

    def finish(self) -> _Loader:
        """Damage only the end of the file shows; the loader (an empty one if none)."""
        report = self.report
        if report.error is None:
            if self.loader is None:
                report.fail(CorruptFileError("no header record", offset=len(MAGIC)), truncated=True)
            elif self.pending:
                message = "file ends after the blobs of a turn whose record is missing"
                report.fail(CorruptFileError(message, offset=report.good_bytes), truncated=True)
            elif report.mode == MODE_SNAPSHOT and not self.ended:
                message = "snapshot ends before its end record"
                report.fail(CorruptFileError(message, offset=report.file_size), truncated=True)
            elif self.loader.key_check is not None and not self.loader.rekey:
                try:
                    self.loader.key_check.finish()
                except CorruptFileError as exc:
                    report.fail(exc)
        if self.loader is not None and self.loader.rekey and self.loader.key_check is not None:
            report.keys_recomputed = self.loader.key_check.finish_rekeyed()
            report.unkeyed = self.loader.key_check.unkeyed
        if self.resync and self.loader is not None:
            # blobs read for turns dropped after the last kept one: no turn refers to them
            blobs = self.loader.graph.blobs
            if blobs.mark()[0] > self.kept_mark[0]:
                blobs.rollback(self.kept_mark)
        return self.loader if self.loader is not None else _Loader(None)


def _scan(
    data: bytes,
    path: str,
    progress: Callable[[int], None] | None = None,
    store: ContentStore | None = None,
    cache: StringCache | None = None,
    check_keys: bool | str = False,
) -> tuple[_Loader, LoadReport]:
    """Read frames until the end or the first damage; never raises for damage (a content
    store that cannot be reached is not damage: its error propagates). `check_keys`: each
    turn's index keys are checked against those its content gives (True: `verify`), or
    recomputed and used (`_REKEY`: `load(recover=True)`; see `key_check`)."""
    size = len(data)
    report = LoadReport(path, size, 0, 0, 0, 0)
    head = bytes(data[: len(MAGIC)])
    version = _MAGICS.get(head)
    if version is None:
        report.fail(CorruptFileError("not a rollout_store file (bad magic)", offset=0))
        report.truncated = (
            size < len(MAGIC) and any(m.startswith(head) for m in _MAGICS)
        ) or not data.strip(b"\0")
        return _Loader(None), report
    report.version = version
    records = _Records(report, version, path, store, cache, check_keys)
    if version == _V1:
        frames = _frames_v1(data, report)
    else:
        frames = _frames_v2(data, report, records.gap if records.resync else None)
    for kind, payload, start, record, end, chain in frames:
        try:
            records.apply(kind, payload, start, record)
        except (CorruptFileError, MissingStoreObjectError) as exc:
            # (an object missing from the store is no damage in the file: the report says
            # which, and `load` raises it as it is, a `MissingObjectError`)
            report.fail(exc)
            break
        except StoreError:  # the store is down or missing: not damage in the file
            raise
        except Exception as exc:  # anything a damaged payload provokes
            at, index = records.at  # (a turn's blob or value record, applied with it)
            kind_name = KIND_NAMES.get(records.at_kind, f"kind {records.at_kind}")
            report.fail(
                CorruptFileError(f"invalid {kind_name} record: {exc}", offset=at, record=index)
            )
            break
        report.records = record + 1
        if not records.pending and report.error is None:
            report.good_bytes, report.good_chain = end, chain
        if progress is not None:
            progress(end)
    return records.finish(), report


def timeline_payload(timelines: list[tuple[int, bytes]]) -> bytes:
    """A `timeline` record: [turn numbers (u32 LE each), their packed timelines]."""
    numbers = array("I", (index for index, _ in timelines))
    if sys.byteorder != "little":
        numbers.byteswap()
    return pack([numbers.tobytes(), b"".join(packed for _, packed in timelines)])


def _timeline_record(body: Any, turns: int) -> list[tuple[int, bytes]]:
    """The (turn number, packed timeline) pairs of a `timeline` record (ValueError if it is
    not one, or names a turn not before it)."""
    if not (
        isinstance(body, list)
        and len(body) == 2
        and isinstance(body[0], bytes)
        and isinstance(body[1], bytes)
        and len(body[0]) % 4 == 0
        and len(body[1]) == len(body[0]) // 4 * TIMELINE_SIZE
    ):
        raise ValueError("a timeline record is not [turn numbers, packed timelines]")
    numbers = array("I", body[0])
    if sys.byteorder != "little":
        numbers.byteswap()
    out = []
    for i, index in enumerate(numbers):
        if index >= turns:
            raise ValueError(f"a timeline record names turn {index}, not one before it")
        packed = body[1][i * TIMELINE_SIZE : (i + 1) * TIMELINE_SIZE]
        Timeline.unpack(packed)  # raises InvalidValueError (a ValueError) on a bad one
        out.append((index, packed))
    return out


def _without_lost_rewards(body: Any, known: Callable[[str], bool], report: LoadReport) -> Any:
    """A `meta` record's payload without the leaf rewards naming a turn the graph lacks
    (noted in `report.rewards_lost`: the last such record gives the metadata, so its lost
    rewards are those reported); a payload of another shape is returned as it is, for
    `GraphMeta.from_record` to refuse."""
    report.rewards_lost = []
    if not isinstance(body, dict) or not isinstance(body.get("rewards"), list):
        return body
    kept = []
    for item in body["rewards"]:
        named = isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
        if named and not known(item[0]):
            report.rewards_lost.append(item[0])
            continue
        kept.append(item)
    return {**body, "rewards": kept}


def _check_end(body: Any, pending: list[Any], report: LoadReport) -> None:
    counts = {"turns": report.turns, "blobs": report.blobs}
    if pending or not isinstance(body, dict) or body.keys() != {*counts, "references"}:
        raise ValueError("end record does not match the records before it")
    if any(body[k] != v for k, v in counts.items()):
        raise ValueError("end record does not match the records before it")
    references = body["references"]
    if not (
        isinstance(references, list)
        and len(references) == 2
        and all(type(r) is int and r >= 0 for r in references)
    ):
        raise ValueError("bad reference counts in the end record")


def _read_header(
    kind: int,
    body: Any,
    start: int,
    magic_version: int,
    path: str = "",
    store: ContentStore | None = None,
    cache: StringCache | None = None,
    check_keys: bool | str = False,
) -> tuple[_Loader, str]:
    if kind != KIND_HEADER or not isinstance(body, dict):
        raise ValueError("the first record is not a header")
    if body.get("format") != "rollout_store":
        raise ValueError("not a rollout_store file")
    version = body.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise UnsupportedVersionError(
            f"format version {version!r} is not supported (this library reads versions 1 to "
            f"{FORMAT_VERSION}; a newer rollout_store wrote it)",
            offset=start,
            record=0,
        )
    if version != magic_version:
        raise ValueError(f"a version {version} header in a version {magic_version} file")
    if version >= 2 and type(body.get("file_id")) is not int:
        raise ValueError("a version 2 header without its file id")
    mode = body.get("mode")
    if mode not in (MODE_LOG, MODE_SNAPSHOT):
        raise ValueError(f"unknown file mode {mode!r}")
    threshold = body.get("share_threshold")
    if threshold is not None and (not isinstance(threshold, int) or threshold < 1):
        raise ValueError("bad share_threshold")
    blobs = body.get("blobs", BLOBS_INLINE)
    if blobs not in (BLOBS_INLINE, BLOBS_STORE) or (blobs == BLOBS_STORE and version < 2):
        raise ValueError(f"unknown blob mode {blobs!r}")
    if blobs == BLOBS_STORE and store is None:
        raise StoreRequiredError(
            f"{path} keeps its long strings in a content store: read it with store=..."
        )
    derived = body.get("derived_flags", False)
    if derived is not False and (derived is not True or version < 2):
        raise ValueError(f"bad derived_flags {derived!r}")
    rekey = version == _V1 or check_keys == _REKEY
    loader = _Loader(threshold, store, cache, bool(check_keys) or rekey)
    loader.rekey = rekey
    loader.writer.blobs_mode = blobs
    # records of a file without it carry the flags their fields give: so do those appended
    loader.carries_flags = loader.writer.carry_flags = not derived
    return loader, mode


def _read(path: str | os.PathLike[str]) -> bytes:
    """The whole file: frames are checked in place, as views of these bytes."""
    with open(path, "rb") as fp:
        return fp.read()


def needs_store(path: str | os.PathLike[str]) -> bool:
    """Whether the file keeps its long strings in a content store (saved with
    ``blobs="store"``): its header record says so. False for a file whose header cannot be
    read (reading it says why)."""
    with open(path, "rb") as fp:
        data = fp.read(_HEADER_READ)
    version = _MAGICS.get(bytes(data[: len(MAGIC)]))
    if version is None:
        return False
    report = LoadReport(os.fspath(path), len(data), 0, 0, 0, 0)
    frames = _frames_v1(data, report) if version == _V1 else _frames_v2(data, report)
    records = _Records(report, version, os.fspath(path), None, None)
    for kind, payload, start, record, _, _ in frames:
        try:
            records.apply(kind, payload, start, record)
        except StoreRequiredError:
            return True
        except Exception:  # damage: the command reading the file reports it
            return False
        break
    return False


#: Bytes `needs_store` reads: a header record is far smaller.
_HEADER_READ = 1 << 16


def _raise_for(report: LoadReport, advice: str = "") -> None:
    exc = report.exception or CorruptFileError("damaged file")
    if advice:  # the same error (class and attributes), its message saying what to do
        told = type(exc).__new__(type(exc), f"{exc}; {advice}")
        told.__dict__.update(exc.__dict__)
        exc = told
    raise exc


def _reopen_advice(report: LoadReport, target: Path) -> str:
    """What to do about a log that cannot be opened for appending as it is."""
    if report.truncated:  # nothing intact follows the damage
        return (
            f"a torn tail (a crash while writing): open it with repair=True, or run "
            f"`rollout-store repair {target}`, to cut it off and append after the intact records"
        )
    return (
        f"intact records follow the damage, so the log is not opened: appending would leave "
        f"them behind it. `rollout-store repair --rewrite {target}` rewrites it in place with "
        f"every intact turn, or `rollout-store recover {target} -o NEW` saves them to a new file"
    )


def verify(
    path: str | os.PathLike[str],
    progress: Callable[[int], None] | None = None,
    *,
    store: ContentStore | None = None,
) -> LoadReport:
    """Check every frame, blob digest and reference of a file, and recompute every index key
    its turn records carry from their content (`key_check`: a mismatch is an
    `IndexKeyMismatch`); never raises for damage (a file of store references needs its
    `store`, whose objects are checked too). `load` trusts the keys."""
    return _scan(_read(path), os.fspath(path), progress, store, check_keys=True)[1]


def load(
    path: str | os.PathLike[str],
    *,
    recover: bool = False,
    progress: Callable[[int], None] | None = None,
    store: ContentStore | None = None,
    cache: StringCache | None = None,
) -> RolloutGraph:
    """Read a rollout file. Damage raises `CorruptFileError` naming its offset.

    With `recover=True` every intact turn is loaded instead, and `graph.load_report` says
    where the file was cut or damaged. In a version-2 file reading goes on past damage, at
    the next frame that verifies: a turn is kept when its own record and every record it
    refers to (its parent, its base, the turn whose tokens it extends, its shared values and
    blobs) are intact; one whose referent was lost is dropped and listed in the report's
    `dropped` (`damaged`, `lost_turns` and `lost_unknown` say what the damage held). A
    version-1 file keeps the turns before its first damage. Each turn's index keys are
    then recomputed from its content rather than trusted (`keys_recomputed` in the report
    counts the turns whose records named others), so saving the graph repairs a file that
    `verify` refuses with `IndexKeyMismatch`. A version-1 file's keys, of an earlier scheme,
    are always recomputed. A turn whose keys cannot be recomputed is kept all the same, under
    the keys its record names, and listed in the report's `unkeyed`.

    `store`: the graph keeps its long strings in this content store (and `cache`, see
    `RolloutGraph`). Required for a file saved with ``blobs="store"`` (else
    `StoreRequiredError`): each referenced object is fetched and verified. An object the
    store does not have raises `MissingStoreObjectError` (a `MissingObjectError`: the file is
    intact, the store is likely the wrong one), a damaged one `DamagedStoreObjectError` (a
    `CorruptFileError`), each naming its key and the record's offset. A
    self-contained file read with a store puts its strings into it.
    """
    rekey = _REKEY if recover else False
    loader, report = _scan(_read(path), os.fspath(path), progress, store, cache, rekey)
    if report.error is not None and not (recover and report.records > 0):
        _raise_for(report)
    loader.graph.load_report = report
    return loader.graph


def rewrite_intact(
    path: str | os.PathLike[str], *, store: ContentStore | None = None
) -> LoadReport:
    """Rewrite a damaged file in place with every turn `load(path, recover=True)` keeps: a
    log as a log (appendable again), a snapshot as a snapshot, each long string kept as the
    file kept it (inline, or as store references: pass its `store`). The new file replaces
    the old one atomically (temporary file, fsync, rename; refused while a graph appends to
    it); the damaged bytes are gone. Returns the report of the recovering read (what was
    lost and dropped). A file with no turn to keep raises `CorruptFileError`."""
    target = Path(path)
    loader, report = _scan(_read(target), os.fspath(target), None, store, None, _REKEY)
    if report.error is not None and report.records == 0:
        _raise_for(report)
    graph, blobs = loader.graph, loader.writer.blobs_mode
    if report.mode == MODE_SNAPSHOT:
        save(graph, target, blobs=blobs)
        return report

    def write(fp: IO[bytes]) -> None:
        writer = _Writer(blobs=blobs)
        out = _Gather(fp.fileno())
        out.add([writer.header(graph, MODE_LOG)])
        for entry in graph.journal_entries():
            frames, commit = writer.turn_frames(graph.blobs, entry)
            out.add(frames)
            commit()
        # what the kept turns carry beside themselves, as a save writes it (a log reads one
        # record of many timelines, and its last meta record, as it reads a snapshot's)
        chain = [writer.chain]
        timelines = graph.timeline_records()
        if timelines:
            out.add([writer.frame(KIND_TIMELINE, timeline_payload(timelines), chain)])
        if not graph.meta.empty:
            out.add([writer.frame(KIND_META, pack(graph.meta.to_record()), chain)])
        writer.chain = chain[0]
        out.flush()

    with graph.lock:
        replace_file(target, write)
    return report


class _AppendLog:
    """The journal of a graph opened with `open_append`: one write per turn."""

    def __init__(
        self, fp: IO[bytes], path: str, blobs: BlobTable, writer: _Writer, fsync_every: int
    ) -> None:
        self.fp = fp
        self._path: str | None = path
        self.blobs = blobs
        self.writer = writer
        self.fsync_every = fsync_every
        self.unsynced = 0
        self.held = 0  # `hold_sync` blocks open: their writes are synced when the last ends
        self.timelines: list[tuple[int, bytes]] = []  # not yet written (`write_timeline`)
        # where the file ends: this log is its only writer, so a write need not ask the
        # system (a call that lets the GIL go, which under load costs more than the write);
        # None after a failed write that could not be undone: asked again then
        self.size: int | None = None

    @property
    def path(self) -> str | None:
        return self._path

    def append(self, entry: JournalEntry) -> None:
        frames, commit = self.writer.turn_frames(self.blobs, entry)
        self._write(frames)
        commit()

    def _write(self, frames: list[Part], sync: bool = True) -> None:
        """Write `frames` with one call (fsync by policy, or left to the next synced write
        and `close` if not `sync`), or leave the file as it was."""
        fd = self.fp.fileno()
        size = self.size
        if size is None:
            size = os.lseek(fd, 0, os.SEEK_END)
        try:
            data = b"".join(frames)
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            self.size = size + len(data)
            self.unsynced += 1
            if sync and not self.held and self.fsync_every and self.unsynced >= self.fsync_every:
                os.fsync(fd)
                self.unsynced = 0
        except BaseException as exc:
            # leave the file exactly as it was before this turn
            self.size = None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
                os.lseek(fd, size, os.SEEK_SET)
                self.size = size
            if isinstance(exc, OSError):
                raise write_error(exc, self._path or "the append log") from exc
            raise

    def hold_sync(self) -> None:
        self.held += 1

    def release_sync(self) -> None:
        self.held -= 1
        if self.held or not self.fsync_every or self.unsynced < self.fsync_every:
            return
        try:
            os.fsync(self.fp.fileno())
        except OSError as exc:  # the writes stay: the next synced write or `close` tries again
            path = self._path or "the append log"
            raise FileSyncError(
                exc.errno or 0,
                f"{exc.strerror or exc}: syncing {path} failed; what was written is kept and "
                "synced again by the next synced write or close",
            ) from exc
        self.unsynced = 0

    def write_meta(self, meta: GraphMeta) -> None:
        if self.writer.version == _V1:
            raise InvalidArgumentError(
                "a version-1 log holds no metadata: save the graph (version 2) and open the copy"
            )
        chain = [self.writer.chain]
        self._write([self.writer.frame(KIND_META, pack(meta.to_record()), chain)])
        self.writer.chain = chain[0]

    def write_timeline(self, index: int, packed: bytes) -> None:
        """Timelines are written in batches of `TIMELINE_BATCH` (and when the log closes):
        a record's 26-byte frame header is shared by the batch."""
        if self.writer.version == _V1:
            raise InvalidArgumentError(
                "a version-1 log holds no timelines: save the graph (version 2) and open the copy"
            )
        self.timelines.append((index, packed))
        if len(self.timelines) >= TIMELINE_BATCH:
            self._write_timelines()

    def _write_timelines(self) -> None:
        chain = [self.writer.chain]
        frame = self.writer.frame(KIND_TIMELINE, timeline_payload(self.timelines), chain)
        self._write([frame], sync=False)
        self.writer.chain = chain[0]
        self.timelines = []

    def close(self) -> None:
        self._path = None
        if self.fp.closed:
            return
        try:
            if self.timelines:
                self._write_timelines()
        except OSError:  # a FileWriteError: the turns are written, only their last
            pass  # timings are lost
        try:
            if self.unsynced:
                os.fsync(self.fp.fileno())
        finally:
            self.fp.close()


def _fsync_policy(fsync: str | int) -> int:
    if fsync == "turn":
        return 1
    if fsync == "never":
        return 0
    if isinstance(fsync, int) and not isinstance(fsync, bool) and fsync >= 1:
        return fsync
    raise InvalidArgumentError("fsync must be 'turn', 'never' or a positive int (every N turns)")


def open_append(
    path: str | os.PathLike[str],
    *,
    share_threshold: int | None = 1024,
    fsync: str | int = "turn",
    repair: bool = False,
    store: ContentStore | None = None,
    cache: StringCache | None = None,
    blobs: str = "inline",
) -> RolloutGraph:
    """A graph that writes each turn to `path` as it is added (created if missing, with
    mode 0600, as every file the library writes).

    An existing file is loaded first; if its last record is cut short (a crash while
    writing), `repair=True` truncates it to the last complete record, else it raises. Intact
    records are never cut: a log damaged before intact records is refused (`CorruptFileError`
    naming the damage and `rollout-store repair --rewrite`, which rewrites it with every
    intact turn; see `rewrite_intact`), even with `repair=True`.

    `store`, `cache`: the graph's content store (see `RolloutGraph`). `blobs="store"` makes
    a new log write references into the store instead of the strings; an existing log keeps
    the mode it was created with (a log of references needs `store`).
    """
    every = _fsync_policy(fsync)
    mode = _blobs_mode(blobs)
    if mode == BLOBS_STORE and store is None:
        raise InvalidArgumentError('open(blobs="store") needs a content store: pass store=...')
    target = Path(path)
    fp = _open_locked(target)
    try:
        resumed = _resume(fp, target, repair, store, cache)
        if resumed is None:
            graph = RolloutGraph(share_threshold=share_threshold, store=store, cache=cache)
            writer = _start_log(fp, target, graph, mode)
        else:
            graph, writer = resumed
        fp.seek(0, os.SEEK_END)
    except BaseException:
        fp.close()
        raise
    graph.attach_journal(_AppendLog(fp, os.path.realpath(target), graph.blobs, writer, every))
    return graph


def _open_locked(target: Path) -> IO[bytes]:
    """`target` opened for appending (created if missing) under the appender's lock."""
    while True:
        # unbuffered: the log is read whole once and written with os.write, so a buffer
        # (4-8 KiB a session, for as long as the log is open) would serve nothing
        # created with FILE_MODE: a log holds content (see `atomic`)
        fd = create_private(target, os.O_RDWR | os.O_APPEND)
        fp = os.fdopen(fd, "a+b", buffering=0)  # owned by the returned graph
        try:
            if lock_log(fp, target):
                return fp
        except BaseException:
            fp.close()
            raise
        fp.close()  # a save replaced the file between open and lock: open the new one


def _resume(
    fp: IO[bytes],
    target: Path,
    repair: bool,
    store: ContentStore | None,
    cache: StringCache | None,
) -> tuple[RolloutGraph, _Writer] | None:
    """The graph of an existing log and a writer that extends it, or None for an empty file
    (or one torn inside its header and repaired to nothing). A torn tail raises, or is cut
    off with `repair`."""
    fp.seek(0)
    data = fp.read()
    if not data:
        return None
    loader, report = _scan(data, os.fspath(target), None, store, cache)
    del data
    if report.mode == MODE_SNAPSHOT:
        raise CorruptFileError(f"{target} is a snapshot written by save(), not a log")
    if report.error is not None:
        if not (repair and report.truncated):
            _raise_for(report, _reopen_advice(report, target))
        # repair: cut the torn tail (a file torn inside its header starts anew)
        keep = report.good_bytes if report.records > 0 else 0
        os.ftruncate(fp.fileno(), keep)
        os.fsync(fp.fileno())
        if not keep:
            return None
    graph = loader.graph
    graph.load_report = report
    writer = loader.writer
    writer.version = report.version or FORMAT_VERSION  # a version-1 log stays one
    writer.chain = report.good_chain
    writer.blobs_written = len(graph.blobs)
    writer.refs = graph.blobs.mark()[1:]
    return graph, writer


def _start_log(fp: IO[bytes], target: Path, graph: RolloutGraph, blobs: str) -> _Writer:
    """Write the header of a new log, durably; the writer that continues it."""
    writer = _Writer(blobs=blobs)
    fd, view = fp.fileno(), memoryview(writer.header(graph, MODE_LOG))
    while view:  # the file is unbuffered: a write may take part of it
        view = view[os.write(fd, view) :]
    os.fsync(fd)
    fsync_dir(target)
    return writer


class RolloutGraph(Graph):
    """Turns of one or many rollouts, with memory proportional to unique content.

    `share_threshold`: strings of at least this many characters are stored once in the
    graph's blob table (`None` disables string sharing; messages and tokens are still
    shared). Safe to use from many threads: `add_turn` is serialized by a lock.

    The in-memory `Graph` plus its files: `save`, `load` and `open`. It is defined here, in
    the file layer, so that the graph below never imports the module that stores it.
    """

    def save(self, path: str | os.PathLike[str], *, blobs: str = "inline") -> None:
        """Write the graph to `path` atomically (temporary file, fsync, rename), with mode
        0600 (only its owner reads it: it holds the rollout's content), as every file the
        library writes, logs included.

        `blobs="store"`: long strings as references into the graph's content store."""
        save(self, path, blobs=blobs)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        recover: bool = False,
        progress: Callable[[int], None] | None = None,
        store: ContentStore | None = None,
        cache: StringCache | None = None,
    ) -> RolloutGraph:
        """Read a file written by `save` or `open`; see `storage.load`."""
        return load(path, recover=recover, progress=progress, store=store, cache=cache)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        share_threshold: int | None = 1024,
        fsync: str | int = "turn",
        repair: bool = False,
        store: ContentStore | None = None,
        cache: StringCache | None = None,
        blobs: str = "inline",
    ) -> RolloutGraph:
        """A graph that appends every added turn to `path` durably; see `open_append`.

        `fsync`: "turn" (every turn), an int N (every N turns) or "never". Close it (or use
        it as a context manager) to flush the last turns. `store`, `cache`, `blobs`: a log
        over a content store, as for `save` and `load`.
        """
        return open_append(
            path,
            share_threshold=share_threshold,
            fsync=fsync,
            repair=repair,
            store=store,
            cache=cache,
            blobs=blobs,
        )

    def __enter__(self) -> RolloutGraph:
        return self

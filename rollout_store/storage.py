"""The rollout file: framed, checksummed msgpack records, each blob once, turns as references.

A file is a magic string and a sequence of frames (kind, length, checksum, payload). Saving
writes a temporary file, fsyncs and renames it; append mode writes one turn's frames with one
write call and fsyncs by policy. Loading checks every frame and every blob digest and stops
at the first damaged or short frame, naming its offset. The format is described in README.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import IO, Any, NamedTuple

from .blobs import BlobTable, content_digest
from .errors import (
    ChecksumMismatch,
    CorruptFileError,
    FileLockedError,
    UnsupportedVersionError,
)
from .frames import (
    BLOB_PREFIX,
    FORMAT_VERSION,
    FRAME,
    KIND_BLOB,
    KIND_END,
    KIND_HEADER,
    KIND_NAMES,
    KIND_TURN,
    KIND_VALUE,
    MAGIC,
    MODE_LOG,
    MODE_SNAPSHOT,
    PackedChecker,
    blob_frame,
    checksum,
    decode_segment,
    encode_segment,
    frame,
    pack,
    unpack_payload,
)
from .graph import Graph, GraphRestorer, JournalEntry
from .intake import token_array
from .tokens import TokenRun, run_list
from .turns import (
    ECHO_PACKED,
    NO_MESSAGES,
    TAIL_ECHO,
    TAIL_SLOW,
    IndexKeys,
    LinkKind,
    Turn,
    TurnMeta,
    finish_tail,
    full_run,
    is_above,
)

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "LoadReport",
    "PromptKind",
    "RolloutGraph",
    "TurnRecord",
    "load",
    "open_append",
    "save",
    "verify",
]


class PromptKind(IntEnum):
    """How a turn record gives its prompt tokens."""

    SAME = 0  # [SAME, turn]: the very prompt of an earlier turn
    EXTENDS = 1  # [EXTENDS, turn, segment]: an earlier turn's prompt + sampled, then more
    NEW = 2  # [NEW, segment]: the tokens whole


class TurnRecord(NamedTuple):
    """The payload of a turn frame: an array of these 19 fields, in this order.

    Files written before `requested` existed have the first 18; it reads as None.

    Written by `_Writer.turn_frames` and read by `_Loader.turn`. Turns, values and blobs
    are referred to by their position in the file.
    """

    node_id: str
    parent: int | None  # an earlier turn (a later parent re-links its child by `moves`)
    link: int  # LinkKind, 0 without parent
    flags: int  # Turn.flags without the derived bits
    meta: list[Any]  # TurnMeta as an array
    system: int | None  # value holding the leading system messages
    base: int | None  # the turn whose request this one extends
    tail: bytes  # packed request messages after the base's
    n_rest: int  # number of non-system request messages
    response: bytes | None
    tools: int | None  # value
    sampling: int | None  # value
    prompt: list[Any] | None  # [PromptKind, ...]
    sampled: list[Any] | None  # segment
    logprobs: list[Any] | None  # segment, or ["j", packed JSON value]
    keys: list[Any]  # IndexKeys as an array
    refs: list[int]  # blob references and their bytes since the previous turn record
    moves: list[list[int]]  # [turn, link] of earlier turns re-linked under this one
    requested: int | None = None  # value holding requested_sampling_params


#: Bits of Turn.flags that are derived on load, never written.
_DERIVED_FLAGS = TAIL_SLOW


# ---------------------------------------------------------------- writing


class _Writer:
    """What has been written so far, so each turn record refers back instead of copying."""

    def __init__(self) -> None:
        self.blobs_written = 0
        self.values: dict[int, int] = {}  # id(stored value bytes) -> ordinal
        self.value_objects: list[bytes] = []  # keeps the ids above valid
        self.prompt_of: dict[int, int] = {}  # id(TokenRun) -> index of a turn whose prompt it is
        self.full_of: dict[int, int] = {}  # id(TokenRun) -> index of a turn whose full it is
        self.refs = (0, 0)  # blob references and their bytes counted so far

    def blob_frames(self, blobs: BlobTable, end: int) -> list[bytes]:
        frames: list[bytes] = []
        for index in range(self.blobs_written, end):
            data = blobs.string(index).encode("utf-8", "surrogatepass")
            frames.extend(blob_frame(blobs.handle(index).digest, data))
        return frames

    def turn_frames(
        self, blobs: BlobTable, entry: JournalEntry
    ) -> tuple[list[bytes], Callable[[], None]]:
        """Frames (as byte parts) for the turn's new blobs, new values and the turn itself,
        and a function to call once they are written."""
        turn, blobs_end = entry.turn, entry.blobs_end
        refs = self.refs if entry.references is None else entry.references
        frames = self.blob_frames(blobs, blobs_end)
        new_values: list[bytes] = []

        def value_ref(stored: bytes | None) -> int | None:
            if stored is None:
                return None
            ordinal = self.values.get(id(stored))
            if ordinal is None:
                for i, pending in enumerate(new_values):
                    if pending is stored:
                        return len(self.value_objects) + i
                new_values.append(stored)
                frames.append(frame(KIND_VALUE, pack(stored)))
                return len(self.value_objects) + len(new_values) - 1
            return ordinal

        parent = turn.parent
        parent_index = parent.index if parent is not None and parent.index < turn.index else None
        record = TurnRecord(
            node_id=turn.node_id,
            parent=parent_index,
            link=int(turn.link) if parent_index is not None else 0,
            flags=turn.flags & ~_DERIVED_FLAGS,
            meta=list(turn.meta),
            system=value_ref(turn.system),
            base=turn.base.index if turn.base is not None else None,
            tail=turn.tail,
            n_rest=turn.n_rest,
            response=turn.response,
            tools=value_ref(turn.tools),
            sampling=value_ref(turn.sampling),
            prompt=self._prompt_spec(turn),
            sampled=encode_segment(turn.sampled),
            logprobs=encode_segment(turn.logprobs)
            if isinstance(turn.logprobs, array)
            else (["j", turn.logprobs] if turn.logprobs is not None else None),
            keys=list(entry.keys),
            refs=[refs[0] - self.refs[0], refs[1] - self.refs[1]],
            moves=[[other.index, int(link)] for other, link in entry.moves],
            requested=value_ref(turn.requested),
        )
        frames.append(frame(KIND_TURN, pack(list(record))))

        def commit() -> None:
            self.blobs_written = blobs_end
            for stored in new_values:
                self.values[id(stored)] = len(self.value_objects)
                self.value_objects.append(stored)
            self.refs = refs
            self.note_runs(turn)

        return frames, commit

    def note_runs(self, turn: Turn) -> None:
        if turn.prompt is not None:
            self.prompt_of.setdefault(id(turn.prompt), turn.index)
        if turn.full is not None:
            self.full_of.setdefault(id(turn.full), turn.index)

    def _prompt_spec(self, turn: Turn) -> list[Any] | None:
        run = turn.prompt
        if run is None:
            return None
        same = self.prompt_of.get(id(run))
        if same is not None:
            return [int(PromptKind.SAME), same]
        if run.prev is not None:
            extends = self.full_of.get(id(run.prev))
            if extends is not None:
                return [int(PromptKind.EXTENDS), extends, encode_segment(run.seg)]
        # a chain this file cannot name: write the tokens whole (exact, just not shared)
        return [int(PromptKind.NEW), encode_segment(token_array(run_list(run), "prompt_ids"))]


def _header(graph: Graph, mode: str) -> bytes:
    payload = pack(
        {
            "format": "rollout_store",
            "version": FORMAT_VERSION,
            "mode": mode,
            "share_threshold": graph.share_threshold,
        }
    )
    return MAGIC + frame(KIND_HEADER, payload)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save(graph: Graph, path: str | os.PathLike[str]) -> None:
    """Write the whole graph to `path` atomically: a temporary file, fsync, rename."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    log_path = graph.journal_path
    if log_path is not None and os.path.realpath(target) == log_path:
        raise ValueError(f"{target} is the log this graph appends to; save to another path")
    with graph.lock:
        writer = _Writer()
        try:
            with open(tmp, "wb") as fp:
                fp.write(_header(graph, MODE_SNAPSHOT))
                entries = graph.journal_entries()
                for entry in entries:
                    # references are counted in the end record of a snapshot
                    frames, commit = writer.turn_frames(graph.blobs, entry)
                    fp.writelines(frames)
                    commit()
                references = list(graph.blobs.mark()[1:])
                end = {"turns": len(entries), "blobs": len(graph.blobs), "references": references}
                fp.write(frame(KIND_END, pack(end)))
                fp.flush()
                os.fsync(fp.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
    _fsync_dir(target)


# ---------------------------------------------------------------- reading


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
    truncated: bool = False  # the damage is a cut (short last frame), not changed bytes
    mode: str | None = None  # "log" (append mode) or "snapshot" (save)
    exception: CorruptFileError | None = None

    def fail(self, exc: CorruptFileError, truncated: bool = False) -> None:
        self.exception = exc
        self.error = str(exc)
        self.error_offset = exc.offset
        self.truncated = truncated

    @property
    def ok(self) -> bool:
        return self.error is None


class _Loader:
    """Rebuilds a graph from the records of a file, through the graph's restore door."""

    def __init__(self, share_threshold: int | None) -> None:
        self.graph = RolloutGraph(share_threshold=share_threshold)
        self.restore: GraphRestorer = self.graph._restorer()
        self.writer = _Writer()
        self.checker = PackedChecker(self.graph.blobs)
        self.value_is_list: list[bool] = []  # system parts must be arrays of messages

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
        actual = content_digest(data)  # type: ignore[arg-type]  # xxhash reads any buffer
        if actual != digest:
            raise ChecksumMismatch("blob", digest, actual, offset=offset, record=record)
        try:
            text, surrogates = str(data, "utf-8"), False
        except UnicodeDecodeError:
            text, surrogates = str(data, "utf-8", "surrogatepass"), True
        self.graph.blobs.add_verified(text, digest, size, surrogates)

    def value(self, payload: Any) -> None:
        decoded = self.checker.check(payload, len(self.graph.blobs))
        self.value_is_list.append(type(decoded) is list)
        self.writer.values[id(payload)] = len(self.writer.value_objects)
        self.writer.value_objects.append(payload)
        self.restore.add_value(payload, self.checker.special)

    def turn(self, payload: Any) -> None:
        """Check one turn record, build the stored turn and commit it to the graph."""
        n_fields = len(TurnRecord._fields)
        if not (isinstance(payload, list) and len(payload) in (n_fields - 1, n_fields)):
            raise ValueError(f"turn record must be a list of {n_fields} fields")
        record = TurnRecord(*payload)
        n_blobs = len(self.graph.blobs)
        turn = self._identity(record)
        self._request(turn, record, n_blobs)
        self._tokens(turn, record, n_blobs)
        keys = _index_keys(record.keys)
        moves = self._moves(turn, record.moves)
        refs = record.refs
        if not (isinstance(refs, list) and len(refs) == 2):
            raise ValueError("bad moves or reference counts")
        if not all(type(r) is int and r >= 0 for r in refs):
            raise ValueError("bad reference counts")
        self.graph.blobs.count_references(refs[0], refs[1])
        self.restore.commit(turn, keys, moves)
        self.writer.note_runs(turn)

    def _identity(self, record: TurnRecord) -> Turn:
        """A new turn with its id, position, parent, link, flags and scalar fields."""
        node_id = record.node_id
        if not isinstance(node_id, str) or node_id in self.graph:
            raise ValueError(f"bad or repeated node id {node_id!r}")
        turn = Turn()
        turn.node_id = node_id
        turn.index = len(self.graph)
        turn.children = None
        turn.parent = self._ref(record.parent)
        link = _link_kind(record.link)
        turn.link = link if turn.parent is not None else LinkKind.NONE
        flags = record.flags
        if not isinstance(flags, int) or flags < 0:
            raise ValueError("bad flags")
        turn.flags = flags
        meta = record.meta
        if not (isinstance(meta, list) and len(meta) == len(TurnMeta._fields)):
            raise ValueError("bad meta")
        if not all(m is None or isinstance(m, str) for m in meta[:4]) or not (
            meta[4] is None or type(meta[4]) is int
        ):
            raise ValueError("bad meta")
        turn.meta = self.restore.meta(TurnMeta(*meta))
        return turn

    def _request(self, turn: Turn, record: TurnRecord, n_blobs: int) -> None:
        """The request (system part, base, tail), the response and the shared values."""
        flags, tail, n_rest, system = turn.flags, record.tail, record.n_rest, record.system
        turn.system = self._value_ref(system)
        turn.base = self._ref(record.base)
        if turn.base is not None and (turn.base.flags | flags) & NO_MESSAGES:
            raise ValueError("a request without messages has no base, and is no base")
        if not isinstance(tail, bytes) or not isinstance(n_rest, int):
            raise ValueError("bad request tail")
        if n_rest < (turn.base.n_rest if turn.base is not None else 0):
            raise ValueError("request shorter than its base")
        turn.tail = tail
        turn.n_rest = n_rest
        finish_tail(turn)
        if tail or not flags & NO_MESSAGES:
            items = self.checker.check(tail, n_blobs, echo_ok=True)
            if type(items) is not list or len(items) != n_rest - turn.first:
                raise ValueError("request tail does not hold its messages")
            echo = bool(flags & TAIL_ECHO)
            at_start = tail[turn.body_start - len(ECHO_PACKED) : turn.body_start] == ECHO_PACKED
            if self.checker.echoes != echo or (echo and (turn.base is None or not at_start)):
                raise ValueError("misplaced echo in a request tail")
        if system is not None and not self.value_is_list[system]:
            raise ValueError("system messages must be an array")
        if record.response is not None:
            self.checker.check(record.response, n_blobs)
        turn.response = record.response
        turn.tools = self._value_ref(record.tools)
        turn.sampling = self._value_ref(record.sampling)
        turn.requested = self._value_ref(record.requested)

    def _tokens(self, turn: Turn, record: TurnRecord, n_blobs: int) -> None:
        """Prompt, sampled ids and logprobs."""
        turn.prompt = self._prompt(record.prompt)
        turn.sampled = decode_segment(record.sampled)
        if turn.sampled is not None and not (
            isinstance(turn.sampled, tuple) or turn.sampled.typecode in "Iq"
        ):
            raise ValueError("bad sampled ids")
        turn.full = full_run(turn.prompt, turn.sampled)
        logprobs = record.logprobs
        if logprobs is None:
            turn.logprobs = None
        elif logprobs[0] == "j":
            self.checker.check(logprobs[1], n_blobs)
            turn.logprobs = logprobs[1]
        elif logprobs[0] == "d":
            turn.logprobs = decode_segment(logprobs, "d")
        else:
            raise ValueError("bad logprobs")

    def _moves(self, turn: Turn, moves: Any) -> list[tuple[Turn, LinkKind]]:
        """Earlier turns that this one re-linked under itself."""
        if not isinstance(moves, list):
            raise ValueError("bad moves or reference counts")
        out: list[tuple[Turn, LinkKind]] = []
        for move in moves:
            if not (isinstance(move, list) and len(move) == 2 and isinstance(move[1], int)):
                raise ValueError("bad move")
            other = self._ref(move[0])
            if other is None or not 0 < move[1] <= LinkKind.EXPLICIT or is_above(other, turn):
                raise ValueError("bad move")
            out.append((other, LinkKind(move[1])))
        return out

    def _value_ref(self, ordinal: Any) -> bytes | None:
        if ordinal is None:
            return None
        values = self.writer.value_objects  # value records in file order
        if not isinstance(ordinal, int) or not 0 <= ordinal < len(values):
            raise ValueError("value reference out of range")
        return values[ordinal]

    def _ref(self, index: Any) -> Turn | None:
        """The earlier turn at `index`, or None."""
        if index is None:
            return None
        if not isinstance(index, int) or not 0 <= index < len(self.graph):
            raise ValueError(f"turn reference {index!r} out of range")
        return self.restore.turn(index)

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
            return TokenRun(other.full, decode_segment(spec[2]))
        if kind == PromptKind.NEW and len(spec) == 2:
            return TokenRun(None, decode_segment(spec[1]))
        raise ValueError("bad prompt spec")


def _link_kind(link: Any) -> LinkKind:
    if not (isinstance(link, int) and 0 <= link <= LinkKind.EXPLICIT):
        raise ValueError("bad link kind")
    return LinkKind(link)


def _index_keys(keys: Any) -> IndexKeys:
    if not (isinstance(keys, list) and len(keys) == len(IndexKeys._fields)):
        raise ValueError("bad index keys")
    if not all(k is None or type(k) is int for k in keys[:3]):
        raise ValueError("bad index keys")
    if keys[3] is not None and not (
        isinstance(keys[3], list) and all(type(k) is int for k in keys[3])
    ):
        raise ValueError("bad index keys")
    return IndexKeys(*keys)


class _Damage(Exception):
    """Internal: the frame at hand is damaged; the scan stops there."""

    def __init__(self, error: CorruptFileError, truncated: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.truncated = truncated


class _Scan:
    """One pass over a file's frames: check each one, then apply its record to the loader.

    Blob and value records are applied only when the turn record after them arrives, so a
    turn cut short leaves nothing of itself behind.
    """

    def __init__(self, data: memoryview, report: LoadReport) -> None:
        self.data = data
        self.report = report
        self.loader: _Loader | None = None
        self.ended = False
        self.pending: list[tuple[int, Any, int, int]] = []  # (kind, body, offset, record)
        self.record = 0  # index of the record at hand, and its offset: errors name them
        self.start = 0

    def run(self, progress: Callable[[int], None] | None) -> None:
        report = self.report
        offset = len(MAGIC)
        while offset < report.file_size:
            start = offset
            try:
                kind, payload, offset = self.frame_at(start)
            except _Damage as damage:
                report.fail(damage.error, truncated=damage.truncated)
                return
            self.start = start
            try:
                self.apply(kind, payload, start)
            except CorruptFileError as exc:
                report.fail(exc)
                return
            except Exception as exc:  # anything a damaged payload provokes
                kind_name = KIND_NAMES.get(kind, f"kind {kind}")
                message = f"invalid {kind_name} record: {exc}"
                report.fail(CorruptFileError(message, offset=self.start, record=self.record))
                return
            self.record += 1
            report.records = self.record
            if not self.pending:
                report.good_bytes = offset
            if progress is not None:
                progress(offset)

    def frame_at(self, start: int) -> tuple[int, memoryview, int]:
        """The kind and payload of the frame at `start` (checksum verified) and its end."""
        data, size, record = self.data, self.report.file_size, self.record
        if size - start < FRAME.size:
            message = "file ends inside a frame header"
            raise _Damage(CorruptFileError(message, offset=start, record=record), True)
        kind, length, expected = FRAME.unpack_from(data, start)
        offset = start + FRAME.size
        if length > size - offset:
            message = f"file ends inside a record: {size - offset} of {length} bytes present"
            failure = CorruptFileError(message, offset=start, record=record)
            raise _Damage(failure, not _frame_after(data, start))
        payload = data[offset : offset + length]  # a view: blob data is not copied
        actual = checksum(kind, payload)
        if actual != expected:
            failure = ChecksumMismatch("record", expected, actual, offset=start, record=record)
            raise _Damage(failure, not _frame_after(data, start))
        return kind, payload, offset + length

    def apply(self, kind: int, payload: memoryview, start: int) -> None:
        body = payload if kind == KIND_BLOB else unpack_payload(payload)
        if self.ended:
            raise ValueError("records after the end record")
        if self.record == 0:
            self.loader, self.report.mode = _read_header(kind, body, start)
            return
        loader = self.loader
        if loader is None or kind == KIND_HEADER:
            raise ValueError("a second header record")
        if kind in (KIND_BLOB, KIND_VALUE):
            self.pending.append((kind, body, start, self.record))
        elif kind == KIND_TURN:
            self.apply_turn(loader, body)
        elif kind == KIND_END:
            self.apply_end(loader, body)
        else:
            raise ValueError(f"unknown record kind {kind}")

    def apply_turn(self, loader: _Loader, body: Any) -> None:
        """The blobs and values waiting for this turn record, then the turn itself."""
        turn_start, turn_record = self.start, self.record
        for kind, pending, start, record in self.pending:
            self.start, self.record = start, record  # an error names the record it is about
            if kind == KIND_BLOB:
                loader.blob(pending, start, record)
                self.report.blobs += 1
            else:
                loader.value(pending)
        self.start, self.record = turn_start, turn_record
        self.pending.clear()
        loader.turn(body)
        self.report.turns += 1

    def apply_end(self, loader: _Loader, body: Any) -> None:
        report = self.report
        counts = {"turns": report.turns, "blobs": report.blobs}
        if self.pending or not isinstance(body, dict) or body.keys() != {*counts, "references"}:
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
        loader.graph.blobs.count_references(*references)
        self.ended = True

    def finish(self) -> _Loader:
        """Damage that only the end of the file shows; the loader (empty if none)."""
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
        return self.loader if self.loader is not None else _Loader(None)


def _scan(
    data: bytes | memoryview,
    path: str,
    progress: Callable[[int], None] | None = None,
) -> tuple[_Loader, LoadReport]:
    """Read frames until the end or the first damage; never raises for damage."""
    data = memoryview(data)
    size = len(data)
    report = LoadReport(path, size, 0, 0, 0, 0)
    if size < len(MAGIC) or bytes(data[: len(MAGIC)]) != MAGIC:
        report.fail(CorruptFileError("not a rollout_store file (bad magic)", offset=0))
        head = bytes(data[: len(MAGIC)])
        report.truncated = (size < len(MAGIC) and MAGIC.startswith(head)) or not bytes(data).strip(
            b"\0"
        )
        return _Loader(None), report
    scan = _Scan(data, report)
    scan.run(progress)
    return scan.finish(), report


def _frame_after(data: memoryview, start: int) -> bool:
    """Whether a whole, valid frame begins anywhere after `start`.

    Damage with no valid frame after it is a torn last write (a cut, garbage or zeros to
    the end), which `repair` may cut off; damage followed by intact records is not.
    """
    size = len(data)
    for pos in range(start + 1, size - FRAME.size + 1):
        kind, length, expected = FRAME.unpack_from(data, pos)
        if kind <= KIND_END and length <= size - pos - FRAME.size:
            payload = data[pos + FRAME.size : pos + FRAME.size + length]
            if checksum(kind, payload) == expected:
                return True
    return False


def _read_header(kind: int, body: Any, start: int) -> tuple[_Loader, str]:
    if kind != KIND_HEADER or not isinstance(body, dict):
        raise ValueError("the first record is not a header")
    if body.get("format") != "rollout_store":
        raise ValueError("not a rollout_store file")
    version = body.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise UnsupportedVersionError(
            f"format version {version!r} is not supported (this library reads version "
            f"{FORMAT_VERSION})",
            offset=start,
            record=0,
        )
    mode = body.get("mode")
    if mode not in (MODE_LOG, MODE_SNAPSHOT):
        raise ValueError(f"unknown file mode {mode!r}")
    threshold = body.get("share_threshold")
    if threshold is not None and (not isinstance(threshold, int) or threshold < 1):
        raise ValueError("bad share_threshold")
    return _Loader(threshold), mode


def _read(path: str | os.PathLike[str]) -> bytes:
    with open(path, "rb") as fp:
        return fp.read()


def _raise_for(report: LoadReport) -> None:
    raise report.exception or CorruptFileError("damaged file")


def verify(
    path: str | os.PathLike[str], progress: Callable[[int], None] | None = None
) -> LoadReport:
    """Check every frame, blob digest and reference of a file; never raises for damage."""
    return _scan(_read(path), os.fspath(path), progress)[1]


def load(
    path: str | os.PathLike[str],
    *,
    recover: bool = False,
    progress: Callable[[int], None] | None = None,
) -> RolloutGraph:
    """Read a rollout file. Damage raises `CorruptFileError` naming its offset.

    With `recover=True` every complete turn before the first damage is loaded instead, and
    `graph.load_report` says where the file was cut or damaged.
    """
    loader, report = _scan(_read(path), os.fspath(path), progress)
    if report.error is not None and not (recover and report.records > 0):
        _raise_for(report)
    loader.graph.load_report = report
    return loader.graph


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

    @property
    def path(self) -> str | None:
        return self._path

    def append(self, entry: JournalEntry) -> None:
        frames, commit = self.writer.turn_frames(self.blobs, entry)
        fd = self.fp.fileno()
        size = os.lseek(fd, 0, os.SEEK_END)
        try:
            data = b"".join(frames)
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            self.unsynced += 1
            if self.fsync_every and self.unsynced >= self.fsync_every:
                os.fsync(fd)
                self.unsynced = 0
        except BaseException:
            # leave the file exactly as it was before this turn
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
                os.lseek(fd, size, os.SEEK_SET)
            raise
        commit()

    def close(self) -> None:
        self._path = None
        if self.fp.closed:
            return
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
    raise ValueError("fsync must be 'turn', 'never' or a positive int (every N turns)")


def open_append(
    path: str | os.PathLike[str],
    *,
    share_threshold: int | None = 1024,
    fsync: str | int = "turn",
    repair: bool = False,
) -> RolloutGraph:
    """A graph that writes each turn to `path` as it is added (created if missing).

    An existing file is loaded first; if its last record is cut short (a crash while
    writing), `repair=True` truncates it to the last complete record, else it raises.
    """
    every = _fsync_policy(fsync)
    target = Path(path)
    fp = open(target, "a+b")  # noqa: SIM115 - owned by the returned graph
    try:
        fcntl.flock(fp.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fp.close()
        raise FileLockedError(f"{target} is open for appending by another process") from None
    try:
        fp.seek(0)
        data = fp.read()
        if data:
            loader, report = _scan(data, os.fspath(target))
            if report.mode == MODE_SNAPSHOT:
                raise CorruptFileError(f"{target} is a snapshot written by save(), not a log")
            if report.error is not None:
                if not (repair and report.truncated):
                    _raise_for(report)
                # repair: cut the torn tail (a file torn inside its header starts anew)
                keep = report.good_bytes if report.records > 0 else 0
                os.ftruncate(fp.fileno(), keep)
                os.fsync(fp.fileno())
                if not keep:
                    data = b""
        if data:
            graph = loader.graph
            graph.load_report = report
            writer = loader.writer
            writer.blobs_written = len(graph.blobs)
            writer.refs = graph.blobs.mark()[1:]
        else:
            graph = RolloutGraph(share_threshold=share_threshold)
            writer = _Writer()
            fp.write(_header(graph, MODE_LOG))
            fp.flush()
            os.fsync(fp.fileno())
            _fsync_dir(target)
        fp.seek(0, os.SEEK_END)
    except BaseException:
        fp.close()
        raise
    graph.attach_journal(_AppendLog(fp, os.path.realpath(target), graph.blobs, writer, every))
    return graph


class RolloutGraph(Graph):
    """Turns of one or many rollouts, with memory proportional to unique content.

    `share_threshold`: strings of at least this many characters are stored once in the
    graph's blob table (`None` disables string sharing; messages and tokens are still
    shared). Safe to use from many threads: `add_turn` is serialized by a lock.

    The in-memory `Graph` plus its files: `save`, `load` and `open`. It is defined here, in
    the file layer, so that the graph below never imports the module that stores it.
    """

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the graph to `path` atomically (temporary file, fsync, rename)."""
        save(self, path)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        recover: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> RolloutGraph:
        """Read a file written by `save` or `open`; see `storage.load`."""
        return load(path, recover=recover, progress=progress)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        share_threshold: int | None = 1024,
        fsync: str | int = "turn",
        repair: bool = False,
    ) -> RolloutGraph:
        """A graph that appends every added turn to `path` durably; see `open_append`.

        `fsync`: "turn" (every turn), an int N (every N turns) or "never". Close it (or use
        it as a context manager) to flush the last turns.
        """
        return open_append(path, share_threshold=share_threshold, fsync=fsync, repair=repair)

    def __enter__(self) -> RolloutGraph:
        return self

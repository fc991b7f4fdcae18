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
from pathlib import Path
from typing import IO, Any

from .blobs import content_digest
from .errors import ChecksumMismatch, CorruptFileError, UnsupportedVersionError
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
from .graph import RolloutGraph
from .intake import token_array
from .tokens import TokenRun, run_list
from .turns import (
    ECHO_PACKED,
    LINK_EXPLICIT,
    NO_MESSAGES,
    TAIL_ECHO,
    Scratch,
    Turn,
    finish_tail,
    full_run,
    is_above,
)

__all__ = ["FORMAT_VERSION", "MAGIC", "LoadReport", "load", "open_append", "save", "verify"]


# prompt specs in a turn record
_PROMPT_SAME, _PROMPT_EXTENDS, _PROMPT_NEW = 0, 1, 2


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

    def blob_frames(self, graph: RolloutGraph, end: int) -> list[bytes]:
        frames: list[bytes] = []
        blobs = graph.blobs
        for index in range(self.blobs_written, end):
            data = blobs.string(index).encode("utf-8", "surrogatepass")
            frames.extend(blob_frame(blobs.handle(index).digest, data))
        return frames

    def turn_frames(
        self,
        graph: RolloutGraph,
        turn: Turn,
        moves: list[tuple[Turn, int]],
        keys: list[Any],
        blobs_end: int,
        refs: tuple[int, int],
    ) -> tuple[list[bytes], Callable[[], None]]:
        """Frames (as byte parts) for the turn's new blobs, new values and the turn itself,
        and a function to call once they are written."""
        frames = self.blob_frames(graph, blobs_end)
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
        record = [
            turn.node_id,
            parent_index,
            turn.link if parent_index is not None else 0,
            turn.flags,
            list(turn.meta),
            value_ref(turn.system),
            turn.base.index if turn.base is not None else None,
            turn.tail,
            turn.n_rest,
            turn.response,
            value_ref(turn.tools),
            value_ref(turn.sampling),
            self._prompt_spec(turn),
            encode_segment(turn.sampled),
            encode_segment(turn.logprobs)
            if isinstance(turn.logprobs, array)
            else (["j", turn.logprobs] if turn.logprobs is not None else None),
            keys,
            [refs[0] - self.refs[0], refs[1] - self.refs[1]],
            [[other.index, link] for other, link in moves],
            value_ref(turn.requested),
        ]
        frames.append(frame(KIND_TURN, pack(record)))

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

    def _prompt_spec(self, turn: Turn) -> Any:
        run = turn.prompt
        if run is None:
            return None
        same = self.prompt_of.get(id(run))
        if same is not None:
            return [_PROMPT_SAME, same]
        if run.prev is not None:
            extends = self.full_of.get(id(run.prev))
            if extends is not None:
                return [_PROMPT_EXTENDS, extends, encode_segment(run.seg)]
        # a chain this file cannot name: write the tokens whole (exact, just not shared)
        return [_PROMPT_NEW, encode_segment(token_array(run_list(run), "prompt_ids"))]


def _header(graph: RolloutGraph, mode: str) -> bytes:
    payload = pack(
        {
            "format": "rollout_store",
            "version": FORMAT_VERSION,
            "mode": mode,
            "share_threshold": graph.share_threshold,
        }
    )
    return MAGIC + frame(KIND_HEADER, payload)


def _turn_keys(scratch: Scratch) -> list[Any]:
    return [scratch.request_digest, scratch.token_key, scratch.prompt_key, scratch.root_keys]


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save(graph: RolloutGraph, path: str | os.PathLike[str]) -> None:
    """Write the whole graph to `path` atomically: a temporary file, fsync, rename."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    if graph._log_path is not None and os.path.realpath(target) == graph._log_path:
        raise ValueError(f"{target} is the log this graph appends to; save to another path")
    with graph._lock:
        writer = _Writer()
        try:
            with open(tmp, "wb") as fp:
                fp.write(_header(graph, MODE_SNAPSHOT))
                turns = graph._turns
                later_children: dict[int, list[tuple[Turn, int]]] = {}
                for turn in turns:
                    parent = turn.parent
                    if parent is not None and parent.index > turn.index:
                        later_children.setdefault(parent.index, []).append((turn, turn.link))
                inverted = graph._inverted_keys()
                marks = graph._blob_marks
                for turn in turns:
                    # references are counted in the end record of a snapshot
                    frames, commit = writer.turn_frames(
                        graph,
                        turn,
                        later_children.get(turn.index, []),
                        inverted[turn.index],
                        marks[turn.index],
                        writer.refs,
                    )
                    fp.writelines(frames)
                    commit()
                references = list(graph.blobs.mark()[1:])
                end = {"turns": len(turns), "blobs": len(graph.blobs), "references": references}
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
    def __init__(self, share_threshold: int | None) -> None:
        self.graph = RolloutGraph(share_threshold=share_threshold)
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
        actual = content_digest(data)
        if actual != digest:
            raise ChecksumMismatch("blob", digest, actual, offset=offset, record=record)
        try:
            text, surrogates = str(data, "utf-8"), False
        except UnicodeDecodeError:
            text, surrogates = str(data, "utf-8", "surrogatepass"), True
        self.graph.blobs.add_verified(text, digest, size, surrogates)

    def value(self, payload: Any) -> None:
        decoded = self.checker.check(payload, len(self.graph.blobs))
        special = self.checker.special
        self.value_is_list.append(type(decoded) is list)
        self.writer.values[id(payload)] = len(self.writer.value_objects)
        self.writer.value_objects.append(payload)
        plain = None if special else self.graph._expand(payload)
        if plain is not None and self.graph._values.find(plain) is None:
            self.graph._values.add(plain, payload)

    def turn(self, payload: Any) -> None:
        g = self.graph
        turns = g._turns
        # 19 fields; files written before requested_sampling_params was kept have 18
        if not (isinstance(payload, list) and len(payload) in (18, 19)):
            raise ValueError("turn record must be a list of 19 fields")
        requested = payload[18] if len(payload) == 19 else None
        (
            node_id,
            parent,
            link,
            flags,
            meta,
            system,
            base,
            tail,
            n_rest,
            response,
            tools,
            sampling,
            prompt,
            sampled,
            logprobs,
            keys,
            refs,
            moves,
        ) = payload[:18]
        if not isinstance(node_id, str) or node_id in g._by_id:
            raise ValueError(f"bad or repeated node id {node_id!r}")
        n_blobs = len(g.blobs)
        turn = Turn()
        turn.node_id = node_id
        turn.index = len(turns)
        turn.children = None
        turn.parent = _ref(turns, parent)
        if not (isinstance(link, int) and 0 <= link <= LINK_EXPLICIT):
            raise ValueError("bad link kind")
        turn.link = link if turn.parent is not None else 0
        if not isinstance(flags, int) or flags < 0:
            raise ValueError("bad flags")
        turn.flags = flags
        if not (isinstance(meta, list) and len(meta) == 5):
            raise ValueError("bad meta")
        if not all(m is None or isinstance(m, str) for m in meta[:4]) or not (
            meta[4] is None or type(meta[4]) is int
        ):
            raise ValueError("bad meta")
        turn.meta = g._meta.setdefault(tuple(meta), tuple(meta))
        turn.system = self._value_ref(system)
        turn.base = _ref(turns, base)
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
        if response is not None:
            self.checker.check(response, n_blobs)
        turn.response = response
        turn.tools = self._value_ref(tools)
        turn.sampling = self._value_ref(sampling)
        turn.requested = self._value_ref(requested)
        turn.prompt = self._prompt(prompt)
        turn.sampled = decode_segment(sampled)
        if turn.sampled is not None and not (
            isinstance(turn.sampled, tuple) or turn.sampled.typecode in "Iq"
        ):
            raise ValueError("bad sampled ids")
        turn.full = full_run(turn.prompt, turn.sampled)
        if logprobs is None:
            turn.logprobs = None
        elif logprobs[0] == "j":
            self.checker.check(logprobs[1], n_blobs)
            turn.logprobs = logprobs[1]
        elif logprobs[0] == "d":
            turn.logprobs = decode_segment(logprobs, "d")
        else:
            raise ValueError("bad logprobs")
        if not (isinstance(keys, list) and len(keys) == 4):
            raise ValueError("bad index keys")
        if not all(k is None or type(k) is int for k in keys[:3]):
            raise ValueError("bad index keys")
        if keys[3] is not None and not (
            isinstance(keys[3], list) and all(type(k) is int for k in keys[3])
        ):
            raise ValueError("bad index keys")
        scratch = Scratch()
        scratch.request_digest, scratch.token_key, scratch.prompt_key, scratch.root_keys = keys
        if not (isinstance(moves, list) and isinstance(refs, list) and len(refs) == 2):
            raise ValueError("bad moves or reference counts")
        for move in moves:
            if not (isinstance(move, list) and len(move) == 2 and isinstance(move[1], int)):
                raise ValueError("bad move")
            other = _ref(turns, move[0])
            if other is None or not 0 < move[1] < LINK_EXPLICIT + 1 or is_above(other, turn):
                raise ValueError("bad move")
            scratch.moves.append((other, move[1]))
        if not all(type(r) is int and r >= 0 for r in refs):
            raise ValueError("bad reference counts")
        g.blobs.count_references(refs[0], refs[1])
        g._commit(turn, scratch)
        self.writer.note_runs(turn)

    def _value_ref(self, ordinal: Any) -> bytes | None:
        if ordinal is None:
            return None
        values = self.writer.value_objects  # value records in file order
        if not isinstance(ordinal, int) or not 0 <= ordinal < len(values):
            raise ValueError("value reference out of range")
        return values[ordinal]

    def _prompt(self, spec: Any) -> TokenRun | None:
        if spec is None:
            return None
        turns = self.graph._turns
        kind = spec[0]
        if kind == _PROMPT_SAME and len(spec) == 2:
            other = _ref(turns, spec[1])
            if other is None or other.prompt is None:
                raise ValueError("prompt reference to a turn without prompt")
            return other.prompt
        if kind == _PROMPT_EXTENDS and len(spec) == 3:
            other = _ref(turns, spec[1])
            if other is None or other.full is None:
                raise ValueError("prompt extends a turn without tokens")
            return TokenRun(other.full, decode_segment(spec[2]))
        if kind == _PROMPT_NEW and len(spec) == 2:
            return TokenRun(None, decode_segment(spec[1]))
        raise ValueError("bad prompt spec")


def _ref(turns: list[Turn], index: Any) -> Turn | None:
    if index is None:
        return None
    if not isinstance(index, int) or not 0 <= index < len(turns):
        raise ValueError(f"turn reference {index!r} out of range")
    return turns[index]


def _scan(
    data: bytes | memoryview,
    path: str,
    progress: Callable[[int], None] | None = None,
) -> tuple[_Loader, LoadReport]:
    """Read frames until the end or the first damage; never raises for damage.

    Blob and value records are applied only when the turn record after them arrives, so a
    turn cut short leaves nothing of itself behind.
    """
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
    offset = len(MAGIC)
    loader: _Loader | None = None
    ended = False
    pending: list[tuple[int, Any, int, int]] = []
    record = 0
    while offset < size:
        start = offset
        if size - offset < FRAME.size:
            message = "file ends inside a frame header"
            report.fail(CorruptFileError(message, offset=start, record=record), truncated=True)
            break
        kind, length, expected = FRAME.unpack_from(data, offset)
        offset += FRAME.size
        if length > size - offset:
            message = f"file ends inside a record: {size - offset} of {length} bytes present"
            failure = CorruptFileError(message, offset=start, record=record)
            report.fail(failure, truncated=not _frame_after(data, start))
            break
        payload = data[offset : offset + length]  # a view: blob data is not copied
        offset += length
        actual = checksum(kind, payload)
        if actual != expected:
            failure = ChecksumMismatch("record", expected, actual, offset=start, record=record)
            report.fail(failure, truncated=not _frame_after(data, start))
            break
        try:
            body = payload if kind == KIND_BLOB else unpack_payload(payload)
            if ended:
                raise ValueError("records after the end record")
            if record == 0:
                loader, report.mode = _read_header(kind, body, start)
            elif loader is None or kind == KIND_HEADER:
                raise ValueError("a second header record")
            elif kind in (KIND_BLOB, KIND_VALUE):
                pending.append((kind, body, start, record))
            elif kind == KIND_TURN:
                turn_start, turn_record = start, record
                for p_kind, p_body, start, record in pending:  # an error names this record
                    if p_kind == KIND_BLOB:
                        loader.blob(p_body, start, record)
                        report.blobs += 1
                    else:
                        loader.value(p_body)
                start, record = turn_start, turn_record
                pending.clear()
                loader.turn(body)
                report.turns += 1
            elif kind == KIND_END:
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
                loader.graph.blobs.count_references(*references)
                ended = True
            else:
                raise ValueError(f"unknown record kind {kind}")
        except CorruptFileError as exc:
            report.fail(exc)
            break
        except Exception as exc:  # anything a damaged payload provokes
            kind_name = KIND_NAMES.get(kind, f"kind {kind}")
            message = f"invalid {kind_name} record: {exc}"
            report.fail(CorruptFileError(message, offset=start, record=record))
            break
        record += 1
        report.records = record
        if not pending:
            report.good_bytes = offset
        if progress is not None:
            progress(offset)
    if report.error is None:
        if loader is None:
            report.fail(CorruptFileError("no header record", offset=len(MAGIC)), truncated=True)
        elif pending:
            message = "file ends after the blobs of a turn whose record is missing"
            report.fail(CorruptFileError(message, offset=report.good_bytes), truncated=True)
        elif report.mode == MODE_SNAPSHOT and not ended:
            message = "snapshot ends before its end record"
            report.fail(CorruptFileError(message, offset=size), truncated=True)
    if loader is None:
        loader = _Loader(None)
    return loader, report


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
    """The file behind a graph opened with `open_append`: one write per turn."""

    def __init__(self, fp: IO[bytes], writer: _Writer, fsync_every: int) -> None:
        self.fp = fp
        self.writer = writer
        self.fsync_every = fsync_every
        self.unsynced = 0

    def on_turn(self, graph: RolloutGraph, turn: Turn, scratch: Scratch) -> None:
        keys = _turn_keys(scratch)
        frames, commit = self.writer.turn_frames(
            graph, turn, scratch.moves, keys, len(graph.blobs), graph.blobs.mark()[1:]
        )
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
        raise CorruptFileError(f"{target} is open for appending by another process") from None
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
    log = _AppendLog(fp, writer, every)
    graph._listeners.append(lambda turn, _first, scratch: log.on_turn(graph, turn, scratch))
    graph._closers.append(log.close)
    graph._closers.append(lambda: setattr(graph, "_log_path", None))
    graph._log_path = os.path.realpath(target)
    return graph

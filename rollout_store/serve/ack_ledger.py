"""The `--ack fast` ledger: every turn answered before it is recorded leaves a line in the data
directory first, so a server killed before recording it still has it counted.

With `--ack fast` the reply goes out before its turn is recorded; the queue of turns waiting
for the recorder lives in the process. Before each such reply, one `write` appends `a SID` to
`acks.ledger` in the data directory (no `fsync`: a killed process leaves what it wrote in the
page cache, so the line outlives it). A turn that is recorded writes nothing more: the
session's log says how many of its turns made it. One the server drops for a reason it knows
(the queue full, a recording error, the server stopping) appends `d SID REASON`.

A starting server (any `--ack`) reads the ledger against its sessions' logs: of a session's
answered turns whose fate the ledger does not say, the ones its log does not hold were lost
with the process (reason `killed`). Those counts, and the known drops, are carried over:
the ledger is rewritten (atomically, synced) with one line per session, `b SID TURNS` (the
log's turn count now: later lines count from there) and `c SID REASON N` (the turns lost so
far, by reason), and counted again at every later start, never twice. A clean stop rewrites
it the same way once the queue is drained; a ledger with nothing to carry is removed. A
running server keeps what its lines say in memory too, and rewrites the ledger from it (the
same lines, summed) once it grew by `COMPACT_BYTES`. A session made or deleted while a
ledger exists appends `n SID`: what came before is another session's; a call of a deleted
session answered after its delete appends nothing (it is counted in that run only).

Lines: `b SID TURNS`, `n SID`, `a SID`, `d SID REASON`, `c SID REASON N`, `p SID N` (answered
turns of a session whose log could not be read at the rewrite, still to be reconciled). A
line that does not parse (the tail of a file a power loss cut) is skipped.

Every line goes to the file through one appender, the engine's `_core.Ledger` (one
descriptor, one lock, one `write` a line), which the Rust data plane's direct lane shares: it
writes a call's `a SID` itself before its reply, with no Python on the way, and the ledger
learns of that line when the recorder hands it the call (`applied`). A rewrite holds the
counts known here; the lane's lines not known yet are appended to it before it is put in
place (`Ledger.replace`), so a rewrite never waits for the lane.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .._core import Ledger
from ..files.atomic import fsync_dir, write_beside

__all__ = ["KILLED", "LEDGER_NAME", "AckLedger", "SessionTally", "read_ledger"]

#: The ledger's file name in the data directory (never a session's: those are `<id>.json`
#: and `<id>.rls`).
LEDGER_NAME = "acks.ledger"
#: The reason of turns answered, then lost with the process (kill -9, a crash).
KILLED = "killed"
#: A running server rewrites its ledger (one line per session and count, as at a start) once
#: this many bytes were appended since the last rewrite: a long run keeps it small.
COMPACT_BYTES = 1 << 20


@dataclass(slots=True)
class SessionTally:
    """What the ledger says of one session: its log's turn count when the ledger's count
    for it began, its answered turns of unknown fate since then, and its lost turns by
    reason."""

    base: int = 0
    pending: int = 0
    lost: Counter[str] = field(default_factory=Counter)

    def apply(self, line: list[str]) -> None:
        """One ledger line's change (`a`, `d`, `c`, `p`) to this session's tally."""
        kind = line[0]
        if kind == "a" and len(line) == 2:
            self.pending += 1
        elif kind == "d" and len(line) == 3:
            self.pending -= 1
            self.lost[line[2]] += 1
        elif kind == "c" and len(line) == 4:
            self.lost[line[2]] += int(line[3])
        elif kind == "p" and len(line) == 3:
            self.pending += int(line[2])

    def settle(self, turns: int) -> None:
        """The log holds `turns` turns: the pending turns it does not hold were lost."""
        killed = self.pending - (turns - self.base)
        if killed > 0:
            self.lost[KILLED] += killed
        self.base, self.pending = turns, 0


def read_ledger(data: bytes) -> dict[str, SessionTally]:
    """The ledger's lines, by session id (lines that do not parse are skipped)."""
    tallies: dict[str, SessionTally] = {}
    for line in data.split(b"\n")[:-1]:  # a last line without its newline was cut
        parts = line.decode("ascii", "replace").split(" ")
        try:
            _apply(tallies, parts)
        except (IndexError, ValueError):
            continue
    return tallies


def _apply(tallies: dict[str, SessionTally], line: list[str]) -> None:
    kind, sid = line[0], line[1]
    if kind == "n" and len(line) == 2:  # (a session made or deleted since: none of it kept)
        tallies.pop(sid, None)
    elif kind == "b" and len(line) == 3:
        tallies[sid] = SessionTally(base=int(line[2]))
    elif kind in ("a", "d", "c", "p"):
        tally = tallies.get(sid)
        if tally is None:
            tally = tallies[sid] = SessionTally()
        tally.apply(line)


def _lines(tallies: Mapping[str, SessionTally]) -> bytes:
    out = []
    for sid, tally in tallies.items():
        out.append(f"b {sid} {tally.base}\n")
        out += [f"c {sid} {reason} {n}\n" for reason, n in sorted(tally.lost.items()) if n > 0]
        if tally.pending > 0:
            out.append(f"p {sid} {tally.pending}\n")
    return "".join(out).encode("ascii")


class AckLedger:
    """The ledger of one data directory (see the module). `write_atomic(path, data)`: how a
    rewrite is put in place (whole or not at all, synced)."""

    def __init__(self, data: Path, write_atomic: Callable[[Path, bytes], None]) -> None:
        self.path = data / LEDGER_NAME
        self._write_atomic = write_atomic
        self._lock = threading.Lock()
        #: The file's one appender (the Rust data plane's direct lane writes through it too).
        self.file = Ledger()
        #: What the ledger's lines say, by session (kept from the last rewrite on), and how
        #: many bytes were appended since that rewrite.
        self._tallies: dict[str, SessionTally] = {}
        self._appended = 0
        #: Writes that failed (a full disk): those turns are answered all the same.
        self.errors = 0
        #: Closed with its server (which let the data directory go): nothing is appended.
        self._closed = False

    def exists(self) -> bool:
        return self.file.is_open or self.path.exists()

    def reconcile(self, turns: Mapping[str, int | None]) -> dict[str, Counter[str]]:
        """Read the ledger against the sessions' turn counts (`None`: a log that cannot be
        read now), rewrite it with what is carried, and return each session's lost turns
        by reason. Sessions not in `turns` (deleted) are forgotten."""
        with self._lock:
            self.file.close()
            self._tallies, self._appended = {}, 0
            try:
                tallies = read_ledger(self.path.read_bytes())
            except FileNotFoundError:
                return {}
            kept: dict[str, SessionTally] = {}
            for sid, tally in tallies.items():
                if sid not in turns:
                    continue
                count = turns[sid]
                if count is not None:
                    tally.settle(count)
                kept[sid] = tally
            if any(t.pending > 0 or +t.lost for t in kept.values()):
                # every session's base too: turns answered later count from it
                for sid, count in turns.items():
                    if sid not in kept and count is not None:
                        kept[sid] = SessionTally(base=count)
                self._tallies = dict(sorted(kept.items()))
                self._write_atomic(self.path, _lines(self._tallies))
            else:
                self.path.unlink()
                fsync_dir(self.path)
            return {sid: +tally.lost for sid, tally in kept.items() if +tally.lost}

    def answered(
        self,
        session_id: str,
        turns: Callable[[], Mapping[str, int | None]],
        gone: Callable[[], bool] | None = None,
    ) -> None:
        """A turn of `session_id` is about to be answered before it is recorded. `turns`:
        every session's turn count now, asked only to begin a new ledger. `gone`: whether
        the session the turn belongs to was deleted (then nothing is written: see
        `_append`)."""
        self._append(["a", session_id], turns, gone)

    def applied(
        self,
        session_id: str,
        written: bool,
        entry: int = 0,
        gone: Callable[[], bool] | None = None,
    ) -> None:
        """The direct lane answered a turn of `session_id` before it is recorded: its `a`
        line is in the file (`written`; `entry`: its number in the appender), or its write
        failed (counted in `errors`). `gone`:
        whether the session was deleted since (its line came before its `n` line, which
        ended its count: a rewrite must not carry it to a session made again under its
        id)."""
        with self._lock:
            if not written:
                self.errors += 1
                return
            self.file.applied(entry)
            if gone is not None and gone():
                return
            _apply(self._tallies, ["a", session_id])
            self._appended += len(session_id) + 3
            if self._appended >= COMPACT_BYTES:
                self._compact()

    def dropped(self, session_id: str, reason: str, gone: Callable[[], bool] | None = None) -> None:
        """One of those turns will not be recorded (`reason`), and is counted now."""
        if self.exists():
            self._append(["d", session_id, reason], None, gone)

    def forget(self, session_id: str) -> None:
        """`session_id` is made or deleted: the lines before are another session's."""
        if self.exists():
            self._append(["n", session_id], None)

    def _append(
        self,
        line: list[str],
        turns: Callable[[], Mapping[str, int | None]] | None,
        gone: Callable[[], bool] | None = None,
    ) -> None:
        data = (" ".join(line) + "\n").encode("ascii")
        with self._lock:
            # a deleted session's turn (a call answered after the delete) is no line: the
            # id's `n` line is written after the session is closed, and a session made again
            # under the id would inherit the line (a turn it never answered, counted as
            # killed at the next start); asked under this lock, so a line of a session not
            # closed yet comes before its `n` line
            if self._closed or (gone is not None and gone()):
                return
            try:
                if not self.file.is_open:
                    self._opened(turns)
                self.file.append(data)  # one write: a kill cannot tear it
            except OSError:
                self.errors += 1
                return
            _apply(self._tallies, line)
            self._appended += len(data)
            if self._appended >= COMPACT_BYTES:
                self._compact()

    def _opened(self, turns: Callable[[], Mapping[str, int | None]] | None) -> None:
        """Open the file (under the lock); a new one begins with the counts every later
        line starts from (no turn is recorded in fast mode before its `a` line, so none is
        on its way now)."""
        header = ""
        if not self.path.exists() and turns is not None:
            bases = {sid: n for sid, n in sorted(turns().items()) if n}
            self._tallies = {sid: SessionTally(base=n) for sid, n in bases.items()}
            header = "".join(f"b {sid} {n}\n" for sid, n in bases.items())
        # (the header written as the file opens: the lane writes to it from then on)
        self.file.open(self.path, header.encode("ascii"))

    def _compact(self) -> None:
        """Rewrite the ledger as the sum of its lines (the same counts, a line or three per
        session), the direct lane's lines not known here yet appended: what the file says is
        unchanged, whenever it is cut."""
        try:
            fresh = write_beside(self.path, _lines(self._tallies))
        except OSError:
            return  # a failed rewrite leaves the file as it was
        try:
            self.file.replace(fresh, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                fresh.unlink()
            return
        self._appended = 0
        # a rewrite adds no line of its own: a folder sync that fails is tried at the next one
        with contextlib.suppress(OSError):
            fsync_dir(self.path)

    def close(self) -> None:
        """No more lines: the server stopped (a call still finishing then has no answer to
        go out; its line would count it as killed at the next start)."""
        with self._lock:
            self._closed = True
            self.file.close()

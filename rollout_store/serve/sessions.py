"""The capture server's sessions: one rollout graph per API key, durable in a data directory.

A session is minted by `Sessions.create`, which returns its id and the API key an agent's SDK
sends; the key is how each request finds its session. With a data directory every session is
`<id>.json` (id, key, metadata, creation time; written atomically before the session is
handed out) and `<id>.rls` (the graph's append-only log, opened with `RolloutGraph.open`). A
restarted server reopens every session from its files, repairing a torn last record, and
goes on appending. Session ids are checked against a strict pattern and every path is
confirmed to lie inside the data directory, so no request can name a file elsewhere.

Keys come from `secrets` and are found by their SHA-256 digest, then compared with
`hmac.compare_digest`; a session file holding a key is written `0600`. The data directory
is held by one server at a time (a `flock` on the directory, dropped by the OS when the
process dies). Creating and deleting one id are serialized, so a session made again under a
deleted id never sees the deleted one's turns nor loses its own to the deleted files. A
session whose log cannot be read (a damaged record, or an object of the shared store it
references that is missing or damaged) is kept as damaged, with the reason and the repair;
the others open as usual.

With `--ack fast` the data directory also holds the sessions' ack ledger (`ack_ledger`): a
line per turn answered before it is recorded, so that turns a killed server answered and
never recorded are counted by the next start (in each session's `dropped`, and by reason in
`lost_at_start`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._core import Ledger
from ..errors import (
    CorruptFileError,
    InvalidValueError,
    RolloutStoreError,
    StoreError,
    StoreUnavailableError,
)
from ..export.document import held_capture_level
from ..files.atomic import fsync_dir, write_beside
from ..files.storage import RolloutGraph, verify
from ..metadata import GraphMeta
from ..stores.content import ContentStore, StringCache
from ..stores.local import DirectoryStore, MemoryStore
from .ack_ledger import AckLedger

__all__ = [
    "DataDirectoryInUseError",
    "Session",
    "SessionDamagedError",
    "SessionDeletedError",
    "SessionError",
    "Sessions",
    "clean_session_id",
    "key_digest",
]

_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_KEY_PREFIX = "rsk-"
#: Creates and deletes of one id take one of these locks (chosen by the id's hash).
_ID_LOCKS = 64


class SessionError(RolloutStoreError, ValueError):
    """A session request that cannot be honoured (bad id, taken id, unusable file)."""


class SessionDamagedError(SessionError):
    """A session's log cannot be read (a damaged record, or a missing or damaged object of
    the content store it references): the message names the object, the file and the
    repair. Other sessions are not affected."""


class SessionDeletedError(SessionError):
    """A request held a session that was deleted meanwhile (its id may name a new session
    by now, which it never touches)."""


class DataDirectoryInUseError(SessionError):
    """Another server holds the data directory (its `flock` on the directory): stop it, or
    give this one another directory."""


def key_digest(key: str) -> bytes:
    """What keys are indexed by: a lookup's timing then says nothing about the key's text."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _same_key(a: str, b: str) -> bool:
    return hmac.compare_digest(
        a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass")
    )


def clean_session_id(value: Any) -> str | None:
    """`value` if it is a valid session id (letters, digits, `_.-`, at most 128), else None."""
    if isinstance(value, str) and _SESSION_ID.fullmatch(value) and ".." not in value:
        return value
    return None


class _Opener:
    """How a session's graph is opened (`Sessions._open_graph`), and who hears that it was
    found damaged (`Sessions.announce`: the Rust data plane's key table then sends its calls
    the prepared way, refused before they go upstream). One small object a session."""

    __slots__ = ("session_id", "sessions")

    def __init__(self, sessions: Sessions, session_id: str) -> None:
        self.sessions, self.session_id = sessions, session_id

    def __call__(self) -> RolloutGraph:
        return self.sessions._open_graph(self.session_id)

    def damaged(self, session: Session) -> None:
        self.sessions.announce(session)


@dataclass(slots=True)  # no instance dict: a server holds one per session, idle or not
class Session:
    """One rollout: its key, its graph (opened on demand) and bookkeeping.

    Counters live in memory only. A session over a log can let its graph go when idle
    (`release_if_idle`): it then holds only its counts, and the graph is reopened from the
    log by the next use.
    """

    session_id: str
    api_key: str
    opener: _Opener
    metadata: dict[str, Any] = field(default_factory=dict)
    group: str | None = None  # the group (a GRPO group) it belongs to; its graph's too
    created_at: float = field(default_factory=time.time)
    last_turn_at: float | None = None
    last_used: float = field(default_factory=time.time)
    upstream_errors: int = 0
    #: Failed upstream attempts since its last turn (`timeline.failed_after`), for that turn.
    failed: int = 0
    recorded: int = 0
    rejected: int = 0
    #: Turns answered with `--ack fast` whose recording failed (queue full, an error, the
    #: server stopping): counted here, in `/health` and in the export's validation.
    dropped: int = 0
    #: Turns answered with `--ack fast` and neither recorded nor counted as dropped yet (under
    #: `Sessions`' settle lock): each one's number (`Sessions.answered`), by the `id` of what
    #: the server tracks it by (its call's clock), in the order answered; None when there is
    #: none (an idle session holds no dict). An export of this session waits for those
    #: answered before it, no other's.
    _waiting: dict[int, int] | None = field(default=None, repr=False)
    users: int = 0
    _graph: RolloutGraph | None = None
    _counts: dict[str, Any] | None = None
    _cold: bool = False  # its graph's caches were let go while it was idle
    _closed: bool = False  # deleted (or the server stopped): its graph is never reopened
    #: Why its log cannot be read (with the repair), or None: it is never opened again.
    damaged: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def unsettled(self) -> int:
        """Its turns answered with `--ack fast` and not yet recorded nor counted as dropped."""
        waiting = self._waiting
        return 0 if waiting is None else len(waiting)

    @property
    def graph(self) -> RolloutGraph:
        """The session's graph, reopened from its log if it was let go."""
        with self._lock:
            if self._graph is not None:
                return self._graph
            if self._closed:  # a call in flight when it was deleted records nowhere
                raise SessionError(f"session {self.session_id!r} was deleted")
            if self.damaged is not None:
                raise SessionDamagedError(self.damaged)
            try:
                self._graph = self.opener()
            except SessionDamagedError as exc:
                self.damaged = str(exc)
                found = exc
            else:
                self._counts = None
                return self._graph
        self.opener.damaged(self)  # (outside the lock: it takes the registry's)
        raise found

    def key_matches(self, key: str) -> bool:
        """Whether `key` is this session's API key (compared in constant time)."""
        return _same_key(self.api_key, key)

    @property
    def loaded(self) -> bool:
        return self._graph is not None

    @contextlib.contextmanager
    def use(self) -> Iterator[RolloutGraph]:
        """The graph, held: an idle sweep does not let it go while it is in use."""
        with self._lock:
            self.users += 1
            self._cold = False
        try:
            yield self.graph
        finally:
            with self._lock:
                self.users -= 1
                self.last_used = time.time()

    @property
    def idle_seconds(self) -> float:
        return time.time() - max(self.last_turn_at or self.created_at, self.last_used)

    def release_if_idle(self, idle_seconds: float) -> bool:
        """Close the graph (its log keeps everything) if unused for `idle_seconds`."""
        with self._lock:
            graph = self._graph
            if graph is None or self.users or self.idle_seconds < idle_seconds:
                return False
            self._counts = _counts(graph)
            self._graph = None
        graph.close()
        return True

    def drop_caches_if_idle(self, idle_seconds: float) -> bool:
        """Let the graph's caches go (see `RolloutGraph.drop_caches`) if unused for
        `idle_seconds`: a session that has no log to reopen its graph from keeps the graph."""
        with self._lock:
            graph = self._graph
            if graph is None or self.users or self._cold or self.idle_seconds < idle_seconds:
                return False
            self._cold = True
        graph.drop_caches()
        return True

    def turns(self) -> int | None:
        """How many turns its log holds (without reopening an idle session); None when
        it is damaged."""
        with self._lock:
            if self.damaged is not None:
                return None
            if self._graph is not None:
                return len(self._graph)
            return None if self._counts is None else int(self._counts["turns"])

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._lock:
            graph, self._graph = self._graph, None
            self._closed = True
        if graph is not None:
            graph.close()

    def capture_level(self) -> str:
        """ "tokens" when some turn carries the engine's token ids, else "text"
        (`export.held_capture_level`)."""
        counts = self._counts if self._graph is None else None
        if counts is None:
            with self.use() as graph:
                counts = _counts(graph)
        level: str = counts["capture_level"]
        return level

    def info(self) -> dict[str, Any]:
        """Counts for `GET /sessions/{id}` (ids-only queries; an idle session is not reopened).
        A damaged session has no counts: its `damaged` says why and how to repair it."""
        if self.damaged is not None:
            return {
                "session_id": self.session_id,
                "damaged": self.damaged,
                "loaded": False,
                "created_at": self.created_at,
                "metadata": self.metadata,
            }
        graph = self._graph
        counts = _counts(graph) if graph is not None else self._counts
        if counts is None:  # never opened (cannot happen for a registered session)
            with self.use() as opened:
                counts = _counts(opened)
        return {
            "session_id": self.session_id,
            **counts,
            "loaded": graph is not None,
            "created_at": self.created_at,
            "idle_s": round(self.idle_seconds, 3),
            "upstream_errors": self.upstream_errors,
            "rejected": self.rejected,
            "dropped": self.dropped,
            "unsettled": self.unsettled,
            "metadata": self.metadata,
            "group": self.group,
        }


def _settled_through(session: Session, answered: int) -> bool:
    """Whether none of `session`'s first `answered` turns waits (under the settle lock; its
    waiting turns are in the order answered: the first one says)."""
    waiting = session._waiting
    first = None if waiting is None else next(iter(waiting.values()), None)
    return first is None or first > answered


def _counts(graph: RolloutGraph) -> dict[str, Any]:
    ids = graph.node_ids()
    return {
        "turns": len(ids),
        "roots": len(graph.root_ids()),
        "leaves": len(graph.leaf_ids()),
        "forks": len(graph.fork_ids()),
        "discarded": len(graph.discarded_ids()),
        "capture_level": held_capture_level(graph),
    }


def _write_atomic(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all, readable by its owner only (it holds a key)."""
    # 0600 (`atomic.FILE_MODE`): a session file holds the session's API key
    tmp = write_beside(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path)


class Sessions:
    """Every session of one server, by id and by API key.

    `data`: the directory holding session files (None keeps sessions in memory only); it is
    locked for this object's life (`DataDirectoryInUseError` if another server holds it)
    until `close`. `fsync`: the logs' policy ("turn", N or "never"). `open_mode`: an unknown
    key creates a session named after it instead of being refused (never opens a session
    that has a key of its own). `store`: the content store every session's graph shares (a
    new `MemoryStore` if None), `cache`: the one string cache of all sessions over an
    out-of-process store. Logs hold their strings inline over a memory store (it dies with
    the process) and references into any other store (`blobs="store"`). `key_prefix`: what
    minted keys begin with (a replica's carries its name: `replicas.replica_key_prefix`).
    """

    def __init__(
        self,
        data: str | os.PathLike[str] | None = None,
        *,
        fsync: str | int = "turn",
        open_mode: bool = False,
        store: ContentStore | None = None,
        cache: StringCache | None = None,
        key_prefix: str = _KEY_PREFIX,
    ) -> None:
        self.data = Path(data).resolve() if data is not None else None
        self.key_prefix = key_prefix
        self.fsync = fsync
        self.open_mode = open_mode
        self.store: ContentStore = store if store is not None else MemoryStore()
        self.cache = cache if cache is not None else StringCache()
        self.blobs = "inline" if isinstance(self.store, MemoryStore) else "store"
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[bytes, Session] = {}
        #: Told of every key added (key, session) and removed (key, None): the Rust data
        #: plane's key table (`watch_keys`).
        self._key_watcher: Callable[[str, Session | None], None] | None = None
        self._lock = threading.Lock()
        self._id_locks = [threading.Lock() for _ in range(_ID_LOCKS)]
        #: Guards every session's `unsettled` count; told when one reaches 0 (one for all
        #: sessions: a session idle or not holds no lock of its own for it).
        self._settle = threading.Condition(threading.Lock())
        #: Turns answered with `--ack fast` so far, every session's: each one's number.
        self._answered = 0
        self._unlock: Callable[[], Any] | None = None
        #: Sessions reopened from the data directory: (id, turns, repaired bytes or 0).
        self.reopened: list[tuple[str, int, int]] = []
        #: The turns answered with `--ack fast` and never recorded that the ack ledger
        #: carries from earlier runs, by reason (`killed`: lost with a killed process).
        self.lost_at_start: Counter[str] = Counter()
        self.ledger: AckLedger | None = None
        if self.data is not None:
            self.data.mkdir(parents=True, exist_ok=True)
            self._lock_data()
            try:
                self._reopen_all()
                self.ledger = AckLedger(self.data, _write_atomic)
                for sid, lost in self.ledger.reconcile(self._turn_counts()).items():
                    self._by_id[sid].dropped += lost.total()
                    self.lost_at_start += lost
            except BaseException:
                self._unlock_data()
                raise

    # ------------------------------------------------------------------ files

    def _lock_data(self) -> None:
        """Hold the data directory: a second server on it would overwrite, then unlink, the
        first one's session files. The lock is a `flock` on the directory itself (no file
        of its own among the sessions'), dropped by the OS when the process dies."""
        assert self.data is not None
        fd = os.open(self.data, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise DataDirectoryInUseError(
                f"the data directory {self.data} is in use by another rollout-store server "
                "(it holds a lock on the directory): stop that server, or give this one "
                "another --data"
            ) from None
        # closing the only descriptor drops the flock: at `close`, or when this object is
        # collected without one (an app made and never served)
        self._unlock = weakref.finalize(self, os.close, fd)

    def _unlock_data(self) -> None:
        if self._unlock is not None:
            self._unlock()

    def _path(self, session_id: str, suffix: str) -> Path:
        assert self.data is not None
        path = (self.data / f"{session_id}{suffix}").resolve()
        if path.parent != self.data:  # ids are validated; this is the second fence
            raise SessionError(f"session id {session_id!r} names a path outside the data directory")
        return path

    def _opener(self, session_id: str) -> _Opener:
        return _Opener(self, session_id)

    def _open_graph(self, session_id: str) -> RolloutGraph:
        """The one place a session's graph is made (the content store joins here)."""
        if self.data is None:
            return RolloutGraph(store=self.store, cache=self.cache)
        log = self._path(session_id, ".rls")
        size = log.stat().st_size if log.exists() else 0
        try:
            graph = RolloutGraph.open(
                log,
                fsync=self.fsync,
                repair=True,
                store=self.store,
                cache=self.cache,
                blobs=self.blobs,
            )
        except StoreUnavailableError:
            raise  # the store is down: nothing is damaged, the next use tries again
        except (CorruptFileError, StoreError) as exc:
            raise SessionDamagedError(self.damage_report(session_id, exc)) from None
        report = graph.load_report
        if size and session_id not in self._by_id:  # at start, not an idle session's reopen
            cut = size - report.good_bytes if report is not None and not report.ok else 0
            self.reopened.append((session_id, len(graph), cut))
        return graph

    def damage_report(self, session_id: str, exc: BaseException) -> str:
        """What is wrong with a session that cannot be read, and how to repair it: the
        object and the file, and the `rollout-store` command that saves what is intact."""
        text = f"session {session_id!r} cannot be read: {exc}"
        key = getattr(exc, "key", None)
        if isinstance(key, bytes) and isinstance(self.store, DirectoryStore):
            text += f"; the object's file is {self.store.object_path(key)}"
        if self.data is None:
            return text
        log = self._path(session_id, ".rls")
        store = "" if self.blobs == "inline" else " --store STORE (the server's --store)"
        try:
            turns = verify(log, store=self.store).turns
        except (OSError, RolloutStoreError):
            turns = 0
        keep = f"the {turns} complete turn{'s' if turns != 1 else ''} before the damage"
        return (
            f"{text}; the session's log is {log}. Put the object's original content back if "
            f"you have it; else stop the server, run `rollout-store recover {log} -o OUT"
            f"{store}`, which saves {keep} to OUT, and move OUT over {log.name}"
        )

    def _turn_counts(self) -> dict[str, int | None]:
        with self._lock:
            sessions = list(self._by_id.values())
        return {session.session_id: session.turns() for session in sessions}

    def answered(
        self, session: Session, turn: object, line: str | None = None, entry: int = 0
    ) -> None:
        """(`--ack fast`) A turn of `session` is about to be answered before it is
        recorded: the ack ledger has its line first (with a data directory), and the turn
        (`turn`: what the server tracks it by, the same object until it is settled) is
        unsettled until `recorded` or `not_recorded` says what it became. `line`: a turn the
        Rust data plane's direct lane answered, its ledger line written by it already
        (`written`), or not (`failed`: its write failed; `retired`: its session was
        deleted first; `entry`: a written line's number in the ledger's appender)."""
        with self._settle:
            self._answered += 1
            if session._waiting is None:
                session._waiting = {}
            session._waiting.pop(id(turn), None)  # (an id reused: to the end, in order)
            session._waiting[id(turn)] = self._answered
        if self.ledger is None:
            return
        if line is None:
            self.ledger.answered(session.session_id, self._turn_counts, lambda: session.closed)
        elif line != "retired":
            self.ledger.applied(
                session.session_id, line == "written", entry, gone=lambda: session.closed
            )

    def ledger_file(self) -> Ledger | None:
        """The ack ledger's file appender (`--ack fast`: the Rust data plane's direct lane
        writes to it once it is open; the first line of a server, this one's, opens it);
        None without a data directory."""
        return None if self.ledger is None else self.ledger.file

    def recorded(self, session: Session, turn: object) -> None:
        """A turn of `session` is recorded: it is settled (nothing is unsettled in `--ack
        durable`, whose turns are recorded before they are answered)."""
        self._settled_one(session, turn)

    def not_recorded(self, session: Session, reason: str, turn: object) -> None:
        """(`--ack fast`) One of those turns is dropped, counted now (`reason`)."""
        self._settled_one(session, turn)
        if self.ledger is not None:
            self.ledger.dropped(session.session_id, reason, lambda: session.closed)

    def _settled_one(self, session: Session, turn: object) -> None:
        with self._settle:
            waiting = session._waiting
            if waiting is not None and waiting.pop(id(turn), None) is not None:
                if not waiting:
                    session._waiting = None
                self._settle.notify_all()

    def answered_so_far(self) -> int:
        """The number of the last turn answered so far (`--ack fast`, any session's): what
        `settled_through` is asked of."""
        with self._settle:
            return self._answered

    def settled_through(self, session: Session, answered: int) -> bool:
        """Whether every turn of `session` numbered up to `answered` is recorded or counted
        as dropped, whatever became of later ones (its turns settle out of their order: a
        later one dropped by a full queue while an earlier one waits for its graph)."""
        with self._settle:
            return _settled_through(session, answered)

    def wait_settled(self, session: Session, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until every turn of `session` answered so far
        is recorded or counted as dropped; whether it was."""
        answered = self.answered_so_far()
        with self._settle:
            return self._settle.wait_for(lambda: _settled_through(session, answered), timeout)

    def _reopen_all(self) -> None:
        assert self.data is not None
        for meta_path in sorted(self.data.glob("*.json")):
            session_id = clean_session_id(meta_path.stem)
            if session_id is None:
                continue
            try:
                meta = json.loads(meta_path.read_text(encoding="utf-8"))
                key = meta["api_key"]
                if meta.get("session_id") != session_id or not isinstance(key, str):
                    raise ValueError("id or key missing")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise SessionError(f"session file {meta_path.name} is unreadable: {exc}") from None
            if meta_path.stat().st_mode & 0o077:  # written by an earlier version: it holds a key
                os.chmod(meta_path, 0o600)
            session = Session(
                session_id,
                key,
                self._opener(session_id),
                metadata=meta.get("metadata") or {},
                group=meta.get("group") if isinstance(meta.get("group"), str) else None,
                created_at=float(meta.get("created_at") or time.time()),
            )
            with contextlib.suppress(SessionDamagedError):  # kept, as damaged: see `damaged`
                graph = session.graph  # opened now: a torn tail is cut at start
                # the group is in both files; a crash between their writes leaves them apart,
                # and the log (what exports read) is the source of truth
                session.group = graph.group
            self._by_id[session_id] = session
            self._by_key[key_digest(key)] = session

    # ------------------------------------------------------------------ registry

    def _id_lock(self, session_id: str) -> threading.Lock:
        return self._id_locks[hash(session_id) % _ID_LOCKS]

    def create(
        self,
        session_id: str | None = None,
        *,
        metadata: dict[str, Any] | None = None,
        api_key: str | None = None,
        group: str | None = None,
        labels: list[str] | None = None,
    ) -> Session:
        """A new session (id minted unless given); raises `SessionError` if the id is taken.

        `group`: the group id (same pattern as a session id) its graph and listing carry;
        `labels`: labels set on its graph (see `RolloutGraph.add_labels`)."""
        if session_id is not None and clean_session_id(session_id) is None:
            raise SessionError(
                "session_id must be 1-128 letters, digits, '_', '.' or '-', starting with a "
                "letter or digit"
            )
        if group is not None and clean_session_id(group) is None:
            raise SessionError(
                "group must be 1-128 letters, digits, '_', '.' or '-', starting with a "
                "letter or digit"
            )
        if labels is not None:
            try:
                GraphMeta().with_labels(labels, add=True)
            except InvalidValueError as exc:
                raise SessionError(str(exc)) from None
        sid = session_id or f"s-{secrets.token_hex(8)}"
        # a delete of this id finishes (its files gone) before the new session's are made
        with self._id_lock(sid):
            with self._lock:
                if sid in self._by_id:
                    raise SessionError(f"session {sid!r} already exists")
            key = (
                api_key if api_key is not None else f"{self.key_prefix}{secrets.token_urlsafe(24)}"
            )
            created = time.time()
            if self.ledger is not None:  # an earlier session of this id's lines end here
                self.ledger.forget(sid)
            if self.data is not None:
                doc: dict[str, Any] = {
                    "session_id": sid,
                    "api_key": key,
                    "metadata": metadata or {},
                    "created_at": created,
                }
                if group is not None:
                    doc["group"] = group
                _write_atomic(self._path(sid, ".json"), json.dumps(doc).encode("ascii"))
            session = Session(
                sid,
                key,
                self._opener(sid),
                metadata=metadata or {},
                group=group,
                created_at=created,
            )
            log = self._path(sid, ".rls") if self.data is not None else None
            log_existed = log is not None and log.exists()
            try:
                graph = session.graph  # the log is created now
                if group is not None or labels:
                    graph.update_metadata(labels=labels or (), group=group)
            except BaseException:
                # nothing of the session is kept: its graph closed (its fd and flock let
                # go), its files gone, so a later create of this id starts afresh
                with contextlib.suppress(Exception):
                    session.close()
                if self.data is not None:
                    with contextlib.suppress(OSError):
                        self._path(sid, ".json").unlink()
                    if log is not None and not log_existed:
                        with contextlib.suppress(OSError):
                            log.unlink()
                raise
            with self._lock:
                self._by_id[sid] = session
                self._by_key[key_digest(key)] = session
                if self._key_watcher is not None:
                    self._key_watcher(key, session)
            return session

    def save_group(self, session: Session) -> None:
        """Write a session's changed group id to its file (with a data directory).

        Under its id's lock, and only while `session` is the one its id names: a session
        deleted meanwhile raises `SessionDeletedError` (its id may name a new session by
        now, whose file, holding the new key, must not be written over with the old one)."""
        if self.data is None:
            return
        sid = session.session_id
        doc: dict[str, Any] = {
            "session_id": sid,
            "api_key": session.api_key,
            "metadata": session.metadata,
            "created_at": session.created_at,
        }
        if session.group is not None:
            doc["group"] = session.group
        with self._id_lock(sid):
            with self._lock:
                if self._by_id.get(sid) is not session:
                    raise SessionDeletedError(f"session {sid!r} was deleted")
            _write_atomic(self._path(sid, ".json"), json.dumps(doc).encode("ascii"))

    def watch_keys(self, watcher: Callable[[str, Session | None], None] | None) -> None:
        """Tell `watcher` every session's key now (key, session), then each key added and
        removed (key, None) until it is replaced (None: no one)."""
        with self._lock:
            self._key_watcher = watcher
            if watcher is not None:
                for session in self._by_id.values():
                    watcher(session.api_key, session)

    def announce(self, session: Session) -> None:
        """Tell the key watcher of `session` again (its state changed: it was found damaged,
        see `_Opener`), if it is still the one its id names."""
        with self._lock:
            if self._key_watcher is not None and self._by_id.get(session.session_id) is session:
                self._key_watcher(session.api_key, session)

    def get(self, session_id: str) -> Session | None:
        with self._lock:
            return self._by_id.get(session_id)

    def by_key(self, api_key: str | None, session_id: str | None = None) -> Session | None:
        """The session whose key is `api_key` (never creates one). `session_id`: the session
        a table of keys kept by `watch_keys` names for it, tried first."""
        if api_key is None:
            return None
        with self._lock:
            found = self._by_id.get(session_id) if session_id is not None else None
            if found is not None and found.key_matches(api_key):
                return found
            found = self._by_key.get(key_digest(api_key))
        return found if found is not None and found.key_matches(api_key) else None

    def resolve(self, api_key: str | None, session_id: str | None = None) -> Session | None:
        """The session an API key names; in open mode an unknown valid key creates one.
        `session_id`: as for `by_key`.

        Open mode serves only open sessions (those made from a key): a key that is the id of
        a session with a key of its own is refused, never let into that session."""
        found = self.by_key(api_key, session_id) if api_key else None
        if found is not None or not self.open_mode:
            return found
        sid = clean_session_id(api_key) if api_key else "default"
        if sid is None:
            return None
        key = api_key or ""
        with self._lock:
            found = self._by_id.get(sid)
        if found is None:
            try:
                return self.create(sid, api_key=key)
            except SessionError:
                with self._lock:
                    found = self._by_id.get(sid)
        return found if found is not None and found.key_matches(key) else None

    def ids(self) -> list[str]:
        with self._lock:
            return sorted(self._by_id)

    def all(self) -> list[Session]:
        with self._lock:
            return [self._by_id[k] for k in sorted(self._by_id)]

    def damaged(self) -> list[str]:
        """The ids of the sessions whose logs cannot be read."""
        return [s.session_id for s in self.all() if s.damaged is not None]

    def delete(self, session_id: str) -> bool:
        """Close a session and remove its files; False if there is no such session."""
        with self._id_lock(session_id):
            with self._lock:
                session = self._by_id.pop(session_id, None)
                if session is None:
                    return False
                self._by_key.pop(key_digest(session.api_key), None)
                if self._key_watcher is not None:
                    self._key_watcher(session.api_key, None)
            session.close()
            if self.ledger is not None:  # its lines end here (made again, it starts afresh)
                self.ledger.forget(session_id)
            if self.data is not None:
                for suffix in (".json", ".rls"):
                    with contextlib.suppress(FileNotFoundError):
                        self._path(session_id, suffix).unlink()
            return True

    def close(self) -> None:
        """Flush and close every session's log (the server is stopping), then let the data
        directory go. The ack ledger is rewritten first (every queued turn is recorded or
        counted by now): only what it carries is kept."""
        try:
            if self.ledger is not None:
                with contextlib.suppress(OSError):
                    self.ledger.reconcile(self._turn_counts())
                self.ledger.close()
            for session in self.all():
                session.close()
        finally:
            self._unlock_data()

    def release_idle(self, idle_seconds: float) -> int:
        """Let go of the graphs of sessions over a log unused for `idle_seconds`."""
        if self.data is None:
            return 0
        return sum(session.release_if_idle(idle_seconds) for session in self.all())

    def drop_idle_caches(self, idle_seconds: float) -> int:
        """Let go of the caches of the graphs of sessions unused for `idle_seconds` (what a
        server without a data directory does for idle sessions: their graphs stay)."""
        return sum(session.drop_caches_if_idle(idle_seconds) for session in self.all())

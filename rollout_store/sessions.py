"""The capture server's sessions: one rollout graph per API key, durable in a data directory.

A session is minted by `Sessions.create`, which returns its id and the API key an agent's SDK
sends; the key is how each request finds its session. With a data directory every session is
`<id>.json` (id, key, metadata, creation time; written atomically before the session is
handed out) and `<id>.rls` (the graph's append-only log, opened with `RolloutGraph.open`). A
restarted server reopens every session from its files, repairing a torn last record, and
goes on appending. Session ids are checked against a strict pattern and every path is
confirmed to lie inside the data directory, so no request can name a file elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .content import ContentStore, StringCache
from .errors import InvalidValueError, RolloutStoreError
from .metadata import GraphMeta
from .storage import RolloutGraph
from .stores import MemoryStore

__all__ = ["Session", "SessionError", "Sessions", "clean_session_id"]

_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_KEY_PREFIX = "rsk-"


class SessionError(RolloutStoreError, ValueError):
    """A session request that cannot be honoured (bad id, taken id, unusable file)."""


def clean_session_id(value: Any) -> str | None:
    """`value` if it is a valid session id (letters, digits, `_.-`, at most 128), else None."""
    if isinstance(value, str) and _SESSION_ID.fullmatch(value) and ".." not in value:
        return value
    return None


@dataclass(slots=True)  # no instance dict: a server holds one per session, idle or not
class Session:
    """One rollout: its key, its graph (opened on demand) and bookkeeping.

    Counters live in memory only. A session over a log can let its graph go when idle
    (`release_if_idle`): it then holds only its counts, and the graph is reopened from the
    log by the next use.
    """

    session_id: str
    api_key: str
    opener: Callable[[], RolloutGraph]
    metadata: dict[str, Any] = field(default_factory=dict)
    group: str | None = None  # the group (a GRPO group) it belongs to; its graph's too
    created_at: float = field(default_factory=time.time)
    last_turn_at: float | None = None
    last_used: float = field(default_factory=time.time)
    upstream_errors: int = 0
    recorded: int = 0
    rejected: int = 0
    users: int = 0
    _graph: RolloutGraph | None = None
    _counts: dict[str, Any] | None = None
    _cold: bool = False  # its graph's caches were let go while it was idle
    _closed: bool = False  # deleted (or the server stopped): its graph is never reopened
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def graph(self) -> RolloutGraph:
        """The session's graph, reopened from its log if it was let go."""
        with self._lock:
            if self._graph is None:
                if self._closed:  # a call in flight when it was deleted records nowhere
                    raise SessionError(f"session {self.session_id!r} was deleted")
                self._graph = self.opener()
                self._counts = None
            return self._graph

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

    def close(self) -> None:
        with self._lock:
            graph, self._graph = self._graph, None
            self._closed = True
        if graph is not None:
            graph.close()

    def capture_level(self) -> str:
        """ "tokens" when every turn carries the engine's token ids, else "text"."""
        counts = self._counts if self._graph is None else None
        if counts is None:
            with self.use() as graph:
                counts = _counts(graph)
        level: str = counts["capture_level"]
        return level

    def info(self) -> dict[str, Any]:
        """Counts for `GET /sessions/{id}` (ids-only queries; an idle session is not reopened)."""
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
            "metadata": self.metadata,
            "group": self.group,
        }


def _counts(graph: RolloutGraph) -> dict[str, Any]:
    ids = graph.node_ids()
    tokens = bool(ids) and all(graph.summary(n)["n_prompt"] > 0 for n in ids)
    return {
        "turns": len(ids),
        "roots": len(graph.root_ids()),
        "leaves": len(graph.leaf_ids()),
        "forks": len(graph.fork_ids()),
        "discarded": len(graph.discarded_ids()),
        "capture_level": "tokens" if tokens else "text",
    }


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as fp:
            fp.write(data)
            fp.flush()
            os.fsync(fp.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Sessions:
    """Every session of one server, by id and by API key.

    `data`: the directory holding session files (None keeps sessions in memory only).
    `fsync`: the logs' policy ("turn", N or "never"). `open_mode`: an unknown key creates a
    session named after it instead of being refused. `store`: the content store every
    session's graph shares (a new `MemoryStore` if None), `cache`: the one string cache of
    all sessions over an out-of-process store. Logs hold their strings inline over a memory
    store (it dies with the process) and references into any other store (`blobs="store"`).
    """

    def __init__(
        self,
        data: str | os.PathLike[str] | None = None,
        *,
        fsync: str | int = "turn",
        open_mode: bool = False,
        store: ContentStore | None = None,
        cache: StringCache | None = None,
    ) -> None:
        self.data = Path(data).resolve() if data is not None else None
        self.fsync = fsync
        self.open_mode = open_mode
        self.store: ContentStore = store if store is not None else MemoryStore()
        self.cache = cache if cache is not None else StringCache()
        self.blobs = "inline" if isinstance(self.store, MemoryStore) else "store"
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}
        self._lock = threading.Lock()
        #: Sessions reopened from the data directory: (id, turns, repaired bytes or 0).
        self.reopened: list[tuple[str, int, int]] = []
        if self.data is not None:
            self.data.mkdir(parents=True, exist_ok=True)
            self._reopen_all()

    # ------------------------------------------------------------------ files

    def _path(self, session_id: str, suffix: str) -> Path:
        assert self.data is not None
        path = (self.data / f"{session_id}{suffix}").resolve()
        if path.parent != self.data:  # ids are validated; this is the second fence
            raise SessionError(f"session id {session_id!r} names a path outside the data directory")
        return path

    def _opener(self, session_id: str) -> Callable[[], RolloutGraph]:
        return lambda: self._open_graph(session_id)

    def _open_graph(self, session_id: str) -> RolloutGraph:
        """The one place a session's graph is made (the content store joins here)."""
        if self.data is None:
            return RolloutGraph(store=self.store, cache=self.cache)
        log = self._path(session_id, ".rls")
        size = log.stat().st_size if log.exists() else 0
        graph = RolloutGraph.open(
            log,
            fsync=self.fsync,
            repair=True,
            store=self.store,
            cache=self.cache,
            blobs=self.blobs,
        )
        report = graph.load_report
        if size and session_id not in self._by_id:  # at start, not an idle session's reopen
            cut = size - report.good_bytes if report is not None and not report.ok else 0
            self.reopened.append((session_id, len(graph), cut))
        return graph

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
            session = Session(
                session_id,
                key,
                self._opener(session_id),
                metadata=meta.get("metadata") or {},
                group=meta.get("group") if isinstance(meta.get("group"), str) else None,
                created_at=float(meta.get("created_at") or time.time()),
            )
            session.graph  # noqa: B018 - opened now: a damaged log stops the server at start
            self._by_id[session_id] = session
            self._by_key[key] = session

    # ------------------------------------------------------------------ registry

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
        with self._lock:
            sid = session_id or f"s-{secrets.token_hex(8)}"
            if sid in self._by_id:
                raise SessionError(f"session {sid!r} already exists")
            key = api_key or f"{_KEY_PREFIX}{secrets.token_urlsafe(24)}"
            created = time.time()
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
            try:
                graph = session.graph  # the log is created now
                if group is not None or labels:
                    graph.update_metadata(labels=labels or (), group=group)
            except BaseException:
                if self.data is not None:
                    with contextlib.suppress(OSError):
                        self._path(sid, ".json").unlink()
                raise
            self._by_id[sid] = session
            self._by_key[key] = session
            return session

    def save_group(self, session: Session) -> None:
        """Write a session's changed group id to its file (with a data directory)."""
        if self.data is None:
            return
        doc: dict[str, Any] = {
            "session_id": session.session_id,
            "api_key": session.api_key,
            "metadata": session.metadata,
            "created_at": session.created_at,
        }
        if session.group is not None:
            doc["group"] = session.group
        _write_atomic(self._path(session.session_id, ".json"), json.dumps(doc).encode("ascii"))

    def in_group(self, group: str) -> list[Session]:
        """The sessions created with this group id, by session id."""
        return [session for session in self.all() if session.group == group]

    def get(self, session_id: str) -> Session | None:
        with self._lock:
            return self._by_id.get(session_id)

    def resolve(self, api_key: str | None) -> Session | None:
        """The session an API key names; in open mode an unknown valid key creates one."""
        if api_key:
            with self._lock:
                found = self._by_key.get(api_key)
            if found is not None:
                return found
        if not self.open_mode:
            return None
        sid = clean_session_id(api_key) if api_key else "default"
        if sid is None:
            return None
        with self._lock:
            found = self._by_id.get(sid)
        if found is not None:
            return found
        try:
            return self.create(sid, api_key=api_key or "")
        except SessionError:
            with self._lock:
                return self._by_id.get(sid)

    def ids(self) -> list[str]:
        with self._lock:
            return sorted(self._by_id)

    def all(self) -> list[Session]:
        with self._lock:
            return [self._by_id[k] for k in sorted(self._by_id)]

    def delete(self, session_id: str) -> bool:
        """Close a session and remove its files; False if there is no such session."""
        with self._lock:
            session = self._by_id.pop(session_id, None)
            if session is None:
                return False
            self._by_key.pop(session.api_key, None)
        session.close()
        if self.data is not None:
            for suffix in (".json", ".rls"):
                with contextlib.suppress(FileNotFoundError):
                    self._path(session_id, suffix).unlink()
        return True

    def close(self) -> None:
        """Flush and close every session's log (the server is stopping)."""
        for session in self.all():
            session.close()

    def release_idle(self, idle_seconds: float) -> int:
        """Let go of the graphs of sessions over a log unused for `idle_seconds`."""
        if self.data is None:
            return 0
        return sum(session.release_if_idle(idle_seconds) for session in self.all())

    def drop_idle_caches(self, idle_seconds: float) -> int:
        """Let go of the caches of the graphs of sessions unused for `idle_seconds` (what a
        server without a data directory does for idle sessions: their graphs stay)."""
        return sum(session.drop_caches_if_idle(idle_seconds) for session in self.all())

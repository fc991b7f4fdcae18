"""A local web page that shows a rollout: its tree of turns, each turn's messages and tokens.

`Viewer(graph).respond(path, query)` answers one GET request with a `Response` (status,
headers, body bytes) and knows nothing of any web framework: the CLI serves it with the
standard library's `http.server` (`serve`), and any other server (the capture server's ASGI
app, a WSGI app) can mount it by passing it the request path and query string. That keeps
the library free of a web framework dependency and lets one object answer in every host.

The page is static HTML, JavaScript and CSS shipped in the package (no CDN, no network):
it fetches small JSON documents (`/api/figures`, `/api/rows`, `/api/turn`, `/api/messages`,
`/api/export-size`, `/api/timeline`) for only the rows and the turn on screen, and builds its
DOM with `textContent`, so message content is never parsed as HTML. A Content-Security-Policy allows
scripts, styles and connections to this origin only, and images from this origin or `data:`.
The page uses relative URLs, so it works mounted under any prefix (`asgi_app` for ASGI).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import threading
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, NamedTuple
from urllib.parse import parse_qs, urlsplit

from ..errors import StoreError
from ..export.figures import plain_export_bytes, store_figures
from ..graph import Graph
from .hosts import LOOPBACK_HOSTS, host_allowed

__all__ = ["Response", "Viewer", "asgi_app", "favicon", "request_handler", "serve"]

#: Rows per `/api/rows` page, at most.
MAX_ROWS = 500
#: Messages per `/api/turn` or `/api/messages` answer, at most.
MAX_MESSAGES = 100
#: Timed calls drawn in the timeline lanes, at most.
MAX_TIMED = 5000
#: Characters of the response shown next to a row in the tree.
PREVIEW_CHARS = 80
#: Ints beyond this magnitude are sent as text (JavaScript numbers would round them).
_JS_SAFE_INT = 2**53

_STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/static/viewer.js": ("viewer.js", "text/javascript; charset=utf-8"),
    "/static/viewer.css": ("viewer.css", "text/css; charset=utf-8"),
    "/static/favicon.svg": ("favicon.svg", "image/svg+xml"),
    # browsers ask for it at the root whatever the page links (an SVG answers it)
    "/favicon.ico": ("favicon.svg", "image/svg+xml"),
}


def favicon() -> bytes:
    """The viewer's icon (SVG), also served by the capture server at its `/favicon.ico`."""
    return resources.files(__package__).joinpath("static", "favicon.svg").read_bytes()


_SECURITY_HEADERS = (
    (
        "Content-Security-Policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
)


class Response(NamedTuple):
    """One answer: HTTP status, headers (name, value pairs) and the body."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


def _shown(value: Any) -> Any:
    """A leaf JSON.parse reads as shown: non-finite floats and huge ints become text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value if -_JS_SAFE_INT <= value <= _JS_SAFE_INT else str(value)
    return repr(value)


def _displayable(value: Any) -> Any:
    """A copy JSON.parse reads as shown (each leaf as `_shown` gives it), made without
    recursion: a recorded value nests up to MAX_DEPTH levels."""
    top: list[Any] = [None]
    # (value, the copy it goes in, its key there); items are pushed last first, so they are
    # set in order (of two keys that show alike, the later wins, as in a dict display)
    stack: list[tuple[Any, Any, Any]] = [(value, top, 0)]
    while stack:
        item, into, key = stack.pop()
        if isinstance(item, dict):
            copy: Any = {}
            pairs = [(k if isinstance(k, str) else json.dumps(k), v) for k, v in item.items()]
            for name, _ in pairs:
                copy[name] = None
            stack.extend((v, copy, name) for name, v in reversed(pairs))
        elif isinstance(item, list | tuple):
            copy = [None] * len(item)
            stack.extend((item[i], copy, i) for i in range(len(item) - 1, -1, -1))
        else:
            copy = _shown(item)
        into[key] = copy
    return top[0]


def _json(status: int, document: Any) -> Response:
    body = json.dumps(_displayable(document), separators=(",", ":")).encode("ascii")
    headers = (("Content-Type", "application/json"), *_SECURITY_HEADERS)
    return Response(status, headers, body)


def _error(status: int, message: str) -> Response:
    return _json(status, {"error": message})


def _preview(response: Any) -> str:
    """A short line for the tree: the response's text, or the tools it calls. A response
    of an unexpected shape (an engine's bug, recorded as it came) previews what it can."""
    if not isinstance(response, dict):
        return "" if response is None else str(response)[:PREVIEW_CHARS]
    parts: list[str] = []
    content = response.get("content")
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list | tuple):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict) and part.get("type") == "tool_use":
                parts.append(f"-> {part.get('name')}()")
    calls = response.get("tool_calls")
    if isinstance(calls, list | tuple):
        for call in calls:
            if isinstance(call, dict):
                function = call.get("function")
                name = function.get("name") if isinstance(function, dict) else call.get("name")
                parts.append(f"-> {name}()")
    elif calls is not None:
        parts.append(f"[tool_calls: {json.dumps(_displayable(calls))[:40]}]")
    text = " ".join(" ".join(parts).split())
    return text[:PREVIEW_CHARS] + ("..." if len(text) > PREVIEW_CHARS else "")


def _runs(mask: list[int]) -> list[list[int]]:
    """The loss mask as [value, length] runs."""
    return [[value, sum(1 for _ in group)] for value, group in itertools.groupby(mask)]


class Viewer:
    """Answers the viewer page's requests for one graph.

    `title` names the rollout on the page (a file name); `file_size` is shown with the store
    figures when the graph was read from a file. The graph may keep growing while it is
    viewed: the tree is rebuilt when its turn count changes.
    """

    def __init__(
        self,
        graph: Graph,
        *,
        title: str = "rollout",
        file_size: int | None = None,
        labels: Any = None,
    ) -> None:
        self.graph = graph
        self.title = title
        self.file_size = file_size
        self.labels = labels  # shown under the title when given (a session's labels)
        self._lock = threading.Lock()
        self._rows: list[_Row] = []
        self._positions: dict[str, int] = {}
        self._rows_for = -1
        self._discarded: set[str] = set()
        self._export_size: tuple[int, int] | None = None

    # ------------------------------------------------------------ the tree

    def _tree(self) -> tuple[list[_Row], set[str]]:
        """Rows in depth-first order (see `_Row`). A fork whose children are retries (at
        most one of them goes on) draws them as siblings one level into the chain's lane,
        and later retries of that chain stay there: a long rollout with many retries does
        not drift right. A fork where several children go on opens a lane per child."""
        with self._lock:
            n = len(self.graph)
            if n != self._rows_for:
                graph = self.graph
                rows: list[_Row] = []
                stack = [_Row(root, 0, 0, "") for root in reversed(graph.root_ids())]
                while stack:
                    row = stack.pop()
                    rows.append(row)
                    children = graph.child_ids(row.node_id)
                    if len(children) == 1:  # the chain goes on (under a sibling: "through")
                        through = "through" if row.branch in ("sibling", "through") else ""
                        stack.append(_Row(children[0], row.indent, row.lane, through))
                        continue
                    going_on = sum(1 for child in children if graph.child_ids(child))
                    if going_on > 1:  # a real branch: a lane per child
                        indent = lane = row.indent + 1
                    else:  # retries: siblings, one level into the chain's lane
                        indent, lane = row.lane + 1, row.lane
                    last = len(children) - 1
                    stack.extend(
                        _Row(child, indent, lane, "last" if i == last else "sibling")
                        for i, child in reversed(list(enumerate(children)))
                    )
                self._rows = rows
                self._positions = {row.node_id: i for i, row in enumerate(rows)}
                try:
                    self._discarded = set(graph.discarded_ids())
                except StoreError:  # (it compares requests: one long string the store cannot
                    # give leaves the tree whole, no turn marked discarded)
                    self._discarded = set()
                self._rows_for = n
            return self._rows, self._discarded

    def _row(self, row: _Row, discarded: set[str], drift: dict[str, Any]) -> dict[str, Any]:
        graph = self.graph
        node_id = row.node_id
        summary = graph.summary(node_id)
        try:
            preview = _preview(graph.response_message(node_id))
        except Exception as exc:  # one turn that cannot be previewed leaves the tree whole
            preview = f"(no preview: {type(exc).__name__})"
        return {
            "id": node_id,
            "indent": row.indent,
            "branch": row.branch,
            "parent": summary["parent_id"],
            "children": len(graph.child_ids(node_id)),
            "discarded": node_id in discarded,
            "link": summary["link"],
            "n_prompt": summary["n_prompt"],
            "n_sampled": summary["n_sampled"],
            "model": summary["model"],
            "session": summary["harness_session_id"],
            "preview": preview,
            "drift": drift.get(node_id),
        }

    def _sessions(self) -> list[dict[str, Any]]:
        """The harness sessions the turns belong to, each with its first turn and count."""
        found: dict[Any, dict[str, Any]] = {}
        for node_id in self.graph.node_ids():
            session = self.graph.summary(node_id)["harness_session_id"]
            if session is None:
                continue
            entry = found.get(session)
            if entry is None:
                found[session] = {"id": session, "first": node_id, "turns": 1}
            else:
                entry["turns"] += 1
        return list(found.values())

    # ------------------------------------------------------------ answers

    def _figures(self) -> Response:
        rows, _ = self._tree()
        figures = store_figures(self.graph)
        figures.update(
            title=self.title,
            rows=len(rows),
            file_bytes=self.file_size,
            labels=self.labels,
            sessions=self._sessions(),
        )
        figures["drift"] = len(self.graph.drift())
        figures["timed"] = len(self.graph.timelines())
        return _json(200, figures)

    def _timeline(self) -> Response:
        """Where the time went, a lane per harness session (turns without one share a
        lane): each timed call's span from its request received to its reply sent, the
        engine's part of it, and the wait before it since the call it continues (the
        agent's and its tools' time). Milliseconds from the first call received."""
        graph = self.graph
        timed = graph.timelines()
        if not timed:
            return _json(200, {"lanes": [], "span_ms": 0, "calls": 0})
        first = min(t.received for t in timed.values())
        lanes: dict[Any, list[dict[str, Any]]] = {}
        end = 0
        for node_id, t in itertools.islice(timed.items(), MAX_TIMED):
            start = t.received - first
            end = max(end, start + t.reply_sent)
            session = graph.summary(node_id)["harness_session_id"]
            lanes.setdefault(session, []).append(
                {
                    "id": node_id,
                    "start_ms": start / 1000,
                    "engine_from_ms": (start + t.upstream_sent) / 1000,
                    "engine_to_ms": (start + t.last_byte) / 1000,
                    "end_ms": (start + t.reply_sent) / 1000,
                    "tools_ms": None if t.gap_before is None else t.gap_before / 1000,
                    "failed": t.failed_attempts,
                    "chunks": t.chunks,
                }
            )
        return _json(
            200,
            {
                "lanes": [{"session": k, "calls": v} for k, v in lanes.items()],
                "span_ms": end / 1000,
                "calls": len(timed),
            },
        )

    def _rows_page(self, query: dict[str, list[str]]) -> Response:
        offset = _int(query, "offset", 0)
        limit = min(_int(query, "limit", 100), MAX_ROWS)
        rows, discarded = self._tree()
        page = rows[offset : offset + limit]
        drift = {entry["node_id"]: entry for entry in self.graph.drift()}
        return _json(
            200,
            {
                "offset": offset,
                "total": len(rows),
                "rows": [self._row(row, discarded, drift) for row in page],
            },
        )

    def _turn(self, query: dict[str, list[str]]) -> Response:
        node_id = _str(query, "id")
        graph = self.graph
        summary = graph.summary(node_id)
        messages = graph.request_messages(node_id) or []
        parent = summary["parent_id"]
        # the parent's request is usually a prefix of this one: what follows it is new
        new_from = 0
        if parent is not None:
            new_from = min(len(graph.request_messages(parent) or ()), len(messages))
        start = max(0, min(new_from, len(messages) - MAX_MESSAGES))
        stop = min(len(messages), start + MAX_MESSAGES)
        sequence = graph.sequence_for(node_id)
        mask = sequence.loss_mask
        _, discarded = self._tree()
        timeline = graph.timeline(node_id)
        return _json(
            200,
            {
                "position": self._positions.get(node_id),
                "summary": summary,
                "children": graph.child_ids(node_id),
                "discarded": node_id in discarded,
                "drift": next((d for d in graph.drift() if d["node_id"] == node_id), None),
                "timeline": None if timeline is None else timeline.document(),
                "sampling_params": graph.sampling_params(node_id),
                "tools": graph.request_tools(node_id),
                "response": graph.response_message(node_id),
                "n_messages": len(messages),
                "new_from": new_from,
                "start": start,
                "messages": list(messages[start:stop]),
                "sequence": {
                    "n_tokens": len(mask),
                    "n_trained": sum(mask),
                    "prompt_len": sequence.prompt_len,
                    "n_turns": sequence.n_turns,
                    "mask_runs": _runs(mask),
                },
            },
        )

    def _messages(self, query: dict[str, list[str]]) -> Response:
        node_id = _str(query, "id")
        messages = self.graph.request_messages(node_id) or []
        start = max(0, _int(query, "start", 0))
        stop = min(len(messages), _int(query, "stop", start + MAX_MESSAGES), start + MAX_MESSAGES)
        return _json(
            200, {"start": start, "n_messages": len(messages), "messages": messages[start:stop]}
        )

    def _export_bytes(self) -> Response:
        n = len(self.graph)
        if self._export_size is None or self._export_size[0] != n:
            self._export_size = (n, plain_export_bytes(self.graph))
        return _json(200, {"turns": n, "plain_export_bytes": self._export_size[1]})

    def respond(self, path: str, query: str = "") -> Response:
        """Answer a GET of `path` (without the query) with `query` (the raw query string)."""
        static = _STATIC.get(path)
        if static is not None:
            name, content_type = static
            body = resources.files(__package__).joinpath("static", name).read_bytes()
            return Response(200, (("Content-Type", content_type), *_SECURITY_HEADERS), body)
        # (an id may hold a lone surrogate: the page sends it as surrogatepass UTF-8)
        params = parse_qs(query, keep_blank_values=True, errors="surrogatepass")
        try:
            if path == "/api/figures":
                return self._figures()
            if path == "/api/rows":
                return self._rows_page(params)
            if path == "/api/turn":
                return self._turn(params)
            if path == "/api/messages":
                return self._messages(params)
            if path == "/api/export-size":
                return self._export_bytes()
            if path == "/api/timeline":
                return self._timeline()
        except _BadQuery as exc:
            return _error(400, str(exc))
        except StoreError as exc:  # (a missing object is a LookupError too: not a bad id)
            return _error(
                502,
                f"a turn's long strings cannot be read from the content store: {exc}",
            )
        except LookupError as exc:  # a node id the graph does not hold
            return _error(404, str(exc.args[0]) if exc.args else "no such turn")
        return _error(404, f"no page {path!r}")


class _Row(NamedTuple):
    """A row of the tree: the turn, how far in it is drawn, the lane (indent) its chain
    keeps, and "sibling" or "last" for a child of a fork, "through" for a turn of the chain
    that goes on from a "sibling" (a later sibling follows it), "" otherwise."""

    node_id: str
    indent: int
    lane: int
    branch: str


class _BadQuery(ValueError):
    """A query parameter is missing or malformed (answered with status 400)."""


def _str(query: dict[str, list[str]], name: str) -> str:
    values = query.get(name)
    if not values:
        raise _BadQuery(f"missing query parameter {name!r}")
    return values[0]


def _int(query: dict[str, list[str]], name: str, default: int) -> int:
    values = query.get(name)
    if not values:
        return default
    try:
        value = int(values[0])
    except ValueError:
        raise _BadQuery(f"query parameter {name!r} must be an integer") from None
    if value < 0:
        raise _BadQuery(f"query parameter {name!r} must not be negative")
    return value


_Scope = MutableMapping[str, Any]
_Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
_Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def asgi_app(viewer: Viewer) -> Callable[[_Scope, _Receive, _Send], Awaitable[None]]:
    """A plain ASGI application answering from `viewer`, to mount in any ASGI server
    (for example `Mount("/viewer", app=asgi_app(viewer))` in Starlette). GET and HEAD only;
    the page is served at the mount's path with a trailing slash."""

    async def app(scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] != "http":
            return
        root = scope.get("root_path", "")
        path = scope["path"]
        if root and path.startswith(root):  # servers that keep the mount prefix in `path`
            path = path[len(root) :]
        if scope["method"] not in ("GET", "HEAD"):
            response = _error(405, "the viewer answers GET requests only")
        elif path == "":
            location = root + "/"
            response = Response(307, (("Location", location),), b"")
        else:
            query = scope.get("query_string", b"").decode("latin-1")
            response = viewer.respond(path, query)
        headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in response.headers]
        headers.append((b"content-length", str(len(response.body)).encode("ascii")))
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        body = b"" if scope["method"] == "HEAD" else response.body
        await send({"type": "http.response.body", "body": body})

    return app


def request_handler(viewer: Viewer) -> type[BaseHTTPRequestHandler]:
    """An `http.server` handler class answering GET requests from `viewer`.

    Requests whose Host header is not a loopback name are refused, so a web page elsewhere
    cannot read the rollout through DNS rebinding.
    """

    class Handler(BaseHTTPRequestHandler):
        server_version = "rollout-store-viewer"

        def do_GET(self) -> None:
            if not host_allowed(self.headers.get("Host"), LOOPBACK_HOSTS):
                response = _error(403, "the viewer answers loopback requests only")
            else:
                url = urlsplit(self.path)
                response = viewer.respond(url.path, url.query)
            self.send_response(response.status)
            for name, value in response.headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(response.body)))
            self.end_headers()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.wfile.write(response.body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a local viewer: no access log on the terminal

    return Handler


@contextlib.contextmanager
def serve(viewer: Viewer, port: int = 0, host: str = "127.0.0.1") -> Iterator[ThreadingHTTPServer]:
    """Serve `viewer` on `host:port` (0: a free port) in a background thread until exit.

    `server.server_address[1]` is the port in use.
    """
    server = ThreadingHTTPServer((host, port), request_handler(viewer))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="rollout-store-viewer")
    thread.daemon = True
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()

"""Record an agent without changing it: `capture()` for Python harnesses, `rollout-store run`.

Both make one session on a capture server: the one named (`server=`), or one started in
this process for the capture (`upstream=`, `data=`) on a free 127.0.0.1 port, in a thread
(the app of `server.create_app`, served by uvicorn as `rollout-store serve` does). The
session's base URLs and key are what the OpenAI and Anthropic SDKs read from their
environment variables (`env()`), or are handed to them by `openai_client()` /
`anthropic_client()`. Leaving the capture stops a server it started, which closes the
session's log (synced with `data`); the session's metadata (`annotate`, `reward`,
`label`) goes through the server's `PATCH /sessions/{id}`.

A `Capture` is safe to share between threads (its calls are independent HTTP requests over
one thread-safe client); `async with capture(...)` enters and leaves it in a worker thread,
so an event loop never waits on the server starting or stopping.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlencode

from ..errors import InvalidArgumentError, RolloutStoreError

__all__ = ["ENV_NAMES", "Capture", "CaptureError", "capture"]

#: The environment variables a capture sets for the agent (see `Capture.env`).
ENV_NAMES = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY")
#: Seconds the in-process server may take to start or stop.
START_TIMEOUT = 30.0
_HTTP_TIMEOUT = 60.0


class CaptureError(RolloutStoreError):
    """The capture server could not be started, reached or asked (the reason is said)."""


class _LocalServer:
    """The capture app served by uvicorn in a daemon thread on a free loopback port."""

    def __init__(self, upstream: str, data: str | None, admin_key: str, fsync: str) -> None:
        try:
            import uvicorn

            from .server import create_app, listen_socket
        except ImportError as exc:
            raise CaptureError(
                f"a capture server needs the server extra ({exc.name} is missing): "
                "pip install 'rollout_store[server]'"
            ) from None
        self.app = create_app(upstream, data=data, admin_key=admin_key, fsync=fsync)
        self._sock = listen_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._sock]},
            name="rollout-store-capture",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise CaptureError("the capture server did not start (see the log above)")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop serving; the app's shutdown closes every session (logs synced)."""
        self._server.should_exit = True
        self._thread.join(START_TIMEOUT)
        self._sock.close()


class Capture:
    """One captured session: where the agent sends its calls, and its metadata and export.

    Made by `capture(...)` (this class under the name a harness calls): `server`, the URL
    of a running capture server; or `upstream`, the engine's URL, for a server started in
    this process for the capture (`data`: the directory of its session logs; None keeps the
    session in memory, readable as `run.graph` afterwards; `admin_key` its admin key,
    random if None; `fsync` as for `serve`). `labels`, `group` and `session_id` are given
    to the new session.

    `base_url` is the OpenAI base URL (it ends in `/v1`), `anthropic_base_url` the
    Anthropic one (the server's root), `api_key` the session's key (both SDKs send it),
    `session_id` its id, `server_url` the server's root and `log_path` the session's log
    (with `data`; None otherwise).
    """

    def __init__(
        self,
        *,
        server: str | None = None,
        upstream: str | None = None,
        data: str | Path | None = None,
        labels: list[str] | tuple[str, ...] = (),
        group: str | None = None,
        session_id: str | None = None,
        admin_key: str | None = None,
        fsync: str = "turn",
    ) -> None:
        if (server is None) == (upstream is None):
            raise InvalidArgumentError(
                "capture needs server= (a running capture server) or upstream= (the engine "
                "a server started for the capture forwards to), not both"
            )
        if server is not None and data is not None:
            raise InvalidArgumentError("data= is for a server started for the capture only")
        if server is not None and admin_key is not None:
            raise InvalidArgumentError(
                "admin_key= is for a server started for the capture only: a running server "
                "has its own, and the session's key is used with it"
            )
        if isinstance(labels, str):
            labels = [labels]
        self._options = {
            "server": server,
            "upstream": upstream,
            "data": None if data is None else str(data),
            "admin_key": admin_key,
            "fsync": fsync,
        }
        self._create = {
            **({"session_id": session_id} if session_id is not None else {}),
            **({"group": group} if group is not None else {}),
            **({"labels": list(labels)} if labels else {}),
        }
        self._local: _LocalServer | None = None
        self._client: Any = None
        self._graph: Any = None
        self._document: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._state = "new"  # "open", then "closed"
        self.session_id = ""
        self.api_key = ""
        self.server_url = ""
        self.base_url = ""
        self.anthropic_base_url = ""
        self.log_path: str | None = None

    # -- lifecycle

    def start(self) -> Capture:
        """Start the server (if one is started for the capture) and create the session."""
        with self._lock:
            if self._state != "new":
                raise CaptureError("a capture is entered once")
            try:
                import httpx
            except ImportError:
                raise CaptureError(
                    "capture needs httpx: pip install 'rollout_store[server]'"
                ) from None
            options = self._options
            try:
                if options["server"] is None:
                    self._local = _LocalServer(
                        str(options["upstream"]),
                        options["data"],
                        options["admin_key"] or secrets.token_urlsafe(32),
                        str(options["fsync"]),
                    )
                    self.server_url = self._local.url
                else:
                    self.server_url = str(options["server"]).rstrip("/")
                self._client = httpx.Client(timeout=_HTTP_TIMEOUT, trust_env=False)
                created = self._request("POST", "/sessions", self._create, session=False)
            except BaseException:
                self._shutdown()
                raise
            self.session_id = created["session_id"]
            self.api_key = created["api_key"]
            self.base_url = created["openai_base_url"]
            self.anthropic_base_url = created["anthropic_base_url"]
            if self._local is not None and options["data"] is not None:
                self.log_path = str(Path(options["data"]) / f"{self.session_id}.rls")
            self._state = "open"
        return self

    def close(self) -> None:
        """End the capture: keep the session's export and graph for `export()` / `graph`,
        then stop a server started for it (its log is closed and synced). Idempotent."""
        with self._lock:
            if self._state != "open":
                return
            self._state = "closed"
            try:
                with contextlib.suppress(CaptureError, OSError):
                    self._document = self._request("GET", f"/sessions/{self.session_id}/export")
                if self._local is not None and self.log_path is None:
                    found = self._local.app.state.sessions.get(self.session_id)
                    if found is not None:
                        with contextlib.suppress(RolloutStoreError):
                            self._graph = found.graph  # memory only: the graph itself
            finally:
                self._shutdown()

    def _shutdown(self) -> None:
        if self._local is not None:
            self._local.stop()
            self._local = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> Capture:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Capture:
        import asyncio

        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        import asyncio

        await asyncio.to_thread(self.close)

    # -- the server's API

    def _request(self, method: str, path: str, payload: Any = None, *, session: bool = True) -> Any:
        client = self._client
        if client is None:
            raise CaptureError("the capture is not open: use it inside `with capture(...)`")
        headers = {"content-type": "application/json"}
        if session:
            headers["authorization"] = f"Bearer {self.api_key}"
        # json.dumps, not the client's encoder: NaN and every value as the graph takes it
        body = None if payload is None else json.dumps(payload).encode()
        try:
            answer = client.request(method, self.server_url + path, content=body, headers=headers)
        except Exception as exc:  # httpx's transport errors: the server is not reachable
            raise CaptureError(
                f"{method} {path} on {self.server_url} failed: {type(exc).__name__}: {exc}"
            ) from None
        if answer.status_code >= 400:
            raise CaptureError(
                f"{method} {path} on {self.server_url} answered {answer.status_code}: "
                f"{answer.text[:500]}"
            )
        return json.loads(answer.content)

    def _patch(self, payload: dict[str, Any]) -> dict[str, Any]:
        if self._state != "open":
            raise CaptureError("the capture is closed: its metadata is set while it is open")
        answer: dict[str, Any] = self._request("PATCH", f"/sessions/{self.session_id}", payload)
        return answer

    def annotate(self, values: dict[str, Any] | None = None, /, **more: Any) -> dict[str, Any]:
        """Set annotations on the session's graph (any JSON values by key); its metadata."""
        merged = dict(values or {})
        merged.update(more)
        return self._patch({"annotations": merged})

    def reward(self, value: float | None, leaf: str | None = None) -> dict[str, Any]:
        """Set the rollout's reward, or with `leaf` (a node id) that path's; None clears."""
        return self._patch({"rewards": {leaf: value}} if leaf is not None else {"reward": value})

    def label(self, *labels: str) -> dict[str, Any]:
        """Add labels to the session's graph."""
        return self._patch({"labels": list(labels)})

    def export(self, **params: Any) -> dict[str, Any]:
        """The session's export document (`GET /sessions/{id}/export`; `params` as its
        query, e.g. `messages=1`). After the capture, the one taken when it ended."""
        if self._state == "closed":
            if self._document is None:
                raise CaptureError("the session's export could not be taken when it ended")
            return self._document
        query = urlencode(params)
        document: dict[str, Any] = self._request(
            "GET", f"/sessions/{self.session_id}/export" + (f"?{query}" if query else "")
        )
        return document

    @property
    def graph(self) -> Any:
        """The session's `RolloutGraph`, once the capture has ended: loaded from its log
        (with `data`), or the graph the in-process server held (without)."""
        if self._state != "closed":
            raise CaptureError("the graph is read once the capture has ended")
        if self._graph is None and self.log_path is not None:
            from ..files.storage import RolloutGraph

            self._graph = RolloutGraph.load(self.log_path)
        if self._graph is None:
            raise CaptureError("the session lives on another server: read it there (export())")
        return self._graph

    # -- the agent's side

    def env(self) -> dict[str, str]:
        """The environment variables that point the OpenAI and Anthropic SDKs at the
        session (`ENV_NAMES`)."""
        return {
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_KEY": self.api_key,
            "ANTHROPIC_BASE_URL": self.anthropic_base_url,
            "ANTHROPIC_API_KEY": self.api_key,
        }

    def openai_client(self, *, asynchronous: bool = False, **kwargs: Any) -> Any:
        """An `openai.OpenAI` (or `AsyncOpenAI`) client of the session."""
        try:
            import openai
        except ImportError:
            raise CaptureError("openai_client needs the openai SDK: pip install openai") from None
        kind = openai.AsyncOpenAI if asynchronous else openai.OpenAI
        return kind(base_url=self.base_url, api_key=self.api_key, **kwargs)

    def anthropic_client(self, *, asynchronous: bool = False, **kwargs: Any) -> Any:
        """An `anthropic.Anthropic` (or `AsyncAnthropic`) client of the session."""
        try:
            import anthropic
        except ImportError:
            raise CaptureError(
                "anthropic_client needs the anthropic SDK: pip install anthropic"
            ) from None
        kind = anthropic.AsyncAnthropic if asynchronous else anthropic.Anthropic
        return kind(base_url=self.anthropic_base_url, api_key=self.api_key, **kwargs)


capture = Capture
"""A capture of one session, to use as `with capture(...) as run:` (or `async with`): the
class `Capture` under the name a harness calls, taking its options."""

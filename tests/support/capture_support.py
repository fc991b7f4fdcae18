"""Running the capture server and the stub engine on loopback for tests: in a thread of the
test process, or as a separate process that can be killed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from rollout_store.serve.loopback import stop_process
from rollout_store.serve.server import listen_socket

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 20.0
#: The admin key the tests' servers are started with (`create_app(admin_key=ADMIN_KEY)`, and
#: ROLLOUT_STORE_ADMIN_KEY for a server process), and the header that sends it.
ADMIN_KEY = "test-admin-key-0123456789"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
#: The key `new_session` was given for each session id, sent by `export`.
_KEYS: dict[str, str] = {}
#: `rust`: the capture servers the tests start serve their model routes with the engine's
#: data plane (`rollout-store serve --data-plane rust`; `serve_app` puts it in front of a
#: `create_app` app); anything else: the Python app alone.
DATA_PLANE = os.environ.get("ROLLOUT_STORE_DATA_PLANE", "python")


def auth(session_id: str) -> dict[str, str]:
    """The header opening a session's routes: its own key when `new_session` made it, else
    the admin key."""
    key = _KEYS.get(session_id)
    return {"authorization": f"Bearer {key}"} if key is not None else ADMIN


class Counting:
    """An ASGI wrapper counting the requests that reach the stub."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.calls = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.calls += 1
        await self.app(scope, receive, send)


class _Server(uvicorn.Server):
    """uvicorn's server, told to stop without waiting for its next tick (a tenth of a second,
    paid by each of the suite's many servers)."""

    _loop: asyncio.AbstractEventLoop | None = None
    _wake: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.1)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        """With no connection or task in flight, uvicorn's shutdown would only close the
        listeners, wait a tenth of a second for connections there are none of, and run the
        app's shutdown: that, without the wait."""
        state = self.server_state
        if state.connections or state.tasks or self.force_exit:
            await super().shutdown(sockets)
            return
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for server in self.servers:
            await server.wait_closed()
        await self.lifespan.shutdown()

    def stop(self) -> None:
        self.should_exit = True
        if self._loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                self._loop.call_soon_threadsafe(self._wake.set)


@contextlib.contextmanager
def serve_app(app: Any, data_plane: str | None = None) -> Iterator[str]:
    """Serve `app` with uvicorn in a thread on a free loopback port; yields its base URL.
    `data_plane` ("python", "rust"; default `DATA_PLANE`): for a capture server's app, who
    serves its model routes."""
    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=5
    )
    server = _Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.002)
    if (data_plane or DATA_PLANE) == "rust" and hasattr(getattr(app, "state", None), "server"):
        from rollout_store.serve.server import RustDataPlane

        port = RustDataPlane(app, host="127.0.0.1", port=0, backend_port=port).port
        # (the app's lifespan stops the plane)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        thread.join(WAIT_S)
        sock.close()


class Process:
    """A child process serving on loopback; `url` is read from its first line of output."""

    def __init__(self, args: list[str], pattern: str, env: dict[str, str] | None = None) -> None:
        env = {
            "ROLLOUT_STORE_ADMIN_KEY": ADMIN_KEY,
            **os.environ,
            **(env or {}),
            "PYTHONPATH": str(ROOT),
        }
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert self.proc.stdout is not None
        line = ""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line or self.proc.poll() is not None:
                break
        match = re.search(pattern, line)
        if match is None:
            self.proc.kill()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"child did not start: {line!r} {err[-2000:]}")
        self.url = match.group(1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(WAIT_S)

    def stop(self) -> int:
        return stop_process(self.proc, WAIT_S)


def start_server_process(upstream: str, *extra: str, env: dict[str, str] | None = None) -> Process:
    """`rollout-store serve` in a child process (`env`: variables added to this one's)."""
    plane = ["--data-plane", "rust"] if DATA_PLANE == "rust" else []
    return Process(
        ["-m", "rollout_store.cli", "serve", "--upstream", upstream, "--port", "0", *plane, *extra],
        r"serve: (http://127\.0\.0\.1:\d+)",
        env,
    )


def start_stub_process() -> Process:
    return Process(
        ["-m", "rollout_store.serve.stub_engine", "--port", "0"], r"on (http://[\d.]+:\d+)"
    )


def new_session(base: str, **payload: Any) -> dict[str, Any]:
    answer = httpx.post(f"{base}/sessions", json=payload, timeout=WAIT_S)
    answer.raise_for_status()
    doc: dict[str, Any] = answer.json()
    _KEYS[doc["session_id"]] = doc["api_key"]
    return doc


def export(base: str, session_id: str, messages: bool = True) -> dict[str, Any]:
    answer = httpx.get(
        f"{base}/sessions/{session_id}/export",
        params={"messages": "1" if messages else "0"},
        headers=auth(session_id),
        timeout=WAIT_S,
    )
    answer.raise_for_status()
    doc: dict[str, Any] = answer.json()
    return doc

"""What the capture server holds for a call in flight, and what it gives back when idle."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import httpx
import pytest
from capture_support import new_session, serve_app

from rollout_store.serve.idle_trim import IdleTrim, malloc_trim, with_idle_trim
from rollout_store.serve.server import create_app
from rollout_store.serve.stub_engine import create_stub_app

IMAGE = "data:image/png;base64," + "iVBORw0KGgo" * 30_000  # 330 KB: the body's bulk


class Snapshotting:
    """An ASGI wrapper around the stub that lists, while it answers a model call, the large
    buffers the capture server holds that it allocated itself (tracemalloc, innermost frame
    in the server module), at least half the request body's size: their sizes."""

    def __init__(self, app: Any, size: int) -> None:
        self.app = app
        self.size = size
        self.held: list[list[int]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in ("/v1/chat/completions", "/v1/messages"):
            snapshot = tracemalloc.take_snapshot()
            self.held.append(
                [
                    trace.size
                    for trace in snapshot.traces
                    if trace.size >= self.size // 2
                    and Path(trace.traceback[0].filename).parts[-2:] == ("serve", "server.py")
                ]
            )
        await self.app(scope, receive, send)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages"])
def test_a_call_waiting_for_the_upstream_lets_the_body_it_read_go(route: str) -> None:
    """While the upstream answers, a call holds the upstream's body and the conversation's
    raw text, not the body as it was read (with it, each call in flight held a third copy of
    its body) nor the conversation's decoded value."""
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}}]},
    ]
    body = json.dumps({"model": "m", "max_tokens": 8, "messages": messages}).encode()
    stub = Snapshotting(create_stub_app(), len(body))
    tracemalloc.start(1)
    try:
        # (the prepared path: a call of the Rust plane's direct lane has no Python object of
        # its body while the upstream answers, its plan made once the answer is in)
        with serve_app(stub) as upstream, serve_app(create_app(upstream, direct_lane=False)) as url:
            session = new_session(url)
            answer = httpx.post(
                url + route,
                content=body,
                headers={
                    "authorization": f"Bearer {session['api_key']}",
                    "content-type": "application/json",
                },
                timeout=20,
            )
    finally:
        tracemalloc.stop()
    assert answer.status_code == 200, answer.text
    (held,) = stub.held
    assert sys.getsizeof(body) not in held, held  # the body as read: a bytes of its size
    assert 1 <= len(held) <= 2, held


# ---------------------------------------------------------------- giving pages back when idle


async def _app(scope: Any, receive: Any, send: Any) -> None:
    """An ASGI app whose request waits for its `release` event (in the scope) before ending."""
    await scope["release"].wait()


async def _request(app: Any, release: asyncio.Event) -> None:
    await app({"type": "http", "release": release}, None, None)


async def _until(check: Any) -> None:
    for _ in range(500):  # bounded: a few event-loop turns suffice with a delay of 0
        if check():
            return
        await asyncio.sleep(0.001)


def test_idle_trim_runs_once_after_the_last_call_in_flight_ends() -> None:
    calls: list[int] = []

    async def scenario() -> None:
        trimmer = IdleTrim(_app, lambda: calls.append(1) or 1, delay=0)
        first, second = asyncio.Event(), asyncio.Event()
        one = asyncio.ensure_future(_request(trimmer, first))
        two = asyncio.ensure_future(_request(trimmer, second))
        await asyncio.sleep(0.01)
        first.set()
        await one
        await asyncio.sleep(0.01)
        assert calls == []  # another call is still in flight
        second.set()
        await two
        await _until(lambda: calls)
        assert calls == [1]
        await asyncio.sleep(0.01)
        assert calls == [1]  # once per idle spell: nothing ran since
        # a lifespan scope is not a call
        await trimmer({"type": "lifespan", "release": first}, None, None)
        await asyncio.sleep(0.01)
        assert calls == [1] and trimmer.trims == 1
        await _request(trimmer, first)
        await _until(lambda: len(calls) == 2)
        assert calls == [1, 1]

    asyncio.run(scenario())


def test_idle_trim_waits_for_its_delay() -> None:
    calls: list[int] = []

    async def scenario() -> None:
        trimmer = IdleTrim(_app, lambda: calls.append(1) or 1, delay=3600)
        done = asyncio.Event()
        done.set()
        await _request(trimmer, done)
        await asyncio.sleep(0.05)
        assert calls == []  # an hour has not passed

    asyncio.run(scenario())
    with pytest.raises(ValueError):
        IdleTrim(_app, lambda: 1, delay=-1)


def test_with_idle_trim_wraps_only_when_asked_and_on_glibc() -> None:
    assert with_idle_trim(_app, 0) is _app
    wrapped = with_idle_trim(_app, 1.0)
    on_glibc = platform.libc_ver()[0] == "glibc"
    assert isinstance(wrapped, IdleTrim) == on_glibc
    assert (malloc_trim() is not None) == on_glibc


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_malloc_trim_gives_the_free_heap_pages_back() -> None:
    """In a child process: 64 MiB of 32 KiB buffers (heap, below glibc's mmap threshold)
    freed but for the last, which keeps the heap from shrinking at its top: the pages stay
    resident until the trim gives them back."""
    script = (
        "import sys\n"
        "from rollout_store.serve.idle_trim import malloc_trim\n"
        "def rss():\n"
        "    return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
        "blocks = [bytearray(32 << 10) for _ in range(2048)]\n"
        "last = blocks[-1]\n"
        "del blocks\n"
        "before = rss()\n"
        "malloc_trim()()\n"
        "print(before - rss())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 32 << 20  # more than half of the 64 MiB came back

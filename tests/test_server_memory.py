"""What the capture server holds for a call in flight, and what it gives back when idle."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import httpx
import pytest
from capture_support import new_session, serve_app

from rollout_store.server import create_app
from rollout_store.stub_engine import create_stub_app

IMAGE = "data:image/png;base64," + "iVBORw0KGgo" * 30_000  # 330 KB: the body's bulk


class Snapshotting:
    """An ASGI wrapper around the stub that counts, while it answers a model call, the large
    buffers the capture server holds that it allocated itself (tracemalloc, innermost frame
    in the server module): copies of the request body, at least half its size."""

    def __init__(self, app: Any, size: int) -> None:
        self.app = app
        self.size = size
        self.copies: list[int] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in ("/v1/chat/completions", "/v1/messages"):
            snapshot = tracemalloc.take_snapshot()
            held = [
                trace.size
                for trace in snapshot.traces
                if trace.size >= self.size // 2
                and Path(trace.traceback[0].filename).parts[-2:] == ("rollout_store", "server.py")
            ]
            self.copies.append(len(held))
        await self.app(scope, receive, send)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages"])
def test_a_call_waiting_for_the_upstream_holds_two_copies_of_its_body(route: str) -> None:
    """The upstream's body and the conversation's raw text; the body as read is let go
    before the upstream is called (it was a third copy of every call in flight)."""
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}}]},
    ]
    body = json.dumps({"model": "m", "max_tokens": 8, "messages": messages}).encode()
    stub = Snapshotting(create_stub_app(), len(body))
    tracemalloc.start(1)
    try:
        with serve_app(stub) as upstream, serve_app(create_app(upstream)) as url:
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
    assert stub.copies and 1 <= stub.copies[0] <= 2, stub.copies

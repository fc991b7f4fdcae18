"""The Rust data plane of the capture server (`rollout-store serve --data-plane rust`).

The engine's `DataPlane` listens on the public port and serves the model routes
(`POST /v1/chat/completions`, `POST /v1/messages`) with hyper on a tokio runtime of its own:
the `Host`, `Origin` and `Content-Type` gate, the session key against a key table, the
body's size and time bounds and its depth, then the upstream call through a pooled client.
Every other request is proxied to the app `create_app` made, listening on a private loopback
socket: sessions, export, trace, viewer and health stay this package's Python, unchanged.

`RustDataPlane` is the control plane's side: it keeps the engine's key table current (the
sessions' keys as they are created, reopened and deleted), and answers the engine's
callbacks with the Python server's own code, so both planes refuse, record and reply alike:
`prepare` resolves the session and makes the upstream call ready (`_Server.plan`),
`finish` turns the upstream's answer into the reply and records the turn (`--ack durable`)
or hands it back to be queued (`--ack fast`), `record` records a queued turn on the engine's
recorder thread, `dropped` counts a queued turn that will not be, and `sent` records a
call's timeline once its reply is out. Each callback runs on an engine thread holding the
GIL. `close` stops the engine: no new call, the queued turns recorded (bounded), the rest
counted as dropped.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.responses import Response, StreamingResponse

from . import _core
from .errors import InvalidArgumentError
from .nodes import TurnNode
from .server import (
    ACK_DRAIN_SECONDS,
    _failure,
    _Passthrough,
    _Plan,
    _Refusal,
    _Server,
)
from .sessions import Session
from .sse import SSE_HEADERS
from .timeline import CallClock, failed_after

__all__ = ["DATA_PLANES", "RustDataPlane"]

#: The data planes `rollout-store serve --data-plane` offers.
DATA_PLANES = ("python", "rust")

_Reply = tuple[int, list[tuple[bytes, bytes]], list[bytes], bool]
_SSE_HEADERS = StreamingResponse(
    iter(()), media_type="text/event-stream", headers=SSE_HEADERS
).raw_headers


def _reply(response: Response) -> _Reply:
    return response.status_code, response.raw_headers, [bytes(response.body)], False


class _Call:
    """One model call between the engine's callbacks: its plan and, once answered, its turn."""

    __slots__ = ("node", "plan")

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan
        self.node: TurnNode | None = None


class RustDataPlane:
    """The engine's data plane in front of the app `create_app` made (`app`), which serves
    on loopback port `backend_port`; the public listener binds `host`:`port` (0: a free
    one, then `port` says which)."""

    def __init__(
        self, app: Starlette, *, host: str, port: int, backend_port: int, workers: int = 2
    ) -> None:
        server: _Server = app.state.server
        config = server.config
        if not server.upstream.startswith("http://"):
            raise InvalidArgumentError(
                f"the Rust data plane calls http:// upstreams only, not {server.upstream!r}: "
                "use --data-plane python for this upstream"
            )
        self._server = server
        self._sessions = server.sessions
        hosts = config.allowed_hosts
        self._engine = _core.DataPlane(
            self,
            host=host,
            port=port,
            backend_port=backend_port,
            upstream=server.upstream,
            hosts=None if hosts is None else sorted(hosts),
            open_mode=self._sessions.open_mode,
            max_body_bytes=config.max_body_bytes,
            body_timeout=config.body_timeout,
            body_timeout_text=f"{config.body_timeout:g}",
            upstream_timeout=config.upstream_timeout,
            fast=config.ack == "fast",
            ack_queue=config.ack_queue,
            workers=workers,
        )
        self.port: int = self._engine.port
        self._sessions.watch_keys(self._key_changed)
        server.plane = self

    def _key_changed(self, key: str, session_id: str | None) -> None:
        data = key.encode("utf-8", "surrogatepass")
        if session_id is None:
            self._engine.remove_key(data)
        else:
            self._engine.set_key(data, session_id)

    # -- for the control plane

    def pending(self) -> int:
        """Turns answered (`--ack fast`) and not yet recorded."""
        return int(self._engine.pending())

    def settle(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) for the queued turns; whether all were taken."""
        return bool(self._engine.settle(timeout))

    def close(self) -> None:
        """Stop serving; the queued turns are recorded first (bounded), the rest counted."""
        self._sessions.watch_keys(None)
        self._engine.stop(ACK_DRAIN_SECONDS)

    # -- the engine's callbacks

    def prepare(
        self,
        anthropic: bool,
        session_id: str | None,
        key: str | None,
        headers: list[tuple[str, bytes]],
        body: bytes,
        received_us: int,
    ) -> tuple[_Call, str, bytes, list[tuple[str, str]]] | tuple[None, _Reply]:
        """A call that passed the engine's gate: its upstream call, or the refusal."""
        clock = CallClock()
        clock.received = received_us
        server = self._server
        try:
            session = server._session(key)
            plan = server.plan(
                anthropic,
                Headers(raw=[(name.encode("latin-1"), value) for name, value in headers]),
                session,
                body,
                clock,
            )
        except _Refusal as refusal:
            return None, _reply(_failure(anthropic, refusal))
        return _Call(plan), plan.path, plan.content, list(plan.headers.items())

    def finish(
        self,
        call: _Call,
        status: int,
        error: str | None,
        content_type: bytes | None,
        retry_after: bytes | None,
        answer: bytes,
        stamps: tuple[int, int, int],
    ) -> tuple[_Reply, bool, bool]:
        """The reply to a call the upstream answered (or failed), whether its turn is to be
        queued, and whether its timeline is to be recorded once the reply is sent."""
        server, plan = self._server, call.plan
        session, clock = plan.session, plan.clock
        clock.upstream_sent, clock.first_byte, clock.last_byte = stamps
        fast = server.config.ack == "fast"
        queue = False
        try:
            if error == "timeout":
                raise _Refusal(
                    504, f"the upstream did not answer within {server.config.upstream_timeout:g} s"
                )
            if error is not None:
                raise _Refusal(502, f"the upstream cannot be reached: {error}")
            headers = {}
            if content_type is not None:
                headers["content-type"] = content_type.decode("latin-1")
            if retry_after is not None:
                headers["retry-after"] = retry_after.decode("latin-1")
            response, answer = server._upstream_answer(status, headers, answer)
        except _Passthrough as passed:
            session.upstream_errors += 1
            session.failed = failed_after(session.failed, passed.response.status_code)
            return self._timed(call, _reply(passed.response), False)
        except _Refusal as refused:
            if refused.status in (502, 504):  # the upstream unreachable or too slow
                session.failed = failed_after(session.failed, refused.status)
            return self._timed(call, _reply(_failure(plan.anthropic, refused)), False)
        try:
            failed = session.failed
            call.node = plan.make_turn(response)
            if fast:
                queue = True
            else:
                clock.node_id = server.record_now(session, call.node)
            clock.failed, session.failed = failed, 0
        except _Refusal as refused:
            return self._timed(call, _reply(_failure(plan.anthropic, refused)), False)
        if plan.stream:
            return self._timed(call, (200, _SSE_HEADERS, list(plan.replay), True), queue)
        return self._timed(call, _reply(plan.reply(response, answer)), queue)

    def _timed(self, call: _Call, reply: _Reply, queue: bool) -> tuple[_Reply, bool, bool]:
        plan = call.plan
        timed = plan.clock.node_id is not None or plan.stream or queue
        if timed:
            self._server.timing(plan.session, plan.clock)
        return reply, queue, timed

    def record(self, call: _Call) -> None:
        """Record a turn answered with `--ack fast` (on the engine's recorder thread)."""
        plan, node = call.plan, call.node
        session, clock = plan.session, plan.clock
        try:
            if node is None:
                raise RuntimeError("a queued call without its turn")
            clock.node_id = self._server.record_now(session, node)
            if clock.reply_sent >= 0:  # sent before the turn was recorded: ours to do
                self._server.record_timeline_now(session, clock)
        except Exception:  # any failure: the client has its answer, the turn is counted
            self._server._drop(session, "record_error")
        call.node = None

    def dropped(self, call: _Call, why: str) -> None:
        """A queued turn that will not be recorded (`queue_full`, `shutdown`)."""
        session: Session = call.plan.session
        self._server._drop(session, why)
        call.node = None

    def sent(self, call: _Call, reply_sent: int, chunks: int, max_gap: int) -> None:
        """A timed call's reply is out: record its timeline (once its turn is recorded)."""
        plan = call.plan
        clock = plan.clock
        clock.reply_sent = reply_sent
        clock.chunks, clock.max_gap = chunks, max_gap
        try:
            self._server.record_timeline_now(plan.session, clock)
        finally:
            self._server.timed(plan.session, clock)

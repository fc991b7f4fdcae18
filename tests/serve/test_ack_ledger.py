"""The `--ack fast` ledger: turns answered and lost with a killed server are counted by the next
start (in /health, the session's info and its export's validation), at every later start the
same, and a clean stop leaves nothing counted and no ledger behind."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from capture_support import (
    ADMIN_KEY,
    DATA_PLANE,
    WAIT_S,
    Process,
    auth,
    export,
    new_session,
    serve_app,
    start_server_process,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from rollout_store.serve import ack_ledger
from rollout_store.serve.ack_ledger import LEDGER_NAME, AckLedger, SessionTally, read_ledger
from rollout_store.serve.server import create_app
from rollout_store.serve.sessions import _write_atomic
from rollout_store.serve.sse import SSE_HEADERS

STALLER = Path(__file__).resolve().parents[1] / "support" / "stalled_recorder.py"
FAILER = Path(__file__).resolve().parents[1] / "support" / "failing_recorder.py"
SERVE_RE = r"serve: (http://127\.0\.0\.1:\d+)"
#: A stream that ends with its last event but whose events make no turn (one is not JSON).
UNREADABLE = [
    b'data: {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", '
    b'"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]}\n\n',
    b'data: {"id": "c1", "choices": [ cut here\n\n',
    b"data: [DONE]\n\n",
]


def _call(url: str, session: dict[str, Any], text: str) -> None:
    answer = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": text}]},
        headers={"authorization": f"Bearer {session['api_key']}"},
        timeout=WAIT_S,
    )
    answer.raise_for_status()
    assert answer.json()["choices"][0]["message"]["content"]


def _counted(url: str, sid: str) -> tuple[int, dict[str, int], int, int, list[str]]:
    """What a server counts of a session: /health's dropped and dropped_by (non-zero), the
    session's info (turns, dropped) and its export's dropped_turns findings."""
    health = httpx.get(f"{url}/health", timeout=WAIT_S).json()
    info = httpx.get(f"{url}/sessions/{sid}", headers=auth(sid), timeout=WAIT_S).json()
    doc = export(url, sid)
    assert len(doc["turns"]) == info["turns"]
    findings = [f for f in doc["validation"] if "dropped_turns" in f]
    by = {k: v for k, v in health["dropped_by"].items() if v}
    return health["dropped"], by, info["turns"], info["dropped"], findings


def test_the_ledger_reads_what_a_kill_or_a_power_loss_leaves() -> None:
    data = (
        b"b s1 4\nc s1 queue_full 2\n"  # carried from an earlier start
        b"a s1\na s1\nd s1 record_error\na s1\n"  # three answered, one dropped
        b"a s2\nn s2\na s2\n"  # s2 deleted and made again: one answered since
        b"a s3\n\x00\x00\x00\na s3"  # a power loss's zeros, a line without its newline
    )
    tallies = read_ledger(data)
    assert tallies["s1"] == SessionTally(4, 2, Counter(queue_full=2, record_error=1))
    assert tallies["s2"] == SessionTally(0, 1)
    assert tallies["s3"] == SessionTally(0, 1)
    tallies["s1"].settle(5)  # one of its two pending turns made it to the log
    assert tallies["s1"] == SessionTally(5, 0, Counter(queue_full=2, record_error=1, killed=1))
    tallies["s2"].settle(1)  # it did
    assert tallies["s2"] == SessionTally(1, 0)


def test_a_long_run_keeps_the_ledger_small(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ack_ledger, "COMPACT_BYTES", 200)
    ledger = AckLedger(tmp_path, _write_atomic)
    path = tmp_path / LEDGER_NAME
    ledger.answered("gone", lambda: {"s1": 7, "s2": 0, "gone": 3})
    ledger.forget("gone")  # deleted: a rewrite keeps nothing of it
    sizes = []
    for i in range(300):
        ledger.answered("s1", lambda: {"s1": 7, "s2": 0})
        if i % 10 == 0:
            ledger.dropped("s1", "queue_full")
        sizes.append(path.stat().st_size)
    ledger.answered("s2", dict)
    assert max(sizes) < 300 and len(set(sizes)) > 20  # rewritten as it grew, not once
    tallies = read_ledger(path.read_bytes())
    assert tallies["s1"] == SessionTally(7, 270, Counter(queue_full=30))
    assert tallies["s2"] == SessionTally(0, 1)
    assert "gone" not in tallies
    ledger.close()
    # at the next start, 100 of s1's pending turns in its log: 170 lost with the process
    lost = AckLedger(tmp_path, _write_atomic).reconcile({"s1": 107, "s2": 1})
    assert lost == {"s1": Counter(queue_full=30, killed=170)}


def test_a_clean_stop_leaves_nothing_counted_and_no_ledger(stub: str, tmp_path: Path) -> None:
    data = tmp_path / "data"
    app = create_app(stub, data=data, ack="fast", admin_key=ADMIN_KEY)
    with serve_app(app) as url:
        session = new_session(url, session_id="clean")
        for i in range(3):
            _call(url, session, f"call {i}")
        # each answered turn has its line, written before its answer
        assert (data / LEDGER_NAME).read_bytes().count(b"a clean\n") == 3
    assert not (data / LEDGER_NAME).exists()
    with serve_app(create_app(stub, data=data, ack="fast", admin_key=ADMIN_KEY)) as url:
        assert _counted(url, "clean") == (0, {}, 3, 0, [])
        _call(url, session, "after the restart")
        assert _counted(url, "clean")[2:4] == (4, 0)
    assert sorted(p.name for p in data.iterdir()) == ["clean.json", "clean.rls"]


def test_a_streamed_call_has_its_line_before_its_stream_ends(stub: str, tmp_path: Path) -> None:
    """A streamed call answered before its turn is recorded (on the Rust plane its events
    are passed on as the engine sends them) has its line in the ledger, as any other."""
    data = tmp_path / "data"
    with serve_app(create_app(stub, data=data, ack="fast", admin_key=ADMIN_KEY)) as url:
        session = new_session(url, session_id="streamed")
        for i in range(2):
            with httpx.stream(
                "POST",
                f"{url}/v1/chat/completions",
                json={
                    "model": "m",
                    "stream": True,
                    "messages": [{"role": "user", "content": f"{i}"}],
                },
                headers={"authorization": f"Bearer {session['api_key']}"},
                timeout=WAIT_S,
            ) as answer:
                text = b"".join(answer.iter_bytes())
            assert answer.status_code == 200 and text.rstrip().endswith(b"data: [DONE]")
        assert (data / LEDGER_NAME).read_bytes().count(b"a streamed\n") == 2
        deadline = time.monotonic() + WAIT_S
        while _counted(url, "streamed")[2] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _counted(url, "streamed") == (0, {}, 2, 0, [])


def test_durable_writes_no_ledger(stub: str, tmp_path: Path) -> None:
    data = tmp_path / "data"
    with serve_app(create_app(stub, data=data, admin_key=ADMIN_KEY)) as url:
        _call(url, new_session(url, session_id="d"), "q")
        assert not (data / LEDGER_NAME).exists()


def test_lines_a_killed_server_left_are_counted_once_and_kept(stub: str, tmp_path: Path) -> None:
    """The ledger as a server killed with turns answered and not recorded leaves it (written
    here), read by the next starts in either mode: counted the same at every start, turns
    recorded since not counted, all forgotten with the session."""
    data = tmp_path / "data"
    with serve_app(create_app(stub, data=data, ack="fast", admin_key=ADMIN_KEY)) as url:
        session = new_session(url, session_id="k")
        new_session(url, session_id="other")
        _call(url, session, "recorded")
    # k's log held 1 turn; 3 more were answered, one dropped (queue full), none recorded
    (data / LEDGER_NAME).write_bytes(b"b k 1\na k\na k\nd k queue_full\na k\n")
    turns = 1
    for ack in ("fast", "durable", "fast"):
        with serve_app(create_app(stub, data=data, ack=ack, admin_key=ADMIN_KEY)) as url:
            dropped, by, held, info_dropped, findings = _counted(url, "k")
            assert (dropped, held, info_dropped) == (3, turns, 3)
            assert by == {"queue_full": 1, "killed": 2}
            assert [f[:34] for f in findings] == ["[WARN] dropped_turns: 3 turn(s) of"]
            assert _counted(url, "other") == (3, by, 0, 0, [])
            _call(url, session, f"under {ack}")  # recorded: nothing more to count
            turns += 1
            assert _counted(url, "k")[2:4] == (turns, 3)
        tally = read_ledger((data / LEDGER_NAME).read_bytes())["k"]
        assert tally == SessionTally(turns, 0, Counter(queue_full=1, killed=2))
    with serve_app(create_app(stub, data=data, admin_key=ADMIN_KEY)) as url:
        httpx.delete(f"{url}/sessions/k", headers=auth("k"), timeout=WAIT_S).raise_for_status()
        new_session(url, session_id="k")
    with serve_app(create_app(stub, data=data, admin_key=ADMIN_KEY)) as url:
        assert _counted(url, "k") == (0, {}, 0, 0, [])
    assert not (data / LEDGER_NAME).exists()


def _health(url: str) -> dict[str, Any]:
    answer: dict[str, Any] = httpx.get(f"{url}/health", timeout=WAIT_S).json()
    return answer


def _queue_taken(url: str, pending: int) -> None:
    """Wait (bounded) until the recorder has taken the queued turns but `pending`."""
    deadline = time.monotonic() + WAIT_S
    while _health(url)["ack_queue"]["pending"] != pending:
        assert time.monotonic() < deadline, _health(url)
        time.sleep(0.01)


@pytest.mark.slow
def test_turns_queued_when_the_server_is_killed_are_counted_at_every_restart(
    stub: str, tmp_path: Path
) -> None:
    data, gate = tmp_path / "data", tmp_path / "gate"
    args = ["--data", str(data), "--ack", "fast", "--ack-queue", "1"]
    plane = ["--data-plane", "rust"] if DATA_PLANE == "rust" else []
    server = Process(
        [str(STALLER), str(gate), "serve", "--upstream", stub, "--port", "0", *plane, *args],
        r"serve: (http://127\.0\.0\.1:\d+)",
    )
    try:
        url = server.url
        session = new_session(url, session_id="killed")
        new_session(url, session_id="whole")
        for i in range(2):
            _call(url, session, f"recorded {i}")
            # (a queue of one: the next call's turn is dropped if it comes before the
            # recorder took this one, which a loaded machine can delay)
            _queue_taken(url, 0)
        assert _counted(url, "killed")[2:4] == (2, 0)
        gate.touch()  # from here the recorder waits: answered turns stay queued
        _call(url, session, "taken by the recorder, not recorded")
        _queue_taken(url, 0)
        _call(url, session, "queued")
        _call(url, session, "the queue is full: dropped")
        health = _health(url)
        assert health["ack_queue"]["pending"] == 1 and health["dropped_by"]["queue_full"] == 1
        server.kill()
        gate.unlink()
        expected = (3, {"queue_full": 1, "killed": 2}, 2, 3)
        for restart in range(3):
            server = start_server_process(stub, *args)
            url = server.url
            dropped, by, turns, info_dropped, findings = _counted(url, "killed")
            assert (dropped, by, turns, info_dropped) == expected, restart
            assert [f[:34] for f in findings] == ["[WARN] dropped_turns: 3 turn(s) of"]
            assert _counted(url, "whole") == (3, by, 0, 0, [])
            if restart == 0:
                server.kill()  # a second kill counts nothing more
            else:
                server.stop()  # nor does a clean stop (SIGTERM), which keeps what it carries
                tally = read_ledger((data / LEDGER_NAME).read_bytes())["killed"]
                assert tally == SessionTally(2, 0, Counter(queue_full=1, killed=2))
    finally:
        server.kill()


@pytest.mark.slow
def test_a_fast_server_stopped_cleanly_counts_nothing(stub: str, tmp_path: Path) -> None:
    data = tmp_path / "data"
    args = ["--data", str(data), "--ack", "fast"]
    server = start_server_process(stub, *args)
    try:
        session = new_session(server.url, session_id="s")
        for i in range(5):
            _call(server.url, session, f"call {i}")
        server.stop()  # SIGTERM: the queue drained, the ledger has nothing to carry
        assert not (data / LEDGER_NAME).exists()
        server = start_server_process(stub, *args)
        assert _counted(server.url, "s") == (0, {}, 5, 0, [])
    finally:
        server.kill()


def _unreadable_upstream() -> Starlette:
    """An upstream whose every answer is the stream `UNREADABLE`."""

    async def chat(request: Request) -> StreamingResponse:
        await request.body()

        async def events() -> Any:
            for event in UNREADABLE:
                yield event

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def _stream(url: str, session: dict[str, Any]) -> tuple[int, bytes]:
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
        headers={"authorization": f"Bearer {session['api_key']}"},
        timeout=WAIT_S,
    ) as answer:
        return answer.status_code, b"".join(answer.iter_raw())


def _dropped_then_killed(server: Process, upstream: str, plane: str, data: Path) -> bytes:
    """One streamed call to `server` (`--ack fast`, `--data data`) whose turn it drops for a
    recording error: counted as such while it runs, after it is killed and at every start
    after; the stream's bytes."""
    expected = (1, {"record_error": 1}, 0, 1)
    finding = "[WARN] dropped_turns: 1 turn(s) of"
    try:
        session = new_session(server.url, session_id="dropped")
        new_session(server.url, session_id="bystander")
        status, streamed = _stream(server.url, session)
        assert status == 200
        deadline = time.monotonic() + WAIT_S
        while _health(server.url)["dropped"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        dropped, by, turns, info_dropped, findings = _counted(server.url, "dropped")
        assert (dropped, by, turns, info_dropped) == expected
        assert [f[: len(finding)] for f in findings] == [finding]
        # the ledger says what became of the answered turn before anything else happens
        assert (data / LEDGER_NAME).read_bytes() == b"a dropped\nd dropped record_error\n"
        server.kill()
        assert (data / LEDGER_NAME).read_bytes() == b"a dropped\nd dropped record_error\n"
        for ack in ("fast", "durable"):
            args = ["--data-plane", plane, "--data", str(data), "--ack", ack]
            server = start_server_process(upstream, *args)
            dropped, by, turns, info_dropped, findings = _counted(server.url, "dropped")
            assert (dropped, by, turns, info_dropped) == expected, ack  # not killed
            assert [f[: len(finding)] for f in findings] == [finding]
            assert _counted(server.url, "bystander") == (1, by, 0, 0, [])
            server.stop()  # a clean stop carries it (and counts nothing more)
            tally = read_ledger((data / LEDGER_NAME).read_bytes())["dropped"]
            assert tally == SessionTally(0, 0, Counter(record_error=1))
    finally:
        server.kill()
    return streamed


@pytest.mark.slow
def test_a_fast_stream_whose_events_make_no_turn_is_dropped_and_counted_after_a_kill(
    tmp_path: Path,
) -> None:
    """The Rust plane passes a stream through; with `--ack fast` one whose events cannot be
    read into a turn ends as it came, counted as dropped (`record_error`): its `d` line makes
    a start after a kill count it for that reason, not as killed."""
    data = tmp_path / "data"
    with serve_app(_unreadable_upstream()) as upstream:
        server = Process(
            [
                "-m",
                "rollout_store.cli",
                "serve",
                "--upstream",
                upstream,
                "--port",
                "0",
                "--data-plane",
                "rust",
                "--data",
                str(data),
                "--ack",
                "fast",
            ],
            SERVE_RE,
        )
        streamed = _dropped_then_killed(server, upstream, "rust", data)
    assert streamed == b"".join(UNREADABLE)  # as it came: no error event in place of [DONE]


@pytest.mark.slow
@pytest.mark.parametrize("plane", ["python", "rust"])
def test_a_fast_stream_whose_turn_cannot_be_recorded_is_counted_after_a_kill(
    stub: str, tmp_path: Path, plane: str
) -> None:
    """Either plane answers a streamed call whose turn then fails to record (a full disk)
    and counts it as dropped (`record_error`) with its `d` line: a start after a kill counts
    it for that reason, not as killed."""
    data = tmp_path / "data"
    server = Process(
        [str(FAILER), "serve", "--upstream", stub, "--port", "0", "--data-plane", plane]
        + ["--data", str(data), "--ack", "fast"],
        SERVE_RE,
    )
    streamed = _dropped_then_killed(server, stub, plane, data)
    assert streamed.endswith(b"data: [DONE]\n\n") and b'"error"' not in streamed
    assert streamed.count(b"data: ") > 2

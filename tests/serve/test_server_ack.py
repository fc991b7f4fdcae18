"""`--ack durable` and `--ack fast`: the same turns recorded either way; in fast mode a turn
that cannot be recorded is still answered, and counted in /health, the session's info and its
export's validation (queue full, a recording error, the server stopping)."""

from __future__ import annotations

import asyncio
import copy
import errno
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from capture_support import ADMIN, ADMIN_KEY, auth, export, new_session, serve_app
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rollout_store import RolloutGraph
from rollout_store.errors import InvalidArgumentError
from rollout_store.serve.server import RustDataPlane, _Server, _strip_injected, create_app

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something, with a float 1.0 and a \u00e9."},
]


def _traffic(session: dict[str, Any]) -> None:
    """A little of everything: chat, streamed chat, a continuation, Anthropic's Messages."""
    client = openai.OpenAI(
        base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
    )
    messages = copy.deepcopy(CONVERSATION)
    first = client.chat.completions.create(model="m", messages=messages, temperature=0.5)
    messages += [first.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "user", "content": "and now?"}]
    for _ in client.chat.completions.create(model="m", messages=messages, stream=True):
        pass
    claude = anthropic.Anthropic(
        base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0
    )
    claude.messages.create(
        model="c", max_tokens=16, system="be brief", messages=[{"role": "user", "content": "hi"}]
    )


def _call(url: str, session: dict[str, Any], content: str) -> None:
    """One model call of `session` whose messages are a user's `content`, answered 200."""
    httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": content}]},
        headers={"authorization": f"Bearer {session['api_key']}"},
        timeout=20,
    ).raise_for_status()


def _export_text(url: str, session_id: str) -> str:
    answer = httpx.get(
        f"{url}/sessions/{session_id}/export",
        params={"messages": "1"},
        headers=auth(session_id),
        timeout=20,
    )
    answer.raise_for_status()
    return answer.text


@pytest.mark.parametrize("data", [False, True], ids=["memory", "log"])
def test_both_ack_modes_record_the_same_bytes(stub: str, tmp_path: Path, data: bool) -> None:
    exports = {}
    for ack in ("durable", "fast"):
        app = create_app(stub, data=tmp_path / ack if data else None, ack=ack, admin_key=ADMIN_KEY)
        with serve_app(app) as url:
            session = new_session(url, session_id="same")
            _traffic(session)
            exports[ack] = _export_text(url, "same")
            info = httpx.get(f"{url}/sessions/same", headers=auth("same")).json()
            assert info["turns"] == 3 and info["dropped"] == 0
            health = httpx.get(f"{url}/health").json()
            assert health["ack"] == ack and health["dropped"] == 0
    durable, fast = json.loads(exports["durable"]), json.loads(exports["fast"])
    assert len(durable["turns"]) == 3
    # each turn has its timeline in both modes; the timings differ run to run, the rest not
    for doc in (durable, fast):
        assert all(turn.pop("timeline")["engine_ms"] > 0 for turn in doc["turns"])
    assert json.dumps(fast) == json.dumps(durable)
    assert not [f for f in fast["validation"] if "dropped_turns" in f]


def _failing_add_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    def add_turn(self: RolloutGraph, node: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(RolloutGraph, "add_turn", add_turn)


def test_durable_fails_a_call_whose_turn_cannot_be_recorded(
    stub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(stub, data=tmp_path / "d", ack="durable", admin_key=ADMIN_KEY)
    with serve_app(app) as url:
        session = new_session(url)
        _failing_add_turn(monkeypatch)
        answer = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "m", "messages": CONVERSATION},
            headers={"authorization": f"Bearer {session['api_key']}"},
            timeout=20,
        )
        assert answer.status_code == 507
        assert "disk is full" in answer.json()["error"]["message"]
        assert httpx.get(f"{url}/health").json()["dropped"] == 0


def test_fast_answers_and_counts_a_turn_that_cannot_be_recorded(
    stub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(stub, data=tmp_path / "d", ack="fast", admin_key=ADMIN_KEY)
    with serve_app(app) as url:
        session = new_session(url)
        sid = session["session_id"]
        client = openai.OpenAI(
            base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
        )
        client.chat.completions.create(model="m", messages=CONVERSATION)
        # (info waits for the turns answered before it: this one is recorded before the patch)
        assert httpx.get(f"{url}/sessions/{sid}", headers=auth(sid)).json()["turns"] == 1
        with monkeypatch.context() as patch:
            _failing_add_turn(patch)
            reply = client.chat.completions.create(
                model="m", messages=[*CONVERSATION, {"role": "user", "content": "again"}]
            )
            assert reply.choices[0].message.content  # answered all the same
            info = httpx.get(f"{url}/sessions/{sid}", headers=auth(sid)).json()
        assert (info["turns"], info["dropped"]) == (1, 1), info
        health = httpx.get(f"{url}/health").json()
        assert health["dropped"] == 1 and health["dropped_by"]["record_error"] == 1
        doc = json.loads(_export_text(url, sid))
        (warning,) = [f for f in doc["validation"] if "dropped_turns" in f]
        assert warning.startswith("[WARN] dropped_turns: 1 turn(s)")
        assert len(doc["turns"]) == 1


# upstream answers json.loads reads as objects that make no turn (`chat_turn` refuses the
# first three; the last one's ids are refused when it is recorded)
_TURNLESS = [
    b'{"choices": []}',
    b'{"id": "x", "prompt_token_ids": [1, 2],\n "choices": [{"message": "text", "logprobs": {}}]}',
    b'{"choices": 1.5, "token_ids": [3]}',
    b'{"prompt_token_ids": ["a"], "choices": [{"message": {"role": "assistant"}}]}',
]


@pytest.mark.parametrize("plane", ["python", "rust"])
def test_fast_answers_and_counts_an_answer_that_makes_no_turn(tmp_path: Path, plane: str) -> None:
    """With `--ack fast` (fail-open) an upstream's answer that is one JSON object but makes no
    turn is answered (what the server asked for taken out), and its turn counted as dropped,
    as a turn that cannot be recorded is: in /health, the session's info and its export's
    validation, and by the next start."""
    answers = list(_TURNLESS)

    async def answer(request: Request) -> Response:
        return Response(answers.pop(0), media_type="application/json")

    routes = [Route("/v1/chat/completions", answer, methods=["POST"])]
    data = tmp_path / "d"
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    with serve_app(Starlette(routes=routes)) as upstream:
        app = create_app(upstream, data=data, ack="fast", admin_key=ADMIN_KEY)
        with serve_app(app, data_plane=plane) as url:
            session = new_session(url, session_id="turnless")
            bearer = {"authorization": f"Bearer {session['api_key']}"}
            for sent in _TURNLESS:
                reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers=bearer)
                assert reply.status_code == 200, reply.text
                expected = json.loads(sent)
                _strip_injected(expected, True, True)
                assert reply.json() == expected
            info = httpx.get(f"{url}/sessions/turnless", headers=auth("turnless")).json()
            assert (info["turns"], info["dropped"]) == (0, 4), info
            health = httpx.get(f"{url}/health").json()
            assert health["dropped"] == 4 and health["dropped_by"]["record_error"] == 4
            doc = json.loads(_export_text(url, "turnless"))
            (warning,) = [f for f in doc["validation"] if "dropped_turns" in f]
            assert warning.startswith("[WARN] dropped_turns: 4 turn(s)")
        with serve_app(create_app(upstream, data=data, admin_key=ADMIN_KEY)) as url:
            info = httpx.get(f"{url}/sessions/turnless", headers=ADMIN).json()
            assert (info["turns"], info["dropped"]) == (0, 4), info


def _slow_recorder(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Each queued turn is recorded `seconds` late: by the Python plane's recorder (in the
    event loop) or the Rust plane's (in its own thread)."""
    record = _Server._record
    record_queued = RustDataPlane.record

    async def slow(self: _Server, session: Any, node: Any) -> None:
        await asyncio.sleep(seconds)
        await record(self, session, node)

    def slow_queued(self: RustDataPlane, calls: Any) -> None:
        time.sleep(seconds)
        record_queued(self, calls)

    monkeypatch.setattr(_Server, "_record", slow)
    monkeypatch.setattr(RustDataPlane, "record", slow_queued)


def _gate_recorders(monkeypatch: pytest.MonkeyPatch, gate: Callable[[], threading.Event]) -> None:
    """Both planes' fast recorders wait (at most 20 s) for the event `gate()` gives at each
    recording before they record."""
    record = _Server._record
    record_queued = RustDataPlane.record

    async def gated(self: _Server, session: Any, node: Any) -> str:
        await asyncio.to_thread(gate().wait, 20)
        return await record(self, session, node)

    def gated_queued(self: RustDataPlane, calls: Any) -> Any:
        gate().wait(20)
        return record_queued(self, calls)

    monkeypatch.setattr(_Server, "_record", gated)
    monkeypatch.setattr(RustDataPlane, "record", gated_queued)


def test_the_server_answers_while_an_export_waits_for_the_queued_turns(
    stub: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An export waits for the turns answered before it; meanwhile /health, a new session
    and another session's call are answered, and the export has the turn once it is in."""
    gate = threading.Event()
    settling = threading.Event()
    settled = _Server.settled_session
    _gate_recorders(monkeypatch, lambda: gate)

    async def settling_first(self: _Server, session: Any, timeout: float = 10.0) -> bool:
        settling.set()
        return await settled(self, session, timeout)

    monkeypatch.setattr(_Server, "settled_session", settling_first)
    app = create_app(stub, ack="fast", admin_key=ADMIN_KEY)
    with serve_app(app) as url:
        session = new_session(url, session_id="waited")
        _call(url, session, "queued")
        exported: list[str] = []
        exporting = threading.Thread(target=lambda: exported.append(_export_text(url, "waited")))
        exporting.start()
        assert settling.wait(5)
        time.sleep(0.05)  # (the export's wait begun)
        health = httpx.get(f"{url}/health", timeout=5)
        made = httpx.post(f"{url}/sessions", json={}, headers=ADMIN, timeout=5)
        assert health.status_code == 200 and made.status_code == 200
        other = {"api_key": made.json()["api_key"]}
        _call(url, other, "not queued behind the export")
        assert exporting.is_alive()  # its turn is not in yet
        gate.set()
        exporting.join(20)
    assert len(json.loads(exported[0])["turns"]) == 1


@pytest.mark.slow
def test_fast_counts_the_turns_a_full_queue_drops(
    stub: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _slow_recorder(monkeypatch, 1.5)
    app = create_app(stub, ack="fast", ack_queue=1, admin_key=ADMIN_KEY)
    with serve_app(app) as url:
        session = new_session(url)
        sid = session["session_id"]
        client = openai.OpenAI(
            base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
        )
        # the first turn is being recorded, the second waits in the queue, the third finds
        # it full
        for i in range(3):
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"call {i}"}]
            )
        health = httpx.get(f"{url}/health").json()
        assert health["dropped_by"]["queue_full"] == 1
        info = httpx.get(f"{url}/sessions/{sid}", headers=auth(sid)).json()
        assert info["turns"] == 2 and info["dropped"] == 1
        doc = json.loads(_export_text(url, sid))
        assert [f for f in doc["validation"] if f.startswith("[WARN] dropped_turns: 1 ")]


@pytest.mark.slow
def test_fast_drains_its_queue_on_shutdown(
    stub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _slow_recorder(monkeypatch, 1.0)
    data = tmp_path / "d"
    with serve_app(create_app(stub, data=data, ack="fast", admin_key=ADMIN_KEY)) as url:
        session = new_session(url, session_id="drained")
        for i in range(4):
            _call(url, session, f"call {i}")
        # the queue still holds turns when the server is told to stop
        assert httpx.get(f"{url}/health").json()["ack_queue"]["pending"] >= 1
    monkeypatch.undo()
    with serve_app(create_app(stub, data=data, admin_key=ADMIN_KEY)) as url:
        info = httpx.get(f"{url}/sessions/drained", headers=ADMIN).json()
        assert info["turns"] == 4


@pytest.mark.parametrize("plane", ["python", "rust"])
def test_fast_records_the_turns_queued_meanwhile_together_in_order(
    stub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plane: str
) -> None:
    """Turns answered while the recorder waits on a sync are recorded together: each
    session's log synced once for its turns among them, not once a turn, and each session's
    turns in the order they were answered."""
    data = tmp_path / "d"
    app = create_app(stub, data=data, ack="fast", admin_key=ADMIN_KEY)
    with serve_app(app, data_plane=plane) as url:
        sessions = [new_session(url, session_id=f"group-{k}") for k in range(3)]
        gate, synced = threading.Event(), []
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            if os.readlink(f"/proc/self/fd/{fd}").endswith(".rls"):
                synced.append(fd)
                gate.wait(20)  # the first sync holds the recorder until every call is answered
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        calls = 6
        for i in range(calls):
            for session in sessions:
                _call(url, session, f"call {i}")
        # a reply goes out before its turn is queued: the recorder goes on once every turn
        # but the held one waits in the queue (a loaded machine queued the last after the
        # recorder took the others once); bounded: a first group of two never gets there
        deadline = time.monotonic() + 5
        while (
            httpx.get(f"{url}/health").json()["ack_queue"]["pending"] < calls * len(sessions) - 1
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        gate.set()
        for session in sessions:
            doc = export(url, session["session_id"])  # (waits for the turns answered before)
            asked = [turn["request_messages"][-1]["content"] for turn in doc["turns"]]
            assert asked == [f"call {i}" for i in range(calls)]
        turns = calls * len(sessions)
        # the first turn alone, then the other 17 as one group: one sync per session
        assert len(synced) <= 1 + len(sessions) < turns, synced
        health = httpx.get(f"{url}/health").json()
        assert health["dropped"] == 0 and health["ack_queue"]["pending"] == 0


class _GatedSyncs:
    """`os.fsync` of the sessions' logs held: the first until `first` is set, the others
    until `rest` is; `synced` counts them as they begin."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.first, self.rest = threading.Event(), threading.Event()
        self.synced: list[int] = []
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            if os.readlink(f"/proc/self/fd/{fd}").endswith(".rls"):
                self.synced.append(fd)
                (self.first if len(self.synced) == 1 else self.rest).wait(20)
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)

    def wait_for(self, n: int) -> None:
        deadline = time.monotonic() + 20
        while len(self.synced) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.synced) == n, self.synced


@pytest.mark.slow
@pytest.mark.parametrize("cut", ["alone", "group"])
def test_a_stop_cutting_the_recorder_counts_each_turn_as_what_it_became(
    stub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    """A stopping server whose queue did not drain in time cancels its recorder in the
    middle of recording one turn (`alone`) or a group of them (`group`): what was being
    recorded is waited for and counted recorded, the turns still queued are counted
    dropped (`shutdown`), none both, none neither."""
    data = tmp_path / "d"
    settled = _Server.settled
    with monkeypatch.context() as patch:
        # the drain gives up at once: the recorder is cancelled with a turn in hand
        patch.setattr(_Server, "settled", lambda self, timeout=0.2: settled(self, 0.2))
        app = create_app(stub, data=data, ack="fast", admin_key=ADMIN_KEY)
        with serve_app(app, data_plane="python") as url:
            sessions = [new_session(url, session_id=f"cut-{k}") for k in range(2)]
            syncs = _GatedSyncs(patch)

            def call(k: int, i: int) -> None:
                _call(url, sessions[k], f"call {i}")

            call(0, 0)
            syncs.wait_for(1)  # cut-0's first turn, alone, is being synced
            for i in range(1, 4):
                call(0, i)
                call(1, i)
            if cut == "group":  # then the 6 turns queued meanwhile, as one group
                syncs.first.set()
                syncs.wait_for(3)  # (one sync per session, side by side)
                call(0, 4)
                call(1, 4)
            # the syncs under way end once the server is stopping and has cancelled them
            threading.Timer(1.5, syncs.first.set).start()
            threading.Timer(1.5, syncs.rest.set).start()
    with serve_app(create_app(stub, data=data, admin_key=ADMIN_KEY)) as url:
        infos = [httpx.get(f"{url}/sessions/cut-{k}", headers=ADMIN).json() for k in (0, 1)]
        health = httpx.get(f"{url}/health").json()
    recorded = [info["turns"] for info in infos]
    dropped = [info["dropped"] for info in infos]
    if cut == "alone":
        assert (recorded, dropped) == ([1, 0], [3, 3]), infos
    else:
        assert (recorded, dropped) == ([4, 3], [1, 1]), infos
    assert health["dropped"] == sum(dropped) == health["dropped_by"]["shutdown"]


def test_ack_arguments_are_checked(stub: str) -> None:
    with pytest.raises(InvalidArgumentError, match="ack must be one of durable, fast"):
        create_app(stub, ack="eventually")
    with pytest.raises(InvalidArgumentError, match="ack_queue"):
        create_app(stub, ack="fast", ack_queue=0)


def _gated_with_a_short_settle(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The fast recorders held at a gate (returned, to open) and a session's settle wait cut
    to 0.3 s: what an export or a trace taken meanwhile gives up on."""
    gate = threading.Event()
    settled = _Server.settled_session
    _gate_recorders(monkeypatch, lambda: gate)

    async def short(self: _Server, session: Any, timeout: float = 0.3) -> bool:
        return await settled(self, session, 0.3)

    monkeypatch.setattr(_Server, "settled_session", short)
    return gate


@pytest.mark.parametrize("plane", ["python", "rust"])
def test_an_export_whose_wait_for_its_turns_times_out_says_so(
    stub: str, monkeypatch: pytest.MonkeyPatch, plane: str
) -> None:
    """An export (and the info) that gave up waiting for its session's answered turns (the
    recorder held up past the wait) says how many it misses, not yet recorded; once they
    are in, nothing is said."""
    gate = _gated_with_a_short_settle(monkeypatch)
    app = create_app(stub, ack="fast", admin_key=ADMIN_KEY)
    with serve_app(app, data_plane=plane) as url:
        session = new_session(url, session_id="late")
        _call(url, session, "queued")
        doc = json.loads(_export_text(url, "late"))
        info = httpx.get(f"{url}/sessions/late", headers=auth("late"), timeout=5).json()
        gate.set()
        settled_doc = json.loads(_export_text(url, "late"))
        settled_info = httpx.get(f"{url}/sessions/late", headers=auth("late"), timeout=5).json()
    assert len(doc["turns"]) == 0
    (warning,) = [f for f in doc["validation"] if "unsettled_turns" in f]
    assert warning.startswith("[WARN] unsettled_turns: 1 turn(s)"), warning
    assert info["unsettled"] == 1 and info["turns"] == 0, info
    assert len(settled_doc["turns"]) == 1
    assert not [f for f in settled_doc["validation"] if "unsettled_turns" in f]
    assert settled_info["unsettled"] == 0 and settled_info["turns"] == 1, settled_info


@pytest.mark.parametrize("plane", ["python", "rust"])
def test_a_trace_whose_wait_for_its_turns_times_out_says_so(
    stub: str, monkeypatch: pytest.MonkeyPatch, plane: str
) -> None:
    """A trace that gave up waiting for its session's answered turns ends with a line that
    says how many it misses (`{"validation": ["[WARN] unsettled_turns: ..."]}`), as an
    export's validation does; before, it was answered as if complete. Once they are in,
    the trace is its turns alone."""
    gate = _gated_with_a_short_settle(monkeypatch)
    app = create_app(stub, ack="fast", admin_key=ADMIN_KEY)
    with serve_app(app, data_plane=plane) as url:
        session = new_session(url, session_id="late")
        _call(url, session, "queued")
        trace = httpx.get(f"{url}/sessions/late/trace.jsonl", headers=auth("late"), timeout=5)
        gate.set()
        settled_trace = httpx.get(
            f"{url}/sessions/late/trace.jsonl", headers=auth("late"), timeout=5
        )
    assert trace.status_code == settled_trace.status_code == 200
    lines = [json.loads(line) for line in trace.text.splitlines()]
    assert [list(line) for line in lines] == [["validation"]], lines
    (warning,) = lines[0]["validation"]
    assert warning.startswith("[WARN] unsettled_turns: 1 turn(s)"), warning
    assert "when this trace was taken" in warning
    settled_lines = [json.loads(line) for line in settled_trace.text.splitlines()]
    assert len(settled_lines) == 1 and "validation" not in settled_lines[0]


@pytest.mark.parametrize("plane", ["python", "rust"])
def test_an_export_waits_for_the_turns_answered_before_it_not_for_later_ones(
    stub: str, monkeypatch: pytest.MonkeyPatch, plane: str
) -> None:
    """A session's info and export wait for its turns answered before them, not for those
    answered while they wait: a session whose calls keep coming (several clients of one
    session) is read as soon as its earlier turns are in, not once no turn of it is on its
    way (which under steady traffic may be never, and every read waited its whole bound)."""
    gates = [threading.Event(), threading.Event()]
    records = [0]
    settled = _Server.settled_session

    def gate() -> threading.Event:
        records[0] += 1
        return gates[min(records[0], 2) - 1]

    _gate_recorders(monkeypatch, gate)

    async def bounded(self: _Server, session: Any, timeout: float = 5.0) -> bool:
        return await settled(self, session, 5.0)

    monkeypatch.setattr(_Server, "settled_session", bounded)
    app = create_app(stub, ack="fast", admin_key=ADMIN_KEY)
    with serve_app(app, data_plane=plane) as url:
        session = new_session(url, session_id="busy")
        _call(url, session, "before")  # (its recording waits for the first gate)
        read: dict[str, tuple[float, Any]] = {}

        def info() -> None:
            began = time.monotonic()
            doc = httpx.get(f"{url}/sessions/busy", headers=auth("busy"), timeout=20).json()
            read["info"] = (time.monotonic() - began, doc)

        def exported() -> None:
            began = time.monotonic()
            doc = json.loads(_export_text(url, "busy"))
            read["export"] = (time.monotonic() - began, doc)

        readers = [threading.Thread(target=info), threading.Thread(target=exported)]
        for reader in readers:
            reader.start()
        time.sleep(0.2)  # (they wait for the first turn)
        _call(url, session, "after")  # (its recording waits for the second gate)
        time.sleep(0.1)
        gates[0].set()
        for reader in readers:
            reader.join(20)
        gates[1].set()
    (waited, info_doc), (exported_in, doc) = read["info"], read["export"]
    assert waited < 2.0 and info_doc["turns"] == 1, (waited, info_doc)
    # (the Rust plane's recorder, held, has the first call's timeline behind the second
    # turn: the export waits for it its bound, 2 s, then goes without it)
    assert exported_in < 3.0 and len(doc["turns"]) == 1, exported_in
    assert not [f for f in doc["validation"] if "unsettled_turns" in f]

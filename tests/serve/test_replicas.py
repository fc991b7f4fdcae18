"""Replicas behind HAProxy: two `rollout-store serve --replica` processes over one Redis store,
each with its own data directory; every session whole on exactly one replica, reached through
the balancer with `Authorization: Bearer` (OpenAI SDK) and `x-api-key` (Anthropic SDK) alike;
a replica killed with -9 and restarted has every turn it acknowledged."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from capture_support import ADMIN, Process, start_server_process, start_stub_process
from services import RedisServer, started, unavailable

from rollout_store.errors import InvalidArgumentError, StoreUnavailableError
from rollout_store.serve.loopback import free_port, wait_for_port
from rollout_store.serve.replicas import haproxy_config, replica_key_prefix
from rollout_store.serve.server import create_app

ROOT = Path(__file__).resolve().parents[2]
SESSIONS = 16
TURNS = 4
WAIT_S = 20.0


def test_shipped_config_is_the_helpers_output() -> None:
    shipped = (ROOT / "deploy" / "haproxy.cfg").read_text()
    made = haproxy_config([("r1", "127.0.0.1:8101"), ("r2", "127.0.0.1:8102")], "127.0.0.1:8100")
    assert shipped == made
    assert "use-server r1 if { req.hdr(x-session-key) -m beg rsk-r1- }" in made


def test_replica_names_and_addresses_are_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="replica name 'r-1'"):
        replica_key_prefix("r-1")
    with pytest.raises(InvalidArgumentError, match="must differ"):
        haproxy_config([("a", "127.0.0.1:1"), ("a", "127.0.0.1:2")])
    with pytest.raises(InvalidArgumentError, match="HOST:PORT"):
        haproxy_config([("a", "127.0.0.1")])
    with pytest.raises(InvalidArgumentError, match="replica name"):
        create_app("http://127.0.0.1:9", replica="not ok")


def test_a_replica_mints_keys_carrying_its_name() -> None:
    app = create_app("http://127.0.0.1:9", replica="r7")
    session = app.state.sessions.create("one")
    assert session.api_key.startswith("rsk-r7-") and len(session.api_key) > 30


class _Replica:
    def __init__(self, name: str, port: int, data: Path, stub: str, redis: str) -> None:
        self.name, self.port, self.data, self.stub, self.redis = name, port, data, stub, redis
        self.process: Process | None = None

    def start(self) -> None:
        self.process = start_server_process(
            self.stub,
            *("--port", str(self.port), "--data", str(self.data)),
            *("--store", self.redis, "--replica", self.name),
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss_kib(self) -> int:
        assert self.process is not None
        status = Path(f"/proc/{self.process.proc.pid}/status").read_text()
        (line,) = [x for x in status.splitlines() if x.startswith("VmRSS:")]
        return int(line.split()[1])


def _haproxy(config: Path, port: int) -> subprocess.Popen[bytes]:
    binary = shutil.which("haproxy")
    if binary is None:
        unavailable("haproxy is not installed (apt-get install haproxy)")
    assert binary is not None
    check = subprocess.run([binary, "-c", "-f", str(config)], capture_output=True, timeout=30)
    assert check.returncode == 0, check.stderr.decode()
    proc = subprocess.Popen(
        [binary, "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        wait_for_port(port, WAIT_S)
    except StoreUnavailableError as exc:
        proc.kill()
        unavailable(f"haproxy did not start: {exc}")
    return proc


def _conversation(base: str, index: int, done: dict[str, Any], errors: list[str]) -> None:
    """One session, made through the balancer; TURNS calls with the OpenAI SDK (even
    sessions: Bearer) or the Anthropic SDK (odd: x-api-key)."""
    try:
        made = httpx.post(f"{base}/sessions", json={"session_id": f"agent-{index}"}, timeout=WAIT_S)
        made.raise_for_status()
        session = made.json()
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {index}"}]
        for turn in range(TURNS):
            if index % 2 == 0:
                client = openai.OpenAI(
                    base_url=f"{base}/v1", api_key=session["api_key"], max_retries=0
                )
                reply = client.chat.completions.create(model="m", messages=messages)
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            else:
                claude = anthropic.Anthropic(
                    base_url=base, api_key=session["api_key"], max_retries=0
                )
                answer = claude.messages.create(model="c", max_tokens=32, messages=messages)
                messages.append({"role": "assistant", "content": answer.content[0].text})  # type: ignore[union-attr]
            messages.append({"role": "user", "content": f"next {turn}"})
        done[session["session_id"]] = session
    except Exception as exc:  # reported by the test thread
        errors.append(f"session {index}: {exc!r}")


def _export(base: str, session: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.get(
        f"{base}/sessions/{session['session_id']}/export",
        params={"messages": "1"},
        headers={"authorization": f"Bearer {session['api_key']}"},
        timeout=WAIT_S,
    )
    answer.raise_for_status()
    doc: dict[str, Any] = answer.json()
    return doc


@pytest.mark.slow
def test_sessions_stay_whole_on_one_replica_through_haproxy(tmp_path: Path) -> None:
    (tmp_path / "redis").mkdir()
    redis = started(RedisServer(tmp_path / "redis"))
    stub = start_stub_process()
    replicas = [
        _Replica(name, free_port(), tmp_path / name, stub.url, redis.url) for name in ("r1", "r2")
    ]
    balancer_port = free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        haproxy_config(
            [(r.name, f"127.0.0.1:{r.port}") for r in replicas], f"127.0.0.1:{balancer_port}"
        )
    )
    haproxy = None
    try:
        for replica in replicas:
            replica.start()
        haproxy = _haproxy(config, balancer_port)
        base = f"http://127.0.0.1:{balancer_port}"

        done: dict[str, Any] = {}
        errors: list[str] = []
        threads = [
            threading.Thread(target=_conversation, args=(base, i, done, errors))
            for i in range(SESSIONS)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        assert len(done) == SESSIONS

        # each session is whole on exactly one replica: the one its key names
        holder: dict[str, _Replica] = {}
        before: dict[str, list[Any]] = {}
        for sid, session in done.items():
            doc = _export(base, session)
            assert len(doc["turns"]) == TURNS, sid
            before[sid] = doc["turns"]
            found = [
                r
                for r in replicas
                if httpx.get(f"{r.url}/sessions/{sid}", headers=ADMIN, timeout=WAIT_S).status_code
                == 200
            ]
            assert len(found) == 1, (sid, [r.name for r in found])
            assert session["api_key"].startswith(replica_key_prefix(found[0].name))
            holder[sid] = found[0]
        assert {r.name for r in holder.values()} == {"r1", "r2"}  # both replicas were used
        # a second create of a taken id is hashed to the same replica, which refuses it
        for sid in list(done)[:4]:
            again = httpx.post(f"{base}/sessions", json={"session_id": sid}, timeout=WAIT_S)
            assert again.status_code == 409, (sid, again.text)

        # kill -9 one replica, restart it on its port and data: every acknowledged turn is back
        victim = replicas[0]
        assert victim.process is not None
        victim.process.kill()
        victim.start()
        deadline = time.monotonic() + WAIT_S
        for sid, session in done.items():
            if holder[sid] is not victim:
                continue
            while True:  # until the balancer's health check sees the replica up again
                try:
                    doc = _export(base, session)
                    break
                except httpx.HTTPError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            # every acknowledged turn, byte for byte; timelines are written in batches (a
            # crash may lose the last ones, never a turn: docs/format.md), so not compared
            assert json.dumps(_untimed(doc["turns"])) == json.dumps(_untimed(before[sid])), sid

        # memory per idle session: RSS of a replica around 1,000 sessions of one turn each
        target = replicas[1]
        rss_before = target.rss_kib()
        key = {"authorization": "Bearer none"}

        def make(start: int) -> None:
            for i in range(start, 1000, 8):
                session = httpx.post(
                    f"{target.url}/sessions", json={"session_id": f"idle-{i}"}, timeout=WAIT_S
                ).json()
                key = {"authorization": f"Bearer {session['api_key']}"}
                httpx.post(
                    f"{target.url}/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": f"idle {i}"}]},
                    headers=key,
                    timeout=WAIT_S,
                ).raise_for_status()

        makers = [threading.Thread(target=make, args=(s,)) for s in range(8)]
        for maker in makers:
            maker.start()
        for maker in makers:
            maker.join(300)
        del key
        health = httpx.get(f"{target.url}/health", timeout=WAIT_S).json()
        assert health["sessions"] >= 1000
        time.sleep(2.0)  # past --trim-idle: the heap's free pages are given back
        rss_after = target.rss_kib()
        print(
            f"\nreplica RSS {rss_before} KiB -> {rss_after} KiB for 1000 sessions of one turn: "
            f"{(rss_after - rss_before) / 1000:.1f} KiB per idle session"
        )
    finally:
        if haproxy is not None:
            haproxy.kill()
            haproxy.wait(WAIT_S)
        for replica in replicas:
            if replica.process is not None:
                replica.process.kill()
        stub.kill()
        redis.stop()


def _untimed(turns: list[Any]) -> list[Any]:
    """The turns without their `timeline` key."""
    return [{k: v for k, v in turn.items() if k != "timeline"} for turn in turns]

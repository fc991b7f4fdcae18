"""A GRPO group through the capture server, and kill -9 of the server in the middle of one."""

from __future__ import annotations

import base64
import json
import random
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from capture_support import (
    ADMIN,
    export,
    new_session,
    serve_app,
    start_server_process,
)

from rollout_store import MemoryStore, RolloutGraph, content_key
from rollout_store.serve.server import create_app
from rollout_store.serve.stub_engine import create_stub_app

SYSTEM = {"role": "system", "content": "You are a careful agent. " * 40}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "click",
            "description": "Click on the screen.",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]
# one 200 KiB screenshot shared by every rollout of the group
IMAGE = "data:image/png;base64," + base64.b64encode(random.Random(7).randbytes(150_000)).decode()


def _task() -> list[Any]:
    return [
        SYSTEM,
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Find the settings button and open it."},
                {"type": "image_url", "image_url": {"url": IMAGE}},
            ],
        },
    ]


class Rollout:
    """One agent of the group: its conversation, and every body its SDK sent."""

    def __init__(self, session: dict[str, Any], seed: int) -> None:
        self.session = session
        self.seed = seed
        self.messages = _task()
        self.sent: list[bytes] = []
        self.acked: list[Any] = []  # response messages the client received
        self.acked_requests: list[str] = []  # json.dumps of the messages of those calls

    def client(self, base_url: str) -> openai.OpenAI:
        def keep(request: httpx.Request) -> None:
            if request.url.path.endswith("/chat/completions"):
                self.sent.append(request.content)

        http = httpx.Client(event_hooks={"request": [keep]}, timeout=30)
        return openai.OpenAI(
            base_url=base_url, api_key=self.session["api_key"], http_client=http, max_retries=0
        )

    def step(self, client: openai.OpenAI, k: int) -> None:
        stream = k % 3 == 2
        kwargs: dict[str, Any] = {
            "model": "policy",
            "messages": self.messages,
            "tools": TOOLS,
            "seed": self.seed,
            "temperature": 1.0,
        }
        if stream:
            content, calls = [], []
            for chunk in client.chat.completions.create(**kwargs, stream=True):
                for choice in chunk.choices:
                    content.append(choice.delta.content or "")
                    calls += [
                        c.model_dump(exclude_none=True) for c in choice.delta.tool_calls or []
                    ]
            message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
            if calls:
                message["tool_calls"] = [
                    {k: v for k, v in c.items() if k != "index"} for c in calls
                ]
        else:
            reply = client.chat.completions.create(**kwargs)
            message = reply.choices[0].message.model_dump(exclude_none=True)
        self.acked.append(message)
        self.acked_requests.append(json.dumps(self.messages))
        self.messages = self.messages + [message]
        if message.get("tool_calls"):
            call = message["tool_calls"][0]
            self.messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "content": f"clicked, seed {self.seed}",
                }
            )
        else:
            self.messages.append({"role": "user", "content": f"Go on (step {k})."})


def _run_group(url: str, n_sessions: int, n_turns: int) -> list[Rollout]:
    rollouts = [Rollout(new_session(url), seed) for seed in range(n_sessions)]
    errors: list[BaseException] = []

    def run(rollout: Rollout) -> None:
        try:
            client = rollout.client(rollout.session["openai_base_url"])
            for k in range(n_turns):
                rollout.step(client, k)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in rollouts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors[:3]
    return rollouts


def _check_exports(url: str, rollouts: list[Rollout], n_turns: int) -> None:
    for rollout in rollouts:
        doc = export(url, rollout.session["session_id"])
        turns = doc["turns"]
        assert len(turns) == n_turns == len(rollout.sent)
        for turn, body, acked in zip(turns, rollout.sent, rollout.acked, strict=True):
            sent = json.loads(body)
            # byte for byte under json.dumps: what the client sent is what comes out
            assert json.dumps(turn["request_messages"]) == json.dumps(sent["messages"])
            assert json.dumps(turn["request_tools"]) == json.dumps(sent["tools"])
            assert turn["response_message"]["content"] == acked.get("content")
        # one path: every turn continues the one before, by token ids
        (sequence,) = doc["sequences"]
        assert sequence["node_ids"] == [t["node_id"] for t in turns]
        assert sequence["n_turns"] == n_turns and sum(sequence["loss_mask"]) > 0
        assert doc["capture_level"] == "tokens"


def _group(tmp_path: Path, n_sessions: int, n_turns: int) -> None:
    with serve_app(create_stub_app()) as stub:
        app = create_app(stub, data=tmp_path / "data", fsync="never")
        with serve_app(app) as url:
            rollouts = _run_group(url, n_sessions, n_turns)
            _check_exports(url, rollouts, n_turns)
    seeds = {r.acked[0].get("tool_calls", [{}])[0].get("id") for r in rollouts}
    assert len(seeds) == n_sessions  # the rollouts did diverge
    # all sessions share one content store: the screenshot is in it once
    store = app.state.sessions.store
    assert isinstance(store, MemoryStore)
    assert store.contains(content_key(IMAGE.encode()))
    assert len(IMAGE) < store.nbytes < len(IMAGE) + 64 * 1024


def test_small_group(tmp_path: Path) -> None:
    _group(tmp_path, 4, 6)


@pytest.mark.slow
def test_grpo_group_16_sessions_20_turns(tmp_path: Path) -> None:
    _group(tmp_path, 16, 20)


# ---------------------------------------------------------------- kill -9


def _drive_until_killed(rollouts: list[Rollout], base: str, stop: threading.Event) -> None:
    def run(rollout: Rollout) -> None:
        client = rollout.client(f"{base}/v1")
        k = len(rollout.acked)
        while not stop.is_set():
            try:
                rollout.step(client, k)
            except (openai.APIConnectionError, openai.APIStatusError, httpx.HTTPError):
                return  # the server is gone: this call was not acknowledged
            k += 1

    threads = [threading.Thread(target=run, args=(r,)) for r in rollouts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)


def _kill_loop(tmp_path: Path, restarts: int, n_sessions: int) -> None:
    data = tmp_path / "data"
    rng = random.Random(20)
    with serve_app(create_stub_app()) as stub:
        server = start_server_process(stub, "--data", str(data), "--fsync", "turn")
        try:
            rollouts = [Rollout(new_session(server.url), seed) for seed in range(n_sessions)]
            for _ in range(restarts):
                stop = threading.Event()
                killer = threading.Timer(rng.uniform(0.3, 1.2), server.kill)
                killer.start()
                _drive_until_killed(rollouts, server.url, stop)
                stop.set()
                killer.join()
                server = start_server_process(stub, "--data", str(data))
            acked = sum(len(r.acked) for r in rollouts)
            assert acked > restarts * n_sessions  # the loop did record between kills
            print(f"{acked} acknowledged turns over {restarts} kill -9 restarts")
            for rollout in rollouts:
                sid = rollout.session["session_id"]
                answer = httpx.get(
                    f"{server.url}/sessions/{sid}/export",
                    params={"messages": "1", "discarded": "1"},
                    headers=ADMIN,
                    timeout=30,
                )
                doc = answer.json()
                recorded = [json.dumps(t["response_message"]["content"]) for t in doc["turns"]]
                for message in rollout.acked:  # every acknowledged turn is there
                    assert json.dumps(message.get("content")) in recorded
                requests = {json.dumps(t["request_messages"]) for t in doc["turns"]}
                assert set(rollout.acked_requests) <= requests
        finally:
            server.stop()
    for path in data.glob("*.rls"):
        RolloutGraph.load(path)  # every log is whole after a clean stop


@pytest.mark.slow
def test_kill_9_once(tmp_path: Path) -> None:
    _kill_loop(tmp_path, 1, 3)


@pytest.mark.slow
def test_kill_9_twenty_restarts_lose_no_acknowledged_turn(tmp_path: Path) -> None:
    _kill_loop(tmp_path, 20, 4)

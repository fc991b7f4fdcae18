"""`rollout-store serve --store redis://...` and `--store s3://bucket/prefix`: sessions recorded
through the server over a shared store, the server restarted (cleanly and with kill -9), and
every session exported byte-identical, with the group's shared screenshot in the store once.

The services come from ROLLOUT_STORE_REDIS_URL / ROLLOUT_STORE_S3_URL (.ci/run starts them)
or are started by tests/services.py; with CI=true a service that cannot start fails.
"""

from __future__ import annotations

import base64
import json
import random
import threading
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import openai
import pytest
from capture_support import export, new_session, start_server_process
from services import S3_CREDENTIALS

from rollout_store import RolloutGraph, content_key
from rollout_store.stores.redis_store import RedisStore
from rollout_store.stores.s3_store import S3Store

pytestmark = pytest.mark.slow

SESSIONS, TURNS = 4, 4
# one 200 KiB screenshot shared by every rollout of the group
IMAGE = "data:image/png;base64," + base64.b64encode(random.Random(11).randbytes(150_000)).decode()
SYSTEM = {"role": "system", "content": "You drive a browser. " * 50}
# the store's database on the Redis server: this test's own, emptied under the server's prefix
REDIS_DB = 9


def _store(kind: str, request: pytest.FixtureRequest) -> tuple[str, dict[str, str], Any]:
    """The `--store` value, the server's environment, and the store as the test reads it."""
    if kind == "redis":
        parts = urlsplit(request.getfixturevalue("redis_url"))
        url = urlunsplit(parts._replace(path=f"/{REDIS_DB}"))
        store = RedisStore(url)  # the server's default prefix
        for name in list(store.client.scan_iter(match=b"rollout_store:*")):
            store.client.delete(name)
        return url, {}, store
    endpoint = request.getfixturevalue("s3_url")
    bucket, prefix = f"server-{uuid.uuid4().hex[:12]}", f"{uuid.uuid4().hex}/"
    store = S3Store(
        bucket, endpoint_url=endpoint, prefix=prefix, create_bucket=True, **S3_CREDENTIALS
    )
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": S3_CREDENTIALS["aws_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": S3_CREDENTIALS["aws_secret_access_key"],
        "AWS_DEFAULT_REGION": S3_CREDENTIALS["region_name"],
    }
    return f"s3://{bucket}/{prefix}", env, store


def _drive(base: str, session: dict[str, Any], seed: int, sent: list[bytes]) -> None:
    def keep(request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            sent.append(request.content)

    http = httpx.Client(event_hooks={"request": [keep]}, timeout=30)
    client = openai.OpenAI(
        base_url=f"{base}/v1", api_key=session["api_key"], http_client=http, max_retries=0
    )
    messages: list[Any] = [
        SYSTEM,
        {
            "role": "user",
            "content": [
                {"type": "text", "text": f"Task {seed}: open the settings."},
                {"type": "image_url", "image_url": {"url": IMAGE}},
            ],
        },
    ]
    for k in range(TURNS):
        if k % 2:
            parts = client.chat.completions.create(
                model="policy", messages=messages, seed=seed, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
            message: dict[str, Any] = {"role": "assistant", "content": text}
        else:
            reply = client.chat.completions.create(model="policy", messages=messages, seed=seed)
            message = reply.choices[0].message.model_dump(exclude_none=True)
        messages = [*messages, message, {"role": "user", "content": f"Go on ({k})."}]


def _group(base: str) -> list[tuple[dict[str, Any], list[bytes]]]:
    rollouts = [(new_session(base), []) for _ in range(SESSIONS)]
    errors: list[BaseException] = []

    def run(seed: int, session: dict[str, Any], sent: list[bytes]) -> None:
        try:
            _drive(base, session, seed, sent)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(seed, *rollout)) for seed, rollout in enumerate(rollouts)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors[:3]
    return rollouts


def _exports(base: str, rollouts: list[tuple[dict[str, Any], list[bytes]]]) -> list[str]:
    docs = []
    for session, sent in rollouts:
        doc = export(base, session["session_id"])
        assert len(doc["turns"]) == TURNS == len(sent)
        for turn, body in zip(doc["turns"], sent, strict=True):
            assert json.dumps(turn["request_messages"]) == json.dumps(json.loads(body)["messages"])
        assert doc["capture_level"] == "tokens" and len(doc["sequences"]) == 1
        docs.append(json.dumps(doc))
    return docs


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_sessions_over_a_shared_store_survive_restarts(
    kind: str, stub: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    spec, env, store = _store(kind, request)
    data = tmp_path / "data"
    args = ("--data", str(data), "--store", spec)
    server = start_server_process(stub, *args, env=env)
    try:
        rollouts = _group(server.url)
        before = _exports(server.url, rollouts)
        server.stop()  # SIGTERM: uvicorn shuts down, then re-raises the signal
        server = start_server_process(stub, *args, env=env)
        assert _exports(server.url, rollouts) == before  # byte-identical after a clean stop
        server.kill()  # and after kill -9
        server = start_server_process(stub, *args, env=env)
        assert _exports(server.url, rollouts) == before
    finally:
        server.stop()
    # the logs hold references: the screenshot is in the store once, in no log
    logs = list(data.glob("*.rls"))
    assert len(logs) == SESSIONS
    assert all(IMAGE.encode() not in path.read_bytes() for path in logs)
    assert store.contains(content_key(IMAGE.encode()))
    keys = list(store.keys())  # a store is no mapping: keys() is its listing
    stored = sum(len(store.get(key)) for key in keys)
    assert len(IMAGE) <= stored < len(IMAGE) + 64 * 1024
    for path in logs:  # each log reads back over the store alone
        graph = RolloutGraph.load(path, store=store)
        assert len(graph) == TURNS

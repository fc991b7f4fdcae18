"""The capture server and its stub engine as `.ci/run` starts them: separate processes on
loopback ports of their own, found through ROLLOUT_STORE_SERVER_URL and
ROLLOUT_STORE_STUB_URL. The official OpenAI SDK records a two-turn conversation through the
server, non-streaming then streaming, and the export holds exactly what it sent. Outside CI
(variables unset) the test is skipped; with CI=true a server that is missing or not
answering fails it."""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import openai
import pytest
from capture_support import WAIT_S, export, new_session
from services import unavailable

SERVER_URL = os.environ.get("ROLLOUT_STORE_SERVER_URL", "")
STUB_URL = os.environ.get("ROLLOUT_STORE_STUB_URL", "")


@pytest.fixture
def server_url() -> str:
    if not SERVER_URL or not STUB_URL:
        unavailable("ROLLOUT_STORE_SERVER_URL / ROLLOUT_STORE_STUB_URL are not set")
    for url in (f"{SERVER_URL}/sessions", f"{STUB_URL}/v1/models"):
        try:
            httpx.get(url, timeout=WAIT_S)
        except httpx.HTTPError as exc:
            unavailable(f"nothing answers at {url}: {exc}")
    return SERVER_URL


def test_the_ci_capture_server_records_what_the_sdk_sent(server_url: str) -> None:
    session = new_session(server_url)
    client = openai.OpenAI(
        base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
    )
    first: list[Any] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2? \U0001f600 -0.0"},
    ]
    reply = client.chat.completions.create(model="stub", messages=first)
    answer = reply.choices[0].message.content
    assert answer
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "?"}]
    chunks = list(client.chat.completions.create(model="stub", messages=second, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    doc = export(server_url, session["session_id"])
    turns = doc["turns"]
    assert [json.dumps(t["request_messages"]) for t in turns] == [
        json.dumps(first),
        json.dumps(second),
    ]
    assert turns[0]["response_message"]["content"] == answer
    assert turns[1]["root_id"] == turns[0]["node_id"]  # the second turn continues the first

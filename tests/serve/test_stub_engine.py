"""The stub engine's benchmark options: replies as long as asked, generation time per token."""

from __future__ import annotations

import time

from starlette.testclient import TestClient

from rollout_store.serve.stub_engine import create_stub_app

BODY = {"model": "policy", "messages": [{"role": "user", "content": "Fix the test."}]}


def test_fill_makes_a_plain_reply_max_tokens_words_long() -> None:
    with TestClient(create_stub_app(fill=True)) as client:
        answer = client.post("/v1/chat/completions", json={**BODY, "max_tokens": 450}).json()
        assert len(answer["choices"][0]["message"]["content"].split()) == 450
        assert answer["usage"]["completion_tokens"] == 451  # the words and the end token
        again = client.post("/v1/chat/completions", json={**BODY, "max_tokens": 450}).json()
        assert again == answer  # still deterministic
        reply = client.post("/v1/messages", json={**BODY, "max_tokens": 30}).json()
        assert len(reply["content"][0]["text"].split()) == 30
    with TestClient(create_stub_app()) as client:  # off by default
        answer = client.post("/v1/chat/completions", json={**BODY, "max_tokens": 450}).json()
        assert len(answer["choices"][0]["message"]["content"].split()) < 20


def test_generation_time_grows_with_the_output() -> None:
    with TestClient(create_stub_app(per_token=0.001, fill=True)) as client:
        start = time.perf_counter()
        client.post("/v1/chat/completions", json={**BODY, "max_tokens": 300})
        assert time.perf_counter() - start >= 0.3

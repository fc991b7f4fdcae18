"""Conversations through the capture server's raw intake (`split_body`, then `chat_turn`) and
through decoded values: the same links, forks, discarded retries and export bytes.

Each message keeps the spelling it was first sent with (json.dumps options, a duplicate key,
escaped or raw unicode) and each request its own separators, so a re-sent prefix is the same
bytes and the raw fast path (`RequestStore._prepare_raw`) confirms it; values are json.dumps's
edge cases and strings around the share threshold.
"""

from __future__ import annotations

import io
import json
import random
from typing import Any

import pytest

from rollout_store import RawJSON, RolloutGraph, write_session_json
from rollout_store.engine.requests import _NOT_FAST, RequestStore
from rollout_store.serve.server import CHAT_RAW_FIELDS, chat_turn, split_body

_THRESHOLD = 64
_ODD: list[Any] = [
    2**70,
    -(2**64),
    2**64 - 1,
    -0.0,
    float("nan"),
    float("inf"),
    1,
    1.0,
    True,
    None,
    "\ud800",
    "\u00e9",
    "\u2028",
    "",
    [],
    {},
    [{}],
    1e300,
    5e-324,
]
_PLAIN: list[Any] = ["hi", 1, 2.5, None, True, []]
_SPELLINGS: list[dict[str, Any]] = [
    {},
    {"ensure_ascii": False},
    {"indent": 1},
    {"separators": (",", ":")},
    {"indent": "\t", "ensure_ascii": False},
]
_SEPARATORS = [", ", ",", " , ", ",\n  "]


def _string(rng: random.Random) -> str:
    n = rng.choice([_THRESHOLD - 1, _THRESHOLD, _THRESHOLD + 1, 5])
    return (rng.choice(["a", "\u00e9", "\\", '"', "\U0001f4a5", "\ud800"]) * n)[:n]


def _value(rng: random.Random, pool: list[Any], depth: int = 0) -> Any:
    r = rng.random()
    if r < 0.4 or depth > 2:
        return rng.choice(pool)
    if r < 0.6:
        return _string(rng)
    if r < 0.8:
        return [_value(rng, pool, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["a", "b", "\u00e9"]): _value(rng, pool, depth + 1) for _ in range(3)}


def _spelled(rng: random.Random, message: dict[str, Any]) -> str:
    text = json.dumps(message, **rng.choice(_SPELLINGS))
    if rng.random() < 0.1:  # a duplicate key: json.loads keeps the later one
        text = '{"role": "dropped", ' + text[1:]
    return text


def _conversations(seed: int) -> list[tuple[list[str], str]]:
    """Requests (message texts) and response texts: continuations of the latest turn, forks
    of earlier ones, retries, new conversations."""
    rng = random.Random(seed)
    pool = _PLAIN if rng.random() < 0.5 else _ODD
    turns: list[tuple[list[str], str]] = []
    for t in range(rng.randint(2, 10)):
        r = rng.random()
        if not turns or r < 0.15:
            items = [_spelled(rng, {"role": "system", "content": _string(rng)})]
            items.append(_spelled(rng, {"role": "user", "content": _value(rng, pool)}))
        else:
            items, answer = turns[-1] if r < 0.7 else rng.choice(turns)
            items = list(items)
            if rng.random() > 0.15:  # else a retry of that request
                items.append(answer)
                items.append(_spelled(rng, {"role": "user", "content": _value(rng, pool)}))
        content = _value(rng, pool) if rng.random() < 0.5 else f"answer {t}"
        turns.append((items, _spelled(rng, {"role": "assistant", "content": content})))
    return turns


def _body(rng: random.Random, items: list[str]) -> bytes:
    messages = "[" + rng.choice(_SEPARATORS).join(items) + "]"
    return f'{{"model": "m", "messages": {messages}, "temperature": 0.5}}'.encode(
        "utf-8", "surrogatepass"
    )


def _record(turns: list[tuple[list[str], str]], raw: bool, text: bool = False) -> RolloutGraph:
    """The turns recorded from their bodies: decoded, split (`raw`), or split with the
    messages handed over as `RawJSON` of a str (`text`: the byte path reads its UTF-8)."""
    graph = RolloutGraph(share_threshold=_THRESHOLD)
    rng = random.Random(len(turns))
    for items, answer in turns:
        body = _body(rng, items)
        fields = split_body(body, CHAT_RAW_FIELDS) if raw else None
        fields = fields if fields is not None else json.loads(body)
        if text and type(fields["messages"]) is RawJSON:
            data = fields["messages"].data
            fields["messages"] = RawJSON(data.decode("utf-8", "surrogatepass"))
        reply = {"choices": [{"message": json.loads(answer)}]}
        graph.add_turn(chat_turn(fields, reply, None))
    return graph


def _fingerprint(graph: RolloutGraph) -> list[Any]:
    out: list[Any] = [
        (n, graph.parent(n), graph.link_kind(n), json.dumps(graph.request_messages(n)))
        for n in graph.node_ids()
    ]
    out += [sorted(graph.discarded_ids()), graph.fork_ids()]
    text = io.StringIO()
    write_session_json(graph, text, include_messages=True, include_discarded=True)
    return [*out, text.getvalue()]


def _check(seeds: range, monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[bool] = []
    taken_str = 0
    prepare_raw = RequestStore._prepare_raw

    def counting(self: RequestStore, *args: Any) -> Any:
        done = prepare_raw(self, *args)
        taken.append(done is not _NOT_FAST)
        return done

    monkeypatch.setattr(RequestStore, "_prepare_raw", counting)
    for seed in seeds:
        turns = _conversations(seed)
        raw, decoded = _record(turns, raw=True), _record(turns, raw=False)
        assert _fingerprint(raw) == _fingerprint(decoded), f"seed {seed}"
        before = sum(taken)
        assert _fingerprint(_record(turns, raw=True, text=True)) == _fingerprint(decoded)
        taken_str += sum(taken) - before
        for node_id, (items, _) in zip(raw.node_ids(), turns, strict=True):
            sent = json.loads("[" + ", ".join(items) + "]")
            assert json.dumps(raw.request_messages(node_id)) == json.dumps(sent), f"seed {seed}"
    assert sum(taken) >= len(seeds) // 4  # the fast path was taken (else this tests nothing)
    assert taken_str >= len(seeds) // 8  # by str texts too


def test_raw_intake_records_as_decoded_values(monkeypatch: pytest.MonkeyPatch) -> None:
    _check(range(12), monkeypatch)


@pytest.mark.slow
def test_raw_intake_records_as_decoded_values_many(monkeypatch: pytest.MonkeyPatch) -> None:
    _check(range(12, 1500), monkeypatch)

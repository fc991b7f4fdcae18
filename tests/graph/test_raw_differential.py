"""Conversations fed as `RawJSON` bytes and as the same messages decoded (`json.loads`): the
same node ids, parents, link kinds, stored messages, stats, export and saved file, and later
turns (raw or decoded, after a reload too) linking the same way.

Plans mix what the raw path (`RequestStore._prepare_raw`) takes and what it leaves to the
decoded path: exact and loose echoes of the base's response (nulls dropped at top level or
nested, keys reordered, null content left out, arguments re-serialized, role added), echoes
that are not loose echoes, retries of one call in waves and continuations of one of them,
forks from older turns, token ids, long strings (holes), system messages that change,
lone surrogates, NaN and big ints in the new messages, and bad texts (refused as the
decoded path refuses them, with the graph left as it was).
"""

from __future__ import annotations

import io
import json
import random
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import messages as supported_messages
from support import small_json

from rollout_store import (
    DirectoryStore,
    InvalidValueError,
    MemoryStore,
    RawJSON,
    RolloutGraph,
    StringCache,
    TurnNode,
    write_session_json,
)
from rollout_store.engine.requests import _NOT_FAST, RequestStore
from rollout_store.engine.stored import TAIL_ECHO

_LONG = 1 << 14  # HOLE_MIN: a blob string long enough to be a hole of a raw tip
_SPELLINGS: list[dict[str, Any]] = [
    {},
    {"ensure_ascii": False},
    {"separators": (",", ":")},
    {"indent": 1},
]


def _long(rng: random.Random, tag: str) -> str:
    return (tag + " " + rng.choice("abcdef") * 40) * (_LONG // 40 + 1)


def _odd(rng: random.Random) -> Any:
    return rng.choice(
        [
            "plain",
            "lone \ud800 surrogate",
            float("nan"),
            2**70,
            -(2**64) - 1,
            -0.0,
            1.0,
            [None, {"k": None}],
            "",
            {"nested": {"deep": [1, None, "x"]}},
        ]
    )


def _response(rng: random.Random, k: int) -> dict[str, Any]:
    """A response with the null fields providers add, maybe tool calls, long strings,
    odd values, no role."""
    kind = rng.randrange(9)
    response: dict[str, Any] = {"role": "assistant", "content": f"answer {k}"}
    if kind == 1:
        call = {"name": "run", "arguments": json.dumps({"k": k, "x": None}), "extra": None}
        response = {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "tool_calls": [{"id": f"c{k}", "type": "function", "function": call}],
        }
    elif kind == 2:
        response = {"content": f"no role {k}", "refusal": None, "audio": None}
    elif kind == 3:
        response["content"] = _long(rng, f"resp{k}")
        response["annotations"] = None
    elif kind == 4:
        response["meta"] = {"a": None, "b": [None, 1], "c": {"d": None}}
        response["refusal"] = None
    elif kind == 5:
        response["score"] = rng.choice([2**70, -0.0, "\udc00", 1.5])
    elif kind == 6:
        response["content"] = [{"type": "text", "text": f"parts {k}", "annotations": None}]
    elif kind == 7:  # a record kept in a store (no blob in it)
        response["content"] = f"medium {k} " + "m" * 300
        response["refusal"] = None
    return response


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _echo(rng: random.Random, response: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The harness sending `response` back (a fresh copy), and how; None: no echo."""
    echo = json.loads(json.dumps(response))
    roll = rng.random()
    if roll < 0.3:
        return echo, "exact"
    if roll < 0.45:
        return {k: v for k, v in echo.items() if v is not None}, "top nulls"
    if roll < 0.55:
        return _drop_nulls(echo), "nested nulls"
    if roll < 0.62:
        return {"role": "assistant", **{k: v for k, v in echo.items() if k != "role"}}, "role"
    if roll < 0.7:
        return dict(reversed(list(echo.items()))), "reordered"
    if roll < 0.76:
        if echo.get("content") is None:
            echo["content"] = ""
        else:
            echo.pop("refusal", None)
        return echo, "null content"
    if roll < 0.82 and "tool_calls" in echo:
        for call in echo["tool_calls"]:
            function = call["function"]
            function["arguments"] = json.dumps(json.loads(function["arguments"]), indent=2)
        return echo, "arguments"
    if roll < 0.9:
        if isinstance(echo.get("content"), str):
            echo["content"] += " (edited)"
        else:
            echo["content"] = "something else"
        return echo, "not an echo"
    if roll < 0.95:
        return None, "no echo"
    return {"role": "assistant"}, "bare"


class _Plan:
    """Turns (request messages, response, token ids, raw or not, the text's spelling)."""

    def __init__(self, seed: int) -> None:
        self.rng = rng = random.Random(seed)
        self.turns: list[dict[str, Any]] = []
        self.raw_share = rng.choice((1.0, 1.0, 0.8, 0.5))
        self.tokens = rng.random() < 0.3
        self.k = 0

    def _new_message(self) -> dict[str, Any]:
        rng = self.rng
        self.k += 1
        r = rng.random()
        if r < 0.15:
            return {"role": "user", "content": _long(rng, f"user{self.k}")}
        if r < 0.35:
            return {"role": "user", "content": _odd(rng), "n": self.k}
        if r < 0.45:
            return {"role": "tool", "tool_call_id": f"c{self.k}", "content": f"ok {self.k}"}
        return {"role": "user", "content": f"question {self.k}"}

    def _add(
        self,
        messages: list[Any],
        spelling: dict[str, Any],
        prompt: list[int] | None,
        bad: bool = False,
    ) -> dict[str, Any]:
        rng = self.rng
        self.k += 1
        turn: dict[str, Any] = {
            "messages": messages,
            "response": _response(rng, self.k),
            "spelling": spelling,
            "raw": rng.random() < self.raw_share,
            "bad": bad,
        }
        if prompt is not None:
            turn["prompt_ids"] = prompt
            turn["sampled_ids"] = [rng.randrange(50) for _ in range(rng.randint(0, 3))]
        self.turns.append(turn)
        return turn

    def _root(self) -> None:
        rng = self.rng
        system = rng.choice(["be brief", "be thorough", "s" * 600, _long(rng, "system")])
        messages: list[Any] = [{"role": "system", "content": system}]
        if rng.random() < 0.2:
            messages.append({"role": "developer", "content": f"dev {self.k}"})
        messages.append(self._new_message())
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 6))] if self.tokens else None
        self._add(messages, rng.choice(_SPELLINGS), prompt)

    def _continue(self, parent: dict[str, Any], bad: bool = False) -> None:
        rng = self.rng
        echo, _how = _echo(rng, parent["response"])
        messages = list(parent["messages"])
        if echo is not None:
            messages.append(echo)
        for _ in range(rng.choice((1, 1, 2))):
            messages.append(self._new_message())
        prompt = None
        if "prompt_ids" in parent:
            prompt = [*parent["prompt_ids"], *parent["sampled_ids"], 7]
            if rng.random() < 0.1:
                prompt = [rng.randrange(1000)]  # tokens that continue nothing
        spelling = parent["spelling"]
        if rng.random() < 0.05:  # the system message edited: a new text altogether
            messages[0] = {"role": "system", "content": "changed"}
        self._add(messages, spelling, prompt, bad)

    def build(self) -> list[dict[str, Any]]:
        rng = self.rng
        self._root()
        for _ in range(rng.randint(3, 14)):
            r = rng.random()
            if r < 0.08:
                self._root()
            elif r < 0.6:
                self._continue(self.turns[-1])
            elif r < 0.75:
                self._continue(rng.choice(self.turns))  # a fork of an older turn
            elif r < 0.9:  # a wave of retries of one call, then one of them continued
                call = rng.choice(self.turns[-3:])
                twins = [call]
                for _ in range(rng.randint(1, 3)):
                    twin = dict(call)
                    self.k += 1
                    twin["response"] = (
                        dict(call["response"]) if rng.random() < 0.3 else _response(rng, self.k)
                    )
                    twin["raw"] = rng.random() < self.raw_share
                    self.turns.append(twin)
                    twins.append(twin)
                for _ in range(rng.randint(1, 2)):
                    self._continue(rng.choice(twins))
            else:
                self._continue(self.turns[-1], bad=True)
        return self.turns


def _text(turn: dict[str, Any]) -> bytes:
    text = json.dumps(turn["messages"], **turn["spelling"]).encode("utf-8", "surrogatepass")
    if turn["bad"]:  # the last new message broken: what json.loads refuses
        cut = text.rindex(b"{")
        text = text[:cut] + b'{"role": "user", "content": }' + text[text.rindex(b"}") + 1 :]
    return text


def _node(turn: dict[str, Any], raw: bool) -> TurnNode:
    text = _text(turn)
    fields: dict[str, Any] = {
        "request_messages": RawJSON(text) if raw else json.loads(text),
        "response_message": json.loads(json.dumps(turn["response"])),
    }
    for name in ("prompt_ids", "sampled_ids"):
        if name in turn:
            fields[name] = list(turn[name])
    return TurnNode(**fields)


def _fingerprint(graph: RolloutGraph) -> list[Any]:
    ids = graph.node_ids()
    out: list[Any] = [
        (
            n,
            graph.parent(n),
            graph.link_kind(n),
            graph.path_ids(n),
            json.dumps(graph.request_messages(n)),
            json.dumps(graph.response_message(n)),
            graph.summary(n),
            graph.get(n).prompt_ids,
            graph.get(n).sampled_ids,
        )
        for n in ids
    ]
    out += [sorted(graph.discarded_ids()), graph.fork_ids(), graph.stats(), graph.drift()]
    text = io.StringIO()
    write_session_json(graph, text, include_messages=True, include_discarded=True)
    return [*out, text.getvalue()]


def _feed(graph: RolloutGraph, turns: list[dict[str, Any]], raw: bool) -> int:
    """Add the turns (raw where a turn says so and `raw`); how many were refused. A bad
    text is refused as json.loads refuses it, naming the field, and changes nothing."""
    refused = 0
    for turn in turns:
        as_raw = raw and turn["raw"]
        if not turn["bad"]:
            graph.add_turn(_node(turn, as_raw))
            continue
        refused += 1
        with pytest.raises(ValueError) as decoded_error:
            json.loads(_text(turn))
        if as_raw:
            before = _fingerprint(graph)
            with pytest.raises(InvalidValueError) as error:
                graph.add_turn(_node(turn, as_raw))
            assert error.value.path == "request_messages"
            assert str(decoded_error.value) in error.value.reason
            assert _fingerprint(graph) == before
    return refused


def _records(path: Path) -> list[tuple[int, Any]]:
    """The records of a saved file, exactly, but the header's file id (new each save)."""
    data = path.read_bytes()
    frame = struct.Struct("<5sBIQQ")
    out: list[tuple[int, Any]] = []
    offset = 8
    while offset < len(data):
        _, kind, length, _, _ = frame.unpack_from(data, offset)
        payload = data[offset + frame.size : offset + frame.size + length]
        offset += frame.size + length
        if not out:  # the header
            header = msgpack.unpackb(payload, raw=False)
            header.pop("file_id")
            out.append((kind, header))
        else:
            out.append((kind, payload))
    return out


def _graphs(kind: str, tmp: Path) -> tuple[RolloutGraph, RolloutGraph]:
    def one(name: str) -> RolloutGraph:
        if kind == "memory":
            return RolloutGraph(store=MemoryStore(), share_threshold=256)
        if kind == "directory":
            (tmp / name).mkdir()
            return RolloutGraph(store=DirectoryStore(tmp / name, fsync=False), share_threshold=256)
        if kind == "log":
            return RolloutGraph.open(tmp / f"{name}.log", share_threshold=256, fsync="never")
        return RolloutGraph(share_threshold=256 if kind == "small" else 1024)

    return one("raw"), one("decoded")


def _check(seed: int, kind: str, tmp: Path) -> None:
    turns = _Plan(seed).build()
    half = len(turns) * 2 // 3
    raw, decoded = _graphs(kind, tmp)
    assert _feed(raw, turns[:half], raw=True) == _feed(decoded, turns[:half], raw=False)
    assert _fingerprint(raw) == _fingerprint(decoded), seed
    sent = [json.loads(_text(t)) for t in turns[:half] if not t["bad"]]
    for node_id, messages in zip(raw.node_ids(), sent, strict=True):
        assert json.dumps(raw.request_messages(node_id)) == json.dumps(messages), seed
    # saved and loaded: the same file, and later turns (raw for both) link the same way
    if kind == "log":  # the logs they appended, then read back
        raw.close()
        decoded.close()
        assert _records(tmp / "raw.log") == _records(tmp / "decoded.log"), seed
        raw, decoded = RolloutGraph.load(tmp / "raw.log"), RolloutGraph.load(tmp / "decoded.log")
        assert _fingerprint(raw) == _fingerprint(decoded), seed
    raw.save(tmp / "raw.rls")
    decoded.save(tmp / "decoded.rls")
    assert _records(tmp / "raw.rls") == _records(tmp / "decoded.rls"), seed
    loaded = RolloutGraph.load(tmp / "raw.rls")
    decoded_loaded = RolloutGraph.load(tmp / "decoded.rls")
    assert _fingerprint(loaded) == _fingerprint(decoded_loaded), seed
    _feed(decoded, turns[half:], raw=False)
    _feed(decoded_loaded, turns[half:], raw=False)
    _feed(raw, turns[half:], raw=True)
    _feed(loaded, turns[half:], raw=True)
    assert _fingerprint(raw) == _fingerprint(decoded), seed
    assert _fingerprint(loaded) == _fingerprint(decoded_loaded), seed


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """How each raw text was stored: "exact" or "loose" (taken by the raw path, after an
    exact or a loose echo), or "decoded" (decoded whole)."""
    found: list[str] = []
    prepare_raw = RequestStore._prepare_raw

    def counting(self: RequestStore, turn: Any, scratch: Any, data: bytes) -> Any:
        done = prepare_raw(self, turn, scratch, data)
        how = "exact" if turn.flags & TAIL_ECHO else "loose"
        found.append("decoded" if done is _NOT_FAST else how)
        return done

    monkeypatch.setattr(RequestStore, "_prepare_raw", counting)
    return found


@pytest.mark.parametrize("kind", ["plain", "small", "memory", "directory", "log"])
@pytest.mark.parametrize("seed", range(8))
def test_raw_and_decoded_plans_agree(kind: str, seed: int, tmp_path: Path) -> None:
    _check(seed, kind, tmp_path)


def test_plans_take_the_raw_path_after_exact_and_loose_echoes(
    tmp_path: Path, taken: list[str]
) -> None:
    """The plans above exercise the raw path (else they test nothing)."""
    for seed in range(8):
        (tmp_path / str(seed)).mkdir()
        _check(seed, "plain", tmp_path / str(seed))
    assert taken.count("loose") >= 5 and taken.count("exact") >= 5, taken


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(["plain", "small", "memory"]))
def test_raw_and_decoded_random_plans_agree(
    seed: int, kind: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    _check(seed, kind, tmp_path_factory.mktemp("plan"))


def _session(graph: RolloutGraph, raw: bool, tag: str) -> None:
    """A conversation with a long system message whose harness drops null fields: decoded
    whole first, then taken by the raw path (a loose echo, then an exact one)."""
    history: list[Any] = [
        {"role": "system", "content": "rules " * 200},
        {"role": "user", "content": f"q {tag}"},
    ]
    for i in range(4):
        response = {"role": "assistant", "content": f"a{i} {tag}", "refusal": None}
        text = json.dumps(history).encode()
        request: Any = RawJSON(text) if raw else json.loads(text)
        graph.add_turn(TurnNode(request_messages=request, response_message=response))
        echo = response if i % 2 else {k: v for k, v in response.items() if v is not None}
        history = [*history, echo, {"role": "user", "content": f"next {i}"}]


def test_raw_sessions_put_into_the_store_what_decoded_ones_put(taken: list[bool]) -> None:
    """Graphs over a memory store: raw texts put no object that the same messages decoded
    do not put (a raw tip's system part is shared, not stored: no turn refers to it), also
    for a turn refused after its messages were prepared."""
    stores = {raw: MemoryStore() for raw in (True, False)}
    for raw, store in stores.items():
        graph = RolloutGraph(store=store)
        _session(graph, raw, "x")
        with pytest.raises(InvalidValueError):
            messages = [{"role": "system", "content": "other " * 100}, {"role": "user"}]
            text = json.dumps(messages).encode()
            graph.add_turn(
                TurnNode(
                    request_messages=RawJSON(text) if raw else json.loads(text),
                    request_tools=[{"bad": b"bytes"}],
                )
            )
    assert any(taken)
    assert sorted(stores[True].keys()) == sorted(stores[False].keys())
    assert stores[True].nbytes == stores[False].nbytes


def test_raw_tips_of_graphs_sharing_a_cache_share_their_system_part() -> None:
    """A capture server's sessions (graphs over one memory store, with one cache): one
    object for the system part of every session's raw tip."""
    store, cache = MemoryStore(), StringCache()
    graphs = [RolloutGraph(store=store, cache=cache) for _ in range(3)]
    for i, graph in enumerate(graphs):
        _session(graph, True, str(i))
    tips = [tip for g in graphs for tip in g._requests.raw_tips._order.values()]
    assert len(tips) == 3 and tips[0].system_plain is not None
    assert all(tip.system_plain is tips[0].system_plain for tip in tips)


_ASK: list[Any] = [{"role": "system", "content": "s"}, {"role": "user", "content": "go"}]
_WITH_NULLS = {"role": "assistant", "content": "x", "refusal": None}
_WITHOUT = {"role": "assistant", "content": "x"}


@pytest.mark.parametrize(
    "order",
    [
        ("a", "b", "twin", "c"),  # the twin takes b (it echoes the twin exactly)
        ("a", "twin", "b", "c"),  # b finds the twin's exact echo first
        ("a", "b", "loose twin", "c"),  # another loose twin: b stays
        ("a", "b", "c", "twin", "loose twin", "d"),
    ],
)
@pytest.mark.parametrize("raw_twins", [True, False])
def test_twins_of_a_call_continued_loosely_by_raw_texts(
    order: tuple[str, ...], raw_twins: bool, taken: list[str]
) -> None:
    """A call's harness drops null fields (b echoes a loosely); a retry of the call (a twin)
    whose response b echoes exactly takes b, as for decoded input; c and d continue b."""
    b = [*_ASK, _WITHOUT, {"role": "user", "content": "more"}]
    c = [*b, {"role": "assistant", "content": "y"}, {"role": "user", "content": "again"}]
    d = [*c, {"role": "assistant", "content": "z"}, {"role": "user", "content": "last"}]
    turns = {
        "a": (_ASK, _WITH_NULLS, True),
        "twin": (_ASK, _WITHOUT, raw_twins),
        "loose twin": (_ASK, {**_WITHOUT, "audio": None}, raw_twins),
        "b": (b, {"role": "assistant", "content": "y", "refusal": None}, True),
        "c": (c, {"role": "assistant", "content": "z"}, True),
        "d": (d, {"role": "assistant", "content": "w"}, True),
    }
    graphs = RolloutGraph(), RolloutGraph()
    for name in order:
        messages, response, raw = turns[name]
        text = json.dumps(messages).encode()
        for graph, as_raw in zip(graphs, (raw, False), strict=True):
            request: Any = RawJSON(text) if as_raw else json.loads(text)
            node = TurnNode(request_messages=request, response_message=response, node_id=name)
            graph.add_turn(node)
    assert _fingerprint(graphs[0]) == _fingerprint(graphs[1])
    if order[:2] == ("a", "b"):
        assert "loose" in taken  # b was taken by the raw path
    if "twin" in order:
        assert graphs[0].parent("b") == "twin"


_CALL = {"name": "look", "arguments": '{"at": [1, 2], "why": null}'}
_RESPONSES: dict[str, dict[str, Any]] = {
    "tools": {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": _CALL, "index": None}],
        "audio": None,
    },
    "text": {"content": "seen", "refusal": None, "annotations": [], "meta": {"x": None}},
}


def _respaced(message: dict[str, Any]) -> dict[str, Any]:
    message = json.loads(json.dumps(message))
    for call in message["tool_calls"]:
        arguments = json.loads(call["function"]["arguments"])
        call["function"]["arguments"] = json.dumps(arguments, indent=2)
    return message


_ECHOES: dict[str, tuple[str, Any, bool]] = {
    # name: (response, the echo made of it, whether it is a loose echo)
    "top nulls": ("tools", lambda m: {k: v for k, v in m.items() if v is not None}, True),
    "nested nulls": ("tools", _drop_nulls, True),
    "reordered": ("tools", lambda m: dict(reversed(list(m.items()))), True),
    "empty content": ("tools", lambda m: {**m, "content": ""}, True),
    "arguments respaced": ("tools", _respaced, True),
    "role added": ("text", lambda m: {"role": "assistant", **m}, True),
    "role and nulls": ("text", lambda m: {"role": "assistant", **_drop_nulls(m)}, True),
    "content parts": (
        "text",
        lambda m: {"role": "assistant", **m, "content": [{"type": "text", "text": "seen"}]},
        True,
    ),
    "exact": ("text", lambda m: m, False),
    "content edited": ("text", lambda m: {**m, "content": "unseen"}, False),
    "other arguments": (
        "tools",
        lambda m: {**m, "tool_calls": [{**m["tool_calls"][0], "function": {"name": "look"}}]},
        False,
    ),
    "user role": ("text", lambda m: {**m, "role": "user"}, False),
    "not a message": ("text", lambda m: ["seen"], False),
}


@pytest.mark.parametrize("name", sorted(_ECHOES))
@pytest.mark.parametrize("spelling", range(len(_SPELLINGS)))
def test_each_kind_of_echo_raw_and_decoded(name: str, spelling: int, taken: list[str]) -> None:
    """Every kind of loose echo `echoes` accepts is taken by the raw path (stored as sent),
    the others are decoded whole; raw texts and the same messages decoded give the same
    graph, and the turns after (exact echoes) continue it the same way."""
    which, make, loose = _ECHOES[name]
    response = _RESPONSES[which]
    history: list[Any] = [*_ASK]
    turns = []
    for i in range(4):
        turns.append((history, response if i == 0 else {"role": "assistant", "content": f"r{i}"}))
        echo = make(json.loads(json.dumps(response))) if i == 0 else turns[-1][1]
        history = [*history, echo, {"role": "user", "content": f"q{i}", "n": [2**53, -0.0]}]
    graphs = RolloutGraph(), RolloutGraph()
    for messages, reply in turns:
        text = json.dumps(messages, **_SPELLINGS[spelling]).encode()
        for graph, raw in zip(graphs, (True, False), strict=True):
            request: Any = RawJSON(text) if raw else json.loads(text)
            graph.add_turn(TurnNode(request_messages=request, response_message=reply))
    assert _fingerprint(graphs[0]) == _fingerprint(graphs[1])
    linked = graphs[0].parent("turn-1") == "turn-0"
    assert linked == (loose or name == "exact")
    # (the first text continues no tip: decoded whole)
    first = "loose" if loose else "exact" if name == "exact" else "decoded"
    assert taken == ["decoded", first, "exact", "exact"]


_DEEP = b'{"role": "user", "content": ' + b"[" * 600 + b"]" * 600 + b"}"


@pytest.mark.parametrize(
    "bad",
    [
        b', {"role": "assistant", "content": "x"}, {"role": "user", "content": }]',
        b', {"role": "assistant", "content": "x",}, {"role": "user"}]',
        b', {"role": "assistant", "content": "x"}, {"role": "user"},]',
        b', {"role": "assistant", "content": "x"}, {"role": "user", "content": "\xff"}]',
        b', {"role": "assistant", "content": "x"} {"role": "user"}]',
        b', {"role": "assistant", "content": "x"}, ' + _DEEP + b"]",
        b', {"role": "assistant", "content": "x"}, {"role": "user"}]]',
        b', {"role": "assistant", "content": "x"}, {"role": "user"}] x',
    ],
)
def test_a_bad_raw_continuation_is_refused_as_decoded_and_changes_nothing(
    bad: bytes, taken: list[str]
) -> None:
    """A text that continues a raw tip (after a loose echo) but is bad in its new part:
    the error json.loads or the decoded messages give, naming the field, and nothing
    changed: the tip still takes the next good text."""
    graph, decoded = RolloutGraph(), RolloutGraph()
    first = json.dumps(_ASK).encode()
    for g, request in ((graph, RawJSON(first)), (decoded, json.loads(first))):
        g.add_turn(TurnNode(request_messages=request, response_message=_WITH_NULLS))
    before = _fingerprint(graph)
    text = first[:-1] + bad
    try:
        decoded.add_turn(TurnNode(request_messages=json.loads(text)))
    except (ValueError, RecursionError) as error:
        expected = str(error)
    with pytest.raises(InvalidValueError) as refused:
        graph.add_turn(TurnNode(request_messages=RawJSON(text)))
    assert refused.value.path.startswith("request_messages")
    assert expected in str(refused.value)
    assert _fingerprint(graph) == before == _fingerprint(decoded)
    good = [*_ASK, _WITHOUT, {"role": "user", "content": "fine"}]
    text = json.dumps(good).encode()
    graph.add_turn(TurnNode(request_messages=RawJSON(text)))
    decoded.add_turn(TurnNode(request_messages=json.loads(text)))
    assert taken[-1] == "loose"
    assert _fingerprint(graph) == _fingerprint(decoded)


_values = small_json.map(lambda v: json.loads(json.dumps(v)))


@st.composite
def _loose_cases(draw: st.DrawFn) -> tuple[dict[str, Any], Any, list[Any], int]:
    """A response with null fields, what a harness sends back for it (dropping nulls at top
    level or nested, reordering keys, naming the role, writing null content as "" or not at
    all; or changing it), the new messages after it, and a spelling of the texts."""
    response: dict[str, Any] = {}
    if draw(st.booleans()):
        response["role"] = "assistant"
    response["content"] = draw(st.one_of(st.none(), st.just("said"), _values))
    if draw(st.booleans()):
        arguments = json.dumps(draw(_values))
        call = {"name": "f", "arguments": arguments, "extra": draw(st.none() | _values)}
        response["tool_calls"] = [{"id": "c", "type": "function", "function": call}]
    extras = draw(st.dictionaries(st.sampled_from(["refusal", "audio", "meta", "x"]), _values))
    response.update({k: v for k, v in extras.items() if k not in response})
    echo: Any = json.loads(json.dumps(response))
    for op in draw(st.lists(st.sampled_from(["top", "nested", "reverse", "role", "content"]))):
        if not isinstance(echo, dict):
            break
        if op == "top":
            echo = {k: v for k, v in echo.items() if v is not None}
        elif op == "nested":
            echo = _drop_nulls(echo)
        elif op == "reverse":
            echo = dict(reversed(list(echo.items())))
        elif op == "role":
            echo = {"role": "assistant", **echo}
        elif echo.get("content") is None:
            echo["content"] = draw(st.sampled_from(["", None, "other"]))
    if draw(st.integers(0, 9)) == 0:
        echo = draw(_values)  # anything at all
    fresh = draw(st.lists(supported_messages.map(lambda m: json.loads(json.dumps(m))), max_size=3))
    return response, echo, fresh, draw(st.integers(0, len(_SPELLINGS) - 1))


@settings(max_examples=60, deadline=None)
@given(case=_loose_cases())
def test_loose_echoes_raw_and_decoded(case: tuple[dict[str, Any], Any, list[Any], int]) -> None:
    response, echo, fresh, spelling = case
    first: list[Any] = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    second = [*first, echo, *fresh, {"role": "user", "content": "then"}]
    later = {"role": "assistant", "content": "later", "refusal": None}
    third = [*second, {"role": "assistant", "content": "later"}, {"role": "user", "content": "on"}]
    graphs = RolloutGraph(share_threshold=64), RolloutGraph(share_threshold=64)
    for messages, reply in ((first, response), (second, later), (third, None)):
        text = json.dumps(messages, **_SPELLINGS[spelling]).encode("utf-8", "surrogatepass")
        for graph, raw in zip(graphs, (True, False), strict=True):
            request: Any = RawJSON(text) if raw else json.loads(text)
            graph.add_turn(TurnNode(request_messages=request, response_message=reply))
    assert _fingerprint(graphs[0]) == _fingerprint(graphs[1])


def test_a_group_with_token_ids_raw_and_decoded(taken: list[str]) -> None:
    """A group sampled from one prompt with token ids, its harness dropping null fields:
    continuations whose tokens extend their parent's (taken raw after loose echoes), one
    whose tokens continue nothing (the drift audit names the turn its messages continue),
    and retries; raw texts and decoded messages give the same graph."""
    prompt = [5, 6, 7]
    turns: list[tuple[list[Any], dict[str, Any], list[int], list[int]]] = []
    for k in range(4):  # the group: one request, four samples
        response = {"role": "assistant", "content": f"a{k % 3}", "refusal": None}
        turns.append((_ASK, response, prompt, [10 + k % 3]))
    for j, k in enumerate((0, 1, 1, 3)):  # continuations (of sample 1 twice: a retry)
        messages, response, tokens, sampled = turns[k]
        echo = {key: v for key, v in response.items() if v is not None}
        ask = [*messages, echo, {"role": "user", "content": f"more {min(j, 1)}"}]
        reply = {"role": "assistant", "content": f"b{k}", "audio": None}
        turns.append((ask, reply, [*tokens, *sampled, 8], [20 + k]))
    messages, response, tokens, sampled = turns[4]
    echo = {"role": "assistant", "content": response["content"]}
    ask = [*messages, echo, {"role": "user", "content": "last"}]
    turns.append((ask, {"role": "assistant", "content": "c"}, [*tokens, *sampled, 9], [30]))
    turns.append((ask, {"role": "assistant", "content": "d"}, [1, 2], [31]))  # drifted
    graphs = RolloutGraph(), RolloutGraph()
    for messages, response, tokens, sampled in turns:
        text = json.dumps(messages).encode()
        for graph, raw in zip(graphs, (True, False), strict=True):
            request: Any = RawJSON(text) if raw else json.loads(text)
            graph.add_turn(
                TurnNode(
                    request_messages=request,
                    response_message=response,
                    prompt_ids=list(tokens),
                    sampled_ids=list(sampled),
                )
            )
    assert _fingerprint(graphs[0]) == _fingerprint(graphs[1])
    assert "loose" in taken
    assert graphs[0].parent("turn-8") == "turn-4" and graphs[0].link_kind("turn-8") == "tokens"
    assert [d["node_id"] for d in graphs[0].drift()] == ["turn-9"]

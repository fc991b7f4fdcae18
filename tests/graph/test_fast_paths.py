"""Attacks on add_turn's fast paths (a continuation of the latest turn, a raw continuation
of a raw tip, raw shared-value texts the graph holds): each must store, link and export
exactly what the usual path does, for values Python calls equal and JSON prints apart."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import assert_same_json, dumps_or_error

from rollout_store import RawJSON, RolloutGraph, TurnNode
from rollout_store.engine.requests import (
    _NOT_FAST,
    MAX_RAW_SHARED,
    MAX_RAW_SHARED_TEXT,
    RequestStore,
)
from rollout_store.graph import Graph

# ---------------------------------------------------------------- the usual path, as reference


def _usual_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fast path of add_turn switched off: what the usual path alone stores."""
    monkeypatch.setattr(RequestStore, "_prepare_raw", lambda self, turn, scratch, data: _NOT_FAST)
    monkeypatch.setattr(RequestStore, "remember_raw", lambda self, seen: None)


def _fingerprint(graph: RolloutGraph) -> list[Any]:
    """Links and exported fields of every turn, as bytes json.dumps prints."""
    out: list[Any] = []
    for node_id in graph.node_ids():
        out.append(
            (
                node_id,
                graph.parent(node_id),
                graph.link_kind(node_id),
                dumps_or_error(graph.request_messages(node_id)),
                dumps_or_error(graph.response_message(node_id)),
                dumps_or_error(graph.request_tools(node_id)),
                graph.get(node_id).n_tools,
            )
        )
    out.append(graph.stats()["message_bytes_stored"])
    return out


def _feed(turns: list[dict[str, Any]], raw: bool) -> RolloutGraph:
    graph = RolloutGraph()
    for fields in turns:
        node = dict(fields)
        if raw:
            node["request_messages"] = RawJSON(json.dumps(fields["request_messages"]).encode())
        graph.add_turn(TurnNode(prompt_ids=None, sampled_ids=None, **node))
    return graph


def _check_against_usual(turns: list[dict[str, Any]], raw: bool) -> None:
    fast = _feed(turns, raw)
    with pytest.MonkeyPatch.context() as patch:
        _usual_only(patch)
        usual = _feed(turns, raw)
    assert _fingerprint(fast) == _fingerprint(usual)
    for node_id, fields in zip(fast.node_ids(), turns, strict=True):
        sent = fields["request_messages"]
        if raw:
            sent = json.loads(json.dumps(sent))
        assert_same_json(fast.request_messages(node_id), sent)
        assert_same_json(fast.response_message(node_id), fields["response_message"])


# ---------------------------------------------------------------- conversations with near echoes

# scalars Python calls equal (and hashes alike) that json.dumps prints apart
_TWINS = [
    [1, 1.0, True],
    [0, 0.0, -0.0, False],
    [2**70, float(2**70)],
    ["\ud800", "\ud800x"],
]
_plain = st.sampled_from([1, 1.0, True, 0, 0.0, -0.0, False, float(2**70), None, float("nan"), ""])
# big ints and lone surrogates need the validating walk (the fast paths leave them be)
# (rare: one in a conversation sends every later turn of it down the usual path)
_scalar = st.builds(
    lambda k, plain, special: special if k == 17 else plain,
    st.integers(0, 40),
    _plain,
    st.sampled_from([2**70, "\ud800", "\ud800x"]),
)


def _alike(value: Any, k: int) -> Any:
    """A value Python's == may call equal to `value` but that packs apart (k picks which)."""
    for group in _TWINS:
        if any(type(value) is type(x) and value == x for x in group[:1] + group[1:]):
            others = [x for x in group if not (type(x) is type(value) and x == value)]
            if others:
                return others[k % len(others)]
    if type(value) is dict and len(value) > 1:
        items = list(value.items())
        return dict(items[1:] + items[:1])  # another key order
    if type(value) is dict:
        return {key: _alike(v, k) for key, v in value.items()}
    if type(value) is list:
        return [*value, None] if not value else [_alike(value[0], k), *value[1:]]
    return [value]


_message = st.builds(
    lambda role, text, extra: {"role": role, "content": text, "n": extra},
    st.sampled_from(["user", "tool"]),
    st.text(max_size=8),
    st.one_of(
        _scalar, st.lists(_scalar, max_size=3), st.dictionaries(st.text(max_size=2), _scalar)
    ),
)
_reply = st.builds(
    lambda text, extra: {"role": "assistant", "content": text, "n": extra},
    st.text(max_size=8),
    st.one_of(_scalar, st.lists(_scalar, max_size=2)),
)
# how each turn's request is made from the one before: 0 the exact echo, 1 an echo that
# differs in one value or key order, 2 the exact echo but a message before it altered, 3
# the previous request sent again (a twin), 4 a new conversation
_step = st.tuples(
    st.sampled_from([0, 0, 0, 1, 2, 3, 4]),
    st.integers(0, 5),
    st.lists(_message, min_size=1, max_size=3),
)


def _conversation(first: list[Any], replies: list[Any], steps: list[Any]) -> list[dict[str, Any]]:
    system = {"role": "system", "content": "be brief"}
    request = [system, *first]
    turns = [{"request_messages": request, "response_message": replies[0]}]
    for (kind, k, new), reply in zip(steps, replies[1:], strict=False):
        previous = turns[-1]
        echo = previous["response_message"]
        if kind == 1:
            echo = _alike(echo, k)
        if kind == 3:
            request = list(previous["request_messages"])
        elif kind == 4:
            request = [system, *new]
        else:
            request = [*previous["request_messages"], echo, *new]
            if kind == 2 and len(request) > 2:
                at = 1 + k % (len(previous["request_messages"]) - 1)
                request[at] = _alike(request[at], k)
        turns.append({"request_messages": json_copy(request), "response_message": reply})
    return turns


def json_copy(value: Any) -> Any:
    """A fresh copy keeping every type (a harness's own objects, not shared with the last)."""
    if type(value) is dict:
        return {k: json_copy(v) for k, v in value.items()}
    if type(value) is list:
        return [json_copy(v) for v in value]
    return value


_conversations = st.builds(
    _conversation,
    st.lists(_message, min_size=1, max_size=3),
    st.lists(_reply, min_size=2, max_size=8),
    st.lists(_step, min_size=1, max_size=7),
)


@pytest.mark.slow
@given(turns=_conversations)
def test_decoded_conversations_store_and_link_as_the_usual_path(
    turns: list[dict[str, Any]],
) -> None:
    _check_against_usual(turns, raw=False)


@given(turns=_conversations)
def test_raw_conversations_store_and_link_as_the_usual_path(
    turns: list[dict[str, Any]],
) -> None:
    # json.dumps of the request is the raw text; its decode is what is stored
    _check_against_usual(turns, raw=True)


@pytest.mark.parametrize(
    "echo",
    [
        {"role": "assistant", "content": "r", "n": 1.0},
        {"role": "assistant", "content": "r", "n": True},
        {"content": "r", "role": "assistant", "n": 1},
    ],
)
def test_an_echo_that_differs_in_one_type_or_key_order_is_kept_as_sent(
    echo: dict[str, Any],
) -> None:
    system = {"role": "system", "content": "s"}
    first = [system, {"role": "user", "content": "q"}]
    reply = {"role": "assistant", "content": "r", "n": 1}
    turns = [
        {"request_messages": first, "response_message": reply},
        {
            "request_messages": [*first, echo, {"role": "user", "content": "q2"}],
            "response_message": reply,
        },
    ]
    for raw in (False, True):
        _check_against_usual(turns, raw)
        graph = _feed(turns, raw)
        assert json.dumps(graph.request_messages("turn-1")[2]) == json.dumps(echo)


def test_a_prefix_altered_in_the_middle_is_not_the_same_content() -> None:
    system = {"role": "system", "content": "s"}
    history = [system] + [{"role": "user", "content": f"q{i}", "n": 1} for i in range(6)]
    reply = {"role": "assistant", "content": "r"}
    altered = [dict(m) for m in history]
    altered[3]["n"] = 1.0
    turns = [
        {"request_messages": history, "response_message": reply},
        {
            "request_messages": [*altered, reply, {"role": "user", "content": "new"}],
            "response_message": reply,
        },
    ]
    for raw in (False, True):
        _check_against_usual(turns, raw)
        graph = _feed(turns, raw)
        assert graph.parent("turn-1") is None
        assert json.dumps(graph.request_messages("turn-1")) == json.dumps(
            turns[1]["request_messages"]
        )


# ---------------------------------------------------------------- raw shared-value texts

_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
_PARAMS = {"temperature": 0.5}


def _tools_turn(i: int, tools: Any, params: Any) -> TurnNode:
    return TurnNode(
        request_messages=[{"role": "user", "content": f"q{i}"}],
        response_message={"role": "assistant", "content": "r"},
        request_tools=tools,
        sampling_params=params,
        n_tools=None,  # counted from the tools
    )


@pytest.mark.parametrize("oldest", ["request_tools", "sampling_params"])
def test_a_known_raw_text_pushed_out_by_another_field_of_its_turn_still_stands(
    oldest: str,
) -> None:
    """The cache is full and the oldest text is one this turn gives; another field's text
    is new but its value stored: remembering it must not drop the text the turn stands on
    (it raised KeyError, in the shared values or in n_tools)."""
    graph = RolloutGraph()
    graph.add_turn(_tools_turn(-1, _TOOLS, _PARAMS))
    value = _TOOLS if oldest == "request_tools" else _PARAMS
    spellings = [json.dumps(value, indent=k) for k in range(MAX_RAW_SHARED)]
    for i, text in enumerate(spellings):  # each decoded, its value found: remembered
        if oldest == "request_tools":
            graph.add_turn(_tools_turn(i, RawJSON(text), _PARAMS))
        else:
            graph.add_turn(_tools_turn(i, _TOOLS, RawJSON(text)))
    assert spellings[0] in graph._requests.raw_shared
    tools = RawJSON(spellings[0] if oldest == "request_tools" else json.dumps(_TOOLS, indent=1))
    params = RawJSON(json.dumps(_PARAMS, indent=1) if oldest == "request_tools" else spellings[0])
    view = graph.add_turn(_tools_turn(99, tools, params))
    assert json.dumps(view.request_tools) == json.dumps(_TOOLS)
    assert json.dumps(view.sampling_params) == json.dumps(_PARAMS)
    assert view.n_tools == 1
    assert len(graph._requests.raw_shared) == MAX_RAW_SHARED


def test_a_failing_add_turn_remembers_no_raw_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn refused after its shared values were found leaves the graph's texts as they
    were (they are remembered at commit)."""
    graph = RolloutGraph()
    graph.add_turn(_tools_turn(0, _TOOLS, _PARAMS))
    before = dict(graph._requests.raw_shared)

    def failing(*args: Any) -> None:
        raise RuntimeError("after the shared values")

    with monkeypatch.context() as patch:
        patch.setattr(type(graph), "_link", failing)
        with pytest.raises(RuntimeError):
            graph.add_turn(_tools_turn(1, RawJSON(json.dumps(_TOOLS)), _PARAMS))
    assert graph._requests.raw_shared == before
    assert len(graph) == 1


def test_raw_texts_past_the_limit_export_as_given() -> None:
    """More distinct texts than the cache holds, each sent twice, interleaved: every turn
    exports its own text's value, with its own n_tools."""
    graph = RolloutGraph()
    values = [[{"name": f"t{i}", "x": x}] * (1 + i % 3) for i, x in enumerate([1, 1.0, True] * 8)]
    sent = []
    for round_ in range(3):
        for value in values:
            text = json.dumps(value, indent=round_ % 2 or None)
            sent.append(text)
            graph.add_turn(_tools_turn(len(sent), RawJSON(text.encode()), _PARAMS))
    assert len(graph._requests.raw_shared) <= MAX_RAW_SHARED
    for node_id, text in zip(graph.node_ids(), sent, strict=True):
        assert json.dumps(graph.request_tools(node_id)) == json.dumps(json.loads(text))
        assert graph.get(node_id).n_tools == len(json.loads(text))


def test_raw_texts_belong_to_their_graph() -> None:
    """No text one graph remembered stands for a value in another: each graph decodes its
    own first text, and its texts are freed with it (no process-global cache)."""
    import gc
    import tracemalloc

    first, second = RolloutGraph(), RolloutGraph()
    text = json.dumps(_TOOLS).encode()
    for i in range(2):
        first.add_turn(_tools_turn(i, RawJSON(text), _PARAMS))
    assert text in first._requests.raw_shared
    assert text not in second._requests.raw_shared
    second.add_turn(_tools_turn(0, RawJSON(b'[{"other": 1}]'), _PARAMS))
    assert json.dumps(second.request_tools("turn-0")) == '[{"other": 1}]'
    del first
    gc.collect()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        # the in-memory graph itself: the suite keeps every RolloutGraph for its round trip
        graph = Graph()
        texts = [  # as many texts as are remembered, each as long as is remembered
            json.dumps([{"name": f"f{i}", "description": "d" * 100}] * 120).encode()
            for i in range(MAX_RAW_SHARED)
        ]
        assert all(12 * 1024 < len(text) <= MAX_RAW_SHARED_TEXT for text in texts)
        for i, text in enumerate(texts * 2):
            graph.add_turn(_tools_turn(i, RawJSON(text), _PARAMS))
        assert all(text in graph._requests.raw_shared for text in texts)
        kept = sum(map(len, texts))
        del graph
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - baseline - kept
    finally:
        tracemalloc.stop()
    assert held < 64 * 1024, held


def test_a_long_raw_text_is_not_kept_beside_what_it_stands_for() -> None:
    """A raw text longer than MAX_RAW_SHARED_TEXT is decoded each time it comes and never
    remembered: the graph keeps its value's long strings once, not a second copy in text."""
    graph = RolloutGraph()
    big = [{"name": "f", "description": "d" * 100} for _ in range(1_000)]  # ~120 KB
    big_text = json.dumps(big).encode()
    assert len(big_text) > MAX_RAW_SHARED_TEXT
    for i in range(3):
        view = graph.add_turn(_tools_turn(i, RawJSON(big_text), _PARAMS))
        assert json.dumps(view.request_tools) == json.dumps(big)
        assert view.n_tools == len(big)
    assert big_text not in graph._requests.raw_shared


def test_a_raw_text_used_again_is_kept_longest() -> None:
    """The texts are dropped least recently used first: a text that every turn sends stays
    remembered while MAX_RAW_SHARED others come and go."""
    graph = RolloutGraph()
    hot = json.dumps(_PARAMS, indent=2)
    others = [json.dumps(_TOOLS, indent=k) for k in range(2 * MAX_RAW_SHARED)]
    graph.add_turn(_tools_turn(-1, _TOOLS, _PARAMS))
    for i, text in enumerate(others):
        graph.add_turn(_tools_turn(i, RawJSON(text), RawJSON(hot)))
        assert hot in graph._requests.raw_shared
    assert len(graph._requests.raw_shared) == MAX_RAW_SHARED
    assert others[0] not in graph._requests.raw_shared
    for node_id in graph.node_ids():
        assert json.dumps(graph.get(node_id).sampling_params) == json.dumps(_PARAMS)


# ---------------------------------------------------------------- colliding blob digests


def _colliding(_: bytes) -> bytes:
    return b"\0" * 16  # every string's digest alike: only a content comparison tells


@pytest.mark.parametrize("raw", [False, True])
def test_colliding_blob_digests_through_the_fast_paths(raw: bool) -> None:
    """Long strings (past HOLE_MIN, so raw tips hold them as holes) of equal length and one
    digest, re-sent turn after turn and swapped: each turn exports what it was given, and
    links as with every fast path off."""
    from rollout_store import BlobTable

    size = 1 << 15  # past HOLE_MIN
    longs = [chr(0x61 + i) * size for i in range(4)]
    system = {"role": "system", "content": "s"}
    request: list[Any] = [system, {"role": "user", "content": longs[0]}]
    turns = []
    for k in range(6):
        reply = {"role": "assistant", "content": f"r{k}"}
        turns.append({"request_messages": json_copy(request), "response_message": reply})
        request = [*request, reply, {"role": "user", "content": longs[(k + 1) % 4]}]
    # a re-sent prefix whose long string is another one of one digest and length
    swapped = json_copy(turns[-1]["request_messages"])
    swapped[1]["content"] = longs[3]
    turns.append(
        {
            "request_messages": [*swapped, turns[-1]["response_message"], {"role": "user"}],
            "response_message": {"role": "assistant", "content": "last"},
        }
    )

    def feed() -> RolloutGraph:
        graph = RolloutGraph(share_threshold=64)
        graph.blobs = BlobTable(hasher=_colliding)
        for fields in turns:
            node = dict(fields)
            if raw:
                text = json.dumps(fields["request_messages"]).encode()
                node["request_messages"] = RawJSON(text)
            graph.add_turn(TurnNode(prompt_ids=None, sampled_ids=None, **node))
        return graph

    fast = feed()
    with pytest.MonkeyPatch.context() as patch:
        _usual_only(patch)
        usual = feed()
    assert _fingerprint(fast) == _fingerprint(usual)
    for node_id, fields in zip(fast.node_ids(), turns, strict=True):
        assert json.dumps(fast.request_messages(node_id)) == json.dumps(fields["request_messages"])
    assert fast.parent("turn-6") is None  # its prefix differs: not the same content


def test_a_request_changed_after_add_turn_changes_nothing_recorded() -> None:
    """The caller's lists and dicts are theirs: changing them after add_turn (a harness
    appends to its history in place) alters no recorded turn, on the continuation path
    too, and the next request is compared with what was recorded, not with the objects."""
    system = {"role": "system", "content": "s"}
    history: list[Any] = [system, {"role": "user", "content": "q0", "n": 1}]
    tools: list[Any] = [{"name": "f"}]
    sent = []
    graph = RolloutGraph()
    for k in range(5):
        reply = {"role": "assistant", "content": f"r{k}", "n": 1}
        graph.add_turn(
            TurnNode(
                request_messages=history,
                response_message=reply,
                request_tools=tools,
                prompt_ids=None,
                sampled_ids=None,
            )
        )
        sent.append(json.dumps(history))
        history.append(reply)  # the same objects, extended in place
        history.append({"role": "user", "content": f"q{k + 1}", "n": 1})
        if k % 2:
            reply["n"] = 1.0  # ... and the echo changed after it was recorded
        tools.append({"name": f"g{k}"})
    for k, text in enumerate(sent):
        assert json.dumps(graph.request_messages(f"turn-{k}")) == text
        assert json.dumps(graph.request_tools(f"turn-{k}")) == json.dumps(
            [{"name": "f"}] + [{"name": f"g{j}"} for j in range(k)]
        )
    for k in range(5):  # the responses as recorded, not as changed since
        want = {"role": "assistant", "content": f"r{k}", "n": 1}
        assert json.dumps(graph.response_message(f"turn-{k}")) == json.dumps(want)
    # an exact echo links its turn to the one before; a changed one (1.0) does not exactly
    assert graph.parent("turn-1") == "turn-0"
    assert graph.parent("turn-3") == "turn-2"


_BAD = [{"k": b"bytes"}, {"k": {1, 2}}, {"k": object()}, {"k": bytearray(b"a")}, {"k": 1 + 2j}]


@pytest.mark.parametrize("raw_tools", [False, True])
@pytest.mark.parametrize("bad", _BAD, ids=[type(b["k"]).__name__ for b in _BAD])
def test_a_bad_continuation_changes_no_graph_and_no_file(
    tmp_path: Any, bad: dict[str, Any], raw_tools: bool
) -> None:
    """A request that continues the latest turn exactly but ends in a value JSON has no
    form for is refused naming it, on the continuation path, and leaves the graph, its
    remembered texts and its file as they were; the next good turn goes on as before."""
    from rollout_store import InvalidValueError

    path = tmp_path / "g.rls"
    system, reply = {"role": "system", "content": "s"}, {"role": "assistant", "content": "r"}
    first = [system, {"role": "user", "content": "q"}]
    tools_text = json.dumps(_TOOLS)

    def turn(messages: list[Any]) -> TurnNode:
        tools = RawJSON(tools_text) if raw_tools else _TOOLS
        return TurnNode(request_messages=messages, response_message=reply, request_tools=tools)

    with RolloutGraph.open(path) as graph:
        graph.add_turn(turn(first))
        graph.add_turn(turn([*first, reply, {"role": "user", "content": "q1"}]))
        continued = [*first, reply, {"role": "user", "content": "q1"}, reply]
        size, ids = path.stat().st_size, graph.node_ids()
        stats, known = graph.stats(), dict(graph._requests.raw_shared)
        with pytest.raises(InvalidValueError) as err:
            graph.add_turn(turn([*continued, bad]))
        assert err.value.path.startswith("request_messages[5]")
        assert path.stat().st_size == size
        assert graph.node_ids() == ids and graph.stats() == stats
        assert graph._requests.raw_shared == known
        good = graph.add_turn(turn([*continued, {"role": "user", "content": "q2"}]))
        assert good.parent_id == ids[-1]
    with RolloutGraph.open(path) as graph:
        assert len(graph) == 3
        assert json.dumps(graph.request_messages(good.node_id)) == json.dumps(
            [*continued, {"role": "user", "content": "q2"}]
        )


# new messages as a client may spell them: duplicate keys (the last wins), NaN and
# Infinity literals, ints past 64 bits, lone-surrogate escapes, -0.0, 1E400, odd spacing
_ODD_TEXTS = [
    '{"role": "user", "content": "a", "content": "b"}',
    '{"role":"user","n":NaN,"m":-Infinity}',
    '{"role": "user", "n": 123456789012345678901234567890}',
    '{"role": "user", "content": "\\ud800 and \\udfff"}',
    '{"role": "user", "n": -0.0, "m": 1E400, "k": 1.0, "t": true}',
    '  {"role" : "user" ,\n "content" : [ ] , "x": {}}  ',
]


@pytest.mark.parametrize("odd", _ODD_TEXTS)
def test_raw_continuations_of_odd_texts_decode_as_json_loads(odd: str) -> None:
    """A raw conversation whose new messages are spelled oddly: each turn stores what
    json.loads of its text gives (byte-identical under json.dumps) and links as with every
    fast path off; a turn that then echoes one of them re-sends it as recorded."""
    reply_text = '{"role": "assistant", "content": "r", "n": 1}'
    pieces = ['{"role": "system", "content": "s"}', '{"role": "user", "content": "q"}']
    texts = []
    for k in range(4):
        texts.append("[" + ", ".join(pieces) + "]")
        pieces = [*pieces, reply_text, odd if k % 2 == 0 else '{"role": "user", "n": 2}']

    def feed() -> RolloutGraph:
        graph = RolloutGraph()
        for text in texts:
            graph.add_turn(
                TurnNode(
                    request_messages=RawJSON(text.encode()),
                    response_message=json.loads(reply_text),
                    prompt_ids=None,
                    sampled_ids=None,
                )
            )
        return graph

    fast = feed()
    with pytest.MonkeyPatch.context() as patch:
        _usual_only(patch)
        usual = feed()
    assert _fingerprint(fast) == _fingerprint(usual)
    for node_id, text in zip(fast.node_ids(), texts, strict=True):
        assert_same_json(fast.request_messages(node_id), json.loads(text))
    assert fast.parent("turn-3") == "turn-2"

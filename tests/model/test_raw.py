"""RawJSON decodes exactly as json.loads does: same values, same bytes under json.dumps, same
refusals, whatever the spelling of the text."""

from __future__ import annotations

import contextlib
import json
import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import FUZZ, assert_same, assert_same_json, json_like

from rollout_store import InvalidValueError, RawJSON
from rollout_store.model.raw import decode_raw, resolve_raw, split_array

# JSON documents as json.loads produces them: lists, str keys (json.dumps turns other keys
# into strings, so the decoded value has str keys)
json_values = json_like.map(lambda v: json.loads(json.dumps(v)) if _dumpable(v) else None)


def _dumpable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _loads_or_error(data: bytes | str) -> tuple[str, Any]:
    try:
        return ("ok", json.loads(data))
    except (ValueError, RecursionError) as exc:
        return ("error", str(exc))


def _raw_or_error(data: bytes | str) -> tuple[str, Any]:
    try:
        return ("ok", decode_raw(RawJSON(data), "field"))
    except InvalidValueError as exc:
        assert exc.path == "field"
        return ("error", exc.reason)


def _same_outcome(data: bytes | str) -> None:
    want = _loads_or_error(data)
    got = _raw_or_error(data)
    assert got[0] == want[0], (data, got, want)
    if want[0] == "ok":
        assert_same(got[1], want[1])
        assert_same_json(got[1], want[1])
    else:  # json.loads's own message, named at the field
        assert want[1] in got[1]


# ---------------------------------------------------------------- odd spellings


def _spell(value: Any, rng: random.Random) -> str:
    """JSON text of `value` with random whitespace, escapes and number spellings."""
    ws = lambda: rng.choice(["", "", " ", "\n", "\t ", "\r\n  "])  # noqa: E731
    if value is None or value is True or value is False:
        return json.dumps(value)
    if isinstance(value, int):
        if value == 0 and rng.random() < 0.3:
            return "-0"
        return str(value)
    if isinstance(value, float):
        text = json.dumps(value)  # repr: shortest round-trip, or NaN / Infinity
        if text[-1].isdigit() and rng.random() < 0.5 and value != 0:
            mantissa, exponent = f"{value:.17e}".split("e")
            sign = "-" if int(exponent) < 0 else rng.choice(["", "+"])
            text = f"{mantissa}{rng.choice('eE')}{sign}{abs(int(exponent))}"
        return text
    if isinstance(value, str):
        out = ['"']
        for ch in value:
            r = rng.random()
            if ch in '"\\' or ord(ch) < 0x20 or 0xD800 <= ord(ch) <= 0xDFFF or r < 0.15:
                if ord(ch) > 0xFFFF:
                    code = ord(ch) - 0x10000
                    hi, lo = 0xD800 + (code >> 10), 0xDC00 + (code & 0x3FF)
                    out.append(f"\\u{hi:04x}\\u{lo:04X}")
                elif ch in '\n\t"\\/' and r < 0.5:
                    out.append({"\n": "\\n", "\t": "\\t", '"': '\\"', "\\": "\\\\", "/": "\\/"}[ch])
                else:
                    out.append(f"\\u{ord(ch):04{rng.choice('xX')}}")
            else:
                out.append(ch)
        out.append('"')
        return "".join(out)
    if isinstance(value, list):
        inner = ("," + ws()).join(ws() + _spell(v, rng) + ws() for v in value)
        return "[" + (inner or ws()) + "]"
    items = [
        ws() + _spell(k, rng) + ws() + ":" + ws() + _spell(v, rng) + ws() for k, v in value.items()
    ]
    if items and rng.random() < 0.2:  # a duplicate key before the real one: last wins
        key = rng.choice(list(value))
        items.insert(0, _spell(key, rng) + ":" + _spell([1, "dup"], rng))
    return "{" + (",".join(items) or ws()) + "}"


@given(json_values)
def test_dumps_text_round_trips(value: Any) -> None:
    for text in (json.dumps(value), json.dumps(value, ensure_ascii=False)):
        _same_outcome(text)
        _same_outcome(text.encode("utf-8", "surrogatepass"))


@given(json_values, st.integers(0, 2**32))
def test_odd_spellings_round_trip(value: Any, seed: int) -> None:
    text = _spell(value, random.Random(seed))
    _same_outcome(text)
    _same_outcome(text.encode("utf-8", "surrogatepass"))


@pytest.mark.slow
@FUZZ
@given(json_values, st.integers(0, 2**32))
def test_odd_spellings_round_trip_fuzz(value: Any, seed: int) -> None:
    text = _spell(value, random.Random(seed))
    _same_outcome(text)
    _same_outcome(text.encode("utf-16"))


@pytest.mark.parametrize(
    "text",
    [
        "NaN",
        "[NaN, Infinity, -Infinity]",
        "1e400",
        "-1e400",
        "[1E400, 1e-400]",
        '"\\ud800"',
        '{"a": "\\udfff x"}',
        "123456789012345678901234567890",
        "-18446744073709551617",
        '{"a": 1, "b": 2, "a": 3}',
        '{"a": 1, "a": {"x": 1}}',
        "-0",
        "-0.0",
        "[1.0, 1, true, 0.0, -0.0]",
        "\ufeff[1]",
        '"\\u00e9\\u20AC\\ud83d\\ude00"',
        "  [ ]  ",
        "{}",
        "[1,]",
        "[01]",
        "1.",
        "",
        "[1] x",
        '"\x01"',
        "[" * 5000 + "]" * 5000,
    ],
)
def test_where_msgspec_and_json_differ(text: str) -> None:
    _same_outcome(text)
    _same_outcome(text.encode("utf-8", "surrogatepass"))


@pytest.mark.parametrize(
    "data",
    [
        b"\xef\xbb\xbf[1, 2]",  # UTF-8 BOM: json.loads accepts it in bytes
        '[1, "\u00e9"]'.encode("utf-16"),
        '[1, "\u00e9"]'.encode("utf-32-le"),
        b'"\xed\xa0\x80"',  # a UTF-8 encoded surrogate: json.loads decodes with surrogatepass
        b'"\xff"',
        b"[1, 2",
    ],
)
def test_bytes_encodings(data: bytes) -> None:
    _same_outcome(data)


@given(st.text(alphabet=st.sampled_from(list('[]{}",:0123456789.eE+-nulltrsaINfiy \\u\n'))))
def test_arbitrary_text_same_verdict(text: str) -> None:
    _same_outcome(text)


@given(st.binary(max_size=40))
def test_arbitrary_bytes_same_verdict(data: bytes) -> None:
    _same_outcome(data)


# ---------------------------------------------------------------- the helpers


def test_rawjson_type() -> None:
    raw = RawJSON(bytearray(b"[1]"))
    assert raw.data == b"[1]" and raw == RawJSON(b"[1]") and raw != RawJSON("[1]")
    assert raw.decode() == [1]
    assert "RawJSON" in repr(RawJSON("x" * 100))
    with pytest.raises(TypeError):
        RawJSON(5)  # type: ignore[arg-type]


def test_split_array_keeps_spans() -> None:
    spans = split_array(b'[ {"a": 1} ,2, "x" ]')
    assert spans is not None
    assert [bytes(s) for s in spans] == [b'{"a": 1}', b"2", b'"x"']
    assert split_array(b'{"a": 1}') is None
    assert split_array(b"[NaN]") is None  # left to json.loads


def test_resolve_raw_items_and_whole() -> None:
    items = [{"role": "user"}, RawJSON('{"role": "assistant", "content": 1.0}')]
    assert_same(resolve_raw(items, "m"), [{"role": "user"}, {"role": "assistant", "content": 1.0}])
    assert_same(resolve_raw((RawJSON("1"),), "m"), (1,))
    plain = [1, 2]
    assert resolve_raw(plain, "m") is plain
    with pytest.raises(InvalidValueError) as info:
        resolve_raw([1, RawJSON("[1,")], "request_messages")
    assert info.value.path == "request_messages[1]"
    assert "Expecting value" in str(info.value)
    assert isinstance(info.value.__cause__, json.JSONDecodeError)


# ---------------------------------------------------------------- in the graph


def _chat(n: int) -> list[list[dict[str, Any]]]:
    """Request message lists of an n-turn chat (each re-sends the last plus two messages)."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    out = []
    for i in range(n):
        history = [*history, {"role": "user", "content": f"question {i}", "n": [1, 1.0, -0.0]}]
        out.append(history)
        history = [*history, {"role": "assistant", "content": f"answer {i}"}]
    return out


def _response(i: int) -> dict[str, Any]:
    return {"role": "assistant", "content": f"answer {i}"}


@pytest.mark.parametrize("raw_turns", [{0, 1, 2, 3}, {1, 3}, {0, 2}, {2}])
def test_raw_and_decoded_turns_link_to_each_other(raw_turns: set[int]) -> None:
    from rollout_store import RolloutGraph, TurnNode

    graph, plain = RolloutGraph(), RolloutGraph()
    for i, messages in enumerate(_chat(4)):
        text = json.dumps(messages)
        given: Any = RawJSON(text.encode()) if i in raw_turns else json.loads(text)
        graph.add_turn(TurnNode(request_messages=given, response_message=_response(i)))
        plain.add_turn(TurnNode(request_messages=json.loads(text), response_message=_response(i)))
    assert graph.path_ids("turn-3") == ["turn-0", "turn-1", "turn-2", "turn-3"]
    assert graph.stats()["message_bytes_stored"] == plain.stats()["message_bytes_stored"]
    for node_id in graph.node_ids():
        assert_same(graph.request_messages(node_id), plain.request_messages(node_id))


def test_raw_items_in_lists_and_every_json_field() -> None:
    from rollout_store import RolloutGraph, TurnNode

    graph = RolloutGraph()
    messages = _chat(2)[1]
    node = TurnNode(
        request_messages=[messages[0], *(RawJSON(json.dumps(m)) for m in messages[1:])],
        request_tools=[RawJSON('{"type": "function", "big": 123456789012345678901234567890}')],
        sampling_params=RawJSON('{"temperature": 1.0, "x": NaN}'),
        response_message=RawJSON(b'{"role": "assistant", "content": "\\ud800"}'),
        prompt_ids=RawJSON("[1, 2, 3]"),  # type: ignore[arg-type]
        sampled_ids=RawJSON(b"[4]"),  # type: ignore[arg-type]
        sampled_logprobs=RawJSON("[-0.5]"),  # type: ignore[arg-type]
        n_tools=None,
    )
    view = graph.add_turn(node)
    got = graph.get(view.node_id)
    assert_same_json(got.request_messages, messages)
    assert_same_json(got.request_tools, [json.loads(node.request_tools[0].data)])  # type: ignore[index]
    assert json.dumps(got.sampling_params) == '{"temperature": 1.0, "x": NaN}'
    assert json.dumps(got.response_message) == '{"role": "assistant", "content": "\\ud800"}'
    assert (got.prompt_ids, got.sampled_ids, got.sampled_logprobs) == ([1, 2, 3], [4], [-0.5])
    assert graph.summary(view.node_id)["n_tools"] == 1


@pytest.mark.parametrize(
    ("field", "value", "path"),
    [
        ("request_messages", RawJSON("[{"), "request_messages"),
        ("request_messages", [{"role": "user"}, RawJSON("{,}")], "request_messages[1]"),
        ("response_message", RawJSON(b"\xff"), "response_message"),
        ("request_tools", [RawJSON("[1,]")], "request_tools[0]"),
        ("sampling_params", RawJSON(""), "sampling_params"),
    ],
)
def test_bad_raw_text_is_refused_naming_the_field(field: str, value: Any, path: str) -> None:
    from rollout_store import RolloutGraph, TurnNode

    graph = RolloutGraph()
    graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "x"}]))
    before = graph.stats()
    with pytest.raises(InvalidValueError) as info:
        graph.add_turn(TurnNode(**{field: value}))
    assert info.value.path == path
    assert graph.stats() == before and len(graph) == 1


@given(st.lists(json_values, max_size=5), st.integers(0, 2**32))
def test_raw_messages_round_trip_in_the_graph(values: list[Any], seed: int) -> None:
    from rollout_store import RolloutGraph, TurnNode

    messages = [{"role": "user", "content": v} for v in values]
    text = "[" + ",".join(_spell(m, random.Random(seed + i)) for i, m in enumerate(messages)) + "]"
    graph = RolloutGraph()
    view = graph.add_turn(TurnNode(request_messages=RawJSON(text)))
    assert_same_json(graph.request_messages(view.node_id), json.loads(text))


@pytest.mark.parametrize(
    "odd",
    [
        '{"role": "user", "content": NaN}',
        '{"role": "user", "content": "\\ud800 lone"}',
        '{"role": "user", "content": 123456789012345678901234567890}',
        '{"role": "user", "content": [1e400, -0.0, 1.0, 1]}',
        '{"role": "user", "content": {"a": 1, "a": 2}}',
        '{"role": "user", "content": "' + "long " * 400 + '"}',
    ],
)
def test_raw_continuations_with_odd_values(odd: str) -> None:
    """A raw conversation whose later messages json.loads and msgspec read differently, or
    that hold blobs and big ints: the same messages and links as decoded input."""
    from rollout_store import RolloutGraph, TurnNode

    raw, decoded = RolloutGraph(), RolloutGraph()
    texts = ['{"role": "system", "content": "s"}', '{"role": "user", "content": "q0"}']
    for i in range(5):
        text = "[" + ", ".join(texts) + "]"
        response = {"role": "assistant", "content": f"a{i}"}
        raw.add_turn(TurnNode(request_messages=RawJSON(text.encode()), response_message=response))
        decoded.add_turn(TurnNode(request_messages=json.loads(text), response_message=response))
        texts += [json.dumps(response), odd if i % 2 else f'{{"role": "user", "content": "q{i}"}}']
    assert raw.path_ids("turn-4") == decoded.path_ids("turn-4")
    assert raw.path_ids("turn-4") == [f"turn-{i}" for i in range(5)]
    for node_id in raw.node_ids():
        assert_same_json(raw.request_messages(node_id), decoded.request_messages(node_id))
    assert raw.stats()["message_bytes_stored"] == decoded.stats()["message_bytes_stored"]


def test_raw_conversation_keeps_one_tip_and_confirms_by_digest() -> None:
    from rollout_store import RolloutGraph, TurnNode

    graph = RolloutGraph()
    history = [{"role": "system", "content": "s"}]
    for i in range(6):
        history = [*history, {"role": "user", "content": f"q{i}"}]
        response = {"role": "assistant", "content": f"a{i}"}
        graph.add_turn(
            TurnNode(
                request_messages=RawJSON(json.dumps(history).encode()), response_message=response
            )
        )
        history = [*history, response]
    tips = graph._requests.raw_tips._order
    assert [tip.turn.node_id for tip in tips.values()] == ["turn-5"]
    assert all(graph._requests.table.digest(t.index) is not None for t in graph._turns)
    # a decoded continuation finds the raw tip by its plain digest
    history = [*history, {"role": "user", "content": "decoded"}]
    view = graph.add_turn(TurnNode(request_messages=history, response_message={"role": "x"}))
    assert graph.parent(view.node_id) == "turn-5"


@pytest.mark.parametrize("long", [False, True])
def test_loosely_echoed_raw_conversation_is_taken_raw(
    long: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A harness that drops the response's null fields re-sends a loose echo: the raw path
    takes it without decoding the re-sent text (kept as sent, not as an echo), with the
    links, messages and stored bytes the decoded path gives, and one tip a conversation
    (its system packing shared by its tips). A retry of a turn (a twin) is decoded whole
    and linked as decoded input is."""
    from rollout_store import RolloutGraph, TurnNode
    from rollout_store.engine import requests

    decoded_whole: list[int] = []
    real = requests.decode_raw

    def counting(raw: RawJSON, path: str) -> Any:
        decoded_whole.append(len(raw.data))
        return real(raw, path)

    monkeypatch.setattr(requests, "decode_raw", counting)
    raw, decoded = RolloutGraph(), RolloutGraph()
    blob = "screenshot " * (3000 if long else 1)
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "s" * 500},
        {"role": "user", "content": [{"type": "text", "text": blob}]},
    ]

    def add(messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        text = json.dumps(messages).encode()
        raw.add_turn(TurnNode(request_messages=RawJSON(text), response_message=response))
        decoded.add_turn(TurnNode(request_messages=json.loads(text), response_message=response))

    for i in range(6):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        response = {"role": "assistant", "content": None, "refusal": None, "tool_calls": [call]}
        add(history, response)
        if i == 3:  # a retry of the same call: decoded whole, linked as decoded input is
            add(history, {**response, "content": "again"})
        history = [*history, {"role": "assistant", "tool_calls": [call]}]
        history = [*history, {"role": "tool", "tool_call_id": f"c{i}", "content": f"ok {i}"}]
    assert len(decoded_whole) == 3  # the first turn, the retry and the turn after it
    assert raw.node_ids() == decoded.node_ids()
    for node_id in raw.node_ids():
        assert raw.parent(node_id) == decoded.parent(node_id)
        assert_same_json(raw.request_messages(node_id), decoded.request_messages(node_id))
    assert raw.path_ids("turn-6") == ["turn-0", "turn-1", "turn-2", "turn-3", "turn-5", "turn-6"]
    assert raw.stats()["message_bytes_stored"] == decoded.stats()["message_bytes_stored"]
    # one tip a branch: the retry's, and the conversation's latest turn's
    tips = list(raw._requests.raw_tips._order.values())
    assert [tip.turn.node_id for tip in tips] == ["turn-4", "turn-6"]
    # a turn replaces the tip it continues, and shares its system packing
    add(history, {"role": "assistant", "content": "done", "refusal": None})
    now = list(raw._requests.raw_tips._order.values())
    assert [tip.turn.node_id for tip in now] == ["turn-4", "turn-7"]
    assert now[1].system_plain is tips[1].system_plain
    assert len(decoded_whole) == 3


def test_tampered_raw_prefix_is_not_confirmed() -> None:
    """Same length, same first and last bytes, one byte changed in the middle: the digest
    refuses the tip and the text is decoded whole (its own content is kept)."""
    from rollout_store import RolloutGraph, TurnNode

    graph = RolloutGraph()
    first = [{"role": "user", "content": "x" * 300 + "A" + "y" * 300}]
    graph.add_turn(
        TurnNode(
            request_messages=RawJSON(json.dumps(first).encode()),
            response_message={"role": "assistant", "content": "r"},
        )
    )
    second = [
        {"role": "user", "content": "x" * 300 + "B" + "y" * 300},
        {"role": "assistant", "content": "r"},
        {"role": "user", "content": "next"},
    ]
    view = graph.add_turn(TurnNode(request_messages=RawJSON(json.dumps(second).encode())))
    assert graph.parent(view.node_id) is None
    assert_same_json(graph.request_messages(view.node_id), second)


def test_short_plain_packings_still_refuse_non_json() -> None:
    """The walk is skipped only for packings that cannot hold bytes or ExtType objects."""
    import msgpack

    from rollout_store import RolloutGraph, TurnNode

    for bad in (b"bytes", msgpack.ExtType(2, b"12"), {b"k": 1}, bytearray(b"x")):
        graph = RolloutGraph()
        with pytest.raises(InvalidValueError):
            graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": bad}]))
        with pytest.raises(InvalidValueError):
            graph.add_turn(TurnNode(response_message={"role": "assistant", "content": bad}))
        assert len(graph) == 0


def test_digest_match_of_special_values_is_validated() -> None:
    """A stored big int and a caller's ExtType packing alike: the digest matches, the
    validating walk refuses the imitation."""
    import msgpack

    from rollout_store import RolloutGraph, TurnNode

    graph = RolloutGraph()
    big = 2**70
    graph.add_turn(
        TurnNode(
            request_messages=[{"role": "user", "content": big}],
            response_message={"role": "assistant", "content": "r"},
        )
    )
    fake = msgpack.ExtType(2, str(big).encode())
    with pytest.raises(InvalidValueError):
        graph.add_turn(
            TurnNode(
                request_messages=[
                    {"role": "user", "content": fake},
                    {"role": "assistant", "content": "r"},
                    {"role": "user", "content": "more"},
                ]
            )
        )
    assert len(graph) == 1


@pytest.mark.parametrize("k", [2, 3, 4])
def test_raw_continuation_past_a_stored_request_takes_the_longer_base(k: int) -> None:
    """A raw text continues a raw tip, and a decoded turn stored since then ends at message
    k, inside the new messages: that one is the base and the parent, as for decoded input."""
    from rollout_store import RolloutGraph, TurnNode

    history: list[Any] = [{"role": "system", "content": "s"}]
    history += [{"role": "user" if i % 2 else "assistant", "content": f"m{i}"} for i in range(7)]
    turns = [
        (history[:2], history[2], True),  # the raw tip: one non-system message
        (history[: k + 1], history[k + 1], False),  # a decoded turn of k messages
        (history[:6], {"role": "assistant", "content": "r"}, True),  # five messages
    ]
    graph, plain = RolloutGraph(), RolloutGraph()
    for messages, response, raw in turns:
        text = json.dumps(messages)
        given: Any = RawJSON(text.encode()) if raw else json.loads(text)
        graph.add_turn(TurnNode(request_messages=given, response_message=response))
        plain.add_turn(TurnNode(request_messages=json.loads(text), response_message=response))
    assert graph.parent("turn-2") == plain.parent("turn-2") == "turn-1"
    assert graph._turns[2].base is graph._turns[1]
    assert graph.stats()["message_bytes_stored"] == plain.stats()["message_bytes_stored"]
    for node_id in graph.node_ids():
        assert_same_json(graph.request_messages(node_id), plain.request_messages(node_id))


def test_a_raw_tools_text_stored_before_is_not_decoded_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same raw tools text each call: decoded until the graph holds its value, then
    taken as that value (same stored tools, same n_tools, same export); another spelling of
    the value, or another text, is decoded as usual."""
    import rollout_store.graph as graph_module
    from rollout_store import RolloutGraph, TurnNode

    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {}}} for i in range(3)
    ]
    text = json.dumps(tools).encode()
    decoded: list[str] = []
    original = graph_module.resolve_raw

    def counting(value: Any, path: str) -> Any:
        if path == "request_tools":
            decoded.append(value.data if type(value) is RawJSON else "list")
        return original(value, path)

    monkeypatch.setattr(graph_module, "resolve_raw", counting)
    graph = RolloutGraph()
    given = [text, text, text, json.dumps(tools, indent=1).encode(), text, b'[{"a": 1}]']
    for i, tools_text in enumerate(given):
        graph.add_turn(
            TurnNode(
                request_messages=[{"role": "user", "content": f"q{i}"}],
                request_tools=RawJSON(tools_text),
                sampling_params=RawJSON(b'{"temperature": 0.5}'),
                n_tools=None,  # counted from the tools
            )
        )
    # turns 0 and 1 decode it (turn 1 finds the value stored, and remembers the text), turn 2
    # and 4 take it as stored; the indented spelling and the other text are decoded
    assert decoded == [text, text, given[3], given[5]]
    for i, node_id in enumerate(graph.node_ids()):
        node = graph.get(node_id)
        expected = json.loads(given[i])
        assert json.dumps(graph.request_tools(node_id)) == json.dumps(expected)
        assert node.n_tools == len(expected)
        assert node.sampling_params == {"temperature": 0.5}
    ids = graph.node_ids()
    assert graph._turns[2].tools is graph._turns[1].tools is graph._turns[4].tools
    # a bad text is refused as ever, naming the field, and changes nothing
    with pytest.raises(InvalidValueError) as err:
        graph.add_turn(TurnNode(request_messages=[], request_tools=RawJSON(text[:-1])))
    assert err.value.path == "request_tools"
    assert graph.node_ids() == ids


def test_dropped_caches_cost_a_raw_conversation_nothing_but_speed() -> None:
    from rollout_store import RolloutGraph, TurnNode

    graph = RolloutGraph()
    tools = [{"type": "function", "function": {"name": "click", "description": "x " * 200}}]
    history: list[Any] = [{"role": "user", "content": "q0"}]
    for i in range(3):
        response = {"role": "assistant", "content": f"a{i}"}
        graph.add_turn(
            TurnNode(
                request_messages=RawJSON(json.dumps(history).encode()),
                request_tools=RawJSON(json.dumps(tools).encode()),
                response_message=response,
            )
        )
        history = [*history, response, {"role": "user", "content": f"q{i + 1}"}]
        if i == 1:  # the conversation's tip and its tool list's text are remembered: let go
            assert graph._requests.raw_tips._order and graph._requests.raw_shared
            graph.drop_caches()
            assert not graph._requests.raw_tips._order and not graph._requests.raw_shared
    ids = graph.node_ids()
    assert graph.parent(ids[2]) == ids[1] and graph.link_kind(ids[2]) == "messages"
    assert graph._requests.raw_tips._order  # the turn after leaves a tip again
    assert json.dumps(graph.request_messages(ids[2])) == json.dumps(history[:-2])
    assert json.dumps(graph.get(ids[2]).request_tools) == json.dumps(tools)


def _str_and_bytes_chat(monkeypatch: pytest.MonkeyPatch, spell: Any) -> tuple[Any, Any, list[int]]:
    """One chat recorded twice, its messages given as `RawJSON(spell(text))` and as bytes;
    the lengths of the texts decoded whole in the first graph."""
    from rollout_store import RolloutGraph, TurnNode
    from rollout_store.engine import requests

    decoded_whole: list[int] = []
    real = requests.decode_raw

    def counting(raw: RawJSON, path: str) -> Any:
        if type(raw.data) is str:
            decoded_whole.append(len(raw.data))
        return real(raw, path)

    monkeypatch.setattr(requests, "decode_raw", counting)
    graph, plain = RolloutGraph(share_threshold=16), RolloutGraph(share_threshold=16)
    odd = ["\ud800", "\U0001f4a5", "\u00e9" * 20, 2**70, float("nan")]
    for i, messages in enumerate(_chat(5)):
        # re-sent as first written (odd values in the system message: the new messages are
        # decoded by msgspec, which leaves NaN and lone surrogates to json.loads)
        messages = [{**messages[0], "odd": odd}, *messages[1:]]
        text = json.dumps(messages, ensure_ascii=False)
        for target, data in ((graph, spell(text)), (plain, text.encode("utf-8", "surrogatepass"))):
            target.add_turn(TurnNode(request_messages=RawJSON(data), response_message=_response(i)))
    return graph, plain, decoded_whole


def test_a_raw_str_is_read_as_its_utf8_and_confirmed_as_bytes_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A conversation sent as `RawJSON(str)` takes the byte path: its re-sent prefix is
    confirmed, not decoded (only its first text is decoded whole), and it records what bytes
    record, lone surrogates and all."""
    graph, plain, decoded_whole = _str_and_bytes_chat(monkeypatch, lambda text: text)
    assert len(decoded_whole) == 1  # the first turn's; each later one continues its tip
    assert graph.path_ids("turn-4") == plain.path_ids("turn-4")
    for node_id in graph.node_ids():
        assert_same_json(graph.request_messages(node_id), plain.request_messages(node_id))
    assert graph.stats()["message_bytes_stored"] == plain.stats()["message_bytes_stored"]


@pytest.mark.parametrize("lead", ["\ufeff", "\x00", " \x00"])
def test_a_raw_str_its_utf8_would_read_otherwise_is_decoded_as_a_str(lead: str) -> None:
    """A str that begins with U+FEFF or a NUL reads otherwise as bytes (a byte order mark
    taken off, UTF-16 or UTF-32 detected), so it is decoded as a str: refused as json.loads
    refuses it, even where a tip of the same bytes would confirm it, and nothing added."""
    from rollout_store import RolloutGraph, TurnNode

    messages = [{"role": "user", "content": "hi"}]
    text = lead + json.dumps(messages)
    longer = lead + json.dumps([*messages, _response(0), {"role": "user", "content": "more"}])
    with pytest.raises(ValueError):
        json.loads(text)  # (what the graph must do too)
    # a graph whose tip is those characters' UTF-8 (bytes json.loads takes a BOM off)
    for first in (text.encode("utf-8"), json.dumps(messages).encode()):
        graph = RolloutGraph()
        with contextlib.suppress(InvalidValueError):  # (bytes json.loads refuses too)
            graph.add_turn(TurnNode(request_messages=RawJSON(first), response_message=_response(0)))
        ids = graph.node_ids()
        for sent in (text, longer):
            with pytest.raises(InvalidValueError) as err:
                node = TurnNode(request_messages=RawJSON(sent), response_message=_response(1))
                graph.add_turn(node)
            assert err.value.path == "request_messages"
            assert _loads_or_error(sent)[1] in err.value.reason
        assert graph.node_ids() == ids


def test_raw_str_token_ids_are_read_as_bytes_are() -> None:
    from rollout_store import RolloutGraph, TurnNode
    from rollout_store.engine.intake import PackedIds
    from rollout_store.graph import _without_raw

    node = TurnNode(prompt_ids=RawJSON("[1, 2, 4294967295]"), sampled_ids=RawJSON(b"[3]"))  # type: ignore[arg-type]
    resolved = _without_raw(node)
    assert type(resolved.prompt_ids) is PackedIds and type(resolved.sampled_ids) is PackedIds
    graph = RolloutGraph()
    view = graph.add_turn(node)
    assert (view.prompt_ids, view.sampled_ids) == ([1, 2, 4294967295], [3])
    odd = TurnNode(prompt_ids=RawJSON("\ufeff[1]"))  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError) as err:
        graph.add_turn(odd)
    assert err.value.path == "prompt_ids" and "BOM" in err.value.reason


class _Str(str):
    def encode(self, *args: Any, **kwargs: Any) -> bytes:
        return b"[]"  # what json.loads never reads of it


class _Bytes(bytes):
    def decode(self, *args: Any, **kwargs: Any) -> str:
        return "[]"


def test_raw_str_and_bytes_subclasses_are_read_as_json_loads_reads_them() -> None:
    """A str or bytes subclass stands for its characters or bytes (its methods may say
    otherwise), as bytes and a str do."""
    from rollout_store import RolloutGraph, TurnNode

    for kind in (_Str, _Bytes):
        graph, plain = RolloutGraph(), RolloutGraph()
        for i, messages in enumerate(_chat(3)):
            text = json.dumps(messages)
            data = kind(text) if kind is _Str else kind(text.encode())
            graph.add_turn(TurnNode(request_messages=RawJSON(data), response_message=_response(i)))
            plain.add_turn(TurnNode(request_messages=messages, response_message=_response(i)))
        for node_id in plain.node_ids():
            assert_same_json(graph.request_messages(node_id), plain.request_messages(node_id))
        assert graph.path_ids("turn-2") == plain.path_ids("turn-2")
    assert type(RawJSON(_Str("[1]")).data) is str and type(RawJSON(_Bytes(b"1")).data) is bytes
    assert RawJSON(memoryview(b"[2]")[1:2]).decode() == 2

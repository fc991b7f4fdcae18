"""Confirming re-sent messages: the chunked prefix digests equal BLAKE3 of the plain packings,
deep conversations link turn by turn (raw and decoded alike), an edit anywhere in a re-sent
prefix is never taken for the stored one, and odd values survive it exactly."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import blake3
import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import assert_same, assert_same_json

from rollout_store import InvalidValueError, RawJSON, RolloutGraph, TurnNode
from rollout_store._core import Packer, RequestTable
from rollout_store.engine.confirm import HOLE_MIN, text_holes
from rollout_store.engine.intake import token_array
from rollout_store.engine.stored import TurnFlag

#: around the pieces the engine hashes in (64 KiB)
ALIGN = 1 << 16
#: the last boundaries the base-finder takes digests at first
WINDOW = 4
SIZES = (0, 1, 30, 200, 1000, 5000, ALIGN - 7, ALIGN + 3, ALIGN + 11, 3 * ALIGN)


def _msgpack() -> Any:
    """msgpack's own packer, the reference the engine's plain packing is checked against."""
    return msgpack.Packer(use_bin_type=True, strict_types=True).pack


def _messages(rng: random.Random, n: int) -> list[dict[str, Any]]:
    return [
        {"role": rng.choice(["user", "assistant"]), "content": "m" * rng.choice(SIZES) + str(i)}
        for i in range(n)
    ]


def _reference(pack: Any, messages: list[Any]) -> list[bytes]:
    plains = [pack(m) for m in messages]
    return [blake3.blake3(b"".join(plains[:j])).digest() for j in range(len(messages) + 1)]


@pytest.mark.parametrize("seed", range(12))
def test_the_tables_digests_are_blake3_of_the_plain_packings(seed: int) -> None:
    """Every boundary's digest where a request is filed, the whole request's, and the
    packings handed back, whatever the chunking and the boundaries filed."""
    rng = random.Random(seed)
    pack = _msgpack()
    messages = _messages(rng, rng.randrange(0, 90))
    want = _reference(pack, messages)
    table = RequestTable()
    lengths = sorted({j for j in range(len(messages) + 1) if rng.random() < 0.3})
    for turn, j in enumerate(lengths):
        table.file(turn, j, want[j])
    plains = [pack(m) for m in messages]
    assert [(n, d) for n, d, _ in table.prefixes(plains)] == [(j, want[j]) for j in lengths[::-1]]
    first, found_plains, (base, base_len, _, digest) = table.find_messages(
        Packer(None, None), messages
    )
    assert digest == want[len(messages)]
    assert (base, base_len) == ((len(lengths) - 1, lengths[-1]) if lengths else (None, 0))
    assert first == base_len and found_plains == plains[first:]


def _conversation(n_turns: int, seed: int, big: bool) -> list[tuple[list[Any], dict[str, Any]]]:
    """Request and response of each turn; 1 to 12 new messages a turn (so bases lie inside
    and beyond the probed window), some long enough to span chunks."""
    rng = random.Random(seed)
    history: list[Any] = [{"role": "system", "content": "sys"}]
    out = []
    for t in range(n_turns):
        for _ in range(rng.choice([1, 1, 2, 3, 5, 12])):
            size = rng.choice(SIZES if big else (10, 200, 300))
            history.append({"role": "user", "content": f"{t}:" + "u" * size})
        response = {"role": "assistant", "content": f"reply {t}"}
        out.append((list(history), response))
        history.append(response)
    return out


@pytest.mark.parametrize("big", [False, True])
def test_deep_conversation_links_every_turn(big: bool) -> None:
    graph = RolloutGraph()
    turns = _conversation(40, 3, big)
    for messages, response in turns:
        graph.add_turn(TurnNode(request_messages=messages, response_message=response))
    assert graph.path_ids("turn-39") == [f"turn-{i}" for i in range(40)]
    for i, (messages, _) in enumerate(turns):
        assert_same(graph.request_messages(f"turn-{i}"), messages)


@pytest.mark.parametrize("raw_every", [1, 2, 3])
def test_raw_and_decoded_turns_of_a_deep_conversation_link(raw_every: int) -> None:
    """Raw turns continue decoded ones and the other way round; the stored bytes are those
    of an all-decoded graph."""
    graph, plain = RolloutGraph(), RolloutGraph()
    turns = _conversation(30, 4, big=True)
    for i, (messages, response) in enumerate(turns):
        text = json.dumps(messages)
        given: Any = RawJSON(text.encode()) if i % raw_every == 0 else json.loads(text)
        graph.add_turn(TurnNode(request_messages=given, response_message=response))
        plain.add_turn(TurnNode(request_messages=json.loads(text), response_message=response))
    assert graph.path_ids("turn-29") == plain.path_ids("turn-29")
    assert graph.path_ids("turn-29") == [f"turn-{i}" for i in range(30)]
    assert graph.stats()["message_bytes_stored"] == plain.stats()["message_bytes_stored"]
    for node_id in graph.node_ids():
        assert_same(graph.request_messages(node_id), plain.request_messages(node_id))


def _edited(messages: list[Any], where: int, rng: random.Random) -> list[Any]:
    """`messages` with one character of message `where` changed (same length)."""
    out = json.loads(json.dumps(messages))
    text = out[where]["content"]
    k = rng.randrange(len(text))
    out[where]["content"] = text[:k] + ("#" if text[k] != "#" else "%") + text[k + 1 :]
    return out


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_an_edit_in_the_middle_of_a_resent_prefix_never_matches(raw: bool, seed: int) -> None:
    """One character changed in an early message (before the probed window, inside some
    chunk): no stored turn holding that message is its parent or base, and what was sent is
    kept."""
    rng = random.Random(seed)
    graph = RolloutGraph()
    turns = _conversation(25, 10 + seed, big=True)
    for messages, response in turns:
        graph.add_turn(TurnNode(request_messages=messages, response_message=response))
    last, response = turns[-1]
    resent = [*last, response, {"role": "user", "content": "next"}]
    where = rng.randrange(1, len(last) - WINDOW)
    edited = _edited(resent, where, rng)
    given: Any = RawJSON(json.dumps(edited).encode()) if raw else edited
    view = graph.add_turn(TurnNode(request_messages=given))
    # the parent is the deepest turn whose request and echoed response lie before the edit
    before = [k for k, (messages, _) in enumerate(turns) if len(messages) < where]
    want = f"turn-{before[-1]}" if before else None
    assert graph.parent(view.node_id) == want
    stored = graph._turn(view.node_id)
    assert stored.base is None or stored.base.n_rest + 1 <= where  # and no base beyond it
    assert_same_json(graph.request_messages(view.node_id), edited)
    # the unedited continuation still finds its parent
    view = graph.add_turn(TurnNode(request_messages=resent))
    assert graph.parent(view.node_id) == f"turn-{len(turns) - 1}"
    assert_same(graph.request_messages(view.node_id), resent)


SPECIAL = [
    ("tuple", ("a", ("b", 1), [])),
    ("big int", 2**80),
    ("negative big int", -(2**70) - 1),
    ("lone surrogate", "x\ud800y"),
    ("nan", math.nan),
    ("inf", -math.inf),
    ("negative zero", -0.0),
    ("int float bool", [1, 1.0, True, 0, 0.0, False]),
    ("key order", {"b": 1, "a": 2}),
    ("empty", [{}, [], ""]),
]


def _chat_with(value: Any, n: int) -> list[tuple[list[Any], dict[str, Any]]]:
    history: list[Any] = [{"role": "user", "content": "start", "odd": value}]
    out = []
    for i in range(n):
        history = [*history, {"role": "user", "content": f"q{i}" * 50, "odd": value}]
        response = {"role": "assistant", "content": f"a{i}"}
        out.append((history, response))
        history = [*history, response]
    return out


@pytest.mark.parametrize(("label", "value"), SPECIAL, ids=[label for label, _ in SPECIAL])
def test_special_values_in_a_resent_prefix_link_and_round_trip(label: str, value: Any) -> None:
    graph = RolloutGraph()
    turns = _chat_with(value, 14)  # deeper than the window: the odd values are re-sent
    for messages, response in turns:
        graph.add_turn(TurnNode(request_messages=messages, response_message=response))
    assert graph.path_ids("turn-13") == [f"turn-{i}" for i in range(14)], label
    for i, (messages, _) in enumerate(turns):
        assert_same(graph.request_messages(f"turn-{i}"), messages)


@pytest.mark.parametrize(
    ("stored", "fresh"),
    [
        (1, 1.0),
        (1, True),
        (0.0, -0.0),
        ([1, 2], (1, 2)),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
        (2**70, 2**70 + 1),
        ("x\ud800", "x\ud801"),
    ],
)
def test_values_equal_in_python_but_not_in_json_are_not_confirmed(stored: Any, fresh: Any) -> None:
    """A re-sent prefix that differs from the stored one only where Python's == does not
    tell is stored as sent, not as the stored turn's."""
    graph = RolloutGraph()
    first = [{"role": "user", "content": "q", "v": stored}] + [
        {"role": "user", "content": f"pad {i}"} for i in range(12)
    ]
    graph.add_turn(
        TurnNode(request_messages=first, response_message={"role": "assistant", "content": "a"})
    )
    second = [{"role": "user", "content": "q", "v": fresh}, *first[1:]]
    second += [{"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}]
    view = graph.add_turn(TurnNode(request_messages=second))
    assert graph.parent(view.node_id) is None
    assert_same(graph.request_messages(view.node_id), second)
    assert_same(graph.request_messages("turn-0"), first)


def test_nan_in_a_raw_prefix_links_to_the_decoded_turn() -> None:
    """NaN and a lone surrogate in raw text (which msgspec leaves to json.loads): the raw
    continuation of a decoded turn still links, and exports the same text."""
    graph = RolloutGraph()
    text = '[{"role": "user", "content": "\\ud800", "x": NaN, "n": 123456789012345678901234}]'
    first = json.loads(text)
    graph.add_turn(
        TurnNode(request_messages=first, response_message={"role": "assistant", "content": "a"})
    )
    resent = (
        text[:-1] + ', {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]'
    )
    view = graph.add_turn(TurnNode(request_messages=RawJSON(resent.encode())))
    assert graph.parent(view.node_id) == "turn-0"
    assert json.dumps(graph.request_messages(view.node_id)) == json.dumps(json.loads(resent))


@pytest.mark.parametrize(
    ("ids", "want"),
    [
        ([1, 2, 3], "I"),
        ([], "I"),
        ([2**32], "q"),
        ([-1, 5], "q"),
        ([2**70], "tuple"),
    ],
)
def test_token_array_storage(ids: list[int], want: str) -> None:
    got = token_array(ids, "prompt_ids")
    assert (got.typecode if not isinstance(got, tuple) else "tuple") == want
    assert list(got) == ids


@pytest.mark.parametrize(
    ("ids", "path"),
    [([1, True], "prompt_ids[1]"), ([False], "prompt_ids[0]"), ([1, 2.0], "prompt_ids[1]")],
)
def test_token_array_refuses_bools_and_floats(ids: list[Any], path: str) -> None:
    with pytest.raises(InvalidValueError) as info:
        token_array(ids, "prompt_ids")
    assert path in str(info.value)


def test_messages_whose_length_byte_looks_like_an_ext_type_skip_the_walk() -> None:
    """A 200-character string packs with the length byte 0xc8 (the ext 16 type byte): the
    message is still stored as its plain packing, and round-trips exactly."""
    graph = RolloutGraph()
    messages = [{"role": "user", "content": "z" * n} for n in range(190, 220)]
    view = graph.add_turn(TurnNode(request_messages=messages))
    pack = _msgpack()
    stored = graph._turn(view.node_id)  # its tail: the messages' plain packings, joined
    assert stored.tail.endswith(b"".join(pack(m) for m in messages))
    assert not stored.flags & (TurnFlag.TAIL_REFS | TurnFlag.TAIL_SPECIAL)
    assert_same(graph.request_messages(view.node_id), messages)


@pytest.mark.parametrize(
    "bad",
    [
        b"",
        b"x" * 200,
        bytearray(b"x"),
        msgpack.Timestamp(5, 0),
        msgpack.Timestamp(2**33, 7),
        msgpack.Timestamp(2**40, 1),
        msgpack.ExtType(3, b"ab"),
    ],
    ids=repr,
)
def test_short_messages_holding_no_json_value_are_refused(bad: Any) -> None:
    """A value that packs to a bin or ext type (a timestamp too, which unpacking decodes
    without the hook) is refused in a short message, a long one and a response."""
    graph = RolloutGraph()
    for messages in (
        [{"role": "user", "content": "z" * 200, "bad": bad}],
        [{"role": "user", "content": "z" * 5000, "bad": bad}],
    ):
        with pytest.raises(InvalidValueError):
            graph.add_turn(TurnNode(request_messages=messages))
    with pytest.raises(InvalidValueError):
        graph.add_turn(TurnNode(response_message={"role": "assistant", "bad": bad}))
    assert len(graph) == 0


@pytest.mark.parametrize(
    "bad",
    [
        b"",
        b"x" * 3,
        msgpack.Timestamp(5, 0),
        msgpack.Timestamp(2**33, 7),
        msgpack.Timestamp(2**40, 1),
        msgpack.ExtType(3, b""),
        msgpack.ExtType(3, b"ab"),
    ],
    ids=repr,
)
def test_a_continuation_s_fresh_messages_are_checked_together_and_each(bad: Any) -> None:
    """The new messages of a continuation are checked for bin and ext types in one pass: one
    bad value among several short messages (after the echo) is refused, and the graph keeps
    only the first turn; good messages around it, alone, are stored as their packings."""
    graph = RolloutGraph()
    reply = {"role": "assistant", "content": "r" * 200}
    first = [{"role": "user", "content": "a" * 200}]
    graph.add_turn(TurnNode(request_messages=first, response_message=reply))
    fresh = [{"role": "user", "content": c * 200} for c in "bcd"]
    with pytest.raises(InvalidValueError):
        bad_fresh = [fresh[0], {"role": "user", "content": "e" * 200, "bad": bad}, fresh[2]]
        graph.add_turn(TurnNode(request_messages=[*first, reply, *bad_fresh]))
    assert len(graph) == 1
    view = graph.add_turn(TurnNode(request_messages=[*first, reply, *fresh]))
    assert view.parent_id == graph.node_ids()[0]
    assert_same(graph.request_messages(view.node_id), [*first, reply, *fresh])


@pytest.mark.parametrize("n_rest", [1, 2, 5, WINDOW + 3])
@pytest.mark.parametrize("long_last", [False, True])
def test_a_graph_s_first_turn_waits_under_every_prefix(n_rest: int, long_last: bool) -> None:
    """A graph's first turn is probed at every boundary at once (nothing filed yet) and
    waits under the key of each shorter prefix: a late turn whose request and response are
    any of its prefixes adopts it, with the keys a later root gets by `extend`."""
    messages: list[Any] = [{"role": "system", "content": "sys"}]
    for i in range(n_rest):
        size = 70_000 if long_last and i == n_rest - 1 else 40
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}" * size})
    for cut in range(1, n_rest + 1):  # the late turn: messages[:cut], then its response
        graph = RolloutGraph()
        first = graph.add_turn(TurnNode(request_messages=messages, response_message=None))
        late = graph.add_turn(
            TurnNode(request_messages=messages[:cut], response_message=messages[cut])
        )
        assert first.parent_id == late.node_id, (n_rest, cut)
        # a second graph whose first turn is another conversation: the root is a later one
        graph = RolloutGraph()
        graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "other"}]))
        root = graph.add_turn(TurnNode(request_messages=messages, response_message=None))
        late = graph.add_turn(
            TurnNode(request_messages=messages[:cut], response_message=messages[cut])
        )
        assert root.parent_id == late.node_id, (n_rest, cut)


#: a long string whose first bytes occur nowhere else in it, and one where they occur at
#: every place
_HEADS = ("".join(random.Random(0).choices("abcdefghij", k=HOLE_MIN)), "x" * HOLE_MIN)


@given(
    st.sampled_from(_HEADS),
    st.lists(st.sampled_from([b"a", b"b", b"\xc3\xa9"]), max_size=6),
    st.integers(0, 12),
    st.integers(0, 3),
    st.booleans(),
)
def test_text_holes_are_where_find_finds_each_blob(
    head: str, tail: list[bytes], decoys: int, cut: int, present: bool
) -> None:
    """Blobs are found where `bytes.find` finds them, also after many places that begin
    alike but differ (more than are compared before `bytes.find` decides)."""
    blob = head + "".join(t.decode() for t in tail) + "end"
    needle = blob.encode()
    alike = needle[: len(needle) - 1 - cut] + b"?"  # same first bytes, another last one
    data = b"[" + b",".join([alike] * decoys + ([needle] if present else []) + [b"z"]) + b"]"
    want = data.find(needle, 1, len(data) - 1)
    holes = text_holes(data, 1, len(data) - 1, [blob])
    assert holes == ([(want, want + len(needle), blob)] if want >= 0 else [])
    assert (want >= 0) == present

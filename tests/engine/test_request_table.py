"""The engine's request table and its one base-finder (`_core.RequestTable`), against the
graph's own request storage and against `json.loads` + the plain packer.

The graph finds a re-sent request's base several ways (the continuation of the turn filed
last, decoded tips, the digests of the message boundaries); the engine's table finds it one
way. On the same turns both must name the same base, the same echo and the same stored tail,
byte for byte. A raw text of messages is transcoded by the engine into the packings
`Packer(None, None)` writes for what `json.loads` reads from it.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from support import json_like

from rollout_store import MAX_DEPTH, RolloutGraph, TurnNode, _core
from rollout_store.engine.confirm import digest_key, prefix_digest
from rollout_store.engine.encoding import ECHO_PACKED
from rollout_store.engine.stored import TAIL_ECHO, LinkKind

RequestTable = _core.RequestTable


def prefix_keys(plains: list[bytes]) -> list[int]:
    """The reference for the table's prefix keys: each prefix's digest, one by one."""
    return [digest_key(prefix_digest(b"".join(plains[:m]))) for m in range(len(plains) + 1)]


def plain(value: Any) -> bytes:
    return _core.Packer(None, None).pack(value)


def _branching_rollouts(seed: int, turns: int) -> list[tuple[list[Any], Any]]:
    """(request messages, response) of turns that continue, branch from, retry and restart
    earlier ones, with their responses echoed exactly or not."""
    rng = random.Random(seed)
    done: list[tuple[list[Any], Any]] = []
    for i in range(turns):
        shape = rng.random()
        if not done or shape < 0.1:
            messages: list[Any] = [{"role": "user", "content": f"task {rng.randrange(4)}"}]
        else:
            before, response = rng.choice(done[-8:] if shape < 0.7 else done)
            if shape < 0.8:  # a retry of that very request
                messages = list(before)
            elif shape < 0.9:  # a branch inside it
                messages = before[: rng.randrange(len(before) + 1)]
                messages.append({"role": "user", "content": f"again {rng.randrange(3)}"})
            else:  # continued, its response echoed (or not quite)
                echo = response if rng.random() < 0.8 else {**response, "content": "edited"}
                messages = [*before, echo, {"role": "user", "content": f"next {i}"}]
        if rng.random() < 0.6 and done:
            before, response = done[-1]
            messages = [*before, response, {"role": "user", "content": f"go on {i}"}]
        content = f"answer {rng.randrange(3)}" if rng.random() < 0.5 else f"answer {i}"
        done.append((messages, {"role": "assistant", "content": content}))
    return done


@pytest.mark.parametrize("seed", range(6))
def test_the_table_finds_the_base_echo_and_tail_the_graph_stores(seed: int) -> None:
    graph = RolloutGraph(share_threshold=None)
    table = RequestTable()
    for index, (messages, response) in enumerate(_branching_rollouts(seed, 120)):
        graph.add_turn(TurnNode(request_messages=messages, response_message=response))
        turn = graph._turns[index]
        plains = [plain(m) for m in messages]
        base, base_len, echo, digest = table.find(plains)
        stored_base = turn.base.index if turn.base is not None else None
        assert (base, echo) == (stored_base, bool(turn.flags & TAIL_ECHO)), f"turn {index}"
        assert base_len == (turn.base.n_rest if turn.base is not None else 0)
        assert digest == prefix_digest(b"".join(plains)) == graph._requests.table.digest(index)
        assert RequestTable.tail(plains, base_len, echo) == bytes(turn.tail), f"turn {index}"
        table.file(index, len(plains), digest, plain(response))
    assert len(table) == len(graph)
    assert table.nbytes > 0


@pytest.mark.parametrize("seed", range(4))
def test_the_tables_prefixes_answer_the_linkers_questions_as_the_graph_does(seed: int) -> None:
    """Each boundary's filed turns (brute force over what was filed), the message parent by
    an exact echo (the graph's, for a turn linked by messages), a root's prefix keys (the
    graph's `prefix_keys`) and twins with children."""
    graph = RolloutGraph(share_threshold=None)
    table = RequestTable()
    filed: list[list[bytes]] = []
    responses: list[bytes] = []  # the table keeps a response's xxh3: the bytes are here
    for index, (messages, response) in enumerate(_branching_rollouts(200 + seed, 120)):
        plains = [plain(m) for m in messages]
        prefixes = table.prefixes(plains)
        expected = [
            (n, [t for t, f in enumerate(filed) if f == plains[:n]])
            for n in range(len(plains), -1, -1)
        ]
        assert [(n, turns) for n, _, turns in prefixes] == [e for e in expected if e[1]]
        for n, digest, _ in prefixes:
            assert digest == prefix_digest(b"".join(plains[:n]))
        assert RequestTable.keys(plains) == prefix_keys(plains)
        # the parent by messages: at the longest boundary before the last message where a
        # filed turn's response comes next, exactly, the first such turn
        exact = next(
            (
                t
                for n, _, turns in prefixes
                if n < len(plains)
                for t in turns
                if table.echoes(t, plains[n]) and responses[t] == plains[n]
            ),
            None,
        )
        graph.add_turn(TurnNode(request_messages=messages, response_message=response))
        turn = graph._turns[index]
        if turn.link == LinkKind.MESSAGES:
            assert turn.parent is not None and exact == turn.parent.index, f"turn {index}"
        else:
            assert exact is None, f"turn {index}"
        if turn.parent is not None:
            table.note_child(turn.parent.index)
        table.file(index, len(plains), prefix_digest(b"".join(plains)), plain(response))
        filed.append(plains)
        responses.append(plain(response))
    for index, turn in enumerate(graph._turns):
        assert table.has_children(index) is (turn.kids is not None)


def test_a_workload_conversation_finds_each_turn_just_before() -> None:
    table = RequestTable()
    messages: list[Any] = [{"role": "user", "content": "start"}]
    for turn in range(50):
        response = {"role": "assistant", "content": f"reply {turn}"}
        plains = [plain(m) for m in messages]
        base, base_len, echo, digest = table.find(plains)
        assert (base, base_len, echo) == (
            (None, 0, False) if turn == 0 else (turn - 1, turn * 2 - 1, True)
        )
        table.file(turn, len(plains), digest, plain(response))
        messages += [response, {"role": "user", "content": f"more {turn}"}]
    assert table.n_rest(49) == 99
    assert table.echoes(49, plain({"role": "assistant", "content": "reply 49"})) is True
    assert table.echoes(49, plain({"role": "assistant", "content": "reply 48"})) is False
    assert table.n_rest(50) is None and table.echoes(50, b"") is None


@settings(max_examples=300, deadline=None)
@given(st.lists(json_like, max_size=6))
@example(["\ud800", 2**64, -(2**63) - 1, float("nan"), -0.0, 1e400, [], {}])
def test_a_raw_text_packs_as_the_plain_packer_packs_what_json_loads_reads(
    values: list[Any],
) -> None:
    text = json.dumps(values).encode()
    first, plains, found = RequestTable().find_json(text)
    assert first == 0
    assert plains == [plain(m) for m in json.loads(text)]
    assert found[3] == prefix_digest(b"".join(plains))


_SEPARATORS = [(", ", ": "), (",", ":"), (" ,\n ", " : ")]


@pytest.mark.parametrize("seed", range(4))
def test_raw_texts_read_from_their_tips_find_what_the_graph_stores(seed: int) -> None:
    graph = RolloutGraph(share_threshold=None)
    table = RequestTable()
    rng = random.Random(seed)
    for index, (messages, response) in enumerate(_branching_rollouts(100 + seed, 120)):
        graph.add_turn(TurnNode(request_messages=messages, response_message=response))
        turn = graph._turns[index]
        # a harness writes its texts one way, mostly: each conversation's texts then extend
        # one another byte for byte (and where they do not, the text is read whole)
        separators = _SEPARATORS[0] if rng.random() < 0.9 else rng.choice(_SEPARATORS)
        text = json.dumps(messages, separators=separators).encode()
        first, plains, (base, base_len, echo, digest) = table.add_json(index, text, plain(response))
        all_plains = [plain(m) for m in messages]
        assert plains == all_plains[first:], f"turn {index}"
        stored_base = turn.base.index if turn.base is not None else None
        assert (base, echo) == (stored_base, bool(turn.flags & TAIL_ECHO)), f"turn {index}"
        assert digest == graph._requests.table.digest(index)
        assert first <= base_len
        assert RequestTable.tail(all_plains, base_len, echo) == bytes(turn.tail)
    assert table.raw_tip_hits > 30


def test_a_long_raw_text_is_read_from_its_tip_with_its_new_messages_only() -> None:
    table = RequestTable()
    messages: list[Any] = [{"role": "user", "content": "x" * (1 << 20)}]
    for turn in range(3):
        response = {"role": "assistant", "content": f"reply {turn}"}
        text = json.dumps(messages).encode()
        first, plains, found = table.add_json(turn, text, plain(response))
        assert found[:3] == ((None, 0, False) if turn == 0 else (turn - 1, 2 * turn - 1, True))
        assert (first, plains) == (
            (0, [plain(messages[0])])
            if turn == 0
            else (2 * turn - 1, [plain(m) for m in messages[-2:]])
        )
        messages += [response, {"role": "user", "content": f"more {turn}"}]
    assert table.raw_tip_hits == 2
    assert table.nbytes < (64 << 10)  # the text is not kept: a digest and a state


def test_a_raw_text_finds_its_base_like_the_same_decoded_messages() -> None:
    table = RequestTable()
    first = [{"role": "user", "content": "hi", "x": 1.0}]
    table.file(0, 1, table.find([plain(m) for m in first])[3], plain({"role": "assistant"}))
    # a repeated key: json.loads keeps its last value, at its first place
    text = (
        b'[{"role":"user","content":"hi","x":1.0},\n {"role": "assistant"},'
        b' {"x": [1], "y": 2, "x": 1e2}]'
    )
    _, plains, found = table.find_json(text)
    assert plains[2] == plain({"x": 100.0, "y": 2})
    assert found[:3] == (0, 1, True)
    assert found == table.find([plain(m) for m in json.loads(text)])


@pytest.mark.parametrize(
    ("text", "error", "says"),
    [
        (b'{"role": "user"}', ValueError, "expected a JSON array"),
        (b"[1, 2", _core.DecodeError, "Expecting"),
        (b"[" + b"9" * 5000 + b"]", ValueError, "Exceeds the limit"),
    ],
)
def test_a_raw_text_json_loads_refuses_is_refused_and_nothing_is_filed(
    text: bytes, error: type[Exception], says: str
) -> None:
    table = RequestTable()
    with pytest.raises(error, match=says):
        table.find_json(text)
    with pytest.raises(error, match=says):
        table.add_json(0, text)
    if b"{" not in text:  # (an object is JSON, only not a request's messages)
        with pytest.raises(ValueError):
            json.loads(text)
    assert len(table) == 0


def test_a_raw_text_nested_past_the_depth_given_is_refused() -> None:
    text = b"[" * 40 + b"]" * 40
    with pytest.raises(_core.DecodeError):
        RequestTable().find_json(text, max_depth=32)
    assert RequestTable().find_json(text, max_depth=64)[1] == [plain(json.loads(text)[0])]


def test_the_digit_limit_is_the_processes_own() -> None:
    text = b"[" + b"9" * 5000 + b"]"
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        _, plains, _ = RequestTable().find_json(text)
        assert plains == [plain(json.loads(text)[0])]
    finally:
        sys.set_int_max_str_digits(old)


def test_filing_out_of_order_or_with_a_bad_digest_is_refused_and_changes_nothing() -> None:
    table = RequestTable()
    digest = prefix_digest(plain({"a": 1}))
    table.file(5, 1, digest)
    with pytest.raises(ValueError, match="in order"):
        table.file(5, 1, digest)
    with pytest.raises(ValueError, match="32 bytes"):
        table.file(6, 1, digest[:8])
    with pytest.raises(ValueError, match="a base of 3 messages"):
        RequestTable.tail([plain(1)], 3, False)
    with pytest.raises(ValueError, match="and an echo"):
        RequestTable.tail([plain(1)], 1, True)
    assert len(table) == 1
    assert table.find([plain({"a": 1})])[:3] == (5, 1, False)


def test_an_echo_is_only_the_base_response_exactly() -> None:
    table = RequestTable()
    request = [plain({"role": "user", "content": "q"})]
    table.file(0, 1, table.find(request)[3], plain({"role": "assistant", "content": "a"}))
    loose = [*request, plain({"content": "a", "role": "assistant"})]
    assert table.find(loose)[:3] == (0, 1, False)
    assert RequestTable.tail(loose, 1, False).startswith(b"\x91") and ECHO_PACKED not in (
        RequestTable.tail(loose, 1, False)
    )


def test_a_tip_nested_deeper_than_a_later_depth_bound_is_refused_as_read_whole() -> None:
    # the tip's messages were read under a higher bound: a text re-sending them under a lower
    # one is refused, as reading it whole refuses it, not read from the tip
    table = RequestTable()
    deep = b"[" + b"[" * 40 + b"]" * 40 + b"]"
    table.add_json(0, deep, max_depth=100)
    for text in (deep, deep[:-1] + b", 1]"):
        with pytest.raises(_core.DecodeError, match="deeper than 20"):
            RequestTable().find_json(text, max_depth=20)
        with pytest.raises(_core.DecodeError, match="deeper than 20"):
            table.find_json(text, max_depth=20)
        with pytest.raises(_core.DecodeError, match="deeper than 20"):
            table.add_json(1, text, max_depth=20)
        first, plains, _ = table.find_json(text, max_depth=41)
        assert (first, plains) == (1, [plain(m) for m in json.loads(text)][1:])
    assert len(table) == 1


def test_a_long_text_added_is_filed_before_a_turn_added_while_it_is_read() -> None:
    # a long text is read with the GIL released; a turn added meanwhile on another thread
    # must come wholly before it (and be found as its base) or after it (and be refused for
    # its order), never be filed between its reading and its filing
    table = RequestTable()
    first_message = {"role": "user", "content": "start"}
    items = [first_message] + [{"role": "user", "content": [i, "x"]} for i in range(100_000)]
    long_text = json.dumps(items).encode()
    assert len(long_text) > 1 << 20
    started = threading.Event()
    got: list[Any] = []

    def add_long() -> None:
        started.set()
        got.append(table.add_json(1, long_text))

    thread = threading.Thread(target=add_long)
    thread.start()
    started.wait()
    # most likely while the long text is read (a tenth of a second or more): either order is
    # right, the check is that the two never interleave
    time.sleep(0.02)
    try:
        table.add_json(0, json.dumps([first_message]).encode())
        short_filed = True
    except ValueError as err:
        assert "in order" in str(err)
        short_filed = False
    thread.join()
    (_, _, (base, base_len, _, _)) = got[0]
    assert len(table) == (2 if short_filed else 1)
    assert (base, base_len) == ((0, 1) if short_filed else (None, 0))


def test_a_text_of_messages_each_nested_to_the_bound_is_read_by_default() -> None:
    # each message may nest MAX_DEPTH levels (Packer's bound, the server's depth check's):
    # their array is one level more
    deepest = b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)
    expected = [plain(m) for m in json.loads(deepest)]
    table = RequestTable()
    assert table.find_json(deepest)[1] == expected
    assert table.add_json(0, deepest)[1] == expected
    too_deep = b"[" + deepest + b"]"
    with pytest.raises(_core.RefusedValue):
        plain(json.loads(too_deep)[0])
    with pytest.raises(_core.DecodeError, match=f"deeper than {MAX_DEPTH + 1}"):
        RequestTable().find_json(too_deep)


@pytest.mark.parametrize(
    "text",
    [
        b'[{"role": "user", "content": ' + b"9" * 5000 + b', "content": "hi"}]',
        b"[" + b"9" * 5000 + b", }",
    ],
    ids=["replaced by a repeated key", "before a fault"],
)
def test_an_int_json_loads_refuses_is_refused_where_it_meets_it(text: bytes) -> None:
    # json.loads converts each int as it reads it: one a repeated key replaces, or one
    # before a later fault, is what it refuses the text for
    with pytest.raises(ValueError, match="Exceeds the limit") as loads:
        json.loads(text)
    table = RequestTable()
    with pytest.raises(ValueError) as found:
        table.find_json(text)
    assert str(found.value) == str(loads.value)
    with pytest.raises(ValueError, match="Exceeds the limit"):
        table.add_json(0, text)
    assert len(table) == 0


def test_a_tip_keeps_the_depth_and_digits_of_a_value_a_repeated_key_replaced() -> None:
    # read under a higher bound (no digit limit), the tip holds a value its dict no longer
    # keeps; a text re-sending it under a lower one is refused as reading it whole refuses it
    deep = b'[{"a": ' + b"[" * 30 + b"]" * 30 + b', "a": 1}]'
    table = RequestTable()
    table.add_json(0, deep, max_depth=100)
    text = deep[:-1] + b", 1]"
    with pytest.raises(_core.DecodeError, match="deeper than 20") as whole:
        RequestTable().find_json(text, max_depth=20)
    with pytest.raises(_core.DecodeError) as from_tip:
        table.find_json(text, max_depth=20)
    assert str(from_tip.value) == str(whole.value)

    big = b'[{"a": ' + b"9" * 5000 + b', "a": 1}]'
    table = RequestTable()
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        table.add_json(0, big)
    finally:
        sys.set_int_max_str_digits(old)
    with pytest.raises(ValueError, match="Exceeds the limit"):
        table.find_json(big[:-1] + b", 1]")


def _confirmed_find(
    table: Any, plains: list[bytes], stored: dict[int, list[bytes]], asked: list[bool]
) -> tuple[int | None, int, bool, bytes]:
    """`find`, comparing the bytes of each turn read by its key alone that the table asks
    about with `stored` (what the graph rebuilds of that turn's request) and confirming or
    refuting it, as the graph's `extends` compares a loaded turn's tails."""
    refuted: list[int] = []
    for _ in range(len(stored) + 1):
        try:
            return table.find(plains, refuted=refuted)
        except _core.Unconfirmed as undecided:
            _, turn, n, digest = undecided.args
            assert n == len(stored[turn])
            if stored[turn] == plains[:n]:
                assert table.confirm(turn, digest) is True
                asked.append(True)
            else:
                refuted.append(turn)
                asked.append(False)
    raise AssertionError("the table asked about more turns than it holds")


@pytest.mark.parametrize("seed", range(4))
def test_turns_read_from_a_file_are_filed_by_their_key_and_confirmed_when_asked(
    seed: int, tmp_path: Any
) -> None:
    """Half of each rollout recorded, saved and loaded: the loaded turns are filed by the
    keys their records name, unconfirmed; the other half, added to the loaded graph, gets
    the base, echo and tail the graph stores once each turn the table asks about is
    compared (a turn of the file whose request differs under its key is refuted)."""
    turns = _branching_rollouts(300 + seed, 120)
    recorded = RolloutGraph(share_threshold=None)
    for messages, response in turns[:60]:
        recorded.add_turn(TurnNode(request_messages=messages, response_message=response))
    recorded.save(tmp_path / "half.rollout")
    graph = RolloutGraph.load(tmp_path / "half.rollout")
    table = RequestTable()
    stored: dict[int, list[bytes]] = {}
    for index, turn in enumerate(graph._turns):
        messages, response = turns[index]
        assert turn.digest is None and turn.rkey is not None  # the record's key alone
        table.file_key(index, turn.n_rest, turn.rkey, plain(response))
        stored[index] = [plain(m) for m in graph.request_messages(turn.node_id) or []]
    assert table.unconfirmed == 60
    asked: list[bool] = []  # each ask: confirmed (True) or refuted
    for index, (messages, response) in enumerate(turns[60:], 60):
        plains = [plain(m) for m in messages]
        base, base_len, echo, digest = _confirmed_find(table, plains, stored, asked)
        graph.add_turn(TurnNode(request_messages=messages, response_message=response))
        turn = graph._turns[index]
        stored_base = turn.base.index if turn.base is not None else None
        assert (base, echo) == (stored_base, bool(turn.flags & TAIL_ECHO)), f"turn {index}"
        assert base_len == (turn.base.n_rest if turn.base is not None else 0)
        assert digest == graph._requests.table.digest(index)
        assert RequestTable.tail(plains, base_len, echo) == bytes(turn.tail), f"turn {index}"
        table.file(index, len(plains), digest, plain(response))
    assert any(asked) and table.unconfirmed == 60 - sum(
        asked
    )  # a confirmed turn is not asked again


def test_an_unconfirmed_turn_blocks_the_find_and_the_filing_until_it_is_decided() -> None:
    request = [plain({"role": "user", "content": "hi"})]
    longer = [*request, plain({"role": "assistant", "content": "yo"})]
    table = RequestTable()
    table.file_key(3, 1, prefix_keys(request)[1], plain({"role": "assistant"}))
    text = json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    for call in (
        lambda: table.find(longer),
        lambda: table.find_json(text.encode()),
        lambda: table.add_json(4, text.encode()),
    ):
        with pytest.raises(_core.Unconfirmed) as undecided:
            call()
        assert undecided.value.args[1:] == (3, 1, prefix_digest(request[0]))
        assert "turn 3" in undecided.value.args[0]
    assert len(table) == 1  # add_json filed nothing
    assert table.find(longer, refuted=[3])[:3] == (None, 0, False)
    assert table.add_json(4, text.encode(), refuted=[3])[2][0] is None
    assert table.confirm(3, prefix_digest(longer[0] + longer[1])) is False
    assert table.confirm(3, prefix_digest(request[0])) is True
    assert table.unconfirmed == 0 and table.confirm(9, prefix_digest(b"")) is None
    assert table.find([request[0], plain({"role": "user"})])[:2] == (3, 1)


@pytest.mark.parametrize("seed", range(3))
def test_messages_packed_in_one_walk_find_what_their_packings_find(seed: int) -> None:
    """`find_messages` (Python values, packed by the engine with no `bytes` a message) names
    the base, echo and digest `find` names for their packings, and gives the packings a
    stored tail holds: those from the base's message count on."""
    table, packer = RequestTable(), _core.Packer(None, None)
    for index, (messages, response) in enumerate(_branching_rollouts(400 + seed, 80)):
        plains = [plain(m) for m in messages]
        first, kept, found = table.find_messages(packer, messages)
        assert found == table.find(plains), f"turn {index}"
        assert (first, kept) == (found[1], plains[found[1] :])
        table.file(index, len(plains), found[3], plain(response))


def test_a_message_the_walk_refuses_is_named_by_its_index() -> None:
    table = RequestTable()
    with pytest.raises(_core.RefusedValue) as refused:
        table.find_messages(_core.Packer(None, None), [{"a": 1}, {"b": {1, 2}}])
    assert refused.value.args[1] == "[1].b"
    assert len(table) == 0
    interning = _core.Packer(lambda text: text, 4)
    with pytest.raises(ValueError, match="without intern"):
        table.find_messages(interning, [{"a": "long string"}])
    # a message the plain packer takes specially (a tuple, a big int) is told by last_special
    packer = _core.Packer(None, None)
    table.find_messages(packer, [{"n": 10**30}])
    assert packer.last_special
    table.find_messages(packer, [{"n": 1}])
    assert not packer.last_special


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 3), max_size=12), st.booleans()),
        min_size=1,
        max_size=24,
    ),
    st.lists(st.integers(0, 3), max_size=14),
)
def test_the_base_is_the_longest_filed_prefix_whatever_the_boundaries(
    filed: list[tuple[list[int], bool]], request: list[int]
) -> None:
    """Against brute force: the longest filed request the request starts with, the first
    filed of twins, and the echo of its response; however many boundaries lie between the
    request's end and its base (the table digests the longest few first)."""
    table = RequestTable()
    rows: list[list[bytes]] = []
    for turn, (messages, has_response) in enumerate(filed):
        plains = [plain({"m": m}) for m in messages]
        response = plain({"m": 0}) if has_response else None
        table.file(turn, len(plains), prefix_digest(b"".join(plains)), response)
        rows.append(plains)
    plains = [plain({"m": m}) for m in request]
    prefixes = [t for t, row in enumerate(rows) if row == plains[: len(row)]]
    expected = max(prefixes, key=lambda t: (len(rows[t]), -t), default=None)
    base, base_len, echo, digest = table.find(plains)
    assert base == expected
    assert base_len == (len(rows[expected]) if expected is not None else 0)
    assert echo == (
        expected is not None
        and filed[expected][1]
        and base_len < len(plains)
        and plains[base_len] == plain({"m": 0})
    )
    assert digest == prefix_digest(b"".join(plains))


HOLE_MIN = 1024  # strings this long are a decoded tip's holes (by default)


def _with_long_strings(messages: list[Any]) -> list[Any]:
    """`messages` with each user message's content made long (a screenshot's size), fresh
    objects each call, as `json.loads` gives a re-sent request."""
    grown = [
        {**m, "content": m["content"] + "|" + "L" * HOLE_MIN} if m["role"] == "user" else m
        for m in messages
    ]
    return json.loads(json.dumps(grown))


@pytest.mark.parametrize("seed", range(3))
def test_requests_read_from_a_decoded_tip_find_what_their_packings_find(seed: int) -> None:
    """`add_messages` reads a request that re-sends its conversation's tip from the tip on
    (its long strings compared, not hashed) and names the base, echo and digest that `find`
    names for the request's packings, with the packings a stored tail holds."""
    table, reference, packer = RequestTable(), RequestTable(), _core.Packer(None, None)
    for index, (messages, response) in enumerate(_branching_rollouts(500 + seed, 60)):
        messages = _with_long_strings(messages)
        plains = [plain(m) for m in messages]
        expected = reference.find(plains)
        first, kept, found = table.add_messages(index, packer, messages, plain(response))
        assert found == expected, f"turn {index}"
        assert (first, kept) == (found[1], plains[found[1] :])
        reference.file(index, len(plains), expected[3], plain(response))
    assert table.decoded_tip_hits > 10 and 0 < table.decoded_tips <= 64
    assert len(table) == len(reference) == 60


def test_a_tip_is_taken_only_when_its_long_strings_and_the_rest_are_the_requests() -> None:
    table, packer = RequestTable(), _core.Packer(None, None)
    screen = "a" * HOLE_MIN
    response = {"role": "assistant", "content": "seen"}
    table.add_messages(0, packer, [{"role": "user", "content": screen}], plain(response))
    assert (table.decoded_tips, table.decoded_tip_hits) == (1, 0)
    later = {"role": "user", "content": "next"}
    # the same length, one character apart: no base, and the tip not taken
    other = screen[:-1] + "b"
    found = table.add_messages(1, packer, [{"role": "user", "content": other}, response, later])
    assert found[2][0] is None and table.decoded_tip_hits == 0
    # the same long string, another short field: not taken either
    found = table.add_messages(2, packer, [{"role": "system!", "content": screen}, response])
    assert found[2][0] is None and table.decoded_tip_hits == 0
    # the very request re-sent (a fresh string): taken, its base turn 0, the echo after it
    resent = [{"role": "user", "content": "".join(["a"] * HOLE_MIN)}, response, later]
    first, kept, (base, base_len, echo, _) = table.add_messages(3, packer, resent)
    assert (base, base_len, echo, first) == (0, 1, True, 1)
    assert kept == [plain(response), plain(later)]
    assert table.decoded_tip_hits == 1
    # shorter strings make no tip, unless the table's holes are shorter
    for table, tips in ((RequestTable(), 0), (RequestTable(hole_min=HOLE_MIN - 1), 1)):
        table.add_messages(0, packer, [{"role": "user", "content": "a" * (HOLE_MIN - 1)}])
        assert table.decoded_tips == tips


_LONGS = ["a" * HOLE_MIN, "a" * (HOLE_MIN - 1) + "b", "\U0001f600" * HOLE_MIN, "\ud800" * HOLE_MIN]


def _message(kind: int, long: int, key_order: bool) -> dict[str, Any]:
    """A message of one of a few shapes, holding one of a few long strings (some equal in
    length, one with a lone surrogate) or a short one."""
    content: Any = _LONGS[long] if long < len(_LONGS) else f"short {long}"
    if kind == 1:
        content = [{"type": "text", "text": "look"}, {"type": "image", "data": content}]
    message = {"role": "user", "content": content}
    return dict(reversed(message.items())) if key_order else message


@settings(max_examples=120, deadline=None)
@given(
    st.lists(
        st.lists(
            st.tuples(st.integers(0, 1), st.integers(0, len(_LONGS)), st.booleans()),
            min_size=1,
            max_size=4,
        ),
        min_size=1,
        max_size=8,
    ),
    st.data(),
)
def test_decoded_tips_never_stand_for_a_request_they_are_not(
    steps: list[list[tuple[int, int, bool]]], data: Any
) -> None:
    """Conversations that grow, re-send their tips with a long string swapped for another of
    the same length, a key order changed, a shape changed: `add_messages` names what `find`
    names for the packings, whatever the tips."""
    table, reference, packer = RequestTable(), RequestTable(), _core.Packer(None, None)
    sent: list[list[Any]] = []
    for index, step in enumerate(steps):
        start: list[Any] = []
        if sent and data.draw(st.booleans()):
            start = list(data.draw(st.sampled_from(sent)))
            if start and data.draw(st.booleans()):  # one earlier message changed
                at = data.draw(st.integers(0, len(start) - 1))
                start[at] = _message(
                    *data.draw(
                        st.tuples(*[st.integers(0, 1), st.integers(0, len(_LONGS)), st.booleans()])
                    )
                )
        messages = json.loads(json.dumps(start + [_message(*m) for m in step]))
        plains = [plain(m) for m in messages]
        expected = reference.find(plains)
        first, kept, found = table.add_messages(index, packer, messages, plain({"r": index}))
        assert found == expected and (first, kept) == (found[1], plains[found[1] :])
        reference.file(index, len(plains), expected[3], plain({"r": index}))
        sent.append(messages)


_WHILE_A_LONG_REQUEST_IS_ADDED = """
import threading
from rollout_store import _core

table, packer = _core.RequestTable(), _core.Packer(None, None)
long = [{"role": "user", "content": "x" * (2 << 20)}]  # hashed with the GIL released
done = threading.Event()

def add():
    try:
        for turn in range(8):
            table.add_messages(turn, packer, [*long, {"role": "user", "content": str(turn)}])
    finally:
        done.set()

worker = threading.Thread(target=add)
worker.start()
while not done.is_set():
    len(table)  # takes the table's lock holding the GIL
worker.join()
assert len(table) == 8
"""


def test_the_table_is_used_by_another_thread_while_a_long_request_is_added() -> None:
    """`add_messages` releases the GIL to hash a long request: it must not hold the table's
    lock then, or a thread holding the GIL waits for the lock while the lock's holder waits
    for the GIL. Run apart: a deadlock would hang the test run itself."""
    try:
        subprocess.run(
            [sys.executable, "-c", _WHILE_A_LONG_REQUEST_IS_ADDED], check=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        pytest.fail("deadlock: add_messages held the table's lock with the GIL released")


def test_a_tip_is_not_kept_from_a_walk_whose_answers_may_change() -> None:
    """A dict subclass is read through its own `items()`, Python code that may answer the
    plain walk (what is hashed and filed) and the hollow walk (what a later request is
    compared with) differently: a tip kept from such walks could give a later request,
    compared with one answer, the packings of the other."""
    screen = "L" * HOLE_MIN

    class Flip(dict):  # type: ignore[type-arg]
        calls = 0

        def items(self) -> Any:
            Flip.calls += 1
            return [("content", screen), ("role", "user" if Flip.calls % 2 else "tool")]

    table, packer = RequestTable(), _core.Packer(None, None)
    answer = {"role": "assistant", "content": "seen"}
    table.add_messages(0, packer, [Flip(), answer])
    resent = [{"content": screen, "role": "tool"}, answer, {"role": "user", "content": "x"}]
    _, _, found = table.add_messages(1, packer, resent)
    assert found == RequestTable().find([plain(m) for m in resent])


def test_a_tip_is_not_taken_from_a_walk_that_ran_a_subclasss_code() -> None:
    """A re-sent request is confirmed against a tip by a hollow walk; a dict subclass is read
    through its own `items()`, which may answer the plain walk otherwise: such a walk
    confirms nothing, and the request is packed and found whole."""
    table, packer = RequestTable(), _core.Packer(None, None)
    long = "x" * HOLE_MIN
    said = {"role": "assistant", "content": "a"}
    response = {"role": "assistant", "content": "ok"}
    table.add_messages(0, packer, [{"role": "user", "content": long}, said], plain(response))
    assert table.decoded_tips == 1

    class FirstUser(dict[str, Any]):
        """Says it is the user's message the first time it is read, a tool's after."""

        def __init__(self) -> None:
            super().__init__(role="user", content=long)
            self.reads = 0

        def items(self) -> Any:
            self.reads += 1
            return [("role", "user" if self.reads == 1 else "tool"), ("content", long)]

    message = FirstUser()
    found = table.find_messages(packer, [message, said, response, {"role": "user"}])
    assert message.reads >= 2 and found[2][0] is None and table.decoded_tip_hits == 0


def test_decoded_messages_under_an_unconfirmed_turn_are_neither_found_nor_filed() -> None:
    """`find_messages` and `add_messages` raise `Unconfirmed` as `find` does; `add_messages`
    then files nothing and keeps no tip, even for a request that would leave one."""
    first = {"role": "user", "content": "s" * HOLE_MIN}
    messages = [first, {"role": "assistant", "content": "yo"}]
    table, packer = RequestTable(), _core.Packer(None, None)
    table.file_key(3, 1, prefix_keys([plain(first)])[1], plain({"role": "assistant"}))
    for call in (
        lambda: table.find_messages(packer, messages),
        lambda: table.add_messages(4, packer, messages),
    ):
        with pytest.raises(_core.Unconfirmed) as undecided:
            call()
        assert undecided.value.args[1:] == (3, 1, prefix_digest(plain(first)))
    assert (len(table), table.decoded_tips, table.unconfirmed) == (1, 0, 1)
    first_, _, found = table.add_messages(4, packer, messages, refuted=[3])
    assert (first_, found[0], len(table), table.decoded_tips) == (0, None, 2, 1)


def test_an_empty_table_holds_no_heap() -> None:
    """`nbytes` is the heap a table holds (what tracemalloc does not see), not its own fields,
    which are inside its Python object (what it does see): counting them too counted them
    twice, about 200 bytes a graph."""
    table = RequestTable()
    assert table.nbytes == 0
    packer = _core.Packer(None, None)
    table.add_messages(0, packer, [{"role": "user", "content": "hi"}])
    assert table.nbytes > 0

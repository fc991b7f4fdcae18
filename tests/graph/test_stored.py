"""The compact stored turn: default ids kept as no string, a single child held bare, the link
in the flags, tail + digest + key + message count in one bytes object, one side (scalars,
shared values, token fields) for all turns alike; all behave as before."""

from __future__ import annotations

from array import array
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import FUZZ, chat_turns, token_turns

from rollout_store import (
    DuplicateNodeError,
    RolloutGraph,
    RolloutStoreError,
    TurnNode,
    UnknownNodeError,
)


def _turns(graph: RolloutGraph) -> list:
    return graph._turns  # the stored turns, to check how they are kept


def test_default_ids_are_derived_and_found() -> None:
    graph = RolloutGraph()
    for fields in chat_turns(3):
        graph.add_turn(TurnNode(**fields))
    assert graph.node_ids() == ["turn-0", "turn-1", "turn-2"]
    assert [t.ident for t in _turns(graph)] == [None, None, None]
    assert graph.get("turn-2").parent_id == "turn-1"
    assert "turn-1" in graph and "turn-3" not in graph
    # only the canonical spelling of a default id names the turn
    for other in ("turn-01", "turn-+1", "turn- 1", "turn-\u0661", "turn-1.0", "Turn-1", 1):
        assert other not in graph
        with pytest.raises(UnknownNodeError):
            graph.get(other)  # type: ignore[arg-type]


def test_chosen_ids_that_look_like_default_ones_stay_apart() -> None:
    graph = RolloutGraph()
    turns = chat_turns(4)
    graph.add_turn(TurnNode(node_id="turn-1", **turns[0]))  # index 1's default id
    graph.add_turn(TurnNode(**turns[1]))  # index 1: its default id is taken
    with pytest.raises(DuplicateNodeError):  # the id index 1 got instead
        graph.add_turn(TurnNode(node_id="turn-2", **turns[2]))
    graph.add_turn(TurnNode(node_id="turn-3", **turns[2]))  # index 2
    graph.add_turn(TurnNode(node_id="turn-3x", **turns[3]))
    ids = graph.node_ids()
    assert ids == ["turn-1", "turn-2", "turn-3", "turn-3x"]
    assert [graph.get(n).index for n in ids] == [0, 1, 2, 3]
    assert [graph.parent(n) for n in ids] == [None, *ids[:-1]]
    assert [t.ident for t in _turns(graph)] == ["turn-1", "turn-2", "turn-3", "turn-3x"]
    assert graph.add_turn(TurnNode(**turns[0])).node_id == "turn-4"  # its default again
    assert _turns(graph)[4].ident is None
    for taken in ids:
        with pytest.raises(DuplicateNodeError):
            graph.add_turn(TurnNode(node_id=taken, **turns[0]))
    assert len(graph) == 5


def test_default_id_of_an_existing_turn_is_a_duplicate() -> None:
    graph = RolloutGraph()
    turns = chat_turns(2)
    graph.add_turn(TurnNode(**turns[0]))
    with pytest.raises(DuplicateNodeError):
        graph.add_turn(TurnNode(node_id="turn-0", **turns[1]))
    assert graph.node_ids() == ["turn-0"]
    node = graph.add_turn(TurnNode(parent_id="turn-0", **turns[1]))
    assert node.parent_id == "turn-0" and graph.link_kind(node.node_id) == "explicit"


def test_ids_survive_a_file(tmp_path) -> None:
    graph = RolloutGraph()
    turns = chat_turns(4)
    graph.add_turn(TurnNode(node_id="turn-1", **turns[0]))
    for fields in turns[1:]:
        graph.add_turn(TurnNode(**fields))
    path = tmp_path / "g.rollout"
    graph.save(path)
    back = RolloutGraph.load(path)
    assert back.node_ids() == graph.node_ids()
    assert [back.parent(n) for n in back.node_ids()] == [graph.parent(n) for n in graph.node_ids()]
    assert [t.ident for t in _turns(back)] == [t.ident for t in _turns(graph)]


def test_children_one_bare_several_as_a_tuple() -> None:
    graph = RolloutGraph()
    turns = chat_turns(2)
    root = graph.add_turn(TurnNode(**turns[0]))
    first = graph.add_turn(TurnNode(**turns[1]))
    stored = _turns(graph)
    assert stored[0].kids is stored[1] and stored[0].children == (stored[1],)
    assert stored[1].kids is None and stored[1].children is None
    second = graph.add_turn(TurnNode(**turns[1]))  # a retry: a sibling
    assert stored[0].children == (stored[1], stored[2])
    assert graph.child_ids(root.node_id) == [first.node_id, second.node_id]
    assert graph.forks() == [(root.node_id, [first.node_id, second.node_id])]


def test_turns_alike_share_one_side_and_token_turns_keep_their_own_tokens() -> None:
    graph = RolloutGraph()
    tools = [{"type": "function", "function": {"name": "f"}}]
    for fields in chat_turns(3):
        graph.add_turn(TurnNode(request_tools=tools, sampling_params={"t": 1}, **fields))
    stored = _turns(graph)
    # sampled_ids=[] by default: its empty segment is as good as any other
    assert stored[0].side is not None and stored[0].side.shared
    assert all(t.side is stored[0].side and t.prompt is None for t in stored)
    assert len(stored[0].sampled) == 0
    assert graph.get("turn-2").sampled_ids == [] and graph.get("turn-2").prompt_ids == []
    assert graph.get("turn-2").request_tools == tools
    assert graph.get("turn-2").sampling_params == {"t": 1}
    other = graph.add_turn(TurnNode(model="another", **chat_turns(1, tag="x")[0]))
    assert _turns(graph)[3].side is not stored[0].side  # other scalars: a side of its own
    assert graph.get(other.node_id).model == "another" and graph.get("turn-2").model is None

    tokens = RolloutGraph()
    fields = token_turns(4)
    for turn_fields in fields:
        tokens.add_turn(TurnNode(**turn_fields))
    stored = _turns(tokens)
    # continuations keep their packed token ids in the turn: alike otherwise, one side
    assert all(t.prompt is t for t in stored[1:]) and stored[1].side.shared
    assert all(t.side is stored[1].side for t in stored[1:])
    for k, turn_fields in enumerate(fields):
        got = tokens.get(f"turn-{k}")
        assert got.prompt_ids == turn_fields["prompt_ids"]
        assert got.sampled_ids == turn_fields["sampled_ids"]
        assert got.sampled_logprobs == turn_fields["sampled_logprobs"]
    # a change to one turn's tokens is its own: its side is copied, the others keep theirs
    changed = [-0.5] * len(fields[2]["sampled_ids"])
    stored[2].logprobs = array("d", changed)
    assert stored[2].side is not stored[1].side and not stored[2].side.shared
    assert tokens.get("turn-2").sampled_logprobs == changed
    assert tokens.get("turn-2").sampled_ids == fields[2]["sampled_ids"]
    assert tokens.get("turn-2").prompt_ids == fields[2]["prompt_ids"]
    assert stored[3].side is stored[1].side and stored[3].prompt is stored[3]
    assert tokens.get("turn-3").sampled_ids == fields[3]["sampled_ids"]
    assert tokens.get("turn-1").sampled_logprobs == fields[1]["sampled_logprobs"]


def test_a_shared_side_is_copied_before_a_change() -> None:
    from rollout_store.engine.stored import Turn, TurnSide

    side = TurnSide()
    side.system, side.shared = b"\x90", True  # as the graph interns it
    first, second = Turn(), Turn()
    first.side = second.side = side
    second.tools = b"\x91\x01"  # a change to one turn: its side is copied first
    assert first.side is side and second.side is not side and not second.side.shared
    assert (first.system, first.tools) == (b"\x90", None)
    assert (second.system, second.tools) == (b"\x90", b"\x91\x01")
    third = Turn()  # a new turn has a side of its own until the graph finds one alike
    assert not third.side.shared and third.prompt is None and third.meta is None


def test_request_tail_digest_key_and_count_in_one_bytes_object() -> None:
    from rollout_store.engine.confirm import digest_key
    from rollout_store.engine.stored import Turn, TurnFlag

    turn = Turn()
    turn.index, turn.flags = 0, 0
    turn.set_request((b"\x92", b"ab"), 700)
    assert (turn.tail, turn.n_rest, turn.digest, turn.rkey) == (b"\x92ab", 700, None, None)
    turn.rkey = 2**64 - 1  # a key from a file, before the digest is known
    assert (turn.tail, turn.n_rest, turn.rkey) == (b"\x92ab", 700, 2**64 - 1)
    digest = bytes(range(32))
    turn.digest = digest  # another key than the digest's: kept beside it
    assert (turn.tail, turn.digest, turn.rkey, turn.n_rest) == (b"\x92ab", digest, 2**64 - 1, 700)
    assert turn.flags & TurnFlag.HAS_KEY
    turn.rkey = digest_key(digest)  # the digest's own key: not kept twice
    assert not turn.flags & TurnFlag.HAS_KEY and turn.rkey == digest_key(digest)
    assert len(turn.data) == 3 + 32 + 4
    turn.tail = b"\x91c"
    turn.n_rest = 3
    assert (turn.tail, turn.digest, turn.n_rest) == (b"\x91c", digest, 3)
    turn.digest = None  # the key it is filed under stays
    assert (turn.tail, turn.digest, turn.rkey, turn.n_rest) == (
        b"\x91c",
        None,
        digest_key(digest),
        3,
    )
    turn.rkey = None
    assert (turn.tail, turn.rkey, turn.data) == (b"\x91c", None, b"\x91c\x03\x00\x00\x00")
    for bad in (-1, 2**32):
        with pytest.raises(RolloutStoreError):
            turn.n_rest = bad
    with pytest.raises(RolloutStoreError):
        turn.rkey = 2**64
    with pytest.raises(RolloutStoreError):
        turn.digest = b"short"
    assert (turn.tail, turn.n_rest) == (b"\x91c", 3)  # a refused value changes nothing


def test_one_builder_sets_every_part_at_once() -> None:
    from rollout_store.engine.confirm import digest_key
    from rollout_store.engine.stored import Turn, TurnFlag

    digest = bytes(range(2, 34))
    cases = [  # tail parts, n_rest, response, digest, key -> what rkey reads
        ((b"\x92", b"a", b"b"), 2, b"\x81\xa1r\xa1s", digest, digest_key(digest)),
        ((b"\x91c",), 2**32 - 1, None, digest, 7),  # a key the digest does not give
        ((b"\x90",), 0, b"", None, 2**64 - 1),  # a file's key, digest not yet known
        ((), 0, None, None, None),
    ]
    for parts, n_rest, response, dig, key in cases:
        turn = Turn()
        turn.index, turn.flags = 0, TurnFlag.TAIL_ECHO
        turn.set_request((b"\x91old",), 9)  # whatever it held before is replaced
        turn.response = b"\xa3old"
        turn.build(parts, n_rest, response, dig, key)
        got = (turn.tail, turn.n_rest, turn.response, turn.digest, turn.rkey)
        assert got == (b"".join(parts), n_rest, response, dig, key)
        assert turn.flags & TurnFlag.TAIL_ECHO  # other flags untouched
        own_key = key is not None and (dig is None or key != digest_key(dig))
        assert bool(turn.flags & TurnFlag.HAS_KEY) == own_key  # the digest's key: not twice
    turn = Turn()
    turn.index, turn.flags = 0, 0
    turn.build((b"\x91a",), 1, b"\xa1r", digest, digest_key(digest))
    assert turn.data == b"\x91a" + b"\xa1r" + digest + (2).to_bytes(4, "little") + bytes(
        (1, 0, 0, 0)
    )
    before = (turn.data, turn.flags)
    for bad in (
        lambda: turn.build((b"",), 2**32, None, None, None),
        lambda: turn.build((b"",), 0, None, b"short", None),
        lambda: turn.build((b"",), 0, None, None, 2**64),
    ):
        with pytest.raises(RolloutStoreError):
            bad()
        assert (turn.data, turn.flags) == before  # a refused part changes nothing


def test_add_turn_and_load_build_each_turn_once(tmp_path: Path, monkeypatch) -> None:
    """add_turn and a file's reader set a turn's bytes once (`Turn.build`), with the digest
    and key it is filed under: no setter rebuilds them afterwards."""
    from rollout_store.engine.stored import Turn

    builds: list[int] = []
    original = Turn._store

    def counting(self, *args):  # type: ignore[no-untyped-def]
        builds.append(id(self))
        return original(self, *args)

    graph = RolloutGraph()
    path = tmp_path / "g.rls"
    monkeypatch.setattr(Turn, "_store", counting)
    for fields in chat_turns(4):
        graph.add_turn(TurnNode(**fields))
    assert len(builds) == 4 and len(set(builds)) == 4
    filed = graph._requests.table  # (the digest is the request table's, the key the turn's)
    assert all(filed.digest(t.index) is not None and t.rkey is not None for t in _turns(graph))
    monkeypatch.setattr(Turn, "_store", original)
    graph.save(path)
    monkeypatch.setattr(Turn, "_store", counting)
    builds.clear()
    back = RolloutGraph.load(path)
    assert len(builds) == 4 and len(set(builds)) == 4
    assert [t.rkey for t in _turns(back)] == [t.rkey for t in _turns(graph)]
    assert [t.response for t in _turns(back)] == [t.response for t in _turns(graph)]


def test_the_link_is_kept_in_the_flags() -> None:
    from rollout_store.engine.stored import LinkKind, Turn, TurnFlag

    turn = Turn()
    turn.flags = TurnFlag.TAIL_ECHO
    for kind in (LinkKind.EXPLICIT, LinkKind.MESSAGES, LinkKind.TOKENS, LinkKind.NONE):
        turn.link = kind
        assert turn.link is kind and turn.flags & ~(TurnFlag.LINK_LOW | TurnFlag.LINK_HIGH) == 32


def test_loaded_turns_are_found_again_by_their_file_keys(tmp_path: Path) -> None:
    graph = RolloutGraph()
    turns = chat_turns(4)
    for fields in turns[:3]:
        graph.add_turn(TurnNode(**fields))
    path = tmp_path / "g.rls"
    graph.save(path)
    back = RolloutGraph.load(path)
    loaded = _turns(back)
    assert all(t.digest is None and t.rkey is not None for t in loaded)
    assert [t.rkey for t in loaded] == [t.rkey for t in _turns(graph)]
    node = back.add_turn(TurnNode(**turns[3]))  # continues the loaded conversation
    assert node.parent_id == "turn-2" and back.link_kind(node.node_id) == "messages"
    assert loaded[2].digest == _turns(graph)[2].digest  # confirmed by bytes, then known
    assert loaded[2].rkey == _turns(graph)[2].rkey


def test_the_response_is_kept_in_the_request_bytes() -> None:
    from rollout_store.engine.confirm import digest_key
    from rollout_store.engine.stored import Turn, TurnFlag

    turn = Turn()
    turn.index, turn.flags = 0, 0
    assert turn.response is None
    turn.set_request((b"\x91", b"a"), 300)
    turn.response = b"\x81\xa1r\xa1s"
    digest = bytes(range(1, 33))
    turn.file_under(7, digest)  # a key the digest does not give: kept too
    assert (turn.tail, turn.response, turn.digest, turn.rkey, turn.n_rest) == (
        b"\x91a",
        b"\x81\xa1r\xa1s",
        digest,
        7,
        300,
    )
    assert len(turn.data) == 2 + 5 + 32 + 8 + 4 + 4
    turn.set_request((b"\x92ab",), 5)  # a new request: the response stays, digest and key go
    assert (turn.tail, turn.response, turn.digest, turn.rkey, turn.n_rest) == (
        b"\x92ab",
        b"\x81\xa1r\xa1s",
        None,
        None,
        5,
    )
    turn.file_under(digest_key(digest), digest)
    turn.response = b""  # an empty packing is a response, not None
    assert (turn.response, turn.digest, turn.rkey) == (b"", digest, digest_key(digest))
    turn.response = None
    assert turn.response is None and not turn.flags & TurnFlag.HAS_RESPONSE
    assert (turn.tail, turn.digest, turn.n_rest) == (b"\x92ab", digest, 5)


_DIGESTS = st.binary(min_size=32, max_size=32)
_CHANGES = st.lists(
    st.one_of(
        st.tuples(st.just("request"), st.binary(max_size=40), st.integers(0, 2**32 - 1)),
        st.tuples(st.just("tail"), st.binary(max_size=40)),
        st.tuples(st.just("n_rest"), st.integers(0, 2**32 - 1)),
        st.tuples(st.just("response"), st.none() | st.binary(max_size=40)),
        st.tuples(st.just("digest"), st.none() | _DIGESTS),
        st.tuples(st.just("rkey"), st.none() | st.integers(0, 2**64 - 1)),
        st.tuples(st.just("file"), st.none() | st.integers(0, 2**64 - 1), st.none() | _DIGESTS),
        st.tuples(
            st.just("build"),
            st.lists(st.binary(max_size=20), max_size=3),
            st.integers(0, 2**32 - 1),
            st.none() | st.binary(max_size=40),
            st.none() | _DIGESTS,
            st.none() | st.integers(0, 2**64 - 1),
        ),
    ),
    max_size=12,
)


@given(_CHANGES, st.sampled_from([0, 32, 64 | 32, 256]))
@settings(FUZZ)
def test_request_bytes_agree_with_separate_fields(changes: list, other_flags: int) -> None:
    """Any order of changes reads back as if tail, n_rest, response, digest and key were
    fields of their own (the key of a turn with a digest and no key of its own is the
    digest's; set_request drops digest and key; other flags never change)."""
    from rollout_store.engine.confirm import digest_key
    from rollout_store.engine.stored import Turn, TurnFlag

    turn = Turn()
    turn.index, turn.flags = 0, other_flags
    model: dict = {"tail": b"", "n_rest": 0, "response": None, "digest": None, "key": None}
    for change in changes:
        kind = change[0]
        if kind == "request":
            turn.set_request((change[1],), change[2])
            model.update(tail=change[1], n_rest=change[2], digest=None, key=None)
        elif kind == "build":
            _, parts, n_rest, response, digest, key = change
            turn.build(parts, n_rest, response, digest, key)
            model.update(
                tail=b"".join(parts), n_rest=n_rest, response=response, digest=digest, key=key
            )
        elif kind == "file":
            turn.file_under(change[1], change[2])
            model.update(key=change[1], digest=change[2])
        elif kind == "rkey":
            turn.rkey = change[1]
            model["key"] = change[1]
        elif kind == "digest":
            if model["key"] is None and model["digest"] is not None:
                model["key"] = digest_key(model["digest"])  # filed under it: the key stays
            turn.digest = change[1]
            model["digest"] = change[1]
        else:
            setattr(turn, kind, change[1])
            model[kind] = change[1]
        key = model["key"]
        if key is None and model["digest"] is not None:
            key = digest_key(model["digest"])
        got = (turn.tail, turn.n_rest, turn.response, turn.digest, turn.rkey)
        assert got == (model["tail"], model["n_rest"], model["response"], model["digest"], key)
        in_memory = TurnFlag.HAS_DIGEST | TurnFlag.HAS_KEY | TurnFlag.HAS_RESPONSE
        assert turn.flags & ~in_memory == other_flags

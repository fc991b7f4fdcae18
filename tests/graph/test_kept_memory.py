"""What a graph keeps between turns, beyond its content: no packers, and no index of token
roots until a lookup has a root to find (a late ancestor still finds every root that waits
for it)."""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import pytest

from rollout_store import RawJSON, RolloutGraph, TurnNode
from rollout_store.engine import linking
from rollout_store.serve.sessions import Sessions


def _prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def test_one_rollout_keeps_no_index_of_its_root() -> None:
    graph = RolloutGraph()
    prompt = _prompt(200)
    for step in range(5):
        sampled = [7 + step, 8 + step]
        graph.add_turn(TurnNode(prompt_ids=prompt, sampled_ids=sampled))
        prompt = [*prompt, *sampled, *_prompt(30, 5000 + 100 * step)]
    assert len(graph.root_ids()) == 1
    assert graph._linker.token_roots is None


def test_late_ancestors_find_roots_committed_before_the_index() -> None:
    """Two continuations arrive before their ancestors (long and short prompts): the first
    is committed before any index exists, the second is filed in the index its own lookup
    built; each ancestor finds its waiting root."""
    graph = RolloutGraph()
    long_head, short_head = _prompt(150), [5, 6, 7, 8, 9, 10]
    late_long = graph.add_turn(TurnNode(prompt_ids=[*long_head, 1, 2, 3, 4], sampled_ids=[9]))
    assert graph._linker.token_roots is None  # a root, but no lookup needed the index yet
    # a second root looks for roots it continues: the index is built, with the first
    late_short = graph.add_turn(TurnNode(prompt_ids=[*short_head, 11, 12, 13], sampled_ids=[1]))
    assert graph._linker.token_roots is not None
    first_long = graph.add_turn(TurnNode(prompt_ids=long_head[:-2], sampled_ids=long_head[-2:]))
    assert graph.parent(late_long.node_id) == first_long.node_id
    first_short = graph.add_turn(TurnNode(prompt_ids=short_head, sampled_ids=[11, 12]))
    assert graph.parent(late_short.node_id) == first_short.node_id
    assert sorted(graph.root_ids()) == sorted([first_long.node_id, first_short.node_id])


def test_an_index_build_cut_short_is_built_again(monkeypatch: Any, tmp_path: Path) -> None:
    """A turn whose lookup fails while the index of roots is being built (here: an error
    from the second root's keys) leaves no index of some roots only: the next lookup builds
    it whole, and an ancestor still finds the root that waits for it."""
    saved = RolloutGraph()
    head_a, head_b = _prompt(80), _prompt(80, 3000)
    saved.add_turn(TurnNode(node_id="a", prompt_ids=[*head_a, 1, 2], sampled_ids=[9]))
    saved.add_turn(TurnNode(node_id="b", prompt_ids=[*head_b, 4, 5], sampled_ids=[9]))
    saved.save(tmp_path / "g.rls")
    graph = RolloutGraph.load(tmp_path / "g.rls")  # two roots, no index of them yet
    assert graph._linker.token_roots is None
    calls = []
    real = linking.root_token_keys

    def failing(prompt: Any) -> list[int]:
        calls.append(prompt)
        if len(calls) == 2:
            raise RuntimeError("cut short")
        return real(prompt)

    monkeypatch.setattr(linking, "root_token_keys", failing)
    with pytest.raises(RuntimeError):
        graph.add_turn(TurnNode(node_id="x", prompt_ids=_prompt(90, 7000), sampled_ids=[1]))
    monkeypatch.setattr(linking, "root_token_keys", real)
    graph.add_turn(TurnNode(node_id="b0", prompt_ids=head_b, sampled_ids=[4, 5]))
    assert graph.parent("b") == "b0"
    graph.add_turn(TurnNode(node_id="a0", prompt_ids=head_a, sampled_ids=[1, 2]))
    assert graph.parent("a") == "a0"


def test_a_graph_loaded_from_a_file_finds_its_waiting_root(tmp_path: Path) -> None:
    graph = RolloutGraph()
    head = _prompt(100)
    late = graph.add_turn(TurnNode(prompt_ids=[*head, 1, 2], sampled_ids=[3]))
    graph.save(tmp_path / "g.rls")
    loaded = RolloutGraph.load(tmp_path / "g.rls")
    first = loaded.add_turn(TurnNode(prompt_ids=head, sampled_ids=[1, 2]))
    assert loaded.parent(late.node_id) == first.node_id


def test_no_packer_is_kept_between_turns() -> None:
    graph = RolloutGraph()
    history: list[Any] = [{"role": "system", "content": "s" * 3000}]
    for i in range(3):
        history = [*history, {"role": "user", "content": f"q{i} " + "x" * 2000}]
        for messages in (history, RawJSON(json.dumps(history).encode())):
            graph.add_turn(
                TurnNode(
                    request_messages=messages,
                    response_message={"role": "assistant", "content": f"a{i}"},
                    request_tools=[{"type": "function", "function": {"name": "f"}}],
                )
            )
            requests = graph._requests
            assert requests._plain_packer is None
            assert requests._encoder._packer is None
        history = [*history, {"role": "assistant", "content": f"a{i}"}]
    assert graph.request_messages(graph.leaf_ids()[-1]) == history[:-1]


def test_graphs_of_one_server_keep_one_copy_of_a_tools_text() -> None:
    """Sessions over one memory store and cache remember the tool list every call re-sends
    as one object; each graph still exports exactly what it was sent."""
    sessions = Sessions()
    tools = [{"type": "function", "function": {"name": f"tool{i}"}} for i in range(5)]
    graphs = [sessions.create().graph for _ in range(3)]
    for n, graph in enumerate(graphs):
        history: list[Any] = [{"role": "user", "content": f"task {n}"}]
        for i in range(3):
            graph.add_turn(
                TurnNode(
                    request_messages=RawJSON(json.dumps(history).encode()),
                    request_tools=RawJSON(json.dumps(tools).encode()),
                    response_message={"role": "assistant", "content": f"a{i}"},
                )
            )
            history = [*history, {"role": "assistant", "content": f"a{i}"}]
            history = [*history, {"role": "user", "content": f"q{i}"}]
    texts = [next(iter(graph._requests.raw_shared)) for graph in graphs]
    assert texts[0] == json.dumps(tools).encode()
    assert all(text is texts[0] for text in texts)
    for graph in graphs:
        assert all(graph.request_tools(node) == tools for node in graph.node_ids())
    private = RolloutGraph()  # a graph of its own keeps the text it was given
    copy = bytes(bytearray(texts[0]))
    for _ in range(2):
        private.add_turn(TurnNode(request_messages=[], request_tools=RawJSON(copy)))
    assert next(iter(private._requests.raw_shared)) is copy


def test_token_runs_compare_by_identity() -> None:
    """A file writer keys runs by the objects themselves (no int per turn): equal tokens in
    two runs must stay two keys."""
    from rollout_store.engine.tokens import ArrayRun, PackedFull, PackedPrompt, TokenRun

    for kind in (TokenRun, ArrayRun, PackedPrompt):
        assert kind.__eq__ is object.__eq__ and kind.__hash__ is object.__hash__
    a, b = ArrayRun(None, array("I", [1, 2])), ArrayRun(None, array("I", [1, 2]))
    assert len({a: 0, b: 1}) == 2
    # a packed prompt's full run is a view made when asked for: views over one prompt are
    # one key, views over two prompts of equal tokens two
    ids, none = array("I", [3, 4]), array("I")
    p, q = PackedPrompt(a, ids, none, None), PackedPrompt(a, ids, none, None)
    assert PackedFull(p) == PackedFull(p) and hash(PackedFull(p)) == hash(PackedFull(p))
    assert len({PackedFull(p): 0, PackedFull(q): 1, PackedFull(p): 2}) == 2
    assert PackedFull(p) != p


def test_one_or_many_index_matches_lists_of_items() -> None:
    """Random adds and removes against a dict of lists: the same members in the same order,
    one item bare, a few as an exact tuple, more than SMALL as a list."""
    import random

    from rollout_store.engine.index import SMALL, index_add, index_members, index_remove

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    items = [object() for _ in range(40)]
    index: dict[int, Any] = {}
    reference: dict[int, list[object]] = {}
    for _ in range(3000):
        key = rng.randrange(4)
        members = reference.setdefault(key, [])
        if len(members) == len(items) or (members and rng.random() < 0.45):
            item = rng.choice(members)
            members.remove(item)
            index_remove(index, key, item)
        else:
            item = rng.choice([i for i in items if i not in members])
            members.append(item)
            index_add(index, key, item)
        index_remove(index, key, object())  # an item not there changes nothing
        for k, expected in reference.items():
            found = index.get(k)
            assert list(index_members(found)) == expected, seed
            if not expected:
                assert found is None, seed
            elif len(expected) == 1:
                assert found is expected[0], seed
            elif type(found) is tuple:
                assert len(found) <= SMALL, seed
            else:
                assert type(found) is list, seed
    many: dict[int, Any] = {}
    for item in items[: SMALL + 2]:
        index_add(many, 0, item)
    assert type(many[0]) is list and many[0] == items[: SMALL + 2]
    small: dict[int, Any] = {}
    index_add(small, 0, items[0])
    index_add(small, 0, items[1])
    assert small[0] == (items[0], items[1])


def test_a_value_table_keeps_values_whose_digests_collide(monkeypatch: Any) -> None:
    """A long value is kept bare under its digest; values whose digests collide are all
    found, each confirmed by its bytes."""
    import types

    from rollout_store.engine import values

    monkeypatch.setattr(values, "xxhash", types.SimpleNamespace(xxh3_128_intdigest=lambda data: 0))
    table = values.ValueTable(lambda stored: stored, None)
    long_values = [bytes([65 + i]) * 2000 for i in range(3)]
    table.add(long_values[0], long_values[0])
    assert table._found[0] is long_values[0]  # one value: bare, no list
    for value in long_values[1:]:
        assert table.find(value) is None
        table.add(value, value)
    assert len(table) == 3
    assert all(table.find(bytes(bytearray(v))) is v for v in long_values)
    assert table.find(b"D" * 2000) is None


def test_an_appending_graph_keeps_no_file_buffer(tmp_path: Path) -> None:
    """The log is read whole once and written with os.write: its file is unbuffered, and
    what was appended is read back after a reopen."""
    import io

    path = tmp_path / "a.rls"
    graph = RolloutGraph.open(path)
    assert type(graph._journal.fp) is io.FileIO
    messages: list[Any] = [{"role": "user", "content": "hi " * 3000}]
    graph.add_turn(TurnNode(request_messages=messages, prompt_ids=[1, 2], sampled_ids=[3]))
    graph.close()
    again = RolloutGraph.open(path)
    assert type(again._journal.fp) is io.FileIO
    assert len(again) == 1 and again.request_messages("turn-0") == messages
    again.add_turn(TurnNode(request_messages=[*messages, {"role": "user", "content": "more"}]))
    again.close()
    assert len(RolloutGraph.load(path)) == 2


def test_a_log_names_packed_prompts_without_keeping_their_fulls(tmp_path: Path) -> None:
    """A log's writer finds the turn whose packed full run a continuation extends through
    the prompt that turn packed: it keeps no entry for it, and the log still stores each
    turn's new tokens only (a long shared prompt is written once)."""
    from rollout_store.engine.tokens import PackedFull

    path = tmp_path / "c.rls"
    graph = RolloutGraph.open(path)
    prompt, sequences = _prompt(2000), []
    for step in range(6):
        sampled = [7 + step, 8 + step, 9 + step]
        graph.add_turn(TurnNode(prompt_ids=prompt, sampled_ids=sampled))
        sequences.append((prompt, sampled))
        prompt = [*prompt, *sampled, *_prompt(20, 5000 + 100 * step)]
    writer = graph._journal.writer
    assert not any(type(run) is PackedFull for run in writer.full_of)
    assert len(writer.full_of) <= 1  # the root's
    graph.close()
    assert path.stat().st_size < 4 * 2000 + 6 * 1000  # the prompt once, then new ids
    loaded = RolloutGraph.load(path)
    for i, (prompt_ids, sampled) in enumerate(sequences):
        node = loaded.get(f"turn-{i}")
        assert list(node.prompt_ids) == prompt_ids and list(node.sampled_ids) == sampled


def test_graphs_without_short_prompts_share_one_empty_set_of_lengths() -> None:
    """An empty set costs 216 bytes a graph: graphs whose turns have no prompt under one
    block share one empty frozenset, and the first short one gets a set of its own (its
    continuation is still linked by tokens, the other graph's lengths unchanged)."""
    graphs = [RolloutGraph(), RolloutGraph()]
    long_prompt = _prompt(200)
    graphs[0].add_turn(TurnNode(prompt_ids=long_prompt, sampled_ids=[1, 2]))
    assert graphs[0]._linker.short_lengths is graphs[1]._linker.short_lengths
    assert not graphs[0]._linker.short_lengths
    short = _prompt(10)
    graphs[1].add_turn(TurnNode(prompt_ids=short, sampled_ids=[3, 4]))
    assert graphs[1]._linker.short_lengths == {12}
    assert not graphs[0]._linker.short_lengths
    child = graphs[1].add_turn(TurnNode(prompt_ids=[*short, 3, 4, 5], sampled_ids=[6]))
    assert child.parent_id == "turn-0" and graphs[1].link_kind("turn-1") == "tokens"


def test_a_session_keeps_no_instance_dict() -> None:
    """A server holds one `Session` per session, idle or not: its fields are slots."""
    session = Sessions().create()
    assert not hasattr(session, "__dict__")
    session.recorded += 1
    assert session.info()["turns"] == 0 and session.recorded == 1


def test_a_packed_turn_has_a_ten_byte_head() -> None:
    """A continuation's new ids, sampled ids and logprobs sit in its turn's bytes after a
    head of 10 bytes: nothing else of the tokens is kept there."""
    from rollout_store.engine.tokens import packed_size

    graph = RolloutGraph()
    prompt = _prompt(100)
    graph.add_turn(TurnNode(prompt_ids=prompt, sampled_ids=[1, 2], sampled_logprobs=[-1.0, -2.0]))
    prompt = [*prompt, 1, 2, 30, 31, 32]
    graph.add_turn(TurnNode(prompt_ids=prompt, sampled_ids=[4], sampled_logprobs=[-0.5]))
    turn = graph._turns[1]
    assert turn.prompt is turn  # packed
    tokens = 3 * 4 + 1 * 4 + 1 * 8
    assert turn.data.startswith(array("I", [len(prompt)]).tobytes())
    assert packed_size(turn.data) == 10 + tokens
    assert (
        turn.data[10 : 10 + tokens]
        == array("I", [30, 31, 32, 4]).tobytes() + array("d", [-0.5]).tobytes()
    )
    view = graph.get(turn.node_id)
    assert (view.prompt_ids, view.sampled_ids, view.sampled_logprobs) == (prompt, [4], [-0.5])


@pytest.mark.parametrize(
    ("n_new", "n_sampled"),
    [(linking.BLOCK, 1), (1 << 16, 1), (3, 1 << 15), ((1 << 16) - 1, (1 << 15) - 1)],
)
def test_a_turn_whose_counts_do_not_fit_the_head_is_kept_unpacked(
    n_new: int, n_sampled: int, tmp_path: Path
) -> None:
    """New ids beyond 65,535 or sampled ids beyond 32,767 do not fit a packed head: such a
    turn keeps its runs and arrays as they came, exactly, and a file of it loads the same."""
    from rollout_store.engine.tokens import MAX_PACKED_NEW, MAX_PACKED_SAMPLED

    graph = RolloutGraph()
    prompt = _prompt(10)
    graph.add_turn(TurnNode(prompt_ids=prompt, sampled_ids=[1]))
    prompt = [*prompt, 1, *range(7, 7 + n_new)]
    sampled = [5 + i % 1000 for i in range(n_sampled)]
    logprobs = [-(i % 7) / 8 for i in range(n_sampled)]
    node = graph.add_turn(
        TurnNode(prompt_ids=prompt, sampled_ids=sampled, sampled_logprobs=logprobs)
    )
    turn = graph._turns[1]
    fits = n_new <= MAX_PACKED_NEW and n_sampled <= MAX_PACKED_SAMPLED
    assert (turn.prompt is turn) == fits
    assert graph.parent(node.node_id) == graph._turns[0].node_id
    path = tmp_path / "g.rls"
    graph.save(path)
    for kept in (graph, RolloutGraph.load(path)):
        view = kept.get(node.node_id)
        assert view.prompt_ids == prompt and view.sampled_ids == sampled
        assert view.sampled_logprobs == logprobs
        assert (kept._turns[1].prompt is kept._turns[1]) == fits


def test_a_turn_keeps_no_slot_for_its_full_run(tmp_path: Path) -> None:
    """A turn's full run (prompt + sampled) has no slot: a packed turn's is a view over it,
    another turn's is kept in place of its prompt, whose run it continues; a flag says which,
    and no file holds that flag."""
    import sys

    from rollout_store.engine.stored import FULL_APART, Turn
    from rollout_store.engine.tokens import ArrayRun
    from rollout_store.errors import RolloutStoreError
    from rollout_store.files import storage

    assert sys.getsizeof(Turn()) <= 104  # 9 slots: no `_full`
    turn = Turn()
    prompt = ArrayRun(None, array("I", [1, 2]))
    turn.prompt = prompt
    assert turn.full is prompt and not turn.flags & FULL_APART
    full = ArrayRun(prompt, array("I", [3]))
    turn.full = full
    assert turn.prompt is prompt and turn.full is full and turn.flags & FULL_APART
    with pytest.raises(RolloutStoreError):
        turn.full = ArrayRun(None, array("I", [3]))  # not over its prompt
    assert turn.prompt is prompt and turn.full is full
    other = ArrayRun(None, array("I", [5]))
    turn.prompt = other  # a new prompt: the full run is that prompt until set
    assert turn.prompt is other and turn.full is other and not turn.flags & FULL_APART
    # never written: not among the bits a file's turn record holds
    assert not FULL_APART & storage._WRITTEN_CARRYING

    graph = RolloutGraph()
    graph.add_turn(TurnNode(prompt_ids=_prompt(20), sampled_ids=[4, 5]))
    graph.add_turn(TurnNode(prompt_ids=[*_prompt(20), 4, 5, 6], sampled_ids=[7]))
    graph.add_turn(TurnNode(sampled_ids=[8]))  # no prompt ids: a full of its sampled ids
    root, child, alone = graph._turns
    assert root.flags & FULL_APART and child.flags & FULL_APART and alone.flags & FULL_APART
    assert alone.prompt is None and _run_list(alone.full) == [8]
    graph.save(tmp_path / "g.rls")
    loaded = RolloutGraph.load(tmp_path / "g.rls")
    for a, b in zip(graph._turns, loaded._turns, strict=True):
        assert a.flags & FULL_APART == b.flags & FULL_APART
        assert _run_list(a.full) == _run_list(b.full)
        assert _run_list(a.prompt) == _run_list(b.prompt)


def _run_list(run: Any) -> list[int] | None:
    from rollout_store.engine.tokens import run_list

    return None if run is None else run_list(run)


def test_a_turn_keeps_its_node_id_in_its_own_bytes() -> None:
    """A chosen node id sits in the turn's bytes after its packed tokens (no slot, no
    string): every other part reads back unchanged as the id is set, changed and cleared."""
    import sys

    from rollout_store.engine.confirm import digest_key
    from rollout_store.engine.stored import HAS_IDENT, Turn
    from rollout_store.engine.tokens import ArrayRun, run_list

    assert sys.getsizeof(Turn()) <= 96  # 8 slots: no `ident`, no `_full`
    digest = bytes(range(32))
    for packed in (False, True):
        turn = Turn()
        turn.index = 3
        turn.node_id = "turn-3"  # the default: nothing kept
        assert turn.ident is None and not turn.flags & HAS_IDENT and turn.data == bytes(4)
        turn.node_id = "n\udc80é-1"  # a lone surrogate and a non-ASCII letter
        if packed:
            before = ArrayRun(None, array("I", [1, 2]))
            turn.pack_tokens(before, array("I", [3]), array("I", [4]), array("d", [-0.5]))
        turn.build((b"\x91\xa1a",), 1, b"\xa2ok", digest, digest_key(digest))
        for ident in ("n\udc80é-1", "other", None, "x" * 300):
            turn.ident = ident
            assert turn.ident == ident and bool(turn.flags & HAS_IDENT) == (ident is not None)
            assert turn.node_id == (ident if ident is not None else "turn-3")
            assert (turn.tail, turn.response, turn.digest) == (b"\x91\xa1a", b"\xa2ok", digest)
            assert turn.rkey == digest_key(digest) and turn.n_rest == 1
            if packed:
                assert run_list(turn) == [1, 2, 3] and run_list(turn.full) == [1, 2, 3, 4]
                assert turn.logprobs == array("d", [-0.5])
        turn.tail = b"\x92\xa1a\xa1b"
        turn.n_rest = 2
        assert turn.ident == "x" * 300 and turn.tail == b"\x92\xa1a\xa1b"


def test_named_turns_are_found_by_their_ids_and_keep_them_through_a_file(
    tmp_path: Path,
) -> None:
    """The index of chosen ids holds ints (no string): a hit is confirmed by the id the turn
    keeps, so two ids under one key stay apart; a file keeps the ids, never the flag."""
    from rollout_store.engine.index import index_add
    from rollout_store.engine.stored import HAS_IDENT
    from rollout_store.errors import DuplicateNodeError
    from rollout_store.files import storage

    graph = RolloutGraph()
    graph.add_turn(TurnNode(node_id="a", request_messages=[{"role": "user", "content": "x"}]))
    graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "y"}]))
    graph.add_turn(TurnNode(node_id="b\u00e9", parent_id="a", request_messages=[]))
    assert graph.node_ids() == ["a", "turn-1", "b\u00e9"]
    assert all(type(key) is int for key in graph._by_id)
    a, other, b = graph._turns
    assert graph._find("a") is a and graph._find("b\u00e9") is b and graph._find("c") is None
    assert graph._find("turn-1") is other and graph._find("turn-0") is None  # "a" is turn 0
    # another turn filed under the key of "a": each id still finds its own turn
    index_add(graph._by_id, hash("a"), b)
    assert graph._find("a") is a and graph._find("b\u00e9") is b
    with pytest.raises(DuplicateNodeError):
        graph.add_turn(TurnNode(node_id="b\u00e9"))
    assert graph.get("b\u00e9").parent_id == "a"
    assert not HAS_IDENT & storage._WRITTEN_CARRYING
    graph = RolloutGraph()
    graph.add_turn(TurnNode(node_id="a", request_messages=[{"role": "user", "content": "x"}]))
    graph.add_turn(TurnNode(node_id="b\u00e9", parent_id="a", request_messages=[]))
    graph.save(tmp_path / "g.rls")
    loaded = RolloutGraph.load(tmp_path / "g.rls")
    assert loaded.node_ids() == ["a", "b\u00e9"] and loaded.get("b\u00e9").parent_id == "a"
    assert loaded._find("b\u00e9") is loaded._turns[1]


def test_a_root_packs_its_sampled_ids_over_its_prompt_run(tmp_path: Path) -> None:
    """A root is a packed turn too: no new ids over its prompt's run (shared through the
    store), its sampled ids and logprobs in its own bytes, so it keeps no side, arrays or full
    run of its own; a retry shares it as its prompt; a file loads it packed the same way, and
    a root whose sampled ids do not fit a packed head stays as it came."""
    from rollout_store.engine.stored import HAS_DIGEST, HAS_KEY, HAS_TOKENS
    from rollout_store.engine.tokens import MAX_PACKED_SAMPLED, ArrayRun, PackedFull

    path = tmp_path / "g.rls"
    graph = RolloutGraph.open(path)
    prompt = _prompt(100)
    graph.add_turn(TurnNode(prompt_ids=prompt, sampled_ids=[1, 2], sampled_logprobs=[-1.0, 0.0]))
    graph.add_turn(TurnNode(prompt_ids=prompt, sampled_ids=[3], sampled_logprobs=[-3.0]))
    big = [5] * (MAX_PACKED_SAMPLED + 1)
    graph.add_turn(TurnNode(prompt_ids=_prompt(10, 7000), sampled_ids=big))
    root, retry, unpacked = graph._turns
    assert root.prompt is root and root.flags & HAS_TOKENS and len(root.seg) == 0
    assert type(root.after) is ArrayRun and type(root.full) is PackedFull
    assert root.side.shared  # no token ids of its own: one side for the turns alike
    assert retry.prompt is root and retry.parent is None
    assert type(unpacked.prompt) is ArrayRun and not unpacked.flags & HAS_TOKENS
    live = [t.flags & ~(HAS_DIGEST | HAS_KEY) for t in graph._turns]
    fields = [
        (v.prompt_ids, v.sampled_ids, v.sampled_logprobs) for v in map(graph.get, graph.node_ids())
    ]
    assert fields[0] == (prompt, [1, 2], [-1.0, 0.0]) and fields[2][1] == big
    graph.close()
    loaded = RolloutGraph.load(path)
    assert [t.flags & ~(HAS_DIGEST | HAS_KEY) for t in loaded._turns] == live
    assert loaded._turns[1].prompt is loaded._turns[0]
    assert [
        (v.prompt_ids, v.sampled_ids, v.sampled_logprobs)
        for v in map(loaded.get, loaded.node_ids())
    ] == fields

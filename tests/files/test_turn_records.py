"""Turn records in an out-of-process store: a graph keeps references to its turns' tails and
responses, fetched on read (verified), and a failing put leaves everything as it was."""

from __future__ import annotations

import gc
import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from counting_store import CountingStore
from support import add_all, reachable

from rollout_store import (
    CorruptObjectError,
    DirectoryStore,
    MemoryStore,
    MissingObjectError,
    RedisStore,
    RolloutGraph,
    StoreUnavailableError,
    StringCache,
    TurnNode,
    content_key,
    export_session,
)
from rollout_store.engine.turn_records import MIN_RECORD_BYTES, RemoteTurn, TurnRecords


def snapshot(graph: RolloutGraph) -> str:
    doc = export_session(graph, include_messages=True, include_discarded=True)
    links = [(graph.parent(n), graph.link_kind(n)) for n in graph.node_ids()]
    return json.dumps(doc) + repr(links) + repr(graph.stats())


def tool_rollout(n: int, tag: str = "r") -> list[dict[str, Any]]:
    """A tool-calling rollout: each response is about 1.5 KB of short strings (none long
    enough to be a blob), each tool output a long string; each request re-sends the
    history."""
    history: list[Any] = [
        {"role": "system", "content": "Use the tools. " * 100},
        {"role": "user", "content": f"{tag}: solve the task"},
    ]
    turns = []
    for k in range(n):
        call = f"call_{tag}_{k}"
        response = {
            "role": "assistant",
            "content": f"{tag} step {k} " + "thinking about it " * 40,
            "tool_calls": [
                {
                    "id": call,
                    "type": "function",
                    "function": {"name": "run", "arguments": json.dumps({"cmd": f"ls {k} " * 60})},
                }
            ],
        }
        turns.append(
            {
                "request_messages": json.loads(json.dumps(history)),
                "response_message": json.loads(json.dumps(response)),
            }
        )
        history = history + [
            response,
            {"role": "tool", "tool_call_id": call, "content": f"{tag} output {k} " * 120},
        ]
    return turns


def private_twin(turns: list[dict[str, Any]]) -> RolloutGraph:
    graph = RolloutGraph()
    add_all(graph, turns)
    return graph


def record_keys(store: Any, turns: list[dict[str, Any]]) -> set[bytes]:
    """The store's objects that are not blobs (long strings) of `turns`: turn records."""
    strings: set[bytes] = set()

    def walk(value: Any) -> None:
        if isinstance(value, str) and len(value) >= 1024:
            strings.add(content_key(value.encode()))
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(turns)
    return set(store.keys()) - strings


def test_a_graph_over_a_store_reads_back_exactly_and_records_without_fetching(
    tmp_path: Path,
) -> None:
    store = CountingStore(tmp_path / "objects")
    turns = tool_rollout(8)
    graph = RolloutGraph(store=store, cache=StringCache(0))
    add_all(graph, turns)
    assert store.gets == 0  # echoes confirmed by key, requests by digest: nothing read back
    assert len(record_keys(store, turns)) == 8  # one record a turn
    assert graph.stats() == private_twin(turns).stats()
    # the counts, the tails' bytes too, are known without a fetch; only the root's prompt is
    # read (its system prompt and record), to tell retries of it apart
    assert store.gets == 2
    assert snapshot(graph) == snapshot(private_twin(turns))
    assert store.gets > 0
    for k, turn in enumerate(turns):
        assert graph.response_message(f"t{k}") == turn["response_message"]
        assert graph.request_messages(f"t{k}") == turn["request_messages"]


def test_a_graph_over_a_store_holds_no_response_bytes(tmp_path: Path) -> None:
    turns = tool_rollout(6)
    graph = RolloutGraph(store=DirectoryStore(tmp_path / "objects"), cache=StringCache(0))
    add_all(graph, turns)
    marker = b"thinking about it thinking"
    held = [o for o in reachable(graph).values() if type(o) is bytes and marker in o]
    assert not held, [len(o) for o in held]
    private = private_twin(turns)
    assert [o for o in reachable(private).values() if type(o) is bytes and marker in o]


def retained_per_turn(make: Any, turns: list[dict[str, Any]]) -> float:
    add_all(make(), tool_rollout(2, "warm-up"))  # lazy imports and set-up before the baseline
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        graph = make()
        for k, turn in enumerate(turns):
            graph.add_turn(TurnNode(node_id=f"t{k}", **json.loads(json.dumps(turn))))
        gc.collect()
        size = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(graph) == len(turns)
    return size / len(turns)


def test_over_redis_a_turn_keeps_references_not_its_response(redis_url: str) -> None:
    """Measured with tracemalloc: a turn's ~1.5 KB packed response stays in the store."""
    turns = tool_rollout(40)
    client = RedisStore(redis_url).client
    cache = StringCache(0)

    def over_redis() -> RolloutGraph:
        store = RedisStore(redis_url, client=client, prefix=f"records-{id(cache)}:")
        return RolloutGraph(store=store, cache=cache)

    def over_memory() -> RolloutGraph:
        return RolloutGraph(store=MemoryStore())

    remote = retained_per_turn(over_redis, turns)
    local = retained_per_turn(over_memory, turns)
    response = len(json.dumps(turns[0]["response_message"]))
    assert local > response  # in process: the packed response, at least
    # references: a Turn, its record key, its response's key, digest, index entries
    assert remote < 800, remote  # (about 630, a graph's own tables included)
    assert local - remote > response - 300, (local, remote)
    print(f"retained per turn: {local:.0f} bytes in process, {remote:.0f} over Redis")


def test_a_tampered_or_missing_record_is_detected(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "objects")
    turns = tool_rollout(3)
    graph = RolloutGraph(store=store, cache=StringCache(0))
    add_all(graph, turns)
    keys = record_keys(store, turns)
    assert len(keys) == 3
    originals = {}
    for key in keys:
        path = store.path / key.hex()[:2] / key.hex()[2:]
        originals[path] = path.read_bytes()
        path.write_bytes(originals[path].replace(b"thinking", b"THINKING", 1))
    with pytest.raises(CorruptObjectError) as info:
        graph.response_message("t1")
    assert info.value.expected in keys and info.value.expected.hex() in str(info.value)
    with pytest.raises(CorruptObjectError):
        graph.request_messages("t2")
    for path in originals:
        path.unlink()
    with pytest.raises(MissingObjectError):
        graph.response_message("t0")
    for path, data in originals.items():
        path.write_bytes(data)
    assert snapshot(graph) == snapshot(private_twin(turns))


@pytest.mark.parametrize("appending", [False, True])
def test_a_failing_record_put_leaves_graph_store_references_and_file_as_they_were(
    tmp_path: Path, appending: bool
) -> None:
    store = CountingStore(tmp_path / "objects")
    turns = tool_rollout(4)
    path = tmp_path / "log.rls"
    if appending:
        graph = RolloutGraph.open(path, store=store, blobs="store")
    else:
        graph = RolloutGraph(store=store)
    add_all(graph, turns[:2])
    before = snapshot(graph)
    size = path.stat().st_size if appending else 0
    # turn 2 puts its new tool output (a blob), then its record: the record's put fails
    store.puts_left = 1
    with pytest.raises(StoreUnavailableError):
        graph.add_turn(TurnNode(node_id="t2", **turns[2]))
    assert store.puts_left == 0  # the blob went in; the record did not
    assert snapshot(graph) == before
    if appending:
        assert path.stat().st_size == size
    store.puts_left = None
    graph.add_turn(TurnNode(node_id="t2", **turns[2]))
    graph.add_turn(TurnNode(node_id="t3", **turns[3]))
    assert snapshot(graph) == snapshot(private_twin(turns))
    if appending:
        graph.close()
        assert snapshot(RolloutGraph.load(path, store=store.inner)) == snapshot(graph)


def test_files_of_a_graph_over_a_store(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "objects")
    turns = tool_rollout(5)
    graph = RolloutGraph(store=store, cache=StringCache(0))
    add_all(graph, turns)
    expected = snapshot(private_twin(turns))
    graph.save(tmp_path / "whole.rls")  # self-contained: readable with no store
    assert snapshot(RolloutGraph.load(tmp_path / "whole.rls")) == expected
    graph.save(tmp_path / "refs.rls", blobs="store")
    assert snapshot(RolloutGraph.load(tmp_path / "refs.rls", store=store)) == expected
    assert (tmp_path / "refs.rls").stat().st_size < (tmp_path / "whole.rls").stat().st_size


def test_a_sealed_turn_fetches_and_unseals(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "objects")
    records = TurnRecords(store, StringCache(10_000))
    turn = records.new_turn()
    turn.flags = 0
    tail, response = b"\x91\xa4tail" + b"t" * 100, b"\x81\xa4role" + b"r" * 100
    turn.build((tail,), 1, response, bytes(range(32)), None)
    keys = records.put(turn)
    assert keys is not None and keys[1] == content_key(response)
    records.seal(turn, keys)
    assert turn.records is records and turn.echo_key() == content_key(response)
    assert len(turn.data) < len(tail) + len(response)
    assert (turn.tail, turn.response, turn.n_rest) == (tail, response, 1)
    assert turn.digest == bytes(range(32))
    turn.response = b"\xc0"  # setting a part brings the record back first
    assert turn.records is None and turn.echo_key() is None
    assert (turn.tail, turn.response, turn.digest) == (tail, b"\xc0", bytes(range(32)))
    short = records.new_turn()
    short.flags = 0
    short.build((b"\x90",), 0, b"\xc0", None, None)
    assert records.put(short) is None  # below MIN_RECORD_BYTES: stays in the process
    assert MIN_RECORD_BYTES > 64 and isinstance(turn, RemoteTurn)


def test_a_malformed_record_is_refused(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "objects")
    records = TurnRecords(store, None)
    key = store.put(b"\xff\xff\xff\x00 not a record")
    with pytest.raises(CorruptObjectError):
        records.fetch(key, True)
    key = store.put((3).to_bytes(4, "little") + b"abc" + b"extra")
    assert records.fetch(key, True) == (b"abc", b"extra")
    with pytest.raises(CorruptObjectError):
        records.fetch(key, False)  # a response its turn does not have


def test_graphs_over_a_memory_store_keep_their_records() -> None:
    store = MemoryStore()  # in the process already: its graphs' turns stay as they are
    graph = RolloutGraph(store=store)
    turns = tool_rollout(3)
    add_all(graph, turns)
    assert not any(isinstance(o, RemoteTurn) for o in reachable(graph).values())
    assert len(store) > 0 and record_keys(store, turns) == set()


def test_a_graph_read_from_a_file_over_a_store_keeps_references(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "objects")
    turns = tool_rollout(6)
    graph = RolloutGraph(store=store)
    add_all(graph, turns[:4])
    graph.save(tmp_path / "refs.rls", blobs="store")
    graph.save(tmp_path / "whole.rls")
    marker = b"thinking about it thinking"
    for name in ("refs.rls", "whole.rls"):
        back = RolloutGraph.load(tmp_path / name, store=store, cache=StringCache(0))
        held = [o for o in reachable(back).values() if type(o) is bytes and marker in o]
        assert not held, name
        add_all_from(back, turns, 4)  # continuations of turns read back (confirmed by bytes)
        assert snapshot(back) == snapshot(private_twin(turns)), name


def test_a_log_reopened_over_a_store_keeps_references(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "objects")
    turns = tool_rollout(6)
    path = tmp_path / "log.rls"
    with RolloutGraph.open(path, store=store, blobs="store") as graph:
        add_all(graph, turns[:3])
    with RolloutGraph.open(path, store=store) as graph:
        kept = _turns(graph)
        assert len(kept) == 3 and all(isinstance(o, RemoteTurn) for o in kept)
        add_all_from(graph, turns, 3)
        assert snapshot(graph) == snapshot(private_twin(turns))
    assert snapshot(RolloutGraph.load(path, store=store)) == snapshot(private_twin(turns))


def test_reading_a_file_into_a_store_that_is_down_fails_clearly(tmp_path: Path) -> None:
    turns = tool_rollout(3)
    private_twin(turns).save(tmp_path / "whole.rls")
    store = CountingStore(tmp_path / "objects")
    store.puts_left = 0
    with pytest.raises(StoreUnavailableError):
        RolloutGraph.load(tmp_path / "whole.rls", store=store)
    store.puts_left = None
    back = RolloutGraph.load(tmp_path / "whole.rls", store=store)
    assert snapshot(back) == snapshot(private_twin(turns))


def _turns(graph: RolloutGraph) -> list[Any]:
    return [o for o in reachable(graph).values() if type(o).__name__.endswith("Turn")]


def add_all_from(graph: RolloutGraph, turns: list[dict[str, Any]], first: int) -> None:
    for k in range(first, len(turns)):
        graph.add_turn(TurnNode(node_id=f"t{k}", **turns[k]))


def test_rollouts_of_one_task_in_one_graph_link_without_fetching(tmp_path: Path) -> None:
    """Four rollouts sharing their first request (twins), interleaved: each continuation
    finds its parent among the twins by its echo, told by key."""
    rollouts = [tool_rollout(5, tag=f"r{r}") for r in range(4)]
    for rollout in rollouts[1:]:  # one task: the same first request
        for turn in rollout:
            turn["request_messages"][:2] = json.loads(
                json.dumps(rollouts[0][0]["request_messages"][:2])
            )
    store = CountingStore(tmp_path / "objects")
    graph = RolloutGraph(store=store, cache=StringCache(0))
    private = RolloutGraph()
    for k in range(5):
        for r, rollout in enumerate(rollouts):
            for g in (graph, private):
                g.add_turn(TurnNode(node_id=f"r{r}t{k}", **json.loads(json.dumps(rollout[k]))))
    assert store.gets == 0
    assert [graph.parent(n) for n in graph.node_ids()] == [
        private.parent(n) for n in private.node_ids()
    ]
    assert graph.parent("r2t3") == "r2t2"
    assert snapshot(graph) == snapshot(private)


def odd_rollout(n: int) -> list[dict[str, Any]]:
    """Responses of odd JSON values (lone surrogates, big ints, -0.0, NaN, 1 and 1.0 and
    True, empty containers, key order), each echoed by the next request."""
    odd = json.loads(
        '{"z": "\\ud800 lone", "a": 1, "b": 1.0, "c": true, "d": -0.0, "e": NaN, '
        '"f": 123456789012345678901234567890, "g": [], "h": {}, "i": 1e400}'
    )
    history: list[Any] = [{"role": "user", "content": "go " * 50}]
    turns = []
    for k in range(n):
        response = {"role": "assistant", "content": f"step {k} " * 30, "odd": odd, "k": k}
        turns.append(
            {
                "request_messages": json.loads(json.dumps(history)),
                "response_message": json.loads(json.dumps(response)),
            }
        )
        history = history + [response, {"role": "user", "content": f"more {k} " * 30}]
    return turns


def test_odd_responses_over_a_store_export_byte_identical(tmp_path: Path) -> None:
    turns = odd_rollout(5)
    store = CountingStore(tmp_path / "objects")
    graph = RolloutGraph(store=store, cache=StringCache(0))
    add_all(graph, turns)
    assert store.gets == 0 and len(record_keys(store, turns)) == 5
    private = private_twin(turns)
    assert [graph.parent(n) for n in graph.node_ids()] == [None, "t0", "t1", "t2", "t3"]
    assert snapshot(graph) == snapshot(private)
    for k, turn in enumerate(turns):
        assert json.dumps(graph.response_message(f"t{k}")) == json.dumps(turn["response_message"])
        assert json.dumps(graph.request_messages(f"t{k}")) == json.dumps(turn["request_messages"])


def test_long_responses_are_kept_in_the_store_and_echo_by_key(tmp_path: Path) -> None:
    """A response with a long string (a blob) is sealed too: its echo is confirmed by the
    SHA-256 of its plain packing, with nothing fetched."""
    history: list[Any] = [{"role": "user", "content": "think hard"}]
    turns = []
    for k in range(5):
        response = {"role": "assistant", "content": f"reasoning {k} " * 200}  # ~2.6 KB
        turns.append(
            {
                "request_messages": json.loads(json.dumps(history)),
                "response_message": json.loads(json.dumps(response)),
            }
        )
        history = history + [response, {"role": "user", "content": f"go on {k}"}]
    store = CountingStore(tmp_path / "objects")
    graph = RolloutGraph(store=store, cache=StringCache(0))
    add_all(graph, turns)
    assert store.gets == 0
    assert len(record_keys(store, turns)) == 5
    assert [graph.parent(n) for n in graph.node_ids()] == [None, "t0", "t1", "t2", "t3"]
    assert not any(isinstance(o, bytes) and b"reasoning" in o for o in reachable(graph).values())
    assert snapshot(graph) == snapshot(private_twin(turns))

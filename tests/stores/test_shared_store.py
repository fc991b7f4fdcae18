"""Graphs over a content store: sharing, exact read-back, collisions, tampering and faults."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from services import S3_CREDENTIALS, RedisServer
from support import add_all, chat_turns, image_url, reachable

from rollout_store import (
    BlobTable,
    CorruptObjectError,
    DirectoryStore,
    InvalidValueError,
    MemoryStore,
    MissingObjectError,
    RedisStore,
    RetryPolicy,
    RolloutGraph,
    S3Store,
    StoreObjectError,
    StoreRequiredError,
    StoreUnavailableError,
    StringCache,
    TurnNode,
    content_key,
    export_session,
)
from rollout_store.engine import shared_blobs
from rollout_store.engine.blobs import content_digest
from rollout_store.engine.index import index_members
from rollout_store.engine.shared_blobs import StoreBlobTable
from rollout_store.stores.content import index_key

LONG = 2000


def _colliding(_: bytes) -> bytes:
    return b"\0" * 16


def snapshot(graph: RolloutGraph) -> str:
    doc = export_session(graph, include_messages=True, include_discarded=True)
    links = [(graph.parent(n), graph.link_kind(n)) for n in graph.node_ids()]
    return json.dumps(doc) + repr(links) + repr(graph.stats())


def group(n_rollouts: int, n_turns: int) -> list[list[dict[str, Any]]]:
    """Rollouts sharing a long system prompt and an image, then diverging with long text."""
    system = "Be careful. " * 200
    image = image_url(1, 20_000)
    return [
        chat_turns(n_turns, tag=f"r{r}", system=system, images=[image], pad=LONG)
        for r in range(n_rollouts)
    ]


def private_twin(turns: list[dict[str, Any]]) -> RolloutGraph:
    graph = RolloutGraph()
    add_all(graph, turns)
    return graph


def saved_by_reference(
    tmp_path: Path,
) -> tuple[DirectoryStore, RolloutGraph, list[dict[str, Any]], Path]:
    """A rollout of two turns (`group`) added over a directory store and saved with its long
    strings as references into it: the store, the graph, the turns and the file."""
    store = DirectoryStore(tmp_path / "objects")
    graph = RolloutGraph(store=store)
    turns = group(1, 2)[0]
    add_all(graph, turns)
    path = tmp_path / "refs.rls"
    graph.save(path, blobs="store")
    return store, graph, turns, path


# ---------------------------------------------------------------- one process


def test_without_a_store_a_graph_owns_a_private_table() -> None:
    graph = RolloutGraph()
    assert graph.store is None and type(graph.blobs) is BlobTable


def test_graphs_over_one_memory_store_share_each_string_once() -> None:
    store = MemoryStore()
    rollouts = group(4, 3)
    graphs = [RolloutGraph(store=store) for _ in rollouts]
    for graph, turns in zip(graphs, rollouts, strict=True):
        add_all(graph, turns)
        assert snapshot(graph) == snapshot(private_twin(turns))
    # the system prompt and the image once, plus each rollout's own long texts
    distinct = {
        s
        for turns in rollouts
        for t in turns
        for s in _long_strings([t["request_messages"], t["response_message"]])
    }
    assert len(store) == len(distinct)
    # the very same str object in every graph
    first = [g.request_messages("t0")[1]["content"][1]["image_url"]["url"] for g in graphs]
    assert all(s is first[0] for s in first)


def _long_strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value] if len(value) >= 1024 else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return [s for item in value for s in _long_strings(item)]
    return []


def test_a_tool_list_is_one_object_in_the_memory_store() -> None:
    store = MemoryStore()
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "description": "d" * 90}}
        for i in range(20)
    ]
    graphs = [RolloutGraph(store=store) for _ in range(3)]
    for graph in graphs:
        graph.add_turn(
            TurnNode(
                request_messages=[{"role": "user", "content": "hi"}],
                request_tools=json.loads(json.dumps(tools)),
            )
        )
    assert len(store) == 1
    assert all(g.request_tools("turn-0") == tools for g in graphs)


# ---------------------------------------------------------------- every backend


@pytest.fixture(params=["memory", "directory", "redis", pytest.param("s3", marks=pytest.mark.slow)])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    kind = request.param
    if kind == "memory":
        return MemoryStore()
    if kind == "directory":
        return DirectoryStore(tmp_path / "objects")
    if kind == "redis":
        url = request.getfixturevalue("redis_url")
        return RedisStore(url, prefix=f"graph-test-{uuid.uuid4().hex}:")
    url = request.getfixturevalue("s3_url")
    bucket = f"graph-{uuid.uuid4().hex[:12]}"
    return S3Store(bucket, endpoint_url=url, create_bucket=True, **S3_CREDENTIALS)


def test_rollouts_over_a_store_read_back_exactly_with_a_cold_cache(any_store: Any) -> None:
    rollouts = group(2, 4)
    cache = StringCache(10**6)
    graphs = [RolloutGraph(store=any_store, cache=cache) for _ in rollouts]
    for graph, turns in zip(graphs, rollouts, strict=True):
        add_all(graph, turns)
    cache.clear()  # every string now comes from the store, verified
    for graph, turns in zip(graphs, rollouts, strict=True):
        assert snapshot(graph) == snapshot(private_twin(turns))
    assert set(any_store.keys()) >= {content_key(s.encode()) for s in _long_strings(rollouts)}


def test_a_cache_bounded_in_bytes_stays_bounded(any_store: Any) -> None:
    if isinstance(any_store, MemoryStore):
        # no cache unless asked for: graphs read the memory store's own str objects
        assert RolloutGraph(store=any_store).blobs.cache is None  # type: ignore[attr-defined]
        return
    cache = StringCache(5_000)
    graph = RolloutGraph(store=any_store, cache=cache)
    turns = group(1, 6)[0]
    add_all(graph, turns)
    assert cache.nbytes <= 5_000
    assert snapshot(graph) == snapshot(private_twin(turns))
    assert cache.nbytes <= 5_000


def test_colliding_xxh3_strings_stay_apart(any_store: Any) -> None:
    a, b = "a" * 3000, "b" * 3000
    graphs = []
    for _ in range(2):
        graph = RolloutGraph(store=any_store)
        graph.blobs = StoreBlobTable(any_store, hasher=_colliding)
        graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": a}]))
        graph.add_turn(
            TurnNode(
                request_messages=[{"role": "user", "content": a}, {"role": "user", "content": b}]
            )
        )
        graphs.append(graph)
    for graph in graphs:
        assert graph.stats()["collisions"] == 1
        assert graph.request_messages("turn-1") == [
            {"role": "user", "content": a},
            {"role": "user", "content": b},
        ]
        assert graph.parent("turn-1") is None or graph.request_messages("turn-0")[0]["content"] == a
    assert {content_key(a.encode()), content_key(b.encode())} <= set(any_store.keys())


def test_a_tampered_object_is_detected_never_returned(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "objects")
    turns = group(1, 2)[0]
    graph = RolloutGraph(store=store, cache=StringCache(0))
    add_all(graph, turns)
    image = turns[0]["request_messages"][1]["content"][1]["image_url"]["url"]
    key = content_key(image.encode())
    name = key.hex()
    (store.path / name[:2] / name[2:]).write_bytes(image[:-1].encode() + b"X")
    with pytest.raises(CorruptObjectError) as info:
        graph.request_messages("t0")  # views read their fields when asked, so read one
    assert info.value.expected == key and name in str(info.value)
    (store.path / name[:2] / name[2:]).unlink()
    with pytest.raises(MissingObjectError):
        graph.request_messages("t1")
    store.put(image.encode())  # put back: the graph reads exactly again
    assert graph.request_messages("t1") == turns[1]["request_messages"]


def test_a_damaged_object_is_replaced_by_the_next_turn_that_stores_its_content(
    tmp_path: Path,
) -> None:
    """One damaged object does not spoil every later turn that stores the same content: the
    next graph to store it replaces the object, and every graph reads exactly again."""
    store = DirectoryStore(tmp_path / "objects")
    turns = group(1, 2)[0]
    first = RolloutGraph(store=store, cache=StringCache(0))
    add_all(first, turns[:1])
    image = turns[0]["request_messages"][1]["content"][1]["image_url"]["url"]
    name = content_key(image.encode()).hex()
    (store.path / name[:2] / name[2:]).write_bytes(image[:-1].encode() + b"X")
    with pytest.raises(CorruptObjectError):
        first.request_messages("t0")
    later = RolloutGraph(store=store, cache=StringCache(0))
    add_all(later, turns)
    assert snapshot(later) == snapshot(private_twin(turns))
    assert first.request_messages("t0") == turns[0]["request_messages"]


@pytest.mark.parametrize("kind", ["memory", "directory"])
def test_a_graph_that_read_a_damaged_object_puts_it_again_with_its_next_turn(
    tmp_path: Path, kind: str
) -> None:
    """Within one graph a repeated string is found in its own table, not put again: once a
    read found the object damaged, the next turn that stores the string replaces it."""
    store: Any = MemoryStore() if kind == "memory" else DirectoryStore(tmp_path / "objects")
    graph = RolloutGraph(store=store, cache=None if kind == "memory" else StringCache(0))
    text = "the long system prompt " * 60
    graph.add_turn(TurnNode("a", request_messages=[{"role": "user", "content": text}]))
    key = content_key(text.encode())
    if kind == "memory":
        store._damage(key, b"damaged")
    else:
        name = key.hex()
        (store.path / name[:2] / name[2:]).write_bytes(b"damaged")
    with pytest.raises(CorruptObjectError):
        graph.request_messages("a")
    other = [{"role": "system", "content": text}, {"role": "user", "content": "again"}]
    graph.add_turn(TurnNode("b", request_messages=other))
    assert store.get(key) == text.encode()
    assert graph.request_messages("a") == [{"role": "user", "content": text}]
    assert graph.request_messages("b") == other


# ---------------------------------------------------------------- faults


class FlakyStore:
    """A directory store that can be switched off, or made to fail after n more puts."""

    def __init__(self, path: Path) -> None:
        self.inner = DirectoryStore(path)
        self.down = False
        self.puts_left: int | None = None

    def _check(self) -> None:
        if self.down:
            raise StoreUnavailableError("the test switched the store off")

    def put(self, data: bytes) -> bytes:
        self._check()
        if self.puts_left is not None:
            if self.puts_left == 0:
                raise StoreUnavailableError("the test made this put time out")
            self.puts_left -= 1
        return self.inner.put(data)

    def get(self, key: bytes) -> bytes:
        self._check()
        return self.inner.get(key)

    def contains(self, key: bytes) -> bool:
        self._check()
        return self.inner.contains(key)


@pytest.mark.parametrize("puts_before_failing", [None, 0, 1])
def test_a_failing_put_rejects_the_turn_and_leaves_everything_as_it_was(
    tmp_path: Path, puts_before_failing: int | None
) -> None:
    store = FlakyStore(tmp_path / "objects")
    graph = RolloutGraph(store=store)
    turns = group(1, 4)[0]
    add_all(graph, turns[:2])
    before = snapshot(graph)
    if puts_before_failing is None:
        store.down = True
    else:
        store.puts_left = puts_before_failing
    # a turn with two new long strings: the put of the first or second one fails
    two_new = dict(turns[2])
    two_new["request_messages"] = turns[2]["request_messages"] + [
        {"role": "user", "content": "x" * 1500}
    ]
    with pytest.raises(StoreUnavailableError):
        graph.add_turn(TurnNode(node_id="t2", **two_new))
    assert snapshot(graph) == before
    store.down, store.puts_left = False, None
    graph.add_turn(TurnNode(node_id="t2", **two_new))
    graph.add_turn(TurnNode(node_id="t3", **turns[3]))
    twin = private_twin(turns[:2])
    twin.add_turn(TurnNode(node_id="t2", **two_new))
    twin.add_turn(TurnNode(node_id="t3", **turns[3]))
    assert snapshot(graph) == snapshot(twin)


def test_a_server_that_never_answers_times_out_clearly() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        store = RedisStore(
            f"redis://127.0.0.1:{port}/0",
            timeout=0.2,
            retry=RetryPolicy(attempts=2, first_delay=0.01),
        )
        graph = RolloutGraph(store=store)
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError) as info:
            graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "q" * 2000}]))
        assert time.monotonic() - start < 5
        assert "failed after 2 attempts" in str(info.value)
        assert len(graph) == 0 and graph.stats()["blobs"] == 0


@pytest.mark.slow
def test_redis_stopped_and_restarted_mid_rollout(own_redis: RedisServer) -> None:
    retry = RetryPolicy(attempts=3, first_delay=0.05, max_delay=0.2)
    store = RedisStore(own_redis.url, timeout=0.5, retry=retry)
    cache = StringCache(10**6)
    graph = RolloutGraph(store=store, cache=cache)
    turns = group(1, 6)[0]
    add_all(graph, turns[:3])
    before = snapshot(graph)

    own_redis.stop()
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError) as info:
        graph.add_turn(TurnNode(node_id="t3", **turns[3]))
    assert "Redis" in str(info.value) and "after 3 attempts" in str(info.value)
    assert time.monotonic() - start < 10  # bounded backoff
    assert snapshot(graph) == before  # cached strings still read; nothing changed
    cache.clear()
    with pytest.raises(StoreUnavailableError):  # reads retry, then fail clearly
        graph.request_messages("t0")

    own_redis.start()  # same port, same append-only file: earlier objects are back
    graph.add_turn(TurnNode(node_id="t3", **turns[3]))
    add_all_from(graph, turns, 4)
    assert snapshot(graph) == snapshot(private_twin(turns))
    store.close()


def add_all_from(graph: RolloutGraph, turns: list[dict[str, Any]], first: int) -> None:
    for k in range(first, len(turns)):
        graph.add_turn(TurnNode(node_id=f"t{k}", **turns[k]))


# ---------------------------------------------------------------- threads


def test_many_threads_each_with_a_graph_over_one_store(any_store: Any) -> None:
    rollouts = group(8, 3)
    graphs = [RolloutGraph(store=any_store) for _ in rollouts]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            add_all(graphs[i], rollouts[i])
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(rollouts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    for graph, turns in zip(graphs, rollouts, strict=True):
        assert snapshot(graph) == snapshot(private_twin(turns))
    distinct = {content_key(s.encode()) for s in _long_strings(rollouts)}
    assert distinct <= set(any_store.keys())
    if isinstance(any_store, MemoryStore):
        assert len(any_store) == len(distinct)


def test_graphs_sharing_a_cache_share_one_tool_list(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "objects")
    cache = StringCache(10**6)
    tools = [{"name": f"f{i}", "description": "d" * 90} for i in range(20)]
    graphs = [RolloutGraph(store=store, cache=cache) for _ in range(3)]
    for graph in graphs:
        graph.add_turn(
            TurnNode(
                request_messages=[{"role": "user", "content": "hi"}],
                request_tools=json.loads(json.dumps(tools)),
            )
        )
    cache.clear()  # the graphs keep the shared value; the cache only forgets it
    assert all(g.request_tools("turn-0") == tools for g in graphs)
    large = [
        {i for i, o in reachable(g).items() if type(o) is bytes and len(o) >= 1024} for g in graphs
    ]
    assert set.intersection(*large)  # one object, held by every graph


# ---------------------------------------------------------------- files


def test_save_is_self_contained_by_default(tmp_path: Path) -> None:
    store = MemoryStore()
    graph = RolloutGraph(store=store)
    turns = group(1, 3)[0]
    add_all(graph, turns)
    graph.save(tmp_path / "g.rls")
    back = RolloutGraph.load(tmp_path / "g.rls")  # no store needed
    assert back.store is None and snapshot(back) == snapshot(graph)


def test_save_references_and_load_them_from_the_store(any_store: Any, tmp_path: Path) -> None:
    graph = RolloutGraph(store=any_store)
    turns = group(1, 3)[0]
    add_all(graph, turns)
    graph.save(tmp_path / "refs.rls", blobs="store")
    inline = tmp_path / "inline.rls"
    graph.save(inline)
    # references only: the file is much smaller than the self-contained one
    assert (tmp_path / "refs.rls").stat().st_size * 5 < inline.stat().st_size
    back = RolloutGraph.load(tmp_path / "refs.rls", store=any_store)
    assert back.store is any_store and snapshot(back) == snapshot(graph)
    with pytest.raises(StoreRequiredError):
        RolloutGraph.load(tmp_path / "refs.rls")
    # a self-contained file read over a store puts its strings into it
    other = MemoryStore()
    again = RolloutGraph.load(inline, store=other)
    assert snapshot(again) == snapshot(graph) and len(other) == graph.stats()["blobs"]


def test_save_blobs_store_needs_a_store(tmp_path: Path) -> None:
    graph = RolloutGraph()
    add_all(graph, group(1, 1)[0])
    with pytest.raises(ValueError, match="content store"):
        graph.save(tmp_path / "x.rls", blobs="store")
    with pytest.raises(ValueError, match="inline"):
        graph.save(tmp_path / "x.rls", blobs="nowhere")
    assert not (tmp_path / "x.rls").exists()


def test_a_missing_or_damaged_object_names_its_key_and_offset(tmp_path: Path) -> None:
    store, graph, turns, path = saved_by_reference(tmp_path)
    image = turns[0]["request_messages"][1]["content"][1]["image_url"]["url"]
    key = content_key(image.encode())
    name = key.hex()
    obj = store.path / name[:2] / name[2:]
    original = obj.read_bytes()
    for damage in ("missing", "damaged"):
        if damage == "missing":
            obj.unlink()
        else:
            obj.write_bytes(original[:-1] + b"Z")
        with pytest.raises(StoreObjectError) as info:
            RolloutGraph.load(path, store=store)
        assert info.value.key == key and name in str(info.value)
        assert info.value.offset is not None and info.value.offset > 0
        assert f"offset {info.value.offset}" in str(info.value)
        recovered = RolloutGraph.load(path, store=store, recover=True)
        assert recovered.load_report.error_offset == info.value.offset
    obj.write_bytes(original)
    assert snapshot(RolloutGraph.load(path, store=store)) == snapshot(graph)


def test_an_append_log_over_a_store(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "objects")
    turns = group(1, 4)[0]
    path = tmp_path / "log.rls"
    with RolloutGraph.open(path, store=store, blobs="store") as graph:
        add_all(graph, turns[:2])
    assert path.stat().st_size < 20_000  # the 20 KB image and long texts are not in it
    with pytest.raises(StoreRequiredError):
        RolloutGraph.open(path)
    with RolloutGraph.open(path, store=store) as graph:  # the log keeps its mode
        add_all_from(graph, turns, 2)
    back = RolloutGraph.load(path, store=store)
    assert snapshot(back) == snapshot(private_twin(turns))
    assert path.stat().st_size < 40_000


def test_a_failing_put_leaves_the_append_log_as_it_was(tmp_path: Path) -> None:
    store = FlakyStore(tmp_path / "objects")
    turns = group(1, 3)[0]
    path = tmp_path / "log.rls"
    graph = RolloutGraph.open(path, store=store, blobs="store")
    add_all(graph, turns[:2])
    size = path.stat().st_size
    store.down = True
    with pytest.raises(StoreUnavailableError):
        graph.add_turn(TurnNode(node_id="t2", **turns[2]))
    assert path.stat().st_size == size
    store.down = False
    graph.add_turn(TurnNode(node_id="t2", **turns[2]))
    graph.close()
    assert snapshot(RolloutGraph.load(path, store=store.inner)) == snapshot(private_twin(turns))


def test_graphs_over_one_memory_store_share_a_long_root_prompt() -> None:
    import gc
    import tracemalloc

    prefix = list(range(1000, 5000))  # 16 KB as array('I')

    def build(store: MemoryStore | None) -> tuple[list[RolloutGraph], int]:
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            graphs = [RolloutGraph(store=store) for _ in range(4)]
            for i, graph in enumerate(graphs):
                graph.add_turn(TurnNode(node_id="a", prompt_ids=list(prefix), sampled_ids=[i]))
                graph.add_turn(TurnNode(node_id="b", prompt_ids=[*prefix, i, 5], sampled_ids=[i]))
            gc.collect()
            return graphs, tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()

    shared, shared_bytes = build(MemoryStore())
    _private, private_bytes = build(None)
    assert private_bytes - shared_bytes > 3 * 16_000 * 0.9  # three of the four copies saved
    for i, graph in enumerate(shared):
        assert graph.get("b").prompt_ids == [*prefix, i, 5]
        assert graph.parent("b") == "a"
    store = MemoryStore()
    one, other = RolloutGraph(store=store), RolloutGraph(store=store)
    one.add_turn(TurnNode(node_id="a", prompt_ids=list(prefix), sampled_ids=[1]))
    other.add_turn(TurnNode(node_id="a", prompt_ids=prefix[::-1], sampled_ids=[1]))
    assert other.get("a").prompt_ids == prefix[::-1] and one.get("a").prompt_ids == prefix


def test_verify_checks_the_objects_a_file_refers_to(tmp_path: Path) -> None:
    from rollout_store.files.storage import verify

    store, _graph, turns, path = saved_by_reference(tmp_path)
    assert verify(path, store=store).ok
    with pytest.raises(StoreRequiredError):
        verify(path)
    key = content_key(turns[0]["request_messages"][0]["content"].encode())  # system prompt
    name = key.hex()
    (store.path / name[:2] / name[2:]).unlink()
    report = verify(path, store=store)
    assert not report.ok and name in (report.error or "")
    assert report.error_offset is not None
    store.put(turns[0]["request_messages"][0]["content"].encode())


def _slot_mates(data: bytes) -> bytes:
    # equal first 8 bytes for every string (one key of the index), different digests
    return bytes(8) + content_key(data)[:8]


@pytest.mark.parametrize("indexed", [False, True])
@pytest.mark.parametrize("hasher", [_colliding, _slot_mates])
def test_the_compact_store_table_keeps_blobs_apart_and_rolls_back(
    hasher: Any, indexed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if indexed:  # the index a large table keeps, from its second blob on
        monkeypatch.setattr(shared_blobs, "INDEX_FROM", 2)
    store = MemoryStore()
    table = StoreBlobTable(store, StringCache(0), hasher=hasher)
    texts = ["a" * 40, "b" * 40, "\ud800" + "c" * 40, "d" * 40]
    handles = [table.intern(t) for t in texts[:3]]
    assert [h.index for h in handles] == [0, 1, 2]
    assert [table.string(i) for i in range(3)] == texts[:3]
    assert [table.key(i) for i in range(3)] == [
        content_key(t.encode("utf-8", "surrogatepass")) for t in texts[:3]
    ]
    assert [(h.digest, h.size, h.surrogates) for h in table] == [
        (hasher(t.encode("utf-8", "surrogatepass")), 40 + (3 if i == 2 else 0), i == 2)
        for i, t in enumerate(texts[:3])
    ]
    assert table.intern("b" * 40).index == 1  # found again among its slot mates
    mark = table.mark()
    assert table.intern(texts[3]).index == 3
    table.rollback(mark)
    assert len(table) == 3
    assert table.stats()["blob_bytes"] == 123
    assert table.stats()["collisions"] == (2 if hasher is _colliding else 0)
    assert table.intern(texts[3]).index == 3  # added again after the rollback
    table.rollback((1, 0, 0))
    assert len(table) == 1 and table.stats()["blobs"] == 1
    assert table.intern("b" * 40).index == 1 and table.intern("a" * 40).index == 0
    assert (table._index is not None) == indexed
    for bad in (5, -1):
        with pytest.raises(IndexError):
            table.key(bad)
        with pytest.raises(IndexError):
            table.handle(bad)


class _KeysOnly:
    """A content store that keeps nothing (what a blob costs the graph, measured alone)."""

    def put(self, data: bytes) -> bytes:
        return content_key(data)

    def get(self, key: bytes) -> bytes:
        raise MissingObjectError("this store keeps nothing", key=key)

    def contains(self, key: bytes) -> bool:
        return False


def test_a_blob_over_an_out_of_process_store_costs_the_graph_about_its_key_and_digest() -> None:
    import gc
    import tracemalloc

    texts = [f"{i:06d}" * 50 for i in range(2000)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        table = StoreBlobTable(_KeysOnly(), StringCache(0))
        for text in texts:
            table.intern(text)
        table.flush()  # (what a graph does once a turn passed its checks)
        gc.collect()
        per_blob = (tracemalloc.get_traced_memory()[0] - before) / len(texts)
    finally:
        tracemalloc.stop()
    assert len(table) == 2000
    # a 32-byte key, a 16-byte digest, 8 bytes of size, an index entry; one Python object
    # per blob (a Handle, a bytes key, a digest) would cost well over 200 bytes
    assert per_blob < 160, per_blob  # 285 with one Handle, digest and key object each


def test_a_refused_turn_over_a_store_forgets_a_blob_that_shares_an_index_key() -> None:
    # two strings whose digests share their first 8 bytes (the store table's index key);
    # from 2048 blobs on that index holds the blobs of one key together, and a refused
    # turn's blob must be taken out of it (it was `list.remove`d from a tuple once:
    # AttributeError)
    a, b = "colliding blob text 00017376", "colliding blob text 00045924"
    mates = {a.encode(), b.encode()}

    def hasher(data: bytes) -> bytes:
        digest = content_digest(data)
        return bytes(8) + digest[8:] if data in mates else digest

    store = MemoryStore()
    graph = RolloutGraph(share_threshold=16, store=store)
    graph.blobs = StoreBlobTable(store, hasher=hasher)
    many = [f"a distinct long string {i:06d}" for i in range(2100)] + [a]
    graph.add_turn(
        TurnNode(
            node_id="t0",
            request_messages=[{"role": "user", "content": many}],
            response_message={"role": "assistant", "content": "ok"},
        )
    )
    before = graph.stats()
    bad = {"role": "user", "content": [b, {1, 2}]}  # B is stored, then the set refused
    with pytest.raises(InvalidValueError):
        graph.add_turn(TurnNode(node_id="t1", request_messages=[bad], response_message={}))
    assert graph.stats() == before
    node = graph.add_turn(
        TurnNode(node_id="t1", request_messages=[{"role": "user", "content": [b, a]}])
    )
    assert graph.request_messages(node.node_id) == [{"role": "user", "content": [b, a]}]
    table = graph.blobs
    assert isinstance(table, StoreBlobTable) and table._index is not None
    assert len(index_members(table._index.get(index_key(hasher(a.encode()))))) == 2


def test_a_file_read_with_the_wrong_store_is_not_found_never_damaged(tmp_path: Path) -> None:
    from rollout_store import CorruptFileError, MemoryStore, MissingStoreObjectError

    *_, path = saved_by_reference(tmp_path)
    before = path.read_bytes()
    for store in (MemoryStore(), DirectoryStore(tmp_path / "typo", readonly=True)):
        with pytest.raises(MissingObjectError) as info:
            RolloutGraph.load(path, store=store)
        assert isinstance(info.value, MissingStoreObjectError)
        assert not isinstance(info.value, CorruptFileError)
        assert f"not found in store {store} (is it the right store?)" in str(info.value)
        report = storage_verify(path, store=store)
        assert isinstance(report.exception, MissingStoreObjectError)
        assert "damaged" not in (report.error or "")
    assert not (tmp_path / "typo").exists() and path.read_bytes() == before


def storage_verify(path: Path, store: Any) -> Any:
    from rollout_store.files import storage

    return storage.verify(path, store=store)

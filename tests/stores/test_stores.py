"""One contract suite for every content store backend (the memory store is the reference).

`StoreContract` holds the tests every backend passes; `SharedStoreContract` adds those of
stores that many processes share (4 writer processes, kill -9 mid-put). Each backend class
says how to make a store, how to reopen it in another process and how to tamper with an
object behind the store's back.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from services import S3_CREDENTIALS
from store_workers import shared_objects

from rollout_store import (
    MAX_DEPTH,
    ContentStore,
    CorruptObjectError,
    DirectoryStore,
    InvalidValueError,
    MemoryStore,
    MissingObjectError,
    RedisStore,
    RetryPolicy,
    RolloutGraph,
    S3Store,
    StoreError,
    StoreUnavailableError,
    TurnNode,
)
from rollout_store.stores.content import StringCache, content_key

TESTS = Path(__file__).resolve().parents[1] / "support"


def _too_deep(leaf: str) -> Any:
    """A response nested past the library's depth limit, a long string at its bottom."""
    value: Any = leaf
    for _ in range(MAX_DEPTH + 1):
        value = [value]
    return {"role": "assistant", "content": value}


ROOT = TESTS.parents[1]


def worker(verb: str, spec: list[Any], seed: int) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    return subprocess.Popen(
        [sys.executable, str(TESTS / "store_workers.py"), verb, json.dumps(spec), str(seed)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


class StoreContract:
    """Tests every backend must pass. Subclasses define `store` (fixture) and `tamper`."""

    def tamper(self, store: Any, key: bytes, data: bytes) -> None:
        raise NotImplementedError

    def keys(self, store: Any) -> set[bytes]:
        return set(store.keys())

    def test_is_a_content_store(self, store: ContentStore) -> None:
        assert isinstance(store, ContentStore)

    def test_put_returns_the_sha256_and_get_gives_the_bytes_back(self, store: Any) -> None:
        for data in (b"", b"x", bytes(range(256)) * 5, b"\0" * 70_000):
            key = store.put(data)
            assert key == hashlib.sha256(data).digest()
            assert store.contains(key)
            assert store.get(key) == data

    def test_accepts_bytearray_and_memoryview(self, store: Any) -> None:
        key = store.put(bytearray(b"abc"))
        assert store.put(memoryview(b"abc")) == key
        assert store.get(key) == b"abc"

    def test_each_distinct_content_once(self, store: Any) -> None:
        before = self.keys(store)
        contents = [f"object {i}".encode() * 50 for i in range(20)]
        for _ in range(3):
            for data in contents:
                store.put(data)
        added = self.keys(store) - before
        assert added == {content_key(d) for d in contents}

    def test_missing_object(self, store: Any) -> None:
        key = content_key(uuid.uuid4().bytes)
        assert not store.contains(key)
        with pytest.raises(MissingObjectError) as info:
            store.get(key)
        assert info.value.key == key
        assert key.hex() in str(info.value)

    def test_malformed_keys_are_refused(self, store: Any) -> None:
        for bad in (b"short", "0" * 64, None, b"\0" * 33):
            with pytest.raises(ValueError):
                store.get(bad)
            with pytest.raises(ValueError):
                store.contains(bad)

    def test_tampered_object_is_detected_never_returned(self, store: Any) -> None:
        data = b"the real content " * 100
        key = store.put(data)
        self.tamper(store, key, b"forged content")
        with pytest.raises(CorruptObjectError) as info:
            store.get(key)
        assert info.value.expected == key
        assert info.value.actual == content_key(b"forged content")
        assert key.hex() in str(info.value)
        # a truncated object (a partial write behind the store's back) is caught the same way
        self.tamper(store, key, data[:-1])
        with pytest.raises(CorruptObjectError):
            store.get(key)

    def test_a_put_over_a_damaged_object_replaces_it(self, store: Any) -> None:
        """Put-if-absent does not trust a damaged object under the key: the next put of its
        content replaces it (small objects, and objects large enough to be checked before
        they are sent), and a put over an intact object leaves it as it is."""
        for data in (b"the real content " * 100, bytes(range(256)) * 400):
            key = store.put(data)
            for forged in (b"forged content", data[:-1], data[:-1] + b"X", b""):
                self.tamper(store, key, forged)
                with pytest.raises(CorruptObjectError):
                    store.get(key)
                assert store.put(data) == key
                assert store.get(key) == data
                assert store.put(data) == key and store.get(key) == data
            assert key in self.keys(store)

    def test_a_turn_refused_for_its_input_leaves_the_store_as_it_was(self, store: Any) -> None:
        """A turn refused for its input puts nothing: not its new strings, not a large value
        it would share with other graphs, and not the string of a damaged object it re-sends
        (which stays as it is until an accepted turn puts it again)."""
        old = "an old tool output " * 100
        graph = RolloutGraph(store=store)
        graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": old}]))
        damaged = content_key(old.encode())
        self.tamper(store, damaged, b"forged content")
        with pytest.raises(CorruptObjectError):  # (the graph now knows the object is damaged)
            graph.nodes()[0].request_messages  # noqa: B018
        new = "a new tool output " * 100
        # (a request of its own: the old string is stored again, not found in a base)
        messages = [{"role": "user", "content": new}, {"role": "user", "content": old}]
        tools = [{"type": "function", "function": {"name": "t", "description": "d" * 400}}]
        before = self.keys(store)
        for bad in (
            {"response_message": {"role": "assistant", "content": {1, 2}}},
            {"sampling_params": {"temperature": object()}},
            {"response_message": _too_deep("a long string at the bottom " * 100)},
        ):
            with pytest.raises(InvalidValueError):
                graph.add_turn(TurnNode(request_messages=messages, request_tools=tools, **bad))
            assert self.keys(store) == before
            assert len(graph) == 1
            with pytest.raises(CorruptObjectError):
                store.get(damaged)
        graph.add_turn(TurnNode(request_messages=messages, request_tools=tools))
        assert store.get(damaged) == old.encode()
        assert content_key(new.encode()) in self.keys(store) - before
        assert graph.nodes()[1].request_messages == messages

    def test_a_damaged_response_is_healed_by_the_turn_that_echoes_it(self, store: Any) -> None:
        """The next turn re-sends the answer as its assistant message, kept as a reference to
        the response (its strings not stored again): a damaged object of the response is put
        again all the same (only the memory store healed; the others stayed unreadable)."""
        answer = {"role": "assistant", "content": "R" * 5000}
        first = [{"role": "user", "content": "q1"}]
        graph = RolloutGraph(store=store, cache=StringCache(0))
        turn = graph.add_turn(TurnNode(request_messages=first, response_message=answer))
        key = content_key(answer["content"].encode())
        self.tamper(store, key, b"R" * 4999)
        with pytest.raises(CorruptObjectError):
            graph.response_message(turn.node_id)
        second = [*first, answer, {"role": "user", "content": "q2"}]
        later = graph.add_turn(TurnNode(request_messages=second))
        assert store.get(key) == answer["content"].encode()
        assert graph.response_message(turn.node_id) == answer
        assert graph.request_messages(later.node_id) == second

    def test_many_threads_put_one_content_once(self, store: Any) -> None:
        before = self.keys(store)
        rng = random.Random(5)
        contents = [rng.randbytes(rng.randrange(1, 40_000)) for _ in range(24)]
        errors: list[BaseException] = []
        barrier = threading.Barrier(12)

        def run(seed: int) -> None:
            try:
                barrier.wait()
                order = list(contents)
                random.Random(seed).shuffle(order)
                for data in order:
                    assert store.get(store.put(data)) == data
            except BaseException as error:  # reported below
                errors.append(error)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors
        assert self.keys(store) - before == {content_key(d) for d in contents}


class SharedStoreContract(StoreContract):
    """Tests of stores that many processes write at once."""

    def spec(self, store: Any) -> list[Any]:
        raise NotImplementedError

    @pytest.mark.slow
    def test_four_processes_write_one_store(self, store: Any) -> None:
        before = self.keys(store)
        procs = [worker("put", self.spec(store), seed) for seed in range(4)]
        outputs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0, 0]
        written = [set(bytes.fromhex(line) for line in out.split()) for out in outputs]
        shared = {content_key(d) for d in shared_objects(12)}
        for keys in written:
            assert shared <= keys and len(keys) == 24
        added = self.keys(store) - before
        assert added == set().union(*written)  # each content once, 12 shared + 4 x 12 own
        assert len(added) == 12 + 4 * 12
        for key in added:
            assert content_key(store.get(key)) == key

    @pytest.mark.slow
    def test_kill_9_during_puts_leaves_no_torn_object(self, store: Any) -> None:
        for seed in range(3):
            proc = worker("forever", self.spec(store), seed)
            assert proc.stdout is not None
            proc.stdout.readline()  # one object stored: the writer is in its loop
            time.sleep(random.Random(seed).uniform(0.01, 0.3))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            proc.stdout.close()
        keys = self.keys(store)
        assert keys
        for key in keys:  # every object under a key is whole: it hashes to its key
            assert content_key(store.get(key)) == key


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def store(self) -> MemoryStore:
        return MemoryStore()

    def tamper(self, store: Any, key: bytes, data: bytes) -> None:
        store._damage(key, data)

    def test_an_object_costs_the_store_a_few_flat_entries_and_no_key_object(self) -> None:
        """Beside its content, an object costs its key's 32 bytes in one buffer, a place in a
        list and an entry of the engine's index (a dict held a key object of 65 bytes and an
        entry: about 95 bytes an object)."""
        import gc
        import tracemalloc

        texts = [f"{i:06d}" + "x" * 100 for i in range(5000)]
        data = [text.encode() for text in texts]
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            store = MemoryStore()
            for text, datum in zip(texts, data, strict=True):
                store.put_text(text, datum)
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before + store._numbers.nbytes
        finally:
            tracemalloc.stop()
        assert len(store) == len(texts)
        assert held / len(texts) < 75  # (measured 66)

    def test_keys_sharing_their_first_8_bytes_are_told_apart(self) -> None:
        store = MemoryStore()
        key = content_key(b"a")
        twin = key[:8] + bytes(24)
        other = key[:8] + b"\x01" * 24
        store._damage(key, b"a")
        store._damage(twin, b"twin")
        assert store.contains(key) and store.contains(twin) and not store.contains(other)
        assert store.get(key) == b"a"
        assert sorted(store.keys()) == sorted([key, twin])
        assert store.put(b"a") == key and len(store) == 2

    def test_get_hands_back_the_stored_object(self) -> None:
        store = MemoryStore()
        data = b"y" * 5000
        key = store.put(data)
        assert store.get(key) is store.get(key)
        assert len(store) == 1 and store.nbytes == 5000


class TestDirectoryStore(SharedStoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> DirectoryStore:
        return DirectoryStore(tmp_path / "objects")

    def tamper(self, store: Any, key: bytes, data: bytes) -> None:
        name = key.hex()
        (store.path / name[:2] / name[2:]).write_bytes(data)

    def spec(self, store: Any) -> list[Any]:
        return ["directory", str(store.path)]

    def test_a_stray_temporary_file_is_no_object(self, store: DirectoryStore) -> None:
        (store.path / "tmp" / "put-left-by-a-killed-writer").write_bytes(b"half")
        key = store.put(b"whole")
        assert set(store.keys()) == {key}
        assert store.remove_temporaries(older_than=0) == 1

    @pytest.mark.parametrize("damage", ["directory", "symlink loop", "fifo", "link elsewhere"])
    def test_whatever_stands_at_an_objects_path_is_replaced_by_its_put(
        self, store: DirectoryStore, damage: str
    ) -> None:
        """Not a file at an object's path: a get says it is missing at once (a pipe blocked
        it for good), and the next put of its content replaces it (a directory or a link
        loop made every put fail, as if the store were down)."""
        data = b"the real content " * 100
        key = store.put(data)
        other = store.put(b"another object")
        path = store.object_path(key)
        path.unlink()
        if damage == "directory":
            path.mkdir()
            (path / "inside").write_bytes(b"x")
        elif damage == "symlink loop":
            os.symlink(path, path)
        elif damage == "fifo":
            os.mkfifo(path)
        else:
            os.symlink(store.object_path(other), path)
        with pytest.raises(MissingObjectError, match="cannot be read"):
            store.get(key)
        assert store.put(data) == key and store.get(key) == data
        assert store.get(other) == b"another object"
        assert store.remove_temporaries(older_than=0) == (damage == "directory")

    def test_a_file_in_place_of_a_folder_or_no_temporary_folder_is_put_through(
        self, store: DirectoryStore
    ) -> None:
        key = content_key(b"content")
        folder = store.object_path(key).parent
        folder.write_bytes(b"not a folder")
        assert store.put(b"content") == key and store.get(key) == b"content"
        shutil.rmtree(store.path / "tmp")  # (removed by hand)
        assert store.put(b"more content") == content_key(b"more content")

    def test_unwritable_directory_is_a_store_error(self, tmp_path: Path) -> None:
        blocker = tmp_path / "file"
        blocker.write_bytes(b"")
        with pytest.raises(StoreUnavailableError):
            DirectoryStore(blocker / "objects")


class TestRedisStore(SharedStoreContract):
    @pytest.fixture
    def store(self, redis_url: str) -> Any:
        store = RedisStore(redis_url, prefix=f"test-{uuid.uuid4().hex}:")
        yield store
        store.close()

    def tamper(self, store: Any, key: bytes, data: bytes) -> None:
        store._client.set(store._name(key), data)

    def spec(self, store: Any) -> list[Any]:
        return ["redis", store.url, store._prefix.decode()]

    @pytest.mark.parametrize("size", [100, 40_000])  # (below and above CHECK_FIRST_BYTES)
    def test_a_value_of_another_type_under_an_objects_name_is_replaced_by_its_put(
        self, store: Any, size: int
    ) -> None:
        """A hash where an object must be: no object (a get says so, contains says no), and
        the next put of its content replaces it (every put failed with WRONGTYPE)."""
        data = bytes(range(256)) * (size // 256 + 1)
        key = store.put(data)
        name = store._name(key)
        store._client.delete(name)
        store._client.hset(name, "field", "value")
        with pytest.raises(MissingObjectError, match="another Redis type"):
            store.get(key)
        assert not store.contains(key)
        assert store.put(data) == key and store.get(key) == data and store.contains(key)

    def test_a_server_that_is_not_there(self) -> None:
        from services import free_port

        store = RedisStore(
            f"redis://127.0.0.1:{free_port()}/0",
            timeout=0.5,
            retry=RetryPolicy(attempts=3, first_delay=0.01),
        )
        with pytest.raises(StoreUnavailableError) as info:
            store.put(b"data")
        assert "failed after 3 attempts" in str(info.value)
        assert info.value.key == content_key(b"data")
        with pytest.raises(StoreUnavailableError):
            store.get(content_key(b"data"))


@pytest.fixture(scope="module")
def s3_bucket(s3_url: str) -> str:
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    S3Store(bucket, endpoint_url=s3_url, create_bucket=True, **S3_CREDENTIALS)
    return bucket


class TestS3Store(SharedStoreContract):
    # moto's server answers slowly enough that this class takes several seconds
    pytestmark = pytest.mark.slow

    @pytest.fixture
    def store(self, s3_url: str, s3_bucket: str) -> S3Store:
        return S3Store(
            s3_bucket, endpoint_url=s3_url, prefix=f"{uuid.uuid4().hex}/", **S3_CREDENTIALS
        )

    def tamper(self, store: Any, key: bytes, data: bytes) -> None:
        store._client.put_object(Bucket=store.bucket, Key=store._name(key), Body=data)

    def spec(self, store: Any) -> list[Any]:
        return ["s3", store.endpoint_url, store.bucket, store._prefix]

    def test_put_if_absent_is_enforced_by_the_server(self, store: Any) -> None:
        key = store.put(b"first")
        with pytest.raises(Exception) as info:  # what S3 itself answers to a second create
            store._client.put_object(
                Bucket=store.bucket, Key=store._name(key), Body=b"other", IfNoneMatch="*"
            )
        assert "PreconditionFailed" in str(info.value) or "412" in str(info.value)
        assert store.get(key) == b"first"

    def test_a_heal_never_overwrites_an_object_changed_since_it_was_read(self, store: Any) -> None:
        """The replace of a damaged object is conditional on the ETag read: when another
        writer changes the object in between, S3 refuses it and the put reads again."""
        data = b"content " * 50
        key = store.put(data)
        self.tamper(store, key, b"damaged once")
        read, seen = store._read, []

        def racing_read(*args: Any) -> Any:
            found = read(*args)
            if not seen:  # another writer changes the object before our replace
                self.tamper(store, key, b"damaged twice")
            seen.append(found[0])
            return found

        store._read = racing_read
        assert store.put(data) == key
        assert seen == [b"damaged once", b"damaged twice"]
        assert store.get(key) == data

    def test_a_missing_bucket_is_a_store_error(self, s3_url: str) -> None:
        store = S3Store("no-such-bucket-here", endpoint_url=s3_url, **S3_CREDENTIALS)
        with pytest.raises(StoreError):
            store.put(b"data")


def test_retry_policy_retries_then_fails_clearly() -> None:
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise TimeoutError("slow")
        return "ok"

    policy = RetryPolicy(attempts=3, first_delay=0.0)
    assert policy.run("flaky call", flaky, (TimeoutError,)) == "ok"
    calls.clear()
    with pytest.raises(StoreUnavailableError) as info:
        RetryPolicy(attempts=2, first_delay=0.0).run("flaky call", flaky, (TimeoutError,))
    assert len(calls) == 2 and "flaky call failed after 2 attempts" in str(info.value)
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)


def test_string_cache_is_bounded_in_bytes() -> None:
    cache = StringCache(max_bytes=100)
    for i in range(10):
        cache.put(bytes([i]) * 32, str(i) * 30, 30)
    assert cache.nbytes <= 100 and len(cache) == 3
    assert cache.get(bytes([9]) * 32) == "9" * 30
    assert cache.get(bytes([0]) * 32) is None
    cache.put(b"k" * 32, "x" * 101, 101)  # larger than the cache: not kept
    assert cache.get(b"k" * 32) is None
    assert StringCache(0).max_bytes == 0
    with pytest.raises(ValueError):
        StringCache(-1)


def test_a_read_only_directory_store_creates_nothing(tmp_path: Path) -> None:
    from rollout_store import StoreError

    missing = tmp_path / "typo"
    store = DirectoryStore(missing, readonly=True)
    with pytest.raises(MissingObjectError):
        store.get(b"\0" * 32)
    assert not store.contains(b"\0" * 32) and list(store.keys()) == []
    with pytest.raises(StoreError, match="read-only"):
        store.put(b"data")
    assert store.remove_temporaries() == 0
    assert not missing.exists()
    writable = DirectoryStore(tmp_path / "objects")
    key = writable.put(b"data")
    assert DirectoryStore(tmp_path / "objects", readonly=True).get(key) == b"data"

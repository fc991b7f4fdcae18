"""The engine's content table through `_core.ContentTable`: one entry per distinct byte string,
reference counts, its byte count, threads, and a Rust panic that leaves it as it was."""

from __future__ import annotations

import threading

import pytest

from rollout_store import _core


def test_equal_bytes_share_one_entry() -> None:
    table = _core.ContentTable()
    a = table.intern(b"hello")
    assert table.intern(b"hello") == a
    b = table.intern(b"world!")
    assert b != a
    assert len(table) == 2
    assert table.refcount(a) == 2 and table.refcount(b) == 1
    assert table.get(a) == b"hello" and table.get(b) == b"world!"
    assert table.content_bytes == 11
    assert table.nbytes >= table.content_bytes
    assert b"hello" in table and b"other" not in table
    assert table.find(b"world!") == b and table.find(b"nope") is None


def test_release_drops_content_with_its_last_reference() -> None:
    table = _core.ContentTable()
    big = bytes(range(256)) * 4096  # 1 MiB: hashed with the GIL released
    h = table.intern(big)
    assert table.intern(big) == h
    assert big in table and table.find(big) == h
    assert big[:-1] + b"!" not in table and table.find(big[:-1] + b"!") is None
    table.release(h)
    assert table.get(h) == big
    table.release(h)
    assert len(table) == 0 and table.content_bytes == 0
    with pytest.raises(KeyError, match=f"no content under handle {h}"):
        table.get(h)
    with pytest.raises(KeyError):
        table.release(h)
    assert table.refcount(h) == 0


def test_byte_count_grows_with_unique_content_only() -> None:
    table = _core.ContentTable()
    blob = b"x" * 100_000
    for _ in range(50):
        table.intern(blob)
    assert table.content_bytes == 100_000
    assert 100_000 <= table.nbytes < 110_000


def test_threads_interning_the_same_bodies_agree() -> None:
    table = _core.ContentTable()
    bodies = [bytes([i]) * (4096 + i) for i in range(8)] + [b"small %d" % i for i in range(8)]
    results: list[list[int]] = []

    def work() -> None:
        results.append([table.intern(body) for body in bodies for _ in range(20)])

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r == results[0] for r in results)
    assert len(table) == len(bodies)
    handles = sorted(set(results[0]))
    assert [table.refcount(h) for h in handles] == [80] * len(bodies)
    assert sorted(table.get(h) for h in handles) == sorted(bodies)


def test_a_rust_panic_is_a_python_exception_and_leaves_the_table_as_it_was() -> None:
    table = _core.ContentTable()
    handles = [table.intern(b"kept %d" % i) for i in range(5)]
    before = (len(table), table.content_bytes, table.nbytes, [table.get(h) for h in handles])
    with pytest.raises(BaseException) as caught:
        table._panic_for_tests(b"never stored")
    assert type(caught.value).__name__ == "PanicException"
    assert type(caught.value).__module__ == "pyo3_runtime"
    assert "panic for tests" in str(caught.value)
    after = (len(table), table.content_bytes, table.nbytes, [table.get(h) for h in handles])
    assert after == before
    assert table.find(b"never stored") is None
    # the lock the panic went through still works
    assert table.intern(b"kept 0") == handles[0]
    assert table.intern(b"new") not in handles

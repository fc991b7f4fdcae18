"""Threads: many rollouts recorded at once stay exact, shared and correctly linked."""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest
from support import assert_same, chat_turns, fresh, image_url, materialized, same, token_turns

from rollout_store import InvalidValueError, RolloutGraph, TurnNode

SHARED_IMAGES = [image_url(1000 + i, size=4096) for i in range(5)]
SYSTEM = "You are an agent. " * 100  # a long system prompt every thread re-sends


def _rollout(thread: int, n: int) -> list[dict[str, Any]]:
    """A rollout of `n` turns: messages for even threads, messages + tokens for odd ones.

    Every thread re-sends the same long system prompt and the same first user message, and
    attaches shared images as well as images of its own.
    """
    own = [image_url(10_000 * (thread + 1) + k, size=2048) for k in range(n)]
    images = [SHARED_IMAGES[k % 5] if k % 3 == 0 else own[k] for k in range(n)]
    turns = chat_turns(n, tag=f"thread {thread}", system=SYSTEM, images=images)
    # the same first user message in every thread: rollouts share a message prefix
    for fields in turns:
        fields["request_messages"][1]["content"][0]["text"] = "common task"
    if thread % 2:
        tokens = token_turns(n, start=1_000_000 * (thread + 1), root_prompt=list(range(100)))
        for fields, extra in zip(turns, tokens, strict=True):
            fields.update(extra)
    for k, fields in enumerate(turns):
        fields["sampling_params"] = {"temperature": 0.7, "seed": thread}
        fields["request_tools"] = [{"name": "click", "thread": thread % 2, "k": k % 2}]
    return turns


def _long_strings(turns: list[dict[str, Any]]) -> set[str]:
    found = set()
    stack: list[Any] = list(turns)
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)
        elif isinstance(value, str) and len(value) >= 1024:
            found.add(value)
    return found


def _run(n_threads: int, n_turns: int, readers: int, saboteurs: int) -> None:
    graph = RolloutGraph()
    rollouts = [_rollout(t, n_turns) for t in range(n_threads)]
    barrier = threading.Barrier(n_threads + readers + saboteurs)
    errors: list[BaseException] = []
    done = threading.Event()

    def writer(thread: int) -> None:
        try:
            barrier.wait()
            for k, fields in enumerate(rollouts[thread]):
                graph.add_turn(TurnNode(node_id=f"w{thread}-{k}", **fresh(fields)))
        except BaseException as exc:
            errors.append(exc)

    def reader() -> None:
        try:
            barrier.wait()
            while not done.is_set():
                for node_id in graph.node_ids()[-20:]:
                    thread, k = map(int, node_id[1:].split("-"))
                    got = materialized(graph, node_id)
                    for name, value in rollouts[thread][k].items():
                        assert same(got[name], value), (node_id, name)
        except BaseException as exc:
            errors.append(exc)

    def saboteur(s: int) -> None:
        """Adds turns with new long strings that are then rejected (blobs rolled back)."""
        try:
            barrier.wait()
            for k in range(n_turns):
                bad = [{"role": "user", "content": f"junk {s} {k} " * 200}, {"x": {1}}]
                try:
                    graph.add_turn(TurnNode(node_id=f"bad{s}-{k}", request_messages=bad))
                except InvalidValueError:
                    pass
                else:
                    raise AssertionError("a bad turn was accepted")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(n_threads)]
    threads += [threading.Thread(target=reader) for _ in range(readers)]
    threads += [threading.Thread(target=saboteur, args=(s,)) for s in range(saboteurs)]
    for thread in threads[:n_threads]:
        thread.start()
    for thread in threads[n_threads:]:
        thread.start()
    for thread in threads[:n_threads]:
        thread.join()
    done.set()
    for thread in threads[n_threads:]:
        thread.join()
    assert not errors, errors[:3]

    assert len(graph) == n_threads * n_turns
    assert sorted(graph.node_ids()) == sorted(
        f"w{t}-{k}" for t in range(n_threads) for k in range(n_turns)
    )
    for t, turns in enumerate(rollouts):
        for k, fields in enumerate(turns):
            got = materialized(graph, f"w{t}-{k}")
            for name, value in fields.items():
                assert_same(got[name], value)
        ids = [f"w{t}-{k}" for k in range(n_turns)]
        assert graph.path_ids(ids[-1]) == ids, t
        assert graph.root_of(ids[-1]) == ids[0]
        assert graph.link_kind(ids[1]) == ("tokens" if t % 2 else "messages")
    distinct = set().union(*map(_long_strings, rollouts))
    assert graph.stats()["blobs"] == len(distinct)
    assert len(graph.blobs) == len(distinct)
    assert sorted(graph.root_ids()) == sorted(f"w{t}-0" for t in range(n_threads))
    assert graph.discarded_ids() == []
    assert graph.fork_ids() == []


def test_eight_threads_fifty_turns_each():
    _run(n_threads=8, n_turns=50, readers=1, saboteurs=1)


@pytest.mark.slow
def test_many_threads_with_readers_and_rejected_turns():
    for _ in range(3):
        _run(n_threads=16, n_turns=80, readers=3, saboteurs=3)


def _tuple_chat(writer: int, n: int) -> list[dict[str, Any]]:
    """A chat rollout whose messages hold tuples (packed through a Python callback)."""
    history: list[Any] = [{"role": "user", "content": tuple((writer, i, (i,)) for i in range(30))}]
    turns = []
    for k in range(n):
        response = {"role": "assistant", "content": (writer, k, tuple(range(10)))}
        turns.append({"request_messages": list(history), "response_message": response})
        history = [*history, response, {"role": "user", "content": (k, "next")}]
    return turns


def test_queries_while_recording_do_not_disturb_linking():
    """discarded_nodes() / export_session() from other threads while turns are added."""
    graph = RolloutGraph()
    root = {"role": "user", "content": tuple((i, (i, i)) for i in range(40))}
    answer = {"role": "assistant", "content": "b"}
    graph.add_turn(
        TurnNode(
            node_id="r0",
            request_messages=[root],
            response_message={"role": "assistant", "content": "a"},
        )
    )
    graph.add_turn(TurnNode(node_id="r1", request_messages=[root], response_message=answer))
    graph.add_turn(TurnNode(node_id="c1", request_messages=[root, answer, {"role": "user"}]))
    assert graph.discarded_ids() == ["r0"]
    rollouts = [_tuple_chat(w, 60) for w in range(2)]
    stop = threading.Event()
    seen: list[Any] = []
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                found = graph.discarded_ids()
                if found != ["r0"]:
                    seen.append(found)
        except BaseException as exc:
            errors.append(exc)

    def writer(w: int) -> None:
        try:
            for k, fields in enumerate(rollouts[w]):
                graph.add_turn(TurnNode(node_id=f"w{w}-{k}", **fields))
        except BaseException as exc:
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        readers = [threading.Thread(target=reader) for _ in range(2)]
        writers = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
        for thread in readers + writers:
            thread.start()
        for thread in writers:
            thread.join()
        stop.set()
        for thread in readers:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    for w, turns in enumerate(rollouts):
        ids = [f"w{w}-{k}" for k in range(len(turns))]
        assert [graph.parent(n) for n in ids] == [None, *ids[:-1]]
        for node_id, fields in zip(ids, turns, strict=True):
            got = materialized(graph, node_id)
            for name, value in fields.items():
                assert_same(got[name], value)
    assert seen == []

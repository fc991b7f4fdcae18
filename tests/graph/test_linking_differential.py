"""Linking a large group of rollouts takes shortcuts (a parent's many children grouped by
length, a large bucket of one request held by its responses and its loosely linked
children, a large token length group held by its tokens): the same turns, added in the same
order, link exactly as they do with those shortcuts never taken, and as eagerly as can be,
over every kind of graph (in memory, over a memory or directory store, saved and loaded
half way). Plans are random (`linking_plan`): groups of 8 to 40 samples with duplicate
responses, exact and loose echoes, retries, failed calls, token ids, requests as JSON text,
and descendants arriving before their ancestors."""

from __future__ import annotations

import copy
import json
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from counting_store import CountingStore
from hypothesis import given, settings
from hypothesis import strategies as st
from linking_plan import add_plan, make_plan, outcome

from rollout_store import (
    DirectoryStore,
    MemoryStore,
    RawJSON,
    RolloutGraph,
    StringCache,
    TurnNode,
)
from rollout_store.engine import index, requests, stored

DATA = Path(__file__).resolve().parents[1] / "data"


@contextmanager
def _thresholds(small: int, many_kids: int) -> Iterator[None]:
    """Large groups from `small` items (index and buckets), many children from
    `many_kids`."""
    saved = index.SMALL, requests.SMALL, stored.MANY_KIDS
    index.SMALL = requests.SMALL = small
    stored.MANY_KIDS = many_kids
    try:
        yield
    finally:
        index.SMALL, requests.SMALL, stored.MANY_KIDS = saved


def _run(plan: list[dict[str, Any]], kind: str, tmp: Path) -> dict[str, Any]:
    store: Any = None
    if kind == "memory":
        store = MemoryStore()
    elif kind == "directory":
        tmp.mkdir()
        store = DirectoryStore(tmp, fsync=False)
    graph = RolloutGraph(store=store)
    if kind == "reloaded":
        half = len(plan) // 2
        errors = add_plan(graph, plan[:half], TurnNode, RawJSON)
        graph.save(tmp)
        graph = RolloutGraph.load(tmp)  # its lazily built indexes start empty
        errors += add_plan(graph, plan[half:], TurnNode, RawJSON)
    else:
        errors = add_plan(graph, plan, TurnNode, RawJSON)
    result = outcome(graph)
    result["errors"] = errors
    result["stats"] = graph.stats()
    return result


def _check(seed: int, kind: str, tmp: Path) -> None:
    plan = make_plan(seed)
    usual = _run(plan, kind, tmp / "usual")
    assert not usual["errors"]
    assert any(parent is not None for parent in usual["parents"])
    with _thresholds(10**9, 10**9):  # no shortcut taken
        plain = _run(plan, kind, tmp / "plain")
    with _thresholds(2, 1):  # every shortcut taken as early as it can be
        eager = _run(plan, kind, tmp / "eager")
    for other in (plain, eager):
        for field in ("parents", "links", "content", "stats", "errors"):
            assert other[field] == usual[field], (seed, kind, field)


@pytest.mark.parametrize("kind", ["memory_graph", "memory", "directory", "reloaded"])
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_large_groups_link_as_without_their_shortcuts(
    kind: str, seed: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    _check(seed, kind, tmp_path_factory.mktemp("plan"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["memory_graph", "memory", "directory", "reloaded"])
@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_large_groups_link_as_without_their_shortcuts_many_plans(
    kind: str, seed: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    _check(seed, kind, tmp_path_factory.mktemp("plan"))


@pytest.mark.parametrize("seed", [3, 17, 41])
def test_a_plan_links_as_the_invariants_say(seed: int) -> None:
    """Each turn's parent holds the longest request + response its own request starts with,
    or the longest prompt + sampled ids its prompt starts with (tokens first); a turn that
    none extends is a root."""
    plan = make_plan(seed)
    graph = RolloutGraph()
    assert not add_plan(graph, plan, TurnNode, RawJSON)
    ids = graph.node_ids()
    turns = [graph.get(node_id) for node_id in ids]
    for turn in turns:
        parent_id, kind = graph.parent(turn.node_id), graph.link_kind(turn.node_id)
        assert turn.node_id is not None
        if parent_id is None:
            assert kind == "none"
            continue
        parent = graph.get(parent_id)
        if kind == "tokens":
            full = [*parent.prompt_ids, *parent.sampled_ids]  # type: ignore[misc]
            assert turn.prompt_ids[: len(full)] == full  # type: ignore[index]
        else:
            assert kind == "messages"
            n = len(parent.request_messages)  # type: ignore[arg-type]
            assert json.dumps(turn.request_messages[:n]) == json.dumps(parent.request_messages)  # type: ignore[index]
            assert len(turn.request_messages) > n  # type: ignore[arg-type]


def test_turns_of_a_fixture_written_earlier_are_continued_by_new_turns(tmp_path: Path) -> None:
    """A file written by an earlier version holds request keys made by its packing: a new
    turn re-sending an old turn's request and response (JSON text too) links under it."""
    graph = RolloutGraph.load(DATA / "v2_inline_snapshot.rls")
    old = [
        graph.get(node_id)
        for node_id in graph.node_ids()
        if graph.get(node_id).request_messages and graph.get(node_id).response_message
    ]
    assert len(old) >= 3
    for k, turn in enumerate(old):
        messages = [
            *copy.deepcopy(list(turn.request_messages)),  # type: ignore[arg-type]
            copy.deepcopy(turn.response_message),
            {"role": "user", "content": f"more {k}"},
        ]
        request: Any = messages
        if k % 2:
            request = RawJSON(json.dumps(messages).encode())
        view = graph.add_turn(
            TurnNode(request_messages=request, response_message={"content": "ok"})
        )
        assert graph.parent(view.node_id) == turn.node_id, (k, turn.node_id)
        assert graph.link_kind(view.node_id) == "messages"


def test_a_deeply_nested_tool_call_in_a_large_bucket_leaves_its_linking_as_it_was() -> None:
    """A response whose tool call's arguments are deeply nested JSON text, among a large
    bucket of samples: holding the bucket's turns by their responses must not make a valid
    turn fail (the loose comparison of such a response is simply no match, as before), nor
    leave the bucket half held: every later continuation finds the sample it echoes."""
    deep = "[" * 600 + "]" * 600
    task = [{"role": "user", "content": "task"}]
    graph = RolloutGraph()
    samples, responses = [], []
    for k in range(10):
        response: dict[str, Any] = {"content": f"a{k}"}  # no role: an echo names it
        if k == 3:
            call = {"name": "f", "arguments": deep}
            response["tool_calls"] = [{"id": "c", "type": "function", "function": call}]
        responses.append(response)
        samples.append(graph.add_turn(TurnNode(request_messages=task, response_message=response)))
    echoes = [
        ({"role": "assistant", "content": "a8"}, 8),  # loose
        (copy.deepcopy(responses[3]), 3),  # exact, deep
        ({"role": "assistant", **copy.deepcopy(responses[3])}, 3),  # loose, deep
        ({"content": "a5"}, 5),  # exact
    ]
    for echo, k in echoes:
        request = [*task, echo, {"role": "user", "content": "go"}]
        view = graph.add_turn(TurnNode(request_messages=request))
        assert graph.parent(view.node_id) == samples[k].node_id, (echo, k)
        assert graph.link_kind(view.node_id) == "messages"


def test_a_twin_of_a_turn_whose_children_are_linked_by_tokens_fetches_nothing(
    tmp_path: Path,
) -> None:
    """A second turn with a stored turn's very request looks for continuations it may take
    from its twin: those linked by messages only. Its twin's children are linked by tokens,
    so nothing is compared, and its own response (a long string in the store) is not
    fetched back."""
    store = CountingStore(tmp_path)
    graph = RolloutGraph(store=store, cache=StringCache(0))
    task = [{"role": "user", "content": "task"}]
    first = {"role": "assistant", "content": "first " + "x" * 2000}
    sample = graph.add_turn(
        TurnNode(request_messages=task, response_message=first, prompt_ids=[1, 2], sampled_ids=[3])
    )
    child = graph.add_turn(
        TurnNode(
            request_messages=[*task, first, {"role": "user", "content": "go"}],
            response_message={"content": "ok"},
            prompt_ids=[1, 2, 3, 4],
            sampled_ids=[5],
        )
    )
    assert graph.parent(child.node_id) == sample.node_id
    assert graph.link_kind(child.node_id) == "tokens"
    before = store.gets
    twin = {"role": "assistant", "content": "twin " + "y" * 2000}
    graph.add_turn(TurnNode(request_messages=task, response_message=twin))
    assert store.gets == before
    assert graph.parent(child.node_id) == sample.node_id


class _CommitReadsStore(CountingStore):
    """A counting store that also counts the gets made while a turn is being committed
    (past the point where a failing get could still leave the graph as it was)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.in_commit = 0

    def get(self, key: bytes) -> bytes:
        if any(frame.name == "_commit" for frame in traceback.extract_stack()):
            self.in_commit += 1
        return super().get(key)


def test_a_continuation_moving_between_twins_is_committed_without_a_read(
    tmp_path: Path,
) -> None:
    """A continuation linked loosely to one sample moves to a later twin it echoes exactly:
    the echo it moves by was read before the commit, so committing the move reads nothing
    from the store (its record is kept there), even with no cache."""
    store = _CommitReadsStore(tmp_path)
    graph = RolloutGraph(store=store, cache=StringCache(0))
    task = [{"role": "user", "content": "task"}]
    text = "hello " + "h" * 300  # records kept in the store, no long string
    first = graph.add_turn(TurnNode(request_messages=task, response_message={"content": "a"}))
    loose = graph.add_turn(TurnNode(request_messages=task, response_message={"content": text}))
    echo = {"role": "assistant", "content": text}
    request = [*task, echo, {"role": "user", "content": "go " + "g" * 300}]
    child = graph.add_turn(TurnNode(request_messages=request, response_message={"content": "b"}))
    assert graph.parent(child.node_id) == loose.node_id
    exact = graph.add_turn(TurnNode(request_messages=task, response_message=dict(echo)))
    assert graph.parent(child.node_id) == exact.node_id
    assert first.node_id != exact.node_id
    assert store.in_commit == 0

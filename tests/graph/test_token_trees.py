"""Random token trees against a plain reference: retries that sample nothing (their prompt
shared with a sibling's packed prompt), continuations of those, forks inside a turn's
sampled ids, lengths around one block, in order and shuffled. What is read back, the token
parent found, the training sequences, and a log written in parts (reopened between them),
loaded, recovered and verified, all agree with what was put in."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_store import RolloutGraph, TurnNode
from rollout_store.files.storage import verify

Fields = dict[str, Any]


def _full(fields: Fields) -> list[int]:
    return list(fields["prompt_ids"]) + list(fields["sampled_ids"] or [])


@st.composite
def token_trees(draw: st.DrawFn) -> list[Fields]:
    """Turns of one tree of token calls, in the order they were made."""
    counter = iter(range(1000, 10**9))
    turns: list[Fields] = []
    for _ in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(["root", "retry", "continue", "fork"])) if turns else "root"
        if kind == "root":
            prompt = [next(counter) for _ in range(draw(st.sampled_from([1, 5, 63, 64, 65, 130])))]
        else:
            # mostly the latest turns: retries and their continuations follow each other
            pick = draw(st.integers(max(0, len(turns) - 3), len(turns) - 1))
            other = turns[pick]
            n_new = draw(st.sampled_from([0, 1, 3, 64]))
            if kind == "retry":  # the very prompt of an earlier call
                prompt = list(other["prompt_ids"])
            elif kind == "continue":  # its prompt + sampled ids + new ids
                prompt = _full(other) + [next(counter) for _ in range(n_new)]
            else:  # its prompt and part of its sampled ids, then new ids
                full = _full(other)
                cut = draw(st.integers(len(other["prompt_ids"]), len(full)))
                prompt = full[:cut] + [next(counter) for _ in range(n_new)]
            if not prompt:
                prompt = [next(counter)]
        shape = draw(st.sampled_from(["ids", "ids", "empty", "empty", "none"]))
        sampled: list[int] | None = None
        if shape == "ids":
            sampled = [next(counter) for _ in range(draw(st.sampled_from([1, 2, 64])))]
        elif shape == "empty":
            sampled = []
        logprobs: list[Any] | None = None
        if sampled is not None:
            lp = draw(st.sampled_from(["floats", "floats", "ints", "misaligned", "none"]))
            if lp == "floats":
                logprobs = [-(k + 1) / 8 for k in range(len(sampled))]
            elif lp == "ints":  # a JSON 0 from a client: kept as packed JSON, still aligned
                logprobs = [0] * len(sampled)
            elif lp == "misaligned":
                logprobs = [-0.5] * (len(sampled) + 1)
        turns.append({"prompt_ids": prompt, "sampled_ids": sampled, "sampled_logprobs": logprobs})
    return turns


def _snapshot(graph: RolloutGraph) -> list[Any]:
    out: list[Any] = []
    for node_id in graph.node_ids():
        node = graph.get(node_id)
        seq = graph.sequence_for(node_id)
        out.append(
            (
                node_id,
                graph.parent(node_id),
                graph.link_kind(node_id),
                node.prompt_ids,
                node.sampled_ids,
                json.dumps(node.sampled_logprobs),
                seq.input_ids,
                seq.loss_mask,
                json.dumps(seq.logprobs),
                seq.node_ids,
            )
        )
    return out


def _is_prefix(run: list[int], of: list[int]) -> bool:
    return len(run) <= len(of) and of[: len(run)] == run


def _parent_lengths(turns: list[Fields], i: int) -> tuple[int, int]:
    """The longest prompt + sampled run of an earlier turn, and of any other turn, that the
    prompt of turn `i` continues (-1: none); one as long as the prompt counts only when it
    sampled ids (one that did not is a failed call of that prompt, a sibling)."""
    prompt = turns[i]["prompt_ids"]
    earlier = anywhere = -1
    for j, other in enumerate(turns):
        full = _full(other)
        if j == i or not _is_prefix(full, prompt):
            continue
        if len(full) == len(prompt) and not other["sampled_ids"]:
            continue
        anywhere = max(anywhere, len(full))
        if j < i:
            earlier = max(earlier, len(full))
    return earlier, anywhere


def _expected_sequence(
    turns: list[Fields], by_id: dict[str, int], path: list[str]
) -> tuple[list[int], list[int], list[Any]]:
    """Input ids, loss mask and logprobs of the sequence ending at the last turn of `path`:
    each turn's sampled ids are trained on when its prompt + sampled ids start the leaf's and
    there is one real number (not a bool) a sampled id."""
    input_ids = _full(turns[by_id[path[-1]]])
    mask = [0] * len(input_ids)
    logprobs: list[Any] = [0.0] * len(input_ids)
    for node_id in path:
        fields = turns[by_id[node_id]]
        sampled, values = fields["sampled_ids"], fields["sampled_logprobs"]
        start, end = len(fields["prompt_ids"]), len(_full(fields))
        if not sampled or not _is_prefix(_full(fields), input_ids) or values is None:
            continue
        if len(values) != len(sampled) or not all(type(v) in (int, float) for v in values):
            continue
        mask[start:end] = [1] * (end - start)
        logprobs[start:end] = values
    return input_ids, mask, logprobs


def _check_against_reference(graph: RolloutGraph, turns: list[Fields], in_order: bool) -> None:
    by_id = {f"turn-{i}": i for i in range(len(turns))}
    for i, fields in enumerate(turns):
        node_id = f"turn-{i}"
        node = graph.get(node_id)
        assert node.prompt_ids == fields["prompt_ids"], i
        assert node.sampled_ids == fields["sampled_ids"], i
        assert json.dumps(node.sampled_logprobs) == json.dumps(fields["sampled_logprobs"]), i
        parent = graph.parent(node_id)
        got = -1 if parent is None else len(_full(turns[by_id[parent]]))
        if parent is not None:
            assert graph.link_kind(node_id) == "tokens", i
            assert _is_prefix(_full(turns[by_id[parent]]), fields["prompt_ids"]), i
        earlier, anywhere = _parent_lengths(turns, i)
        # found deepest first; a turn that arrives later re-links it only deeper
        assert got <= anywhere, i
        if in_order:
            assert got >= earlier, i
            if earlier == anywhere:
                assert got == earlier, i
        seq = graph.sequence_for(node_id)
        input_ids, mask, logprobs = _expected_sequence(turns, by_id, graph.path_ids(node_id))
        assert seq.input_ids == input_ids, i
        assert seq.loss_mask == mask, i
        assert json.dumps(seq.logprobs) == json.dumps(logprobs), i


@given(turns=token_trees(), shuffle=st.booleans(), data=st.data())
def test_random_token_trees_match_a_plain_reference(
    turns: list[Fields], shuffle: bool, data: st.DataObject
) -> None:
    if shuffle:
        turns = data.draw(st.permutations(turns))
    graph = RolloutGraph()
    for fields in turns:
        graph.add_turn(TurnNode(**fields))
    _check_against_reference(graph, turns, in_order=not shuffle)


@given(turns=token_trees(), data=st.data())
def test_random_token_trees_read_back_from_a_log_written_in_parts(
    turns: list[Fields], data: st.DataObject, tmp_path_factory: Any
) -> None:
    graph = RolloutGraph()
    for fields in turns:
        graph.add_turn(TurnNode(**fields))
    expected = _snapshot(graph)
    path: Path = tmp_path_factory.mktemp("log") / "tree.rls"
    cut = data.draw(st.integers(0, len(turns)))
    for part in (turns[:cut], turns[cut:]):  # the second part after reopening the log
        with RolloutGraph.open(path, fsync="never") as log:
            for fields in part:
                log.add_turn(TurnNode(**fields))
    assert _snapshot(RolloutGraph.load(path)) == expected
    assert _snapshot(RolloutGraph.load(path, recover=True)) == expected
    assert verify(path).error is None
    with RolloutGraph.open(path, fsync="never") as reopened:
        assert _snapshot(reopened) == expected


@pytest.mark.parametrize(
    "calls",
    [
        # a call, a failed call of its very run, then two that continue that run
        {
            "t0": ([1, 2, 3], [4]),
            "t1": ([1, 2, 3, 4], []),
            "t3": ([1, 2, 3, 4, 5, 6], []),
            "t2": ([1, 2, 3, 4, 5, 6, 7, 8], [9]),
        },
        # the same over a block: the failed call is found by block digests
        {
            "t0": (list(range(1, 64)), [64]),
            "t1": (list(range(1, 65)), []),
            "t3": (list(range(1, 67)), [67]),
            "t2": (list(range(1, 70)), [70]),
        },
    ],
)
def test_a_failed_call_of_a_run_links_the_same_in_every_arrival_order(
    calls: dict[str, tuple[list[int], list[int]]],
) -> None:
    # Found by review: a late failed call adopted what continued its parent's run, and what
    # hung under it was never moved to a later, deeper turn, so the links depended on order.
    outcomes = set()
    for order in itertools.permutations(calls):
        graph = RolloutGraph()
        for name in order:
            prompt, sampled = calls[name]
            graph.add_turn(TurnNode(prompt_ids=prompt, sampled_ids=sampled, node_id=name))
        outcomes.add(tuple((name, graph.parent(name)) for name in sorted(calls)))
    assert outcomes == {(("t0", None), ("t1", "t0"), ("t2", "t3"), ("t3", "t0"))}

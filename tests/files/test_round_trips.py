"""What conftest.py adds to every run: the save/load check every test gets (round_trips.py)
fails on a broken round trip, checks every new shape of graph and skips only a shape it
checked before; the run's summary says how many slow tests were left out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from round_trips import RoundTrips, graph_snapshot, same_answers, shape_of

from rollout_store import RolloutGraph, TurnNode
from rollout_store.files import storage


def chain(text: str, turns: int = 3, **fields: Any) -> RolloutGraph:
    graph = RolloutGraph()
    messages: list[Any] = [{"role": "user", "content": text}]
    for i in range(turns):
        answer = {"role": "assistant", "content": f"{text} {i}"}
        graph.add_turn(TurnNode(request_messages=list(messages), response_message=answer, **fields))
        messages += [answer, {"role": "user", "content": "next"}]
    return graph


def _dropping_finish_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer that loses each turn's finish_reason: a broken round trip."""
    record = storage._Writer._record

    def lossy(self: Any, entry: Any, values: Any, refs: Any) -> storage.TurnRecord:
        written = record(self, entry, values, refs)
        return written._replace(meta=written.meta._replace(finish_reason=None))

    monkeypatch.setattr(storage._Writer, "_record", lossy)


def test_a_broken_round_trip_fails_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checker = RoundTrips()
    checker.check([chain("a", finish_reason="stop")], tmp_path)  # intact: passes
    assert checker.checked == 1
    _dropping_finish_reason(monkeypatch)
    with pytest.raises(AssertionError):  # a shape it has not seen: loaded and compared
        RoundTrips().check([chain("a", finish_reason="stop")], tmp_path)


def test_a_graph_of_a_checked_shape_is_saved_but_not_compared_again(tmp_path: Path) -> None:
    checker = RoundTrips()
    checker.check([chain("a"), chain("b " * 600)], tmp_path)  # the second holds a blob
    assert (checker.checked, checker.skipped) == (2, 0)
    checker.check([chain("c"), chain("d")], tmp_path)  # other text, the first one's shape
    assert (checker.checked, checker.skipped) == (2, 2)
    every = RoundTrips(every=True)
    every.check([chain("c"), chain("d")], tmp_path)
    assert (every.checked, every.skipped) == (2, 0)


@pytest.mark.parametrize(
    "other",
    [
        lambda: chain("a", turns=1),  # a single turn: no chain
        lambda: chain("a", finish_reason="stop"),  # a scalar field set
        lambda: chain("a", prompt_ids=[1, 2], sampled_ids=[3]),  # token ids
        lambda: chain("a", prompt_ids=[2**40], sampled_ids=[3]),  # ids beyond 32 bits
        lambda: chain("\ud800"),  # a lone surrogate
        lambda: chain("a", request_tools=[{"type": "function"}]),  # a shared value
        lambda: chain("a", sampled_logprobs=[{"not": "a number"}]),  # logprobs as JSON
    ],
)
def test_each_difference_of_shape_is_checked(other: Any, tmp_path: Path) -> None:
    first = tmp_path / "first.rls"
    chain("a").save(first)
    second = tmp_path / "second.rls"
    other().save(second)
    assert shape_of(first.read_bytes()) != shape_of(second.read_bytes())


def test_longer_chains_of_one_shape_are_one_shape(tmp_path: Path) -> None:
    shapes = set()
    for turns in (3, 4, 9):
        path = tmp_path / f"{turns}.rls"
        chain("a", turns=turns).save(path)
        shapes.add(shape_of(path.read_bytes()))
    assert len(shapes) == 1


def test_a_fork_and_a_chain_differ_in_shape(tmp_path: Path) -> None:
    fork = RolloutGraph()
    root = [{"role": "user", "content": "q"}]
    fork.add_turn(TurnNode(request_messages=root, response_message={"role": "assistant"}))
    for text in ("x", "y"):
        fork.add_turn(
            TurnNode(
                request_messages=[*root, {"role": "assistant"}, {"role": "user", "content": text}]
            )
        )
    fork.save(tmp_path / "fork.rls")
    chain("a").save(tmp_path / "chain.rls")
    shapes = {shape_of((tmp_path / f"{name}.rls").read_bytes()) for name in ("fork", "chain")}
    assert len(shapes) == 2


@pytest.mark.parametrize(
    ("one", "other", "alike"),
    [
        (1, 1.0, False),  # equal in Python, not in JSON
        (True, 1, False),
        (0.0, -0.0, False),
        (float("nan"), float("nan"), True),  # unequal in Python, alike in JSON
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}, False),  # key order
        ([1, [2]], [1, [3]], False),
        ("\ud800", "\ud800", True),
        ([1, 2], (1, 2), False),  # dumped alike, stored (and counted) apart
        ([1, 2, 3], [1, 2.0, 3], False),  # lists of scalars, compared whole
        ([1, True], [1, 1], False),
        ([0.5, 0.0], [0.5, -0.0], False),
        ([0.5, float("nan")], [0.5, float("nan")], True),
        (["a", None, 7], ["a", None, 7], True),
    ],
)
def test_the_comparison_is_that_of_the_snapshots(one: Any, other: Any, alike: bool) -> None:
    """`same_answers` (what the check runs) says what comparing `graph_snapshot`s says."""
    graphs = [chain("a", request_tools=[{"type": "function", "x": v}]) for v in (one, other)]
    assert (graph_snapshot(graphs[0]) == graph_snapshot(graphs[1])) is alike
    assert same_answers(*graphs) is alike


def test_the_run_says_how_many_slow_tests_it_left_out() -> None:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/project/test_readme_server.py",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(root)},
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:]
    line = "2 slow tests (stress, fuzz, browser, subprocess servers) were left out"
    assert f"{line}; run them with: python -m pytest -q -m slow" in proc.stdout

"""Ints with more digits than a default process writes as text, recorded where the limit
was raised: the files hold them intact, and a default process reads, verifies and re-saves
them without touching its own limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_store import RolloutGraph, export_session
from rollout_store.engine.encoding import int_digits, int_from_digits
from rollout_store.files.storage import verify


def _raised() -> Iterator[None]:
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(before)


_WRITER = """
import json, sys
sys.set_int_max_str_digits(0)
from rollout_store import RolloutGraph, TurnNode, export_session
big = [10**5000 + 7, -(3**100_000), 2**40_000 - 1]
nodes = [
    {
        "prompt_ids": [1, 2, 3],
        "sampled_ids": [4, big[2]],
        "request_messages": [{"role": "user", "content": [big[0], "x" * 2000]}],
        "response_message": {"role": "assistant", "content": big[1]},
    },
    {
        "prompt_ids": [1, 2, 3, 4, big[2], 9],
        "sampled_ids": [big[0]],
        "request_messages": [
            {"role": "user", "content": [big[0], "x" * 2000]},
            {"role": "assistant", "content": big[1]},
            {"role": "user", "content": "again"},
        ],
        "sampling_params": {"seed": big[1]},
    },
]
folder = sys.argv[1]
graph = RolloutGraph()
log = RolloutGraph.open(folder + "/log.rls")
for node in nodes:
    graph.add_turn(TurnNode(**node))
    log.add_turn(TurnNode(**node))
log.close()
graph.save(folder + "/snap.rls")
with open(folder + "/expected.json", "w") as out:
    out.write(json.dumps(export_session(graph, include_messages=True)))
"""


def _write(tmp_path: Path) -> tuple[Path, Path, str]:
    """A snapshot and a log of the same turns, written by another process that raised its
    limit, and the export's json.dumps there."""
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run([sys.executable, "-c", _WRITER, str(tmp_path)], check=True, env=env, timeout=120)
    expected = (tmp_path / "expected.json").read_text()
    return tmp_path / "snap.rls", tmp_path / "log.rls", expected


@pytest.mark.parametrize("kind", ["snapshot", "log"])
def test_a_file_with_huge_ints_loads_verifies_and_resaves_in_a_default_process(
    kind: str, tmp_path: Path
) -> None:
    snap, log, expected = _write(tmp_path)
    path = snap if kind == "snapshot" else log
    limit = sys.get_int_max_str_digits()
    assert 0 < limit < 5000  # a default process: the ints cannot be written as text here
    report = verify(path)
    assert report.error is None, report.error
    graph = RolloutGraph.load(path)
    graph.save(tmp_path / "again.rls")
    assert verify(tmp_path / "again.rls").error is None
    again = RolloutGraph.load(tmp_path / "again.rls")
    assert sys.get_int_max_str_digits() == limit
    # json.dumps cannot write these ints here: export fails as json.dumps does
    with pytest.raises(ValueError, match="digits"):
        json.dumps(export_session(graph, include_messages=True))
    for _ in _raised():
        assert json.dumps(export_session(graph, include_messages=True)) == expected
        assert json.dumps(export_session(again, include_messages=True)) == expected


@pytest.mark.parametrize(
    "n",
    [0, 7, -7, 10**599, 10**600, -(10**600) + 1, 3**20_000, -(2**9_000)],
    ids=["0", "7", "-7", "599", "600", "-600", "3^20000", "-2^9000"],
)
def test_int_digits_round_trips_under_the_lowest_limit(n: int) -> None:
    for _ in _raised():
        text = str(n)
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    try:
        assert int_digits(n) == text
        assert int_from_digits(text.encode("ascii")) == n
    finally:
        sys.set_int_max_str_digits(before)


@pytest.mark.parametrize(
    "payload",
    [b"", b"-", b"+" + b"1" * 700, b" " + b"1" * 700, b"1_0" * 300, b"--" + b"1" * 700],
    ids=["empty", "minus", "plus", "space", "underscore", "two-minus"],
)
def test_a_payload_that_is_not_decimal_digits_is_damage(payload: bytes) -> None:
    with pytest.raises(ValueError):
        int_from_digits(payload)

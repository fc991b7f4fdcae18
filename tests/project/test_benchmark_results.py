"""Benchmarks write to a gitignored folder unless asked, and count targets met and missed; the
retained bytes they measure count the engine's BLAKE3 states (a graph's tips) once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollout_store import RolloutGraph, TurnNode
from rollout_store.engine import confirm

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import measure  # noqa: E402


def test_targets_summary_counts_each_verdict() -> None:
    checks = ["PASS  a", "MISS  b", "PASS  c", "SKIP  d"]
    assert measure.targets_summary(checks) == "targets: 2 met, 1 missed, 1 not run (of 4)"
    assert measure.targets_summary(["PASS  a"]) == "targets: 1 met, 0 missed (of 1)"


def test_default_results_folder_is_ignored_by_git() -> None:
    assert measure.results_dir(False) == measure.LOCAL_RESULTS
    probe = measure.LOCAL_RESULTS / "file_format.json"
    try:
        proc = subprocess.run(
            ["git", "check-ignore", "-q", str(probe)], cwd=BENCH, check=False, timeout=30
        )
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if proc.returncode == 128:
        pytest.skip("not a git checkout")
    assert proc.returncode == 0  # ignored
    tracked = subprocess.run(
        ["git", "check-ignore", "-q", str(measure.TRACKED_RESULTS / "file_format.json")],
        cwd=BENCH,
        check=False,
        timeout=30,
    )
    assert tracked.returncode == 1  # not ignored


SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if "def main(" in p.read_text())


def test_every_benchmark_script_is_found() -> None:
    assert {"demo.py", "file_format.py", "memory_per_turn.py", "seed_report.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_ends_with_the_targets_summary(script: str) -> None:
    text = (BENCH / script).read_text()
    assert "targets_summary(" in text
    if "write_text(" in text:  # writes results: to the untracked folder unless asked
        assert "results_dir(args.update_results)" in text and "add_results_option(" in text


def test_the_capture_servers_warm_up_group_shares_no_content_with_the_measured_one() -> None:
    """The memory runs warm up with a group of the same shape: nothing in it may be a long
    string (or a tool list) of the measured group, or the store would hold it before the
    measured group comes and the figure would miss it."""
    import capture_server

    def strings(value: object) -> set[str]:
        if isinstance(value, str):
            return {value} if len(value) >= 64 else set()
        if isinstance(value, dict):
            return set().union(*map(strings, value.values())) if value else set()
        if isinstance(value, list):
            return set().union(*map(strings, value)) if value else set()
        return set()

    measured, warm = capture_server.task(0), capture_server.task(1)
    assert len(str(warm)) == pytest.approx(len(str(measured)), rel=0.05)  # the same shape
    assert not strings(measured) & strings(warm)
    assert capture_server.OTHER_TOOLS != capture_server.TOOLS
    for seed in range(capture_server.SESSIONS):  # screenshots of the large group too
        assert capture_server.screenshot(seed + 100, 0) != capture_server.screenshot(seed, 0)


def _screenshot_turns(seed: int, n_turns: int) -> list[tuple[list[Any], dict[str, Any]]]:
    """A conversation sending a new long (blob) string each turn: a graph keeps its tip."""
    history: list[Any] = [{"role": "system", "content": "sys"}]
    turns = []
    for t in range(n_turns):
        image = f"data:image/png;base64,{seed:04d}{t:04d}" + "A" * (confirm.HOLE_MIN + 100)
        content = [
            {"type": "text", "text": f"step {t}"},
            {"type": "image_url", "image_url": {"url": image}},
        ]
        history.append({"role": "user", "content": content})
        response = {"role": "assistant", "content": f"reply {t} {seed}"}
        turns.append((json.loads(json.dumps(history)), response))
        history.append(response)
    return turns


def test_retained_bytes_count_each_tips_blake3_state_once() -> None:
    """A decoded tip's BLAKE3 states live in the request table's heap, which tracemalloc
    does not see: the engine's count (`nbytes`) holds them, so the retained bytes hold each
    tip once (not missed, not twice), and letting the tips go frees that much."""
    conversations = [_screenshot_turns(seed, 3) for seed in range(40)]
    with measure.traced() as measured:
        graph = RolloutGraph()
        for turns in conversations:
            for messages, response in turns:
                graph.add_turn(TurnNode(request_messages=messages, response_message=response))
        table = graph._requests.table
        assert table.decoded_tips == len(conversations)
        with_tips, engine_with = measured.retained(), measure.engine_bytes()
        graph._requests.table.drop_tips()
        assert table.decoded_tips == 0
        without_tips, engine_without = measured.retained(), measure.engine_bytes()
        freed = with_tips - without_tips
        size = (engine_with - engine_without) / len(conversations)
        # two BLAKE3 states a tip, held compactly (the engine's `digest::State`: chaining
        # values and a last chunk each, where BLAKE3's own state takes about 1.9 KB)
        assert 2 * 32 < size < 1800, size
        # the retained bytes fell by what the engine let go (its strings' references aside)
        assert 0.95 < freed / (engine_with - engine_without) < 1.1, (freed, size)

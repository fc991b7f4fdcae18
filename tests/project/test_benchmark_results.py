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
from rollout_store._core import Blake3
from rollout_store.engine import confirm
from rollout_store.engine import requests as requests_module

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


def test_retained_bytes_count_each_tips_blake3_state_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tip's BLAKE3 state lives inside its `_core.Blake3` object, allocated by the
    interpreter's object allocator: tracemalloc sees it, so the retained bytes hold each
    state once, and the engine's own count (heap tracemalloc does not see) adds nothing."""
    monkeypatch.setattr(requests_module, "TIP_MIN_BYTES", 0)  # a tip for every conversation
    conversations = [_screenshot_turns(seed, 3) for seed in range(40)]
    with measure.traced() as measured:
        graph = RolloutGraph()
        for turns in conversations:
            for messages, response in turns:
                graph.add_turn(TurnNode(request_messages=messages, response_message=response))
        engine_with = measure.engine_bytes()
        with_states = measured.retained()
        tips = list(graph._requests.tips._by_turn.values())
        assert len(tips) == len(conversations)
        states = [tip.plain_state for tip in tips]
        assert all(type(state) is Blake3 for state in states)
        assert len({id(state) for state in states}) == len(tips)
        size = sys.getsizeof(states[0])  # the object, its BLAKE3 state inside
        assert size > 1800  # (BLAKE3's state: about 2 KB)
        for tip in tips:
            tip.plain_state = None
        del states, tip
        without_states = measured.retained()
        assert measure.engine_bytes() == engine_with
        freed = with_states - without_states
        # each state counted once (not missed, not twice), give or take the bytes around it
        assert 0.9 < freed / (len(tips) * size) < 1.1, (freed, len(tips), size)

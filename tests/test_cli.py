"""The `rollout-store` command: info, verify, export, and damaged files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_store import RolloutGraph, TurnNode, export_session, iter_turn_records
from rollout_store.cli import main


@pytest.fixture
def rollout_file(tmp_path: Path) -> Path:
    path = tmp_path / "r.rls"
    with RolloutGraph.open(path) as graph:
        messages: list = [{"role": "system", "content": "s" * 2000}]
        for k in range(4):
            messages.append({"role": "user", "content": f"question {k}"})
            response = {"role": "assistant", "content": f"answer {k}"}
            graph.add_turn(
                TurnNode(
                    request_messages=list(messages),
                    response_message=response,
                    prompt_ids=list(range(10 * (k + 1))),
                    sampled_ids=[1, 2],
                    sampled_logprobs=[-0.5, -0.25],
                )
            )
            messages.append(response)
    return path


def test_info(rollout_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(rollout_file)]) == 0
    out = capsys.readouterr().out
    lines = {line.split("  ")[0].strip(): line.split("  ")[-1].strip() for line in out.splitlines()}
    assert lines["turns"] == "4"
    assert lines["roots"] == "4"  # token prompts do not extend each other here
    assert lines["blobs"] == "1"
    assert "dedup ratio (long strings)" in lines


def test_verify_ok_and_damaged(rollout_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(rollout_file)]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    data = bytearray(rollout_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rollout_file.write_bytes(bytes(data))
    assert main(["verify", str(rollout_file)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("damaged: ") and "offset" in err
    assert len(err.splitlines()) == 1


def test_export_json_equals_export_session(rollout_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    assert main(["export", str(rollout_file), "--messages", "-o", str(out)]) == 0
    graph = RolloutGraph.load(rollout_file)
    assert out.read_text() == json.dumps(export_session(graph, include_messages=True)) + "\n"


def test_export_jsonl(rollout_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    assert main(["export", str(rollout_file), "--jsonl", "-o", str(out)]) == 0
    graph = RolloutGraph.load(rollout_file)
    lines = out.read_text().splitlines()
    assert lines == [json.dumps(record) for record in iter_turn_records(graph)]


def test_export_of_truncated_file_fails_with_one_line(
    rollout_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rollout_file.write_bytes(rollout_file.read_bytes()[:-7])
    assert main(["export", str(rollout_file)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "ends inside" in err


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tmp_path / "nope.rls")]) == 1
    assert "nope.rls" in capsys.readouterr().err


def test_console_script_runs(rollout_file: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rollout_store.cli", "--progress", "verify", str(rollout_file)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok: ")

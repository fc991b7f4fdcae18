"""benchmarks/turn_cpu.py compares two checkouts turn by turn (here, this one with itself)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_turn_cpu_prints_a_row_per_turn_and_the_sums() -> None:
    script = ROOT / "benchmarks" / "turn_cpu.py"
    args = [sys.executable, str(script), "--against", str(ROOT), "--workloads", "chatty"]
    args += ["--turns", "3", "--graphs", "2", "--rounds", "2"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout
    lines = out.strip().splitlines()
    assert lines[0].startswith("chatty: add_turn thread CPU us, 2 fresh graphs x 2 rounds")
    rows = [line.split() for line in lines[2:6]]
    assert [row[0] for row in rows] == ["1", "2", "3", "sum"]
    assert lines[6] == ""
    assert lines[7].split()[:2] in (["PASS", "chatty:"], ["MISS", "chatty:"])
    assert lines[8] in ("targets: 1 met, 0 missed (of 1)", "targets: 0 met, 1 missed (of 1)")
    for row in rows:
        this_min, other_min, ratio = (float(x) for x in row[1:4])
        assert this_min > 0 and other_min > 0
        assert abs(ratio - this_min / other_min) < 0.01


def test_turn_cpu_refuses_a_folder_without_the_library(tmp_path: Path) -> None:
    script = ROOT / "benchmarks" / "turn_cpu.py"
    args = [sys.executable, str(script), "--against", str(tmp_path)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert "holds no rollout_store/ folder" in proc.stderr

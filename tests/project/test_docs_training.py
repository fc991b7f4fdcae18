"""The python example of docs/training.md runs as written, in an empty folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def test_training_doc_example_runs(tmp_path: Path) -> None:
    (block,) = re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), flags=re.S | re.M)
    script = tmp_path / "example.py"
    script.write_text(block)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(DOC.parent.parent)},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "tokens packed" in proc.stdout and (tmp_path / "group.parquet").exists()

"""Every ```python block of README.md runs as written, each on its own, in an empty folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
ALL_BLOCKS = re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)
#: The capture server's examples talk to the server its shell block starts on port 8100; the
#: server's own tests run that flow. Every other block runs here.
NEEDS_SERVER = "127.0.0.1:8100"
BLOCKS = [block for block in ALL_BLOCKS if NEEDS_SERVER not in block]


def test_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 2  # the quick start and the Use section
    assert len(ALL_BLOCKS) - len(BLOCKS) <= 2  # only the capture server's examples are left out


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index: int, tmp_path: Path) -> None:
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(BLOCKS[index])
    root = str(README.parent)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": root},
        check=False,
    )
    assert proc.returncode == 0, f"README python block {index} failed:\n{proc.stderr}"

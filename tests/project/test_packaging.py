"""The wheel builds without warnings and carries the viewer's files, the license and metadata."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_builds_cleanly(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy: the build leaves build/ and egg-info behind
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "*.egg-info", "__pycache__", "out", "target", "*.so"
        ),
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    wheels = tmp_path / "wheels"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-w", str(wheels), "-v"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    build_output = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if "warning" in line.lower() and "Location 'file:" not in line
    ]
    assert build_output == []
    (wheel,) = wheels.glob("rollout_store-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = next(archive.read(n) for n in names if n.endswith(".dist-info/METADATA"))
    for name in ("index.html", "viewer.js", "viewer.css"):
        assert f"rollout_store/viewer/static/{name}" in names
    assert "rollout_store/__main__.py" in names and "rollout_store/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    text = metadata.decode()
    assert "License-Expression: MIT" in text
    assert "Requires-Dist: tqdm" in text
    # the long description links no picture by a relative path (it would break off GitHub)
    assert "](benchmarks/" not in text and 'src="benchmarks/' not in text

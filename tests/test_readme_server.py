"""The README's capture server examples run as written: its shell block starts the stub
engine and the server, then each of its Python blocks runs on its own against them.

The ports the README names (8000, 8100) are swapped for free ones throughout, the install
line is left out (this environment has the packages), and `rollout-store` / `python` are
this interpreter; every other word is the README's.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from services import free_port

from rollout_store.loopback import wait_for_port

ROOT = Path(__file__).resolve().parent.parent
TEXT = (ROOT / "README.md").read_text()
SECTION = TEXT[TEXT.index("## Capture server") :]
SECTION = SECTION[: SECTION.index("\n## ", 3)]
SHELL = re.findall(r"^```sh\n(.*?)^```$", SECTION, flags=re.S | re.M)
PYTHON = re.findall(r"^```python\n(.*?)^```$", SECTION, flags=re.S | re.M)
PORTS = ("8000", "8100")


def test_the_section_has_its_examples() -> None:
    assert len(SHELL) == 1 and "rollout-store serve" in SHELL[0]
    assert len(PYTHON) == 2 and all("127.0.0.1:8100" in block for block in PYTHON)


def _ported(text: str, ports: dict[str, str]) -> str:
    return re.sub(r"\b(8000|8100)\b", lambda m: ports[m.group(1)], text)


def _commands(block: str, ports: dict[str, str]) -> list[list[str]]:
    commands = []
    for line in _ported(block, ports).splitlines():
        line = line.split("#", 1)[0].strip().rstrip("&").strip()
        if not line or line.startswith("python -m pip install"):
            continue
        argv = shlex.split(line)
        if argv[0] == "rollout-store":
            argv = [sys.executable, "-m", "rollout_store.cli", *argv[1:]]
        elif argv[0] == "python":
            argv = [sys.executable, *argv[1:]]
        commands.append(argv)
    return commands


def test_the_quick_start_and_the_group_run_as_written(tmp_path: Path) -> None:
    ports = {port: str(free_port()) for port in PORTS}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    commands = _commands(SHELL[0], ports)
    assert len(commands) == 2  # the stub, then the server
    children = []
    try:
        for argv, port in zip(commands, PORTS, strict=True):
            children.append(
                subprocess.Popen(
                    argv,
                    cwd=tmp_path,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
            wait_for_port(int(ports[port]), timeout=30)
        outputs = []
        for index, block in enumerate(PYTHON):
            script = tmp_path / f"server_block_{index}.py"
            script.write_text(_ported(block, ports))
            proc = subprocess.run(
                [sys.executable, str(script)],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert proc.returncode == 0, f"README server block {index} failed:\n{proc.stderr}"
            outputs.append(proc.stdout)
        assert "'n_turns': 1" in outputs[0]
        assert outputs[1].strip() == "16 sequences of tokens"
        assert list((tmp_path / "rollouts").glob("*.rls"))  # the server's --data folder
    finally:
        for child in reversed(children):
            child.terminate()
            try:
                child.wait(20)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(20)

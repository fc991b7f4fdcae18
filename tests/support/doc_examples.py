"""The code examples of README.md and docs/*.md, found and run the one way every doc test uses.

A ```python block runs on its own, as a script in an empty folder, with this checkout on
PYTHONPATH. A block that talks to the capture server (it names 127.0.0.1:8100) runs against
the server its section's ```sh block starts: the ports the docs name (8000, 8100) are swapped
for free ones, the install line is left out (this environment has the packages), and
`rollout-store` / `python` are this interpreter; every other word is the docs'. A ```sh block
of `rollout-store` commands runs line by line in a folder where the README's quick start ran.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from services import free_port

from rollout_store.serve.loopback import wait_for_port

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: README first, then every page of the docs site (the API pages hold no code blocks).
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
#: Blocks that name this address need the capture server their section starts.
NEEDS_SERVER = "127.0.0.1:8100"
PORTS = ("8000", "8100")


def blocks(text: str, language: str) -> list[str]:
    """The fenced blocks of `language` in `text`, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", text, flags=re.S | re.M)


def section(path: Path, heading: str) -> str:
    """The section of `path` under `heading` (a `## ` line), up to the next `## ` heading."""
    text = path.read_text()
    start = text.index(f"\n{heading}\n") + 1
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def page_name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def python_examples() -> list[tuple[str, int, str]]:
    """(page, index, block) of every ```python block that needs no capture server."""
    found = []
    for path in PAGES:
        for index, block in enumerate(blocks(path.read_text(), "python")):
            if NEEDS_SERVER not in block:
                found.append((page_name(path), index, block))
    return found


def server_examples() -> list[tuple[str, str]]:
    """(page, block) of every ```python block that talks to the capture server."""
    return [
        (page_name(path), block)
        for path in PAGES
        for block in blocks(path.read_text(), "python")
        if NEEDS_SERVER in block
    ]


def run_python(block: str, folder: Path, name: str, timeout: float = 120) -> str:
    """Run `block` as the script `name` in `folder`; its stdout. Fails with its stderr."""
    script = folder / name
    script.write_text(block)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stderr}"
    return proc.stdout


def _ported(text: str, ports: dict[str, str]) -> str:
    return re.sub(r"\b(8000|8100)\b", lambda m: ports[m.group(1)], text)


def shell_commands(block: str, ports: dict[str, str] | None = None) -> list[list[str]]:
    """The commands of a ```sh block, one a line (comments, `&` and installs left out)."""
    commands = []
    text = _ported(block, ports) if ports else block
    for line in text.splitlines():
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


def run_server_section(shell: str, python: list[str], folder: Path) -> list[str]:
    """Start the stub engine and the server as `shell` says, run each of `python` against
    them in `folder`, stop both; the blocks' stdouts."""
    ports = {port: str(free_port()) for port in PORTS}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    commands = shell_commands(shell, ports)
    assert len(commands) == 2  # the stub, then the server
    children = []
    try:
        for argv, port in zip(commands, PORTS, strict=True):
            children.append(
                subprocess.Popen(
                    argv,
                    cwd=folder,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
            wait_for_port(int(ports[port]), timeout=30)
        return [
            run_python(_ported(block, ports), folder, f"server_block_{index}.py")
            for index, block in enumerate(python)
        ]
    finally:
        for child in reversed(children):
            child.terminate()
            try:
                child.wait(20)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(20)

"""The capture server's examples run as written: a section's shell block starts the stub
engine and the server, then each of its Python blocks runs on its own against them (see
`doc_examples`): the quick start and the GRPO group of docs/server.md, and the README's
server in ten lines.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from doc_examples import DOCS, README, blocks, run_server_section, section

SECTION = section(DOCS / "server.md", "## Quick start")
SHELL = blocks(SECTION, "sh")
PYTHON = blocks(SECTION, "python")
README_SECTION = section(README, "## Capture server")


def test_the_section_has_its_examples() -> None:
    assert len(SHELL) == 1 and "rollout-store serve" in SHELL[0]
    assert len(PYTHON) == 2 and all("127.0.0.1:8100" in block for block in PYTHON)


@pytest.mark.slow
def test_the_quick_start_and_the_group_run_as_written(tmp_path: Path) -> None:
    outputs = run_server_section(SHELL[0], PYTHON, tmp_path)
    assert "'n_turns': 1" in outputs[0]
    assert outputs[1].strip() == "16 sequences of tokens"
    assert list((tmp_path / "rollouts").glob("*.rls"))  # the server's --data folder


@pytest.mark.slow
def test_the_readmes_server_example_runs_as_written(tmp_path: Path) -> None:
    (shell,) = blocks(README_SECTION, "sh")
    (python,) = blocks(README_SECTION, "python")
    assert shell == SHELL[0]  # the same commands as the docs' quick start
    (output,) = run_server_section(shell, [python], tmp_path)
    assert "'n_turns': 1" in output
    assert list((tmp_path / "rollouts").glob("*.rls"))
    # the README says how to stop what it started and where its files are
    assert "kill %1 %2" in README_SECTION and "rollouts/" in README_SECTION

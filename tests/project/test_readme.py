"""Every ```python block of README.md and docs/*.md runs as written, each on its own, in an
empty folder (see `doc_examples`); the README's command-line block runs after its quick
start; the README stays short and names every public name."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from doc_examples import (
    DOCS,
    README,
    blocks,
    python_examples,
    run_python,
    section,
    server_examples,
    shell_commands,
)

import rollout_store
from rollout_store import cli

ALL_BLOCKS = blocks(README.read_text(), "python")
#: The capture server's examples talk to the server its shell block starts on port 8100; the
#: server's own tests run that flow. Every other block runs here.
NEEDS_SERVER = "127.0.0.1:8100"
BLOCKS = [block for block in ALL_BLOCKS if NEEDS_SERVER not in block]
DOC_EXAMPLES = [example for example in python_examples() if example[0] != "README.md"]


def test_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 2  # the quick start and the Use section
    assert len(ALL_BLOCKS) - len(BLOCKS) <= 2  # only the capture server's examples are left out


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index: int, tmp_path: Path) -> None:
    run_python(BLOCKS[index], tmp_path, f"readme_block_{index}.py")


def test_the_docs_have_python_examples() -> None:
    pages = {page for page, _, _ in DOC_EXAMPLES}
    assert {"docs/guide.md", "docs/stores.md", "docs/format.md", "docs/index.md"} <= pages


@pytest.mark.parametrize(
    "example", DOC_EXAMPLES, ids=[f"{page}:{index}" for page, index, _ in DOC_EXAMPLES]
)
def test_docs_block_runs(example: tuple[str, int, str], tmp_path: Path) -> None:
    page, index, block = example
    run_python(block, tmp_path, f"{Path(page).stem}_block_{index}.py")


def test_every_server_example_is_run_by_the_server_tests() -> None:
    """tests/project/test_readme_server.py runs the server blocks of these two sections only."""
    covered = blocks(section(README, "## Capture server"), "python") + blocks(
        section(DOCS / "server.md", "## Quick start"), "python"
    )
    assert [block for _, block in server_examples()] == covered


@pytest.mark.parametrize(
    ("page", "heading"), [(README, "## Command line"), (DOCS / "cli.md", "## Commands")]
)
def test_the_command_line_blocks_run_after_the_quick_start(
    page: Path,
    heading: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every `rollout-store` line but `view` (it serves until stopped; the viewer's tests
    cover it) runs where the README's quick start ran, with `damaged.rls` a cut snapshot.
    The command's entry point runs in this process, in that folder."""
    run_python(BLOCKS[0], tmp_path, "quickstart.py")  # writes episode.rls and live.rls
    episode = (tmp_path / "episode.rls").read_bytes()
    (tmp_path / "damaged.rls").write_bytes(episode[: len(episode) - 40])
    (shell,) = blocks(section(page, heading), "sh")
    commands = [argv for argv in shell_commands(shell) if "view" not in argv]
    assert len(commands) >= 6
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        assert argv[:3] == [sys.executable, "-m", "rollout_store.cli"]
        status = cli.main(argv[3:])
        out, err = capsys.readouterr()
        assert status == 0, f"{argv[3:]} failed:\n{out}{err}"
    assert (tmp_path / "saved.rls").exists() and (tmp_path / "trace.jsonl").exists()


def test_rerunning_the_quick_start_does_not_grow_its_log(tmp_path: Path) -> None:
    run_python(BLOCKS[0], tmp_path, "quickstart.py")
    size = (tmp_path / "live.rls").stat().st_size
    run_python(BLOCKS[0], tmp_path, "quickstart.py")
    assert (tmp_path / "live.rls").stat().st_size == size


def test_the_readme_is_short() -> None:
    assert len(README.read_bytes()) <= 12 * 1024


def test_the_readme_api_table_names_every_public_name() -> None:
    api = section(README, "## API")
    named = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)", api))
    missing = sorted(set(rollout_store.__all__) - named)
    assert not missing, f"add {missing} to the README's API table"


#: Words of a development diary, not of user docs.
DIARY = re.compile(r"this round|since undone|before the merge|on the branch|\(today\)", re.I)


@pytest.mark.parametrize("page", [README, *sorted(DOCS.rglob("*.md"))], ids=lambda p: p.name)
def test_user_docs_tell_no_development_history(page: Path) -> None:
    found = [m.group(0) for m in DIARY.finditer(page.read_text())]
    assert not found, f"{page.name}: {found}"

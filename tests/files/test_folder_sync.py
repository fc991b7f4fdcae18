"""A folder sync that fails is an error, not a quiet success: a save, a log's start, a
directory store's put and a session file's write each raise it, and a file system that
cannot sync folders at all (`EINVAL`) is no failure."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from rollout_store import DirectoryStore, RolloutGraph, StoreUnavailableError, TurnNode
from rollout_store.folders import sync_folder
from rollout_store.serve.sessions import Sessions


def _folder_fsync_fails(monkeypatch: pytest.MonkeyPatch, code: int) -> list[int]:
    """Make `os.fsync` of a folder fail with `code` (files still sync); the folders' fds tried."""
    real = os.fsync
    tried: list[int] = []

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            tried.append(fd)
            raise OSError(code, os.strerror(code))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return tried


def _graph() -> RolloutGraph:
    graph = RolloutGraph()
    graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "hi"}]))
    return graph


def test_sync_folder_raises_io_errors_and_passes_unsupported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sync_folder(tmp_path)  # a real sync
    tried = _folder_fsync_fails(monkeypatch, errno.EIO)
    with pytest.raises(OSError) as info:
        sync_folder(tmp_path)
    assert info.value.errno == errno.EIO
    assert tried
    monkeypatch.undo()
    _folder_fsync_fails(monkeypatch, errno.EINVAL)
    sync_folder(tmp_path)  # cannot sync folders here: nothing more to do
    with pytest.raises(NotADirectoryError):  # not a folder: nothing was made durable
        sync_folder(_a_file(tmp_path))


def _a_file(tmp_path: Path) -> Path:
    path = tmp_path / "plain"
    path.write_bytes(b"x")
    return path


def _save(tmp_path: Path) -> None:
    _graph().save(tmp_path / "g.rls")


def _open_log(tmp_path: Path) -> None:
    RolloutGraph.open(tmp_path / "log.rls").close()


def _put(tmp_path: Path) -> None:
    DirectoryStore(tmp_path / "store").put(b"content")


def _session_file(tmp_path: Path) -> None:
    sessions = Sessions(tmp_path / "data")
    try:
        sessions.create("s1")
    finally:
        sessions.close()


@pytest.mark.parametrize("write", [_save, _open_log, _put, _session_file])
def test_a_failed_folder_sync_fails_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: Callable[[Path], None]
) -> None:
    if write is _put:
        DirectoryStore(tmp_path / "store")  # its folders made before the failures start
    tried = _folder_fsync_fails(monkeypatch, errno.EIO)
    with pytest.raises((OSError, StoreUnavailableError)) as info:
        write(tmp_path)
    assert tried, "the write synced no folder"
    assert os.strerror(errno.EIO) in str(info.value)


@pytest.mark.parametrize("write", [_save, _open_log, _put, _session_file])
def test_a_folder_that_cannot_be_synced_is_no_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: Callable[[Path], None]
) -> None:
    tried = _folder_fsync_fails(monkeypatch, errno.EINVAL)
    write(tmp_path)
    assert tried, "the write synced no folder"

"""Replacing a rollout file atomically, and the lock an appending graph holds on its log.

`replace_file` writes a temporary file with a unique name in the target's folder, fsyncs it,
renames it over the target and fsyncs the folder: saves from many threads or processes to
one path each land whole (the last rename wins) and never see each other's temporary files.
An appending graph holds an exclusive `flock` on its log (`lock_log`); `replace_file` holds a
shared one on the file it replaces across the rename, so it refuses to replace a log in use
(saves do not exclude each other), and an appender that opened the old file just before a
rename notices and opens the new one.

File mode: every file the library creates (snapshots, logs, recovered copies, the capture
server's session files, which hold API keys, and the CLI's exports) is created with
`FILE_MODE`, 0600: read and written by its owner only, whatever the umask, because each holds
recorded content. A save over an existing file gives it that mode too (the new file replaces
it); a log appended to keeps the mode it has.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from ..errors import FileLockedError, FileWriteError, RolloutStoreError
from ..folders import sync_folder

__all__ = [
    "FILE_MODE",
    "create_private",
    "fsync_dir",
    "lock_log",
    "replace_file",
    "write_beside",
    "write_error",
]

#: The mode of every file the library creates: its owner reads and writes it, nobody else.
FILE_MODE = 0o600


def create_private(path: str | os.PathLike[str], flags: int) -> int:
    """`os.open(path, flags)`, creating the file with `FILE_MODE` if it is missing."""
    return os.open(path, flags | os.O_CREAT, FILE_MODE)


def write_beside(path: Path, data: bytes) -> Path:
    """A new file beside `path` (a unique hidden name, `FILE_MODE`) holding `data`, synced:
    what a rename then puts in place whole. Removed again when writing it fails."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with os.fdopen(create_private(tmp, os.O_WRONLY | os.O_EXCL), "wb") as fp:
            fp.write(data)
            fp.flush()
            os.fsync(fp.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return tmp


def fsync_dir(path: Path) -> None:
    """Make a rename or a creation of `path` durable: its folder synced (see `folders`)."""
    sync_folder(path.parent)


def _locked_error(path: Path) -> FileLockedError:
    return FileLockedError(
        f"{path} is open for appending by another process or graph; close it first, or use "
        "another path"
    )


#: How long an appender waits for a save's brief shared lock before calling the file busy.
LOCK_WAIT_SECONDS = 0.2


def lock_log(fp: IO[bytes], path: Path) -> bool:
    """Take the appender's exclusive lock on the open file `fp` of `path`. False when `path`
    no longer names that file (a save replaced it meanwhile: open it again); raises
    `FileLockedError` when another graph or process holds the lock."""
    deadline = time.monotonic() + LOCK_WAIT_SECONDS
    while True:
        try:
            fcntl.flock(fp.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise _locked_error(path) from None
            time.sleep(0.01)
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fp.fileno())
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)


def replace_file(target: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write a new file at `target` with `write(fp)`, atomically (see the module docstring)."""
    folder = target.parent
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fp:
            write(fp)
            fp.flush()
            os.fsync(fp.fileno())
        with _lock_existing(target):
            os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError) and not isinstance(exc, RolloutStoreError):
            raise write_error(exc, target) from exc
        raise
    fsync_dir(target)


def write_error(exc: OSError, path: str | os.PathLike[str]) -> FileWriteError:
    """The library's error for a failed write of `path` (the file is left as it was)."""
    return FileWriteError(
        exc.errno or 0,
        f"{exc.strerror or exc}: writing {os.fspath(path)} failed and nothing of it was kept; "
        "free space or fix the file, then try again",
    )


@contextlib.contextmanager
def _lock_existing(target: Path) -> Iterator[None]:
    """Hold a shared lock on the file at `target` (if any) across the rename: refused while
    an appender holds its exclusive one."""
    try:  # non-blocking: opening a FIFO someone put at the path must not hang the save
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            raise _locked_error(target) from None
        yield
    finally:
        os.close(fd)

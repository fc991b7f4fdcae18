"""Making a folder's entries durable: the one directory fsync every writer of the package uses.

A rename or a new file is durable only once its folder is synced. Some file systems cannot
sync a folder and say so (`EINVAL`, `ENOTSUP`): there is nothing more to do, and the write
stands as durable as the system makes it. Any other failure (`EIO`, `ENOSPC`, a folder that
cannot be opened) means the entry may not survive a crash, so it is raised, as a failed
`fsync` of the file itself would be.
"""

from __future__ import annotations

import errno
import os

__all__ = ["sync_folder"]

#: What `fsync` of a folder answers on a file system that cannot sync folders.
_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})


def sync_folder(folder: str | os.PathLike[str]) -> None:
    """Make the entries of `folder` (renames, creations) durable; raises `OSError` when the
    system fails to, and returns quietly when it cannot sync folders at all."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:
            raise
    finally:
        os.close(fd)

"""A directory store for tests that counts its gets and puts and can be made to fail puts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollout_store import DirectoryStore, StoreUnavailableError


class CountingStore:
    """A directory store that counts gets and can fail puts (after n more, or all)."""

    def __init__(self, path: Path) -> None:
        self.inner = DirectoryStore(path, fsync=False)
        self.gets = 0
        self.puts = 0
        self.puts_left: int | None = None

    def put(self, data: bytes) -> bytes:
        if self.puts_left is not None:
            if self.puts_left == 0:
                raise StoreUnavailableError("the test made this put fail")
            self.puts_left -= 1
        self.puts += 1
        return self.inner.put(data)

    def get(self, key: bytes) -> bytes:
        self.gets += 1
        return self.inner.get(key)

    def contains(self, key: bytes) -> bool:
        return self.inner.contains(key)

    def keys(self) -> Any:
        return self.inner.keys()

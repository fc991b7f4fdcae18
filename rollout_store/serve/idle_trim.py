"""A server process giving its freed heap pages back to the system when it goes idle (glibc).

glibc keeps the pages of freed heap memory: a capture server's requests (a 200 KiB body read,
split and forwarded: several copies per call in flight) leave holes in its heap, between the
small objects the sessions keep, that stay resident after the burst of calls is over. With
glibc's default settings the holes are large: its mmap threshold rises after the first large
buffer is freed, so later bodies come from the heap too (measured with the benchmark's GRPO
group, 16 calls in flight: 12-13 MiB of free heap resident after the group). `malloc_trim(0)`
returns every whole free page in the heap to the system (the pages stay mapped; the next use
faults them in again).

`IdleTrim` wraps an ASGI app and calls it once after no HTTP request has been in flight for
`delay` seconds (and at least one ended since the last call), in the event loop: never while
a request is being answered, so it adds nothing to a request in flight; the first request
after an idle spell may fault in pages the trim gave back. This is a process's choice about
its own allocator, made by `rollout-store serve` (`--trim-idle`), never by the library.
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgumentError

__all__ = ["IdleTrim", "malloc_trim", "with_idle_trim"]


def malloc_trim() -> Callable[[], int] | None:
    """glibc's `malloc_trim(0)` (returns 1 when it gave memory back), or None where the C
    library is not glibc (musl, macOS, Windows) or cannot be reached through ctypes."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
        libc.gnu_get_libc_version  # noqa: B018 - glibc's own symbol: not musl
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def call() -> int:
        return int(trim(0))

    return call


class IdleTrim:
    """ASGI middleware: `trim()` once when no HTTP request has been in flight for `delay`
    seconds after one ended. `trims` counts the calls."""

    def __init__(self, app: Any, trim: Callable[[], int], delay: float) -> None:
        if not delay >= 0:
            raise InvalidArgumentError("delay must be 0 or more seconds")
        self.app = app
        self.trim = trim
        self.delay = delay
        self.trims = 0
        self._active = 0
        self._timer: asyncio.TimerHandle | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self._active += 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            await self.app(scope, receive, send)
        finally:
            self._active -= 1
            if not self._active:
                self._timer = asyncio.get_running_loop().call_later(self.delay, self._idle)

    def _idle(self) -> None:
        self._timer = None
        if not self._active:
            self.trims += 1
            self.trim()


def with_idle_trim(app: Any, delay: float) -> Any:
    """`app` wrapped in `IdleTrim` with glibc's `malloc_trim`; `app` itself when `delay` is 0
    or the C library is not glibc."""
    trim = malloc_trim() if delay > 0 else None
    return app if trim is None else IdleTrim(app, trim, delay)

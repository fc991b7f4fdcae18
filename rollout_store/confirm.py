"""Confirming re-sent messages at C speed: one packing of a request, prefix keys at its message
boundaries, and cryptographic digests of packed prefixes.

A request re-sends, byte for byte, an earlier request plus a few new messages. The request's
non-system messages are packed once, as one msgpack array (one C call); the boundaries of its
last few messages come from packing just those again. A stored request is found by the BLAKE3 digest
of its whole packed prefix (never of one message: buckets would grow with content that many
rollouts share): its first 8 bytes are the index key, and all 32 confirm the match. xxh3
collisions can be crafted, BLAKE3 collisions cannot, so a digest match stands for a byte
comparison. Packed
msgpack items are self-delimiting, so equal prefix bytes mean equal leading messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import blake3

from .encoding import array_header

__all__ = ["CHUNK_BYTES", "WINDOW", "Probe", "digest_key", "prefix_digest", "prefix_keys"]

#: How many trailing message boundaries are probed before every boundary is.
WINDOW = 8
#: Messages before the window are packed in chunks of about this many bytes.
CHUNK_BYTES = 1 << 16


def prefix_digest(data: bytes | memoryview) -> bytes:
    """The BLAKE3 digest (32 bytes) of a packed request prefix."""
    return blake3.blake3(data).digest()


def digest_key(digest: bytes) -> int:
    """The index key of a prefix: the first 8 bytes of its digest."""
    return int.from_bytes(digest[:8], "little")


def prefix_keys(plains: Sequence[bytes]) -> list[int]:
    """Index keys of every prefix of a request: keys[m] is that of its first m messages."""
    hasher = blake3.blake3()
    keys = [digest_key(hasher.digest())]
    for plain in plains:
        hasher.update(plain)
        keys.append(digest_key(hasher.digest()))
    return keys


class Probe:
    """One request's non-system messages, packed once, with keys and digests of its prefixes.

    The messages before the last `WINDOW` are packed in chunks of about `CHUNK_BYTES` (a few
    C calls, small buffers that the allocator reuses) and hashed as they go; the last ones are
    packed one by one, so the digest at each of their boundaries is known. `plains[i]` is the
    packing of message i where known (from `low` on), `digests[j]` the digest of the first j
    messages. Raises what the packer raises when some message cannot be packed plainly (the
    caller then takes the validating path).
    """

    __slots__ = ("_pack", "digests", "low", "messages", "n", "plains")

    def __init__(
        self, messages: Sequence[Any], pack: Callable[[Any], bytes], message_size: int = 256
    ) -> None:
        if type(messages) is not list:
            messages = list(messages)
        n = len(messages)
        low = max(n - WINDOW, 0)
        self.n = n
        self.messages = messages
        self._pack = pack
        self.plains: list[bytes | None] = [None] * n
        self.digests: list[bytes | None] = [None] * (n + 1)
        hasher = blake3.blake3()
        step = max(CHUNK_BYTES // max(message_size, 1), 1)
        for start in range(0, low, step):
            stop = min(start + step, low)
            chunk = memoryview(pack(messages[start:stop]))[len(array_header(stop - start)) :]
            hasher.update(chunk)
        digests, plains = self.digests, self.plains
        digests[low] = hasher.digest()
        for i in range(low, n):
            plain = pack(messages[i])
            plains[i] = plain
            hasher.update(plain)
            digests[i + 1] = hasher.digest()
        self.low = low

    def extend(self) -> None:
        """Know the plains and digests of every boundary."""
        low = self.low
        if not low:
            return
        pack, plains, messages = self._pack, self.plains, self.messages
        hasher = blake3.blake3()
        digests = self.digests
        digests[0] = hasher.digest()
        for i in range(low):
            plain = plains[i] = pack(messages[i])
            hasher.update(plain)
            digests[i + 1] = hasher.digest()
        self.low = 0

    def key(self, j: int) -> int:
        """The index key of the first `j` messages."""
        return digest_key(self.digest(j))

    def plain(self, i: int) -> bytes:
        """The packing of message `i`."""
        if i < self.low:
            self.extend()
        return self.plains[i]  # type: ignore[return-value]

    def digest(self, j: int) -> bytes:
        """The BLAKE3 digest of the packing of the first `j` messages."""
        if j < self.low:
            self.extend()
        return self.digests[j]  # type: ignore[return-value]

    def all_plains(self) -> list[bytes]:
        """Every message's packing."""
        self.extend()
        return self.plains  # type: ignore[return-value]

    def keys(self) -> list[int]:
        """The index keys of every prefix."""
        self.extend()
        return [digest_key(d) for d in self.digests]  # type: ignore[arg-type]

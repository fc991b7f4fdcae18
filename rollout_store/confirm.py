"""Confirming re-sent messages at C speed: one packing of a request, prefix keys at its message
boundaries, and cryptographic digests of packed prefixes.

A request re-sends, byte for byte, an earlier request plus a few new messages. The request's
non-system messages are packed once, as one msgpack array (one C call); the boundaries of its
last few messages come from packing just those again. A stored request is found by the xxh3 key
of its whole packed prefix (never of one message: buckets would grow with content that many
rollouts share), and confirmed by the BLAKE3 digest of that prefix: xxh3 collisions can be
crafted, BLAKE3 collisions cannot, so a digest match stands for a byte comparison. Packed
msgpack items are self-delimiting, so equal prefix bytes mean equal leading messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import blake3
import xxhash

from .encoding import array_header

__all__ = ["WINDOW", "Probe", "prefix_digest", "prefix_keys"]

#: How many trailing message boundaries are probed before every boundary is.
WINDOW = 8


def prefix_digest(data: bytes | memoryview) -> bytes:
    """The BLAKE3 digest (32 bytes) of a packed request prefix."""
    return blake3.blake3(data).digest()


def prefix_keys(plains: Sequence[bytes]) -> list[int]:
    """Index keys of every prefix of a request: keys[m] is that of its first m messages."""
    hasher = xxhash.xxh3_64()
    keys = [hasher.intdigest()]
    for plain in plains:
        hasher.update(plain)
        keys.append(hasher.intdigest())
    return keys


class Probe:
    """One request's non-system messages, packed once, with keys and digests on demand.

    `plains[i]` is the packing of message i where known (from `low` on); `offsets[j]` the
    byte length of the packing of the first j messages; `keys[j]` the index key of that
    prefix. Raises what the packer raises when some message cannot be packed plainly (the
    caller then takes the validating path).
    """

    __slots__ = (
        "_hashed",
        "_hasher",
        "_pack",
        "body",
        "keys",
        "low",
        "messages",
        "n",
        "offsets",
        "plains",
    )

    def __init__(self, messages: Sequence[Any], pack: Callable[[Any], bytes]) -> None:
        n = len(messages)
        packed = pack(messages if type(messages) is list else list(messages))
        self.body = memoryview(packed)[len(array_header(n)) :]
        self.n = n
        self.messages = messages
        self._pack = pack
        self.plains: list[bytes | None] = [None] * n
        self.offsets: list[int] = [0] * (n + 1)
        self.offsets[n] = len(self.body)
        self.keys: list[int | None] = [None] * (n + 1)
        self.low = n
        self._hasher = blake3.blake3()
        self._hashed = 0  # bytes of body the hasher has seen
        self.extend(max(n - WINDOW, 0))

    def extend(self, low: int) -> None:
        """Know plains, offsets and keys of every boundary from `low` on."""
        if low >= self.low and self.keys[self.low] is not None:
            return
        pack, plains, offsets, messages = self._pack, self.plains, self.offsets, self.messages
        end = offsets[self.low]
        for i in range(self.low - 1, low - 1, -1):
            plain = pack(messages[i])
            plains[i] = plain
            end -= len(plain)
            offsets[i] = end
        if end < 0:  # cannot happen: the packer is deterministic
            raise ValueError("message packings do not add up to the request's")
        self.low = low
        hasher = xxhash.xxh3_64()
        body = self.body
        hasher.update(body[: offsets[low]])
        keys = self.keys
        keys[low] = hasher.intdigest()
        for i in range(low, self.n):
            hasher.update(plains[i])  # type: ignore[arg-type]
            keys[i + 1] = hasher.intdigest()

    def key(self, j: int) -> int:
        """The index key of the first `j` messages."""
        if j < self.low:
            self.extend(0)
        return self.keys[j]  # type: ignore[return-value]

    def plain(self, i: int) -> bytes:
        """The packing of message `i`."""
        if i < self.low:
            self.extend(0)
        return self.plains[i]  # type: ignore[return-value]

    def digest(self, j: int) -> bytes:
        """The BLAKE3 digest of the packing of the first `j` messages.

        Asked in ascending order (a base's prefix, then the whole request), the body is hashed
        once."""
        if j < self.low:
            self.extend(0)
        end = self.offsets[j]
        if end < self._hashed:
            return prefix_digest(self.body[:end])
        self._hasher.update(self.body[self._hashed : end])
        self._hashed = end
        return self._hasher.digest()

    def all_plains(self) -> list[bytes]:
        """Every message's packing."""
        self.extend(0)
        return self.plains  # type: ignore[return-value]

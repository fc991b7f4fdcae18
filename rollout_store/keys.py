"""The keys stored turns are filed under: token prefixes and request prefixes.

Keys are cheap xxh3-64 digests; a hit under a key is only a candidate, always confirmed by
comparing the tokens or messages themselves.
"""

from __future__ import annotations

import xxhash

from .tokens import TokenRun, block_digests, run_bytes

__all__ = ["HEADS", "request_key", "root_token_keys", "short_key"]

#: Token roots are also found by their first 16, 32 or 48 tokens (for continuations of
#: turns with fewer than BLOCK tokens).
HEADS = (16, 32, 48)


def short_key(data: bytes, n_tokens: int) -> int:
    """Index key of exactly the first `n_tokens` tokens of `data` (array('I') bytes)."""
    return xxhash.xxh3_64_intdigest(memoryview(data)[: n_tokens * 4], seed=n_tokens + 1)


def root_token_keys(prompt: TokenRun) -> list[int]:
    """The keys a root with this prompt waits under for a late ancestor: its heads and its
    whole blocks."""
    if not prompt.compact or prompt.length < HEADS[0]:
        return []
    data = run_bytes(prompt)
    keys = [short_key(data, head) for head in HEADS if head <= prompt.length]
    return keys + block_digests(data)[1:]


def request_key(plains: list[bytes | None] | list[bytes], n: int) -> int:
    """Index key of the first `n` messages of a non-system request: `n` and the last one.

    Cheap on purpose (one message hashed): a hit is confirmed against every message anyway.
    `plains[n - 1]` must be a packing (not None) when `n` > 0.
    """
    last = plains[n - 1] if n else b""
    if last is None:
        raise ValueError("a request key needs the plain packing of its last message")
    return xxhash.xxh3_64_intdigest(last, seed=n)

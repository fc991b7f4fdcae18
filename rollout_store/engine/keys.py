"""The keys stored turns are filed under: token prefixes and request prefixes.

Token keys are cheap xxh3-64 digests; a hit under one is only a candidate, always confirmed
by comparing the tokens themselves. Request keys come from the BLAKE3 digest of the whole
packed prefix, which confirms a hit (see `confirm`).
"""

from __future__ import annotations

import xxhash

from .._core import RequestTable
from .confirm import digest_key, prefix_digest
from .tokens import TokenRun, block_digests, run_bytes

__all__ = ["HEADS", "request_key", "request_keys", "root_token_keys", "short_key"]

#: Token roots are also found by their first 1, 2, 4, ... 48 tokens (for continuations of
#: turns with fewer than BLOCK tokens; never a scan of every root).
HEADS = (1, 2, 4, 8, 16, 32, 48)


def short_key(data: bytes, n_tokens: int) -> int:
    """Index key of exactly the first `n_tokens` tokens of `data` (array('I') bytes)."""
    return xxhash.xxh3_64_intdigest(memoryview(data)[: n_tokens * 4], seed=n_tokens + 1)


def root_token_keys(prompt: TokenRun) -> list[int]:
    """The keys a root with this prompt waits under for a late ancestor: its heads and its
    whole blocks."""
    if not prompt.length or not prompt.compact:
        return []
    data = run_bytes(prompt)
    keys = [short_key(data, head) for head in HEADS if head <= prompt.length]
    return keys + block_digests(data)[1:]


def request_key(plains: list[bytes | None] | list[bytes], n: int) -> int:
    """Index key of the first `n` messages of a non-system request: from the BLAKE3 digest
    of their whole packing (never of one message, so buckets do not grow with content many
    rollouts share). `request_keys` gives every prefix's at once."""
    if None in plains[:n]:
        raise ValueError("a request key needs the plain packing of every message")
    return digest_key(prefix_digest(b"".join(plains[:n])))  # type: ignore[arg-type]


def request_keys(plains: list[bytes]) -> list[int]:
    """The request keys of every prefix: keys[m] is that of the first m messages (the
    request table's, one hashing pass)."""
    return RequestTable.keys(plains)

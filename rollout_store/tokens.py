"""Token ids in compact, shared storage, and exact prefix matching over them.

A turn's prompt is a chain of runs: its parent's prompt + sampled tokens, then the tokens
that are new. Ids are kept as array('I') (4 bytes each) when they fit; prefix digests are
taken every `BLOCK` tokens so a parent is found without scanning stored turns.
"""

from __future__ import annotations

from array import array
from typing import TypeAlias, cast

import xxhash

__all__ = ["BLOCK", "Segment", "TokenRun", "block_digests", "run_bytes", "run_list"]

#: Tokens per prefix-digest block.
BLOCK = 64
_BLOCK_BYTES = BLOCK * 4

#: A run's tokens: array('I') (or 'q') when they fit, else a tuple of exact ints.
Segment: TypeAlias = "array[int] | tuple[int, ...]"


class TokenRun:
    """A node of a token chain: the tokens of `prev`, then `seg`. Shared between turns."""

    __slots__ = ("length", "prev", "seg")

    def __init__(self, prev: TokenRun | None, seg: Segment) -> None:
        self.prev = prev
        self.seg = seg
        self.length: int = (prev.length if prev is not None else 0) + len(seg)

    def segments(self) -> list[Segment]:
        """The segments of the chain, first to last."""
        out: list[Segment] = []
        run: TokenRun | None = self
        while run is not None:
            if len(run.seg):
                out.append(run.seg)
            run = run.prev
        out.reverse()
        return out

    @property
    def compact(self) -> bool:
        """True when every segment is array('I'), so the run can be matched by bytes."""
        run: TokenRun | None = self
        while run is not None:
            seg = run.seg
            if len(seg) and not (isinstance(seg, array) and seg.typecode == "I"):
                return False
            run = run.prev
        return True


def run_list(run: TokenRun) -> list[int]:
    out: list[int] = []
    for seg in run.segments():
        out.extend(seg.tolist() if isinstance(seg, array) else seg)
    return out


def run_bytes(run: TokenRun) -> bytes:
    """The run as array('I') bytes; the caller checks `compact` first."""
    return b"".join(cast("array[int]", seg).tobytes() for seg in run.segments())


def run_matches(run: TokenRun, data: bytes) -> bool:
    """Whether `data` (array('I') bytes) starts with exactly the tokens of `run`."""
    if run.length * 4 > len(data):
        return False
    end = run.length * 4
    node: TokenRun | None = run
    while node is not None:
        seg = node.seg
        n = len(seg) * 4
        if n:
            if not (isinstance(seg, array) and seg.typecode == "I"):
                return False
            if not data.startswith(seg, end - n):
                return False
        end -= n
        node = node.prev
    return True


def block_digests(data: bytes | memoryview) -> list[int]:
    """Digest of the first j*BLOCK tokens, for j = 0 .. len(tokens) // BLOCK."""
    view = memoryview(data)
    hasher = xxhash.xxh3_64()
    out = [hasher.intdigest()]
    for start in range(0, len(view) - _BLOCK_BYTES + 1, _BLOCK_BYTES):
        hasher.update(view[start : start + _BLOCK_BYTES])
        out.append(hasher.intdigest())
    return out


def prefix_digest(data: bytes | memoryview, n_tokens: int) -> int:
    """The block digest of the first `n_tokens // BLOCK` blocks of `data`."""
    blocks = n_tokens // BLOCK
    return xxhash.xxh3_64_intdigest(memoryview(data)[: blocks * _BLOCK_BYTES])

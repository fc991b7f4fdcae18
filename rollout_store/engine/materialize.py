"""Rebuilding what a stored turn holds: fresh containers, exactly what was recorded.

Every function takes the stored `Turn` (or a packed value) and the blob table its references
point into; long strings come back as the table's own `str` objects, never copies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .blobs import BlobTable
from .encoding import unpack
from .stored import Turn, TurnFlag, seg_list
from .tokens import run_list

__all__ = [
    "Messages",
    "logprobs",
    "prompt_ids",
    "request_messages",
    "rest_values",
    "sampled_ids",
    "value",
]

Messages = list[Any] | tuple[Any, ...]


def value(packed: bytes | None, blobs: BlobTable) -> Any:
    """A stored value rebuilt (None stays None)."""
    return None if packed is None else unpack(packed, blobs.string)


def rest_values(turn: Turn, blobs: BlobTable) -> list[Any]:
    """The non-system request messages of `turn`: its base's, then its own tail."""
    chain: list[Turn] = []
    node: Turn | None = turn
    while node is not None:
        chain.append(node)
        node = node.base
    out: list[Any] = []
    string = blobs.string
    for owner in reversed(chain):
        base = owner.base
        echo = _echo_of(base, blobs) if base is not None else None
        out.extend(unpack(owner.tail, string, echo))
    return out


def request_messages(turn: Turn, blobs: BlobTable) -> Messages | None:
    """The request messages of `turn` as they were recorded (a tuple stays a tuple)."""
    if turn.flags & TurnFlag.NO_MESSAGES:
        return None
    messages: list[Any] = []
    if turn.system is not None:
        messages.extend(unpack(turn.system, blobs.string))
    messages.extend(rest_values(turn, blobs))
    return tuple(messages) if turn.flags & TurnFlag.MESSAGES_TUPLE else messages


def prompt_ids(turn: Turn) -> list[int] | None:
    if turn.prompt is not None:
        return run_list(turn.prompt)
    return [] if turn.flags & TurnFlag.EMPTY_PROMPT else None


def sampled_ids(turn: Turn) -> list[int] | None:
    return seg_list(turn.sampled)


def logprobs(turn: Turn, blobs: BlobTable) -> Any:
    """The sampled logprobs: a list of floats, or the JSON value recorded."""
    lp = turn.logprobs
    if lp is None:
        return None
    if turn.flags & TurnFlag.LOGPROBS_PACKED:
        return unpack(lp, blobs.string)
    return lp.tolist()


def _echo_of(base: Turn, blobs: BlobTable) -> Callable[[], Any]:
    """What the echo placeholder in a tail stands for: the base turn's response."""
    return lambda: value(base.response, blobs)

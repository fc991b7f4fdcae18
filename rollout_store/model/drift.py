"""The drift audit: turns whose messages continue a stored turn but whose token ids do not.

Retokenization drift (a chat template that renders history differently from what the model
saw, a generation prompt rendered anew) makes a continuation a root, silently: linking goes
by token ids and stays so. The graph records, for such a turn, the stored turn it would have
continued (the one its request messages extend, whose response it echoes), the first token
offset at which its prompt leaves that turn's prompt + sampled ids, and where that offset
falls:

- `region` "response": inside the would-be parent's sampled tokens, i.e. in the echo of its
  response, which is request message `message_index` of the new turn;
- `region` "prompt": inside the would-be parent's prompt. The graph keeps no token-to-message
  boundaries, so `message_index` is None there; `parent_messages` says how many request
  messages that prompt was rendered from (the offset falls in one of them, or in the template
  text between them).

The check runs only for a turn with token ids that found no token parent, no explicit one,
and whose messages continue a stored turn with token ids: the normal path pays nothing.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Drift", "REGIONS"]

#: Where the first differing token falls, by the code a file's `drift` record holds.
REGIONS = ("prompt", "response")


class Drift(NamedTuple):
    """One drifted turn, by turn indexes (what a file's `drift` record holds)."""

    turn: int  # the drifted turn's index
    parent: int  # the would-be parent's index
    offset: int  # the first token offset where the prompt leaves the parent's context
    region: int  # index into REGIONS
    message_index: int | None  # the request message the offset falls in, when known
    parent_tokens: int  # the would-be parent's prompt + sampled length
    parent_messages: int  # its request's message count

    def to_record(self) -> list[Any]:
        return list(self)

    @classmethod
    def from_record(cls, body: Any, turn_index: int) -> Drift:
        """A file's `drift` record read back, checked against the turn record after it
        (`turn_index`, the next turn read). Raises ValueError."""
        if not isinstance(body, list) or len(body) != len(cls._fields):
            raise ValueError("a drift record is an array of 7 items")
        if not all(type(v) is int and v >= 0 for i, v in enumerate(body) if i != 4):
            raise ValueError("bad numbers in a drift record")
        if body[4] is not None and not (type(body[4]) is int and body[4] >= 0):
            raise ValueError("bad message index in a drift record")
        drift = cls(*body)
        if drift.turn != turn_index or drift.parent >= drift.turn:
            raise ValueError("a drift record out of place (it precedes its own turn)")
        if drift.region >= len(REGIONS) or drift.offset > drift.parent_tokens:
            raise ValueError("bad region or offset in a drift record")
        return drift

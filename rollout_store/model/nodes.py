"""`TurnNode`: one model call as the harness sent it and the engine answered it.

The fields, their order and their defaults are those of the capture graph this library
replaces, so code that builds nodes for it builds them for rollout_store unchanged. Nodes
handed out by a graph are read-only views of the same class (see `views`).
"""

from __future__ import annotations

from abc import ABCMeta
from dataclasses import dataclass, field, fields
from typing import Any

from .raw import RawJSON

__all__ = ["FIELD_NAMES", "NodeMethods", "TurnNode", "common_prefix_len"]


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class NodeMethods:
    """What `TurnNode` and the graph's views of it share (no state of its own)."""

    __slots__ = ()

    prompt_ids: list[int] | None
    sampled_ids: list[int] | None

    @property
    def end_ids(self) -> list[int]:
        """The tokens after this turn: its prompt, then what it sampled."""
        return list(self.prompt_ids or []) + list(self.sampled_ids or [])

    def context_ids(self, parent: NodeMethods | None) -> list[int]:
        """The tokens this turn adds before the model starts sampling.

        For a root, its whole prompt; for a child, the part of its prompt after the parent's
        `end_ids` (tool results, user turns, template scaffolding): tokens the model saw and
        did not produce.
        """
        prompt = list(self.prompt_ids or [])
        if parent is None:
            return prompt
        return prompt[len(parent.end_ids) :]

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in FIELD_NAMES)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NodeMethods):
            return NotImplemented
        return self is other or self._values() == other._values()

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it mirrors


class _CountTools(int):
    """The type of `COUNT_TOOLS`: an int 0 the graph tells apart by identity."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "COUNT_TOOLS"

    def __reduce__(self) -> str:
        return "COUNT_TOOLS"  # pickled and copied as the one constant, so `is` holds


#: `TurnNode.n_tools`'s default: the graph counts the tools sent (`request_tools`). It is the
#: int 0 to compare (`node.n_tools == 0` holds, as for the capture graph's node), so code
#: that reads the field before the turn is added sees what it always saw.
COUNT_TOOLS: int = _CountTools(0)


@dataclass(eq=False)
class TurnNode(NodeMethods, metaclass=ABCMeta):
    """One model call of a rollout: what the harness sent and what came back.

    Pass it to `RolloutGraph.add_turn`, which sets `index` (arrival order) and `parent_id`
    on it. `node_id=None` asks the graph for a fresh id; a `parent_id` given before adding
    is an explicit parent. `n_tools` is the number of tools sent: left at its default
    (`COUNT_TOOLS`), or None, the graph counts `request_tools` (0 when none were sent); an
    int given is kept as it is. An empty `prompt_ids`
    means the engine returned no token ids, and the turn is linked by its messages.
    Every JSON field also takes `RawJSON` (the JSON text, undecoded; the token fields too), and
    `request_messages` and `request_tools` lists take `RawJSON` items: each is stored as
    `json.loads` would decode it.
    """

    node_id: str | None = None
    prompt_ids: list[int] | None = field(default_factory=list)
    sampled_ids: list[int] | None = field(default_factory=list)
    sampled_logprobs: list[float] | None = None
    parent_id: str | None = None
    index: int = 0
    model: str | None = None
    finish_reason: str | None = None
    harness_session_id: str | None = None
    system_digest: str | None = None
    n_tools: int | None = COUNT_TOOLS
    request_messages: list[Any] | RawJSON | None = field(default_factory=list)
    request_tools: list[Any] | RawJSON | None = None
    sampling_params: dict[str, Any] | RawJSON | None = field(default_factory=dict)
    requested_sampling_params: dict[str, Any] | RawJSON | None = field(default_factory=dict)
    response_message: dict[str, Any] | RawJSON | None = field(default_factory=dict)

    # equality, end_ids and context_ids come from NodeMethods; views of stored turns are
    # registered as virtual subclasses (views.NodeView), so isinstance() holds for them


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(TurnNode))

"""Read-only `TurnNode` views of stored turns, cheap to hand out by the thousand.

A view holds two references: its graph and the stored turn. Scalar fields (`node_id`,
`index`, `parent_id`, `model`, `finish_reason`, `harness_session_id`, `system_digest`,
`n_tools`) are read from the stored turn as they are now, so a view follows re-linking.
Every other field is rebuilt from storage each time it is read, as fresh containers:
changing them changes nothing stored. `dataclasses.replace`, `copy` and `pickle` give plain
`TurnNode` objects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

from .engine.stored import Turn
from .errors import ReadOnlyError
from .model.nodes import FIELD_NAMES, NodeMethods, TurnNode

__all__ = ["NodeSource", "NodeView"]


class NodeSource(Protocol):
    """What a view asks its graph for: the rebuilt value of one field of one turn."""

    def field_value(self, node_id: str, name: str) -> Any: ...


class NodeView(NodeMethods):
    """A `TurnNode` backed by a stored turn; built by the graph, never by callers.

    Two slots and no instance dict: a view costs about 48 bytes. It is a virtual subclass
    of `TurnNode` (isinstance holds) and carries its dataclass fields, so `dataclasses`
    functions accept it.
    """

    __slots__ = ("_source", "_turn")

    _source: NodeSource
    _turn: Turn

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # what dataclasses.replace (and anything calling type(view)(...)) builds: a plain node
        return TurnNode(*args, **kwargs)

    @classmethod
    def of(cls, source: NodeSource, turn: Turn) -> TurnNode:
        """A view of `turn`, typed as the `TurnNode` it stands for (a virtual subclass)."""
        view: NodeView = object.__new__(cls)
        object.__setattr__(view, "_source", source)
        object.__setattr__(view, "_turn", turn)
        return cast(TurnNode, view)

    def __setattr__(self, name: str, value: Any) -> None:
        raise ReadOnlyError(
            f"a node handed out by the graph is read-only (setting {name!r}); "
            "use dataclasses.replace(node, ...) for an editable copy"
        )

    def __delattr__(self, name: str) -> None:
        raise ReadOnlyError("a node handed out by the graph is read-only")

    def __reduce__(self) -> tuple[Any, ...]:
        return (TurnNode, tuple(getattr(self, name) for name in FIELD_NAMES))

    def __copy__(self) -> TurnNode:
        return self.as_node()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, NodeView) and other._turn is self._turn:
            return True
        return super().__eq__(other)

    __hash__ = None

    def as_node(self) -> TurnNode:
        """An editable `TurnNode` holding every field rebuilt."""
        return TurnNode(*(getattr(self, name) for name in FIELD_NAMES))

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in FIELD_NAMES)
        return f"TurnNode({fields})"


def _scalar(read: Callable[[Turn], Any]) -> property:
    return property(lambda self: read(self._turn))


def _rebuilt(name: str) -> property:
    return property(lambda self: self._source.field_value(self._turn.node_id, name))


_SCALARS: dict[str, Callable[[Turn], Any]] = {
    "node_id": lambda t: t.node_id,
    "index": lambda t: t.index,
    "parent_id": lambda t: t.parent.node_id if t.parent is not None else None,
    "model": lambda t: t.meta[0],
    "finish_reason": lambda t: t.meta[1],
    "harness_session_id": lambda t: t.meta[2],
    "system_digest": lambda t: t.meta[3],
    "n_tools": lambda t: t.meta[4],
}

TurnNode.register(NodeView)
# what dataclasses.fields / replace / asdict look for
NodeView.__dataclass_fields__ = TurnNode.__dataclass_fields__  # type: ignore[attr-defined]
NodeView.__dataclass_params__ = TurnNode.__dataclass_params__  # type: ignore[attr-defined]

# Set after the class: read-only properties, one per field.
for _name in FIELD_NAMES:
    setattr(
        NodeView,
        _name,
        _scalar(_SCALARS[_name]) if _name in _SCALARS else _rebuilt(_name),
    )

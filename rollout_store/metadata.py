"""What a trainer attaches to a rollout: labels, annotations, rewards and a group id.

A graph holds one `GraphMeta`, an immutable value replaced whole on every change, so a
change that fails (a bad value, a file write that fails) leaves the graph's metadata exactly
as it was. Annotations are any JSON values, kept as their plain packing (every string
inline) and rebuilt byte-identical under `json.dumps`; rewards are real numbers, one for the
whole graph and optionally one per leaf (keyed by the leaf's node id).

`to_record` / `from_record` are the one shape a file's `meta` record holds (see `storage`);
`document` is the JSON-ready form the export, the trace and the capture server show.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from .engine.encoding import unpack
from .engine.intake import encode
from .errors import InvalidValueError

__all__ = ["NO_META", "UNCHANGED", "GraphMeta", "check_group", "check_label", "check_reward"]

#: Rewards are kept as given; ints beyond this are refused (a file keeps them as msgpack ints).
_INT_LIMIT = 2**63


class _Unchanged:
    """The default of an `update_metadata` argument left out (None clears a value)."""

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Any = _Unchanged()


def check_reward(value: object, path: str) -> int | float:
    """`value` as a reward: an int or a finite float (numpy scalars taken by `.item()`)."""
    if type(value).__module__.split(".")[0] == "numpy" and hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidValueError(
            f"a reward must be an int or a float, got {type(value).__name__}", path
        )
    if isinstance(value, int):
        if not -_INT_LIMIT <= value < _INT_LIMIT:
            raise InvalidValueError("an int reward must fit in 64 bits", path)
        return int(value)
    value = float(value)
    if not math.isfinite(value):
        raise InvalidValueError(f"a reward must be finite, got {value!r}", path)
    return value


def check_label(value: object, path: str) -> str:
    """`value` as a label: a non-empty str."""
    if not isinstance(value, str):
        raise InvalidValueError(f"a label must be a str, got {type(value).__name__}", path)
    if not value:
        raise InvalidValueError("a label must not be empty", path)
    return str.__str__(value)


def check_group(value: object, path: str = "group") -> str | None:
    """`value` as a group id: a non-empty str, or None for no group."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidValueError(f"a group id must be a str, got {type(value).__name__}", path)
    if not value:
        raise InvalidValueError("a group id must not be empty", path)
    return str.__str__(value)


def _no_blob(index: int) -> str:
    raise ValueError("an annotation holds no blob reference")


@dataclass(frozen=True)
class GraphMeta:
    """A graph's labels, annotations (key -> plain packing), rewards and group id."""

    labels: tuple[str, ...] = ()
    annotations: tuple[tuple[str, bytes], ...] = ()
    reward: int | float | None = None
    leaf_rewards: tuple[tuple[str, int | float], ...] = ()
    group: str | None = None

    @cached_property
    def _by_leaf(self) -> dict[str, int | float]:
        return dict(self.leaf_rewards)

    @property
    def empty(self) -> bool:
        """True when nothing is set (such a graph writes no `meta` record)."""
        return not (self.labels or self.annotations or self.leaf_rewards) and (
            self.reward is None and self.group is None
        )

    # ------------------------------------------------------------------ changes

    def with_labels(self, labels: Iterable[object], add: bool) -> GraphMeta:
        """Labels added to (`add`) or replacing the current ones; a repeat is kept once."""
        if isinstance(labels, str):
            labels = [labels]
        kept = list(self.labels) if add else []
        for i, label in enumerate(labels):
            text = check_label(label, f"labels[{i}]")
            if text not in kept:
                kept.append(text)
        return replace(self, labels=tuple(kept))

    def with_annotations(self, values: Mapping[Any, Any]) -> GraphMeta:
        """Annotations set (a key given again is replaced), each value checked and packed."""
        merged = dict(self.annotations)
        for key, value in values.items():
            if not isinstance(key, str):
                raise InvalidValueError(
                    f"an annotation key must be a str, got {type(key).__name__}", "annotations"
                )
            packed, _ = encode(value, f"annotations[{key!r}]", None, None)
            merged[str.__str__(key)] = packed
        return replace(self, annotations=tuple(merged.items()))

    def without_annotations(self, keys: Iterable[str]) -> GraphMeta:
        drop = set(keys)
        kept = tuple(item for item in self.annotations if item[0] not in drop)
        return replace(self, annotations=kept)

    def with_reward(self, value: object, leaf: str | None) -> GraphMeta:
        """The graph's reward (`leaf` None) or one leaf's set; None clears it."""
        if leaf is None:
            reward = None if value is None else check_reward(value, "reward")
            return replace(self, reward=reward)
        rewards = dict(self.leaf_rewards)
        if value is None:
            rewards.pop(leaf, None)
        else:
            rewards[leaf] = check_reward(value, f"rewards[{leaf!r}]")
        return replace(self, leaf_rewards=tuple(rewards.items()))

    def with_group(self, group: object) -> GraphMeta:
        return replace(self, group=check_group(group))

    # ------------------------------------------------------------------ reading

    def annotation_values(self) -> dict[str, Any]:
        """Every annotation rebuilt (fresh containers), in the order first set."""
        return {key: unpack(packed, _no_blob) for key, packed in self.annotations}

    def reward_for(self, leaf: str) -> int | float | None:
        """The leaf's own reward, else the graph's, else None."""
        found = self._by_leaf.get(leaf)
        return found if found is not None else self.reward

    def document(self) -> dict[str, Any]:
        """The JSON-ready form: group, labels, annotations, reward, rewards (per leaf)."""
        return {
            "group": self.group,
            "labels": list(self.labels),
            "annotations": self.annotation_values(),
            "reward": self.reward,
            "rewards": dict(self.leaf_rewards),
        }

    # ------------------------------------------------------------------ files

    def to_record(self) -> dict[str, Any]:
        """The payload of a file's `meta` record (packed by the file layer)."""
        return {
            "labels": list(self.labels),
            "annotations": [[key, packed] for key, packed in self.annotations],
            "reward": self.reward,
            "rewards": [[leaf, value] for leaf, value in self.leaf_rewards],
            "group": self.group,
        }

    @classmethod
    def from_record(
        cls, body: Any, known: Callable[[str], bool], check: Callable[[bytes], object]
    ) -> GraphMeta:
        """A `meta` record's payload read back, every field checked; `known(node_id)` says
        whether a leaf reward names a turn of the graph, `check(packed)` checks an
        annotation's packing (the file layer's check of stored values). Raises ValueError."""
        if not isinstance(body, dict) or set(body) != {
            "labels",
            "annotations",
            "reward",
            "rewards",
            "group",
        }:
            raise ValueError("a meta record must map exactly its five fields")
        labels, annotations, rewards = body["labels"], body["annotations"], body["rewards"]
        if not isinstance(labels, list) or not isinstance(annotations, list):
            raise ValueError("bad labels or annotations in a meta record")
        if not isinstance(rewards, list):
            raise ValueError("bad rewards in a meta record")
        pairs: list[tuple[str, bytes]] = []
        for item in annotations:
            if not (
                isinstance(item, list)
                and len(item) == 2
                and isinstance(item[0], str)
                and isinstance(item[1], bytes)
            ):
                raise ValueError("bad annotation in a meta record")
            check(item[1])
            pairs.append((item[0], item[1]))
        leaf_rewards: list[tuple[str, int | float]] = []
        for item in rewards:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                raise ValueError("bad leaf reward in a meta record")
            if not known(item[0]):
                raise ValueError(f"a reward names no turn of the file ({item[0]!r})")
            leaf_rewards.append((item[0], check_reward(item[1], "rewards")))
        reward = body["reward"]
        meta = cls(
            labels=tuple(check_label(label, "labels") for label in labels),
            annotations=tuple(pairs),
            reward=None if reward is None else check_reward(reward, "reward"),
            leaf_rewards=tuple(leaf_rewards),
            group=check_group(body["group"]),
        )
        if len(set(meta.labels)) != len(meta.labels) or len(dict(pairs)) != len(pairs):
            raise ValueError("a repeated label or annotation key in a meta record")
        return meta


#: The metadata of a graph that has none: one immutable object for every such graph (every
#: change makes a new `GraphMeta`), rather than one of about 350 bytes each.
NO_META = GraphMeta()

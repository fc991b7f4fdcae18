"""Training rows: one per root-to-leaf path, or one tree-packed row per trajectory or group.

`token_samples(graph)` gives one row per leaf, exactly the graph's training sequence for it
(`Graph.sequence_for`): `input_ids`, `loss_mask`, `rollout_logprobs` (its `logprobs`),
`position_ids` (0, 1, ...), `leaf_id`, `reward` (the leaf's own, else the graph's, see
`Graph.reward_for`), `stop_reason` (the leaf turn's `finish_reason`), plus `root_id`,
`node_ids`, `n_trainable`, `discarded` and `group`.

`tree_samples(graph)` packs those paths so that every token is held once: the paths are
merged into a prefix tree where two paths share a token only when they agree on it and on
everything before it (token id, mask bit and logprob: a float by its float64 bits, an int by
its value, so the two never meet), and the tree
is laid out in DFS pre-order. A row holds, per token, `input_ids`, `loss_mask`,
`rollout_logprobs`, `position_ids` (the token's offset along its own root path, so rotary
positions are those of the path alone), `token_node` (index into the node arrays) and
`token_owner_path` (index into `paths`); per node (a run of tokens of one turn shared by the
same paths, in pre-order) `node_ids` (the turn's node id; None for a synthetic root),
`node_parent` (-1 for a root), `node_enter` / `node_exit` (DFS interval: node a is an
ancestor-or-self of node d iff ``enter[a] <= enter[d] < exit[a]``), `node_offset` and
`node_length` (its tokens' place in the row); and `paths`, one per leaf: `leaf_node` (the node
its last token is in, at that node's end), `leaf_id`, `reward`, `stop_reason`, `n_trainable`
(trainable tokens it owns), `length` (its per-path row's length) and `graph` (the index of
its graph in a group).

The tree mask: token a attends token b iff b's node is an ancestor-or-self of a's node and
b comes no later than a in the row (within one node, tokens are in order; an ancestor's
tokens precede all its descendants'). `tree_attention_mask(row)` builds it as a numpy array.

A sampled token reached by several leaves is trained once; `token_owner_path` names the path
that owns its node, for that path's reward: the first path (in leaf order) through the node
whose leaf did not overflow the context (`stop_reason` in `OVERFLOW_STOP_REASONS`), else the
first path. A leaf that overflowed therefore never owns a node another leaf reaches.

One graph gives one row per tree of the packing: paths whose first tokens differ are separate
trajectories. `tree_samples([g1, g2, ...])` packs all the graphs' paths as one forest under a
synthetic root (node 0: no tokens, `node_ids[0]` None), so a GRPO group's shared prompt is held
once. Paths without token ids carry nothing to pack and are left out of tree rows.
"""

from __future__ import annotations

import math
import struct
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from ..errors import InvalidArgumentError
from ..graph import Graph

__all__ = [
    "OVERFLOW_STOP_REASONS",
    "iter_token_samples",
    "iter_tree_samples",
    "token_samples",
    "tree_attention_mask",
    "tree_samples",
]

#: Stop reasons that say a leaf ran out of context or budget (OpenAI's "length", Anthropic's
#: "max_tokens" and its context-window stop).
OVERFLOW_STOP_REASONS = frozenset({"length", "max_tokens", "model_context_window_exceeded"})

#: Per-token fields of a path row and of a tree row; per-node fields of a tree row.
PATH_TOKEN_FIELDS = ("input_ids", "loss_mask", "rollout_logprobs", "position_ids")
TREE_TOKEN_FIELDS = (*PATH_TOKEN_FIELDS, "token_node", "token_owner_path")
TREE_NODE_FIELDS = ("node_parent", "node_enter", "node_exit", "node_offset", "node_length")


def _graphs(source: Any, name: str) -> list[Graph]:
    if isinstance(source, Graph):
        return [source]
    if isinstance(source, Iterable) and not isinstance(source, str | bytes):
        graphs = list(source)
        for i, graph in enumerate(graphs):
            if not isinstance(graph, Graph):
                raise InvalidArgumentError(
                    f"{name} expects a RolloutGraph or a list of them; item {i} is a "
                    f"{type(graph).__name__}"
                )
        return graphs
    raise InvalidArgumentError(
        f"{name} expects a RolloutGraph or a list of them, got {type(source).__name__}"
    )


def _as_numpy(row: dict[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    import numpy as np

    for name in fields:
        values = row[name]
        if name == "rollout_logprobs":
            try:
                row[name] = np.asarray(values, dtype=np.float64)
            except OverflowError:  # an int beyond float64: kept exactly, as Python values
                row[name] = np.asarray(values, dtype=object)
        else:
            try:
                row[name] = np.asarray(values, dtype=np.int64)
            except OverflowError:  # ids beyond 64 bits: kept exactly, as Python ints
                row[name] = np.asarray(values, dtype=object)
    return row


# ---------------------------------------------------------------- per path


def iter_token_samples(graph: Graph, *, numpy: bool = False) -> Iterator[dict[str, Any]]:
    """`token_samples`, one row at a time (hold the graph's lock for a consistent view)."""
    meta = graph.meta
    discarded = set(graph.discarded_ids())
    for leaf in graph.leaf_ids():
        seq = graph.sequence_for(leaf)
        row: dict[str, Any] = {
            "input_ids": seq.input_ids,
            "loss_mask": seq.loss_mask,
            "rollout_logprobs": seq.logprobs,
            "position_ids": list(range(len(seq.input_ids))),
            "leaf_id": leaf,
            "reward": meta.reward_for(leaf),
            "stop_reason": graph.summary(leaf)["finish_reason"],
            "root_id": seq.root_id,
            "node_ids": seq.node_ids,
            "n_trainable": seq.n_trainable,
            "discarded": leaf in discarded,
            "group": meta.group,
        }
        yield _as_numpy(row, PATH_TOKEN_FIELDS) if numpy else row


def token_samples(graph: Graph, *, numpy: bool = False) -> list[dict[str, Any]]:
    """One row per root-to-leaf path, in the leaves' arrival order (see the module
    docstring): `input_ids`, `loss_mask` and `rollout_logprobs` are exactly
    `graph.sequence_for(leaf)`'s, `position_ids` count from 0, with `leaf_id`, `reward`,
    `stop_reason` and the path's ids. `numpy=True`: per-token fields as numpy arrays (int64,
    float64 logprobs) instead of lists."""
    with graph.lock:
        return list(iter_token_samples(graph, numpy=numpy))


# ---------------------------------------------------------------- tree


#: The 8-byte keys of logprobs that are not plain floats (`_Packer._bits`): the signaling-NaN
#: space of positive floats, [0x7FF4 << 48, 0x7FF8 << 48).
_TAGGED, _TAGGED_END = 0x7FF4 << 48, 0x7FF8 << 48
_FLOAT = frozenset({float})
_PACK_FLOAT = struct.Struct("<d").pack
_FLOAT_BITS = struct.Struct("<Q").unpack


class _Node:
    """A run of tokens shared by the same paths, all of one turn (of the path that first
    brought them)."""

    __slots__ = ("bits", "children", "ends", "ids", "lps", "mask", "parent", "turn")

    def __init__(
        self,
        ids: list[int],
        mask: bytes,
        lps: list[Any],
        bits: bytes,
        turn: str | None,
        parent: _Node | None,
    ) -> None:
        self.ids = ids
        self.mask = mask
        self.lps = lps
        self.bits = bits  # the logprobs as float64 bytes: compared exactly, NaN included
        self.turn = turn
        self.parent = parent
        self.children: dict[tuple[int, int, bytes], _Node] = {}
        self.ends: list[int] = []  # paths whose last token is this node's last

    def key(self) -> tuple[int, int, bytes]:
        return (self.ids[0], self.mask[0], self.bits[:8])

    def split(self, k: int) -> _Node:
        """Keep the first `k` tokens; the rest become the one child (which takes over this
        node's children and the paths ending here)."""
        tail = _Node(
            self.ids[k:],
            self.mask[k:],
            self.lps[k:],
            self.bits[k * 8 :],
            self.turn,
            self,
        )
        tail.children, tail.ends = self.children, self.ends
        for child in tail.children.values():
            child.parent = tail
        self.ids, self.mask, self.lps, self.bits = (
            self.ids[:k],
            self.mask[:k],
            self.lps[:k],
            self.bits[: k * 8],
        )
        self.children, self.ends = {tail.key(): tail}, []
        return tail


def _agree(node: _Node, ids: list[int], mask: bytes, bits: bytes, start: int, m: int) -> bool:
    """Whether the node's first `m` tokens are the path's from `start`."""
    return (
        node.ids[:m] == ids[start : start + m]
        and node.mask[:m] == mask[start : start + m]
        and node.bits[: m * 8] == bits[start * 8 : (start + m) * 8]
    )


def _common(node: _Node, ids: list[int], mask: bytes, bits: bytes, start: int, m: int) -> int:
    """How many leading tokens (at most `m`, at least 1: the first matched its key) the node
    shares with the path from `start`; slices compared in C, by halving."""
    if _agree(node, ids, mask, bits, start, m):
        return m
    low, high = 1, m - 1  # agree on `low`, the answer is at most `high`
    while low < high:
        mid = (low + high + 1) // 2
        if _agree(node, ids, mask, bits, start, mid):
            low = mid
        else:
            high = mid - 1
    return low


def _turn_spans(graph: Graph, leaf_id: str) -> list[tuple[int, str]]:
    """(start, turn id) of each turn's tokens along a path (`Graph.token_spans`): a turn
    holds from the end of the turn before it to its own end (prompt + sampled), only a turn
    whose tokens begin the row."""
    return [(start, node_id) for node_id, start, _ in graph.token_spans(leaf_id)]


class _Packer:
    """The prefix tree of many paths (under a synthetic root), then its rows."""

    def __init__(self) -> None:
        self.root = _Node([], b"", [], b"", None, None)
        self.paths: list[dict[str, Any]] = []
        self.n_paths = 0
        # logprobs that are not plain floats, numbered (see `_bits`)
        self.tagged: dict[tuple[type, int], int] = {}

    def _bits(self, lps: list[Any]) -> bytes:
        """Each logprob as 8 bytes, equal exactly when the values are (as `json.dumps` writes
        them): a float as its float64 bits (one NaN is another), an int (`-1` from a
        JavaScript client, or one a float cannot hold) as a number of its own in the
        signaling-NaN space (where no float Python makes from text or arithmetic falls; a
        float there is numbered too): `-1` never meets `-1.0`, nor two ints one float holds."""
        if set(map(type, lps)) <= _FLOAT and not any(map(math.isnan, lps)):
            return array("d", lps).tobytes()
        out, tagged = array("Q"), self.tagged
        for lp in lps:
            bits = _FLOAT_BITS(_PACK_FLOAT(lp))[0] if type(lp) is float else -1
            if bits < 0 or _TAGGED <= bits < _TAGGED_END:
                key = (float, bits) if bits >= 0 else (type(lp), lp)
                bits = _TAGGED + tagged.setdefault(key, len(tagged))
            out.append(bits)
        return out.tobytes()

    def add_graph(self, graph: Graph, index: int) -> None:
        meta = graph.meta
        for row in iter_token_samples(graph):
            ids = row["input_ids"]
            if not ids:
                continue
            spans = _turn_spans(graph, row["leaf_id"])
            stop = row["stop_reason"]
            self._insert(ids, bytes(row["loss_mask"]), row["rollout_logprobs"], spans)
            self.paths.append(
                {
                    "leaf_id": row["leaf_id"],
                    "reward": meta.reward_for(row["leaf_id"]),
                    "stop_reason": stop,
                    "n_trainable": 0,  # counted once owners are known
                    "length": len(ids),
                    "graph": index,
                }
            )

    def _insert(
        self, ids: list[int], mask: bytes, lps: list[Any], spans: list[tuple[int, str]]
    ) -> None:
        bits = self._bits(lps)
        node, pos, n = self.root, 0, len(ids)
        while pos < n:
            child = node.children.get((ids[pos], mask[pos], bits[pos * 8 : pos * 8 + 8]))
            if child is None:
                break
            m = min(len(child.ids), n - pos)
            k = _common(child, ids, mask, bits, pos, m)
            if k < len(child.ids):
                child.split(k)
            node, pos = child, pos + k
        if pos < n:  # the rest is new: one node per turn it spans
            cuts = [start for start, _ in spans if pos < start < n]
            owners = {start: turn for start, turn in spans}
            turn = next(t for start, t in reversed(spans) if start <= pos)
            for a, b in zip([pos, *cuts], [*cuts, n], strict=True):
                turn = owners.get(a, turn)
                fresh = _Node(ids[a:b], mask[a:b], lps[a:b], bits[a * 8 : b * 8], turn, node)
                node.children[fresh.key()] = fresh
                node = fresh
        node.ends.append(self.n_paths)
        self.n_paths += 1

    def rows(self, forest: bool) -> list[dict[str, Any]]:
        # where each path ends now (a split hands the paths ending at a node to its tail)
        ends: list[_Node | None] = [None] * self.n_paths
        stack = [self.root]
        while stack:
            node = stack.pop()
            for p in node.ends:
                ends[p] = node
            stack.extend(node.children.values())
        owner: dict[int, int] = {}  # id(node) -> owning path
        for p, leaf in enumerate(ends):
            overflow = self.paths[p]["stop_reason"] in OVERFLOW_STOP_REASONS
            walk: _Node | None = leaf
            while walk is not None:
                current = owner.get(id(walk))
                if current is None:
                    owner[id(walk)] = p
                elif overflow or self.paths[current]["stop_reason"] not in OVERFLOW_STOP_REASONS:
                    break  # owned by an earlier path this one does not displace (nor above)
                else:
                    owner[id(walk)] = p  # an earlier overflowed path gives way
                walk = walk.parent
        if not self.n_paths:
            return []  # nothing with token ids to pack
        tops = [self.root] if forest else list(self.root.children.values())
        return [self._row(top, ends, owner, forest) for top in tops]

    def _row(
        self, top: _Node, ends: list[_Node | None], owner: dict[int, int], forest: bool
    ) -> dict[str, Any]:
        order: list[_Node] = []
        index: dict[int, int] = {}
        depth: dict[int, int] = {}  # token offset of each node along its root path
        stack: list[tuple[_Node, int]] = [(top, 0)]
        while stack:  # pre-order, children in insertion order (dicts keep it)
            node, at = stack.pop()
            index[id(node)] = len(order)
            depth[id(node)] = at
            order.append(node)
            below = at + len(node.ids)
            stack.extend((c, below) for c in reversed(list(node.children.values())))
        n_nodes = len(order)
        parent = [
            index[id(node.parent)] if node.parent is not None and id(node.parent) in index else -1
            for node in order
        ]
        exit_ = list(range(1, n_nodes + 1))
        for i in range(n_nodes - 1, 0, -1):  # a node's subtree ends where its last child's does
            if parent[i] >= 0:
                exit_[parent[i]] = max(exit_[parent[i]], exit_[i])
        input_ids: list[int] = []
        loss_mask: list[int] = []
        logprobs: list[Any] = []
        positions: list[int] = []
        token_node: list[int] = []
        token_owner: list[int] = []
        offsets: list[int] = []
        for i, node in enumerate(order):
            n = len(node.ids)
            offsets.append(len(input_ids))
            input_ids += node.ids
            loss_mask += node.mask
            logprobs += node.lps
            at = depth[id(node)]
            positions += range(at, at + n)
            token_node += [i] * n
            token_owner += [owner.get(id(node), -1)] * n
        members = sorted({p for p, end in enumerate(ends) if end is not None and id(end) in index})
        local = {p: k for k, p in enumerate(members)}
        paths = []
        for p in members:
            paths.append({"leaf_node": index[id(ends[p])], **self.paths[p]})
        for node in order:
            if owner.get(id(node)) is not None and node.mask:
                paths[local[owner[id(node)]]]["n_trainable"] += sum(node.mask)
        token_owner = [local[p] if p >= 0 else -1 for p in token_owner]
        return {
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "rollout_logprobs": logprobs,
            "position_ids": positions,
            "token_node": token_node,
            "token_owner_path": token_owner,
            "node_ids": [node.turn for node in order],
            "node_parent": parent,
            "node_enter": list(range(n_nodes)),
            "node_exit": exit_,
            "node_offset": offsets,
            "node_length": [len(node.ids) for node in order],
            "paths": paths,
            "n_tokens": len(input_ids),
            "n_trainable": sum(loss_mask),
        }


def iter_tree_samples(source: Any, *, numpy: bool = False) -> Iterator[dict[str, Any]]:
    """`tree_samples`, as an iterator (the packing is built first, whole)."""
    forest = not isinstance(source, Graph)
    graphs = _graphs(source, "tree_samples")
    packer = _Packer()
    for i, graph in enumerate(graphs):
        with graph.lock:
            packer.add_graph(graph, i)
    groups = {graph.meta.group for graph in graphs}
    group = groups.pop() if len(groups) == 1 else None
    for row in packer.rows(forest):
        row["group"] = group
        row["n_graphs"] = len(graphs)
        yield _as_numpy(row, (*TREE_TOKEN_FIELDS, *TREE_NODE_FIELDS)) if numpy else row


def tree_samples(source: Any, *, numpy: bool = False) -> list[dict[str, Any]]:
    """Tree-packed rows (see the module docstring): for one graph, one row per trajectory
    (a tree of paths sharing their first token); for a list of graphs (a group), one row:
    the forest of all their paths under a synthetic root (no row when no path has token
    ids). `numpy=True`: per-token and per-node fields as numpy arrays."""
    return list(iter_tree_samples(source, numpy=numpy))


def tree_attention_mask(row: dict[str, Any]) -> Any:
    """The boolean (n, n) mask of a tree row: `mask[a, b]` iff token a may attend token b
    (b's node is an ancestor-or-self of a's, and b is not after a).

    n * n booleans: for checking and for small rows. An attention kernel tests the same
    thing per pair from `token_node`, `node_enter` and `node_exit` (for PyTorch flex
    attention, a `mask_mod`: ``enter[nb] <= enter[na] < exit[nb] and kv <= q``)."""
    import numpy as np

    node = np.asarray(row["token_node"], dtype=np.int64)
    enter = np.asarray(row["node_enter"], dtype=np.int64)[node]
    exit_ = np.asarray(row["node_exit"], dtype=np.int64)[node]
    n = len(node)
    ancestor = (enter[None, :] <= enter[:, None]) & (enter[:, None] < exit_[None, :])
    causal = np.arange(n)[None, :] <= np.arange(n)[:, None]
    return ancestor & causal

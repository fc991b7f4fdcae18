"""Training rows: per-path rows are the graph's sequences; tree rows hold each token once and
give, under their tree mask, what every path alone gives (walked back, and through a numpy
reference attention layer with rotary positions)."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollout_store import (
    InvalidArgumentError,
    RolloutGraph,
    TurnNode,
    export_session,
    token_samples,
    tree_attention_mask,
    tree_samples,
    write_rows,
    write_session_json,
)
from rollout_store.export.rows import OVERFLOW_STOP_REASONS

TOKEN_FIELDS = ("input_ids", "loss_mask", "rollout_logprobs", "position_ids")


def _turn(node_id: str, prompt: list[int], sampled: list[int], **kw: Any) -> TurnNode:
    rng = random.Random(node_id)
    return TurnNode(
        request_messages=[{"role": "user", "content": node_id}],
        response_message={"role": "assistant", "content": node_id},
        prompt_ids=prompt,
        sampled_ids=sampled,
        sampled_logprobs=[-rng.random() for _ in sampled],
        node_id=node_id,
        **kw,
    )


def _fan_out() -> RolloutGraph:
    """A root with three children (one overflowed), each of which ends a path."""
    graph = RolloutGraph()
    graph.add_turn(_turn("r", [1, 2, 3, 4], [5, 6, 7]))
    base = [1, 2, 3, 4, 5, 6, 7]
    graph.add_turn(_turn("x", [*base, 10], [11, 12]))
    graph.add_turn(_turn("y", [*base, 20, 21], [22], finish_reason="length"))
    graph.add_turn(_turn("z", [*base, 10], [13, 14, 15]))  # shares x's new prompt token
    return graph


def _nested() -> RolloutGraph:
    """Forks under forks, a chain through them, and a second, unrelated root."""
    graph = RolloutGraph()
    graph.add_turn(_turn("a", [1, 2], [3]))
    graph.add_turn(_turn("b1", [1, 2, 3, 4], [5, 6]))
    graph.add_turn(_turn("b2", [1, 2, 3, 7], [8], finish_reason="length"))
    graph.add_turn(_turn("c1", [1, 2, 3, 4, 5, 6, 9], [10]))
    graph.add_turn(_turn("c2", [1, 2, 3, 4, 5, 6, 11], [12, 13]))
    graph.add_turn(_turn("d", [1, 2, 3, 4, 5, 6, 11, 12, 13, 14], [15]))
    graph.add_turn(_turn("e", [1, 2, 3, 4, 5, 6, 11, 12, 13, 14, 15, 16], [17, 18]))
    graph.add_turn(_turn("b2-retry", [1, 2, 3, 7], [8, 19]))
    graph.add_turn(_turn("other", [40, 41], [42]))
    return graph


def _stripped(turns: int = 6) -> RolloutGraph:
    """Each turn re-renders history without the earlier turns' thinking: a root per turn."""
    graph = RolloutGraph()
    history = [1, 2, 3]
    for k in range(turns):
        think, answer = [100 + k, 101 + k], [200 + k]
        graph.add_turn(_turn(f"t{k}", [*history, 9], [*think, *answer]))
        history = [*history, 9, *answer, 50 + k]
    return graph


def _group(n: int = 4) -> list[RolloutGraph]:
    graphs = []
    for i in range(n):
        graph = RolloutGraph()
        prompt = list(range(1, 30))
        graph.add_turn(_turn(f"g{i}-0", prompt, [300 + i, 301]))
        graph.add_turn(_turn(f"g{i}-1", [*prompt, 300 + i, 301, 7], [302, 303 + i % 2]))
        graph.set_reward(float(i), leaf=f"g{i}-1")
        graph.set_group("grp")
        graphs.append(graph)
    return graphs


CASES = {
    "fan_out": lambda: [_fan_out()],
    "nested": lambda: [_nested()],
    "stripped": lambda: [_stripped()],
    "group": _group,
}


def _rows_of(graphs: list[RolloutGraph]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per-path rows of every graph, and the tree rows (one forest for several graphs)."""
    paths = [row for graph in graphs for row in token_samples(graph)]
    trees = tree_samples(graphs) if len(graphs) > 1 else tree_samples(graphs[0])
    return paths, trees


def _path_tokens(tree: dict[str, Any], leaf_node: int) -> list[int]:
    """The row indexes of the tokens on the path from the root to `leaf_node`, in order."""
    chain = []
    node = leaf_node
    while node >= 0:
        chain.append(node)
        node = tree["node_parent"][node]
    out: list[int] = []
    for node in reversed(chain):
        start = tree["node_offset"][node]
        out.extend(range(start, start + tree["node_length"][node]))
    return out


def _each_path(graphs):
    paths, trees = _rows_of(graphs)
    by_leaf = {(row["leaf_id"]): row for row in paths}
    for tree in trees:
        for path in tree["paths"]:
            yield tree, path, by_leaf[path["leaf_id"]]


@pytest.mark.parametrize("case", sorted(CASES))
def test_path_rows_are_the_graphs_sequences(case: str) -> None:
    for graph in CASES[case]():
        rows = token_samples(graph)
        assert [row["leaf_id"] for row in rows] == graph.leaf_ids()
        for row in rows:
            seq = graph.sequence_for(row["leaf_id"])
            assert row["input_ids"] == seq.input_ids and row["loss_mask"] == seq.loss_mask
            assert row["rollout_logprobs"] == seq.logprobs
            assert row["position_ids"] == list(range(len(seq.input_ids)))
            assert row["reward"] == graph.reward_for(row["leaf_id"])
            assert row["stop_reason"] == graph.get(row["leaf_id"]).finish_reason


@pytest.mark.parametrize("case", sorted(CASES))
def test_walking_a_tree_row_gives_every_path_row(case: str) -> None:
    graphs = CASES[case]()
    seen = set()
    for tree, path, row in _each_path(graphs):
        at = _path_tokens(tree, path["leaf_node"])
        assert len(at) == path["length"] == len(row["input_ids"])
        for name in TOKEN_FIELDS:
            assert [tree[name][i] for i in at] == row[name], name
        assert path["reward"] == row["reward"] and path["stop_reason"] == row["stop_reason"]
        seen.add(path["leaf_id"])
    assert seen == {row["leaf_id"] for g in graphs for row in token_samples(g)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_token_once_and_trained_once(case: str) -> None:
    graphs = CASES[case]()
    paths, trees = _rows_of(graphs)
    # every distinct path prefix (token, mask, logprob all the same) is one token of a row
    prefixes = {
        tuple(zip(*(row[f][: i + 1] for f in TOKEN_FIELDS[:3]), strict=True))
        for row in paths
        for i in range(len(row["input_ids"]))
    }
    assert sum(tree["n_tokens"] for tree in trees) == len(prefixes)
    for tree in trees:
        assert tree["n_trainable"] == sum(p["n_trainable"] for p in tree["paths"])
        for i, owner in enumerate(tree["token_owner_path"]):
            assert i in _path_tokens(tree, tree["paths"][owner]["leaf_node"])


def test_an_overflowed_leaf_never_owns_a_shared_node() -> None:
    for graphs in (CASES["fan_out"](), CASES["nested"]()):
        (tree, *_) = _rows_of(graphs)[1]
        reached: dict[int, set[int]] = {}
        for p, path in enumerate(tree["paths"]):
            for i in _path_tokens(tree, path["leaf_node"]):
                reached.setdefault(tree["token_node"][i], set()).add(p)
        overflowed = {
            p
            for p, path in enumerate(tree["paths"])
            if path["stop_reason"] in OVERFLOW_STOP_REASONS
        }
        assert overflowed
        for i, owner in enumerate(tree["token_owner_path"]):
            node = tree["token_node"][i]
            if owner in overflowed:
                assert reached[node] <= overflowed, (node, reached[node])


def test_tree_interval_and_mask_follow_the_definition() -> None:
    (tree,) = tree_samples(_group(), numpy=False)
    enter, exit_, parent = tree["node_enter"], tree["node_exit"], tree["node_parent"]
    for a in range(len(enter)):
        ancestors = set()
        node = a
        while node >= 0:
            ancestors.add(node)
            node = parent[node]
        for d in range(len(enter)):
            assert (enter[d] <= enter[a] < exit_[d]) == (d in ancestors)
    mask = tree_attention_mask(tree)
    node = tree["token_node"]
    for a in range(len(node)):
        path = set(_path_tokens(tree, node[a]))
        for b in range(len(node)):
            assert mask[a, b] == (b in path and b <= a)


def test_a_group_forest_holds_the_shared_prompt_once() -> None:
    graphs = _group(6)
    (tree,) = tree_samples(graphs)
    assert tree["node_ids"][0] is None and tree["node_parent"][0] == -1
    assert tree["input_ids"].count(1) == 1 and tree["n_graphs"] == 6
    assert tree["group"] == "grp"
    assert sorted(p["graph"] for p in tree["paths"]) == list(range(6))
    per_path = sum(len(row["input_ids"]) for g in graphs for row in token_samples(g))
    assert tree["n_tokens"] < per_path / 3


# ---------------------------------------------------------------- reference attention


def _rotary(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (np.arange(half) / half))
    angle = positions[:, None] * freq[None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _layers(ids: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Two attention layers (rotary queries and keys, masked softmax, residual)."""
    rng = np.random.default_rng(7)
    dim = 16
    table = rng.normal(size=(512, dim))
    weights = [rng.normal(size=(3, dim, dim)) / np.sqrt(dim) for _ in range(2)]
    h = table[ids % 512]
    for wq, wk, wv in weights:
        q, k, v = _rotary(h @ wq, positions), _rotary(h @ wk, positions), h @ wv
        scores = np.where(mask, q @ k.T / np.sqrt(dim), -np.inf)
        scores -= scores.max(axis=1, keepdims=True)
        weights_ = np.exp(scores)
        h = h + (weights_ / weights_.sum(axis=1, keepdims=True)) @ v
    return h


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_attention_over_the_tree_equals_each_path(case: str) -> None:
    graphs = CASES[case]()
    _, trees = _rows_of(graphs)
    for tree in trees:
        ids = np.asarray(tree["input_ids"])
        out = _layers(ids, np.asarray(tree["position_ids"], float), tree_attention_mask(tree))
        for path in tree["paths"]:
            at = _path_tokens(tree, path["leaf_node"])
            n = len(at)
            alone = _layers(ids[at], np.arange(n, dtype=float), np.tril(np.ones((n, n), bool)))
            np.testing.assert_allclose(out[at], alone, rtol=1e-6, atol=1e-9)
    # a wrong mask (plain causal over the packed row) does not give the paths' outputs
    tree = trees[0]
    n = len(tree["input_ids"])
    ids = np.asarray(tree["input_ids"])
    causal = _layers(ids, np.asarray(tree["position_ids"], float), np.tril(np.ones((n, n), bool)))
    last = tree["paths"][-1]
    at = _path_tokens(tree, last["leaf_node"])
    if len(at) < n:
        alone = _layers(
            ids[at], np.arange(len(at), dtype=float), np.tril(np.ones((len(at),) * 2, bool))
        )
        assert not np.allclose(causal[at], alone, rtol=1e-6)


# ---------------------------------------------------------------- files and formats


def test_rows_of_a_loaded_graph_equal_the_writers(tmp_path: Path) -> None:
    for name, make in CASES.items():
        graphs = make()
        loaded = []
        for i, graph in enumerate(graphs):
            graph.save(tmp_path / f"{name}-{i}.rls")
            loaded.append(RolloutGraph.load(tmp_path / f"{name}-{i}.rls"))
        assert _rows_of(loaded) == _rows_of(graphs)
        log = tmp_path / f"{name}.log.rls"
        with RolloutGraph.open(log) as appending:
            for node_id in graphs[0].node_ids():
                node = graphs[0].get(node_id)
                appending.add_turn(
                    _turn(
                        node_id, node.prompt_ids, node.sampled_ids, finish_reason=node.finish_reason
                    )
                )
            appending.update_metadata(rewards=graphs[0].rewards, group=graphs[0].group)
        assert token_samples(RolloutGraph.load(log)) == token_samples(graphs[0])
        assert tree_samples(RolloutGraph.load(log)) == tree_samples(graphs[0])


def test_numpy_rows_hold_the_same_values() -> None:
    graph = _nested()
    for plain, arrays in zip(token_samples(graph), token_samples(graph, numpy=True), strict=True):
        assert isinstance(arrays["input_ids"], np.ndarray) and arrays["input_ids"].dtype == np.int64
        for name in TOKEN_FIELDS:
            assert arrays[name].tolist() == plain[name]
    for plain, arrays in zip(tree_samples(graph), tree_samples(graph, numpy=True), strict=True):
        for name in ("token_node", "token_owner_path", "node_parent", "node_exit"):
            assert arrays[name].tolist() == plain[name]


def test_parquet_and_jsonl_read_back(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    graphs = _group()
    paths = [row for g in graphs for row in token_samples(g)]
    assert write_rows(paths, tmp_path / "p.parquet", "path") == len(paths)
    back = pq.read_table(tmp_path / "p.parquet").to_pylist()
    for row, read in zip(paths, back, strict=True):
        assert set(read) == set(row)
        for name, value in row.items():
            expected = float(value) if name == "reward" and value is not None else value
            assert read[name] == expected, name
    (tree,) = tree_samples(graphs)
    write_rows([tree], tmp_path / "t.parquet", "tree")
    (read,) = pq.read_table(tmp_path / "t.parquet").to_pylist()
    for name in ("input_ids", "loss_mask", "rollout_logprobs", "position_ids", "node_exit"):
        assert read[name] == tree[name]
    assert [p["leaf_id"] for p in read["paths"]] == [p["leaf_id"] for p in tree["paths"]]
    assert [p["reward"] for p in read["paths"]] == [p["reward"] for p in tree["paths"]]
    write_rows([tree], tmp_path / "t.jsonl", "tree")
    assert json.loads((tmp_path / "t.jsonl").read_text()) == json.loads(json.dumps(tree))


def test_write_rows_refuses_unknown_kinds_and_suffixes(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="path, tree"):
        write_rows([], tmp_path / "a.parquet", "paths")
    with pytest.raises(InvalidArgumentError, match=r"\.parquet, \.jsonl"):
        write_rows([], tmp_path / "a.csv", "path")
    assert not (tmp_path / "a.csv").exists()


def test_writing_parquet_streams(tmp_path: Path) -> None:
    """Memory while writing stays within 2x the largest row, whatever the number of rows."""
    import tracemalloc

    import pyarrow as pa

    n_tokens = 20_000

    def row(i: int) -> dict[str, Any]:
        ids = np.arange(i, i + n_tokens, dtype=np.int64)
        return {
            "input_ids": ids,
            "loss_mask": np.ones(n_tokens, np.int8),
            "rollout_logprobs": np.full(n_tokens, -0.5),
            "position_ids": np.arange(n_tokens, dtype=np.int32),
            "leaf_id": f"leaf-{i}",
            "reward": 1.0,
            "stop_reason": "stop",
            "root_id": "r",
            "node_ids": ["r"],
            "n_trainable": n_tokens,
            "discarded": False,
            "group": None,
        }

    write_rows([row(0)], tmp_path / "warm.parquet", "path")  # imports done before measuring
    tracemalloc.start()
    one = row(0)
    row_bytes = tracemalloc.get_traced_memory()[0]
    del one
    peaks = []
    default = pa.default_memory_pool()
    try:
        for count in (8, 64):
            pool = pa.proxy_memory_pool(default)  # counts its own peak: Arrow's buffers
            pa.set_memory_pool(pool)
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            write_rows((row(i) for i in range(count)), tmp_path / f"{count}.parquet", "path")
            peak = tracemalloc.get_traced_memory()[1] - base  # Python and numpy's memory
            peaks.append((peak, pool.max_memory()))
            assert peak <= 2 * row_bytes, (peak, row_bytes)
            assert pool.max_memory() <= 2 * row_bytes, (pool.max_memory(), row_bytes)
            assert pq_rows(tmp_path / f"{count}.parquet") == count
    finally:
        pa.set_memory_pool(default)
        tracemalloc.stop()
    assert peaks[1][0] < peaks[0][0] * 1.5 and peaks[1][1] < peaks[0][1] * 1.5, peaks


def pq_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return int(pq.ParquetFile(path).metadata.num_rows)


def test_graphs_without_token_ids_give_no_tree_rows() -> None:
    graph = RolloutGraph()
    graph.add_turn(
        TurnNode(request_messages=[{"role": "user", "content": "q"}], response_message={})
    )
    assert [row["input_ids"] for row in token_samples(graph)] == [[]]
    assert tree_samples(graph) == [] and tree_samples([graph]) == [] and tree_samples([]) == []
    with pytest.raises(InvalidArgumentError, match="item 1"):
        tree_samples([graph, "not a graph"])


def test_samples_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import pyarrow.parquet as pq

    from rollout_store.cli import main

    files = []
    for i, graph in enumerate(_group(3)):
        graph.save(tmp_path / f"g{i}.rls")
        files.append(str(tmp_path / f"g{i}.rls"))
    loaded = [RolloutGraph.load(f) for f in files]
    assert main(["samples", *files, "--format", "path", "-o", str(tmp_path / "p.parquet")]) == 0
    read = pq.read_table(tmp_path / "p.parquet").to_pylist()
    assert [r["input_ids"] for r in read] == [
        r["input_ids"] for g in loaded for r in token_samples(g)
    ]
    out = tmp_path / "f.jsonl"
    assert main(["samples", *files, "--format", "tree", "--group", "-o", str(out)]) == 0
    (forest,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert forest == json.loads(json.dumps(tree_samples(loaded)[0]))
    assert main(["samples", *files, "--format", "tree", "-o", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 3  # a row per file's trajectory
    capsys.readouterr()
    assert main(["samples", files[0], "--group", "-o", str(out)]) == 1
    assert "--format tree" in capsys.readouterr().err
    assert main(["samples", files[0], "-o", str(tmp_path / "x.csv")]) == 1
    assert ".parquet, .jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["samples", files[0], "--format", "forest", "-o", str(out)])
    assert exit_.value.code == 2 and "'path', 'tree'" in capsys.readouterr().err


def _one(logprob: Any, finish: str | None = None) -> RolloutGraph:
    graph = RolloutGraph()
    graph.add_turn(
        TurnNode(
            request_messages=[{"role": "user", "content": "q"}],
            prompt_ids=[1, 2, 3],
            sampled_ids=[7, 8],
            sampled_logprobs=[logprob, -0.5],
            finish_reason=finish,
        )
    )
    return graph


def test_tree_rows_share_a_token_only_when_its_logprob_is_the_same_json() -> None:
    """-1 (a JavaScript client's) is not -1.0, nor are two ints one float holds: a tree row
    shares their tokens with no other path, and each path unpacks to exactly its flat row
    (under json.dumps), where the first path's value stood for the others'."""
    for pair in ([-1, -1.0], [-(2**53), -(2**53) - 1], [0, -0.0, 0.0], [-1.5, -1.5]):
        group = [_one(lp) for lp in pair]
        (tree,) = tree_samples(group)
        for path in tree["paths"]:
            flat = token_samples(group[path["graph"]])[0]
            at = _path_tokens(tree, path["leaf_node"])
            for name in TOKEN_FIELDS:
                assert json.dumps([tree[name][i] for i in at]) == json.dumps(flat[name]), pair
        distinct = len({json.dumps(lp) for lp in pair})
        assert tree["n_tokens"] == 3 + distinct + 1 * distinct  # the prompt once


def test_an_int_logprob_no_float_holds_is_a_finding_not_an_error(tmp_path: Path) -> None:
    """-10**400 is recorded exactly; a row with it is untrainable (invalid_logprob), and
    every export and row form gives it back (numpy ones as Python values)."""
    graph = _one(-(10**400))
    document = export_session(graph)
    (sequence,) = document["sequences"]
    assert not sequence["trainable"] and "invalid_logprob" in sequence["validation"][0]
    assert json.dumps(sequence["logprobs"]) == json.dumps([0.0, 0.0, 0.0, -(10**400), -0.5])
    (tree,) = tree_samples(graph)
    assert json.dumps(tree["rollout_logprobs"]) == json.dumps(sequence["logprobs"])
    (row,) = token_samples(graph, numpy=True)
    assert row["rollout_logprobs"].tolist() == sequence["logprobs"]
    out = io.StringIO()
    write_session_json(graph, out)
    assert json.loads(out.getvalue()) == json.loads(json.dumps(document))


def test_a_string_parquet_cannot_hold_is_refused_naming_its_field(tmp_path: Path) -> None:
    graph = _one(-0.25, finish="stop\udc00")
    assert token_samples(graph)[0]["stop_reason"] == "stop\udc00"  # recorded exactly
    for kind, rows in (("path", token_samples(graph)), ("tree", tree_samples(graph))):
        with pytest.raises(InvalidArgumentError, match=r"stop_reason|paths"):
            write_rows(rows, tmp_path / "rows.parquet", kind)
        assert not (tmp_path / "rows.parquet").exists()
    assert write_rows(token_samples(graph), tmp_path / "rows.jsonl", "path") == 1


def test_a_turn_whose_tokens_do_not_begin_the_row_holds_none_of_it() -> None:
    """Under an explicit parent with other tokens, the child's row is its own tokens alone,
    and a tree row labels them all with the child (the parent's lengths gave the parent the
    first three, which it never had)."""
    graph = RolloutGraph()
    graph.add_turn(_turn("A", [1, 2], [3]))
    graph.add_turn(_turn("B", [9, 9, 9, 9], [4], parent_id="A"))
    assert graph.path_ids("B") == ["A", "B"]
    assert graph.token_spans("B") == [("B", 0, 5)]
    assert graph.token_spans("A") == [("A", 0, 3)]
    (tree,) = tree_samples(graph)
    labels = {}
    for node, turn in enumerate(tree["node_ids"]):
        start, n = tree["node_offset"][node], tree["node_length"][node]
        labels.setdefault(turn, []).extend(tree["input_ids"][start : start + n])
    assert labels == {"B": [9, 9, 9, 9, 4]}  # (A ends no path: its tokens are in no row)
    chain = RolloutGraph()
    chain.add_turn(_turn("a", [1, 2], [3]))
    chain.add_turn(_turn("b", [1, 2, 3, 4], [5]))
    assert chain.token_spans("b") == [("a", 0, 3), ("b", 3, 5)]

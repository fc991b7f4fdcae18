"""Training rows per path against tree-packed rows: tokens, attention pairs, rows per second.

Shapes (token ids drawn from a seeded generator, so segments never share by chance):

- a thinking-stripped agent at 8, 32 and 64 turns: each call's token ids re-render the
  history without the earlier answers' thinking (as Qwen3's template does), so each turn is
  a root of its own (the drift audit records it) and its path carries the whole history;
  with best-of-1 and best-of-4 (four samples of every call, one continues);
- a GRPO group of 16 rollouts sharing a 1,000-token prompt, two calls each, packed as one
  forest.

Per shape: tokens and attention pairs (causal per path; under the tree mask in the packed
row) per trainable token, and trainable tokens both ways, which must be equal. Then Parquet
writing: rows per second for the 64-turn agent's path and tree rows, and memory while writing
`--gb` GiB of rows (Python and numpy's peak by tracemalloc, Arrow's by a proxy pool) against
the largest single row. Writes out/training_rows.json (results/ with --update-results); ends
with PASS/MISS lines and a count of targets met and missed.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from measure import add_results_option, library_commit, results_dir, shown, targets_summary

from rollout_store import (
    RolloutGraph,
    TurnNode,
    iter_token_samples,
    token_samples,
    tree_samples,
    write_rows,
)

#: Sizes per call of the agent (tokens): system and task, thinking, answer, tool result.
SYSTEM, THINK, ANSWER, TOOL = 1500, 1700, 100, 350
TARGET_RATIO = 0.15  # tree tokens at most this share of per-path tokens (64 turns)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 150_000) for _ in range(n)]


def _jitter(rng: random.Random, n: int) -> int:
    return max(1, int(n * rng.uniform(0.7, 1.3)))


def stripped_agent(turns: int, best_of: int, seed: int = 0) -> RolloutGraph:
    """The thinking-stripped agent: history without thinking, a root per call."""
    rng = random.Random(seed)
    graph = RolloutGraph()
    history = _ids(rng, SYSTEM)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "task"}]
    for k in range(turns):
        kept = None
        for s in range(best_of):
            think, answer = _ids(rng, _jitter(rng, THINK)), _ids(rng, _jitter(rng, ANSWER))
            sampled = think + answer
            graph.add_turn(
                TurnNode(
                    request_messages=list(messages),
                    response_message={"role": "assistant", "content": f"a{k}.{s}"},
                    prompt_ids=history,
                    sampled_ids=sampled,
                    sampled_logprobs=[-0.25] * len(sampled),
                    node_id=f"t{k}.{s}",
                    finish_reason="tool_calls",
                )
            )
            if kept is None:
                kept = answer
        assert kept is not None
        history = history + kept + _ids(rng, _jitter(rng, TOOL))
        messages = [
            *messages,
            {"role": "assistant", "content": f"a{k}.0"},
            {"role": "tool", "content": f"r{k}"},
        ]
    return graph


def grpo_group(n: int = 16, prompt: int = 1000, seed: int = 1) -> list[RolloutGraph]:
    """`n` rollouts of one 1,000-token prompt, two calls each, one group."""
    rng = random.Random(seed)
    shared = _ids(rng, prompt)
    graphs = []
    for i in range(n):
        graph = RolloutGraph()
        first = _ids(rng, _jitter(rng, 500))
        graph.add_turn(
            TurnNode(prompt_ids=shared, sampled_ids=first, sampled_logprobs=[-0.5] * len(first))
        )
        second = _ids(rng, _jitter(rng, 400))
        graph.add_turn(
            TurnNode(
                prompt_ids=shared + first + _ids(rng, 120),
                sampled_ids=second,
                sampled_logprobs=[-0.5] * len(second),
            )
        )
        graph.set_reward(float(i % 2))
        graph.set_group("grpo")
        graphs.append(graph)
    return graphs


def figures(graphs: list[RolloutGraph], forest: bool) -> dict[str, Any]:
    """Tokens, attention pairs and trainable tokens per path and packed."""
    path_tokens = path_pairs = path_trainable = n_paths = 0
    for graph in graphs:
        for row in iter_token_samples(graph):
            n = len(row["input_ids"])
            path_tokens += n
            path_pairs += n * (n + 1) // 2
            path_trainable += sum(row["loss_mask"])
            n_paths += 1
    started = time.perf_counter()
    trees = tree_samples(graphs) if forest else tree_samples(graphs[0])
    pack_s = time.perf_counter() - started
    tree_tokens = sum(t["n_tokens"] for t in trees)
    tree_pairs = sum(sum(p + 1 for p in t["position_ids"]) for t in trees)
    tree_trainable = sum(t["n_trainable"] for t in trees)
    return {
        "paths": n_paths,
        "tree_rows": len(trees),
        "path_tokens": path_tokens,
        "tree_tokens": tree_tokens,
        "token_ratio": tree_tokens / path_tokens,
        "path_trainable": path_trainable,
        "tree_trainable": tree_trainable,
        "path_tokens_per_trainable": path_tokens / path_trainable,
        "tree_tokens_per_trainable": tree_tokens / tree_trainable,
        "path_pairs_per_trainable": path_pairs / path_trainable,
        "tree_pairs_per_trainable": tree_pairs / tree_trainable,
        "pack_s": pack_s,
        "trees": trees,
    }


def rows_per_second(graph: RolloutGraph, folder: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    for kind, rows in (("path", token_samples(graph)), ("tree", tree_samples(graph))):
        started = time.perf_counter()
        write_rows(rows, folder / f"{kind}.parquet", kind)
        seconds = time.perf_counter() - started
        size = (folder / f"{kind}.parquet").stat().st_size
        out[f"{kind}_rows_per_s"] = len(rows) / seconds
        out[f"{kind}_mb_per_s"] = sum(len(r["input_ids"]) for r in rows) * 8 / seconds / 1e6
        out[f"{kind}_file_mb"] = size / 1e6
    return out


def streaming_memory(gib: float, folder: Path, row_tokens: int = 500_000) -> dict[str, Any]:
    """Write `gib` GiB of path rows (numpy arrays, 21 bytes a token) and measure what the
    writing holds against the largest single row."""
    per_row = row_tokens * 21
    count = max(2, int(gib * (1 << 30) / per_row))

    def row(i: int) -> dict[str, Any]:
        return {
            "input_ids": np.arange(i, i + row_tokens, dtype=np.int64),
            "loss_mask": np.ones(row_tokens, np.int8),
            "rollout_logprobs": np.full(row_tokens, -0.5),
            "position_ids": np.arange(row_tokens, dtype=np.int32),
            "leaf_id": f"leaf-{i}",
            "reward": 1.0,
            "stop_reason": "stop",
            "root_id": "r",
            "node_ids": ["r"],
            "n_trainable": row_tokens,
            "discarded": False,
            "group": None,
        }

    write_rows([row(0)], folder / "warm.parquet", "path")
    default = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(default)
    pa.set_memory_pool(pool)
    tracemalloc.start()
    try:
        one = row(0)
        row_bytes = tracemalloc.get_traced_memory()[0]
        del one
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        started = time.perf_counter()
        write_rows((row(i) for i in range(count)), folder / "big.parquet", "path")
        seconds = time.perf_counter() - started
        python_peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        pa.set_memory_pool(default)
    total = count * per_row
    return {
        "rows": count,
        "bytes_of_rows": total,
        "largest_row_bytes": row_bytes,
        "python_numpy_peak": python_peak,
        "arrow_peak": pool.max_memory(),
        "peak_over_row": (python_peak + pool.max_memory()) / row_bytes,
        "seconds": seconds,
        "file_bytes": (folder / "big.parquet").stat().st_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="GiB of rows for the memory run")
    add_results_option(parser)
    args = parser.parse_args()
    results: dict[str, Any] = {"commit": library_commit(), "shapes": {}}
    checks: list[str] = []
    print(
        f"{'shape':<28} {'paths':>5} {'path tok':>10} {'tree tok':>9} {'ratio':>6} "
        f"{'tok/tr p':>8} {'tok/tr t':>8} {'pairs/tr p':>10} {'pairs/tr t':>10} {'pack s':>6}"
    )
    agent64 = None
    for best_of in (1, 4):
        for turns in (8, 32, 64):
            graph = stripped_agent(turns, best_of)
            if turns == 64 and best_of == 1:
                agent64 = graph
            f = figures([graph], forest=False)
            name = f"stripped {turns} turns best-of-{best_of}"
            _print(name, f)
            f.pop("trees")
            f["n_drift"] = graph.stats()["n_drift"]
            results["shapes"][name] = f
            if turns == 64:
                ok = f["token_ratio"] <= TARGET_RATIO and f["tree_trainable"] == f["path_trainable"]
                checks.append(
                    f"{'PASS' if ok else 'MISS'}  {name}: tree tokens {f['token_ratio']:.3f}x "
                    f"per-path (target <= {TARGET_RATIO}), trainable {f['tree_trainable']} tree "
                    f"vs {f['path_trainable']} per path"
                )
    group = grpo_group()
    f = figures(group, forest=True)
    _print("GRPO group of 16 (forest)", f)
    (forest,) = f.pop("trees")
    shared_once = sum(1 for p in forest["position_ids"] if p < 1000) == 1000
    results["shapes"]["grpo group 16"] = f
    checks.append(
        f"{'PASS' if shared_once else 'MISS'}  GRPO group of 16: the 1,000-token prompt is held "
        f"once in the forest ({f['tree_tokens']} tokens vs {f['path_tokens']} per path)"
    )
    assert agent64 is not None
    with tempfile.TemporaryDirectory() as tmp:
        speed = rows_per_second(agent64, Path(tmp))
        memory = streaming_memory(args.gb, Path(tmp))
    results["parquet"] = speed
    results["streaming"] = memory
    print(
        f"\nParquet, stripped 64 turns: {speed['path_rows_per_s']:.1f} path rows/s "
        f"({speed['path_mb_per_s']:.0f} MB/s of token ids, file {speed['path_file_mb']:.1f} MB), "
        f"{speed['tree_rows_per_s']:.1f} tree rows/s ({speed['tree_mb_per_s']:.0f} MB/s, "
        f"file {speed['tree_file_mb']:.1f} MB)"
    )
    print(
        f"writing {memory['bytes_of_rows'] / (1 << 30):.2f} GiB of rows ({memory['rows']} rows of "
        f"{memory['largest_row_bytes'] / 1e6:.1f} MB) in {memory['seconds']:.1f} s: peak "
        f"{memory['python_numpy_peak'] / 1e6:.1f} MB Python+numpy, "
        f"{memory['arrow_peak'] / 1e6:.1f} MB Arrow = {memory['peak_over_row']:.2f}x the "
        "largest row"
    )
    ok = memory["peak_over_row"] <= 2
    gib = memory["bytes_of_rows"] / (1 << 30)
    checks.append(
        f"{'PASS' if ok else 'MISS'}  memory while writing {gib:.2f} GiB of rows: "
        f"{memory['peak_over_row']:.2f}x the largest row (target <= 2x)"
    )
    out = results_dir(args.update_results) / "training_rows.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {shown(out)}")
    for line in checks:
        print(line)
    print(targets_summary(checks))


def _print(name: str, f: dict[str, Any]) -> None:
    print(
        f"{name:<28} {f['paths']:>5} {f['path_tokens']:>10} {f['tree_tokens']:>9} "
        f"{f['token_ratio']:>6.3f} {f['path_tokens_per_trainable']:>8.2f} "
        f"{f['tree_tokens_per_trainable']:>8.2f} {f['path_pairs_per_trainable']:>10.0f} "
        f"{f['tree_pairs_per_trainable']:>10.0f} {f['pack_s']:>6.2f}"
    )


if __name__ == "__main__":
    main()

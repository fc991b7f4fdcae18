"""What listing nodes costs: `graph.nodes()` views against the bytes the graph retains.

Builds each workload's graph under tracemalloc (bytes retained, as memory_per_turn.py
measures them), then, side by side in this run: the peak bytes allocated while listing every
node and reading its id, index and parent (views), and while rebuilding every node's messages
(what a list of fully built nodes would hold). Writes results/node_views.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import tracemalloc
from pathlib import Path
from typing import Any

from measure import library_commit, record_traced
from schemes import RolloutStoreRecorder
from workloads import WORKLOADS, iter_texts

RESULTS = Path(__file__).resolve().parent / "results" / "node_views.json"
MAX_SHARE = 0.01  # listing views must cost well under 1% of the graph's retained bytes


def _peak(action: Any) -> int:
    """Peak traced bytes above the current level while `action()` runs (tracemalloc on)."""
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    action()
    return tracemalloc.get_traced_memory()[1] - before


def _list_views(graph: Any) -> None:
    nodes = graph.nodes()
    seen = 0
    for node in nodes:
        seen += node.node_id is not None and node.index >= 0 and node.parent_id != node.node_id
    assert seen == len(nodes)


def _build_all(graph: Any) -> None:
    built = [
        (n.request_messages, n.response_message, n.prompt_ids, n.sampled_ids) for n in graph.nodes()
    ]
    assert len(built) == len(graph)


def measure(workload: str, n_turns: int) -> dict[str, Any]:
    texts = list(iter_texts(WORKLOADS[workload], n_turns))
    recorder, retained = record_traced(RolloutStoreRecorder, texts, [n_turns])
    graph = recorder.root  # type: ignore[attr-defined]
    tracemalloc.start()
    try:
        _list_views(graph)  # warm-up (method caches)
        views = _peak(lambda: _list_views(graph))
        built = _peak(lambda: _build_all(graph))
    finally:
        tracemalloc.stop()
    row = {
        "workload": workload,
        "turns": n_turns,
        "retained_bytes": retained[n_turns],
        "nodes_listing_bytes": views,
        "nodes_listing_bytes_per_turn": views / n_turns,
        "nodes_listing_share_of_retained": views / retained[n_turns],
        "all_messages_rebuilt_bytes": built,
        "rebuilt_over_views": built / views if views else None,
    }
    recorder.close()  # type: ignore[attr-defined]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--workloads", default="multimodal")
    args = parser.parse_args(argv)
    rows = [measure(name, args.turns) for name in args.workloads.split(",")]
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"commit": library_commit(), "rows": rows}, indent=2) + "\n")
    ok = True
    for row in rows:
        share = row["nodes_listing_share_of_retained"]
        verdict = "PASS" if share < MAX_SHARE else "MISS"
        ok = ok and share < MAX_SHARE
        print(
            f"{verdict} {row['workload']} {row['turns']} turns: nodes() + id/index/parent "
            f"{row['nodes_listing_bytes']:,} B ({row['nodes_listing_bytes_per_turn']:.0f} B/turn) "
            f"= {share:.3%} of {row['retained_bytes']:,} B retained; rebuilding every node's "
            f"messages {row['all_messages_rebuilt_bytes']:,} B ({row['rebuilt_over_views']:.0f}x)"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

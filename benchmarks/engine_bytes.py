"""Retained memory counted so that the engine's allocations are seen: process RSS against
tracemalloc plus the engine's own byte count, on one workload.

`tracemalloc` sees the interpreter's allocations only; the compiled engine allocates through
Rust's allocator, and reports what it holds itself (`ContentTable.nbytes`). Each case runs
twice, each time in a fresh worker process doing the same work: once under tracemalloc
(retained traced bytes, and the engine's bytes held by what was built), once without (the
growth of the process's anonymous resident memory, read after `gc.collect()` and glibc's
`malloc_trim(0)` hand freed pages back). The two agree when neither count misses anything.

Cases, over rollouts of the multimodal workload (independent rollouts one after the other,
so a finished rollout's generator state is freed and what stays is what was recorded):

* graph: a `RolloutGraph` records every turn. The engine's fixed bytes per turn are the
  engine bytes the graph holds between turns (`measure.engine_bytes`), over the turns: its
  request table's rows and index, its blob table's index (`_core.KeyNumbers`). It holds no
  packer between turns, which the worker checks.
* content table: every turn's messages (their JSON text) interned into one
  `_core.ContentTable`; its fixed bytes per entry (slots and index, beyond the content) are
  printed too.

    python benchmarks/engine_bytes.py [--rollouts 20] [--turns 50]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tracemalloc
from array import array
from pathlib import Path
from typing import Any

from measure import engine_bytes, targets_summary
from workloads import iter_bodies, multimodal

HERE = Path(__file__).resolve().parent
#: RSS and tracemalloc + engine bytes agree within this factor either way
AGREE = 1.10


def _rss_anon() -> int:
    """Anonymous resident bytes of this process (heap and mmapped blocks, no file pages),
    after freed memory is handed back."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _packers() -> int:
    """The engine's packers alive in this process (reachable by the garbage collector)."""
    from rollout_store import _core

    return sum(isinstance(o, _core.Packer) for o in gc.get_objects())


def _bodies(rollouts: int, turns: int) -> Any:
    for r in range(rollouts):
        yield from iter_bodies(multimodal, turns, seed=100 + r)


def _graph(rollouts: int, turns: int) -> tuple[object, int]:
    import rollout_store as rs

    graph = rs.RolloutGraph(share_threshold=1024)
    for body in _bodies(rollouts, turns):
        graph.add_turn(
            rs.TurnNode(request_messages=body["messages"], response_message=body["response"])
        )
        del body
    engine = engine_bytes()
    packers = _packers()
    if packers:
        engine = -packers  # reported: the graph was meant to hold none between turns
    return graph, engine


def _table(rollouts: int, turns: int) -> tuple[object, int]:
    from rollout_store import _core

    table = _core.ContentTable()
    handles = array("I")
    for body in _bodies(rollouts, turns):
        for message in body["messages"]:
            handles.append(table.intern(json.dumps(message).encode()))
        del body
    return (table, handles), table.nbytes


def worker(case: str, traced: bool, rollouts: int, turns: int) -> dict[str, Any]:
    import rollout_store  # imported before the baseline

    del rollout_store
    build = _graph if case == "graph" else _table
    if traced:
        tracemalloc.start()
    gc.collect()
    before = tracemalloc.get_traced_memory()[0] if traced else _rss_anon()
    kept, engine = build(rollouts, turns)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0] if traced else _rss_anon()
    out: dict[str, Any] = {"bytes": after - before, "engine": engine}
    if case == "table":
        table = kept[0]  # type: ignore[index]
        out["entries"] = len(table)
        out["content"] = table.content_bytes
    return out


def run(case: str, traced: bool, rollouts: int, turns: int) -> dict[str, Any]:
    args = [sys.executable, str(Path(__file__).resolve()), "--worker", case]
    args += ["--rollouts", str(rollouts), "--turns", str(turns)]
    if traced:
        args.append("--traced")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    done = subprocess.run(args, capture_output=True, text=True, check=True, env=env)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=20)
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--worker", choices=["graph", "table"])
    parser.add_argument("--traced", action="store_true")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.traced, args.rollouts, args.turns)))
        return 0
    n = args.rollouts * args.turns
    print(f"multimodal: {args.rollouts} rollouts x {args.turns} turns ({n} turns); MiB retained")
    print(f"{'case':<15}{'tracemalloc':>12}{'engine':>9}{'sum':>9}{'RSS':>9}{'RSS/sum':>9}")
    lines = []
    for case in ("graph", "table"):
        traced = run(case, True, args.rollouts, args.turns)
        rss = run(case, False, args.rollouts, args.turns)
        if traced["engine"] < 0:
            print(f"{case}: the graph holds {-traced['engine']} packers between turns")
            return 1
        total = traced["bytes"] + traced["engine"]
        print(
            f"{case:<15}{traced['bytes'] / 2**20:12.2f}{traced['engine'] / 2**20:9.2f}"
            f"{total / 2**20:9.2f}{rss['bytes'] / 2**20:9.2f}{rss['bytes'] / total:9.3f}"
        )
        if case == "graph":
            print(f"  engine bytes per turn held by the graph: {traced['engine'] / n:.1f}")
        else:
            fixed = (traced["engine"] - traced["content"]) / traced["entries"]
            print(
                f"  {traced['entries']} entries, {traced['content'] / 2**20:.2f} MiB of content:"
                f" {fixed:.1f} engine bytes per entry beyond its content"
            )
        ratio = rss["bytes"] / total
        verdict = "PASS" if 1 / AGREE <= ratio <= AGREE else "MISS"
        lines.append(f"{verdict}  {case}: RSS / (tracemalloc + engine) {ratio:.3f} within {AGREE}x")
    print("\nTargets:")
    for line in lines:
        print("  " + line)
    print(targets_summary(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

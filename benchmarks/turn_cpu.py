"""CPU time of each early turn of `add_turn`, this checkout against another one, side by side.

Each workload's first turns are added to many fresh graphs (garbage collector paused, each
body decoded just before its turn, outside the timing); a turn's figure is the least thread
CPU time (`time.thread_time_ns`) any graph took for it, and its median. The two checkouts run
in worker processes of their own (one library each on PYTHONPATH), alternated round by round,
so a machine shared with other work moves both alike. Thread CPU time is not wall time:
waiting for a core is not counted. Prints a table per workload: each checkout's figures and
the ratio this / other (below 1: this checkout is faster). Only the public API is used, so
`--against` can name any checkout of the library (its folder, the one holding
`rollout_store/`).

Large turns depend on the C allocator's state, which the process's history sets: glibc
serves blocks from fresh pages (page faults inside the timing) until it has freed a large
block, then raises its thresholds. Measured: turns 4-10 of multimodal cost up to 2.5x more,
for either checkout, in a worker that had not yet freed a large block than in one that had
(the same loop in two scripts, or after freeing a 2 MB block first). Compare checkouts within
one run, never figures of different runs or scripts.

    python benchmarks/turn_cpu.py --against ../other-checkout --workloads multimodal,tool_heavy
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from time import thread_time_ns

from measure import targets_summary
from workloads import WORKLOADS, iter_texts

HERE = Path(__file__).resolve().parent
SHARE_THRESHOLD = 1024
#: The target: this checkout's turns, in all (least CPU time of each, summed), at most this
#: many times the other's (no regression beyond noise)
MAX_SUM_RATIO = 1.05


def work(workload: str, n_turns: int, graphs: int) -> dict[str, list[int]]:
    """In a worker: {"min": [...], "median": [...]} nanoseconds per turn over `graphs` graphs."""
    import rollout_store as rs

    texts = list(iter_texts(WORKLOADS[workload], n_turns))
    times: list[list[int]] = [[] for _ in texts]
    gc.collect()
    gc.disable()
    for g in range(graphs):
        graph = rs.RolloutGraph(share_threshold=SHARE_THRESHOLD)
        for i, text in enumerate(texts):
            body = json.loads(text)
            node = rs.TurnNode(
                request_messages=body["messages"],
                request_tools=body["tools"],
                response_message=body["response"],
                sampling_params=body["sampling_params"],
                prompt_ids=body.get("prompt_ids"),
                sampled_ids=body.get("sampled_ids"),
                sampled_logprobs=body.get("sampled_logprobs"),
                model=body["model"],
                finish_reason=body["finish_reason"],
                harness_session_id="s",
            )
            start = thread_time_ns()
            graph.add_turn(node)
            times[i].append(thread_time_ns() - start)
            del body, node
        del graph
        if g % 20 == 19:  # graphs hold cycles: collected now and then, outside the timing
            gc.collect()
    return {"min": [min(t) for t in times], "median": [sorted(t)[len(t) // 2] for t in times]}


def run_worker(library: Path, workload: str, n_turns: int, graphs: int) -> dict[str, list[int]]:
    env = {**os.environ, "PYTHONPATH": str(library)}
    args = [sys.executable, str(Path(__file__).resolve()), "--worker", workload]
    args += ["--turns", str(n_turns), "--graphs", str(graphs)]
    out = subprocess.run(args, env=env, cwd=HERE, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def compare(
    this: Path, other: Path, workload: str, n_turns: int, graphs: int, rounds: int
) -> float:
    """Print the table of one workload; return the ratio of the sums of the least times."""
    best: dict[str, dict[str, list[int]]] = {}
    for r in range(rounds):
        order = [("this", this), ("other", other)]
        for name, library in order if r % 2 == 0 else order[::-1]:
            got = run_worker(library, workload, n_turns, graphs)
            if name not in best:
                best[name] = got
            else:  # the least over all rounds
                for stat in ("min", "median"):
                    best[name][stat] = [
                        min(a, b) for a, b in zip(best[name][stat], got[stat], strict=True)
                    ]
    a, b = best["this"], best["other"]
    print(f"\n{workload}: add_turn thread CPU us, {graphs} fresh graphs x {rounds} rounds")
    print(
        f"{'turn':>6}{'this min':>10}{'other min':>11}{'ratio':>7}"
        f"{'this med':>10}{'other med':>10}{'ratio':>7}"
    )
    for i in range(n_turns):
        print(
            f"{i + 1:>6}{a['min'][i] / 1e3:>10.1f}{b['min'][i] / 1e3:>11.1f}"
            f"{a['min'][i] / b['min'][i]:>7.2f}{a['median'][i] / 1e3:>10.1f}"
            f"{b['median'][i] / 1e3:>10.1f}{a['median'][i] / b['median'][i]:>7.2f}"
        )
    sa, sb = sum(a["min"]), sum(b["min"])
    ma, mb = sum(a["median"]), sum(b["median"])
    print(
        f"{'sum':>6}{sa / 1e3:>10.1f}{sb / 1e3:>11.1f}{sa / sb:>7.2f}"
        f"{ma / 1e3:>10.1f}{mb / 1e3:>10.1f}{ma / mb:>7.2f}"
    )
    return sa / sb


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, help="the other checkout (holds rollout_store/)")
    parser.add_argument("--workloads", default="multimodal,tool_heavy,chatty")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--graphs", type=int, default=100, help="fresh graphs a round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, checkouts alternated")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(work(args.worker, args.turns, args.graphs)))
        return
    if args.against is None:
        parser.error("--against names the checkout to compare with")
    other = args.against.resolve()
    if not (other / "rollout_store").is_dir():
        parser.error(f"{other} holds no rollout_store/ folder")
    names = args.workloads.split(",")
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    checks = []
    for name in names:
        ratio = compare(HERE.parent, other, name, args.turns, args.graphs, args.rounds)
        verdict = "PASS" if ratio <= MAX_SUM_RATIO else "MISS"
        checks.append(
            f"{verdict}  {name}: turns 1-{args.turns} {ratio:.2f}x the other checkout's"
            f" (target: at most {MAX_SUM_RATIO}x)"
        )
    print()
    print("\n".join(checks))
    print(targets_summary(checks))


if __name__ == "__main__":
    main()

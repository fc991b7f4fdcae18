"""What `verify` costs over a plain `load` of the same file, on each workload.

`verify` checks everything `load` does and recomputes every turn record's index keys from
its content (`rollout_store.files.key_check`); `load` trusts them. Each workload is recorded into
one graph, saved as a snapshot and appended as a log; verify and load of each file are timed
side by side (best of REPEAT, interleaved round by round), and the ratio verify / load is the
figure (target: at most MAX_VERIFY_OVER_LOAD). Uses only the public API, so the same script
measures any checkout of the library (run it with that checkout first on PYTHONPATH). Writes
out/verify_cost.json (results/ with --update-results); ends with PASS/MISS lines for the
targets (never failing on them) and a one-line count of targets met and missed.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path
from time import perf_counter
from typing import Any

from measure import add_results_option, library_commit, results_dir, shown, targets_summary
from schemes import SHARE_THRESHOLD, turn_node
from workloads import WORKLOADS, iter_bodies

from rollout_store import RolloutGraph
from rollout_store.files import storage

REPEAT = 15
#: verify checks what load checks and hashes every stored message byte once more (BLAKE3);
#: issue 24's target
MAX_VERIFY_OVER_LOAD = 2.0


def build(name: str, turns: int, folder: Path) -> dict[str, Path]:
    """The workload as a snapshot and as a log."""
    snapshot, log = folder / f"{name}.rls", folder / f"{name}.log.rls"
    graph = RolloutGraph(share_threshold=SHARE_THRESHOLD)
    with RolloutGraph.open(log, share_threshold=SHARE_THRESHOLD, fsync="never") as appending:
        for body in iter_bodies(WORKLOADS[name], turns):
            graph.add_turn(turn_node(body))
            appending.add_turn(turn_node(body))
    graph.save(snapshot)
    return {"snapshot": snapshot, "log": log}


def best_of(path: Path) -> tuple[float, float]:
    """Best verify and load times of `path`, interleaved."""
    best = {"verify": float("inf"), "load": float("inf")}
    cases = {"verify": lambda: storage.verify(path), "load": lambda: RolloutGraph.load(path)}
    for _ in range(REPEAT):
        for what, fn in cases.items():
            gc.collect()
            start = perf_counter()
            out = fn()
            best[what] = min(best[what], perf_counter() - start)
            del out
    return best["verify"], best["load"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=100, help="turns per workload (100)")
    parser.add_argument("--quick", action="store_true", help="25 turns")
    add_results_option(parser)
    args = parser.parse_args(argv)
    turns = 25 if args.quick else args.turns
    import rollout_store

    print(f"rollout_store from {Path(rollout_store.__file__).parent.parent.name}; {turns} turns")
    print(f"{'workload':<12} {'file':<9} {'MiB':>7} {'load ms':>9} {'verify ms':>10} {'ratio':>6}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in WORKLOADS:
            for kind, path in build(name, turns, Path(tmp)).items():
                report = storage.verify(path)
                assert report.ok, report.error
                verify_s, load_s = best_of(path)
                size = path.stat().st_size / (1 << 20)
                print(
                    f"{name:<12} {kind:<9} {size:7.1f} {load_s * 1e3:9.2f}"
                    f" {verify_s * 1e3:10.2f} {verify_s / load_s:6.2f}"
                )
                sys.stdout.flush()
                rows.append(
                    {"workload": name, "file": kind, "bytes": path.stat().st_size,
                     "load_s": load_s, "verify_s": verify_s,
                     "verify_over_load": verify_s / load_s}
                )  # fmt: skip
    checks = [
        f"{'PASS' if row['verify_over_load'] <= MAX_VERIFY_OVER_LOAD else 'MISS'}  verify of "
        f"the {row['workload']} {row['file']} <= {MAX_VERIFY_OVER_LOAD}x its load: "
        f"{row['verify_over_load']:.2f}x"
        for row in rows
    ]
    print("\n" + "\n".join(checks))
    report = {"turns": turns, "commit": library_commit(), "rows": rows, "checks": checks}
    out = results_dir(args.update_results) / "verify_cost.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {shown(out)}")
    print(targets_summary(checks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

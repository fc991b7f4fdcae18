"""The engine's exact JSON against the standard library, as ratios on the workloads' bodies.

For a body at a few turns of each workload: `_core.loads(bytes)` / `json.loads(bytes)` and
`_core.dumps(value)` / `json.dumps(value)`. Each pair is timed back to back, alternating, and
the figure is the median of the per-pair ratios, so other load on the machine moves both
sides. Ends with PASS/MISS lines for the targets (the engine no slower than the standard
library on any body) and their count. A report, never a pass/fail test.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from time import perf_counter
from typing import Any

from measure import targets_summary
from schemes import _import_rollout_store
from workloads import WORKLOADS, iter_texts

_import_rollout_store()
from rollout_store import _core  # noqa: E402

CHECKPOINTS = {
    "chatty": (10, 100),
    "tool_heavy": (10, 100),
    "multimodal": (10, 40),
    "token_heavy": (10, 40),
}
#: the engine's figures may not exceed the standard library's
MAX_RATIO = 1.0


def _time(fn: Callable[[Any], Any], arg: Any, loops: int) -> float:
    start = perf_counter()
    for _ in range(loops):
        fn(arg)
    return (perf_counter() - start) / loops


def _ratio(ours: Callable[[Any], Any], theirs: Callable[[Any], Any], arg: Any) -> float:
    """Median over rounds of (ours / theirs), each round timing both back to back."""
    once = _time(theirs, arg, 1)
    loops = max(1, int(0.05 / max(once, 1e-7)))
    ratios = []
    for i in range(11):
        if i % 2:
            a = _time(ours, arg, loops)
            b = _time(theirs, arg, loops)
        else:
            b = _time(theirs, arg, loops)
            a = _time(ours, arg, loops)
        ratios.append(a / b)
    return statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the first checkpoint")
    args = parser.parse_args()
    print(f"{'workload':<12} {'turn':>5} {'body':>10}  {'loads':>7}  {'dumps':>7}")
    checks: list[str] = []
    for name, generator in WORKLOADS.items():
        wanted = CHECKPOINTS.get(name)
        if wanted is None:
            continue
        if args.quick:
            wanted = wanted[:1]
        for turn, text in enumerate(iter_texts(generator, max(wanted)), start=1):
            if turn not in wanted:
                continue
            data = text.encode()
            value = json.loads(data)
            # the comparison is only worth printing where both give the same bytes
            assert json.dumps(_core.loads(data)) == text and _core.dumps(value) == text
            loads = _ratio(_core.loads, json.loads, data)
            dumps = _ratio(_core.dumps, json.dumps, value)
            size = f"{len(data) / 1024:.1f} KiB"
            print(f"{name:<12} {turn:>5} {size:>10}  {loads:>6.2f}x  {dumps:>6.2f}x")
            for verb, ratio in (("loads", loads), ("dumps", dumps)):
                verdict = "PASS" if ratio <= MAX_RATIO else "MISS"
                checks.append(
                    f"{verdict}  _core.{verb} <= {MAX_RATIO}x json.{verb}: {name} turn {turn} "
                    f"{ratio:.2f}x"
                )
    print("(ratios: _core.loads / json.loads and _core.dumps / json.dumps; below 1 is faster)")
    for line in checks:
        print(line)
    print(targets_summary(checks))


if __name__ == "__main__":
    main()

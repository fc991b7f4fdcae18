"""Retained memory and add time per turn of plain, interning and rollout_store, side by side.

Writes out/memory_per_turn.json and .png (results/ with --update-results, for a full run);
ends with PASS/MISS lines for the targets and a one-line count of targets met and missed.
`--replot` redraws the plot from the tracked results without measuring. `--long` and `--soak`
then run ingest.py's long mode (decoded and raw input at turns 10 to 2,000) and soak mode
(20,000 turns in one graph) in the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from pathlib import Path

from measure import (
    TRACKED_RESULTS,
    MiB,
    add_results_option,
    library_commit,
    results_dir,
    retained_bytes,
    shown,
    targets_summary,
    time_turns,
)
from schemes import SCHEMES, available_schemes
from tqdm import tqdm
from workloads import WORKLOADS, UniqueContent, chatty, iter_texts

TURN_COUNTS = (10, 25, 50, 100, 200)
QUICK_TURN_COUNTS = (10, 25, 50)

SCALING_ROLLOUTS = 100
SCALING_TURNS = 10
SCALING_SAMPLE = 5  # rollouts at each end whose last turn is timed
SCALING_REPEATS = 3  # the 1,000-turn graph is built this many times; samples are pooled

MAX_OVER_UNIQUE = {"multimodal": 1.10, "tool_heavy": 1.10, "token_heavy": 1.10, "chatty": 1.25}
# the turn counts each limit holds at (chatty's per-turn bookkeeping weighs most on few turns:
# issue 9 sets its limit at 200 turns)
OVER_UNIQUE_AT = {"multimodal": (100, 200), "tool_heavy": (100, 200), "token_heavy": (100, 200)}
OVER_UNIQUE_AT["chatty"] = (200,)
MAX_GROWTH_100_TO_200 = 2.1
MAX_ADD_OVER_LOADS = 1.0
MAX_SCALING_RATIO = 1.5

# How runs are shared: a workload's first n turns do not depend on its total turn count, so
# each (workload, scheme) is recorded once with the largest turn count, under tracemalloc,
# reading the retained bytes at every turn count on the way; and once more without tracemalloc
# (garbage collector paused) to time every turn, the median for n turns taken over turns 1..n.


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="turn counts 10, 25, 50; no scaling check"
    )
    parser.add_argument("--turns", help="comma-separated turn counts, e.g. 10,25")
    parser.add_argument("--workloads", help="comma-separated names: " + ",".join(WORKLOADS))
    parser.add_argument(
        "--long",
        action="store_true",
        help="then ingest.py's long mode: decoded and raw add_turn/json.loads at turns 10-2,000",
    )
    parser.add_argument(
        "--soak",
        action="store_true",
        help="then ingest.py's soak mode: turn 20,000 / turn 100 in one graph, every shape",
    )
    add_results_option(parser)
    parser.add_argument(
        "--replot",
        action="store_true",
        help="only redraw the plot from results/memory_per_turn.json (no measuring)",
    )
    args = parser.parse_args(argv)
    if args.turns:
        args.turn_counts = tuple(sorted({int(n) for n in args.turns.split(",")}))
    else:
        args.turn_counts = QUICK_TURN_COUNTS if args.quick else TURN_COUNTS
    args.workload_names = args.workloads.split(",") if args.workloads else list(WORKLOADS)
    unknown = set(args.workload_names) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    args.full = args.turn_counts == TURN_COUNTS and args.workload_names == list(WORKLOADS)
    if args.update_results and not (args.full and not args.quick):
        parser.error("--update-results needs a full run (no --quick, --turns or --workloads)")
    return args


def unique_by_turn_count(texts: list[str], turn_counts: tuple[int, ...]) -> dict[int, int]:
    unique = UniqueContent()
    out = {}
    for turn, text in enumerate(texts, 1):
        unique.add(json.loads(text))
        if turn in turn_counts:
            out[turn] = unique.bytes
    return out


def measure_scheme(scheme: str, texts: list[str], turn_counts: tuple[int, ...], bar) -> dict:
    """Retained bytes at each turn count and every turn's (loads, add) time for one scheme."""
    make = SCHEMES[scheme]
    retained = retained_bytes(make, texts, turn_counts, on_turn=bar.update)
    timings = time_turns(make, texts, on_turn=bar.update)
    return {"retained": retained, "timings": timings}


def rows_for(workload: str, scheme: str, measured: dict, unique: dict[int, int]) -> list[dict]:
    rows = []
    prev_n, prev_bytes = 0, 0
    for n, retained in sorted(measured["retained"].items()):
        turns = [t for t in measured["timings"] if t <= n]
        ratios = [measured["timings"][t][1] / measured["timings"][t][0] for t in turns]
        rows.append(
            {
                "workload": workload,
                "scheme": scheme,
                "turns": n,
                "retained_bytes": retained,
                "unique_bytes": unique[n],
                "retained_over_unique": retained / unique[n],
                "marginal_bytes_per_turn": (retained - prev_bytes) / (n - prev_n),
                "add_over_loads_median": statistics.median(ratios),
                "add_ms_median": 1e3 * statistics.median(measured["timings"][t][1] for t in turns),
                "loads_ms_median": 1e3
                * statistics.median(measured["timings"][t][0] for t in turns),
                "timed_turns": len(turns),
            }
        )
        prev_n, prev_bytes = n, retained
    return rows


def run_workload(name: str, turn_counts, schemes: list[str], bar) -> tuple[list[dict], list]:
    texts = list(iter_texts(WORKLOADS[name], max(turn_counts)))
    unique = unique_by_turn_count(texts, turn_counts)
    rows, errors = [], []
    for scheme in schemes:
        bar.set_description(f"{name}/{scheme}")
        try:
            measured = measure_scheme(scheme, texts, turn_counts, bar)
        except Exception as exc:
            errors.append({"workload": name, "scheme": scheme, "error": repr(exc)})
            traceback.print_exc()
            continue
        rows.extend(rows_for(name, scheme, measured, unique))
    return rows, errors


def scaling_check(scheme: str, bar) -> dict:
    """100 independent 10-turn chatty rollouts (own session id each) into one recorder: the add
    time of the 10th turn of the first 5 rollouts vs that of the last 5 (medians)."""
    texts, sessions = [], []
    for rollout in range(SCALING_ROLLOUTS):
        texts.extend(iter_texts(chatty, SCALING_TURNS, seed=1000 + rollout))
        sessions.extend([f"rollout-{rollout}"] * SCALING_TURNS)
    last_turns = range(SCALING_TURNS, len(texts) + 1, SCALING_TURNS)
    first, last = [], []
    for _ in range(SCALING_REPEATS):
        bar.set_description(f"scaling/{scheme}")
        timings = time_turns(
            SCHEMES[scheme],
            texts,
            is_timed=lambda turn: turn % SCALING_TURNS == 0,
            session_ids=sessions,
            on_turn=bar.update,
        )
        first.extend(timings[t][1] for t in last_turns[:SCALING_SAMPLE])
        last.extend(timings[t][1] for t in last_turns[-SCALING_SAMPLE:])
    early, late = statistics.median(first), statistics.median(last)
    return {"scheme": scheme, "early_us": 1e6 * early, "late_us": 1e6 * late, "ratio": late / early}


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'workload':<12}{'turns':>6}  {'scheme':<14}{'retained MiB':>13}{'unique MiB':>11}"
        f"{'x unique':>10}{'marginal KiB/turn':>19}{'add/loads':>11}{'add ms':>9}"
    )
    print(header)
    print("-" * len(header))
    previous = None
    for row in sorted(rows, key=lambda r: (list(WORKLOADS).index(r["workload"]), r["turns"])):
        if previous is not None and row["workload"] != previous:
            print()
        previous = row["workload"]
        print(
            f"{row['workload']:<12}{row['turns']:>6}  {row['scheme']:<14}"
            f"{row['retained_bytes'] / MiB:>13.2f}{row['unique_bytes'] / MiB:>11.2f}"
            f"{row['retained_over_unique']:>9.2f}x{row['marginal_bytes_per_turn'] / 1024:>19.1f}"
            f"{row['add_over_loads_median']:>11.2f}{row['add_ms_median']:>9.3f}"
        )
    print(
        "\nadd/loads: median over turns 1..n of (add time / json.loads time of the same body);"
        " every turn timed,\nwithout tracemalloc and with the garbage collector paused."
        " add ms: median add time over turns 1..n."
    )


def print_scaling(results: list[dict]) -> None:
    print(
        f"\nScaling: {SCALING_ROLLOUTS} chatty rollouts of {SCALING_TURNS} turns in one graph;"
        f" add time of turn {SCALING_TURNS} (median of {SCALING_SAMPLE} rollouts"
        f" x {SCALING_REPEATS} builds)"
    )
    for r in results:
        print(
            f"  {r['scheme']:<14} first {SCALING_SAMPLE}: {r['early_us']:9.1f} us"
            f"   last {SCALING_SAMPLE}: {r['late_us']:9.1f} us   ratio {r['ratio']:6.2f}"
        )


def _verdict(ok: bool | None) -> str:
    return {True: "PASS", False: "MISS", None: "SKIP"}[ok]


def check_targets(rows: list[dict], scaling: list[dict], workloads: list[str]) -> list[str]:
    """PASS/MISS/SKIP lines for the targets (rollout_store rows only)."""
    ours = {(r["workload"], r["turns"]): r for r in rows if r["scheme"] == "rollout_store"}
    lines = []
    for name in workloads:
        limit = MAX_OVER_UNIQUE[name]
        for n in OVER_UNIQUE_AT[name]:
            row = ours.get((name, n))
            value = f"{row['retained_over_unique']:.3f}" if row else "not run"
            ok = row["retained_over_unique"] <= limit if row else None
            lines.append(f"{_verdict(ok)}  {name} retained/unique at {n} turns {value} <= {limit}")
    for name in workloads:
        a, b = ours.get((name, 100)), ours.get((name, 200))
        growth = b["retained_bytes"] / a["retained_bytes"] if a and b else None
        value = f"{growth:.3f}" if growth is not None else "not run"
        ok = growth <= MAX_GROWTH_100_TO_200 if growth is not None else None
        lines.append(
            f"{_verdict(ok)}  {name} retained(200)/retained(100) {value} <= {MAX_GROWTH_100_TO_200}"
        )
    for name in workloads:
        counts = [n for (w, n) in ours if w == name]
        row = ours.get((name, max(counts))) if counts else None
        value = f"{row['add_over_loads_median']:.3f}" if row else "not run"
        at = f" ({row['turns']} turns)" if row else ""
        ok = row["add_over_loads_median"] <= MAX_ADD_OVER_LOADS if row else None
        lines.append(
            f"{_verdict(ok)}  {name} median add_turn/json.loads{at} {value} <= {MAX_ADD_OVER_LOADS}"
        )
    ours_scaling = [s for s in scaling if s["scheme"] == "rollout_store"]
    value = f"{ours_scaling[0]['ratio']:.3f}" if ours_scaling else "not run"
    ok = ours_scaling[0]["ratio"] <= MAX_SCALING_RATIO if ours_scaling else None
    lines.append(f"{_verdict(ok)}  scaling: late/early add_turn {value} <= {MAX_SCALING_RATIO}")
    return lines


STYLE = {  # distinct colour, marker and dash, so lines that overlap stay readable
    "plain": {
        "color": "#d62728",
        "marker": "o",
        "markersize": 9,
        "markerfacecolor": "none",
        "linestyle": "-",
        "linewidth": 3.5,
    },
    "interning": {
        "color": "#ff7f0e",
        "marker": "s",
        "markersize": 4,
        "linestyle": "--",
        "linewidth": 1.8,
    },
    "rollout_store": {
        "color": "#1f77b4",
        "marker": "D",
        "markersize": 5,
        "linestyle": "-",
        "linewidth": 2.5,
    },
}


def plot(rows: list[dict], workloads: list[str], path: Path) -> None:
    """Retained MiB against turns on linear axes: quadratic growth curves up, linear growth
    is a straight line. The legend gives each line's last value and x unique content (text
    next to the lines would collide where they overlap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(len(workloads), 2)
    nrows = (len(workloads) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6.4 * cols, 4.4 * nrows), squeeze=False)
    for ax, name in zip(axes.flat, workloads, strict=False):
        mine = [r for r in rows if r["workload"] == name]
        unique = sorted({(r["turns"], r["unique_bytes"]) for r in mine})
        if unique:
            xs, ys = zip(*[(n, b / MiB) for n, b in unique], strict=True)
            ax.plot(
                xs,
                ys,
                color="black",
                linestyle=":",
                linewidth=1.5,
                label=f"unique content: {ys[-1]:.1f} MiB",
                zorder=4,
            )
        for scheme in SCHEMES:
            points = sorted(
                (r["turns"], r["retained_bytes"], r["retained_over_unique"])
                for r in mine
                if r["scheme"] == scheme
            )
            if not points:
                continue
            xs, ys = [n for n, _, _ in points], [b / MiB for _, b, _ in points]
            n, b, over = points[-1]
            label = f"{scheme}: {b / MiB:.1f} MiB at {n} turns ({over:.2f}x unique)"
            ax.plot(xs, ys, label=label, alpha=0.9, zorder=3, **STYLE.get(scheme, {}))
        ax.set_title(f"{name}: retained memory (lower is better)")
        ax.set_xlabel("turns")
        ax.set_ylabel("retained MiB")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    for ax in list(axes.flat)[len(workloads) :]:
        ax.set_visible(False)
    fig.suptitle(
        "Bytes retained after n turns (linear axes): plain grows with the square of the turns,"
        " rollout_store with the turns",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        report = json.loads((TRACKED_RESULTS / "memory_per_turn.json").read_text())
        path = results_dir(args.update_results) / "memory_per_turn.png"
        plot(report["rows"], report["workloads"], path)
        print(f"redrew {shown(path)} from results/memory_per_turn.json")
        print(targets_summary(report["checks"]))
        return 0
    schemes = available_schemes()
    max_turns = max(args.turn_counts)
    total = len(args.workload_names) * len(schemes) * 2 * max_turns
    scaling_schemes = [s for s in ("plain", "rollout_store") if s in schemes]
    if not args.quick:
        total += len(scaling_schemes) * SCALING_REPEATS * SCALING_ROLLOUTS * SCALING_TURNS
    rows, errors, scaling = [], [], []
    with tqdm(total=total, file=sys.stderr, unit="turn", dynamic_ncols=True) as bar:
        for name in args.workload_names:
            workload_rows, workload_errors = run_workload(name, args.turn_counts, schemes, bar)
            rows.extend(workload_rows)
            errors.extend(workload_errors)
        if not args.quick:
            scaling = [scaling_check(scheme, bar) for scheme in scaling_schemes]

    print_table(rows)
    if scaling:
        print_scaling(scaling)
    for error in errors:
        print(f"\nERROR {error['workload']}/{error['scheme']}: {error['error']}")
    checks = check_targets(rows, scaling, args.workload_names)
    print("\nTargets (rollout_store):")
    for line in checks:
        print("  " + line)

    report = {
        "commit": library_commit(),
        "turn_counts": list(args.turn_counts),
        "workloads": args.workload_names,
        "schemes": schemes,
        "rows": rows,
        "scaling": scaling,
        "errors": errors,
        "checks": checks,
    }
    folder = results_dir(args.update_results)
    stem = "memory_per_turn" if args.full else "memory_per_turn.partial"
    (folder / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(rows, args.workload_names, folder / f"{stem}.png")
    print(f"\nwrote {shown(folder / f'{stem}.json')} and {shown(folder / f'{stem}.png')}")
    print(targets_summary(checks))
    if args.long or args.soak:  # the intake figures, measured by ingest.py in this process
        import ingest

        print()
        modes = [] if args.long else ["--no-long"]
        modes += [] if args.soak else ["--no-soak"]
        ingest.main([*modes, "--no-memory"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

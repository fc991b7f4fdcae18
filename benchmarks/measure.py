"""Measuring a recorder: bytes it retains (tracemalloc and the engine's own count) and time
per add (perf_counter).

Both feed it JSON texts decoded one turn at a time, so no two turns share objects.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from time import perf_counter

MiB = 1024 * 1024
LOADS_REPEAT_BELOW = 1 << 20  # texts shorter than this are decoded 3 times for their timing


def engine_bytes() -> int:
    """Bytes the compiled engine's objects alive in this process hold (their `nbytes`), which
    tracemalloc does not see: Rust allocates through its own allocator. An engine object's
    own fields are inside its Python object, which the interpreter allocates and tracemalloc
    traces; what they own on the heap is in its `nbytes`: a `RequestTable`'s rows, index and
    decoded tips, a `SizedIndex`'s keys and turn numbers, a `KeyNumbers`' keys and numbers (a
    memory store's index), a `Blake3`'s chaining values and last chunk (a graph's raw tips
    keep one each). A `Blake3`, a `SizedIndex` or a `KeyNumbers` holds no
    reference to other objects, so the collector does not list it: it is found among what
    the objects it lists refer to (a raw tip's `plain_state`, a linker's token indexes, a
    memory store's index)."""
    core = sys.modules.get("rollout_store._core")
    if core is None:
        return 0
    tracked = tuple(
        getattr(core, name) for name in ("ContentTable", "RequestTable") if hasattr(core, name)
    )
    untracked = tuple(
        getattr(core, name)
        for name in ("Blake3", "SizedIndex", "KeyNumbers")
        if hasattr(core, name)
    )
    total, found = 0, {}
    for o in gc.get_objects():
        if isinstance(o, tracked):
            total += o.nbytes
        if untracked:
            for referred in gc.get_referents(o):
                if type(referred) in untracked:
                    found[id(referred)] = referred
    return total + sum(getattr(o, "nbytes", 0) for o in found.values())


class Traced:
    """What `traced()` measured: `retained()` is the traced bytes now minus the baseline,
    plus the engine's bytes (see `engine_bytes`) now minus its baseline."""

    def __init__(self, baseline: int) -> None:
        self.baseline = baseline
        self.engine_baseline = engine_bytes()
        self.bytes = 0

    def rebase(self) -> None:
        """Take both baselines again, now (after gc.collect)."""
        gc.collect()
        self.baseline = tracemalloc.get_traced_memory()[0]
        self.engine_baseline = engine_bytes()

    def retained(self) -> int:
        """Bytes traced now (after gc.collect) above the baseline, and the engine's."""
        gc.collect()
        traced_now = tracemalloc.get_traced_memory()[0] - self.baseline
        return traced_now + engine_bytes() - self.engine_baseline


@contextmanager
def traced() -> Iterator[Traced]:
    """tracemalloc on, a baseline taken after gc.collect; on exit `bytes` holds what is
    retained then (see `Traced.retained`) and tracemalloc is off again."""
    gc.collect()
    tracemalloc.start()
    try:
        gc.collect()
        measured = Traced(tracemalloc.get_traced_memory()[0])
        yield measured
        measured.bytes = measured.retained()
    finally:
        tracemalloc.stop()


def record_traced(
    make: Callable[[], object],
    texts: list[str],
    checkpoints: Iterable[int],
    session_id: str = "s",
    on_turn: Callable[[], None] | None = None,
) -> tuple[object, dict[int, int]]:
    """Record texts into a new recorder under tracemalloc; return it and, for each checkpoint
    n, the bytes retained after n turns (traced current minus the baseline taken before the
    recorder was made, after gc.collect, with each decoded body already dropped)."""
    checkpoints = set(checkpoints)
    retained: dict[int, int] = {}
    make().close()  # lazy imports and one-time set-up happen before the baseline
    with traced() as measured:
        recorder = make()
        for turn, text in enumerate(texts, 1):
            body = json.loads(text)
            recorder.add(body, session_id=session_id)
            del body
            if turn in checkpoints:
                retained[turn] = measured.retained()
            if on_turn is not None:
                on_turn()
    return recorder, retained


def retained_bytes(
    make: Callable[[], object],
    texts: list[str],
    checkpoints: Iterable[int],
    on_turn: Callable[[], None] | None = None,
) -> dict[int, int]:
    """Bytes retained after each checkpoint turn count (see record_traced); closes the recorder."""
    recorder, retained = record_traced(make, texts, checkpoints, on_turn=on_turn)
    recorder.close()
    return retained


def _timed_loads(text: str) -> tuple[dict, float]:
    """Decode text; return the body and the median time of 1 or 3 decodes."""
    repeat = 3 if len(text) < LOADS_REPEAT_BELOW else 1
    times = []
    body = None
    for _ in range(repeat):
        body = None  # free the previous decode outside the timed region
        start = perf_counter()
        body = json.loads(text)
        times.append(perf_counter() - start)
    return body, statistics.median(times)


def time_turns(
    make: Callable[[], object],
    texts: list[str],
    is_timed: Callable[[int], bool] = lambda turn: True,
    session_ids: Iterable[str] | None = None,
    on_turn: Callable[[], None] | None = None,
) -> dict[int, tuple[float, float]]:
    """Record texts into a new recorder without tracemalloc and with the garbage collector
    paused; return {turn: (json.loads seconds, add seconds)} for the timed turns."""
    sessions = iter(session_ids) if session_ids is not None else None
    timings: dict[int, tuple[float, float]] = {}
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        recorder = make()
        for turn, text in enumerate(texts, 1):
            session_id = next(sessions) if sessions is not None else "s"
            if is_timed(turn):
                body, loads_time = _timed_loads(text)
                start = perf_counter()
                recorder.add(body, session_id=session_id)
                timings[turn] = (loads_time, perf_counter() - start)
            else:
                body = json.loads(text)
                recorder.add(body, session_id=session_id)
            del body
            if on_turn is not None:
                on_turn()
        recorder.close()
        del recorder
    finally:
        if was_enabled:
            gc.enable()
        gc.collect()
    return timings


def library_commit() -> str | None:
    """The repository's current commit (best effort), so results can be tied to a version."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


# ---------------------------------------------------------------- where results go

BENCH_DIR = Path(__file__).resolve().parent
#: Tracked figures, rewritten only with --update-results (the README quotes them).
TRACKED_RESULTS = BENCH_DIR / "results"
#: Every other run writes here (gitignored), so a run never dirties the work tree.
LOCAL_RESULTS = BENCH_DIR / "out"


def add_results_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--update-results",
        action="store_true",
        help="write the tracked files in benchmarks/results/ (default: benchmarks/out/, "
        "which git ignores)",
    )


def results_dir(update: bool) -> Path:
    """The folder a run writes to: the tracked one only when asked."""
    folder = TRACKED_RESULTS if update else LOCAL_RESULTS
    folder.mkdir(exist_ok=True)
    return folder


def shown(path: Path) -> str:
    """A results path relative to the benchmarks folder, for messages."""
    return str(path.relative_to(BENCH_DIR))


def targets_summary(checks: list[str]) -> str:
    """One line: how many PASS/MISS/SKIP lines there are."""
    met = sum(line.startswith("PASS") for line in checks)
    missed = sum(line.startswith("MISS") for line in checks)
    skipped = sum(line.startswith("SKIP") for line in checks)
    line = f"targets: {met} met, {missed} missed"
    if skipped:
        line += f", {skipped} not run"
    return line + f" (of {len(checks)})"

"""The Rust data plane's Python callbacks a call, as thread CPU time: this checkout against
another one, side by side.

Each call of the Rust plane runs `prepare` and `finish` on its caller thread under the GIL,
on the path of its reply; the recorder thread runs `record` after it (`--ack fast`). Here a
capture server (`--data-plane rust`, a data directory, `--fsync never`) runs in process in
front of the stub engine (no generation time), and 8 sessions make 15 turns each of the GRPO
task of `capture_server.py` (a 200 KiB screenshot, the answers' token ids and logprobs),
one call at a time; each callback's thread CPU time (`time.thread_time_ns`: waiting for the
GIL or a core is not counted) is noted, the first 10 calls left out. The two checkouts run
in worker processes of their own (one library each on PYTHONPATH), alternated round by
round. Prints each callback's median a call, per checkout and round.

    python benchmarks/plane_callbacks.py [--against OTHER_CHECKOUT] [--rounds 3] [--ack fast]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from measure import targets_summary

HERE = Path(__file__).resolve().parent
CALLBACKS = ("prepare", "adopt", "finish", "record", "sent")
#: The target (with `--against`): this checkout's callbacks (the least of each over the
#: rounds, summed) at most this many times the other's: no regression beyond noise
MAX_SUM_RATIO = 1.05
SESSIONS, TURNS, WARMUP = 8, 15, 10


@contextmanager
def _served(app: Any) -> Iterator[int]:
    """`app` served by uvicorn in a thread on a free loopback port."""
    import uvicorn

    from rollout_store.serve.server import listen_socket

    sock = listen_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(20)


def _timed(times: list[int], method: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time_ns()
        try:
            return method(*args, **kwargs)
        finally:
            times.append(time.thread_time_ns() - start)

    return timed


def work(ack: str) -> dict[str, float]:
    """In a worker: each callback's median thread CPU time a call, in microseconds."""
    import httpx

    from rollout_store.serve.server import RustDataPlane, create_app
    from rollout_store.serve.stub_engine import create_stub_app

    sys.path.insert(0, str(HERE))
    from capture_server import task

    times: dict[str, list[int]] = {name: [] for name in CALLBACKS}
    for name in CALLBACKS:
        if hasattr(RustDataPlane, name):  # (a checkout before the direct lane has no `adopt`)
            setattr(RustDataPlane, name, _timed(times[name], getattr(RustDataPlane, name)))
    with _served(create_stub_app()) as stub, tempfile.TemporaryDirectory() as data:
        app = create_app(f"http://127.0.0.1:{stub}", data=data, fsync="never", ack=ack)
        with _served(app) as backend:
            plane = RustDataPlane(app, host="127.0.0.1", port=0, backend_port=backend)
            url = f"http://127.0.0.1:{plane.port}"
            with httpx.Client(timeout=30) as client:
                for _ in range(SESSIONS):
                    made = client.post(f"{url}/sessions", json={}).json()
                    auth = {"authorization": f"Bearer {made['api_key']}"}
                    messages = copy.deepcopy(task())
                    for turn in range(TURNS):
                        body = {"model": "m", "messages": messages}
                        answer = client.post(f"{url}/v1/chat/completions", json=body, headers=auth)
                        answer.raise_for_status()
                        messages += [answer.json()["choices"][0]["message"]]
                        messages += [{"role": "user", "content": f"go on {turn}"}]
                # (the info waits for the session's turns: `record` has run for each)
                client.get(f"{url}/sessions/{made['session_id']}", headers=auth)
    return {
        name: statistics.median(found[WARMUP:]) / 1e3 if found[WARMUP:] else float("nan")
        for name, found in times.items()
    }


def _in_worker(checkout: Path, ack: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(
        [sys.executable, __file__, "--worker", "--ack", ack],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, default=None, help="another checkout's folder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ack", choices=("durable", "fast"), default="fast")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(work(args.ack)))
        return 0
    checkouts = {"this": HERE.parent}
    if args.against is not None:
        checkouts["other"] = args.against.resolve()
    print(f"--ack {args.ack}: median thread CPU time a call (us)")
    print(f"{'round':<7}{'checkout':<10}" + "".join(f"{name:>10}" for name in CALLBACKS))
    least: dict[str, dict[str, float]] = {label: {} for label in checkouts}
    for n in range(1, args.rounds + 1):
        for label, checkout in checkouts.items():
            found = _in_worker(checkout, args.ack)
            for name in CALLBACKS:
                if found[name] == found[name]:  # (nan: not called)
                    least[label][name] = min(least[label].get(name, found[name]), found[name])
            cells = (
                f"{found[name]:>10.1f}" if found[name] == found[name] else f"{'-':>10}"
                for name in CALLBACKS
            )  # (nan: not called, `--ack durable`'s `record`)
            print(f"{n:<7}{label:<10}" + "".join(cells))
    if "other" in least:
        this, other = sum(least["this"].values()), sum(least["other"].values())
        ratio = this / other if other else float("inf")
        verdict = "PASS" if ratio <= MAX_SUM_RATIO else "MISS"
        checks = [
            f"{verdict}: callbacks' CPU a call, this / the other checkout {ratio:.2f} "
            f"<= {MAX_SUM_RATIO} ({this:.1f} / {other:.1f} us)"
        ]
    else:
        checks = ["SKIP: callbacks' CPU against another checkout (no --against)"]
    print("\n".join(checks))
    print(targets_summary(checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())

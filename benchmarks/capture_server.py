"""A GRPO group through the capture server: server memory and the latency it adds.

16 sessions x 20 turns of one task (a shared system prompt, tools and a 200 KiB screenshot)
run concurrently against the stub engine: directly, through `rollout-store serve`, and
through two baselines that forward the same way: *anchor* (the well-known capture server's
scheme: decode every request and keep it, with its response, per session, in memory) and
*forward-only* (records nothing: the floor every recorder pays for proxying). Every scheme
runs in a fresh server process; the schemes take turns over several rounds in one run.

Reported: each server's RSS growth over the group (after a small warm-up) against the
group's unique content (benchmarks/workloads.py's definition), also net of forward-only's
growth (what recording itself keeps), and the per-request latency each adds over calling
the stub directly, median and p99, with 16 rollouts in flight: from separate runs, and
paired (each rollout makes every call to the stub and then through the server, so both
see the same load; the figure is the difference per call, and the targets use it).
Writes out/capture_server.json (results/ with --update-results; a --quick run writes nothing);
ends with PASS/MISS lines for the targets and a one-line count of targets met and missed.

    python benchmarks/capture_server.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from measure import (  # noqa: E402
    MiB,
    add_results_option,
    library_commit,
    results_dir,
    targets_summary,
)
from workloads import UniqueContent  # noqa: E402

SESSIONS, TURNS = 16, 20
IMAGE_BYTES = 150 * 1024  # 200 KiB of base64
TARGET_RSS_OVER_UNIQUE = 1.5
TARGET_MEDIAN_MS, TARGET_P99_MS = 2.0, 10.0
WAIT_S = 30.0
# Servers run with glibc's mmap threshold fixed at 64 KiB, so a request's large buffers go
# back to the system when freed and RSS shows what a server keeps, not its peak of
# transient buffers (16 requests of 270 KiB in flight); the same for every scheme.
MALLOC_ENV = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "65536"}

SYSTEM = {"role": "system", "content": "You operate a browser for the user. " * 120}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} on the page",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
    for name in ("click", "type", "scroll")
]
IMAGE = (
    "data:image/png;base64," + base64.b64encode(random.Random(1).randbytes(IMAGE_BYTES)).decode()
)


def task() -> list[Any]:
    return [
        SYSTEM,
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Open the settings page and turn on dark mode."},
                {"type": "image_url", "image_url": {"url": IMAGE}},
            ],
        },
    ]


# ---------------------------------------------------------------- the baselines


def baseline_app(upstream: str, keep: bool) -> Any:
    """A proxy forwarding like the capture server; with `keep`, the anchor's scheme."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    kept: dict[str, list[tuple[Any, Any]]] = {}
    limits = httpx.Limits(max_keepalive_connections=64, keepalive_expiry=2.0)  # as the server
    client = httpx.AsyncClient(base_url=upstream, timeout=600, limits=limits)

    async def chat(request: Request) -> Response:
        key = request.headers.get("authorization", "")[7:]
        body = json.loads(await request.body())
        upstream_body = {**body, "stream": False, "return_token_ids": True, "logprobs": True}
        answer = await client.post("/v1/chat/completions", content=json.dumps(upstream_body))
        response = json.loads(answer.content)
        if keep:
            kept.setdefault(key, []).append((body, response))
        response.pop("prompt_token_ids", None)
        for choice in response["choices"]:
            choice.pop("token_ids", None)
            choice["logprobs"] = None
        return JSONResponse(response)

    async def sessions(request: Request) -> Response:
        return JSONResponse({"session_id": "s", "api_key": f"k{len(kept)}-{time.time_ns()}"})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/sessions", sessions, methods=["POST"]),
        ]
    )


def serve_baseline(argv: list[str]) -> int:
    import uvicorn

    from rollout_store.server import listen_socket

    upstream, mode = argv
    sock = listen_socket("127.0.0.1", 0)
    print(f"baseline serve: http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    app = baseline_app(upstream, keep=mode == "anchor")
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
    return 0


# ---------------------------------------------------------------- processes


class Child:
    def __init__(self, args: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), **MALLOC_ENV}
        self.proc = subprocess.Popen(
            [sys.executable, *args], stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = re.search(r"(http://127\.0\.0\.1:\d+)", line)
        if match is None:
            self.stop()
            raise RuntimeError(f"child did not start: {args} {line!r}")
        self.url = match.group(1)

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as fp:
            for line in fp:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(WAIT_S)


@contextlib.contextmanager
def server_for(scheme: str, stub: str, data: Path) -> Iterator[Child]:
    if scheme == "rollout_store":
        args = ["-m", "rollout_store.cli", "serve", "--upstream", stub, "--port", "0"]
    elif scheme == "rollout_store+log":
        args = ["-m", "rollout_store.cli", "serve", "--upstream", stub, "--port", "0"]
        args += ["--data", str(data), "--fsync", "turn"]
    else:
        args = [str(Path(__file__).resolve()), "--serve-baseline", stub, scheme]
    child = Child(args)
    try:
        yield child
    finally:
        child.stop()


# ---------------------------------------------------------------- the group


async def rollout(
    client: httpx.AsyncClient,
    url: str,
    key: str,
    seed: int,
    turns: int,
    direct: bool,
    latencies: list[float],
    bodies: list[dict[str, Any]] | None,
    first: str = "",
    pair: str | None = None,
    added: list[float] | None = None,
) -> None:
    messages = task() if not first else [{"role": "user", "content": first}]
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    for k in range(turns):
        body: dict[str, Any] = {
            "model": "policy",
            "messages": messages,
            "tools": TOOLS,
            "seed": seed,
            "temperature": 1.0,
        }
        sent = {**body, "return_token_ids": True, "logprobs": True} if direct else body
        content = json.dumps(sent)
        paired = 0.0
        if pair is not None:  # the same call to the stub first, under the same load
            tokens = json.dumps({**body, "return_token_ids": True, "logprobs": True})
            start = time.perf_counter()
            (await client.post(f"{pair}/v1/chat/completions", content=tokens)).raise_for_status()
            paired = time.perf_counter() - start
        start = time.perf_counter()
        answer = await client.post(f"{url}/v1/chat/completions", content=content, headers=headers)
        latencies.append(time.perf_counter() - start)
        if added is not None:
            added.append(latencies[-1] - paired)
        answer.raise_for_status()
        response = answer.json()
        choice = response["choices"][0]
        message = choice["message"]
        if bodies is not None:
            bodies.append(
                {
                    "messages": messages,
                    "tools": TOOLS,
                    "response": message,
                    "prompt_ids": response.get("prompt_token_ids"),
                    "sampled_ids": choice.get("token_ids"),
                    "sampled_logprobs": [e["logprob"] for e in choice["logprobs"]["content"]],
                }
            )
        message = {k: v for k, v in message.items() if v is not None}
        messages = messages + [message]
        if message.get("tool_calls"):
            call_id = message["tool_calls"][0]["id"]
            messages.append({"role": "tool", "tool_call_id": call_id, "content": f"ok {k}"})
        else:
            messages.append({"role": "user", "content": f"Continue (step {k})."})


async def run_group(
    url: str,
    direct: bool,
    sessions: int,
    turns: int,
    bodies: list[dict[str, Any]] | None = None,
    warmup: bool = False,
    pair: str | None = None,
    added: list[float] | None = None,
) -> list[float]:
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=WAIT_S, limits=limits) as client:
        keys = []
        for _ in range(sessions):
            if direct:
                keys.append("direct")
            else:
                made = await client.post(f"{url}/sessions", json={})
                keys.append(made.json()["api_key"])
        await asyncio.gather(
            *(
                rollout(
                    client,
                    url,
                    key,
                    seed,
                    turns,
                    direct,
                    latencies,
                    bodies,
                    first="warm up please" if warmup else "",
                    pair=pair,
                    added=added,
                )
                for seed, key in enumerate(keys)
            )
        )
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-baseline"]:
        return serve_baseline(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 sessions x 6 turns, 1 round")
    parser.add_argument("--rounds", type=int, default=3)
    add_results_option(parser)
    args = parser.parse_args(argv)
    sessions, turns, rounds = (4, 6, 1) if args.quick else (SESSIONS, TURNS, args.rounds)
    schemes = ["direct", "rollout_store", "rollout_store+log", "anchor", "forward-only"]

    stub = Child(["-m", "rollout_store.stub_engine", "--port", "0"])
    latencies: dict[str, list[float]] = {s: [] for s in schemes}
    rss: dict[str, list[int]] = {s: [] for s in schemes if s != "direct"}
    added: dict[str, list[float]] = {s: [] for s in schemes if s != "direct"}
    bodies: list[dict[str, Any]] = []
    try:
        asyncio.run(run_group(stub.url, True, sessions, turns, bodies))  # content + warm stub
        for r in range(rounds):
            order = schemes[r % len(schemes) :] + schemes[: r % len(schemes)]
            for scheme in order:
                if scheme == "direct":
                    latencies[scheme] += asyncio.run(run_group(stub.url, True, sessions, turns))
                    continue
                with (
                    tempfile.TemporaryDirectory() as tmp,
                    server_for(scheme, stub.url, Path(tmp)) as server,
                ):
                    asyncio.run(run_group(server.url, False, 2, 3, warmup=True))
                    before = server.rss()
                    latencies[scheme] += asyncio.run(run_group(server.url, False, sessions, turns))
                    rss[scheme].append(server.rss() - before)
                    # paired: each call made to the stub, then through the server, in turn
                    asyncio.run(
                        run_group(
                            server.url,
                            False,
                            sessions,
                            turns,
                            pair=stub.url,
                            added=added[scheme],
                        )
                    )
                print(f"round {r + 1}/{rounds}: {scheme} done", file=sys.stderr)
    finally:
        stub.stop()

    unique = UniqueContent()
    for body in bodies:
        unique.add(body)
    direct_median = statistics.median(latencies["direct"]) * 1000
    direct_p99 = percentile(latencies["direct"], 0.99) * 1000
    rows: dict[str, Any] = {}
    for scheme in schemes:
        median = statistics.median(latencies[scheme]) * 1000
        p99 = percentile(latencies[scheme], 0.99) * 1000
        row: dict[str, Any] = {
            "requests": len(latencies[scheme]),
            "median_ms": median,
            "p99_ms": p99,
            "added_median_ms": median - direct_median,
            "added_p99_ms": p99 - direct_p99,
        }
        if scheme in added:
            row["paired_added_median_ms"] = statistics.median(added[scheme]) * 1000
            row["paired_added_p99_ms"] = percentile(added[scheme], 0.99) * 1000
        if scheme in rss:
            growth = statistics.median(rss[scheme])
            row["rss_growth_bytes"] = growth
            row["rss_growth_runs"] = rss[scheme]
            row["rss_over_unique"] = growth / unique.bytes
        rows[scheme] = row
    floor = rows["forward-only"]["rss_growth_bytes"]
    for scheme in ("rollout_store", "rollout_store+log", "anchor"):
        rows[scheme]["rss_over_forward_only_over_unique"] = (
            rows[scheme]["rss_growth_bytes"] - floor
        ) / unique.bytes
    result = {
        "commit": library_commit(),
        "sessions": sessions,
        "turns": turns,
        "rounds": rounds,
        "unique_bytes": unique.bytes,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "schemes": rows,
    }
    if not args.quick:
        path = results_dir(args.update_results) / "capture_server.json"
        path.write_text(json.dumps(result, indent=2) + "\n")

    print(f"GRPO group: {sessions} sessions x {turns} turns, {rounds} rounds")
    print(f"unique content: {unique.bytes / MiB:.2f} MiB; load average {os.getloadavg()[0]:.1f}")
    print(
        f"{'scheme':<18} {'RSS growth MiB':>14} {'x unique':>9} {'net x':>7} {'median ms':>10} "
        f"{'p99 ms':>8} {'+median':>8} {'+p99':>8} {'paired +median':>15} {'paired +p99':>12}"
    )
    for scheme, row in rows.items():
        growth = row.get("rss_growth_bytes")
        mib = f"{growth / MiB:.2f}" if growth is not None else "-"
        over = f"{row['rss_over_unique']:.2f}" if growth is not None else "-"
        net = row.get("rss_over_forward_only_over_unique")
        net_text = f"{net:.2f}" if net is not None else "-"
        print(
            f"{scheme:<18} {mib:>14} {over:>9} {net_text:>7} "
            f"{row['median_ms']:>10.2f} {row['p99_ms']:>8.2f} "
            f"{row['added_median_ms']:>8.2f} {row['added_p99_ms']:>8.2f} "
            f"{row.get('paired_added_median_ms', 0.0):>15.2f} "
            f"{row.get('paired_added_p99_ms', 0.0):>12.2f}"
        )
    ours = rows["rollout_store"]
    checks = [
        (
            f"server RSS growth <= {TARGET_RSS_OVER_UNIQUE}x unique content",
            ours["rss_over_unique"] <= TARGET_RSS_OVER_UNIQUE,
            f"{ours['rss_over_unique']:.2f}x (anchor {rows['anchor']['rss_over_unique']:.2f}x)",
        ),
        (
            f"added median latency (paired) <= {TARGET_MEDIAN_MS} ms",
            ours["paired_added_median_ms"] <= TARGET_MEDIAN_MS,
            f"{ours['paired_added_median_ms']:.2f} ms",
        ),
        (
            f"added p99 latency (paired) <= {TARGET_P99_MS} ms",
            ours["paired_added_p99_ms"] <= TARGET_P99_MS,
            f"{ours['paired_added_p99_ms']:.2f} ms",
        ),
    ]
    lines = [f"{'PASS' if ok else 'MISS'}: {name}: {value}" for name, ok, value in checks]
    print("\n".join(lines))
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1):
        print(f"note: load average {load:.1f} on {os.cpu_count()} CPUs: latencies include queueing")
    print(targets_summary(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Throughput through the capture server: against an instant stub, and an agentic replay.

Both modes run each server in a fresh process (`capture_server.py`'s helpers), for each data
plane (`--planes python,rust`): `--ack durable --fsync never` and `--ack fast` with a data
directory, and the same plane recording nothing (forward-only: the Python baseline proxy, or
`rust-forward-only`, the Rust listener and pooled client forwarding each call as it came, so
its client asks for token ids and logprobs itself, as direct calls do, for the stub to do the
same work as for the recording servers), in turns within one run, beside direct calls to the
stub (the ceiling).

`--throughput`: the GRPO group's bodies (a 200 KiB screenshot each) against a stub answering
at once, `--sessions` concurrent sessions x `--turns` turns. Each row: calls a second (wall
clock, everything sharing the machine's CPUs: client, stub and server), the server's CPU a
call (user + system, from /proc) and calls a second per server core (calls over the server's
CPU seconds: what one core of server could carry). PASS/MISS: server CPU a call <= 0.3 ms.

`--replay`: coding-agent sessions shaped like SemiAnalysis AgentX as skyrl-capture replays it
(about 31 turns a session, context about 100k tokens at the median and growing each turn,
output about 450 tokens at the median), scaled to a small machine: the stub's tokens are
words, the context is scaled 1/10 (a 1,000-word system prompt and task, then 600 words a
turn: the reply, about 450 words at the median, and a tool result; 10,000 words, about
60 KiB, at the median turn 15, 19,000 at turn 30); each call asks for its output length as
`max_tokens` (log-normal, median 450, 50-2,000) and the stub (`--fill-max-tokens
--ms-per-token`) answers that many words after 2 ms a token. Each session plays `--window`
consecutive turns starting at its own turn of the 31 (the turns before are its history), so
the calls of a run span the whole session's range of contexts. Throughput: completed calls
a second in steady state, each session a closed loop (its calls over its own time, summed
over the sessions; the run's wall time is set by its slowest session's outputs, so calls
over wall time, shown as "wall kept", hides most of what a server adds); throughput kept =
through the server / direct, the same workload. At
16, 64 and 128 concurrent sessions (`--sessions`). PASS/MISS: >= 95% of direct at 64
sessions, each ack mode, each plane.

Writes out/capture_throughput.json (results/ with --update-results).

    python benchmarks/capture_throughput.py --throughput [--sessions 16] [--turns 10]
    python benchmarks/capture_throughput.py --replay [--sessions 16,64,128] [--window 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from capture_server import (  # noqa: E402
    Child,
    http_client,
    new_keys,
    post_json,
    run_group,
    server_for,
)
from measure import add_results_option, library_commit, results_dir, targets_summary  # noqa: E402

TARGET_CPU_MS = 0.3
TARGET_KEPT = 0.95
#: AgentX as replayed: turns a session, median output tokens; the context scale used here.
SESSION_TURNS, OUTPUT_MEDIAN = 31, 450
BASE_WORDS, TURN_WORDS = 1_000, 600
MS_PER_TOKEN = 2.0
VOCABULARY = [
    f"{a}{b}"
    for a in ("re", "in", "de", "ex", "un", "co", "pro", "sub")
    for b in (
        "turn",
        "call",
        "read",
        "write",
        "test",
        "file",
        "path",
        "line",
        "node",
        "edit",
        "diff",
        "fix",
        "grep",
        "load",
        "parse",
        "build",
        "run",
        "check",
        "merge",
        "patch",
        "scan",
        "store",
    )
]


def schemes_for(planes: Sequence[str]) -> list[str]:
    found = []
    if "python" in planes:
        found += ["ack-durable", "ack-fast", "forward-only"]
    if "rust" in planes:
        found += ["rust-durable", "rust-fast", "rust-forward-only"]
    return found


def start_stub(*extra: str) -> Child:
    return Child(["-m", "rollout_store.serve.stub_engine", "--port", "0", *extra], malloc=False)


def _floor(scheme: str) -> str:
    return "rust-forward-only" if scheme.startswith("rust-") else "forward-only"


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---------------------------------------------------------------- against an instant stub


def throughput(planes: Sequence[str], sessions: int, turns: int, rounds: int) -> dict[str, Any]:
    schemes = schemes_for(planes)
    stub = start_stub("--latency-ms", "0")
    rate: dict[str, list[float]] = {s: [] for s in ["direct", *schemes]}
    cpu: dict[str, list[float]] = {s: [] for s in schemes}
    try:
        asyncio.run(run_group(stub.url, True, sessions, 2))  # a warm stub
        for r in range(rounds):
            start = time.perf_counter()
            asyncio.run(run_group(stub.url, True, sessions, turns))
            rate["direct"].append(sessions * turns / (time.perf_counter() - start))
            for scheme in schemes[r % len(schemes) :] + schemes[: r % len(schemes)]:
                with (
                    tempfile.TemporaryDirectory() as tmp,
                    server_for(scheme, stub.url, Path(tmp), malloc=False) as server,
                ):
                    asyncio.run(run_group(server.url, False, sessions, 2, warmup=True))
                    calls = sessions * turns
                    before = server.cpu()
                    start = time.perf_counter()
                    # rust-forward-only forwards a body as it came: the client asks for
                    # token ids and logprobs, so the stub does the same work
                    ask = scheme == "rust-forward-only"
                    asyncio.run(run_group(server.url, False, sessions, turns, ask_ids=ask))
                    rate[scheme].append(calls / (time.perf_counter() - start))
                    cpu[scheme].append((server.cpu() - before) / calls)
                print(
                    f"round {r + 1}: {scheme:<18} {rate[scheme][-1]:7.1f} calls/s, cpu "
                    f"{cpu[scheme][-1] * 1000:.2f} ms a call ({load()})",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        stub.stop()
    rows = {
        scheme: {
            "calls_per_s": statistics.median(rate[scheme]),
            "cpu_ms_per_call": statistics.median(cpu[scheme]) * 1000 if scheme in cpu else None,
            "calls_per_s_per_server_core": (
                1 / statistics.median(cpu[scheme]) if cpu.get(scheme) else None
            ),
        }
        for scheme in rate
    }
    print(
        f"\nthroughput against an instant stub: GRPO bodies, {sessions} sessions x {turns} "
        f"turns, {rounds} round(s), {os.cpu_count()} CPUs, {load()}"
    )
    print(f"{'server':<18}{'calls/s':>9}{'of direct':>11}{'cpu/call ms':>13}{'calls/s/core':>14}")
    lines = []
    for scheme, row in rows.items():
        of_direct = row["calls_per_s"] / rows["direct"]["calls_per_s"]
        if row["cpu_ms_per_call"] is None:
            print(f"{scheme:<18}{row['calls_per_s']:>9.1f}{of_direct:>10.0%}{'':>13}{'':>14}")
            continue
        print(
            f"{scheme:<18}{row['calls_per_s']:>9.1f}{of_direct:>10.0%}"
            f"{row['cpu_ms_per_call']:>13.2f}{row['calls_per_s_per_server_core']:>14.0f}"
        )
        if "forward-only" not in scheme:
            floor = rows[_floor(scheme)]
            ok = row["cpu_ms_per_call"] <= TARGET_CPU_MS
            lines.append(
                f"{'PASS' if ok else 'MISS'}: {scheme} server CPU a call <= {TARGET_CPU_MS} ms "
                f"(instant stub): {row['cpu_ms_per_call']:.2f} ms ({_floor(scheme)} "
                f"{floor['cpu_ms_per_call']:.2f}), {row['calls_per_s_per_server_core']:.0f} "
                f"calls/s per server core"
            )
    print("\n".join(lines))
    return {"sessions": sessions, "turns": turns, "rounds": rounds, "rows": rows, "lines": lines}


# ---------------------------------------------------------------- the agentic replay


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(VOCABULARY, k=n))


def output_tokens(seed: int, turn: int) -> int:
    """The output length a call asks for: log-normal around the median, fixed per call."""
    rng = random.Random(seed * 1_000 + turn)
    return max(50, min(2_000, round(OUTPUT_MEDIAN * math.exp(rng.gauss(0.0, 0.6)))))


def session_plan(seed: int, window: int) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """A session's history before its first played turn, and each played turn's (output
    tokens asked for, tool result added after the reply)."""
    rng = random.Random(seed)
    first = (seed * 7) % (SESSION_TURNS - window + 1)
    system = {"role": "system", "content": _words(random.Random(-1), BASE_WORDS - 200)}
    messages: list[dict[str, Any]] = [system, {"role": "user", "content": _words(rng, 200)}]
    for turn in range(first):
        out = output_tokens(seed, turn)
        messages.append({"role": "assistant", "content": _words(rng, out)})
        messages.append({"role": "user", "content": _words(rng, max(20, TURN_WORDS - out))})
    played = []
    for turn in range(first, first + window):
        out = output_tokens(seed, turn)
        played.append((out, _words(rng, max(20, TURN_WORDS - out))))
    return messages, played


async def replay_session(
    client: Any,
    url: str,
    key: str,
    seed: int,
    plan: tuple[list[dict[str, Any]], list[tuple[int, str]]],
    ask_ids: bool,
) -> tuple[int, float]:
    """(words of context sent, seconds for the session's played turns)."""
    messages, played = plan
    start = time.perf_counter()
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    sent_words = 0
    for out, result in played:
        body: dict[str, Any] = {
            "model": "policy",
            "messages": messages,
            "max_tokens": out,
            "temperature": 1.0,
            "seed": seed,
        }
        if ask_ids:  # what a recording server asks the engine for
            body |= {"return_token_ids": True, "logprobs": True}
        sent_words += sum(len(str(m["content"]).split()) for m in messages)
        _, answer = await post_json(
            client, f"{url}/v1/chat/completions", json.dumps(body).encode(), headers
        )
        reply = json.loads(answer)["choices"][0]["message"]
        messages = messages + [
            {"role": "assistant", "content": reply["content"]},
            {"role": "user", "content": result},
        ]
    return sent_words, time.perf_counter() - start


async def replay_run(
    url: str,
    direct: bool,
    plans: list[tuple[list[dict[str, Any]], list[tuple[int, str]]]],
    ask_ids: bool = False,
) -> tuple[float, float, int]:
    """(calls a second summed over the sessions, calls a second over the run's wall time,
    words of context sent)."""
    async with http_client() as client:
        keys = ["direct"] * len(plans) if direct else await new_keys(client, url, len(plans))
        start = time.perf_counter()
        found = await asyncio.gather(
            *(
                replay_session(client, url, key, seed, plan, direct or ask_ids)
                for seed, (key, plan) in enumerate(zip(keys, plans, strict=True))
            )
        )
        wall = time.perf_counter() - start
        calls = sum(len(plan[1]) for plan in plans)
        steady = sum(
            len(plan[1]) / seconds for plan, (_, seconds) in zip(plans, found, strict=True)
        )
        return steady, calls / wall, sum(words for words, _ in found)


def replay(
    planes: Sequence[str], counts: Sequence[int], window: int, rounds: int
) -> dict[str, Any]:
    schemes = schemes_for(planes)
    stub = start_stub("--fill-max-tokens", "--ms-per-token", str(MS_PER_TOKEN))
    rate: dict[tuple[str, int], list[float]] = {}
    wall: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    context: dict[int, float] = {}
    loads: dict[int, str] = {}
    try:
        asyncio.run(run_group(stub.url, True, 4, 2))  # a warm stub
        for n in counts:
            plans = [session_plan(seed, window) for seed in range(n)]
            calls = n * window
            for r in range(rounds):
                steady, whole, words = asyncio.run(replay_run(stub.url, True, plans))
                rate.setdefault(("direct", n), []).append(steady)
                wall.setdefault(("direct", n), []).append(whole)
                context[n] = words / calls
                for scheme in schemes[r % len(schemes) :] + schemes[: r % len(schemes)]:
                    with (
                        tempfile.TemporaryDirectory() as tmp,
                        server_for(scheme, stub.url, Path(tmp), malloc=False) as server,
                    ):
                        asyncio.run(run_group(server.url, False, 4, 2, warmup=True))
                        before = server.cpu()
                        # rust-forward-only forwards a body as it came: the client asks
                        # for token ids and logprobs, so the stub does the same work
                        steady, whole, _ = asyncio.run(
                            replay_run(server.url, False, plans, scheme == "rust-forward-only")
                        )
                        rate.setdefault((scheme, n), []).append(steady)
                        wall.setdefault((scheme, n), []).append(whole)
                        cpu.setdefault((scheme, n), []).append((server.cpu() - before) / calls)
                    print(
                        f"{n:>3} sessions round {r + 1}: {scheme:<18} "
                        f"{rate[scheme, n][-1]:6.1f} calls/s (direct "
                        f"{rate['direct', n][-1]:.1f}) ({load()})",
                        file=sys.stderr,
                        flush=True,
                    )
            loads[n] = load()
    finally:
        stub.stop()
    print(
        f"\nagentic replay: {window} turns a session from its own turn of {SESSION_TURNS}, "
        f"output median {OUTPUT_MEDIAN} tokens at {MS_PER_TOKEN:g} ms a token, {rounds} "
        f"round(s), {os.cpu_count()} CPUs"
    )
    print(
        f"{'server':<18}{'sessions':>9}{'calls/s':>9}{'kept':>8}{'cpu/call ms':>13}"
        f"{'wall kept':>10}{'ctx words':>11}  load"
    )
    rows: dict[str, dict[str, Any]] = {}
    for n in counts:
        direct = statistics.median(rate["direct", n])
        for scheme in ["direct", *schemes]:
            value = statistics.median(rate[scheme, n])
            per_call = statistics.median(cpu[scheme, n]) * 1000 if (scheme, n) in cpu else None
            rows[f"{scheme}@{n}"] = {
                "sessions": n,
                "calls_per_s": value,
                "kept": value / direct,
                "wall_calls_per_s": statistics.median(wall[scheme, n]),
                "wall_kept": statistics.median(wall[scheme, n])
                / statistics.median(wall["direct", n]),
                "cpu_ms_per_call": per_call,
            }
            shown = f"{per_call:>13.2f}" if per_call is not None else f"{'':>13}"
            print(
                f"{scheme:<18}{n:>9}{value:>9.1f}{value / direct:>8.1%}{shown}"
                f"{rows[f'{scheme}@{n}']['wall_kept']:>10.1%}"
                f"{context[n]:>11.0f}  {loads[n]}"
            )
    lines = []
    if 64 in counts:
        for scheme in schemes:
            if "forward-only" in scheme:
                continue
            kept = rows[f"{scheme}@64"]["kept"]
            lines.append(
                f"{'PASS' if kept >= TARGET_KEPT else 'MISS'}: {scheme} agentic replay keeps "
                f">= {TARGET_KEPT:.0%} of direct throughput at 64 sessions: {kept:.1%} "
                f"({_floor(scheme)} {rows[f'{_floor(scheme)}@64']['kept']:.1%})"
            )
    else:
        lines.append("SKIP: throughput kept at 64 sessions (64 not in --sessions)")
    print("\n".join(lines))
    return {
        "window": window,
        "rounds": rounds,
        "ms_per_token": MS_PER_TOKEN,
        "context_words_per_call": context,
        "load_average": loads,
        "rows": rows,
        "lines": lines,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--throughput", action="store_true", help="against an instant stub")
    mode.add_argument("--replay", action="store_true", help="the agentic replay")
    parser.add_argument("--planes", default="python,rust", help="python, rust or both")
    parser.add_argument("--sessions", default=None, help="concurrent sessions, comma-separated")
    parser.add_argument("--turns", type=int, default=10, help="turns a session (--throughput)")
    parser.add_argument("--window", type=int, default=3, help="turns a session (--replay)")
    parser.add_argument("--rounds", type=int, default=1)
    add_results_option(parser)
    args = parser.parse_args(argv)
    planes = args.planes.split(",")
    result: dict[str, Any] = {"commit": library_commit(), "cpus": os.cpu_count()}
    if args.throughput:
        sessions = int(args.sessions or 16)
        found = throughput(planes, sessions, args.turns, args.rounds)
        name = "throughput"
    else:
        counts = [int(n) for n in (args.sessions or "16,64,128").split(",")]
        found = replay(planes, counts, args.window, args.rounds)
        name = "replay"
    result[name] = found
    path = results_dir(args.update_results) / f"capture_throughput_{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(targets_summary(found["lines"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

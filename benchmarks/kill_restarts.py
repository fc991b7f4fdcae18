"""Acknowledged turns over kill -9 restarts of the capture server, each ack mode and data plane.

For each configuration (`--ack durable --fsync turn` and `--ack fast --fsync turn`, on the
Python and the Rust data plane), a server process runs over one `--data` directory in front
of the stub engine (`--latency-ms 20`, half of it jitter); `--sessions` concurrent sessions
call the model in a loop (each call's conversation unique, so every turn is told apart by its
request); after a random 0.3-1.5 s, with calls in flight, the server gets SIGKILL and is
restarted on the same directory, `--restarts` times. Every call the client saw acknowledged
(200 with its whole body) is kept: its request's messages and the reply's message. After the
last restart each session's export (`messages=1`, `discarded=1`) must hold a turn with that
request and that response for every acknowledged call.

`durable`: acknowledged turns missing (target 0). `fast`: acknowledged turns missing, and what
the restarted server counts as dropped (`/health`, each session's info, its export's
`dropped_turns` finding). A fast server killed with -9 dies with its queue; the turns it had
answered and not yet recorded are counted by the next start from the data directory's ack
ledger (docs/server.md), which may count a few more than the client saw acknowledged: a
reply the kill cut after its ledger line was written. PASS/MISS: durable loses none; fast
counts every acknowledged turn it lost.

Writes out/kill_restarts.json (results/ with --update-results).

    python benchmarks/kill_restarts.py [--restarts 20] [--sessions 8] [--planes python,rust]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from capture_server import JSON, Child, http_client, post_json  # noqa: E402
from capture_throughput import load, start_stub  # noqa: E402
from measure import add_results_option, library_commit, results_dir, targets_summary  # noqa: E402

ACKS = ("durable", "fast")
SYSTEM = {"role": "system", "content": "You are a careful agent. " * 20}
#: A session's conversation starts afresh after this many acknowledged calls (bounded bodies).
CONVERSATION_CALLS = 6
KILL_AFTER_S = (0.3, 1.5)


class Session:
    """One session's calls: every acknowledged call's request and response, as `json.dumps`."""

    def __init__(self, index: int, session_id: str, key: str) -> None:
        self.index = index
        self.session_id = session_id
        self.key = key
        self.history: list[Any] = []
        self.calls = 0
        self.acked: list[tuple[str, str]] = []

    def body(self) -> list[Any]:
        if len(self.history) >= 2 * CONVERSATION_CALLS:
            self.history = []
        self.calls += 1
        ask = {"role": "user", "content": f"session {self.index}, call {self.calls}: go on."}
        return [SYSTEM, *self.history, ask]


class Flight:
    """Calls started and not finished, and what each round saw when its kill came."""

    def __init__(self) -> None:
        self.now = 0
        self.at_kills: list[int] = []
        self.failed = 0  # answered, but not 200: not acknowledged
        self.cut = 0  # refused or cut by a kill: not acknowledged


def _message(message: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in message.items() if v is not None})


async def _calls(client: aiohttp.ClientSession, url: str, session: Session, flight: Flight) -> None:
    headers = {"authorization": f"Bearer {session.key}", **JSON}
    while True:
        messages = session.body()
        content = json.dumps({"model": "policy", "messages": messages, "seed": session.index})
        flight.now += 1
        try:
            _, answer = await post_json(
                client, f"{url}/v1/chat/completions", content.encode(), headers
            )
            message = json.loads(answer)["choices"][0]["message"]
        except RuntimeError:  # a status other than 200
            flight.failed += 1
            return
        except (TimeoutError, aiohttp.ClientError, ValueError):
            flight.cut += 1
            return
        finally:
            flight.now -= 1
        session.acked.append((json.dumps(messages), _message(message)))
        session.history = [*messages[1:], {k: v for k, v in message.items() if v is not None}]


async def _round(server: Child, sessions: list[Session], flight: Flight, delay: float) -> None:
    async def kill() -> None:
        await asyncio.sleep(delay)
        flight.at_kills.append(flight.now)
        server.proc.kill()

    async with http_client() as client:
        await asyncio.gather(kill(), *(_calls(client, server.url, s, flight) for s in sessions))
    server.proc.wait(30)


async def _get(client: aiohttp.ClientSession, url: str, key: str | None = None) -> Any:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with client.get(url, headers=headers) as answer:
        if answer.status != 200:
            raise RuntimeError(f"{url} answered {answer.status}: {(await answer.text())[:300]}")
        return json.loads(await answer.read())


async def _check(url: str, sessions: list[Session]) -> dict[str, Any]:
    """After the last restart: the acknowledged calls missing from the exports, and what the
    restarted server counts as dropped."""
    missing, listed, findings, exported = 0, 0, 0, 0
    examples: list[str] = []
    async with http_client() as client:
        for session in sessions:
            base = f"{url}/sessions/{session.session_id}"
            doc = await _get(client, f"{base}/export?messages=1&discarded=1", session.key)
            recorded = {
                (json.dumps(t["request_messages"]), _message(t["response_message"]))
                for t in doc["turns"]
            }
            exported += len(doc["turns"])
            lost = [call for call in session.acked if call not in recorded]
            missing += len(lost)
            examples += [f"{session.session_id}: {json.loads(r)[-1]['content']}" for r, _ in lost]
            info = await _get(client, base, session.key)
            listed += info["dropped"]
            findings += sum("dropped_turns" in f for f in doc["validation"])
        health = await _get(client, f"{url}/health")
    return {
        "exported_turns": exported,
        "missing": missing,
        "missing_examples": examples[:10],
        "health_dropped": health["dropped"],
        "sessions_dropped": listed,
        "exports_with_dropped_finding": findings,
    }


def run(ack: str, plane: str, restarts: int, n_sessions: int, stub: str, seed: int) -> dict:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        args = ["-m", "rollout_store.cli", "serve", "--upstream", stub, "--port", "0"]
        args += ["--data", str(Path(tmp) / "data"), "--fsync", "turn", "--ack", ack]
        args += ["--data-plane", plane]
        server = Child(args, malloc=False)
        flight = Flight()
        try:
            sessions = []
            for i in range(n_sessions):
                made = asyncio.run(_made(server.url, f"kill-{i}"))
                sessions.append(Session(i, made["session_id"], made["api_key"]))
            start = time.perf_counter()
            for r in range(restarts):
                asyncio.run(_round(server, sessions, flight, rng.uniform(*KILL_AFTER_S)))
                server = Child(args, malloc=False)
                print(
                    f"{ack}/{plane} kill {r + 1}: {flight.at_kills[-1]} calls in flight, "
                    f"{sum(len(s.acked) for s in sessions)} acknowledged so far ({load()})",
                    file=sys.stderr,
                    flush=True,
                )
            seconds = time.perf_counter() - start
            found = asyncio.run(_check(server.url, sessions))
        finally:
            server.stop()
    return {
        "ack": ack,
        "plane": plane,
        "restarts": restarts,
        "sessions": n_sessions,
        "seed": seed,
        "seconds": round(seconds, 1),
        "acknowledged": sum(len(s.acked) for s in sessions),
        "in_flight_at_kills": flight.at_kills,
        "unacknowledged": flight.cut,
        "failed_not_200": flight.failed,
        **found,
    }


async def _made(url: str, session_id: str) -> dict[str, Any]:
    async with http_client() as client:
        _, made = await post_json(
            client, f"{url}/sessions", json.dumps({"session_id": session_id}).encode(), JSON
        )
    answer: dict[str, Any] = json.loads(made)
    return answer


def _lines(row: dict[str, Any]) -> list[str]:
    name = f"{row['plane']} plane, --ack {row['ack']}"
    counted = row["health_dropped"]
    if row["ack"] == "durable":
        ok = row["missing"] == 0
        text = (
            f"{name}: 0 acknowledged turns lost over {row['restarts']} kill -9 restarts: "
            f"{row['missing']} lost of {row['acknowledged']}"
        )
        if not ok:
            text += (
                f" (reproduce: python benchmarks/kill_restarts.py --acks durable --planes "
                f"{row['plane']} --restarts {row['restarts']} --sessions {row['sessions']} "
                f"--seed {row['seed']}; lost: {row['missing_examples']})"
            )
    else:
        ok = min(counted, row["sessions_dropped"]) >= row["missing"]
        text = (
            f"{name}: every acknowledged turn lost over {row['restarts']} kill -9 restarts is "
            f"counted: {row['missing']} lost of {row['acknowledged']}, {counted} counted "
            f"by the restarted server's /health, {row['sessions_dropped']} by its sessions' "
            f"info, {row['exports_with_dropped_finding']} export(s) with a dropped_turns "
            f"finding"
        )
        if row["missing"] == 0:
            text += " (none lost in this run: nothing to count)"
    return [f"{'PASS' if ok else 'MISS'}: {text}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=20)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--planes", default="python,rust", help="python, rust or both")
    parser.add_argument("--acks", default="durable,fast", help="durable, fast or both")
    parser.add_argument("--seed", type=int, default=27, help="of the moments of the kills")
    add_results_option(parser)
    args = parser.parse_args(argv)
    rows = []
    stub = start_stub("--latency-ms", "20", "--jitter", "0.5")
    try:
        for ack in args.acks.split(","):
            for plane in args.planes.split(","):
                rows.append(run(ack, plane, args.restarts, args.sessions, stub.url, args.seed))
    finally:
        stub.stop()
    print(
        f"\nkill -9 restarts: {args.restarts} a configuration, {args.sessions} sessions calling "
        f"in a loop, stub 10-30 ms, --fsync turn, {os.cpu_count()} CPUs, {load()}"
    )
    print(
        f"{'plane':<8}{'ack':<9}{'acked':>7}{'unacked':>9}{'in flight at kill':>19}"
        f"{'lost':>6}{'counted health/info/export':>28}{'seconds':>9}"
    )
    lines = []
    for row in rows:
        flying = row["in_flight_at_kills"]
        counted = "/".join(
            str(row[k])
            for k in ("health_dropped", "sessions_dropped", "exports_with_dropped_finding")
        )
        print(
            f"{row['plane']:<8}{row['ack']:<9}{row['acknowledged']:>7}{row['unacknowledged']:>9}"
            f"{f'{min(flying)}-{max(flying)}':>19}{row['missing']:>6}{counted:>28}"
            f"{row['seconds']:>9}"
        )
        lines += _lines(row)
    print("\n".join(lines))
    result = {"commit": library_commit(), "cpus": os.cpu_count(), "rows": rows, "lines": lines}
    path = results_dir(args.update_results) / "kill_restarts.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(targets_summary(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

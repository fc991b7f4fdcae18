"""A GRPO group over one shared content store: memory, store objects and add_turn time.

The workload: 16 rollouts x 20 turns of one task. Every rollout's first requests carry the same
12 KiB system prompt, the same 20-tool list and the same first user message (a task text and
one 200 KiB base64 image); then the conversations diverge (each turn a tool call and a tool
output of 1-4 KiB). Turns arrive interleaved, as a capture server serving the group sees them,
each body decoded from its own JSON text. `--tokens` adds token ids (a shared 6,000-token
prompt prefix, then diverging tokens) to the memory-store figures.

Measured side by side in one run (retained bytes by tracemalloc, see measure.py):
- 16 private graphs (today), one graph holding all 16, 16 graphs over one MemoryStore, over
  Redis and over S3 with one bounded StringCache: retained bytes / the group's unique content;
- objects in each store vs distinct contents that went there (long strings; the shared tool
  list in the memory store; one record per distinct turn in the out-of-process stores);
- add_turn time of each against 16 private graphs;
- 4 processes x 4 rollouts over one Directory / Redis / S3 store: the image stored once.

Redis and S3: the URLs in ROLLOUT_STORE_REDIS_URL / ROLLOUT_STORE_S3_URL, else this script
starts redis-server and moto_server on free loopback ports and stops them at the end.
Writes out/shared_store.json (results/ with --update-results); ends with PASS/MISS lines for
the targets and a one-line count of targets met and missed.
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from measure import (
    MiB,
    add_results_option,
    library_commit,
    results_dir,
    shown,
    targets_summary,
    traced,
)
from schemes import _import_rollout_store, turn_node
from workloads import UniqueContent, random_text

rs = _import_rollout_store()
from rollout_store.serve.loopback import MotoServer, RedisServer  # noqa: E402 - after the path is set

ROLLOUTS = 16
TURNS = 20
IMAGE_BYTES = 200 * 1024
SYSTEM_PROMPT_CHARS = 12 * 1024
N_TOOLS = 20
SHARED_PREFIX_TOKENS = 6_000
SAMPLED_TOKENS = 100
CACHE_BYTES = 64 * 1024  # the bounded cache of the Redis and S3 runs (shared by 16 graphs)
S3_CREDENTIALS = {
    "aws_access_key_id": "bench",
    "aws_secret_access_key": "bench",
    "region_name": "us-east-1",
}

TIME_ROUNDS = 5
CAPTURE_SESSIONS = 1000
CAPTURE_TURNS = 5

MAX_MEMORY_OVER_UNIQUE = 1.15  # 16 graphs over one MemoryStore, with token ids or without
MAX_REMOTE_OVER_UNIQUE = 0.2
MAX_MEMORY_TIME_RATIO = 1.2


# ------------------------------------------------------------------------------ workload


def group_texts(rollouts: int, turns: int, tokens: bool, seed: int = 7) -> list[list[str]]:
    """texts[r][t]: the JSON body of turn t of rollout r."""
    task = random.Random(seed)
    system = random_text(task, SYSTEM_PROMPT_CHARS)
    image = (
        "data:image/png;base64," + base64.b64encode(task.randbytes(IMAGE_BYTES * 3 // 4)).decode()
    )
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": random_text(task, 200),
                "parameters": {
                    "type": "object",
                    "properties": {
                        f"arg_{j}": {"type": "string", "description": random_text(task, 40)}
                        for j in range(3)
                    },
                    "required": ["arg_0"],
                },
            },
        }
        for i in range(N_TOOLS)
    ]
    first_user = {
        "role": "user",
        "content": [
            {"type": "text", "text": "Solve the task shown. " + random_text(task, 300)},
            {"type": "image_url", "image_url": {"url": image}},
        ],
    }
    prefix_ids = [task.randrange(150_000) for _ in range(SHARED_PREFIX_TOKENS)]
    out: list[list[str]] = []
    for r in range(rollouts):
        rng = random.Random(seed * 1000 + r)
        history: list[Any] = [{"role": "system", "content": system}, first_user]
        prompt_ids = list(prefix_ids)
        texts: list[str] = []
        for t in range(turns):
            call_id = f"call_{r}_{t}_{rng.getrandbits(32):08x}"
            response = {
                "role": "assistant",
                "content": random_text(rng, 200),
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": f"tool_{rng.randrange(N_TOOLS)}",
                            "arguments": json.dumps({"arg_0": random_text(rng, 60)}),
                        },
                    }
                ],
            }
            body: dict[str, Any] = {
                "messages": history,
                "tools": tools,
                "response": response,
                "sampling_params": {"temperature": 1.0, "max_tokens": 1024},
                "model": "bench-model",
                "finish_reason": "tool_calls",
            }
            if tokens:
                sampled = [rng.randrange(150_000) for _ in range(SAMPLED_TOKENS)]
                body["prompt_ids"] = prompt_ids
                body["sampled_ids"] = sampled
                body["sampled_logprobs"] = [-rng.expovariate(2.0) for _ in sampled]
            texts.append(json.dumps(body))
            tool_output = random_text(rng, rng.randrange(1024, 4096))
            history = history + [
                response,
                {"role": "tool", "tool_call_id": call_id, "content": tool_output},
            ]
            if tokens:
                prompt_ids = (
                    prompt_ids
                    + body["sampled_ids"]
                    + [rng.randrange(150_000) for _ in range(len(tool_output) // 4)]
                )
        out.append(texts)
    return out


def interleaved(texts: list[list[str]]) -> Iterator[tuple[int, str]]:
    """(rollout, text) in arrival order: turn t of every rollout, then turn t+1."""
    for t in range(len(texts[0])):
        for r, rollout in enumerate(texts):
            yield r, rollout[t]


def unique_bytes(texts: list[list[str]]) -> int:
    unique = UniqueContent()
    for _, text in interleaved(texts):
        unique.add(json.loads(text))
    return unique.bytes


def long_strings(value: Any, threshold: int = 1024) -> Iterator[str]:
    if isinstance(value, str):
        if len(value) >= threshold:
            yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from long_strings(item, threshold)
    elif isinstance(value, list):
        for item in value:
            yield from long_strings(item, threshold)


def distinct_long_strings(texts: list[list[str]]) -> int:
    seen: set[str] = set()
    for _, text in interleaved(texts):
        body = json.loads(text)
        for key in ("messages", "tools", "response", "sampling_params"):
            seen.update(long_strings(body[key]))
    return len(seen)


def distinct_turn_records(texts: list[list[str]]) -> int:
    """Turn records an out-of-process store gets (see rollout_store.engine.turn_records): one per
    distinct turn, i.e. per distinct (request, response) (each turn of this group packs its
    tail and response to far more than MIN_RECORD_BYTES, and no response holds a long
    string)."""
    seen = set()
    for _, text in interleaved(texts):
        body = json.loads(text)
        seen.add((json.dumps(body["messages"]), json.dumps(body["response"])))
    return len(seen)


def distinct_tool_lists(texts: list[list[str]]) -> int:
    return len({json.dumps(json.loads(t)["tools"]) for _, t in interleaved(texts)} - {"null"})


# ------------------------------------------------------------------------------ configurations

# A configuration makes (graphs for the group, the store or None) when called.
Make = Callable[[int], tuple[list[Any], Any]]


def private(n: int) -> tuple[list[Any], Any]:
    return [rs.RolloutGraph() for _ in range(n)], None


def one_graph(n: int) -> tuple[list[Any], Any]:
    graph = rs.RolloutGraph()
    return [graph] * n, None


def over(make_store: Callable[[], Any], cache_bytes: int | None) -> Make:
    def make(n: int) -> tuple[list[Any], Any]:
        store = make_store()
        cache = rs.StringCache(cache_bytes) if cache_bytes is not None else None
        return [rs.RolloutGraph(store=store, cache=cache) for _ in range(n)], store

    return make


#: Calls made before a baseline, so that what a client loads or caches lazily is there.
WARM_UP_CALLS = 3
WARM_UP_OBJECTS = (
    b"warm-up",
    bytes(200 * 1024),
    *(b"warm-up %d" % i for i in range(WARM_UP_CALLS)),
)
WARM_UP_KEYS = {rs.content_key(data) for data in WARM_UP_OBJECTS}


def warm_up(store: Any) -> None:
    """Every call a graph makes, so what a client loads lazily is loaded already."""
    for data in WARM_UP_OBJECTS:
        store.contains(store.put(data))
        store.put(data)  # present already: the refused put-if-absent
        store.get(rs.content_key(data))


def clear_process_caches() -> None:
    """Empty the caches the whole process shares, whatever the number of graphs, that a
    store client's calls fill: the interpreter's type-attribute cache (up to 4,096 entries,
    each holding an attribute name: botocore looks its handlers up by names it builds per
    call) and `urllib.parse`'s cache of 128 split URLs (botocore's per-request URLs). Done
    at the baseline and before reading what is retained, so neither counts."""
    sys._clear_type_cache()
    urllib.parse.clear_cache()


def steady_baseline(measured: Any, store: Any) -> None:
    """Warm `store`'s client up under tracemalloc, then take the baseline with the process's
    shared caches empty (see clear_process_caches)."""
    if store is not None:
        warm_up(store)
    clear_process_caches()
    measured.rebase()


def retained(
    make: Make, texts: list[list[str]], read_back: bool = False
) -> tuple[int, Any, list[Any]]:
    """Bytes retained by the group's graphs (and an in-process store) after every turn; with
    `read_back`, after each graph's whole export was then made and dropped (what a bounded
    cache holds once reads have filled it)."""
    _, store = make(1)  # imports, connections and clients' models load before the baseline
    if store is not None:
        warm_up(store)
    with traced() as measured:
        steady_baseline(measured, store)
        graphs, store = make(len(texts))
        for r, text in interleaved(texts):
            body = json.loads(text)
            graphs[r].add_turn(turn_node(body, f"rollout-{r}"))
            del body
        if read_back:
            for graph in graphs:
                json.dumps(rs.export_session(graph, include_messages=True))
        clear_process_caches()
    return measured.bytes, store, graphs


def paired_times(configs: dict[str, Make], texts: list[list[str]]) -> dict[str, float]:
    """Best total add_turn seconds of each configuration, the configurations measured in
    turn, round after round, so that a busy machine slows them alike."""
    best = {name: float("inf") for name in configs}
    for _ in range(TIME_ROUNDS):
        for name, make in configs.items():
            best[name] = min(best[name], add_time(make, texts, repeats=1))
    return best


def add_time(make: Make, texts: list[list[str]], repeats: int = 3) -> float:
    """Best of `repeats` total add_turn seconds for the whole group (gc paused)."""
    bodies = [(r, text) for r, text in interleaved(texts)]
    best = float("inf")
    for _ in range(repeats):
        graphs, _store = make(len(texts))
        gc.collect()
        gc.disable()
        total = 0.0
        try:
            for r, text in bodies:
                node = turn_node(json.loads(text), f"rollout-{r}")
                start = time.perf_counter()
                graphs[r].add_turn(node)
                total += time.perf_counter() - start
        finally:
            gc.enable()
        best = min(best, total)
    return best


def capture_server(
    make_store: Callable[[], Any],
    cache_bytes: int | None,
    texts: list[list[str]],
    sessions: int,
    turns: int,
) -> dict[str, Any]:
    """`sessions` graphs over one store and one cache, each recording `turns` turns of a
    rollout of the group (session i records rollout i % 16): bytes retained per session."""
    store = make_store()
    warm_up(store)
    with traced() as measured:
        steady_baseline(measured, store)
        cache = rs.StringCache(cache_bytes) if cache_bytes is not None else None
        graphs = [rs.RolloutGraph(store=store, cache=cache) for _ in range(sessions)]
        for t in range(turns):
            for i, graph in enumerate(graphs):
                graph.add_turn(turn_node(json.loads(texts[i % len(texts)][t]), f"s{i}"))
        clear_process_caches()
    size = measured.bytes
    in_store = getattr(store, "nbytes", 0)
    return {
        "sessions": sessions,
        "turns_each": turns,
        "retained": size,
        "store_bytes_in_process": in_store,
        "cache_bytes": cache.nbytes if cache is not None else 0,
        "per_session_outside_store_and_cache": (size - in_store - (cache.nbytes if cache else 0))
        / sessions,
    }


# ------------------------------------------------------------------------------ services


@contextmanager
def service(env: str, make: Callable[[], Any]) -> Iterator[str | None]:
    """The service URL from `env`, or that of a loopback server started here (None when it
    cannot start: its figures are skipped)."""
    url = os.environ.get(env)
    if url:
        yield url
        return
    server = make()
    try:
        server.start()
    except rs.StoreUnavailableError as exc:
        print(f"{exc}: its figures are skipped", file=sys.stderr)
        yield None
        return
    try:
        yield server.url
    finally:
        server.stop()


def open_store(spec: list[Any]) -> Any:
    kind = spec[0]
    if kind == "directory":
        return rs.DirectoryStore(spec[1])
    if kind == "redis":
        return rs.RedisStore(spec[1], prefix=spec[2])
    return rs.S3Store(spec[2], endpoint_url=spec[1], prefix=spec[3], **S3_CREDENTIALS)


def worker(spec: list[Any], first: int, count: int, tokens: bool) -> None:
    """One of the 4 processes: record rollouts first..first+count-1 of the group."""
    texts = group_texts(first + count, TURNS, tokens)[first:]
    store = open_store(spec)
    graphs = [rs.RolloutGraph(store=store) for _ in texts]
    for r, text in interleaved(texts):
        graphs[r].add_turn(turn_node(json.loads(text), f"rollout-{first + r}"))


def four_processes(spec: list[Any], store: Any, texts: list[list[str]]) -> dict[str, Any]:
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps(spec), str(4 * i), "4"],
        )
        for i in range(4)
    ]
    codes = [p.wait(timeout=600) for p in procs]
    image_key = rs.content_key(
        json.loads(texts[0][0])["messages"][1]["content"][1]["image_url"]["url"].encode()
    )
    keys = set(store.keys())
    return {
        "exit_codes": codes,
        "objects": len(keys),
        "distinct_contents": distinct_long_strings(texts) + distinct_turn_records(texts),
        "image_stored_once": image_key in keys,
    }


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rollouts", type=int, default=ROLLOUTS)
    parser.add_argument("--turns", type=int, default=TURNS)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    add_results_option(parser)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker[0]), int(args.worker[1]), int(args.worker[2]), False)
        return 0

    results: dict[str, Any] = {
        "commit": library_commit(),
        "rollouts": args.rollouts,
        "turns": args.turns,
    }
    texts = group_texts(args.rollouts, args.turns, tokens=False)
    token_texts = group_texts(args.rollouts, args.turns, tokens=True)
    unique = unique_bytes(texts)
    unique_tokens = unique_bytes(token_texts)
    distinct = distinct_long_strings(texts)
    results.update(
        unique_bytes=unique, unique_bytes_tokens=unique_tokens, distinct_long_strings=distinct
    )
    print(
        f"group: {args.rollouts} rollouts x {args.turns} turns; unique content "
        f"{unique / MiB:.2f} MiB (with tokens {unique_tokens / MiB:.2f} MiB); "
        f"{distinct} distinct long strings"
    )

    rows: dict[str, dict[str, Any]] = {}
    lines: list[str] = []
    with ExitStack() as stack:
        redis_url = stack.enter_context(service("ROLLOUT_STORE_REDIS_URL", RedisServer))
        s3_url = stack.enter_context(service("ROLLOUT_STORE_S3_URL", MotoServer))
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        if s3_url:
            rs.S3Store(bucket, endpoint_url=s3_url, create_bucket=True, **S3_CREDENTIALS)
        configs: dict[str, Make] = {
            "16 private graphs": private,
            "one graph for all 16": one_graph,
            "16 graphs over one MemoryStore": over(rs.MemoryStore, None),
        }
        # one client per process, made before any baseline (a boto3 client alone holds about
        # half a MiB of models and hooks); each configuration run gets a fresh key prefix
        if redis_url:
            redis_client = rs.RedisStore(redis_url).client
            configs[f"16 graphs over Redis, {CACHE_BYTES // 1024} KiB cache"] = over(
                lambda: rs.RedisStore(
                    redis_url, client=redis_client, prefix=f"bench-{uuid.uuid4().hex}:"
                ),
                CACHE_BYTES,
            )
        if s3_url:
            s3_client = rs.S3Store(bucket, endpoint_url=s3_url, **S3_CREDENTIALS).client
            configs[f"16 graphs over S3, {CACHE_BYTES // 1024} KiB cache"] = over(
                lambda: rs.S3Store(
                    bucket,
                    endpoint_url=s3_url,
                    client=s3_client,
                    prefix=f"{uuid.uuid4().hex}/",
                ),
                CACHE_BYTES,
            )
        times = paired_times(configs, texts)
        private_time = times["16 private graphs"]
        for name, make in configs.items():
            size, store, graphs = retained(make, texts)
            row: dict[str, Any] = {"retained": size, "over_unique": size / unique}
            if store is not None:
                row["objects"] = len(set(store.keys()) - WARM_UP_KEYS)
                # the memory store also holds each distinct large plain value (the tool list);
                # out-of-process stores hold each distinct turn record
                row["distinct_contents"] = distinct + (
                    distinct_tool_lists(texts)
                    if isinstance(store, rs.MemoryStore)
                    else distinct_turn_records(texts)
                )
                row["blob_references"] = sum(g.stats()["blobs"] for g in graphs)
            del graphs, store
            if "cache" in name:  # for context, not a target: the cache filled by reads
                row["after_read_back"] = retained(make, texts, read_back=True)[0] / unique
            seconds = times[name]
            row["add_turn_seconds"] = seconds
            row["time_vs_private"] = seconds / private_time
            rows[name] = row
            objects = (
                f"  objects {row['objects']} / distinct {row['distinct_contents']}"
                if "objects" in row
                else ""
            )
            print(
                f"{name:42} retained {size / MiB:7.2f} MiB = {size / unique:5.2f}x unique   "
                f"add_turn {seconds * 1000:7.1f} ms = {seconds / private_time:5.2f}x private"
                + objects
            )
            if "after_read_back" in row:
                print(
                    f"{'':42} after every graph's export was read back: "
                    f"{row['after_read_back']:5.2f}x unique (the cache then full; not a target)"
                )
        token_configs = {
            "16 private graphs": private,
            "16 graphs over one MemoryStore": over(rs.MemoryStore, None),
        }
        token_times = paired_times(token_configs, token_texts)
        for name, make in token_configs.items():
            size, _, _ = retained(make, token_texts)
            rows[name]["tokens_retained"] = size
            rows[name]["tokens_over_unique"] = size / unique_tokens
            rows[name]["tokens_add_turn_seconds"] = token_times[name]
            print(
                f"{name + ' (token ids)':42} retained {size / MiB:7.2f} MiB = "
                f"{size / unique_tokens:5.2f}x unique"
            )
        results["configurations"] = rows

        server: dict[str, Any] = {}
        targets: dict[str, tuple[Callable[[], Any], int | None]] = {
            "memory": (rs.MemoryStore, None)
        }
        if redis_url:
            targets["redis"] = (
                lambda: rs.RedisStore(redis_url, prefix=f"bench-cs-{uuid.uuid4().hex}:"),
                8 * MiB,
            )
        for kind, (make_store, cache_bytes) in targets.items():
            server[kind] = out = capture_server(
                make_store, cache_bytes, texts, CAPTURE_SESSIONS, CAPTURE_TURNS
            )
            print(
                f"capture server, {CAPTURE_SESSIONS} sessions x {CAPTURE_TURNS} turns over one "
                f"{kind} store: retained {out['retained'] / MiB:.1f} MiB (store in process "
                f"{out['store_bytes_in_process'] / MiB:.1f} MiB, cache "
                f"{out['cache_bytes'] / MiB:.1f} MiB), "
                f"{out['per_session_outside_store_and_cache'] / 1024:.1f} KiB per session besides"
            )
        results["capture_server"] = server

        shared: dict[str, Any] = {}
        folder = stack.enter_context(tempfile.TemporaryDirectory())
        specs: list[tuple[str, list[Any]]] = [("directory", ["directory", folder])]
        if redis_url:
            specs.append(("redis", ["redis", redis_url, f"bench-mp-{uuid.uuid4().hex}:"]))
        if s3_url:
            specs.append(("s3", ["s3", s3_url, bucket, f"mp-{uuid.uuid4().hex}/"]))
        for kind, spec in specs:
            shared[kind] = outcome = four_processes(spec, open_store(spec), texts)
            print(
                f"4 processes x 4 rollouts over one {kind} store: {outcome['objects']} objects for "
                f"{outcome['distinct_contents']} distinct contents, image stored once: "
                f"{outcome['image_stored_once']}, exit codes {outcome['exit_codes']}"
            )
        results["four_processes"] = shared

    memory = rows["16 graphs over one MemoryStore"]
    lines.append(
        _verdict(
            memory["over_unique"] <= MAX_MEMORY_OVER_UNIQUE,
            f"16 graphs over one MemoryStore retain {memory['over_unique']:.2f}x unique "
            f"(target <= {MAX_MEMORY_OVER_UNIQUE})",
        )
    )
    lines.append(
        _verdict(
            memory["time_vs_private"] <= MAX_MEMORY_TIME_RATIO,
            f"add_turn over MemoryStore {memory['time_vs_private']:.2f}x a private store "
            f"(target <= {MAX_MEMORY_TIME_RATIO})",
        )
    )
    memory_tokens = memory["tokens_over_unique"]
    tokens_time = (
        memory["tokens_add_turn_seconds"] / rows["16 private graphs"]["tokens_add_turn_seconds"]
    )
    lines.append(
        _verdict(
            memory_tokens <= MAX_MEMORY_OVER_UNIQUE,
            f"with token ids, 16 graphs over one MemoryStore retain {memory_tokens:.2f}x unique "
            f"(target <= {MAX_MEMORY_OVER_UNIQUE}); add_turn "
            f"{tokens_time:.2f}x a private store",
        )
    )
    for name, row in rows.items():
        if "cache" in name:
            lines.append(
                _verdict(
                    row["over_unique"] < MAX_REMOTE_OVER_UNIQUE,
                    f"{name}: process memory {row['over_unique']:.2f}x unique "
                    f"(target < {MAX_REMOTE_OVER_UNIQUE}); add_turn "
                    f"{row['time_vs_private']:.2f}x private",
                )
            )
        if "objects" in row:
            lines.append(
                _verdict(
                    row["objects"] == row["distinct_contents"],
                    f"{name}: {row['objects']} objects for {row['distinct_contents']} "
                    "distinct contents",
                )
            )
    for kind, outcome in shared.items():
        ok = (
            outcome["image_stored_once"]
            and outcome["objects"] == outcome["distinct_contents"]
            and not any(outcome["exit_codes"])
        )
        lines.append(_verdict(ok, f"4 processes over one {kind} store: every content stored once"))
    results["verdicts"] = lines
    path = results_dir(args.update_results) / "shared_store.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(lines))
    print(f"wrote {shown(path)}")
    print(targets_summary(lines))
    return 0


def _verdict(ok: bool, text: str) -> str:
    return ("PASS " if ok else "MISS ") + text


if __name__ == "__main__":
    sys.exit(main())

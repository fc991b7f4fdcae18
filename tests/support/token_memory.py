"""Run by test_token_packing.py in a child process: what a graph keeps per token turn.

    python tests/token_memory.py TURNS

Records a linear rollout of TURNS token turns (each: 8 new prompt ids, 16 sampled ids with
their logprobs, a short message and response) into one graph and prints JSON
{"per_turn": bytes, "content": bytes}: what the graph retains (tracemalloc) per turn beyond
its first, and the turn's token content at 4 bytes an id and 8 a logprob. Each node is made
and dropped inside the loop, as the server drops it, so only what the graph keeps counts.
"""

from __future__ import annotations

import gc
import json
import sys
import tracemalloc

from rollout_store import RawJSON, RolloutGraph, TurnNode

N_NEW, N_SAMPLED = 8, 16


def record(graph: RolloutGraph, turns: int) -> None:
    prompt = list(range(1000, 1064))  # a root prompt of one block
    messages: list[dict[str, str]] = [{"role": "user", "content": "go"}]
    for k in range(turns):
        sampled = [5000 + 17 * k + i for i in range(N_SAMPLED)]
        response = {"role": "assistant", "content": f"step {k}"}
        graph.add_turn(
            TurnNode(
                prompt_ids=RawJSON(json.dumps(prompt).encode()),
                sampled_ids=RawJSON(json.dumps(sampled).encode()),
                sampled_logprobs=[-0.5 - i / 64 - k for i in range(N_SAMPLED)],
                request_messages=RawJSON(json.dumps(messages).encode()),
                response_message=response,
            )
        )
        messages = [*messages, response, {"role": "user", "content": f"next {k}"}]
        prompt = prompt + sampled + [9000 + 11 * k + i for i in range(N_NEW)]


def main() -> None:
    turns = int(sys.argv[1])
    warm = RolloutGraph()
    record(warm, 2)  # first-use allocations (caches, interned names) happen here
    warm.close()
    del warm
    gc.collect()
    tracemalloc.start()
    graph = RolloutGraph()
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    record(graph, turns)
    gc.collect()
    retained = tracemalloc.get_traced_memory()[0] - before
    assert len(graph) == turns and graph.sequences()[0].input_ids  # alive, and whole
    content = (N_NEW + N_SAMPLED) * 4 + N_SAMPLED * 8
    print(json.dumps({"per_turn": retained / turns, "content": content}))


if __name__ == "__main__":
    main()

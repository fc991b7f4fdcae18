"""Random plans of turns for linking tests: groups of rollouts sampled from one request (8 to
40 samples, duplicate responses among them), continued by exact or loose echoes or by their
tokens, retried, and added out of order (late ancestors), with long strings, lone surrogates,
NaN and big ints in the responses. Public API only, so that the same plan can be run by
another version of the library and the outcomes compared."""

from __future__ import annotations

import json
import math
import random
from typing import Any

__all__ = ["add_plan", "make_plan", "outcome"]


def _response(rng: random.Random, k: int) -> dict[str, Any]:
    """A response from a small pool (`k` picks it): duplicates are common."""
    kind = k % 7
    text = f"answer {k}"
    if kind == 1:
        text = f"long {k} " + "x" * 1100  # a blob reference in the stored response
    elif kind == 2:
        text = f"surrogate {k} \ud800 end"
    elif kind == 6:
        text = f"medium {k} " + "m" * 300  # a record kept in a store (no blob in it)
    response: dict[str, Any] = {"role": "assistant", "content": text}
    if kind == 3:
        response["score"] = math.nan
    elif kind == 4:
        response["big"] = 2**70 + k
    elif kind == 5:
        call = {"name": "run", "arguments": json.dumps({"k": k})}
        response["tool_calls"] = [{"id": f"c{k}", "type": "function", "function": call}]
    if rng.random() < 0.3:
        del response["role"]  # an echo names it: a loose echo
    return response


def _echo(rng: random.Random, response: dict[str, Any]) -> dict[str, Any]:
    """The harness sending `response` back: exactly, or loosely (role added, keys reordered,
    content as text parts, arguments re-serialized), or not at all (another message)."""
    roll = rng.random()
    echo = dict(response)
    if roll < 0.45 and "role" in echo:
        return echo
    echo = {"role": "assistant", **{k: v for k, v in response.items() if k != "role"}}
    if roll < 0.6:
        return echo
    if roll < 0.7:
        return dict(reversed(list(echo.items())))
    if roll < 0.8 and isinstance(echo.get("content"), str):
        echo["content"] = [{"type": "text", "text": echo["content"]}]
        return echo
    if roll < 0.88 and "tool_calls" in echo:
        calls = []
        for call in echo["tool_calls"]:
            function = dict(call["function"])
            function["arguments"] = json.dumps(json.loads(function["arguments"]), indent=1)
            calls.append({**call, "function": function})
        echo["tool_calls"] = calls
        return echo
    if roll < 0.94:
        return echo
    return {"role": "assistant", "content": "something else"}


def make_plan(seed: int) -> list[dict[str, Any]]:
    """Turns (as TurnNode keyword arguments, with JSON-able values only, and `raw`: whether
    to send the request as JSON text) in arrival order."""
    rng = random.Random(seed)
    logical: list[dict[str, Any]] = []  # in generation order: parents before children
    n_tasks = rng.randint(1, 3)
    for t in range(n_tasks):
        tokens = rng.random() < 0.5
        system = [{"role": "system", "content": "You are terse."}] if rng.random() < 0.4 else []
        root_request = [*system, {"role": "user", "content": f"task {t} of {seed}"}]
        root_prompt = [rng.randrange(1000) for _ in range(rng.randint(3, 12))]
        pool = rng.randint(1, 12)
        samples = rng.randint(8, 40)
        token_pool = [[rng.randrange(1000) for _ in range(rng.randint(1, 4))] for _ in range(pool)]
        frontier: list[dict[str, Any]] = []
        for _ in range(samples):
            k = rng.randrange(pool)
            turn: dict[str, Any] = {
                "request_messages": root_request,
                "response_message": _response(rng, k + 100 * t),
            }
            if tokens:
                sampled = list(token_pool[k]) if rng.random() < 0.9 else []  # failed call
                turn["prompt_ids"] = root_prompt
                turn["sampled_ids"] = sampled
            logical.append(turn)
            frontier.append(turn)
        # continuations, a few levels deep, some retried (twins of one request)
        for depth in range(rng.randint(1, 3)):
            nxt = []
            for i, parent in enumerate(frontier):
                # (the last sample is continued when no other was: a task with no link
                # would check nothing; the draw is made all the same, so that every other
                # plan stays as it was)
                if rng.random() < 0.5 and (depth or nxt or i < len(frontier) - 1):
                    continue
                for _ in range(rng.choice((1, 1, 1, 2, 3))):
                    request = [
                        *parent["request_messages"],
                        _echo(rng, parent["response_message"]),
                        {"role": "user", "content": rng.choice(("go", "more", "again"))},
                    ]
                    k = rng.randrange(pool)
                    child: dict[str, Any] = {
                        "request_messages": request,
                        "response_message": _response(rng, k + 100 * t + 50),
                    }
                    if tokens and "prompt_ids" in parent:
                        prompt = [*parent["prompt_ids"], *parent["sampled_ids"], 7, 8]
                        if rng.random() < 0.1:
                            prompt = [*prompt[:-3], 9, 9]  # tokens that continue nothing
                        child["prompt_ids"] = prompt
                        child["sampled_ids"] = list(token_pool[k]) if rng.random() < 0.9 else []
                    logical.append(child)
                    nxt.append(child)
            frontier = nxt
    # arrival order: generation order jittered by a window, so descendants often come first
    raw = rng.choice((0.0, 0.0, 0.5, 1.0))  # requests sent as JSON text (the raw path)
    for turn in logical:
        turn["raw"] = rng.random() < raw
    window = rng.choice((0, 3, 20, 200))
    order = sorted(range(len(logical)), key=lambda i: i + rng.uniform(0, window))
    return [logical[i] for i in order]


def add_plan(graph: Any, plan: list[dict[str, Any]], node_type: Any, raw_type: Any) -> list[str]:
    """Add the plan's turns (fresh copies; `raw_type`: RawJSON); the errors met, by
    position."""
    errors = []
    for i, fields in enumerate(plan):
        copy = {k: _copy(v) for k, v in fields.items() if k != "raw"}
        if fields.get("raw"):
            copy["request_messages"] = raw_type(json.dumps(copy["request_messages"]).encode())
        try:
            graph.add_turn(node_type(**copy))
        except Exception as error:  # the same in both versions, or a difference
            errors.append(f"{i}: {type(error).__name__}")
    return errors


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def outcome(graph: Any) -> dict[str, Any]:
    """What linking decided, and what the graph gives back, as JSON-able values."""
    ids = graph.node_ids()
    return {
        "parents": [graph.parent(i) for i in ids],
        "links": [graph.link_kind(i) for i in ids],
        "content": json.dumps(
            [[graph.request_messages(i), graph.response_message(i)] for i in ids]
        ),
    }

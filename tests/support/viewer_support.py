"""Rollouts for the viewer tests: OpenAI- and Anthropic-shaped messages with images, tool
calls, a fork, a discarded retry and a message holding a script tag."""

from __future__ import annotations

import base64
import json
import random
import struct
import zlib
from typing import Any

from rollout_store import RolloutGraph, TurnNode

SCRIPT_TEXT = "<script>window.__pwned = 1</script><img src=x onerror=window.__pwned=2> & <b>"


def png(width: int, height: int, rgb: tuple[int, int, int], noise: bool = False) -> bytes:
    """A valid PNG of one colour, or of seeded noise (which does not compress)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    if noise:
        rng = random.Random(bytes(rgb))
        pixels = b"".join(b"\0" + rng.randbytes(3 * width) for _ in range(height))
    else:
        pixels = (b"\0" + bytes(rgb) * width) * height
    raw = zlib.compress(pixels)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", raw) + chunk(b"IEND", b"")


def data_url(k: int, size: int = 24, noise: bool = False) -> str:
    image = png(size, size, (k * 37 % 256, k * 91 % 256, 200), noise)
    return "data:image/png;base64," + base64.b64encode(image).decode("ascii")


def small_rollout() -> RolloutGraph:
    """Six turns: a chain with an image, a tool call and an Anthropic image; a discarded
    retry; a root with Responses, Google and Anthropic tool shapes; and a root whose user
    message is a script tag."""
    graph = RolloutGraph()
    system = {"role": "system", "content": "You are a browser agent. " * 60}
    tools = [{"type": "function", "function": {"name": "click", "parameters": {}}}]
    messages: list[Any] = [
        system,
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is on the screen?"},
                {"type": "image_url", "image_url": {"url": data_url(1)}},
            ],
        },
    ]
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "click", "arguments": json.dumps({"x": 10, "y": 20})},
            }
        ],
    }
    graph.add_turn(
        TurnNode(
            request_messages=list(messages),
            request_tools=tools,
            response_message=call,
            prompt_ids=list(range(40)),
            sampled_ids=[7, 8, 9],
            sampled_logprobs=[-0.1, -0.2, -0.3],
            model="m",
            node_id="t0",
        )
    )
    messages += [
        call,
        {"role": "tool", "tool_call_id": "call_1", "content": "clicked"},
        {
            "role": "user",
            "content": [
                {
                    "type": "image",
                    "source": {
                        "type": "base64",
                        "media_type": "image/png",
                        "data": data_url(2).split(",", 1)[1],
                    },
                }
            ],
        },
    ]
    prompt = list(range(40)) + [7, 8, 9] + list(range(100, 120))
    for node_id, answer in (("t1", "The page shows a form."), ("t2", "retry that was dropped")):
        graph.add_turn(
            TurnNode(
                request_messages=list(messages),
                request_tools=tools,
                response_message={"role": "assistant", "content": answer},
                prompt_ids=prompt,
                sampled_ids=[5, 6],
                sampled_logprobs=[-0.5, -0.6],
                model="m",
                node_id=node_id,
            )
        )
    messages.append({"role": "assistant", "content": "The page shows a form."})
    messages.append({"role": "user", "content": "Thanks"})
    graph.add_turn(
        TurnNode(
            request_messages=list(messages),
            request_tools=tools,
            response_message={"role": "assistant", "content": "Done."},
            prompt_ids=prompt + [5, 6] + [200, 201],
            sampled_ids=[1],
            sampled_logprobs=[-0.9],
            model="m",
            node_id="t3",
        )
    )
    b64 = data_url(3).split(",", 1)[1]
    graph.add_turn(
        TurnNode(
            request_messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Responses API image:"},
                        {"type": "input_image", "image_url": data_url(4)},
                        {"inline_data": {"mime_type": "image/png", "data": b64}},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "tu_1", "name": "scroll", "input": {"dy": 300}}
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "tu_1", "content": "scrolled"}
                    ],
                },
            ],
            response_message={"role": "assistant", "content": "ok"},
            model="m",
            node_id="shapes",
        )
    )
    graph.add_turn(
        TurnNode(
            request_messages=[{"role": "user", "content": SCRIPT_TEXT}],
            response_message={"role": "assistant", "content": SCRIPT_TEXT},
            model="m",
            node_id="evil",
        )
    )
    return graph


def long_rollout(n_turns: int, image_every: int = 10, image_size: int = 24) -> RolloutGraph:
    """One chain of `n_turns` message-linked turns; every `image_every`-th user message
    carries a new image (`image_size` pixels square; above 24, noise that does not
    compress), so the last request holds about 2 * n_turns messages."""
    graph = RolloutGraph()
    messages: list[Any] = [{"role": "system", "content": "system prompt " * 100}]
    for k in range(n_turns):
        content: Any = f"step {k}: go on"
        if k % image_every == 0:
            content = [
                {"type": "text", "text": f"step {k}: screenshot"},
                {
                    "type": "image_url",
                    "image_url": {"url": data_url(k, image_size, image_size > 24)},
                },
            ]
        messages.append({"role": "user", "content": content})
        response = {"role": "assistant", "content": f"answer {k}"}
        graph.add_turn(TurnNode(request_messages=list(messages), response_message=response))
        messages.append(response)
    return graph

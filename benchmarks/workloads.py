"""Deterministic synthetic agent rollouts for the benchmarks, and the unique content they hold.

Each workload yields one request body per turn; turn k re-sends the whole conversation so far.
"""

from __future__ import annotations

import base64
import bisect
import json
import random
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator

IMAGE_URL_PREFIX = "data:image/png;base64,"
IMAGE_URL_LEN = 64 * 1024
TOOL_OUTPUT_LEN = 8 * 1024
CHATTY_MESSAGE_LEN = 200
CHATTY_NEW_PER_TURN = 4
NEW_PROMPT_TOKENS = 2_000
SAMPLED_TOKENS = 300
MAX_TOKEN_ID = 150_000
SEED_TURNS = 12

MODEL = "synthetic-model"
SAMPLING_PARAMS = {"temperature": 0.7, "top_p": 0.95, "max_tokens": 1024}
SYSTEM_PROMPT = "You are a careful agent. Think step by step and use the tools when useful."

_WORD_TEXT = (
    "agent alpha branch buffer cache commit delta error file fix graph index kernel layer "
    "memory merge node output parser patch query reply result screen search shell state "
    "stream table test token trace tree update value vector window worker"
)
_WORDS = tuple(_WORD_TEXT.split())

Body = dict
Generator = Callable[[int, int], Iterator[Body]]


# --- small random content -------------------------------------------------------------------


def random_text(rng: random.Random, length: int) -> str:
    """Random words, cut to exactly `length` characters."""
    out: list[str] = []
    size = 0
    while size < length:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:length]


def _image_url(rng: random.Random) -> str:
    """A 64 KiB PNG data URL of random base64 text (incompressible, distinct per call)."""
    payload = base64.b64encode(rng.randbytes(IMAGE_URL_LEN * 3 // 4)).decode("ascii")
    return IMAGE_URL_PREFIX + payload[: IMAGE_URL_LEN - len(IMAGE_URL_PREFIX)]


def _token_ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(MAX_TOKEN_ID) for _ in range(count)]


def _logprobs(rng: random.Random, count: int) -> list[float]:
    return [-rng.expovariate(2.0) for _ in range(count)]


def _body(messages: list, response: dict, tools: list | None = None, **tokens) -> Body:
    return {
        "messages": list(messages),
        "tools": tools,
        "response": response,
        "sampling_params": dict(SAMPLING_PARAMS),
        "prompt_ids": tokens.get("prompt_ids"),
        "sampled_ids": tokens.get("sampled_ids"),
        "sampled_logprobs": tokens.get("sampled_logprobs"),
        "model": MODEL,
        "finish_reason": tokens.get("finish_reason", "stop"),
    }


# --- workloads ------------------------------------------------------------------------------
# Every generator draws the same random numbers for turn k whatever n_turns is, so the first n
# turns of a longer run equal an n-turn run (memory_per_turn.py relies on this).


def _image_conversation(n_turns: int, seed: int, system: bool) -> Iterator[Body]:
    rng = random.Random(seed)
    history: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}] if system else []
    for turn in range(n_turns):
        history.append(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"Step {turn}: " + random_text(rng, 80)},
                    {"type": "image_url", "image_url": {"url": _image_url(rng)}},
                ],
            }
        )
        response = {"role": "assistant", "content": random_text(rng, 120)}
        yield _body(history, response)
        history.append(response)


def multimodal(n_turns: int, seed: int = 1) -> Iterator[Body]:
    """One new 64 KiB screenshot per turn, short text, short replies; no token ids."""
    return _image_conversation(n_turns, seed, system=True)


def seed_workload(n_turns: int = SEED_TURNS, seed: int = 12) -> Iterator[Body]:
    """Turn k re-sends k+1 user messages, each with its own distinct 64 KiB image."""
    return _image_conversation(n_turns, seed, system=False)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    arg: {"type": "string", "description": f"The {arg}."} for arg in args
                },
                "required": list(args),
            },
        },
    }
    for name, description, args in (
        ("read_file", "Read a file of the repository.", ("path",)),
        ("write_file", "Write a file of the repository.", ("path", "content")),
        ("run_shell", "Run a shell command and return its output.", ("command", "cwd")),
        ("search_code", "Search the repository for a pattern.", ("pattern", "glob")),
        ("open_url", "Fetch a web page as text.", ("url",)),
    )
]


def tool_heavy(n_turns: int, seed: int = 2) -> Iterator[Body]:
    """Each reply is a tool call; each next request adds its 8 KiB result. Tools re-sent."""
    rng = random.Random(seed)
    history: list[dict] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Fix the failing test. " + random_text(rng, 200)},
    ]
    for turn in range(n_turns):
        tool = TOOLS[turn % len(TOOLS)]["function"]
        arguments = {arg: random_text(rng, 40) for arg in tool["parameters"]["required"]}
        call_id = f"call_{turn:05d}_{rng.getrandbits(32):08x}"
        response = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": tool["name"], "arguments": json.dumps(arguments)},
                }
            ],
        }
        yield _body(history, response, tools=TOOLS, finish_reason="tool_calls")
        history.append(response)
        history.append(
            {"role": "tool", "tool_call_id": call_id, "content": random_text(rng, TOOL_OUTPUT_LEN)}
        )


def token_heavy(n_turns: int, seed: int = 3) -> Iterator[Body]:
    """Short messages; 2,000 new prompt tokens and 300 sampled tokens (with logprobs) a turn."""
    rng = random.Random(seed)
    history: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}]
    prompt_ids: list[int] = []
    for _turn in range(n_turns):
        history.append({"role": "user", "content": random_text(rng, 100)})
        prompt_ids = prompt_ids + _token_ids(rng, NEW_PROMPT_TOKENS)
        sampled_ids = _token_ids(rng, SAMPLED_TOKENS)
        response = {"role": "assistant", "content": random_text(rng, 120)}
        yield _body(
            history,
            response,
            prompt_ids=prompt_ids,
            sampled_ids=sampled_ids,
            sampled_logprobs=_logprobs(rng, SAMPLED_TOKENS),
        )
        history.append(response)
        prompt_ids = prompt_ids + sampled_ids


def chatty(n_turns: int, seed: int = 4) -> Iterator[Body]:
    """Many short (~200 character) messages: 4 new user messages a turn, plus the echoed reply."""
    rng = random.Random(seed)
    history: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}]
    for _turn in range(n_turns):
        for _ in range(CHATTY_NEW_PER_TURN):
            history.append({"role": "user", "content": random_text(rng, CHATTY_MESSAGE_LEN)})
        response = {"role": "assistant", "content": random_text(rng, CHATTY_MESSAGE_LEN)}
        yield _body(history, response)
        history.append(response)


WORKLOADS: dict[str, Generator] = {
    "multimodal": multimodal,
    "tool_heavy": tool_heavy,
    "token_heavy": token_heavy,
    "chatty": chatty,
}


def iter_texts(generator: Generator, n_turns: int, seed: int | None = None) -> Iterator[str]:
    """Each turn's body as the JSON text a harness would receive."""
    bodies = generator(n_turns) if seed is None else generator(n_turns, seed)
    for body in bodies:
        yield json.dumps(body)


def iter_bodies(generator: Generator, n_turns: int, seed: int | None = None) -> Iterator[Body]:
    """Each turn's body decoded on its own: nothing is shared between turns by identity."""
    for text in iter_texts(generator, n_turns, seed):
        yield json.loads(text)


# --- unique content -------------------------------------------------------------------------


def _token_key(ids: list[int]) -> bytes:
    """Fixed-width big-endian bytes: byte order equals the order of the id sequences."""
    packed = array("I", ids)
    if sys.byteorder == "little":
        packed.byteswap()
    return packed.tobytes()


def _common_prefix(a: bytes, b: bytes, block: int = 1 << 16) -> int:
    """Length of the longest common prefix of a and b, in bytes."""
    end = min(len(a), len(b))
    lo = 0
    while lo < end and a[lo : lo + block] == b[lo : lo + block]:
        lo += block
    lo, hi = min(lo, end), min(lo + block, end)
    while lo < hi:  # binary search inside the first differing block
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class UniqueContent:
    """Accumulates the unique content of bodies fed one at a time; `.bytes` is the total.

    Messages, tools lists and responses count their UTF-8 `json.dumps` size once per distinct
    text (a response and the same message echoed in the next request count once: both are
    message dicts of equal text). Tokens count 4 bytes per node of the trie of all turns'
    prompt_ids + sampled_ids. The trie is counted exactly: a new sequence adds its length minus
    its longest common prefix with any earlier sequence, and that prefix is found with its two
    neighbours in the sorted list of earlier sequences (the longest common prefix with a set is
    always reached at a neighbour in lexicographic order). Logprobs count 8 bytes per sampled
    token of each turn whose (token sequence, logprobs) is distinct.
    """

    def __init__(self) -> None:
        self._messages: set[str] = set()
        self._tools: set[str] = set()
        self._sequences: list[bytes] = []
        self._logprob_turns: set[tuple[bytes, bytes]] = set()
        self.content_bytes = 0
        self.token_nodes = 0
        self.logprobs = 0

    @property
    def bytes(self) -> int:
        return self.content_bytes + 4 * self.token_nodes + 8 * self.logprobs

    def _count_json(self, seen: set[str], value: object) -> None:
        text = json.dumps(value)
        if text not in seen:
            seen.add(text)
            self.content_bytes += len(text.encode("utf-8"))

    def _count_tokens(self, ids: list[int]) -> bytes:
        key = _token_key(ids)
        pos = bisect.bisect_left(self._sequences, key)
        shared = 0
        for neighbour in self._sequences[max(pos - 1, 0) : pos + 1]:
            shared = max(shared, _common_prefix(key, neighbour) // 4)
        self.token_nodes += len(ids) - shared
        self._sequences.insert(pos, key)
        return key

    def add(self, body: Body) -> None:
        for message in body["messages"]:
            self._count_json(self._messages, message)
        if body.get("tools") is not None:
            self._count_json(self._tools, body["tools"])
        if body.get("response") is not None:
            self._count_json(self._messages, body["response"])
        ids = (body.get("prompt_ids") or []) + (body.get("sampled_ids") or [])
        if ids:
            key = self._count_tokens(ids)
            logprobs = body.get("sampled_logprobs") or []
            lp_key = array("d", logprobs).tobytes()
            if (key, lp_key) not in self._logprob_turns:
                self._logprob_turns.add((key, lp_key))
                self.logprobs += len(body.get("sampled_ids") or [])


def unique_content_bytes(bodies: Iterable[Body]) -> int:
    """Bytes of unique content in `bodies` (see UniqueContent for the definition)."""
    unique = UniqueContent()
    for body in bodies:
        unique.add(body)
    return unique.bytes

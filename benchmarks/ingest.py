"""Ingest cost of rollout_store per turn, as ratios against json.loads of the same body.

Two modes, both measured side by side in one process (every ratio compares two timings taken
one right after the other, so other load on the machine moves both):

* long: chatty and tool_heavy to 2,000 turns, multimodal and token_heavy to 200. At turns 10,
  100, 1,000 and 2,000: add_turn / json.loads of the body, for decoded input (the body
  json.loads-ed, as today) and for raw input (`RawJSON` of the request's messages and tools,
  the rest decoded; `raw str`: the same texts as a str, which the graph reads as their UTF-8
  on the same path), also the cost of splitting the body with msgspec first, as a capture
  server would, and what the engine's request table alone costs on the messages: `table` on
  their text (`RequestTable.add_json`: read from the conversation's raw tip, packed, its base
  found and filed), `table_dec` on the decoded messages after the system ones
  (`RequestTable.add_messages`: packed in one walk from the conversation's decoded tip on,
  its base found and filed); not yet add_turn's path, so figures, not targets. Each figure
  is the median over the 9 turns around the checkpoint.
* soak: 20,000 turns in one graph for each shape that makes index buckets grow (shared
  observation text, one prompt sampled many times with token ids and by messages, short-prompt
  independent calls, groups of 8 rollouts by messages and by tokens, one prompt sampled
  20,000 times whose completions repeat: 1,000 distinct answers, by messages and with token
  ids). Printed: the median add time of the 20 turns around turns 100, 1,000, 5,000 and of
  the last 20; the figure checked: the last over turns 91-110, samples pooled over the builds.

Also retained memory over unique content at 200 turns of every workload (tracemalloc and the
engine's own byte count, as memory_per_turn.py measures it).

Writes out/ingest.json (out/ingest.partial.json for partial runs; results/ with
--update-results); ends with PASS/MISS lines for the targets and a one-line count of targets
met and missed. Never a pass/fail test: a report.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import statistics
import sys
from array import array
from collections.abc import Callable, Iterator
from time import perf_counter
from typing import Any

import blake3
import msgpack
import msgspec
from measure import (
    add_results_option,
    library_commit,
    results_dir,
    retained_bytes,
    shown,
    targets_summary,
)
from schemes import SCHEMES, _import_rollout_store, turn_node
from workloads import SAMPLING_PARAMS, SYSTEM_PROMPT, WORKLOADS, UniqueContent, iter_texts
from workloads import random_text as _text

rs = _import_rollout_store()
from rollout_store.engine.stored import Turn as _Turn  # noqa: E402  (imported once rs is on the path)

LONG_CHECKPOINTS = {
    "chatty": (10, 100, 1000, 2000),
    "tool_heavy": (10, 100, 1000, 2000),
    "multimodal": (10, 100, 200),
    "token_heavy": (10, 100, 200),
}
WINDOW = 4  # turns t-4 .. t+4 are timed around checkpoint t
SOAK_TURNS = 20_000
SOAK_EARLY = range(91, 111)
SOAK_BUILDS = 2

MAX_DECODED_DEEP = 0.5  # turns >= 100, every workload
MAX_DECODED_CHATTY_10 = 1.0
MAX_RAW_DEEP = 0.25
MAX_SOAK = 1.5
# retained / unique content at MEMORY_TURNS turns, by workload (issue 24)
MAX_RETAINED = {"chatty": 1.10, "tool_heavy": 1.05, "multimodal": 1.05, "token_heavy": 1.05}
MEMORY_TURNS = 200


class _Body(msgspec.Struct):
    """How a capture server splits a request body without decoding the conversation."""

    messages: msgspec.Raw
    tools: msgspec.Raw = msgspec.Raw(b"null")


_split_body = msgspec.json.Decoder(_Body).decode


def _decoded_node(body: dict[str, Any]) -> Any:
    return turn_node(body)


def _str(text: bytes | None) -> str | None:
    return None if text is None else text.decode()


def _raw_node(body: dict[str, Any], messages: bytes | str, tools: bytes | str | None) -> Any:
    raw_tools = None if tools is None else rs.RawJSON(tools)
    return turn_node(body, request_messages=rs.RawJSON(messages), request_tools=raw_tools)


class _MessageTexts:
    """json.dumps of a growing conversation, built from each message's text once (the
    workloads re-send the same message objects, so earlier texts stay valid)."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def of(self, messages: list[Any]) -> bytes:
        for message in messages[len(self.texts) :]:
            self.texts.append(json.dumps(message))
        return ("[" + ", ".join(self.texts[: len(messages)]) + "]").encode("utf-8")


def _median_time(fn: Callable[[], Any], repeat: int = 3) -> tuple[Any, float]:
    times, out = [], None
    for _ in range(repeat):
        out = None
        start = perf_counter()
        out = fn()
        times.append(perf_counter() - start)
    return out, statistics.median(times)


# ---------------------------------------------------------------- floors
#
# The least work any implementation must do on a body, measured as C calls on that very body
# (a lower bound, not a target): where it is above a target, no Python-level change can meet
# the target. Each component is necessary, and each is timed alone, without the Python an
# implementation needs around it (building a hollowed copy, finding spans, the strict checks
# of ints and JSON-only values), so the bound is if anything low. Where two schemes can do
# the work, the floor is the cheaper of them on that body.
#
# decoded: every message is visited (a decoded object may differ anywhere), and the fastest
#   exact C visitor is a strict msgpack packing (json.dumps is slower, `==` cannot tell 1,
#   1.0 and True apart). Either the whole packing is hashed by BLAKE3 (packed at once or in
#   chunks of 64 messages, whichever is faster), or the strings the graph keeps as blobs
#   (1,024 characters or more) are compared with `==` with its copies (memcmp, one C call
#   for all) and the rest is packed with a placeholder for each, and hashed. BLAKE3 confirms
#   the re-sent part and keys the request with O(1) memory (no copy of earlier requests).
#   The response and the tools are packed too.
# raw: the re-sent bytes (the previous request's messages text, which the new text extends)
#   are read once: hashed by BLAKE3, or the blob strings' spans compared by memcmp with
#   their UTF-8 (made beforehand, untimed) and the rest hashed. Only the new messages are
#   decoded (msgspec, one call), packed and hashed; the response is packed, the tools text
#   hashed. No split of the whole text into spans: the library confirms by byte offsets.
# kept: as above, but the re-sent part compared by one memcmp with a kept copy of the
#   previous request's text or packing, which costs a copy of every live conversation's
#   last request in memory: below every scheme, as any must read the re-sent part once.
# tokens (both): prompt and sampled ids made compact (array('I'), one C call each; the
#   logprobs array('d')) and the prompt's bytes compared with the parent's tokens (memcmp).
# Plus one stored turn object (the library's own slotted class) appended to a list.

_floor_pack = msgpack.Packer(use_bin_type=True, strict_types=True).pack
_floor_decode = msgspec.json.decode
_floor_turns: list[Any] = []
_BLOB_MIN = 1024  # a RolloutGraph's default share threshold: longer strings are blobs
_HOLE = msgpack.ExtType(1, b"")


def _floor_common(fields: dict[str, Any], parent_tokens: bytes | None) -> None:
    """What both floors do apart from the messages: response, tokens, one turn object."""
    _floor_pack(fields["response"])
    prompt = fields.get("prompt_ids")
    if prompt:
        prompt_bytes = array("I", prompt).tobytes()
        if parent_tokens is not None:
            prompt_bytes.startswith(parent_tokens)
    if fields.get("sampled_ids"):
        array("I", fields["sampled_ids"])
    if fields.get("sampled_logprobs"):
        array("d", fields["sampled_logprobs"])
    _floor_turns.append(_Turn())
    _floor_turns.clear()


def _array_header_size(n: int) -> int:
    return 1 if n < 16 else 3 if n < 1 << 16 else 5


def _items(messages: list[Any]) -> bytes:
    """The packing of `messages` without its array header."""
    return _floor_pack(messages)[_array_header_size(len(messages)) :]


def _tokens_of(body: dict[str, Any]) -> bytes | None:
    ids = (body.get("prompt_ids") or []) + (body.get("sampled_ids") or [])
    return array("I", ids).tobytes() if ids else None


def _hollow(value: Any, strings: list[str]) -> Any:
    """`value` with each blob-long string value replaced by a placeholder (kept in order)."""
    if type(value) is str and len(value) >= _BLOB_MIN:
        strings.append(value)
        return _HOLE
    if type(value) is dict:
        return {k: _hollow(v, strings) for k, v in value.items()}
    if type(value) is list:
        return [_hollow(v, strings) for v in value]
    return value


def _copy(s: str) -> str:
    return (s + ".")[:-1]  # equal, not the same object: `==` compares the characters


def _pack_hash(messages: list[Any], kept: bytes | None) -> None:
    """Messages packed and hashed (or their items compared with `kept`, the new ones hashed)."""
    packed = _floor_pack(messages)
    header = _array_header_size(len(messages))
    if kept is None:
        blake3.blake3(packed).digest()
    else:
        packed.startswith(kept, header)
        blake3.blake3(memoryview(packed)[header + len(kept) :]).digest()


def _pack_hash_chunks(messages: list[Any]) -> None:
    hasher = blake3.blake3()
    for start in range(0, len(messages), 64):
        chunk = messages[start : start + 64]
        hasher.update(memoryview(_floor_pack(chunk))[_array_header_size(len(chunk)) :])
    hasher.digest()


Schemes = dict[str, Callable[[], None]]


def _decoded_schemes(fields: dict[str, Any], n_resent: int, kept: bool) -> Schemes:
    """Ways to do the decoded floor's message work on this body (see above), by name."""
    messages = fields["messages"]
    schemes: Schemes
    if kept:
        items = _items(messages[:n_resent])
        schemes = {"kept_pack": lambda: _pack_hash(messages, items)}
    else:
        schemes = {
            "pack": lambda: _pack_hash(messages, None),
            "pack_chunks": lambda: _pack_hash_chunks(messages),
        }
    strings: list[str] = []
    hollow = _hollow(messages, strings)
    if strings:
        copies = [_copy(x) for x in strings]
        hollow_items = _items(hollow[:n_resent]) if kept else None

        def holes() -> None:
            _pack_hash(hollow, hollow_items)
            strings == copies  # noqa: B015 (the comparison is the work)

        schemes["kept_holes" if kept else "holes"] = holes
    return schemes


def _raw_schemes(messages: bytes, resent: int, kept: bytes | None) -> Schemes:
    """Ways to read the re-sent bytes of a raw text once (see above), by name."""
    view = memoryview(messages)
    if kept is not None:
        return {"kept_memcmp": lambda: messages.startswith(kept)}
    schemes: Schemes = {"blake3": lambda: blake3.blake3(view[:resent]).digest()}
    strings: list[str] = []
    _hollow(json.loads(messages[:resent] + b"]"), strings)
    needles, at, rest, found = [], [], [], 0
    for string in strings:  # their spans in the text, in order
        needle = string.encode("utf-8")
        where = messages.find(needle, found, resent)
        if where < 0:
            continue  # written with escapes: hashed with the rest
        rest.append(view[found:where])
        needles.append(needle)
        at.append(where)
        found = where + len(needle)
    rest.append(view[found:resent])
    if needles:
        others = b"".join(rest)  # one update for all of them (joined beforehand)

        def holes() -> None:
            blake3.blake3(others).digest()
            list(map(messages.startswith, needles, at))

        schemes["holes"] = holes
    return schemes


def _floor_raw_rest(
    fields: dict[str, Any],
    messages: bytes,
    resent: int,
    tools: bytes | None,
    parent_tokens: bytes | None,
) -> None:
    """The raw floor's work after the re-sent bytes."""
    new = _floor_decode(b"[" + memoryview(messages)[resent + 1 :])  # after the comma
    blake3.blake3(_floor_pack(new)).digest()
    if tools is not None:
        blake3.blake3(tools).digest()
    _floor_common(fields, parent_tokens)


def _time_floor(fn: Callable[[], Any]) -> float:
    return min(_median_time(fn)[1], _median_time(fn)[1])


FLOORS = ("floor_decoded", "floor_decoded_kept", "floor_raw", "floor_raw_kept")


def _floors(
    text: str, before: dict[str, Any], texts: _MessageTexts, by_scheme: dict[str, list[float]]
) -> dict[str, float]:
    """The floors of one body (seconds), given the turn before it (see above); each scheme's
    figure is added to `by_scheme`. A kept floor is at most the O(1) one (it may do that)."""
    fields = json.loads(text)
    parent_tokens = _tokens_of(before)
    n_resent = len(before["messages"])
    rest = [lambda: _floor_pack(fields["tools"])]
    rest.append(lambda: _floor_common(fields, parent_tokens))
    fixed = sum(_time_floor(fn) for fn in rest)
    timed: dict[str, float] = {}
    for kept in (False, True):
        for scheme, fn in _decoded_schemes(fields, n_resent, kept).items():
            timed[f"decoded_{scheme}"] = fixed + _time_floor(fn)
    parts = _split_body(text.encode("utf-8"))
    messages = bytes(parts.messages)
    previous = texts.of(before["messages"])
    resent = len(previous) - 1  # the previous text but its closing bracket
    if messages[:resent] == previous[:resent]:  # (always in these workloads)
        tools = None if bytes(parts.tools) == b"null" else bytes(parts.tools)
        raw_fields = json.loads(text)
        after = _time_floor(
            lambda: _floor_raw_rest(raw_fields, messages, resent, tools, parent_tokens)
        )
        for copy in (None, previous[:resent]):
            for scheme, fn in _raw_schemes(messages, resent, copy).items():
                timed[f"raw_{scheme}"] = after + _time_floor(fn)
    for name, seconds in timed.items():
        by_scheme.setdefault(name, []).append(seconds)
    out = {}
    for kind in ("decoded", "raw"):
        every = [t for name, t in timed.items() if name.startswith(kind + "_")]
        if every:
            out[f"floor_{kind}"] = min(
                t for name, t in timed.items() if name.startswith(kind + "_") and "kept" not in name
            )
            out[f"floor_{kind}_kept"] = min(every)
    return out


def _file_decoded(table: Any, packer: Any, turn: int, messages: list[Any], response: bytes) -> None:
    """What the request table does for a decoded request: its messages after the system ones
    packed in one walk (from its conversation's decoded tip on), its base found, then filed."""
    n_sys = 0
    while n_sys < len(messages) and messages[n_sys].get("role") == "system":
        n_sys += 1
    table.add_messages(turn, packer, messages[n_sys:] if n_sys else messages, response)


def long_run(name: str, raw: bool) -> dict[str, Any]:
    """One decoded graph and (if `raw`) one raw graph fed the same workload turn by turn."""
    checkpoints = LONG_CHECKPOINTS[name]
    timed = {t: c for c in checkpoints for t in range(c - WINDOW, c + WINDOW + 1)}
    n_turns = max(timed)
    decoded_graph = rs.RolloutGraph()
    raw_graph = rs.RolloutGraph() if raw else None
    str_graph = rs.RolloutGraph() if raw else None  # fed the same texts as a str
    table = rs._core.RequestTable() if raw else None
    decoded_table = rs._core.RequestTable()
    packer = rs._core.Packer(None, None)
    pack = packer.pack
    texts = _MessageTexts()
    kinds = ("decoded", "raw", "raw_str", "split_raw", "table", "table_dec", *FLOORS)
    samples: dict[int, dict[str, list[float]]] = {c: {k: [] for k in kinds} for c in checkpoints}
    previous: dict[str, Any] | None = None
    schemes: dict[int, dict[str, list[float]]] = {c: {} for c in checkpoints}  # floors
    raw_error = None
    gc.collect()
    gc.disable()
    try:
        for turn, body in enumerate(WORKLOADS[name](n_turns), 1):
            tools = json.dumps(body["tools"]).encode() if body["tools"] is not None else None
            checkpoint = timed.get(turn)
            before, previous = previous, body
            response = pack(body["response"])
            if checkpoint is None:  # (timed below, at a checkpoint)
                _file_decoded(decoded_table, packer, turn, body["messages"], response)
                if table is not None:
                    table.add_json(turn, texts.of(body["messages"]), response)
            if checkpoint is None:
                decoded_graph.add_turn(_decoded_node(body))
                if raw_graph is not None and raw_error is None:
                    try:
                        raw_graph.add_turn(_raw_node(body, texts.of(body["messages"]), tools))
                        str_graph.add_turn(  # type: ignore[union-attr]
                            _raw_node(body, texts.of(body["messages"]).decode(), _str(tools))
                        )
                    except Exception as exc:  # before RawJSON intake existed
                        raw_error = repr(exc)
                continue
            text = json.dumps(body)
            fresh, loads = _median_time(lambda text=text: json.loads(text))
            node = _decoded_node(fresh)
            start = perf_counter()
            decoded_graph.add_turn(node)
            samples[checkpoint]["decoded"].append((perf_counter() - start) / loads)
            del node
            start = perf_counter()
            _file_decoded(decoded_table, packer, turn, fresh["messages"], response)
            samples[checkpoint]["table_dec"].append((perf_counter() - start) / loads)
            del fresh
            if raw_graph is not None and raw_error is None:
                data = text.encode("utf-8")
                start = perf_counter()
                parts = _split_body(data)
                split = perf_counter() - start
                raw_tools = bytes(parts.tools)
                # the other fields freshly decoded, as a capture server has them (the
                # generator's own lists hold ints made over many turns, scattered in memory:
                # visiting them costs more than visiting a fresh decode's)
                node = _raw_node(
                    json.loads(text),
                    bytes(parts.messages),
                    None if raw_tools == b"null" else raw_tools,
                )
                start = perf_counter()
                try:
                    raw_graph.add_turn(node)
                except Exception as exc:
                    raw_error = repr(exc)
                    continue
                add = perf_counter() - start
                samples[checkpoint]["raw"].append(add / loads)
                samples[checkpoint]["split_raw"].append((add + split) / loads)
                del node
                node = _raw_node(
                    json.loads(text),
                    bytes(parts.messages).decode(),
                    None if raw_tools == b"null" else raw_tools.decode(),
                )
                start = perf_counter()
                str_graph.add_turn(node)  # type: ignore[union-attr]
                samples[checkpoint]["raw_str"].append((perf_counter() - start) / loads)
            if table is not None:
                messages_text = texts.of(body["messages"])
                start = perf_counter()
                table.add_json(turn, messages_text, response)
                samples[checkpoint]["table"].append((perf_counter() - start) / loads)
            if before is not None:
                by_scheme: dict[str, list[float]] = {}
                for kind, floor in _floors(text, before, texts, by_scheme).items():
                    samples[checkpoint][kind].append(floor / loads)
                for scheme, seconds in by_scheme.items():
                    schemes[checkpoint].setdefault(scheme, []).extend(t / loads for t in seconds)
    finally:
        gc.enable()
    out: dict[str, Any] = {"workload": name, "turns": n_turns, "raw_error": raw_error}
    out["checkpoints"] = {
        c: {kind: statistics.median(v) if v else None for kind, v in s.items()}
        for c, s in samples.items()
    }
    out["floor_schemes"] = {  # each way of doing a floor's work, / json.loads (see floors)
        c: {scheme: statistics.median(v) for scheme, v in s.items()} for c, s in schemes.items()
    }
    return out


# ---------------------------------------------------------------- soak shapes


def _asked(rng: random.Random, lead: str, words: int) -> list[dict[str, Any]]:
    """A request's messages: the system prompt, then `lead` and `words` random words."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": lead + _text(rng, words)},
    ]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(150_000) for _ in range(n)]


def shared_observation(n: int) -> Iterator[dict[str, Any]]:
    """Rollouts of 10 turns by messages; every observation is one of 5 shared short texts."""
    rng = random.Random(11)
    turn = 0
    while True:
        history = _asked(rng, f"Task {turn}: ", 60)
        for step in range(10):
            response = {"role": "assistant", "content": _text(rng, rng.randrange(20, 80))}
            yield {"request_messages": list(history), "response_message": response}
            turn += 1
            if turn == n:
                return
            history += [response, {"role": "user", "content": f"obs {step % 5}"}]


def same_prompt_tokens(n: int) -> Iterator[dict[str, Any]]:
    """One prompt (300 token ids) sampled n times: n roots with one prompt."""
    rng = random.Random(12)
    prompt = _tokens(rng, 300)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Q"}]
    for _ in range(n):
        yield {
            "request_messages": messages,
            "response_message": {"role": "assistant", "content": _text(rng, 30)},
            "prompt_ids": prompt,
            "sampled_ids": _tokens(rng, 40),
        }


def short_prompt_calls(n: int) -> Iterator[dict[str, Any]]:
    """Independent calls with 6-token prompts and 6 sampled tokens (under the 16-token head)."""
    rng = random.Random(13)
    for i in range(n):
        yield {
            "request_messages": [{"role": "user", "content": f"call {i}"}],
            "response_message": {"role": "assistant", "content": _text(rng, 20)},
            "prompt_ids": _tokens(rng, 6),
            "sampled_ids": _tokens(rng, 6),
        }


def same_prompt_messages(n: int) -> Iterator[dict[str, Any]]:
    """One request (by messages, no token ids) sampled n times."""
    rng = random.Random(14)
    messages = _asked(rng, "Solve: ", 100)
    for _ in range(n):
        yield {
            "request_messages": messages,
            "response_message": {"role": "assistant", "content": _text(rng, 40)},
        }


def _message_groups(n: int, seed: int, size: int, steps: int | None) -> Iterator[dict[str, Any]]:
    """Groups of `size` rollouts of one task by messages, a turn of each in turn, `steps`
    turns each before the next group's task (`None`: one group that never ends)."""
    rng = random.Random(seed)
    turn = 0
    while True:
        task = _asked(rng, "Task: ", 80)
        histories = [list(task) for _ in range(size)]
        for _step in itertools.count() if steps is None else range(steps):
            for history in histories:
                response = {"role": "assistant", "content": _text(rng, rng.randrange(20, 60))}
                yield {"request_messages": list(history), "response_message": response}
                turn += 1
                if turn == n:
                    return
                history += [response, {"role": "user", "content": "continue"}]


def _token_groups(n: int, seed: int, size: int, steps: int | None) -> Iterator[dict[str, Any]]:
    """`_message_groups` with token ids: a continuation's prompt extends its parent's tokens."""
    rng = random.Random(seed)
    turn = 0
    while True:
        task = _tokens(rng, 200)
        prompts = [list(task) for _ in range(size)]
        for _step in itertools.count() if steps is None else range(steps):
            for k, prompt in enumerate(prompts):
                sampled = _tokens(rng, 30)
                yield {
                    "request_messages": [{"role": "user", "content": f"t{turn}"}],
                    "response_message": {"role": "assistant", "content": "ok"},
                    "prompt_ids": list(prompt),
                    "sampled_ids": sampled,
                }
                turn += 1
                if turn == n:
                    return
                prompts[k] = prompt + sampled + _tokens(rng, 10)


def groups_of_8_messages(n: int) -> Iterator[dict[str, Any]]:
    """GRPO-like: groups of 8 rollouts x 10 turns of one task, turns interleaved in a group."""
    return _message_groups(n, seed=15, size=8, steps=10)


def groups_of_8_tokens(n: int) -> Iterator[dict[str, Any]]:
    """Groups of 8 rollouts x 10 turns with token ids: a prompt extends its parent's tokens."""
    return _token_groups(n, seed=16, size=8, steps=10)


def _completions(rng: random.Random, n: int) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": f"The answer is {_text(rng, 12)}."} for _ in range(n)]


def repeating_completions(n: int) -> Iterator[dict[str, Any]]:
    """One request (by messages) sampled n times; its completions repeat: 1,000 distinct."""
    rng = random.Random(17)
    messages = _asked(rng, "Answer in one word: ", 100)
    answers = _completions(rng, 1000)
    for _ in range(n):
        yield {"request_messages": messages, "response_message": rng.choice(answers)}


def repeating_completions_tokens(n: int) -> Iterator[dict[str, Any]]:
    """`repeating_completions` with token ids: one prompt, 1,000 distinct sampled runs."""
    rng = random.Random(18)
    messages = _asked(rng, "Answer in one word: ", 100)
    prompt = _tokens(rng, 300)
    answers = [(a, _tokens(rng, 8)) for a in _completions(rng, 1000)]
    for _ in range(n):
        answer, sampled = rng.choice(answers)
        yield {
            "request_messages": messages,
            "response_message": answer,
            "prompt_ids": prompt,
            "sampled_ids": sampled,
        }


def group_of_1000_messages(n: int) -> Iterator[dict[str, Any]]:
    """A group of 1,000 rollouts of one task, by messages, a turn of each in turn (step by
    step): every continuation looks among 1,000 samples of one request for its own."""
    return _message_groups(n, seed=21, size=1000, steps=None)


def group_of_1000_tokens(n: int) -> Iterator[dict[str, Any]]:
    """`group_of_1000_messages` with token ids: every continuation's prompt extends the
    tokens of one of 1,000 samples of one prompt."""
    return _token_groups(n, seed=22, size=1000, steps=None)


def sampled_mid_conversation(n: int) -> Iterator[dict[str, Any]]:
    """A conversation's 6th call sampled n times after its first 5 (best-of-n at one step):
    the samples are siblings under one parent; their completions repeat, 1,000 distinct."""
    rng = random.Random(19)
    history: list[dict[str, Any]] = _asked(rng, "Task: ", 120)
    for _ in range(5):
        response = {"role": "assistant", "content": _text(rng, 60)}
        yield {"request_messages": list(history), "response_message": response}
        n -= 1
        if n == 0:
            return
        history += [response, {"role": "user", "content": "continue: " + _text(rng, 30)}]
    answers = _completions(rng, 1000)
    for _ in range(n):
        yield {"request_messages": history, "response_message": rng.choice(answers)}


def sampled_mid_conversation_tokens(n: int) -> Iterator[dict[str, Any]]:
    """`sampled_mid_conversation` with token ids: the 6th call's prompt extends the 5th's
    tokens; 1,000 distinct sampled runs."""
    rng = random.Random(20)
    prompt = _tokens(rng, 200)
    for step in range(5):
        sampled = _tokens(rng, 30)
        yield {
            "request_messages": [{"role": "user", "content": f"step {step}"}],
            "response_message": {"role": "assistant", "content": "ok"},
            "prompt_ids": list(prompt),
            "sampled_ids": sampled,
        }
        n -= 1
        if n == 0:
            return
        prompt = prompt + sampled + _tokens(rng, 10)
    answers = [(a, _tokens(rng, 8)) for a in _completions(rng, 1000)]
    for _ in range(n):
        answer, sampled = rng.choice(answers)
        yield {
            "request_messages": [{"role": "user", "content": "step 5"}],
            "response_message": answer,
            "prompt_ids": prompt,
            "sampled_ids": sampled,
        }


SOAK_SHAPES: dict[str, Callable[[int], Iterator[dict[str, Any]]]] = {
    "shared_observation": shared_observation,
    "same_prompt_tokens": same_prompt_tokens,
    "short_prompt_calls": short_prompt_calls,
    "same_prompt_messages": same_prompt_messages,
    "groups_of_8_messages": groups_of_8_messages,
    "groups_of_8_tokens": groups_of_8_tokens,
    "repeating_completions": repeating_completions,
    "repeating_completions_tokens": repeating_completions_tokens,
    "group_of_1000_messages": group_of_1000_messages,
    "group_of_1000_tokens": group_of_1000_tokens,
    "sampled_mid_conversation": sampled_mid_conversation,
    "sampled_mid_conversation_tokens": sampled_mid_conversation_tokens,
}
#: turns whose add time the soak prints (the median of the 20 turns around each)
SOAK_CHECKPOINTS = (100, 1000, 5000)


def soak_run(name: str, n_turns: int, builds: int) -> dict[str, Any]:
    late = range(n_turns - 19, n_turns + 1)
    windows = {c: range(c - 9, c + 11) for c in SOAK_CHECKPOINTS if c + 10 < n_turns - 19}
    early_t: list[float] = []
    late_t: list[float] = []
    at: dict[int, list[float]] = {c: [] for c in windows}
    for _ in range(builds):
        turns = list(SOAK_SHAPES[name](n_turns))
        graph = rs.RolloutGraph()
        gc.collect()
        gc.disable()
        try:
            for turn, fields in enumerate(turns, 1):
                node = rs.TurnNode(sampling_params=SAMPLING_PARAMS, model="m", **fields)
                start = perf_counter()
                graph.add_turn(node)
                elapsed = perf_counter() - start
                if turn in SOAK_EARLY:
                    early_t.append(elapsed)
                elif turn in late:
                    late_t.append(elapsed)
                for c, window in windows.items():
                    if turn in window:
                        at[c].append(elapsed)
        finally:
            gc.enable()
        del graph, turns
    early, late_median = statistics.median(early_t), statistics.median(late_t)
    return {
        "shape": name,
        "turns": n_turns,
        "early_us": 1e6 * early,
        "late_us": 1e6 * late_median,
        "at_us": {c: 1e6 * statistics.median(t) for c, t in at.items()},
        "ratio": late_median / early,
    }


def memory_run(name: str, n_turns: int) -> dict[str, Any]:
    """Retained bytes of rollout_store over unique content after `n_turns` turns."""
    texts = list(iter_texts(WORKLOADS[name], n_turns))
    unique = UniqueContent()
    for text in texts:
        unique.add(json.loads(text))
    retained = retained_bytes(SCHEMES["rollout_store"], texts, [n_turns])[n_turns]
    return {"workload": name, "turns": n_turns, "retained": retained, "unique": unique.bytes}


# ---------------------------------------------------------------- report


def _fmt(x: float | None) -> str:
    return f"{x:8.3f}" if x is not None else "     n/a"


def check(
    long: list[dict[str, Any]], soak: list[dict[str, Any]], memory: list[dict[str, Any]]
) -> list[str]:
    lines = []
    for m in memory:
        limit = MAX_RETAINED.get(m["workload"])
        if limit is None:
            continue
        ratio = m["retained"] / m["unique"]
        verdict = "PASS" if ratio <= limit else "MISS"
        lines.append(
            f"{verdict}  {m['workload']} retained/unique at {m['turns']} turns {ratio:.3f}"
            f" <= {limit}"
        )
    for r in long:
        for c, v in r["checkpoints"].items():
            c = int(c)
            if c >= 100:
                limits = [("decoded", MAX_DECODED_DEEP), ("raw", MAX_RAW_DEEP)]
            elif c == 10 and r["workload"] == "chatty":
                limits = [("decoded", MAX_DECODED_CHATTY_10)]
            else:
                limits = []
            for kind, limit in limits:
                value = v[kind]
                verdict = "SKIP" if value is None else ("PASS" if value <= limit else "MISS")
                line = (
                    f"{verdict}  {r['workload']} turn {c} {kind} add_turn/json.loads"
                    f" {_fmt(value).strip()} <= {limit}"
                )
                floor = v.get(f"floor_{kind}")
                if verdict == "MISS" and floor is not None:
                    kept = v.get(f"floor_{kind}_kept")
                    line += f" (floor {floor:.3f}, kept {kept:.3f}"
                    line += ": the floor itself is above the target)" if floor > limit else ")"
                lines.append(line)
    for s in soak:
        verdict = "PASS" if s["ratio"] <= MAX_SOAK else "MISS"
        lines.append(
            f"{verdict}  soak {s['shape']} turn {s['turns']}/turn 100"
            f" {s['ratio']:.2f} <= {MAX_SOAK}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", help="long-mode workloads, comma-separated")
    parser.add_argument("--shapes", help="soak shapes, comma-separated")
    parser.add_argument("--no-long", action="store_true")
    parser.add_argument("--no-soak", action="store_true")
    parser.add_argument("--no-raw", action="store_true", help="decoded input only")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--soak-turns", type=int, default=SOAK_TURNS)
    parser.add_argument("--builds", type=int, default=SOAK_BUILDS)
    add_results_option(parser)
    args = parser.parse_args(argv)
    workloads = args.workloads.split(",") if args.workloads else list(LONG_CHECKPOINTS)
    shapes = args.shapes.split(",") if args.shapes else list(SOAK_SHAPES)

    long: list[dict[str, Any]] = []
    if not args.no_long:
        print("add_turn / json.loads of the same body (median of 9 turns around each turn);")
        print("floor: the least work any implementation must do on that body, with O(1) memory")
        print("(kept: with a copy of the previous request kept), measured, not a target")
        print(
            f"{'workload':<12}{'turn':>6}{'decoded':>9}{'floor':>9}{'kept':>9}"
            f"{'raw':>9}{'floor':>9}{'kept':>9}{'raw str':>9}{'split+raw':>10}{'table':>9}"
            f"{'table_dec':>10}"
        )
        for name in workloads:
            r = long_run(name, raw=not args.no_raw)
            long.append(r)
            for c, v in r["checkpoints"].items():
                print(
                    f"{name:<12}{c:>6}{_fmt(v['decoded'])} {_fmt(v['floor_decoded'])}"
                    f" {_fmt(v['floor_decoded_kept'])} {_fmt(v['raw'])} {_fmt(v['floor_raw'])}"
                    f" {_fmt(v['floor_raw_kept'])} {_fmt(v['raw_str'])}  {_fmt(v['split_raw'])}"
                    f" {_fmt(v['table'])}"
                    f"  {_fmt(v['table_dec'])}",
                    flush=True,
                )
            if r["raw_error"]:
                print(f"  raw input refused: {r['raw_error'][:120]}")
    soak: list[dict[str, Any]] = []
    if not args.no_soak:
        print(
            f"\nsoak: {args.soak_turns} turns in one graph; median add time of the last 20 turns"
            f" / turns 91-110 ({args.builds} builds pooled)"
        )
        for name in shapes:
            s = soak_run(name, args.soak_turns, args.builds)
            soak.append(s)
            at = "".join(f"  turn {c} {t:8.1f}" for c, t in s["at_us"].items())
            print(
                f"  {name:<28} turns 91-110 {s['early_us']:8.1f}{at}"
                f"  turn {s['turns']} {s['late_us']:8.1f} us  ratio {s['ratio']:6.2f}",
                flush=True,
            )
    memory: list[dict[str, Any]] = []
    if not args.no_memory:
        print(f"\nretained memory at {MEMORY_TURNS} turns (tracemalloc + the engine's bytes)")
        for name in workloads:
            m = memory_run(name, MEMORY_TURNS)
            memory.append(m)
            print(
                f"  {name:<12} retained {m['retained'] / 2**20:8.2f} MiB"
                f"  unique {m['unique'] / 2**20:8.2f} MiB"
                f"  x unique {m['retained'] / m['unique']:.3f}",
                flush=True,
            )
    lines = check(long, soak, memory)
    print("\nTargets:")
    for line in lines:
        print("  " + line)
    full = (
        not (
            args.no_long
            or args.no_soak
            or args.no_raw
            or args.no_memory
            or args.workloads
            or args.shapes
        )
        and args.soak_turns == SOAK_TURNS
    )
    stem = "ingest" if full else "ingest.partial"
    report = {
        "commit": library_commit(),
        "long": long,
        "soak": soak,
        "memory": memory,
        "checks": lines,
    }
    path = results_dir(args.update_results) / f"{stem}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {shown(path)}")
    print(targets_summary(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

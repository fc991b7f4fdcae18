"""What a capture server's sessions keep: values shared across sessions, no copies kept twice."""

from __future__ import annotations

import gc
import json
import os
import tracemalloc

import rollout_store
from rollout_store import RawJSON, TurnNode
from rollout_store.engine import values
from rollout_store.engine.values import ValueTable
from rollout_store.serve.sessions import Sessions

# A short tool list (about 350 bytes packed), as a browser agent sends with every call.
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


def _turn(k: int) -> TurnNode:
    messages = [{"role": "user", "content": f"step {k}"}]
    return TurnNode(
        request_messages=RawJSON(json.dumps(messages).encode()),
        request_tools=RawJSON(json.dumps(TOOLS).encode()),
        sampling_params={"temperature": 1.0},
        response_message={"role": "assistant", "content": f"done {k}"},
    )


def test_a_short_tool_list_is_one_object_for_every_session() -> None:
    sessions = Sessions()
    group = [sessions.create() for _ in range(4)]
    for k, session in enumerate(group):
        with session.use() as graph:
            graph.add_turn(_turn(k))
    # the tool list is the only value long enough to share: one object in the store
    assert len(sessions.store) == 1
    for session in group:
        with session.use() as graph:
            (node_id,) = graph.node_ids()
            assert json.dumps(graph.request_tools(node_id)) == json.dumps(TOOLS)
    sessions.close()


def test_a_value_table_keeps_one_object_for_a_value_stored_as_its_plain_packing() -> None:
    value = b"\x91\xda\x01\xf4" + b"v" * 500  # a packed string, equal stored and plain
    table = ValueTable(lambda stored: stored, None)
    stored = bytes(bytearray(value))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        plain = bytes(bytearray(value))  # equal, another object: the fresh value's packing
        table.add(plain, stored)
        del plain
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    # only what this test and the table allocated: a thread that an earlier test left running
    # (a store client's, a server's) may allocate meanwhile
    mine = [tracemalloc.Filter(True, __file__), tracemalloc.Filter(True, values.__file__)]
    kept = sum(
        diff.size_diff
        for diff in after.filter_traces(mine).compare_to(before.filter_traces(mine), "filename")
    )
    assert table.find(value) is stored
    assert kept < len(value)  # the dictionary's entry, not a second copy of the bytes


def test_a_conversation_keeps_what_each_turn_adds_and_no_more() -> None:
    """A session recording a conversation as the server does (the raw messages text, token
    ids, the harness dropping the reply's null fields before sending it back): what it keeps
    grows by what each turn adds, not by a copy of what the turn re-sends (a raw tip and the
    system part's packing were kept per turn, 4.7x the unique content of a GRPO group)."""
    system = {"role": "system", "content": "You are a careful agent. " * 160}  # 4 KB
    history: list[dict[str, object]] = [system, {"role": "user", "content": "task"}]
    prompt = list(range(1000))
    sessions = Sessions()
    session = sessions.create()

    def turn(k: int) -> int:
        nonlocal history, prompt
        reply = {"role": "assistant", "content": f"step {k} " * 8, "refusal": None}
        sampled = [2000 + 8 * k + i for i in range(8)]
        with session.use() as graph:
            graph.add_turn(
                TurnNode(
                    prompt_ids=prompt,
                    sampled_ids=sampled,
                    request_messages=RawJSON(json.dumps(history).encode()),
                    response_message=reply,
                )
            )
        echo = {k: v for k, v in reply.items() if v is not None}
        new = [echo, {"role": "user", "content": f"go on {k}"}]
        history = [*history, *new]
        prompt = [*prompt, *sampled, *range(3000 + 10 * k, 3010 + 10 * k)]
        # what the turn adds: its reply, the next user message, its new token ids
        return len(json.dumps([reply, new[1]])) + 4 * (len(sampled) + 10)

    for k in range(10):
        turn(k)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        added = sum(turn(k) for k in range(10, 40))
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    sessions.close()
    # what the library allocated and keeps (the test's own growing history is not counted)
    mine = [tracemalloc.Filter(True, os.path.join(os.path.dirname(rollout_store.__file__), "*"))]
    diffs = after.filter_traces(mine).compare_to(before.filter_traces(mine), "lineno")
    kept = sum(d.size_diff for d in diffs)
    # a turn keeps its own content and its stored form (the reply, the loose echo kept as
    # sent, digests, the turn's object: about 3.7x `added` here), never a copy of the 4 KB
    # system part or a tip per turn (37x before)
    assert kept < 6 * added, (kept, added, diffs[:6])

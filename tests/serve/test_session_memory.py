"""What a capture server's sessions keep: values shared across sessions, no copies kept twice."""

from __future__ import annotations

import gc
import json
import tracemalloc

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

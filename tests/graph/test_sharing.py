"""Memory: long strings, messages and tokens are stored once however often they are re-sent."""

from __future__ import annotations

import copy
import gc
import json
import math
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from support import (
    add_all,
    assert_same,
    chat_turns,
    fresh,
    image_url,
    materialized,
    reachable,
    same,
    token_turns,
)

from rollout_store import RolloutGraph, TurnNode

IMAGE = 64 * 1024


def _retained(build: Callable[[], Any]) -> int:
    """Bytes that the object returned by `build` keeps alive (tracemalloc, after a warm-up)."""
    build()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        keep = build()
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del keep
    return used


def _empty_graph() -> RolloutGraph:
    graph = RolloutGraph()
    graph.add_turn(TurnNode(node_id="x", request_messages=[{"role": "user", "content": "x"}]))
    return graph


# ---------------------------------------------------------------- long strings


def _image_rollout() -> tuple[list[dict[str, Any]], list[str]]:
    # 8 turns, 6 distinct images: image 0 is attached again at turn 4 and image 2 at turn 7
    distinct = [image_url(seed) for seed in range(6)]
    attached = [distinct[i] for i in (0, 1, 2, 3, 0, 4, 5, 2)]
    return chat_turns(8, images=attached), distinct


def _image_urls(messages: list[Any]) -> list[str]:
    return [
        part["image_url"]["url"]
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if part.get("type") == "image_url"
    ]


def test_each_distinct_image_is_retained_once():
    turns, distinct = _image_rollout()
    assert all(len(image) == IMAGE for image in distinct)
    graph = RolloutGraph()
    ids = add_all(graph, turns)  # every request body is a fresh json.loads copy
    del turns
    gc.collect()
    images = {
        id(obj): obj for obj in reachable(graph).values() if type(obj) is str and len(obj) == IMAGE
    }
    assert len(images) == len(distinct)
    assert sorted(images.values()) == sorted(distinct)
    by_content = {obj: obj for obj in images.values()}
    assert graph.stats()["blobs"] == len(distinct)
    for node_id in ids:
        urls = _image_urls(graph.get(node_id).request_messages)
        assert urls
        for url in urls:
            assert url is by_content[url]
        for url in _image_urls(graph.request_messages(node_id)):
            assert url is by_content[url]


def test_long_strings_in_every_field_are_one_object():
    graph = RolloutGraph()
    text = "T" * 5000
    for k in range(4):
        graph.add_turn(
            TurnNode(
                node_id=f"n{k}",
                request_messages=[{"role": "system", "content": fresh(text)}, {"k": k}],
                response_message={"content": fresh(text)},
                request_tools=[{"description": fresh(text)}],
                sampling_params={"prefix": fresh(text), "k": k},
            )
        )
    seen = {id(o) for o in reachable(graph).values() if type(o) is str and len(o) == len(text)}
    assert len(seen) == 1
    (obj,) = [o for o in reachable(graph).values() if type(o) is str and len(o) == len(text)]
    for k in range(4):
        node = graph.get(f"n{k}")
        assert node.request_messages[0]["content"] is obj
        assert node.response_message["content"] is obj
        assert node.request_tools[0]["description"] is obj
        assert node.sampling_params["prefix"] is obj


def test_multimodal_memory_is_proportional_to_unique_content():
    n = 20

    def build() -> RolloutGraph:
        graph = RolloutGraph()
        add_all(graph, chat_turns(n, images=[image_url(seed) for seed in range(n)]))
        return graph

    unique = n * IMAGE
    content = _retained(build) - _retained(_empty_graph)
    naive = n * (n + 1) // 2 * IMAGE
    assert content < 1.15 * unique + 64 * 1024, (content, unique, naive)


# ---------------------------------------------------------------- messages


def _naive_bytes(turns: list[dict[str, Any]]) -> int:
    return sum(len(json.dumps(t["request_messages"])) for t in turns)


def test_message_storage_grows_linearly():
    stored = {}
    naive = {}
    for n in (15, 30):
        turns = chat_turns(n, pad=600)
        graph = RolloutGraph()
        add_all(graph, turns)
        stored[n] = graph.stats()["message_bytes_stored"]
        naive[n] = _naive_bytes(turns)
        assert graph.stats()["messages_received"] == sum(len(t["request_messages"]) for t in turns)
    assert naive[30] > 3.5 * naive[15]  # what re-sending costs without sharing
    assert stored[30] < 2.2 * stored[15]
    assert stored[30] < naive[30] / 10


def test_message_memory_grows_linearly():
    def build(n: int) -> Callable[[], RolloutGraph]:
        def run() -> RolloutGraph:
            graph = RolloutGraph()
            add_all(graph, chat_turns(n, pad=600))
            return graph

        return run

    base = _retained(_empty_graph)
    used = {n: _retained(build(n)) - base for n in (15, 30)}
    assert used[30] < 2.2 * used[15], used


def test_system_prompt_and_tools_are_stored_once():
    system = "S" * 900  # below the string threshold: shared as a whole value
    tools = [
        {"type": "function", "function": {"name": f"tool{i}", "doc": "d" * 200}} for i in range(5)
    ]

    def build(n: int) -> RolloutGraph:
        graph = RolloutGraph()
        turns = chat_turns(n, system=system)
        for fields in turns:
            fields["request_tools"] = fresh(tools)
            fields["sampling_params"] = {"temperature": 0.2, "max_tokens": 512}
        add_all(graph, turns)
        return graph

    small, large = build(5), build(25)
    assert small.stats()["shared_values"] == large.stats()["shared_values"]
    base = _retained(_empty_graph)
    grow_small = _retained(lambda: build(5)) - base
    grow_large = _retained(lambda: build(25)) - base
    # 20 more turns must cost far less than 20 copies of the system prompt and tools
    per_turn_copy = len(json.dumps(tools)) + len(system)
    assert grow_large - grow_small < 20 * per_turn_copy / 3, (grow_small, grow_large)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"role": "user", "content": 1}, {"role": "user", "content": 1.0}),
        ({"role": "user", "content": 1}, {"role": "user", "content": True}),
        ({"role": "user", "content": 0.0}, {"role": "user", "content": -0.0}),
        (
            {"role": "user", "content": "x", "name": "n"},
            {"name": "n", "role": "user", "content": "x"},
        ),
        ({"role": "user", "content": [1, 2]}, {"role": "user", "content": (1, 2)}),
        ({"role": "user", "content": {"a": 1}}, {"role": "user", "content": {1: "a"}}),
        ({"role": "user", "content": {"1": 1}}, {"role": "user", "content": {1: 1}}),
    ],
)
@pytest.mark.parametrize("where", ["history", "system", "tools", "sampling", "response"])
def test_near_identical_messages_both_come_back_exactly(a, b, where):
    """Values equal under Python == but printed differently by json.dumps are never merged."""
    graph = RolloutGraph()
    if where == "history":
        first = [a, {"role": "assistant", "content": "r"}, {"role": "user", "content": "q"}]
        second = [b, *copy.deepcopy(first[1:]), {"role": "user", "content": "more"}]
        fields = [{"request_messages": first}, {"request_messages": second}]
    elif where == "system":
        fields = [
            {"request_messages": [{**a, "role": "system"}, {"role": "user", "content": "u"}]},
            {"request_messages": [{**b, "role": "system"}, {"role": "user", "content": "u"}]},
        ]
    elif where == "tools":
        fields = [{"request_tools": [a]}, {"request_tools": [b]}]
    elif where == "sampling":
        fields = [{"sampling_params": a}, {"sampling_params": b}]
    else:
        fields = [
            {"request_messages": [{"role": "user"}], "response_message": a},
            {"request_messages": [{"role": "user"}, b, {"role": "user"}]},
        ]
    for order in (fields, fields[::-1]):
        graph = RolloutGraph()
        ids = add_all(graph, copy.deepcopy(order))
        for node_id, want in zip(ids, order, strict=True):
            got = materialized(graph, node_id)
            for name, value in want.items():
                assert_same(got[name], value)
                assert json.dumps(got[name]) == json.dumps(value)


def test_re_sent_history_with_one_changed_number_is_exact():
    graph = RolloutGraph()
    turns = chat_turns(4)
    turns[3]["request_messages"][3]["content"] = {"n": 1.0}
    turns[2]["request_messages"][3]["content"] = {"n": 1}
    turns[1]["request_messages"][3]["content"] = {"n": True}
    ids = add_all(graph, turns)
    for node_id, fields in zip(ids, turns, strict=True):
        assert_same(graph.request_messages(node_id), fields["request_messages"])


# ---------------------------------------------------------------- tokens


def test_linear_token_rollout_stores_only_new_tokens():
    graph = RolloutGraph()
    turns = token_turns(20, n_prompt=300, n_new=150, n_sampled=50)
    ids = add_all(graph, turns)
    final = turns[-1]["prompt_ids"] + turns[-1]["sampled_ids"]
    assert len(set(final)) == len(final)
    stats = graph.stats()
    assert stats["tokens_stored"] == len(final) == 300 + 19 * 150 + 20 * 50
    assert stats["tokens_received"] == sum(
        len(t["prompt_ids"]) + len(t["sampled_ids"]) for t in turns
    )
    for node_id, fields in zip(ids, turns, strict=True):
        node = graph.get(node_id)
        assert_same(node.prompt_ids, fields["prompt_ids"])
        assert_same(node.sampled_ids, fields["sampled_ids"])
        assert_same(node.sampled_logprobs, fields["sampled_logprobs"])


def test_token_memory_is_proportional_to_distinct_tokens():
    def build() -> RolloutGraph:
        graph = RolloutGraph()
        add_all(graph, token_turns(20, n_prompt=2000, n_new=2000, n_sampled=300))
        return graph

    distinct = 2000 + 19 * 2000 + 20 * 300
    naive = sum(
        len(t["prompt_ids"]) for t in token_turns(20, n_prompt=2000, n_new=2000, n_sampled=300)
    )
    content = _retained(build) - _retained(_empty_graph)
    # ids: 4 bytes each; logprobs: 8 bytes per sampled token; plus per-turn bookkeeping
    assert content < 4 * distinct + 8 * 20 * 300 + 20 * 2048, (content, distinct, naive)


def test_roots_with_identical_prompt_share_one_copy():
    graph = RolloutGraph()
    prompt = list(range(10_000, 10_500))
    graph.add_turn(TurnNode(node_id="a", prompt_ids=list(prompt), sampled_ids=[1, 2, 3]))
    graph.add_turn(TurnNode(node_id="b", prompt_ids=list(prompt), sampled_ids=[4, 5]))
    graph.add_turn(TurnNode(node_id="c", prompt_ids=list(prompt), sampled_ids=[6]))
    assert graph.stats()["tokens_stored"] == 500 + 3 + 2 + 1
    assert graph.root_ids() == ["a", "b", "c"]
    for node_id in "abc":
        assert graph.get(node_id).prompt_ids == prompt


@pytest.mark.parametrize(
    "ids",
    [
        [0, 1, 2**32 - 1],
        [2**32, 2**32 + 1, 5],
        [2**63 - 1, 2**63, 2**64 - 1],
        [2**64, 2**64 + 7, 2**100],
        [-1, -(2**31), -(2**63), -(2**70)],
        [3, -3, 2**40, 2**70, 0],
    ],
)
def test_token_ids_of_any_size_come_back_exactly(ids):
    graph = RolloutGraph()
    prompt = ids + [7, 8]
    sampled = list(reversed(ids))
    logprobs = [-0.0, math.nan, -math.inf, 1e-300, -1.5][: len(sampled)]
    logprobs += [-1.0] * (len(sampled) - len(logprobs))
    graph.add_turn(
        TurnNode(node_id="a", prompt_ids=prompt, sampled_ids=sampled, sampled_logprobs=logprobs)
    )
    child = prompt + sampled + [1]
    graph.add_turn(TurnNode(node_id="b", prompt_ids=child, sampled_ids=ids[:1]))
    a, b = graph.get("a"), graph.get("b")
    assert_same(a.prompt_ids, prompt)
    assert_same(a.sampled_ids, sampled)
    assert_same(a.sampled_logprobs, logprobs)
    assert_same(b.prompt_ids, child)
    assert_same(b.sampled_ids, ids[:1])
    assert all(type(x) is int for x in a.prompt_ids + a.sampled_ids)
    assert same(graph.sequence_for("b").input_ids, child + ids[:1])


def test_token_and_message_turns_keep_logprob_bits():
    graph = RolloutGraph()
    logprobs = [-0.0, 0.0, math.nan, -math.inf, 5e-324, -1.2345678901234567]
    graph.add_turn(
        TurnNode(node_id="a", prompt_ids=[1], sampled_ids=[2] * 6, sampled_logprobs=logprobs)
    )
    got = graph.get("a").sampled_logprobs
    assert type(got) is list
    assert_same(got, logprobs)
    assert math.copysign(1.0, got[0]) == -1.0

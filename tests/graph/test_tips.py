"""Tips: a re-sent request holding long blob strings is confirmed by comparing those strings
with the conversation's tip (the request table's decoded tips; a raw text's with the blobs in
place) and hashing the rest, never by trusting xxh3; an edit anywhere (inside a long string,
beside it, between them) is never taken for the stored request, and everything links and
round-trips as without tips."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import msgpack
import pytest
from support import assert_same

from rollout_store import InvalidValueError, MemoryStore, RawJSON, RolloutGraph, TurnNode, _core
from rollout_store.engine import confirm as confirm_module
from rollout_store.engine.confirm import HOLE_MIN, holes_of

IMAGE = HOLE_MIN + 100  # long enough to be a hole (a raw tip's, and a decoded tip's)
#: Decoded tips a graph keeps (the request table's), and messages re-sent last that an edit
#: is kept away from (an edit there is a shorter base, whatever tips do)
MAX_TIPS = 64
WINDOW = 8


def _image(rng: random.Random) -> str:
    return "data:image/png;base64," + "".join(rng.choices("ABCDEFGHIJ+/0123", k=IMAGE))


def _conversation(n_turns: int, seed: int) -> list[tuple[list[Any], dict[str, Any]]]:
    """An agent that sees a screenshot each turn (and, now and then, two or none)."""
    rng = random.Random(seed)
    history: list[Any] = [{"role": "system", "content": "sys"}]
    out = []
    for t in range(n_turns):
        content: list[Any] = [{"type": "text", "text": f"step {t} {seed}"}]
        for _ in range(rng.choice([0, 1, 1, 2])):
            content.append({"type": "image_url", "image_url": {"url": _image(rng)}})
        history.append({"role": "user", "content": content})
        if rng.random() < 0.3:
            history.append({"role": "user", "content": "short " * rng.randrange(1, 5)})
        response = {"role": "assistant", "content": f"reply {t} {seed}"}
        out.append((list(history), response))
        history.append(response)
    return out


def _add_all(graph: RolloutGraph, turns: list[tuple[list[Any], dict[str, Any]]]) -> list[str]:
    ids = []
    for messages, response in turns:
        fresh = json.loads(json.dumps(messages))  # new objects, as a decoded body gives
        ids.append(graph.add_turn(TurnNode(request_messages=fresh, response_message=response)))
    return [view.node_id for view in ids]


def _tips(graph: RolloutGraph) -> int:
    """The graph's decoded tips (its request table's), to check they are used."""
    return graph._requests.table.decoded_tips


def _hits(graph: RolloutGraph) -> int:
    """Requests the graph's table read from a decoded tip on."""
    return graph._requests.table.decoded_tip_hits


def test_a_tip_is_kept_from_a_conversations_first_long_string() -> None:
    turns = _late_images(14, 4, 1)
    counts = []  # images (of IMAGE characters and a data URL's prefix) each request holds
    graph = RolloutGraph(share_threshold=HOLE_MIN)  # the tool outputs are no blobs
    tip_counts, ids = [], []
    for messages, response in turns:
        counts.append(json.dumps(messages).count("data:image/png"))
        fresh = json.loads(json.dumps(messages))
        view = graph.add_turn(TurnNode(request_messages=fresh, response_message=response))
        ids.append(view.node_id)
        tip_counts.append(_tips(graph))
    assert 0 in counts and counts[-1] > 0  # turns without images, and with
    assert tip_counts == [0 if c == 0 else 1 for c in counts]
    assert _hits(graph) == sum(1 for c in counts if c) - 1  # each turn after the first
    assert graph.path_ids(ids[-1]) == ids
    for node_id, (messages, response) in zip(ids, turns, strict=True):
        assert_same(graph.request_messages(node_id), messages)
        assert_same(graph.get(node_id).response_message, response)


def test_a_conversation_with_long_strings_continues_its_tip() -> None:
    graph = RolloutGraph()
    turns = _conversation(14, 1)
    ids = _add_all(graph, turns)
    assert graph.path_ids(ids[-1]) == ids
    for node_id, (messages, response) in zip(ids, turns, strict=True):
        assert_same(graph.request_messages(node_id), messages)
        assert_same(graph.get(node_id).response_message, response)
    assert _tips(graph) == 1 and _hits(graph) >= len(turns) - 3  # one tip, continued


def test_a_graph_without_blobs_of_its_own_keeps_no_decoded_tip() -> None:
    """No share threshold: the long strings are not the graph's own objects, and a tip
    would hold the last request's strings."""
    graph = RolloutGraph(share_threshold=None)
    turns = _conversation(6, 1)
    ids = _add_all(graph, turns)
    assert _tips(graph) == 0 and graph.path_ids(ids[-1]) == ids


def _edit_char(text: str, rng: random.Random) -> str:
    k = rng.randrange(len(text))
    return text[:k] + ("#" if text[k] != "#" else "%") + text[k + 1 :]


class _Colliding:
    """Stands in for `xxhash` in `confirm`: every digest 0, as crafted collisions would give."""

    @staticmethod
    def xxh3_64_intdigest(data: Any) -> int:
        return 0


def _edit_images(turns: list[tuple[list[Any], Any]], rng: random.Random) -> None:
    """Change one character of every image after the first text part of each message."""
    for messages, _ in turns:
        for m in messages:
            if isinstance(m["content"], list):
                for part in m["content"][1:]:
                    part["image_url"]["url"] = _edit_char(part["image_url"]["url"], rng)


@pytest.mark.parametrize("what", ["inside an image", "beside an image", "between images"])
@pytest.mark.parametrize("seed", range(3))
def test_an_edit_in_a_resent_request_with_long_strings_never_matches(what: str, seed: int) -> None:
    rng = random.Random(seed)
    graph = RolloutGraph()
    turns = _conversation(12, 10 + seed)
    _add_all(graph, turns)
    last, response = turns[-1]
    resent = json.loads(json.dumps([*last, response, {"role": "user", "content": "next"}]))
    edited = json.loads(json.dumps(resent))
    with_images = [
        i
        for i, m in enumerate(edited[1 : len(last) - WINDOW], 1)
        if isinstance(m["content"], list) and len(m["content"]) > 1
    ]
    where = rng.choice(with_images)
    message = edited[where]
    if what == "inside an image":
        url = message["content"][1]["image_url"]
        url["url"] = _edit_char(url["url"], rng)
    elif what == "beside an image":
        message["content"][0]["text"] = _edit_char(message["content"][0]["text"], rng)
    else:
        where = rng.choice([i for i in range(1, len(last) - 1) if i not in with_images])
        edited[where] = {**edited[where], "role": edited[where]["role"] + "!"}
    view = graph.add_turn(TurnNode(request_messages=edited))
    stored = graph._turn(view.node_id)
    assert stored.base is None or stored.base.n_rest + 1 <= where  # no base beyond the edit
    parent = graph.parent(view.node_id)
    assert parent is None or graph._turn(parent).n_rest + 1 <= where
    assert_same(graph.request_messages(view.node_id), edited)
    # the unedited continuation still finds its parent (through the tip)
    view = graph.add_turn(TurnNode(request_messages=resent))
    assert graph.parent(view.node_id) == f"turn-{len(turns) - 1}"
    assert_same(graph.request_messages(view.node_id), resent)


def test_tips_alike_but_for_their_long_strings_never_match() -> None:
    """Conversations of the same shape and text whose images differ (one in one character
    only): their tips agree on the last message's key and on the hollow digest wherever the
    last message holds no image, so only the strings' comparison tells them apart; each
    still continues its own turns only."""
    graph = RolloutGraph()
    a, b = _conversation(8, 5), _conversation(8, 5)
    # b: same shape and text, other images (and one that differs in one character only)
    _edit_images(b, random.Random(9))
    ids_a, ids_b = [], []
    # b's first turn, then all of a (each finds b's tip first), then the rest of b
    for ids, turns in ((ids_b, b[:1]), (ids_a, a), (ids_b, b[1:])):
        for messages, response in turns:
            view = graph.add_turn(TurnNode(request_messages=messages, response_message=response))
            ids.append(view.node_id)
    assert graph.path_ids(ids_a[-1]) == ids_a
    assert graph.path_ids(ids_b[-1]) == ids_b
    for node_id, (messages, _) in zip(ids_a + ids_b, a + b, strict=True):
        assert_same(graph.request_messages(node_id), messages)


def test_a_tip_confirms_only_the_very_strings_it_holds() -> None:
    """A request that re-sends the tip's messages but one long string (edited, longer,
    another type, gone) is never read from the tip: its base is the longest filed request
    before that string, as a table without tips finds it."""
    graph = RolloutGraph()
    turns = _conversation(6, 2)
    _add_all(graph, turns)
    table = graph._requests.table
    assert _tips(graph) == 1
    pack = _core.Packer(None, None)
    messages = json.loads(json.dumps([*turns[-1][0][1:], turns[-1][1]]))  # non-system
    n = len(messages) - 1  # the last turn's request: its tip
    assert table.find_messages(pack, messages)[2][1] == n
    where = max(
        i for i, m in enumerate(messages[:n]) if isinstance(m["content"], list) and m["content"][1:]
    )
    part = messages[where]["content"][1]["image_url"]
    blob = part["url"]
    below = table.find_messages(pack, messages[:where])[2][1]  # the base before it
    for other in (_edit_char(blob, random.Random(0)), blob + " ", [blob], None):
        part["url"] = other
        assert table.find_messages(pack, messages)[2][1] == below, other
    part["url"] = blob
    assert table.find_messages(pack, messages)[2][1] == n
    messages[where]["extra"] = 1  # anything else changed in the message: the digest differs
    assert table.find_messages(pack, messages)[2][1] == below


def test_a_placeholder_in_a_fresh_request_is_refused_and_changes_nothing() -> None:
    graph = RolloutGraph()
    turns = _conversation(5, 3)
    _add_all(graph, turns)
    before = graph.stats()
    messages = json.loads(json.dumps(turns[-1][0]))
    for m in messages:
        if isinstance(m["content"], list) and len(m["content"]) > 1:
            m["content"][1]["image_url"]["url"] = msgpack.ExtType(127, b"")
            break
    with pytest.raises(InvalidValueError):
        graph.add_turn(TurnNode(request_messages=messages))
    assert graph.stats() == before and len(graph) == len(turns)


def test_holes_are_long_blob_strings_as_values() -> None:
    graph = RolloutGraph()
    long = "x" * HOLE_MIN
    message = {"a": [1, {"b": long}], "c": "y" * 2000, "d": long, long: 1}
    graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "hi"}, message]))
    stored = graph._requests.encode(message, "m")[0]  # its blobs are in the table now
    holes = holes_of(stored, graph.blobs.string)
    assert sorted(path for path, _ in holes) == [("a", 1, "b"), ("d",)]
    assert all(blob == long for _, blob in holes)


def test_more_conversations_than_tips(tmp_path: Path) -> None:
    """Conversations beyond MAX_TIPS evict the oldest tips; every one still links, and the
    graph saves and loads (continuing there without tips)."""
    graph = RolloutGraph()
    conversations = [_conversation(3, 100 + k) for k in range(MAX_TIPS + 6)]
    ids: list[list[str]] = [[] for _ in conversations]
    for step in range(3):
        for k, turns in enumerate(conversations):
            messages, response = turns[step]
            view = graph.add_turn(TurnNode(request_messages=messages, response_message=response))
            ids[k].append(view.node_id)
    assert _tips(graph) == MAX_TIPS
    for chain in ids:
        assert graph.path_ids(chain[-1]) == chain
    path = tmp_path / "g.rls"
    graph.save(path)
    back = RolloutGraph.load(path)
    more = _conversation(5, 100)  # the first conversation, two more turns
    for messages, response in more[3:]:
        view = back.add_turn(TurnNode(request_messages=messages, response_message=response))
        assert_same(back.request_messages(view.node_id), messages)
    assert back.path_ids(view.node_id) == [*ids[0], f"turn-{len(graph)}", view.node_id]


def _late_images(n_turns: int, first_image: int, seed: int) -> list[tuple[list[Any], Any]]:
    """Short text for the first turns, then a screenshot each turn (and a tool output of a
    few KiB, a blob too short to be a hole)."""
    rng = random.Random(seed)
    history: list[Any] = [{"role": "system", "content": "sys"}]
    out = []
    for t in range(n_turns):
        content: list[Any] = [{"type": "text", "text": f"step {t}"}]
        if t >= first_image:
            content.append({"type": "image_url", "image_url": {"url": _image(rng)}})
        history.append({"role": "user", "content": content})
        history.append({"role": "tool", "content": "out " * 1000 + str(t)})
        response = {"role": "assistant", "content": f"reply {t}"}
        out.append((list(history), response))
        history.append(response)
    return out


def test_a_tip_is_worked_out_whole_where_long_strings_first_appear(tmp_path: Path) -> None:
    """No tip while a conversation holds no long string; its first one makes a tip, which
    the next turns continue; a loaded graph has none until its next turn leaves one."""
    turns = _late_images(12, 4, 7)
    graph = RolloutGraph(share_threshold=HOLE_MIN)  # the tool outputs are no blobs
    ids = _add_all(graph, turns[:4])
    assert _tips(graph) == 0  # nothing long yet
    ids += _add_all(graph, turns[4:8])
    assert _tips(graph) == 1 and _hits(graph) == 3  # turns 5 to 7 continued the tip of turn 4
    assert graph.path_ids(ids[-1]) == ids
    path = tmp_path / "g.rls"
    graph.save(path)
    back = RolloutGraph.load(path)
    assert _tips(back) == 0
    more = _add_all(back, turns[8:])
    assert _tips(back) == 1 and _hits(back) == 3  # a tip from turn 8, continued after
    assert back.path_ids(more[-1]) == ids + more
    for node_id, (messages, response) in zip(ids + more, turns, strict=True):
        assert_same(back.request_messages(node_id), messages)
        assert_same(back.get(node_id).response_message, response)


def _raw(messages: list[Any]) -> RawJSON:
    return RawJSON(json.dumps(messages).encode())


def _raw_tips(graph: RolloutGraph) -> list[Any]:
    return list(graph._requests.raw_tips._order.values())


def test_raw_turns_compare_long_strings_and_hash_the_rest() -> None:
    graph = RolloutGraph()
    turns = _conversation(10, 21)
    ids = []
    for messages, response in turns:
        view = graph.add_turn(TurnNode(request_messages=_raw(messages), response_message=response))
        ids.append(view.node_id)
    assert graph.path_ids(ids[-1]) == ids
    for node_id, (messages, _) in zip(ids, turns, strict=True):
        assert_same(graph.request_messages(node_id), messages)
    (tip,) = _raw_tips(graph)
    images = [
        part["image_url"]["url"]
        for m in turns[-1][0]
        if isinstance(m["content"], list)
        for part in m["content"][1:]
    ]
    assert [blob for _, _, blob in tip.holes] == images  # each image, in order


@pytest.mark.parametrize("seed", range(3))
def test_a_raw_conversation_compares_its_long_strings_in_place(seed: int) -> None:
    """Raw texts compare their long strings in place (a screenshot re-sent every turn, which
    BLAKE3 would hash at a tenth of a comparison's speed), from the raw tip their first
    text, decoded whole, leaves. An edit inside one never matches; everything links as
    before."""
    rng = random.Random(seed)
    image = _image(rng)
    history: list[Any] = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]},
    ]
    graph = RolloutGraph()
    ids = []
    for t in range(6):
        response = {"role": "assistant", "content": f"reply {t}"}
        view = graph.add_turn(TurnNode(request_messages=_raw(history), response_message=response))
        ids.append(view.node_id)
        assert_same(graph.request_messages(view.node_id), history)
        history = [*history, response, {"role": "user", "content": f"next {t}"}]
    assert graph.path_ids(ids[-1]) == ids
    (tip,) = _raw_tips(graph)
    assert [blob for _, _, blob in tip.holes] == [image]
    edited = json.loads(json.dumps(history))
    url = edited[1]["content"][0]["image_url"]
    url["url"] = _edit_char(url["url"], rng)
    view = graph.add_turn(TurnNode(request_messages=_raw(edited)))
    assert graph.parent(view.node_id) is None
    assert_same(graph.request_messages(view.node_id), edited)
    view = graph.add_turn(TurnNode(request_messages=_raw(history)))
    assert graph.parent(view.node_id) == ids[-1]
    assert_same(graph.request_messages(view.node_id), history)


@pytest.mark.parametrize("seed", range(3))
def test_an_edit_inside_a_long_string_of_a_raw_text_never_matches(seed: int) -> None:
    rng = random.Random(seed)
    graph = RolloutGraph()
    turns = _conversation(10, 30 + seed)
    for messages, response in turns:
        graph.add_turn(TurnNode(request_messages=_raw(messages), response_message=response))
    last, response = turns[-1]
    resent = json.loads(json.dumps([*last, response, {"role": "user", "content": "next"}]))
    edited = json.loads(json.dumps(resent))
    with_images = [
        i for i, m in enumerate(edited) if isinstance(m["content"], list) and len(m["content"]) > 1
    ]
    where = rng.choice(with_images[:-1])
    url = edited[where]["content"][1]["image_url"]
    url["url"] = _edit_char(url["url"], rng)
    view = graph.add_turn(TurnNode(request_messages=_raw(edited)))
    stored = graph._turn(view.node_id)
    assert stored.base is None or stored.base.n_rest + 1 <= where  # (where counts the system)
    parent = graph.parent(view.node_id)
    assert parent is None or graph._turn(parent).n_rest + 1 <= where
    assert_same(graph.request_messages(view.node_id), edited)
    view = graph.add_turn(TurnNode(request_messages=_raw(resent)))
    assert graph.parent(view.node_id) == f"turn-{len(turns) - 1}"
    assert_same(graph.request_messages(view.node_id), resent)


def test_crafted_xxh3_collisions_of_raw_tips_never_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every raw tip under one head key and one check (as crafted xxh3 collisions would
    make them): texts that differ in an image only continue their own turns."""

    monkeypatch.setattr(confirm_module, "xxhash", _Colliding)
    graph = RolloutGraph()
    a, b = _conversation(6, 40), _conversation(6, 40)
    _edit_images(b, random.Random(3))
    ids_a: list[Any] = []
    ids_b: list[Any] = []
    # b's first turn, then all of a (each finds b's tip first), then the rest of b
    for ids, turns in ((ids_b, b[:1]), (ids_a, a), (ids_b, b[1:])):
        for messages, response in turns:
            ids.append(
                graph.add_turn(TurnNode(request_messages=_raw(messages), response_message=response))
            )
    for views, turns in ((ids_a, a), (ids_b, b)):
        chain = [view.node_id for view in views]
        assert graph.path_ids(chain[-1]) == chain
        for node_id, (messages, _) in zip(chain, turns, strict=True):
            assert_same(graph.request_messages(node_id), messages)


def test_a_tip_continues_past_a_turn_that_adds_more_than_the_window() -> None:
    """A turn adding more messages than the base-finder's window is read from the tip; the
    tip it leaves holds them too, and later turns continue it."""
    graph = RolloutGraph()
    turns = _conversation(4, 50)
    ids = _add_all(graph, turns)
    hits = _hits(graph)
    messages, response = turns[-1]
    many = [{"role": "user", "content": f"note {k}"} for k in range(WINDOW + 4)]
    longer = [*messages, response, *many]
    ids.append(graph.add_turn(TurnNode(request_messages=longer, response_message=response)).node_id)
    assert _tips(graph) == 1 and _hits(graph) == hits + 1
    following = [*longer, response, {"role": "user", "content": "and then"}]
    view = graph.add_turn(TurnNode(request_messages=json.loads(json.dumps(following))))
    assert graph.path_ids(view.node_id) == [*ids, view.node_id]
    assert _tips(graph) == 1 and _hits(graph) == hits + 2
    assert_same(graph.request_messages(view.node_id), following)


@pytest.mark.parametrize("raw", [False, True])
def test_blob_strings_shorter_than_holes_make_no_tip_until_a_long_one(raw: bool) -> None:
    """Tool outputs kept as blobs but shorter than HOLE_MIN are hashed with the rest (no raw
    hole; no decoded tip below the graph's share threshold, HOLE_MIN here); the first long
    string makes a tip holding it alone, which later turns continue, and everything
    round-trips."""
    rng = random.Random(5)
    history: list[Any] = [{"role": "system", "content": "sys"}]
    turns = []
    for t in range(8):
        output = "".join(rng.choices("abcdef ", k=HOLE_MIN // 2))  # a blob, not a hole
        history.append({"role": "tool", "tool_call_id": f"c{t}", "content": output})
        if t == 4:
            history.append({"role": "user", "content": [{"type": "text", "text": _image(rng)}]})
        response = {"role": "assistant", "content": f"reply {t}"}
        turns.append((list(history), response))
        history.append(response)
    graph = RolloutGraph(share_threshold=HOLE_MIN // 4)
    graph_tips = graph._requests.table
    ids = []
    for t, (messages, response) in enumerate(turns):
        given: Any = _raw(messages) if raw else json.loads(json.dumps(messages))
        ids.append(graph.add_turn(TurnNode(request_messages=given, response_message=response)))
        holes = [h for tip in _raw_tips(graph) for h in tip.holes] if raw else None
        if raw:
            assert len(holes) == (t >= 4)  # the long string alone
    if not raw:
        # (HOLE_MIN // 2 characters: a decoded tip's holes from the share threshold on)
        assert graph_tips.decoded_tips == 1 and graph_tips.decoded_tip_hits == 7
    node_ids = [view.node_id for view in ids]
    assert graph.path_ids(node_ids[-1]) == node_ids
    for node_id, (messages, response) in zip(node_ids, turns, strict=True):
        assert_same(graph.request_messages(node_id), messages)
        assert_same(graph.get(node_id).response_message, response)


def test_graphs_over_one_store_keep_no_decoded_tip() -> None:
    """Graphs over one content store hold one object of a string that each got from its own
    requests: a tip would keep a copy of each conversation's long strings (a capture
    server's sessions, one screenshot shared by a group), so they keep none, and every turn
    links and round-trips all the same."""
    store = MemoryStore()
    for seed in range(2):
        graph = RolloutGraph(store=store)
        turns = _conversation(5, 70 + seed)
        ids = _add_all(graph, turns)
        assert _tips(graph) == 0 and graph.path_ids(ids[-1]) == ids
        for node_id, (messages, _) in zip(ids, turns, strict=True):
            assert_same(graph.request_messages(node_id), messages)


def _shared_image_conversations(n: int, turns: int) -> list[list[tuple[list[Any], Any]]]:
    """`n` conversations that all begin with one task: a text and one 64 KiB screenshot (a
    GRPO group's prompt), then go their own ways."""
    rng = random.Random(99)
    image = "data:image/png;base64," + "".join(rng.choices("ABCDEFGHIJ+/0123", k=64 * 1024))
    task = {"role": "user", "content": [{"type": "text", "text": "the task"}]}
    task["content"].append({"type": "image_url", "image_url": {"url": image}})
    out = []
    for seed in range(n):
        history: list[Any] = [{"role": "system", "content": "sys"}, task]
        conversation = []
        for t in range(turns):
            response = {"role": "assistant", "content": f"reply {t} {seed}"}
            conversation.append((list(history), response))
            history += [response, {"role": "user", "content": f"tool output {t} {seed}"}]
        out.append(conversation)
    return out


def _blob_strings(graph: RolloutGraph) -> list[str]:
    blobs = graph._requests.blobs
    return [blobs.string(i) for i in range(len(blobs))]


def test_a_tip_holds_the_graphs_own_string_not_the_requests_copy() -> None:
    """Conversations of one graph that share a long string each get it as a fresh object
    (each body decoded from its own text): every tip holds the blob table's object, never a
    copy of its own (16 conversations sharing a 200 KiB screenshot would keep 16 copies)."""
    graph = RolloutGraph(share_threshold=HOLE_MIN)
    conversations = _shared_image_conversations(4, 3)
    ids = [_add_all(graph, conversation) for conversation in conversations]
    strings = graph._requests.table.tip_strings()
    assert _tips(graph) == 4 and len(strings) == 4 and _hits(graph) == 8
    stored = _blob_strings(graph)
    assert len(stored) == 1
    assert all(string is stored[0] for string in strings)
    for conversation, node_ids in zip(conversations, ids, strict=True):
        assert graph.path_ids(node_ids[-1]) == node_ids
        for node_id, (messages, _) in zip(node_ids, conversation, strict=True):
            assert_same(graph.request_messages(node_id), messages)


def test_a_graph_of_conversations_sharing_a_screenshot_keeps_it_once() -> None:
    """What the process keeps, counted by tracemalloc (the tips' string references are
    Python objects): 8 conversations sharing a 64 KiB string keep about one copy of it."""
    import gc
    import tracemalloc

    conversations = _shared_image_conversations(8, 3)
    image_bytes = len(conversations[0][0][0][1]["content"][1]["image_url"]["url"])
    bodies = [[json.dumps(m) for m, _ in c] for c in conversations]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        graph = RolloutGraph(share_threshold=HOLE_MIN)
        for conversation, texts in zip(conversations, bodies, strict=True):
            for (_, response), text in zip(conversation, texts, strict=True):
                graph.add_turn(
                    TurnNode(request_messages=json.loads(text), response_message=response)
                )
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert _tips(graph) == 8
    assert retained < 2 * image_bytes, (retained, image_bytes)

"""Tips: a re-sent request holding long blob strings is confirmed by comparing those strings
with the blobs and hashing the rest, never by trusting xxh3; an edit anywhere (inside a long
string, beside it, between them) is never taken for the stored request, and everything
links and round-trips as without tips."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import msgpack
import pytest
from support import assert_same

from rollout_store import InvalidValueError, RawJSON, RolloutGraph, TurnNode
from rollout_store.engine import confirm as confirm_module
from rollout_store.engine import requests as requests_module
from rollout_store.engine.confirm import _HOLE, HOLE_MIN, MAX_TIPS, WINDOW, holes_of, hollowed

IMAGE = HOLE_MIN + 100  # long enough to be a hole


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


def _tips(graph: RolloutGraph) -> Any:
    return graph._requests.tips  # the graph's tips, to check they are used


@pytest.fixture(autouse=True)
def _tips_from_the_first_hole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tips for every conversation with a long string, so these short images exercise them
    (a graph keeps one only from TIP_MIN_BYTES of such strings on: see the tests below)."""
    monkeypatch.setattr(requests_module, "TIP_MIN_BYTES", 0)


def test_a_tip_is_kept_only_once_its_long_strings_are_worth_its_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(requests_module, "TIP_MIN_BYTES", 3 * IMAGE)
    turns = _conversation(14, 1)
    counts = []  # images (of IMAGE characters and a data URL's prefix) each request holds
    graph = RolloutGraph()
    tip_counts, ids = [], []
    for messages, response in turns:
        counts.append(json.dumps(messages).count("data:image/png"))
        fresh = json.loads(json.dumps(messages))
        view = graph.add_turn(TurnNode(request_messages=fresh, response_message=response))
        ids.append(view.node_id)
        tip_counts.append(len(_tips(graph)._by_turn))
    assert counts[0] < 3 <= counts[-1]  # the conversation crosses the threshold
    assert tip_counts == [0 if c < 3 else 1 for c in counts]
    # and every turn is kept and linked as with a tip from the first image on
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
    tips = list(_tips(graph)._by_turn.values())
    assert len(tips) == 1 and tips[0].holes  # one tip, where its images are


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


def test_crafted_xxh3_collisions_of_tips_never_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tip filed under one key (as a crafted xxh3 collision of last messages would):
    conversations of the same shape still continue their own turns only."""

    monkeypatch.setattr(confirm_module, "xxhash", _Colliding)
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
    graph = RolloutGraph()
    turns = _conversation(6, 2)
    _add_all(graph, turns)
    (tip,) = _tips(graph)._by_turn.values()
    messages = json.loads(json.dumps(turns[-1][0][1:]))  # its non-system messages
    pack = graph._requests._packer().pack
    assert tip.confirm(messages, pack) is not None
    i, holes = tip.holes[0]
    path, blob = holes[0]
    node = messages[i]
    for key in path[:-1]:
        node = node[key]
    for other in (
        _edit_char(blob, random.Random(0)),
        blob + " ",
        [blob],
        msgpack.ExtType(127, b""),  # what stands for a hole: never taken for one
        None,
    ):
        node[path[-1]] = other
        assert tip.confirm(messages, pack) is None, other
    node[path[-1]] = blob
    assert tip.confirm(messages, pack) is not None
    messages[i]["extra"] = 1  # anything else changed in the message: the digest differs
    assert tip.confirm(messages, pack) is None


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
    hollow = hollowed(message, holes)
    assert hollow["a"][1]["b"] is _HOLE and hollow["d"] is _HOLE
    assert message["a"][1]["b"] == long and message["d"] == long  # the message is untouched
    assert hollow["c"] is message["c"] and list(hollow) == list(message)


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
    assert len(_tips(graph)._by_turn) == MAX_TIPS
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


def _count_tip_confirms(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """A list that gets, for every `Tip.confirm` call from now on, whether it confirmed."""
    confirmed: list[bool] = []
    original = confirm_module.Tip.confirm

    def counting(self: Any, messages: Any, pack: Any) -> Any:
        result = original(self, messages, pack)
        confirmed.append(result is not None)
        return result

    monkeypatch.setattr(confirm_module.Tip, "confirm", counting)
    return confirmed


def test_a_tip_is_worked_out_whole_where_long_strings_first_appear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No tip while a conversation holds no long string; its first one makes a tip from the
    stored tails (a loaded graph's too), which the next turns continue."""
    confirmed = _count_tip_confirms(monkeypatch)
    turns = _late_images(12, 4, 7)
    graph = RolloutGraph()
    ids = _add_all(graph, turns[:4])
    assert not _tips(graph)  # nothing long yet
    ids += _add_all(graph, turns[4:8])
    (tip,) = _tips(graph)._by_turn.values()
    assert [i for i, _ in tip.holes] == [3 * k for k in range(4, 8)]  # the images only
    assert confirmed == [True, True, True]  # turns 5 to 7 continued the tip of turn 4
    assert graph.path_ids(ids[-1]) == ids
    path = tmp_path / "g.rls"
    graph.save(path)
    back = RolloutGraph.load(path)
    assert not _tips(back)
    confirmed.clear()
    more = _add_all(back, turns[8:])
    assert confirmed == [True, True, True]  # a tip from the loaded tails at turn 8
    (tip,) = _tips(back)._by_turn.values()
    assert [i for i, _ in tip.holes] == [3 * k for k in range(4, 12)]
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
def test_a_raw_conversation_compares_its_long_strings_where_no_decoded_tip_is_kept(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Below TIP_MIN_BYTES of long strings a conversation keeps no decoded tip; its raw
    texts still compare their long strings in place (a screenshot re-sent every turn, which
    BLAKE3 would hash at a tenth of a comparison's speed), from the raw tip its first text,
    decoded whole, leaves. An edit inside one never matches; everything links as before."""
    monkeypatch.setattr(requests_module, "TIP_MIN_BYTES", 1 << 20)
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
    assert not _tips(graph)  # (no decoded tip: too little of long strings)
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
    """A turn adding more messages than the probed window is confirmed by the plain digest;
    the tip it leaves is hollowed again from its messages and later turns continue it."""
    graph = RolloutGraph()
    turns = _conversation(4, 50)
    ids = _add_all(graph, turns)
    messages, response = turns[-1]
    many = [{"role": "user", "content": f"note {k}"} for k in range(WINDOW + 4)]
    longer = [*messages, response, *many]
    ids.append(graph.add_turn(TurnNode(request_messages=longer, response_message=response)).node_id)
    (tip,) = _tips(graph)._by_turn.values()
    assert tip.turn is graph._turn(ids[-1]) and tip.n == len(longer) - 1
    following = [*longer, response, {"role": "user", "content": "and then"}]
    view = graph.add_turn(TurnNode(request_messages=json.loads(json.dumps(following))))
    assert graph.path_ids(view.node_id) == [*ids, view.node_id]
    (tip,) = _tips(graph)._by_turn.values()
    assert tip.turn is graph._turn(view.node_id)
    assert_same(graph.request_messages(view.node_id), following)


@pytest.mark.parametrize("raw", [False, True])
def test_blob_strings_shorter_than_holes_make_no_tip_until_a_long_one(
    raw: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tool outputs kept as blobs but shorter than HOLE_MIN are hashed with the rest (no tip,
    no hole); the first long string makes a tip holding it alone, which later turns
    continue, and everything round-trips."""
    confirmed = _count_tip_confirms(monkeypatch)
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
    graph = RolloutGraph()
    ids = []
    for t, (messages, response) in enumerate(turns):
        given: Any = _raw(messages) if raw else json.loads(json.dumps(messages))
        ids.append(graph.add_turn(TurnNode(request_messages=given, response_message=response)))
        holes = [h for tip in _raw_tips(graph) for h in tip.holes] if raw else None
        if raw:
            assert len(holes) == (t >= 4)  # the long string alone
        elif t < 4:
            assert not _tips(graph)
        else:
            (tip,) = _tips(graph)._by_turn.values()
            assert [i for i, _ in tip.holes] == [9]  # the long string's message alone
    if not raw:
        assert confirmed == [True, True, True]  # turns 5 to 7 continued the tip of turn 4
    node_ids = [view.node_id for view in ids]
    assert graph.path_ids(node_ids[-1]) == node_ids
    for node_id, (messages, response) in zip(node_ids, turns, strict=True):
        assert_same(graph.request_messages(node_id), messages)
        assert_same(graph.get(node_id).response_message, response)

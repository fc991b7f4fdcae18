"""A turn's token fields packed in one object: its new prompt ids, sampled ids and logprobs
in one bytes object of the turn (a `PackedPrompt` itself, with `PackedFull` over it), read
back exactly, matched in place, unpacked when a field is set, and a bounded memory per turn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
from support import token_turns

from rollout_store import RolloutGraph, TurnNode
from rollout_store.engine.stored import HAS_TOKENS, Turn
from rollout_store.engine.tokens import (
    ArrayRun,
    PackedFull,
    PackedPrompt,
    PromptAlone,
    run_bytes,
    run_list,
    run_matches,
)


def _turns(graph: RolloutGraph) -> list[Turn]:
    return graph._turns  # type: ignore[attr-defined]  # the stored turns, to check how they are kept


def test_a_continuation_keeps_its_token_fields_in_one_packed_prompt() -> None:
    turns = token_turns(4, n_new=5, n_sampled=7)
    graph = RolloutGraph()
    for fields in turns:
        graph.add_turn(TurnNode(**fields))
    stored = _turns(graph)
    # a root packs its sampled ids and logprobs too, over its prompt's run (shared through
    # the store), with no new ids of its own
    root = stored[0]
    assert root.prompt is root and type(root.after) is ArrayRun and root.after.prev is None
    assert len(root.seg) == 0 and type(root.full) is PackedFull
    assert run_list(root.full) == turns[0]["prompt_ids"] + turns[0]["sampled_ids"]
    assert root.sampled == array("I", turns[0]["sampled_ids"])
    for k in (1, 2, 3):
        turn = stored[k]
        assert turn.prompt is turn and type(turn.full) is PackedFull
        # the full run is a view over the prompt, equal to any other view over it; the
        # prompt keeps its parent's packed prompt, standing for that one's full run
        assert turn.full.prev is turn.prompt and turn.prompt.prev == stored[k - 1].full
        assert turn.prompt.after is stored[k - 1].prompt
        assert run_list(turn.prompt) == turns[k]["prompt_ids"]
        assert run_list(turn.full) == turns[k]["prompt_ids"] + turns[k]["sampled_ids"]
        assert turn.prompt.length == len(turns[k]["prompt_ids"])
        assert turn.sampled == array("I", turns[k]["sampled_ids"])
        assert turn.logprobs == array("d", turns[k]["sampled_logprobs"])
        node = graph.get(f"turn-{k}")
        assert node.prompt_ids == turns[k]["prompt_ids"]
        assert node.sampled_ids == turns[k]["sampled_ids"]
        assert json.dumps(node.sampled_logprobs) == json.dumps(turns[k]["sampled_logprobs"])
    sequence = graph.sequence_for("turn-3")
    assert sequence.input_ids == turns[3]["prompt_ids"] + turns[3]["sampled_ids"]
    assert sum(sequence.loss_mask) == 4 * 7


def test_packed_runs_match_by_bytes_exactly() -> None:
    turns = token_turns(3, n_new=3, n_sampled=4)
    graph = RolloutGraph()
    for fields in turns:
        graph.add_turn(TurnNode(**fields))
    full = _turns(graph)[2].full
    data = array("I", turns[2]["prompt_ids"] + turns[2]["sampled_ids"]).tobytes()
    assert full.compact and run_bytes(full) == data
    assert run_matches(full, data) and run_matches(full, data + b"\x01\x00\x00\x00")
    assert not run_matches(full, data[:-4])  # shorter than the run
    for at in range(0, len(data), 4):  # a different id anywhere (each part of the chain)
        changed = bytearray(data)
        changed[at] ^= 1
        assert not run_matches(full, bytes(changed)), at


def test_a_turn_without_sampled_ids_or_logprobs_packs_them_as_none() -> None:
    turns = token_turns(2)
    graph = RolloutGraph()
    graph.add_turn(TurnNode(**turns[0]))
    failed = {"prompt_ids": turns[1]["prompt_ids"], "sampled_ids": [], "sampled_logprobs": None}
    graph.add_turn(TurnNode(**failed))
    turn = _turns(graph)[1]
    assert turn.prompt is turn and turn.full is turn.prompt
    assert turn.sampled == array("I") and turn.logprobs is None
    node = graph.get("turn-1")
    assert node.sampled_ids == [] and node.sampled_logprobs is None
    no_ids = {
        "prompt_ids": turns[1]["prompt_ids"] + [7],
        "sampled_ids": None,
        "sampled_logprobs": [-1.5],
    }
    graph.add_turn(TurnNode(**no_ids))
    assert graph.get("turn-2").sampled_ids is None
    assert graph.get("turn-2").sampled_logprobs == [-1.5]


def test_a_retry_shares_the_packed_prompt_and_keeps_its_own_sampled_ids() -> None:
    turns = token_turns(2, n_sampled=3)
    graph = RolloutGraph()
    graph.add_turn(TurnNode(**turns[0]))
    graph.add_turn(TurnNode(**turns[1]))
    retry = {**turns[1], "sampled_ids": [1, 2, 3, 4], "sampled_logprobs": [-0.5] * 4}
    graph.add_turn(TurnNode(**retry))
    first, second = _turns(graph)[1], _turns(graph)[2]
    assert second.prompt is first.prompt and type(second.full) is ArrayRun
    assert graph.get("turn-1").sampled_ids == turns[1]["sampled_ids"]
    assert graph.get("turn-2").sampled_ids == [1, 2, 3, 4]
    assert graph.get("turn-2").sampled_logprobs == [-0.5] * 4
    assert graph.child_ids("turn-0") == ["turn-1", "turn-2"]


def test_setting_a_token_field_of_a_packed_turn_unpacks_the_others() -> None:
    turns = token_turns(2, n_sampled=5)
    graph = RolloutGraph()
    for fields in turns:
        graph.add_turn(TurnNode(**fields))
    turn = _turns(graph)[1]
    prompt = turn.prompt
    turn.logprobs = None
    assert turn.prompt is prompt and turn.sampled == array("I", turns[1]["sampled_ids"])
    assert turn.logprobs is None


def _token_fields(graph: RolloutGraph) -> str:
    nodes = [graph.get(n) for n in graph.node_ids()]
    return json.dumps([[n.prompt_ids, n.sampled_ids, n.sampled_logprobs] for n in nodes])


def test_packed_turns_survive_a_file(tmp_path: Path) -> None:
    turns = token_turns(5, n_new=6, n_sampled=9)
    path = tmp_path / "tokens.rls"
    graph = RolloutGraph.open(path)
    for fields in turns:
        graph.add_turn(TurnNode(**fields))
    expected = _token_fields(graph)
    assert expected == json.dumps(
        [[t["prompt_ids"], t["sampled_ids"], t["sampled_logprobs"]] for t in turns]
    )
    graph.close()
    reopened = RolloutGraph.open(path)
    assert _token_fields(reopened) == expected
    assert reopened.get("turn-4").parent_id == "turn-3"
    # read back as add_turn keeps them: a continuation's token fields packed
    stored = _turns(reopened)
    assert all(t.prompt is t for t in stored) and type(stored[0].after) is ArrayRun
    assert all(type(t.full) is PackedFull and t.full.prev is t.prompt for t in stored)
    reopened.close()


@pytest.mark.slow
def test_a_token_turn_keeps_a_bounded_memory() -> None:
    """What a graph keeps per continuation turn (8 new prompt ids, 16 sampled ids with
    logprobs, a short message and response: 224 bytes of token content), by tracemalloc in a
    child process (this suite's fixtures keep every graph alive). Two runs and three arrays a
    turn, its prompt filed by its key, kept 1,207 bytes here; packed and unfiled, 869."""
    child = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve().parents[1] / "support" / "token_memory.py"),
            "300",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert child.returncode == 0, child.stderr[-2000:]
    figures = json.loads(child.stdout)
    assert figures["content"] == 224
    assert figures["per_turn"] <= 1000, figures


def test_a_retry_after_reopening_shares_the_prompt_and_a_saved_copy_equals_the_log(
    tmp_path: Path,
) -> None:
    turns = token_turns(3, n_sampled=4)
    retry = {**turns[2], "sampled_ids": [7, 8], "sampled_logprobs": [-1.0, -2.0]}
    path = tmp_path / "log.rls"
    graph = RolloutGraph.open(path)
    for fields in (*turns, retry):
        graph.add_turn(TurnNode(**fields))
    graph.save(tmp_path / "saved.rls")
    graph.close()
    for name in ("log.rls", "saved.rls"):
        opened = RolloutGraph.open if name == "log.rls" else RolloutGraph.load
        reopened = opened(tmp_path / name)
        reopened.add_turn(TurnNode(**{**turns[2], "sampled_ids": [9], "sampled_logprobs": [-3.0]}))
        stored = _turns(reopened)
        assert stored[4].prompt is stored[2].prompt, name
        assert reopened.child_ids("turn-1") == ["turn-2", "turn-3", "turn-4"], name
        assert _token_fields(reopened) == json.dumps(
            [
                [t["prompt_ids"], t["sampled_ids"], t["sampled_logprobs"]]
                for t in (
                    *turns,
                    retry,
                    {**turns[2], "sampled_ids": [9], "sampled_logprobs": [-3.0]},
                )
            ]
        ), name
        reopened.close()


def test_a_packed_turn_keeps_no_full_run_and_each_view_is_equal() -> None:
    """A packed turn's prompt + sampled run is a view made when asked for: the turn keeps
    none (nor does its child's prompt, which keeps the parent's packed prompt), and every
    view over one prompt is equal to the others, with the same tokens."""
    import gc

    turns = token_turns(4, n_new=5, n_sampled=7)
    graph = RolloutGraph()
    for fields in turns:
        graph.add_turn(TurnNode(**fields))
    gc.collect()
    stored = _turns(graph)
    kept = [o for o in gc.get_referents(*stored) if type(o) is PackedFull]
    kept += [o for t in stored[1:] for o in gc.get_referents(t.prompt) if type(o) is PackedFull]
    assert kept == []
    for turn in stored[1:]:
        views = turn.full, turn.full
        assert views[0] is not views[1] and views[0] == views[1]
        assert hash(views[0]) == hash(views[1]) and run_list(views[0]) == run_list(views[1])
    assert stored[2].prompt.prev == stored[1].full and stored[2].prompt.prev != stored[2].full


def test_a_continuation_of_a_retry_that_sampled_nothing_extends_the_prompt_alone(
    tmp_path: Path,
) -> None:
    """A retry that sampled nothing shares its sibling's packed prompt as its full run; a
    turn that continues the retry extends that prompt alone, not the prompt and the
    sibling's sampled ids (which a packed prompt kept after another stands for): its tokens
    come back exactly, linked under the retry, in memory and from a file."""
    turns = token_turns(2, n_new=5, n_sampled=7)
    path = tmp_path / "retry.rls"
    graph = RolloutGraph.open(path)
    for fields in turns:
        graph.add_turn(TurnNode(**fields))
    graph.add_turn(TurnNode(prompt_ids=turns[1]["prompt_ids"], sampled_ids=[]))  # turn-2
    sibling = turns[1]["sampled_ids"]
    extra = [90_001, 90_002, 90_003]
    assert extra[: len(sibling)] != sibling
    prompt = turns[1]["prompt_ids"] + extra
    graph.add_turn(TurnNode(prompt_ids=prompt, sampled_ids=[5, 6], sampled_logprobs=[-1.0] * 2))
    stored = _turns(graph)
    retry, child = stored[2], stored[3]
    assert retry.prompt is stored[1].prompt and retry.full is retry.prompt
    assert child.prompt is child and type(child.prompt.after) is PromptAlone
    assert child.prompt.prev is retry.full
    assert run_list(child.prompt) == prompt and child.prompt.length == len(prompt)
    assert run_list(child.full) == [*prompt, 5, 6]
    assert run_matches(child.prompt, array("I", prompt).tobytes())
    assert not run_matches(child.prompt, array("I", turns[1]["prompt_ids"] + sibling).tobytes())
    assert graph.get("turn-3").parent_id == "turn-2"
    assert graph.get("turn-3").prompt_ids == prompt
    expected = _token_fields(graph)
    graph.close()
    reopened = RolloutGraph.load(path)
    assert _token_fields(reopened) == expected
    assert reopened.get("turn-3").parent_id == "turn-2"


def test_a_token_turn_is_its_own_prompt_and_keeps_no_chain_node_apart() -> None:
    """A token turn's prompt is the turn itself (its packed bytes are its new prompt ids,
    sampled ids and logprobs; a root's, no new ids over its prompt's run): no token run
    object is kept besides the turns, but for the root's prompt run; a retry's prompt is its
    sibling turn, matched in place like any run."""
    import gc

    from rollout_store.engine.tokens import TokenRun

    turns = token_turns(4, n_new=5, n_sampled=7)
    graph = RolloutGraph()
    for fields in turns:
        graph.add_turn(TurnNode(**fields))
    graph.add_turn(TurnNode(prompt_ids=turns[3]["prompt_ids"], sampled_ids=[8, 9]))  # a retry
    gc.collect()
    stored = _turns(graph)
    kept = [o for o in gc.get_referents(*stored) if isinstance(o, TokenRun)]
    apart = {id(o) for o in kept if type(o) is not Turn}
    # the root's prompt run (under the root turn, packed) and the retry's full
    assert apart == {id(stored[0].after), id(stored[4].full)}
    assert type(stored[0].after) is ArrayRun and stored[1].after is stored[0]
    for turn in stored[0:4]:
        assert turn.prompt is turn and turn.flags & HAS_TOKENS and turn.after is not None
    retry = stored[4]
    assert (
        not retry.flags & HAS_TOKENS and retry.prompt is stored[3] and type(retry.full) is ArrayRun
    )
    assert run_list(retry.full) == [*turns[3]["prompt_ids"], 8, 9]
    assert retry.prompt.compact and run_matches(
        retry.full, array("I", run_list(retry.full)).tobytes()
    )
    for k, fields in enumerate(turns):
        node = graph.get(f"turn-{k}")
        assert node.prompt_ids == fields["prompt_ids"]
        assert node.sampled_ids == fields["sampled_ids"]
        assert node.sampled_logprobs == fields["sampled_logprobs"]


def test_a_packed_turn_keeps_its_tokens() -> None:
    """A turn is packed once; its prompt is not replaced and its full run stays the view
    over it (an error, not a turn whose tokens silently change)."""
    import pytest

    from rollout_store.errors import RolloutStoreError

    fresh = Turn()
    assert fresh.prompt is None and fresh.full is None and not fresh.flags & HAS_TOKENS
    turns = token_turns(2, n_new=3, n_sampled=2)
    graph = RolloutGraph()
    for fields in turns:
        graph.add_turn(TurnNode(**fields))
    turn = _turns(graph)[1]
    before = turn.after
    with pytest.raises(RolloutStoreError):
        turn.pack_tokens(None, array("I", [1]), None, None)
    with pytest.raises(RolloutStoreError):
        turn.prompt = ArrayRun(None, array("I", [1]))
    with pytest.raises(RolloutStoreError):
        turn.full = ArrayRun(None, array("I", [1]))
    turn.full = PackedFull(turn)  # the view it is: kept as the mark
    assert turn.after is before and turn.prompt is turn and type(turn.full) is PackedFull
    assert graph.get("turn-1").prompt_ids == turns[1]["prompt_ids"]


def test_a_packed_turn_keeps_its_tokens_and_its_request_in_one_bytes_object() -> None:
    """The packed token ids are the start of the turn's own bytes: every part of the request
    set before or after packing reads back as set, and the tokens stay as packed."""
    import gc

    from rollout_store.engine.confirm import digest_key

    before = ArrayRun(None, array("I", [1, 2, 3]))
    turn = Turn()
    turn.build((b"\x91\xa1a",), 1)  # a request before the tokens are packed
    turn.pack_tokens(before, array("I", [4, 5]), array("I", [6]), array("d", [-0.5]))
    assert turn.tail == b"\x91\xa1a" and turn.n_rest == 1 and turn.response is None
    turn.response = b"\xa2ok"
    digest = bytes(range(32))
    turn.file_under(digest_key(digest), digest)
    assert (turn.tail, turn.response, turn.digest) == (b"\x91\xa1a", b"\xa2ok", digest)
    turn.tail = b"\x92\xa1a\xa1b"
    turn.n_rest = 2
    turn.rkey = 7  # a key the digest does not give
    turn.build((b"\x92\xa1a", b"\xa1c"), 2, b"\xa1r", digest, 7)
    for _ in range(2):
        assert turn.tail == b"\x92\xa1a\xa1c" and turn.response == b"\xa1r"
        assert turn.digest == digest and turn.rkey == 7 and turn.n_rest == 2
        assert run_list(turn) == [1, 2, 3, 4, 5] and run_list(turn.full) == [1, 2, 3, 4, 5, 6]
        assert turn.sampled == array("I", [6]) and turn.logprobs == array("d", [-0.5])
        assert run_matches(turn.full, array("I", [1, 2, 3, 4, 5, 6, 7]).tobytes())
        turn.set_request([b"\x92\xa1a", b"\xa1c"], 2)
        turn.file_under(7, digest)
    assert [o for o in gc.get_referents(turn) if type(o) is bytes] == [turn.data]
    alone = PackedPrompt(before, array("I", [4, 5]), array("I", [6]), array("d", [-0.5]))
    assert turn.data.startswith(alone.data)

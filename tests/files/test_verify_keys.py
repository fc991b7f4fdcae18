"""`verify` recomputes the index keys each turn record carries (`key_check`).

A key changed in a file whose frames are chained right (what a crafted or damaged-but-
consistent file can be) used to pass `verify`, and a turn added to the loaded graph then
linked to an older ancestor than its true parent. Each field is changed here the way only
the new check can catch: the record is packed again and the file chained again.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import random
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import chat_turns, image_url, token_turns
from test_format_v2 import frame_offsets, rechained, records_of
from test_storage import build_rollout

from rollout_store import (
    DirectoryStore,
    FileWriteError,
    IndexKeyMismatch,
    IndexKeyRecomputeError,
    MemoryStore,
    RawJSON,
    RolloutGraph,
    StringCache,
    TurnNode,
)
from rollout_store.cli import main as cli_main
from rollout_store.engine.shared_blobs import StoreBlobTable
from rollout_store.files import frames, storage
from rollout_store.files.frames import KIND_TURN

DATA = Path(__file__).resolve().parents[1] / "data"
_KEYS = storage.TurnRecord._fields.index("keys")
_NODE_ID = storage.TurnRecord._fields.index("node_id")
FIELDS = ("request", "token", "prompt", "roots")
_INDEX = {name: i for i, name in enumerate(FIELDS)}

Records = list[tuple[int, bytes]]


# ---------------------------------------------------------------- crafting


def _unpacked(payload: bytes) -> list[Any]:
    record: list[Any] = msgpack.unpackb(payload, raw=False, unicode_errors="surrogatepass")
    return record


def _packed(record: list[Any]) -> bytes:
    packed: bytes = msgpack.packb(record, use_bin_type=True, unicode_errors="surrogatepass")
    return packed


def turn_at(records: Records, node_id: str) -> int:
    """The index (in the file's frames) of the turn record of `node_id`."""
    for i, (kind, payload) in enumerate(records):
        if kind == KIND_TURN and _unpacked(payload)[_NODE_ID] == node_id:
            return i
    raise AssertionError(f"no turn record of {node_id!r}")


def keys_of(records: Records, at: int) -> list[Any]:
    keys: list[Any] = _unpacked(records[at][1])[_KEYS]
    return keys


def with_key(records: Records, at: int, field: str, new: Any) -> Records:
    """The records with one index key of the turn record at `at` replaced: the record
    packed again (the file is then chained again by `write`)."""
    record = _unpacked(records[at][1])
    record[_KEYS][_INDEX[field]] = new
    changed = list(records)
    changed[at] = (KIND_TURN, _packed(record))
    return changed


def write(path: Path, records: Records) -> bytes:
    data = rechained(records)
    path.write_bytes(data)
    return data


def assert_refused(path: Path, field: str, at: int, store: Any = None) -> IndexKeyMismatch:
    """`verify` (and the command) refuse the file at the record `at`, naming the field, and
    leave it byte for byte as it was."""
    before = path.read_bytes()
    report = storage.verify(path, store=store)
    assert not report.ok
    error = report.exception
    assert isinstance(error, IndexKeyMismatch), report.error
    assert error.field == field, report.error
    assert report.error_offset == frame_offsets(before)[at] == error.offset
    assert error.record == at
    node_id = _unpacked(records_of(before)[at][1])[_NODE_ID]
    assert error.node_id == node_id
    assert f"its {field} index key" in str(error) and repr(node_id) in str(error)
    assert "restore the file from a copy" in str(error)
    assert path.read_bytes() == before
    if store is None:
        assert cli_main(["verify", str(path)]) == 1
        assert path.read_bytes() == before
    return error


def chat_log(path: Path, n: int = 5) -> list[dict[str, Any]]:
    turns = chat_turns(n, images=[image_url(k, 2000) for k in range(n)])
    with RolloutGraph.open(path, share_threshold=64, fsync="never") as graph:
        for k, fields in enumerate(turns):
            graph.add_turn(TurnNode(node_id=f"m{k}", **copy.deepcopy(fields)))
    return turns


def token_log(path: Path, n: int = 5, n_new: int = 70) -> list[dict[str, Any]]:
    turns = token_turns(n, n_new=n_new)
    with RolloutGraph.open(path, fsync="never") as graph:
        for k, fields in enumerate(turns):
            graph.add_turn(TurnNode(node_id=f"k{k}", **copy.deepcopy(fields)))
    return turns


def continuation(fields: dict[str, Any]) -> TurnNode:
    """The next call of a chat rollout whose last call is `fields`."""
    messages = [
        *copy.deepcopy(fields["request_messages"]),
        copy.deepcopy(fields["response_message"]),
        {"role": "user", "content": "and then?"},
    ]
    return TurnNode(request_messages=messages, response_message={"role": "assistant"})


# ---------------------------------------------------------------- each field


def test_a_request_key_changed_to_an_older_turns_is_refused(tmp_path: Path) -> None:
    """The attack of the review: turn m3 filed under m1's key. A plain load trusts it, and
    the next call of m3 then links to an older ancestor (m2, the longest request it still
    finds); verify refuses the file at m3's record."""
    path = tmp_path / "log.rls"
    turns = chat_log(path)
    records = records_of(path.read_bytes())
    at = turn_at(records, "m3")
    older = keys_of(records, turn_at(records, "m1"))[0]
    assert older is not None and older != keys_of(records, at)[0]
    write(path, with_key(records, at, "request", older))
    trusted = RolloutGraph.load(path)
    assert trusted.add_turn(continuation(turns[3])).parent_id == "m2"  # silently re-linked
    error = assert_refused(path, "request", at)
    assert error.recorded == older and error.expected == keys_of(records, at)[0]
    # the file as main wrote it verifies, and links the continuation to its true parent
    write(path, records)
    assert storage.verify(path).ok
    assert RolloutGraph.load(path).add_turn(continuation(turns[3])).parent_id == "m3"


def test_a_request_key_dropped_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "log.rls"
    chat_log(path)
    records = records_of(path.read_bytes())
    at = turn_at(records, "m2")
    write(path, with_key(records, at, "request", None))
    assert assert_refused(path, "request", at).recorded is None


def test_a_request_key_on_a_turn_without_messages_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "log.rls"
    with RolloutGraph.open(path, fsync="never") as graph:
        graph.add_turn(TurnNode(node_id="none", request_messages=None, prompt_ids=[1, 2]))
    records = records_of(path.read_bytes())
    at = turn_at(records, "none")
    assert keys_of(records, at)[0] is None
    write(path, with_key(records, at, "request", 12345))
    assert assert_refused(path, "request", at).expected is None


@pytest.mark.parametrize("n_new", [2, 70], ids=["under a block", "whole blocks"])
def test_a_token_key_changed_is_refused(tmp_path: Path, n_new: int) -> None:
    """Turn k3 filed under k1's token key: under a plain load, the next call of k3 links to
    an older ancestor (k2, the longest prefix it still finds)."""
    path = tmp_path / "log.rls"
    turns = token_log(path, n=4, n_new=n_new)
    records = records_of(path.read_bytes())
    at = turn_at(records, "k3")
    older = keys_of(records, turn_at(records, "k1"))[1]
    assert older is not None and older != keys_of(records, at)[1]
    write(path, with_key(records, at, "token", older))
    after = token_turns(5, n_new=n_new)[4]
    assert after["prompt_ids"][: len(turns[3]["prompt_ids"])] == turns[3]["prompt_ids"]
    trusted = RolloutGraph.load(path)
    assert trusted.add_turn(TurnNode(**copy.deepcopy(after))).parent_id == "k2"
    assert_refused(path, "token", at)
    write(path, records)
    assert storage.verify(path).ok
    assert RolloutGraph.load(path).add_turn(TurnNode(**after)).parent_id == "k3"


def test_a_token_key_dropped_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "log.rls"
    token_log(path)
    records = records_of(path.read_bytes())
    at = turn_at(records, "k2")
    write(path, with_key(records, at, "token", None))
    assert_refused(path, "token", at)


def test_a_prompt_key_changed_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "log.rls"
    token_log(path)
    records = records_of(path.read_bytes())
    at = turn_at(records, "k0")  # a root: its prompt is filed under its digest
    key = keys_of(records, at)[2]
    assert key is not None
    write(path, with_key(records, at, "prompt", key ^ 1))
    error = assert_refused(path, "prompt", at)
    assert error.recorded == key ^ 1 and error.expected == key


def test_a_root_prompts_key_dropped_is_refused_and_recover_files_it_again(tmp_path: Path) -> None:
    """add_turn files every root prompt (one that extends no earlier turn's tokens, of ids
    that fit 32 bits) under its digest, and no other: the record shows which (a prompt that
    extends another's names that turn), so a key dropped from a root's record is refused. It
    used to pass. What it costs a plain load: the prompt is not found again, so a retry of
    the root keeps its ids a second time; no link changes (roots are found by their token
    key). recover files it again, and so does the file it saves."""
    path = tmp_path / "log.rls"
    turns = token_log(path)
    records = records_of(path.read_bytes())
    at = turn_at(records, "k0")
    key = keys_of(records, at)[2]
    assert key is not None
    assert [keys_of(records, turn_at(records, f"k{k}"))[2] for k in (1, 2)] == [None, None]
    write(path, with_key(records, at, "prompt", None))
    error = assert_refused(path, "prompt", at)
    assert error.recorded is None and error.expected == key
    retry = TurnNode(node_id="retry", prompt_ids=list(turns[0]["prompt_ids"]), sampled_ids=[1])
    after = token_turns(6, n_new=70)[5]
    trusted = RolloutGraph.load(path)
    assert trusted.add_turn(copy.deepcopy(retry)).parent_id is None
    assert trusted.add_turn(TurnNode(**copy.deepcopy(after))).parent_id == "k4"
    first, *_, again, _ = (e.turn for e in trusted.journal_entries())
    assert again.node_id == "retry" and again.prompt is not first.prompt  # not shared
    recovered = RolloutGraph.load(path, recover=True)
    assert recovered.load_report.keys_recomputed == 1
    assert recovered.add_turn(copy.deepcopy(retry)).parent_id is None
    first, *_, again = (e.turn for e in recovered.journal_entries())
    assert again.prompt is first.prompt  # shared, as in the graph that wrote the file
    out = tmp_path / "fixed.rls"
    RolloutGraph.load(path, recover=True).save(out)
    assert storage.verify(out).ok
    assert keys_of(records_of(out.read_bytes()), at)[2] == key


def test_a_prompt_key_of_a_prompt_that_extends_another_is_checked_when_given(
    tmp_path: Path,
) -> None:
    """add_turn names none there (the prompt is reached through its parent's tokens), but
    files of an earlier main do (tests/data/v2_*.rls): one that its content gives verifies,
    any other is refused."""
    from array import array

    import xxhash

    path = tmp_path / "log.rls"
    turns = token_log(path)
    records = records_of(path.read_bytes())
    at = turn_at(records, "k2")
    assert keys_of(records, at)[2] is None
    key = xxhash.xxh3_64_intdigest(array("I", turns[2]["prompt_ids"]).tobytes())
    write(path, with_key(records, at, "prompt", key))
    assert storage.verify(path).ok
    write(path, with_key(records, at, "prompt", key ^ 1))
    assert assert_refused(path, "prompt", at).expected == key


def test_a_prompt_of_ids_beyond_32_bits_names_no_key(tmp_path: Path) -> None:
    """Such a root prompt is stored exactly and never filed: a key on it is refused."""
    path = tmp_path / "log.rls"
    with RolloutGraph.open(path, fsync="never") as graph:
        graph.add_turn(TurnNode(node_id="big", prompt_ids=[2**40, 3], sampled_ids=[1]))
    records = records_of(path.read_bytes())
    at = turn_at(records, "big")
    assert keys_of(records, at)[2] is None and storage.verify(path).ok
    write(path, with_key(records, at, "prompt", 12345))
    assert assert_refused(path, "prompt", at).expected is None


@pytest.mark.parametrize("pad", [0, 150_000], ids=["short", "messages over 64 KiB"])
def test_root_keys_changed_are_refused(tmp_path: Path, pad: int) -> None:
    """A root without token ids waits under its request's shorter prefixes (for an ancestor
    that arrives late): one of them changed, or one added, is refused."""
    path = tmp_path / "log.rls"
    turns = chat_turns(4, pad=pad)
    with RolloutGraph.open(path, share_threshold=None, fsync="never") as graph:
        graph.add_turn(TurnNode(node_id="late", **copy.deepcopy(turns[3])))  # a root, for now
        graph.add_turn(TurnNode(node_id="first", **copy.deepcopy(turns[0])))
    records = records_of(path.read_bytes())
    at = turn_at(records, "late")
    roots = keys_of(records, at)[3]
    assert isinstance(roots, list) and len(roots) == 7  # prefixes of 0 to 6 messages
    assert storage.verify(path).ok
    write(path, with_key(records, at, "roots", [*roots[:-1], roots[-1] ^ 1]))
    assert_refused(path, "roots", at)
    write(path, with_key(records, at, "roots", [*roots, 99]))
    assert_refused(path, "roots", at)
    write(path, with_key(records, at, "roots", roots[:-1]))
    assert_refused(path, "roots", at)


def _late_root_without_prefix_keys(tmp_path: Path) -> tuple[Path, list[Any], int]:
    """A log whose root "late" (the fourth turn of `chat_turns(4)`, its ancestors not yet
    recorded) lost its prefix keys; the log's records as written, and that turn's index."""
    path = tmp_path / "log.rls"
    turns = chat_turns(4)
    with RolloutGraph.open(path, fsync="never") as graph:
        graph.add_turn(TurnNode(node_id="late", **copy.deepcopy(turns[3])))
        graph.add_turn(TurnNode(node_id="other", request_messages=[{"role": "user"}]))
    records = records_of(path.read_bytes())
    at = turn_at(records, "late")
    write(path, with_key(records, at, "roots", None))
    return path, records, at


def test_root_keys_dropped_from_a_root_that_stays_one_are_refused(tmp_path: Path) -> None:
    """Without them the late ancestor never adopts the root: checked at the end of the file,
    naming the root's record."""
    path, records, at = _late_root_without_prefix_keys(tmp_path)
    turns = chat_turns(4)
    trusted = RolloutGraph.load(path)
    for k in (0, 1, 2):
        trusted.add_turn(TurnNode(node_id=f"t{k}", **copy.deepcopy(turns[k])))
    assert trusted.parent("late") is None  # never adopted
    error = assert_refused(path, "roots", at)
    assert error.recorded is None and len(error.expected) == 7
    write(path, records)
    reloaded = RolloutGraph.load(path)
    for k in (0, 1, 2):
        reloaded.add_turn(TurnNode(node_id=f"t{k}", **copy.deepcopy(turns[k])))
    assert reloaded.parent("late") == "t2"


def test_a_snapshot_leaves_the_root_keys_of_a_turn_adopted_later_out(tmp_path: Path) -> None:
    """The one place a root's record names no prefix keys: a snapshot, for a root that a
    later turn adopted (the adopting record says so). That file verifies."""
    turns = chat_turns(3)
    graph = RolloutGraph()
    graph.add_turn(TurnNode(node_id="late", **copy.deepcopy(turns[2])))
    graph.add_turn(TurnNode(node_id="first", **copy.deepcopy(turns[0])))
    graph.add_turn(TurnNode(node_id="middle", **copy.deepcopy(turns[1])))
    assert graph.parent("late") == "middle"
    path = tmp_path / "s.rls"
    graph.save(path)
    records = records_of(path.read_bytes())
    assert keys_of(records, turn_at(records, "late"))[3] is None
    assert storage.verify(path).ok


def test_root_keys_on_a_turn_with_a_parent_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "log.rls"
    chat_log(path)
    records = records_of(path.read_bytes())
    at = turn_at(records, "m2")
    assert keys_of(records, at)[3] is None
    write(path, with_key(records, at, "roots", [1, 2]))
    assert assert_refused(path, "roots", at).expected is None


def test_keys_are_checked_over_a_content_store(tmp_path: Path) -> None:
    """A file of store references: its turns' keys are recomputed from the fetched strings."""
    store = DirectoryStore(tmp_path / "objects", fsync=False)
    path = tmp_path / "refs.rls"
    turns = chat_turns(4, images=[image_url(k, 3000) for k in range(4)])
    with RolloutGraph.open(path, store=store, blobs="store", fsync="never") as graph:
        for k, fields in enumerate(turns):
            graph.add_turn(TurnNode(node_id=f"m{k}", **copy.deepcopy(fields)))
    assert storage.verify(path, store=store).ok
    records = records_of(path.read_bytes())
    at = turn_at(records, "m2")
    write(path, with_key(records, at, "request", keys_of(records, turn_at(records, "m0"))[0]))
    assert_refused(path, "request", at, store=store)


# ---------------------------------------------------------------- any field, at random


@pytest.fixture(scope="module")
def mixed_records(tmp_path_factory: pytest.TempPathFactory) -> Records:
    """A log of a message rollout, a token rollout and a root that a late turn adopts."""
    path = tmp_path_factory.mktemp("mixed") / "log.rls"
    chats = chat_turns(4, images=[image_url(k, 500) for k in range(4)])
    tokens = token_turns(4, n_new=40)
    with RolloutGraph.open(path, share_threshold=64, fsync="never") as graph:
        graph.add_turn(TurnNode(node_id="c3", **copy.deepcopy(chats[3])))
        for k in (0, 1, 2):
            graph.add_turn(TurnNode(node_id=f"c{k}", **copy.deepcopy(chats[k])))
        for k, fields in enumerate(tokens):
            graph.add_turn(TurnNode(node_id=f"k{k}", **copy.deepcopy(fields)))
    return records_of(path.read_bytes())


@given(st.data())
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_any_key_changed_at_random_is_refused_at_its_record(
    mixed_records: Records, tmp_path: Path, data: st.DataObject
) -> None:
    """A random turn record's random key (request, token or prompt where it has one, and a
    root's prefix keys) changed to another value: verify names that record and field."""
    choices = [
        (at, field)
        for at, (kind, _) in enumerate(mixed_records)
        if kind == KIND_TURN
        for field in FIELDS
        if keys_of(mixed_records, at)[_INDEX[field]]
    ]
    at, field = data.draw(st.sampled_from(choices))
    old = keys_of(mixed_records, at)[_INDEX[field]]
    new: Any
    if field == "roots":
        where = data.draw(st.integers(0, len(old) - 1))
        value = data.draw(st.integers(0, 2**64 - 1).filter(lambda v: v != old[where]))
        new = [*old[:where], value, *old[where + 1 :]]
    else:
        new = data.draw(st.integers(0, 2**64 - 1).filter(lambda v: v != old))
    path = tmp_path / "changed.rls"
    write(path, with_key(mixed_records, at, field, new))
    before = path.read_bytes()
    report = storage.verify(path)
    assert isinstance(report.exception, IndexKeyMismatch), report.error
    assert report.exception.field == field and report.exception.record == at
    assert path.read_bytes() == before


def test_the_mixed_log_verifies_as_written(mixed_records: Records, tmp_path: Path) -> None:
    path = tmp_path / "log.rls"
    write(path, mixed_records)
    assert storage.verify(path).ok
    roots = keys_of(mixed_records, turn_at(mixed_records, "c3"))[3]
    assert roots is not None and len(roots) == 7  # the random test changes them too


# ---------------------------------------------------------------- files main writes verify


def _seeded_turns(rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
    """Several rollouts of one graph, in a shuffled arrival order: messages (with images,
    system prompts, odd values, retries), tokens (short and long), explicit parents, turns
    without messages or without token ids."""
    out: list[tuple[str, dict[str, Any]]] = []
    n = rng.randrange(2, 6)
    images = [image_url(rng.randrange(10**6), rng.choice([100, 3000])) for _ in range(n)]
    system = rng.choice([None, "You are terse.", "rules " * 200])
    chats = chat_turns(n, tag=f"c{rng.random()}", system=system, images=images)
    for k, fields in enumerate(chats):
        out.append((f"c{k}", fields))
        if rng.random() < 0.3:  # a retry of the same call with another answer
            retry = dict(fields, response_message={"role": "assistant", "content": "again"})
            out.append((f"c{k}r", copy.deepcopy(retry)))
    odd: dict[str, Any] = {"tuple": (1, (2, 3)), "big": 2**70, "lone": "\ud800", "z": -0.0}
    if rng.random() < 0.5:
        first = copy.deepcopy(chats[0])
        first["request_messages"][-1]["odd"] = odd
        out.append(("odd", first))
    tokens = token_turns(
        rng.randrange(2, 5), start=rng.randrange(10**6), n_new=rng.choice([2, 70, 130])
    )
    out.extend((f"k{k}", fields) for k, fields in enumerate(tokens))
    out.append(("none", {"request_messages": None, "prompt_ids": [5, 6], "sampled_ids": [7]}))
    out.append(("empty", {"request_messages": [], "prompt_ids": [], "sampled_ids": []}))
    out.append(("big", {"prompt_ids": [2**40, 3], "sampled_ids": [2**33]}))
    rng.shuffle(out)
    return out


def test_long_tails_with_blob_references_verify(tmp_path: Path) -> None:
    """Tails and responses longer than `QUICK_LIMIT` that hold blob references (one of a
    string with a lone surrogate) and an echo: spliced where `check_packed` finds them."""
    QUICK_LIMIT = 16 << 10  # what key_check once decoded whole below: spliced above it

    many = ["short"] * (QUICK_LIMIT // 4)
    history: list[Any] = []
    path = tmp_path / "log.rls"
    with RolloutGraph.open(path, share_threshold=64, fsync="never") as graph:
        for k in range(3):
            history.append(
                {"role": "user", "content": [*many, image_url(k, 500), "\ud800" * 70 + str(k)]}
            )
            response = {"role": "assistant", "content": [*many, image_url(k + 9, 300)]}
            graph.add_turn(
                TurnNode(request_messages=copy.deepcopy(history), response_message=response)
            )
            history.append(copy.deepcopy(response))
        graph.save(tmp_path / "s.rls")
    assert len(records_of(path.read_bytes())[-1][1]) > 2 * QUICK_LIMIT
    assert storage.verify(path).ok and storage.verify(tmp_path / "s.rls").ok
    records = records_of(path.read_bytes())
    at = max(i for i, (kind, _) in enumerate(records) if kind == KIND_TURN)
    write(path, with_key(records, at, "request", keys_of(records, at)[0] ^ 1))
    assert_refused(path, "request", at)


def _add(graph: RolloutGraph, turns: list[tuple[str, dict[str, Any]]], raw: bool) -> None:
    names = [name for name, _ in turns]
    for i, (name, fields) in enumerate(turns):
        fields = copy.deepcopy(fields)
        messages = fields.get("request_messages")
        if raw and isinstance(messages, list) and "odd" not in name:
            fields["request_messages"] = RawJSON(json.dumps(messages).encode())
        if i and name.startswith("k") and name.endswith("1") and i % 2:
            fields["parent_id"] = names[i - 1]  # an explicit parent now and then
        graph.add_turn(TurnNode(node_id=name, **fields))


STORES = ["none", "memory", "directory", "directory, blobs in the store"]


@pytest.mark.parametrize("store_kind", STORES)
@pytest.mark.parametrize("raw", [False, True], ids=["decoded", "raw"])
def test_files_main_writes_verify(tmp_path: Path, store_kind: str, raw: bool) -> None:
    """Seeded rollouts written as logs and snapshots, from decoded and raw intake, with and
    without a content store: every one verifies (the keys main writes are those the check
    recomputes), and so does each file once loaded and saved again."""
    _write_and_verify(tmp_path, store_kind, raw, range(6))


@pytest.mark.slow
@pytest.mark.parametrize("store_kind", STORES)
@pytest.mark.parametrize("raw", [False, True], ids=["decoded", "raw"])
def test_files_main_writes_verify_many_seeds(tmp_path: Path, store_kind: str, raw: bool) -> None:
    _write_and_verify(tmp_path, store_kind, raw, range(6, 60))


def _write_and_verify(tmp_path: Path, store_kind: str, raw: bool, seeds: range) -> None:
    for seed in seeds:
        rng = random.Random(seed)
        turns = _seeded_turns(rng)
        store: Any = None
        if store_kind == "memory":
            store = MemoryStore()
        elif store_kind.startswith("directory"):
            store = DirectoryStore(tmp_path / f"objects{seed}", fsync=False)
        blobs = "store" if store_kind.endswith("store") else "inline"
        log = tmp_path / f"log{seed}{raw}.rls"
        threshold = rng.choice([16, 64, 1024])
        with RolloutGraph.open(
            log, share_threshold=threshold, store=store, blobs=blobs, fsync="never"
        ) as graph:
            _add(graph, turns, raw)
            snap = tmp_path / f"snap{seed}{raw}.rls"
            graph.save(snap, blobs=blobs)
        for path in (log, snap):
            report = storage.verify(path, store=store)
            assert report.ok, (seed, path.name, report.error)
            again = tmp_path / "again.rls"
            RolloutGraph.load(path, store=store).save(again, blobs=blobs)
            assert storage.verify(again, store=store).ok, (seed, path.name)


@pytest.mark.parametrize("raw", [False, True], ids=["decoded", "raw"])
def test_conversations_in_order_verify(tmp_path: Path, raw: bool) -> None:
    """Each turn re-sending the one before, with screenshots of 16 KiB and more: the
    continuation fast paths (tips, raw tips) give the keys the check recomputes."""
    path = tmp_path / "log.rls"
    with RolloutGraph.open(path, fsync="never") as graph:
        for tag in ("a", "b"):
            turns = chat_turns(6, tag=tag, images=[image_url(k, 20_000 + k) for k in range(6)])
            for k, fields in enumerate(turns):
                fields = copy.deepcopy(fields)
                if raw:
                    fields["request_messages"] = RawJSON(
                        json.dumps(fields["request_messages"]).encode()
                    )
                graph.add_turn(TurnNode(node_id=f"{tag}{k}", **fields))
        assert [graph.parent(f"a{k}") for k in range(6)] == [None, "a0", "a1", "a2", "a3", "a4"]
        graph.save(tmp_path / "s.rls")
    assert storage.verify(path).ok and storage.verify(tmp_path / "s.rls").ok


def test_build_rollout_files_verify(tmp_path: Path) -> None:
    """The odd-valued multimodal rollout of the storage tests, at several share thresholds."""
    for seed, threshold in enumerate([8, 64, 1024, None]):
        log = tmp_path / f"log{seed}.rls"
        with RolloutGraph.open(log, share_threshold=threshold, fsync="never") as graph:
            build_rollout(graph, seed=seed, turns=6)
            graph.save(tmp_path / f"snap{seed}.rls")
        assert storage.verify(log).ok
        assert storage.verify(tmp_path / f"snap{seed}.rls").ok


# ---------------------------------------------------------------- version 1, and files of main


@pytest.mark.parametrize("name", ["v1_log.rls", "v1_snapshot.rls"])
def test_version_1_keys_are_recomputed_on_load(tmp_path: Path, name: str) -> None:
    """Version-1 files hold keys of an earlier scheme: a continuation of one of their turns
    became a root. Their keys are recomputed on load, so it links to its parent."""
    graph = RolloutGraph.load(DATA / name)
    continued = 0
    for node_id in graph.node_ids():
        turn = graph.get(node_id)
        if turn.request_messages is None or turn.response_message is None or turn.prompt_ids:
            continue
        fresh = RolloutGraph.load(DATA / name)
        fields = {
            "request_messages": turn.request_messages,
            "response_message": turn.response_message,
        }
        assert fresh.add_turn(continuation(fields)).parent_id == node_id
        continued += 1
    assert continued
    assert storage.verify(DATA / name).ok


@pytest.mark.parametrize("name", ["v2_log.rls", "v2_snapshot.rls"])
def test_version_2_files_of_an_earlier_main_verify(name: str) -> None:
    assert storage.verify(DATA / name).ok


# ---------------------------------------------------------------- a failed write over a store


def test_a_failed_append_over_a_content_store_leaves_its_record_unreferenced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn's record is put into the shared store before the file write (the other
    order could leave a file naming an object the store lacks). When the write fails, the
    graph and the file are as they were, the graph references nothing new, and the store
    keeps the complete, unreferenced record; the same turn added again reuses it."""
    store = DirectoryStore(tmp_path / "objects", fsync=False)
    log = tmp_path / "log.rls"
    turns = chat_turns(3, pad=400)
    graph = RolloutGraph.open(log, store=store, cache=StringCache(0), fsync="never")
    for k, fields in enumerate(turns[:2]):
        graph.add_turn(TurnNode(node_id=f"m{k}", **copy.deepcopy(fields)))
    before, stats, ids = log.read_bytes(), graph.stats(), graph.node_ids()
    entries = [(e.turn.index, e.keys) for e in graph.journal_entries()]
    objects = set(store.keys())

    def full_disk(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(FileWriteError, match="No space"):
        graph.add_turn(TurnNode(node_id="m2", **copy.deepcopy(turns[2])))
    monkeypatch.undo()
    assert log.read_bytes() == before
    assert graph.stats() == stats and graph.node_ids() == ids
    assert [(e.turn.index, e.keys) for e in graph.journal_entries()] == entries
    left = set(store.keys()) - objects
    assert len(left) == 1  # the turn's record (its strings were all stored before)
    (record_key,) = left
    blobs = graph.blobs
    assert isinstance(blobs, StoreBlobTable)
    referenced = {blobs.key(i) for i in range(len(blobs))}
    assert record_key not in referenced
    assert storage.verify(log, store=store).ok
    graph.add_turn(TurnNode(node_id="m2", **copy.deepcopy(turns[2])))
    assert set(store.keys()) - objects == left  # put again: the same object
    graph.close()
    assert RolloutGraph.load(log, store=store).node_ids() == ["m0", "m1", "m2"]
    assert storage.verify(log, store=store).ok


# ---------------------------------------------------------------- what to do: recover


def test_recover_recomputes_the_keys_and_keeps_every_turn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The content of a file with a wrong key is intact: the command's advice is `recover`,
    which loads every turn with its keys recomputed and writes a file that verifies."""
    path = tmp_path / "log.rls"
    turns = chat_log(path)
    records = records_of(path.read_bytes())
    at = turn_at(records, "m3")
    write(path, with_key(records, at, "request", keys_of(records, turn_at(records, "m1"))[0]))
    before = path.read_bytes()
    assert cli_main(["verify", str(path)]) == 1
    err = capsys.readouterr().err
    assert "its request index key" in err and f"rollout-store recover {path} -o OUT" in err
    recovered = RolloutGraph.load(path, recover=True)
    assert recovered.load_report.ok and recovered.load_report.keys_recomputed == 1
    assert recovered.add_turn(continuation(turns[3])).parent_id == "m3"
    out = tmp_path / "fixed.rls"
    assert cli_main(["recover", str(path), "-o", str(out)]) == 0
    assert "1 of them with their index keys recomputed" in capsys.readouterr().out
    assert path.read_bytes() == before
    assert storage.verify(out).ok
    fixed = RolloutGraph.load(out)
    assert fixed.node_ids() == [f"m{k}" for k in range(5)]
    assert fixed.add_turn(continuation(turns[3])).parent_id == "m3"
    # a file main wrote has nothing to recompute
    write(path, records)
    assert RolloutGraph.load(path, recover=True).load_report.keys_recomputed == 0


def _v1_records(data: bytes) -> Records:
    out, offset = [], len(frames.MAGIC)
    while offset < len(data):
        kind, length, _ = frames.FRAME.unpack_from(data, offset)
        start = offset + frames.FRAME.size
        out.append((kind, data[start : start + length]))
        offset = start + length
    return out


def test_a_version_1_files_keys_are_never_trusted(tmp_path: Path) -> None:
    """A key changed in a version-1 file (framed again) changes nothing: load recomputes
    them all, so the continuation of the changed turn still links to it."""
    records = _v1_records((DATA / "v1_log.rls").read_bytes())
    turns = [i for i, (kind, _) in enumerate(records) if kind == KIND_TURN]
    graph = RolloutGraph.load(DATA / "v1_log.rls")
    node_id = next(
        n
        for n in graph.node_ids()
        if graph.get(n).request_messages is not None
        and graph.get(n).response_message is not None
        and not graph.get(n).prompt_ids
    )
    at = next(i for i in turns if _unpacked(records[i][1])[_NODE_ID] == node_id)
    changed = with_key(records, at, "request", 12345)
    path = tmp_path / "v1.rls"
    path.write_bytes(frames.MAGIC + b"".join(frames.frame(k, p) for k, p in changed))
    assert storage.verify(path).ok
    turn = graph.get(node_id)
    fields = {"request_messages": turn.request_messages, "response_message": turn.response_message}
    assert RolloutGraph.load(path).add_turn(continuation(fields)).parent_id == node_id


def test_a_short_tail_with_an_echo_a_blob_and_a_lone_surrogate_verifies(tmp_path: Path) -> None:
    """A tail that re-sends the answer before it (an echo placeholder), holds a blob reference
    and a string msgpack cannot pack (a lone surrogate): its plain packing is spliced (the
    validating walk takes no placeholder). verify refused such a file, and recover dropped
    the turn as damaged."""
    path = tmp_path / "log.rls"
    messages: list[Any] = [{"role": "user", "content": "hello"}]
    answer = {"role": "assistant", "content": "ok"}
    with RolloutGraph.open(path, share_threshold=64, fsync="never") as graph:
        graph.add_turn(
            TurnNode(
                node_id="a",
                request_messages=copy.deepcopy(messages),
                response_message=copy.deepcopy(answer),
            )
        )
        messages += [answer, {"role": "user", "content": ["\ud800", "x" * 100]}]
        graph.add_turn(
            TurnNode(
                node_id="b",
                request_messages=copy.deepcopy(messages),
                response_message=copy.deepcopy(answer),
            )
        )
        assert graph.parent("b") == "a"
        graph.save(tmp_path / "s.rls")
    for name in ("log.rls", "s.rls"):
        report = storage.verify(tmp_path / name)
        assert report.ok, report.error
        recovered = RolloutGraph.load(tmp_path / name, recover=True)
        assert recovered.load_report.ok, recovered.load_report.error
        assert recovered.node_ids() == ["a", "b"] and recovered.load_report.keys_recomputed == 0


def test_interleaved_conversations_hash_each_tail_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As many conversations advancing in turn as hash states are kept: each turn's base
    state is still kept when its next turn comes, so every tail is hashed once (a count of
    work, not a timing). A base found was moved to the newest end, each conversation so held
    two states, and a miss kept every state of the chain hashed again, pushing out others':
    the tails were hashed again and again along their chains."""
    from rollout_store.files import key_check

    monkeypatch.setattr(key_check, "KEPT_STATES", 16)
    calls = 0
    tail_plain = key_check.KeyCheck._tail_plain

    def counted(self: key_check.KeyCheck, turn: Any) -> Any:
        nonlocal calls
        calls += 1
        return tail_plain(self, turn)

    monkeypatch.setattr(key_check.KeyCheck, "_tail_plain", counted)
    path = tmp_path / "log.rls"
    n_conversations, n_turns = 16, 12
    conversations: list[list[Any]] = [
        [{"role": "user", "content": f"conversation {c}"}] for c in range(n_conversations)
    ]
    with RolloutGraph.open(path, fsync="never") as graph:
        for k in range(n_turns):
            for c, messages in enumerate(conversations):
                answer = {"role": "assistant", "content": f"answer {c} {k}"}
                graph.add_turn(
                    TurnNode(request_messages=copy.deepcopy(messages), response_message=answer)
                )
                messages += [answer, {"role": "user", "content": f"more {k}"}]
    assert storage.verify(path).ok
    assert calls == n_conversations * n_turns  # (a root of one message has no prefix to hash)


def test_interleaved_token_rollouts_hash_each_run_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for token ids: a turn's prompt and its prompt + sampled run are two nodes of
    a chain, and keeping both pushed out other rollouts' states at half as many rollouts as
    states kept; each new segment is now hashed once (counted as copies of the xxh3 state)."""
    import xxhash

    from rollout_store.files import key_check

    copies = 0

    class Counted:
        def __init__(self, inner: Any = None) -> None:
            self.inner = xxhash.xxh3_64() if inner is None else inner

        def copy(self) -> Counted:
            nonlocal copies
            copies += 1
            return Counted(self.inner.copy())

        def update(self, data: Any) -> None:
            self.inner.update(data)

        def intdigest(self) -> int:
            return int(self.inner.intdigest())

    class CountedModule:
        xxh3_64 = Counted

    monkeypatch.setattr(key_check, "KEPT_STATES", 16)
    monkeypatch.setattr(key_check, "xxhash", CountedModule)
    path = tmp_path / "log.rls"
    n_rollouts, n_turns = 16, 10
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(50)] for _ in range(n_rollouts)]
    with RolloutGraph.open(path, fsync="never") as graph:
        for _ in range(n_turns):
            for prompt in prompts:
                sampled = [rng.randrange(1000) for _ in range(30)]
                graph.add_turn(TurnNode(prompt_ids=list(prompt), sampled_ids=sampled))
                prompt += sampled + [rng.randrange(1000) for _ in range(20)]
    assert storage.verify(path).ok
    # a turn's two segments, each root's prompt key once more, and a few runs hashed again
    # while the first turns' prompts still fill the states kept (1776 copies before)
    assert copies <= 2 * n_rollouts * n_turns + n_rollouts + 3 * n_rollouts


def test_the_advice_for_a_wrong_key_promises_no_turn_past_later_damage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify stops at the wrong key: a torn tail after it is not seen, and recover keeps only
    the turns before that, so the advice does not say every turn is written."""
    path = tmp_path / "log.rls"
    chat_log(path)
    records = records_of(path.read_bytes())
    at = turn_at(records, "m1")
    data = write(
        path, with_key(records, at, "request", keys_of(records, turn_at(records, "m0"))[0])
    )
    path.write_bytes(data[:-7])  # and a torn tail
    assert cli_main(["verify", str(path)]) == 1
    advice = capsys.readouterr().err
    assert "its request index key" in advice and "before any later damage" in advice
    assert cli_main(["recover", str(path), "-o", str(tmp_path / "out.rls")]) == 0
    assert "recovered 4 turns from before the damage" in capsys.readouterr().out
    assert len(RolloutGraph.load(tmp_path / "out.rls")) == 4


# ---------------------------------------------------------------- keys that cannot be recomputed


def _failing_request_key(monkeypatch: pytest.MonkeyPatch, node_ids: set[str]) -> None:
    """Recomputing the request key of these turns raises (whatever the cause: a record the
    check cannot follow, a bug in it); the turns' content is intact."""
    from rollout_store.files import key_check

    request_key = key_check.KeyCheck.request_key

    def failing(self: key_check.KeyCheck, turn: Any) -> Any:
        if turn.node_id in node_ids:
            raise ValueError("cannot follow this tail")
        return request_key(self, turn)

    monkeypatch.setattr(key_check.KeyCheck, "request_key", failing)


def test_recover_keeps_a_turn_whose_keys_cannot_be_recomputed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """recover dropped such a turn and every intact turn after it, as damage. It now keeps
    them all: the turn filed under the keys its record names (what a plain load trusts), and
    named in the report with the reason; the other turns' keys are recomputed as before."""
    path = tmp_path / "log.rls"
    turns = chat_log(path)
    records = records_of(path.read_bytes())
    at = turn_at(records, "m2")
    before = path.read_bytes()
    _failing_request_key(monkeypatch, {"m2"})
    recovered = RolloutGraph.load(path, recover=True)
    report = recovered.load_report
    assert recovered.node_ids() == [f"m{k}" for k in range(5)]
    assert report.ok, report.error
    assert [(u.node_id, u.record, u.offset) for u in report.unkeyed] == [
        ("m2", at, frame_offsets(before)[at])
    ]
    assert "cannot follow this tail" in report.unkeyed[0].cause
    assert report.keys_recomputed == 0
    assert [recovered.parent(f"m{k}") for k in range(5)] == [None, "m0", "m1", "m2", "m3"]
    assert recovered.add_turn(continuation(turns[2])).parent_id == "m2"  # its record's keys
    assert recovered.add_turn(continuation(turns[4])).parent_id == "m4"
    assert path.read_bytes() == before
    # the command says so, and writes every turn
    out = tmp_path / "out.rls"
    assert cli_main(["recover", str(path), "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "recovered all 5 turns" in said and "1 of them (m2) kept under" in said
    assert RolloutGraph.load(out).node_ids() == [f"m{k}" for k in range(5)]


def test_verify_names_a_turn_whose_keys_cannot_be_recomputed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify cannot vouch for such a turn: it stops there with an error naming the turn, its
    record and the reason, and says what recover does with it (the file is left as it was)."""
    path = tmp_path / "log.rls"
    chat_log(path)
    records = records_of(path.read_bytes())
    at = turn_at(records, "m3")
    before = path.read_bytes()
    _failing_request_key(monkeypatch, {"m3"})
    report = storage.verify(path)
    error = report.exception
    assert isinstance(error, IndexKeyRecomputeError), report.error
    assert error.node_id == "m3" and error.record == at
    assert report.error_offset == frame_offsets(before)[at] == error.offset
    assert "'m3'" in str(error) and "cannot follow this tail" in str(error)
    assert "recover=True" in str(error) and "load_report.unkeyed" in str(error)
    assert report.turns == 3
    assert cli_main(["verify", str(path)]) == 1
    err = capsys.readouterr().err
    assert "cannot be recomputed" in err and f"rollout-store recover {path} -o OUT" in err
    assert path.read_bytes() == before


def test_verify_reports_prefix_keys_that_cannot_be_recomputed_at_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The end-of-file check of roots waiting without prefix keys recomputes them: an error
    there escaped verify (which never raises for what a file holds)."""
    from rollout_store.files import key_check

    path, _, at = _late_root_without_prefix_keys(tmp_path)

    prefix_keys = key_check.KeyCheck.prefix_keys

    def failing(self: key_check.KeyCheck, turn: Any) -> list[int]:
        if turn.node_id == "late":
            raise ValueError("cannot follow this tail")
        return prefix_keys(self, turn)

    monkeypatch.setattr(key_check.KeyCheck, "prefix_keys", failing)
    report = storage.verify(path)
    error = report.exception
    assert isinstance(error, IndexKeyRecomputeError), report.error
    assert error.node_id == "late" and error.record == at


@pytest.mark.parametrize("name", ["v1_log.rls", "v1_snapshot.rls"])
def test_a_version_1_load_keeps_a_turn_whose_keys_cannot_be_recomputed(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every load of a version-1 file recomputes its keys: one that cannot be recomputed
    failed the whole load (a plain one) or dropped the turn and all after it (recover)."""
    node_ids = RolloutGraph.load(DATA / name).node_ids()
    middle = node_ids[len(node_ids) // 2]
    _failing_request_key(monkeypatch, {middle})
    for recover in (False, True):
        graph = RolloutGraph.load(DATA / name, recover=recover)
        assert graph.node_ids() == node_ids
        report = graph.load_report
        assert report.ok and [u.node_id for u in report.unkeyed] == [middle]


def test_recover_lists_every_turn_whose_keys_hash_a_tail_that_cannot_be_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later turn's request is hashed from its base's state, so a base tail the check cannot
    follow leaves that turn's keys unrecomputed too: each is kept and listed, none dropped."""
    from rollout_store.files import key_check

    path = tmp_path / "log.rls"
    chat_log(path)
    tail_plain = key_check.KeyCheck._tail_plain

    def failing(self: key_check.KeyCheck, turn: Any) -> Any:
        if turn.node_id == "m2":
            raise ValueError("cannot follow this tail")
        return tail_plain(self, turn)

    monkeypatch.setattr(key_check.KeyCheck, "_tail_plain", failing)
    recovered = RolloutGraph.load(path, recover=True)
    assert recovered.node_ids() == [f"m{k}" for k in range(5)]
    assert [u.node_id for u in recovered.load_report.unkeyed] == ["m2", "m3", "m4"]
    assert [recovered.parent(f"m{k}") for k in range(5)] == [None, "m0", "m1", "m2", "m3"]

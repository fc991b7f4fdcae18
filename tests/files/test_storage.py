"""The rollout file: round trips, append mode, truncation, flipped bytes, garbage input."""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import random
from pathlib import Path

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import assert_same, json_like
from support import messages as message_values

from rollout_store import (
    ChecksumMismatch,
    CorruptFileError,
    FileLockedError,
    FileSyncError,
    FileWriteError,
    InvalidValueError,
    RolloutGraph,
    RolloutStoreError,
    TurnNode,
    UnsupportedVersionError,
    export_session,
)
from rollout_store.files import frames, framing, storage

ODD = [1, 1.0, True, -0.0, float("nan"), float("inf"), -float("inf"), 2**70, -(2**65)]


def _image(rng: random.Random, n: int = 3000) -> str:
    return "data:image/png;base64," + base64.b64encode(rng.randbytes(n)).decode()


def build_rollout(graph: RolloutGraph, seed: int = 0, turns: int = 5) -> list[str]:
    """A multimodal, token-carrying rollout with odd values, a fork and a retry."""
    rng = random.Random(seed)
    messages: list = [{"role": "system", "content": "rules " * 300}]
    prompt: list[int] = []
    ids = []
    for k in range(turns):
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"turn {k} \ud800 caf\u00e9"},
                    {"type": "image_url", "image_url": {"url": _image(rng)}},
                ],
                "odd": ODD + [{}, [], (1, 2), {"1": 1, "a": None}],
            }
        )
        prompt = prompt + [rng.randrange(150_000) for _ in range(100)]
        sampled = [rng.randrange(150_000) for _ in range(20)]
        response = {"role": "assistant", "content": f"reply {k} " + "x" * 1500, "refusal": None}
        body = {
            "request_messages": messages,
            "response_message": response,
            "request_tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "sampling_params": {"temperature": 1.0, "seed": k},
            "prompt_ids": prompt,
            "sampled_ids": sampled,
            "sampled_logprobs": [-rng.random() for _ in sampled],
            "model": "m",
            "finish_reason": "stop",
        }
        node = graph.add_turn(TurnNode(**json.loads(json.dumps(body))))
        ids.append(node.node_id)
        if k == 2:  # a retry of this call that was dropped
            retry = dict(body, sampled_ids=sampled[:5], sampled_logprobs=None)
            graph.add_turn(TurnNode(**json.loads(json.dumps(retry))))
        messages = [*messages, {"role": "assistant", "content": response["content"]}]
        prompt = prompt + sampled
    # a message-only fork, and a turn with big and negative ids
    graph.add_turn(
        TurnNode(
            request_messages=[{"role": "user", "content": "other"}],
            response_message={"role": "assistant", "content": "ok"},
        )
    )
    graph.add_turn(TurnNode(prompt_ids=[2**40, -3, 2**70], sampled_ids=[], sampled_logprobs=[0]))
    return ids


def snapshot(graph: RolloutGraph) -> str:
    doc = export_session(graph, include_messages=True, include_discarded=True)
    traces = [graph.get(n) for n in graph.node_ids()]
    return json.dumps(doc) + repr(
        [(t.prompt_ids, t.sampled_ids, t.sampled_logprobs) for t in traces]
    )


def assert_same_graph(a: RolloutGraph, b: RolloutGraph) -> None:
    assert snapshot(a) == snapshot(b)
    assert a.stats() == b.stats()
    assert [a.link_kind(n) for n in a.node_ids()] == [b.link_kind(n) for n in b.node_ids()]


@pytest.fixture
def graph() -> RolloutGraph:
    g = RolloutGraph()
    build_rollout(g)
    return g


@pytest.mark.parametrize("threshold", [1024, 8, None])
def test_save_load_round_trip(tmp_path: Path, threshold: int | None) -> None:
    g = RolloutGraph(share_threshold=threshold)
    build_rollout(g)
    path = tmp_path / "r.rls"
    g.save(path)
    loaded = RolloutGraph.load(path)
    assert_same_graph(g, loaded)
    assert loaded.load_report.ok
    # the loaded graph keeps recording and sharing like the original
    for target in (g, loaded):
        build_rollout(target, seed=1, turns=2)
    assert_same_graph(g, loaded)


def test_long_strings_stored_once_in_file(tmp_path: Path) -> None:
    g = RolloutGraph()
    build_rollout(g, turns=6)
    g.save(tmp_path / "r.rls")
    data = (tmp_path / "r.rls").read_bytes()
    image = g.get(g.node_ids()[0]).request_messages[1]["content"][1]["image_url"]["url"]
    assert data.count(image.encode()) == 1


def test_save_replaces_atomically_and_leaves_no_temp(tmp_path: Path, graph: RolloutGraph) -> None:
    path = tmp_path / "r.rls"
    path.write_bytes(b"old")
    graph.save(path)
    assert RolloutGraph.load(path).stats() == graph.stats()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.rls"]


def test_relinked_turns_round_trip(tmp_path: Path) -> None:
    """A turn that arrived before its parent keeps the corrected link after save and load."""
    first = {"prompt_ids": list(range(100)), "sampled_ids": [500, 501]}
    second = {"prompt_ids": [*range(100), 500, 501, 7, 8], "sampled_ids": [600]}
    third = {"prompt_ids": [*range(100), 500, 501, 7, 8, 600, 9], "sampled_ids": [700]}
    for mode in ("save", "append"):
        path = tmp_path / f"{mode}.rls"
        g = RolloutGraph.open(path) if mode == "append" else RolloutGraph()
        g.add_turn(TurnNode(node_id="a", **first))
        g.add_turn(TurnNode(node_id="c", **third))
        g.add_turn(TurnNode(node_id="b", **second))
        assert g.parent("c") == "b"
        if mode == "save":
            g.save(path)
        g.close()
        loaded = RolloutGraph.load(path)
        assert loaded.path_ids("c") == ["a", "b", "c"]
        assert_same_graph(g, loaded)


@pytest.mark.parametrize("fsync", ["turn", 3, "never"])
def test_append_mode_writes_every_turn(tmp_path: Path, fsync: str | int) -> None:
    path = tmp_path / "log.rls"
    reference = RolloutGraph()
    build_rollout(reference)
    with RolloutGraph.open(path, fsync=fsync) as g:
        build_rollout(g)
        # every turn is in the file before close, whatever the fsync policy
        assert_same_graph(RolloutGraph.load(path), reference)
    assert_same_graph(RolloutGraph.load(path), reference)
    # reopen and continue
    with RolloutGraph.open(path) as g:
        build_rollout(g, seed=5, turns=2)
    build_rollout(reference, seed=5, turns=2)
    assert_same_graph(RolloutGraph.load(path), reference)


def _counting_fsync(monkeypatch: pytest.MonkeyPatch, path: Path, fail: bool = False) -> list[int]:
    """Count the syncs of `path` (and fail them as an I/O error would, if `fail`)."""
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.path.samefile(f"/proc/self/fd/{fd}", path):
            synced.append(fd)
            if fail:
                raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


@pytest.mark.parametrize(("fsync", "syncs"), [("turn", 1), (2, 1), (1000, 0), ("never", 0)])
def test_a_group_commit_syncs_its_turns_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: str | int, syncs: int
) -> None:
    path, reference = tmp_path / "log.rls", RolloutGraph()
    build_rollout(reference)
    with RolloutGraph.open(path, fsync=fsync) as g:
        synced = _counting_fsync(monkeypatch, path)
        with g.group_commit():
            build_rollout(g)
            assert synced == []  # written one by one, synced at the end
            assert_same_graph(RolloutGraph.load(path), reference)
        assert len(synced) == syncs
        g.add_turn(TurnNode(request_messages=[{"role": "user", "content": "after"}]))
        if fsync == "turn":  # the policy as before
            assert len(synced) == syncs + 1
    assert len(RolloutGraph.load(path)) == len(reference) + 1
    with RolloutGraph().group_commit():  # no file: nothing to sync
        pass


def test_a_group_commit_whose_sync_fails_keeps_its_turns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed sync at the end of a group raises `FileSyncError` (an `OSError` in the
    library's tree): the turns stay in the graph and the file, synced again at close."""
    path = tmp_path / "log.rls"
    with RolloutGraph.open(path) as g:
        with monkeypatch.context() as patch:
            failed = _counting_fsync(patch, path, fail=True)
            with (
                pytest.raises(FileSyncError, match="Input/output error") as error,
                g.group_commit(),
            ):
                build_rollout(g, turns=2)
            assert len(failed) == 1 and error.value.errno == errno.EIO
            assert isinstance(error.value, RolloutStoreError) and str(path) in str(error.value)
        reference = RolloutGraph()
        build_rollout(reference, turns=2)
        assert_same_graph(g, reference)
        assert_same_graph(RolloutGraph.load(path), reference)
        synced = _counting_fsync(monkeypatch, path)
    assert len(synced) == 1  # close syncs what the failed sync left


def test_append_rejected_turn_leaves_file_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "log.rls"
    with RolloutGraph.open(path) as g:
        build_rollout(g, turns=2)
        before = path.read_bytes()
        stats = g.stats()
        bad = TurnNode(request_messages=[{"role": "user", "content": "y" * 5000, "b": {1, 2}}])
        with pytest.raises(InvalidValueError, match=r"request_messages\[0\]\.b"):
            g.add_turn(bad)
        assert path.read_bytes() == before
        assert g.stats() == stats


def test_append_write_failure_rolls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "log.rls"
    with RolloutGraph.open(path) as g:
        build_rollout(g, turns=2)
        before, stats = path.read_bytes(), g.stats()
        calls = {"n": 0}
        real_write = os.write

        def failing_write(fd: int, data: bytes) -> int:
            calls["n"] += 1
            if calls["n"] == 1:  # write half, then fail as a full disk would
                real_write(fd, bytes(data)[: len(data) // 2])
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "write", failing_write)
        turn = TurnNode(request_messages=[{"role": "user", "content": "z" * 4000}])
        with pytest.raises(OSError, match="No space"):
            g.add_turn(turn)
        monkeypatch.setattr(os, "write", real_write)
        assert path.read_bytes() == before
        assert g.stats() == stats
        g.add_turn(turn)
    assert len(RolloutGraph.load(path)) == len(g)


def test_a_failed_write_is_the_librarys_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk while appending or saving raises `FileWriteError` (an `OSError` in the
    library's tree, with the system's errno), and leaves the log, the graph and the target
    of the save as they were."""
    log, snapshot = tmp_path / "log.rls", tmp_path / "s.rls"
    with RolloutGraph.open(log) as g:
        build_rollout(g, turns=2)
        g.save(snapshot)
        before, saved, stats = log.read_bytes(), snapshot.read_bytes(), g.stats()

        def full_disk(fd: int, data: object) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "write", full_disk)
        monkeypatch.setattr(os, "writev", full_disk)
        turn = TurnNode(request_messages=[{"role": "user", "content": "full"}])
        with pytest.raises(FileWriteError, match="No space") as appended:
            g.add_turn(turn)
        assert isinstance(appended.value, RolloutStoreError)
        assert appended.value.errno == errno.ENOSPC and str(log) in str(appended.value)
        with pytest.raises(FileWriteError, match="No space") as replaced:
            g.save(snapshot)
        assert replaced.value.errno == errno.ENOSPC
        monkeypatch.undo()
        assert log.read_bytes() == before and snapshot.read_bytes() == saved
        assert g.stats() == stats
        assert sorted(p.name for p in tmp_path.iterdir()) == ["log.rls", "s.rls"]


def test_second_appender_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "log.rls"
    with RolloutGraph.open(path), pytest.raises(FileLockedError, match="another process"):
        RolloutGraph.open(path)


def test_open_refuses_snapshot(tmp_path: Path, graph: RolloutGraph) -> None:
    graph.save(tmp_path / "s.rls")
    with pytest.raises(CorruptFileError, match="snapshot"):
        RolloutGraph.open(tmp_path / "s.rls")


def _turn_ends(path: Path) -> list[int]:
    """Byte offsets just past each turn record of a file."""
    return [
        start + length
        for kind, start, length in _record_offsets(path.read_bytes())
        if kind == frames.KIND_TURN
    ]


def _small_log(tmp_path: Path) -> Path:
    path = tmp_path / "small.rls"
    with RolloutGraph.open(path, share_threshold=64) as g:
        g.add_turn(TurnNode(request_messages=[{"role": "user", "content": "a" * 70}]))
        g.add_turn(
            TurnNode(
                request_messages=[
                    {"role": "user", "content": "a" * 70},
                    {"role": "assistant", "content": "b" * 80},
                    {"role": "user", "content": [1, 1.0, -0.0]},
                ],
                prompt_ids=[1, 2, 3],
                sampled_ids=[4],
                sampled_logprobs=[-0.25],
            )
        )
    return path


def test_truncation_at_every_byte_loads_complete_turns(tmp_path: Path) -> None:
    path = _small_log(tmp_path)
    data = path.read_bytes()
    ends = _turn_ends(path)
    header_end = _record_offsets(data)[1][1]
    full = RolloutGraph.load(path)
    cut_path = tmp_path / "cut.rls"
    for cut in range(len(data)):
        cut_path.write_bytes(data[:cut])
        if cut < header_end:  # not even the header: nothing to recover
            with pytest.raises(CorruptFileError):
                RolloutGraph.load(cut_path, recover=True)
            continue
        recovered = RolloutGraph.load(cut_path, recover=True)
        assert len(recovered) == sum(1 for end in ends if end <= cut), cut
        for node_id in recovered.node_ids():
            assert json.dumps(recovered.get(node_id).request_messages) == json.dumps(
                full.get(node_id).request_messages
            )
        report = recovered.load_report
        if cut in ends or cut == header_end:
            assert report.ok  # a log cut between turns is a shorter, valid log
            continue
        assert not report.ok and report.truncated, cut
        assert report.good_bytes == max([header_end, *(e for e in ends if e <= cut)])
        with pytest.raises(CorruptFileError) as info:
            RolloutGraph.load(cut_path)
        assert info.value.offset is not None


def test_repair_truncates_torn_tail_and_continues(tmp_path: Path) -> None:
    path = _small_log(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-5])
    with pytest.raises(CorruptFileError, match="ends inside"):
        RolloutGraph.open(path)
    assert path.read_bytes() == data[:-5]  # refused without touching the file
    with RolloutGraph.open(path, repair=True) as g:
        assert len(g) == 1
        g.add_turn(TurnNode(request_messages=[{"role": "user", "content": "again"}]))
    assert len(RolloutGraph.load(path)) == 2
    assert storage.verify(path).ok


def test_snapshot_cut_at_record_boundary_is_detected(tmp_path: Path, graph: RolloutGraph) -> None:
    path = tmp_path / "s.rls"
    graph.save(path)
    ends = _turn_ends(path)
    path.write_bytes(path.read_bytes()[: ends[-1]])  # drop only the end record
    with pytest.raises(CorruptFileError, match="end record"):
        RolloutGraph.load(path)
    assert len(RolloutGraph.load(path, recover=True)) == len(graph)


def _record_offsets(data: bytes) -> list[tuple[int, int, int]]:
    """(kind, offset, size) of each frame of a version-1 or version-2 file."""
    offset, out = len(frames.MAGIC), []
    v1 = data.startswith(frames.MAGIC)
    while offset < len(data):
        if v1:
            kind, length, _ = frames.FRAME.unpack_from(data, offset)
            size = frames.FRAME.size + length
        else:
            _, kind, length, _, _ = framing.HEADER.unpack_from(data, offset)
            kind, size = kind & 0x7F, framing.HEADER.size + length
        out.append((kind, offset, size))
        offset += size
    return out


def test_flipped_byte_in_each_record_kind_is_detected(tmp_path: Path, graph: RolloutGraph) -> None:
    path = tmp_path / "s.rls"
    graph.save(path)
    data = path.read_bytes()
    records = _record_offsets(data)
    kinds = {kind for kind, _, _ in records}
    assert kinds == {0, 1, 2, 3, 4}
    damaged = tmp_path / "d.rls"
    for kind in sorted(kinds):
        for _, start, length in [r for r in records if r[0] == kind][:3]:
            for pos in (start, start + 5, start + 13, start + length // 2, start + length - 1):
                changed = bytearray(data)
                changed[pos] ^= 0x01
                damaged.write_bytes(bytes(changed))
                with pytest.raises(CorruptFileError) as info:
                    RolloutGraph.load(damaged)
                assert info.value.offset is not None and info.value.offset <= pos
                assert not storage.verify(damaged).ok


def test_every_flipped_bit_of_a_small_file_is_detected(tmp_path: Path) -> None:
    path = _small_log(tmp_path)
    data = path.read_bytes()
    damaged = tmp_path / "d.rls"
    for pos in range(len(data)):
        changed = bytearray(data)
        changed[pos] ^= 1 << (pos % 8)
        damaged.write_bytes(bytes(changed))
        with pytest.raises(CorruptFileError):
            RolloutGraph.load(damaged)


def test_blob_digest_mismatch_is_a_checksum_error(tmp_path: Path) -> None:
    """A blob whose content changed with a recomputed frame checksum still fails its digest
    (in version 2 the frame's chain covers the digest, and the digest the text)."""
    path = _small_log(tmp_path)
    data = bytearray(path.read_bytes())
    for kind, start, length in _record_offsets(bytes(data)):
        if kind == frames.KIND_BLOB and not data.startswith(frames.MAGIC):
            data[start + length - 1] ^= 0x02
            break
        if kind == frames.KIND_BLOB:
            payload = bytearray(data[start + frames.FRAME.size : start + length])
            payload[-1] ^= 0x02  # the blob's last content byte
            frame = frames.frame(kind, bytes(payload))
            data[start : start + length] = frame
            break
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch) as info:
        RolloutGraph.load(path)
    assert info.value.offset is not None


def test_newer_version_is_refused(tmp_path: Path) -> None:
    header = frames.pack({"format": "rollout_store", "version": 99, "mode": "log"})
    path = tmp_path / "new.rls"
    path.write_bytes(frames.MAGIC + frames.frame(frames.KIND_HEADER, header))
    with pytest.raises(UnsupportedVersionError, match="version 99"):
        RolloutGraph.load(path)


def test_not_a_rollout_file(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text('{"turns": []}')
    with pytest.raises(CorruptFileError, match="magic"):
        RolloutGraph.load(path)


@given(st.binary(max_size=300))
def test_garbage_never_crashes_with_another_error(tmp_path_factory, blob: bytes) -> None:
    path = tmp_path_factory.mktemp("g") / "g.rls"
    for data in (
        blob,
        frames.MAGIC + blob,
        framing.MAGIC_V2 + blob,
        framing.MAGIC_V2 + framing.SYNC + blob,
    ):
        path.write_bytes(data)
        with contextlib.suppress(CorruptFileError):
            RolloutGraph.load(path, recover=True)


def test_crafted_records_with_valid_checksums_are_rejected(tmp_path: Path) -> None:
    """Payloads that pass the frame checksum but make no sense still fail cleanly."""
    header = frames.pack({"format": "rollout_store", "version": 1, "mode": "log"})
    bad_turns = [
        [],
        ["a"] * 18,
        ["n", 5, 0, 0, [None] * 5, None, None, b"", 0, None, None, None, None, None, None]
        + [[None] * 4, [0, 0], []],  # parent 5 does not exist
        ["n", None, 0, 0, [None] * 5, None, None, b"\xd6\x04\x00\x00\x00\x09", 1, None]
        + [None, None, None, None, None, [None] * 4, [0, 0], []],  # blob 9 does not exist
        ["n", None, 0, 0, [None] * 5, 3, None, b"", 0, None, None, None, None, None, None]
        + [[None] * 4, [0, 0], []],  # value 3 does not exist
        ["n", None, 0, 0, [None] * 5, None, None, b"", 0, None, None, None, [0, 0], None, None]
        + [[None] * 4, [0, 0], []],  # prompt refers to a turn not yet read
    ]
    path = tmp_path / "c.rls"
    for turn in bad_turns:
        records = frames.frame(frames.KIND_HEADER, header) + frames.frame(
            frames.KIND_TURN, frames.pack(turn)
        )
        path.write_bytes(frames.MAGIC + records)
        with pytest.raises(CorruptFileError) as info:
            RolloutGraph.load(path)
        assert info.value.offset == len(frames.MAGIC) + len(
            frames.frame(frames.KIND_HEADER, header)
        )


@pytest.mark.slow
def test_fuzzed_mutations_of_a_real_file(tmp_path: Path) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    path = _small_log(tmp_path)
    data = path.read_bytes()
    damaged = tmp_path / "d.rls"
    for _ in range(3000):
        changed = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            pos = rng.randrange(len(changed))
            if op < 0.5:
                changed[pos] = rng.randrange(256)
            elif op < 0.75:
                del changed[pos : pos + rng.randint(1, 20)]
            else:
                changed[pos:pos] = rng.randbytes(rng.randint(1, 20))
        damaged.write_bytes(bytes(changed))
        try:
            loaded = RolloutGraph.load(damaged, recover=True)
        except CorruptFileError:
            continue
        except Exception as exc:  # pragma: no cover - the failure message carries the seed
            raise AssertionError(f"seed {seed}: {type(exc).__name__}: {exc}") from exc
        # whatever loaded is a prefix of the original turns, exactly
        original = RolloutGraph.load(path)
        for node_id in loaded.node_ids():
            assert json.dumps(loaded.get(node_id).request_messages) == json.dumps(
                original.get(node_id).request_messages
            ), f"seed {seed}"


@given(
    st.lists(message_values, min_size=1, max_size=4),
    json_like,
    st.lists(json_like, max_size=2),
)
def test_any_value_round_trips_through_a_file(tmp_path_factory, messages, response, tools) -> None:
    """Whatever JSON can carry comes back type-exact and byte-identical from a file."""
    graph = RolloutGraph(share_threshold=16)
    graph.add_turn(
        TurnNode(request_messages=messages, response_message=response, request_tools=tools)
    )
    graph.add_turn(
        TurnNode(request_messages=[*messages, response, {"role": "user", "content": "more"}])
    )
    path = tmp_path_factory.mktemp("rt") / "r.rls"
    graph.save(path)
    loaded = RolloutGraph.load(path)
    for node_id in graph.node_ids():
        want, got = graph.get(node_id), loaded.get(node_id)
        for field in ("request_messages", "request_tools", "response_message"):
            assert_same(getattr(got, field), getattr(want, field))
    assert_same_graph(graph, loaded)


def test_deep_nesting_round_trips_through_a_file(tmp_path: Path) -> None:
    value: object = "leaf"
    for depth in range(499):
        value = [value] if depth % 3 else ({"k": value} if depth % 2 else (value,))
    graph = RolloutGraph()
    graph.add_turn(TurnNode(request_messages=[value]))
    graph.save(tmp_path / "deep.rls")
    loaded = RolloutGraph.load(tmp_path / "deep.rls")
    assert_same(loaded.request_messages(loaded.node_ids()[0]), [value])


def test_ids_and_names_with_lone_surrogates_round_trip(tmp_path: Path) -> None:
    for mode in ("save", "append"):
        path = tmp_path / f"{mode}.rls"
        graph = RolloutGraph.open(path) if mode == "append" else RolloutGraph()
        graph.add_turn(TurnNode(node_id="a\ud800", model="m\udc00", harness_session_id="\ud83d"))
        graph.close()
        if mode == "save":
            graph.save(path)
        loaded = RolloutGraph.load(path)
        assert loaded.node_ids() == ["a\ud800"]
        turn = loaded.get("a\ud800")
        assert (turn.model, turn.harness_session_id) == ("m\udc00", "\ud83d")


def _crafted_log(tmp_path: Path, records: list[tuple[int, object]]) -> Path:
    header = frames.pack({"format": "rollout_store", "version": 1, "mode": "log"})
    data = frames.MAGIC + frames.frame(frames.KIND_HEADER, header)
    for kind, body in records:
        data += frames.frame(kind, frames.pack(body))
    path = tmp_path / "crafted.rls"
    path.write_bytes(data)
    return path


def _turn_record(**changes: object) -> list:
    fields = {
        "node_id": "n",
        "parent": None,
        "link": 0,
        "flags": 0,
        "meta": [None] * 5,
        "system": None,
        "base": None,
        "tail": b"\x90",
        "n_rest": 0,
        "response": None,
        "tools": None,
        "sampling": None,
        "prompt": None,
        "sampled": None,
        "logprobs": None,
        "keys": [None] * 4,
        "refs": [0, 0],
        "moves": [],
    }
    fields.update(changes)
    return list(fields.values())


def test_crafted_records_that_pass_checksums_are_still_refused(tmp_path: Path) -> None:
    """Checksums can be recomputed by anyone: the structure is checked too (review findings)."""
    value = (frames.KIND_VALUE, msgpack.packb({"role": "system"}))
    crafted = [
        [(frames.KIND_TURN, _turn_record(tail=msgpack.packb(5)))],  # tail not an array
        [(frames.KIND_TURN, _turn_record(tail=b"\x91\xa1x", n_rest=2))],  # wrong count
        [value, (frames.KIND_TURN, _turn_record(system=0))],  # system not an array
        [(frames.KIND_TURN, _turn_record(prompt=[2, ["d", b"\0" * 16]]))],  # float tokens
        [(frames.KIND_TURN, _turn_record(refs=[-1, 0]))],
        [
            (frames.KIND_TURN, _turn_record(node_id="a")),
            (frames.KIND_TURN, _turn_record(node_id="b", tail=b"\x91\xc7\x00\x05", n_rest=1)),
        ],  # an echo placeholder where no echo is flagged
        [
            (frames.KIND_TURN, _turn_record(node_id="a")),
            (frames.KIND_TURN, _turn_record(node_id="b", parent=0, link=2, moves=[[0, 2]])),
        ],  # a move that would make a cycle
    ]
    for records in crafted:
        path = _crafted_log(tmp_path, records)
        with pytest.raises(CorruptFileError):
            RolloutGraph.load(path)


@pytest.mark.parametrize(
    "tear",
    [
        lambda data: data + b"\0" * 64,  # space allocated, write never landed
        lambda data: data[:-9] + bytes(9),  # the last frame's bytes zeroed
        lambda data: data[:-5] + b"garbage",  # the last frame overwritten to the end
        lambda data: frames.MAGIC[:5],  # cut inside the magic
    ],
)
def test_repair_handles_torn_tails_that_are_not_short(tmp_path: Path, tear) -> None:
    path = _small_log(tmp_path)
    data = path.read_bytes()
    path.write_bytes(tear(data))
    with pytest.raises(CorruptFileError):
        RolloutGraph.open(path)
    with RolloutGraph.open(path, repair=True) as graph:
        kept = len(graph)
        graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "after"}]))
    assert kept in (0, 1, 2)
    loaded = RolloutGraph.load(path)
    assert len(loaded) == kept + 1 and storage.verify(path).ok


def test_repair_refuses_damage_in_the_middle(tmp_path: Path) -> None:
    path = _small_log(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(frames.MAGIC) + 20] ^= 0xFF  # inside the header record, far from the end
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError):
        RolloutGraph.open(path, repair=True)
    assert path.read_bytes() == bytes(data)


def test_closed_log_refuses_turns_and_save_refuses_its_own_log(tmp_path: Path) -> None:
    path = tmp_path / "log.rls"
    graph = RolloutGraph.open(path)
    graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "a"}]))
    with pytest.raises(ValueError, match="appends to"):
        graph.save(path)
    graph.close()
    with pytest.raises(RolloutStoreError, match="closed"):
        graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "b"}]))
    assert len(graph) == 1 and len(RolloutGraph.load(path)) == 1
    graph.save(tmp_path / "copy.rls")  # a snapshot elsewhere is fine, also after close


def _log_of(tmp_path: Path, n: int) -> tuple[Path, list[int]]:
    path = tmp_path / "log.rls"
    with RolloutGraph.open(path, share_threshold=4) as graph:
        for i in range(n):
            graph.add_turn(
                TurnNode(
                    node_id=f"t{i}",
                    request_messages=[{"role": "user", "content": f"a long string {i}"}],
                )
            )
    return path, [start for _, start, _ in _record_offsets(path.read_bytes())]


def test_repair_never_cuts_intact_records_after_a_damaged_length(tmp_path: Path) -> None:
    """A flipped bit in a middle frame's length looks like a cut, but records follow it."""
    path, starts = _log_of(tmp_path, 5)
    for victim in (starts[0], starts[3]):  # the header frame, then a middle frame
        data = bytearray(path.read_bytes())
        original = bytes(data)
        data[victim + 4] ^= 0x40
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptFileError):
            RolloutGraph.open(path, repair=True)
        assert path.read_bytes() == bytes(data)  # untouched
        path.write_bytes(original)


def test_repair_cuts_a_partial_write_followed_by_zeros(tmp_path: Path) -> None:
    """A crash that left the size of a whole turn write but only its first bytes."""
    path = tmp_path / "log.rls"
    with RolloutGraph.open(path, share_threshold=4) as graph:
        graph.add_turn(TurnNode(node_id="a", request_messages=[{"role": "user", "content": "hi"}]))
    good = path.stat().st_size
    with RolloutGraph.open(path, share_threshold=4) as graph:
        graph.add_turn(
            TurnNode(node_id="b", request_messages=[{"role": "user", "content": "a long string"}])
        )
    data = path.read_bytes()
    for written in (good + 5, good + 20, len(data) - 3):
        path.write_bytes(data[:written] + bytes(len(data) - written))
        with RolloutGraph.open(path, share_threshold=4, repair=True) as graph:
            assert graph.node_ids() == ["a"]
        assert path.stat().st_size == good


def test_crafted_base_without_messages_is_refused(tmp_path: Path) -> None:
    crafted = [
        (frames.KIND_TURN, _turn_record(node_id="a", flags=16, tail=b"")),  # no messages
        (frames.KIND_TURN, _turn_record(node_id="b", base=0, tail=b"\x91\xa1x", n_rest=1)),
    ]
    with pytest.raises(CorruptFileError, match="no base"):
        RolloutGraph.load(_crafted_log(tmp_path, crafted))


def test_every_file_the_library_writes_is_private(tmp_path: Path) -> None:
    """Snapshots, logs, recovered copies, exports and session files (an API key): 0600."""
    import stat

    from rollout_store.cli import main as cli_main
    from rollout_store.serve.sessions import Sessions

    def mode(path: Path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    old = os.umask(0o022)  # a common umask: files it governs would be 0644
    try:
        with RolloutGraph.open(tmp_path / "log.rls") as graph:
            build_rollout(graph, turns=2)
        graph.save(tmp_path / "snap.rls")
        assert (
            cli_main(["recover", str(tmp_path / "log.rls"), "-o", str(tmp_path / "rec.rls")]) == 0
        )
        assert cli_main(["export", str(tmp_path / "log.rls"), "-o", str(tmp_path / "x.json")]) == 0
        sessions = Sessions(tmp_path / "data")
        try:
            session = sessions.create("s1")
        finally:
            sessions.close()
        session_files = sorted((tmp_path / "data").iterdir())
    finally:
        os.umask(old)
    for name in ("log.rls", "snap.rls", "rec.rls", "x.json"):
        assert mode(tmp_path / name) == 0o600, name
    assert session_files and session.api_key
    for path in session_files:
        assert mode(path) == 0o600, path.name

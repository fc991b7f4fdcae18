"""Format version 2 against the breaks found in version 1 (issue 10), and version 1 still read."""

from __future__ import annotations

import gc
import itertools
import json
import multiprocessing
import os
import struct
import threading
import tracemalloc
from collections.abc import Callable
from functools import partial
from pathlib import Path

import blake3
import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_storage import build_rollout, snapshot

from rollout_store import (
    MAX_DEPTH,
    CorruptFileError,
    RolloutGraph,
    RolloutStoreError,
    TurnNode,
    export_session,
    write_session_json,
)
from rollout_store.cli import main as cli_main
from rollout_store.engine.stored import TurnFlag
from rollout_store.files import frames, framing, storage
from rollout_store.files.framing import HEADER, MAGIC_V2, SYNC, encode_frame

DATA = Path(__file__).resolve().parents[1] / "data"


def frame_offsets(data: bytes) -> list[int]:
    """Offsets of the frames of a version-2 file, read from their headers."""
    assert data.startswith(MAGIC_V2)
    offset, out = len(MAGIC_V2), []
    while offset < len(data):
        out.append(offset)
        _, _, length, _, _ = HEADER.unpack_from(data, offset)
        offset += HEADER.size + length
    return out


def frames_of(data: bytes) -> list[bytes]:
    bounds = [*frame_offsets(data), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def small_graph(path: Path | None = None) -> RolloutGraph:
    g = RolloutGraph.open(path, share_threshold=32) if path else RolloutGraph(share_threshold=32)
    g.add_turn(TurnNode(node_id="a", request_messages=[{"role": "user", "content": "A" * 40}]))
    g.add_turn(
        TurnNode(
            node_id="b",
            request_messages=[
                {"role": "user", "content": "A" * 40},
                {"role": "user", "content": "B" * 40},
            ],
            sampling_params={"t": 1},
        )
    )
    g.add_turn(
        TurnNode(
            node_id="c",
            request_messages=[{"role": "user", "content": "C" * 40}],
            sampling_params={"t": 2},
        )
    )
    return g


# ---------------------------------------------------------------- version 1 still loads


@pytest.mark.parametrize("name", ["v1_snapshot.rls", "v1_log.rls"])
def test_version_1_files_load_and_save_as_version_2(tmp_path: Path, name: str) -> None:
    path = DATA / name
    assert path.read_bytes().startswith(b"RLSTORE\x00")
    loaded = RolloutGraph.load(path)
    assert snapshot(loaded) == (DATA / f"{name}.expected").read_text()
    assert storage.verify(path).ok
    rewritten = tmp_path / "v2.rls"
    loaded.save(rewritten)
    assert rewritten.read_bytes().startswith(MAGIC_V2)
    assert snapshot(RolloutGraph.load(rewritten)) == snapshot(loaded)


def test_a_version_1_log_keeps_appending(tmp_path: Path) -> None:
    path = tmp_path / "log.rls"
    path.write_bytes((DATA / "v1_log.rls").read_bytes())
    with RolloutGraph.open(path, share_threshold=64) as graph:
        n = len(graph)
        graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "more"}]))
    assert len(RolloutGraph.load(path)) == n + 1


def _torn_v1_log(tmp_path: Path, n_ids: int) -> tuple[Path, int, int]:
    """A version-1 log whose last turn (`n_ids` token ids) was cut short: (path, turns
    before it, bytes of the damaged tail)."""
    path = tmp_path / f"torn-{n_ids}.rls"
    path.write_bytes((DATA / "v1_log.rls").read_bytes())
    with RolloutGraph.open(path, share_threshold=64, fsync="never") as graph:
        kept = len(graph)
        good = path.stat().st_size
        graph.add_turn(TurnNode(prompt_ids=list(range(n_ids)), sampled_ids=[1]))
    assert path.read_bytes().startswith(frames.MAGIC)  # a version-1 log stays one
    with open(path, "r+b") as fp:
        fp.truncate(path.stat().st_size - 64)
    return path, kept, path.stat().st_size - good


def _hashed_by_repair(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """(bytes, frames and candidates) of version-1 checksums computed while
    `open(repair=True)` reads it: the engine counts what it hashes, and every reader the
    loader makes reports to one count."""
    counters = framing.ScanCounters()
    monkeypatch.setattr(storage, "FrameReader", partial(frames.FrameReader, counters=counters))
    with RolloutGraph.open(path, share_threshold=64, repair=True):
        pass
    monkeypatch.undo()
    return counters.hashed_bytes, counters.candidates


def test_repair_of_a_torn_version_1_turn_is_linear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 10, break 3 for version 1: repair checksummed a candidate frame at every offset
    of the damage (a torn token turn holds a plausible frame header every few bytes). Work is
    counted, not timed: the bytes hashed grow with the damage, not with its square."""
    work = []
    for n_ids in (1 << 14, 1 << 17):
        path, kept, damaged = _torn_v1_log(tmp_path, n_ids)
        before = path.stat().st_size
        hashed, _ = _hashed_by_repair(path, monkeypatch)
        assert len(RolloutGraph.load(path)) == kept and path.stat().st_size < before
        work.append((hashed - (before - damaged), damaged))  # what the damage cost to hash
    for extra, damaged in work:
        assert extra <= 2 * damaged, (extra, damaged)
    (small, small_damage), (big, big_damage) = work
    assert big <= 2 * small * big_damage / small_damage + (1 << 16)


def test_a_recovered_graph_does_not_keep_the_file_bytes(tmp_path: Path) -> None:
    """The load report of a damaged file kept the error's traceback, whose frames held the
    whole file read in memory, for as long as the recovered graph lived."""
    path = tmp_path / "torn.rls"
    with RolloutGraph.open(path, share_threshold=64, fsync="never") as graph:
        graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "a"}]))
        graph.add_turn(TurnNode(prompt_ids=list(range(1 << 20)), sampled_ids=[1]))
    with open(path, "r+b") as fp:
        fp.truncate(path.stat().st_size - 64)
    size = path.stat().st_size
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        recovered = RolloutGraph.load(path, recover=True)
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(recovered) == 1 and recovered.load_report is not None
    assert recovered.load_report.exception is not None
    assert retained < size // 8, (retained, size)


def test_version_1_repair_refuses_a_tail_crafted_to_hold_many_candidate_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frame headers every 13 bytes, each claiming to end at the end of the file: hashing
    them all would be quadratic, so past a bounded multiple of the tail the damage is taken
    as followed by records, and repair refuses rather than cut what might be intact."""
    path = tmp_path / "crafted.rls"
    data = (DATA / "v1_log.rls").read_bytes()
    n = 1 << 16
    tail = bytearray(b"\xff" * (n * frames.FRAME.size))
    for i in range(n):
        at = i * frames.FRAME.size
        remaining = len(tail) - at - frames.FRAME.size
        frames.FRAME.pack_into(tail, at, 4, remaining, 0)
    path.write_bytes(data + b"\x01" + bytes(tail))  # a frame of kind 1 cut after its kind
    counters = framing.ScanCounters()  # the engine counts what it hashes
    monkeypatch.setattr(storage, "FrameReader", partial(frames.FrameReader, counters=counters))
    report = storage.verify(path)
    assert not report.ok and not report.truncated
    assert len(data) < counters.hashed_bytes <= 2 * len(tail) + (2 << 20) + len(data)
    monkeypatch.undo()
    with pytest.raises(CorruptFileError):
        RolloutGraph.open(path, repair=True)


def test_version_1_repair_keeps_refusing_damage_followed_by_an_intact_last_record(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.rls"
    data = bytearray((DATA / "v1_log.rls").read_bytes())
    data[len(frames.MAGIC) + 20] ^= 0xFF  # inside the header record
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError):
        RolloutGraph.open(path, repair=True)
    assert path.read_bytes() == bytes(data)


def test_saved_files_are_version_2(tmp_path: Path) -> None:
    graph = small_graph()
    graph.save(tmp_path / "s.rls")
    with small_graph(tmp_path / "log.rls"):
        pass
    for name in ("s.rls", "log.rls"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(MAGIC_V2)
        header = msgpack.unpackb(frames_of(data)[0][HEADER.size :])
        assert header["version"] == 2 and type(header["file_id"]) is int


# ---------------------------------------------------------------- frames bound to their place


@pytest.mark.parametrize("mode", ["log", "snapshot"])
def test_every_reorder_and_duplicate_of_two_frames_is_refused(tmp_path: Path, mode: str) -> None:
    """Issue 10, break 1: 64 variants of one small log and snapshot loaded silently wrong."""
    path = tmp_path / "orig.rls"
    if mode == "log":
        small_graph(path).close()
    else:
        small_graph().save(path)
    data = path.read_bytes()
    original = RolloutGraph.load(path)
    frames = frames_of(data)
    assert len(frames) >= 8
    damaged = tmp_path / "d.rls"
    variants = 0
    for i, j in itertools.permutations(range(len(frames)), 2):
        swapped = list(frames)
        swapped[i], swapped[j] = frames[j], frames[i]
        duplicated = list(frames)
        duplicated.insert(j, frames[i])
        for variant in (swapped, duplicated):
            damaged.write_bytes(MAGIC_V2 + b"".join(variant))
            first = next(k for k in range(len(variant)) if variant[k] != frames[k])
            at = len(MAGIC_V2) + sum(map(len, variant[:first]))
            with pytest.raises(CorruptFileError) as info:
                RolloutGraph.load(damaged)
            assert info.value.offset == at, (i, j)
            assert not storage.verify(damaged).ok
            # what recover returns is a prefix of the original turns, exactly
            try:
                recovered = RolloutGraph.load(damaged, recover=True)
            except CorruptFileError:
                continue
            for node_id in recovered.node_ids():
                assert json.dumps(recovered.get(node_id).request_messages) == json.dumps(
                    original.get(node_id).request_messages
                )
                assert (
                    recovered.get(node_id).sampling_params == original.get(node_id).sampling_params
                )
            variants += 1
    assert variants > 0


def test_frames_spliced_from_another_file_are_refused(tmp_path: Path) -> None:
    small_graph().save(tmp_path / "a.rls")
    small_graph().save(tmp_path / "b.rls")  # the same turns, another file id
    a, b = (frames_of((tmp_path / n).read_bytes()) for n in ("a.rls", "b.rls"))
    assert a[1:] != b[1:]  # chained from different file ids
    mixed = tmp_path / "mixed.rls"
    mixed.write_bytes(MAGIC_V2 + b"".join(a[:3] + b[3:]))
    with pytest.raises(CorruptFileError, match="out of place") as info:
        RolloutGraph.load(mixed)
    assert info.value.offset == len(MAGIC_V2) + sum(map(len, a[:3]))


# ---------------------------------------------------------------- repair whatever turns hold


def _frame_as_doubles(frame: bytes) -> list[float]:
    frame += bytes(-len(frame) % 8)
    return [struct.unpack("<d", frame[k : k + 8])[0] for k in range(0, len(frame), 8)]


def test_repair_of_a_torn_turn_whose_content_looks_like_frames(tmp_path: Path) -> None:
    """Issue 10, break 4: content that parses as a valid frame made repair refuse."""
    path = tmp_path / "log.rls"
    small_graph(path).close()
    good = path.stat().st_size
    fake, _ = encode_frame(3, msgpack.packb(["x"] * 18), 0)
    v1_like = b"\x03" + struct.pack("<IQ", 5, 0) + b"hello"  # the version-1 shape, too
    with RolloutGraph.open(path, share_threshold=32) as graph:
        graph.add_turn(
            TurnNode(
                node_id="torn",
                request_messages=[{"role": "tool", "content": v1_like.decode("latin-1") * 3}],
                prompt_ids=list(fake) * 3,
                sampled_ids=[1, 2],
                sampled_logprobs=_frame_as_doubles(fake) * 2,
            )
        )
    data = path.read_bytes()
    assert data.count(SYNC) == len(frame_offsets(data))  # no marker inside a payload
    for cut in (good + 30, (good + len(data)) // 2, len(data) - 1):
        path.write_bytes(data[:cut])
        report = storage.verify(path)
        assert not report.ok and report.truncated, cut
        with RolloutGraph.open(path, share_threshold=32, repair=True) as graph:
            assert graph.node_ids() == ["a", "b", "c"]
        assert path.stat().st_size == good


# ---------------------------------------------------------------- bounded memory


@pytest.mark.slow
def test_many_empty_maps_load_in_memory_bounded_by_the_file(tmp_path: Path) -> None:
    """Issue 10, break 2: a value of many empty maps peaked at about 150x the file."""
    path = tmp_path / "maps.rls"
    graph = RolloutGraph(share_threshold=None)
    graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": [{}] * (1 << 17)}]))
    graph.save(path)
    size = path.stat().st_size
    del graph
    storage.verify(path)  # imports and caches before the baseline
    gc.collect()
    tracemalloc.start()
    try:
        for fn in (storage.verify, RolloutGraph.load):
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            out = fn(path)
            peak = tracemalloc.get_traced_memory()[1] - before
            gc.collect()
            retained = tracemalloc.get_traced_memory()[0] - before
            del out
            assert peak - retained <= 4 * size, (fn, peak, retained, size)
    finally:
        tracemalloc.stop()


# ---------------------------------------------------------------- concurrent saves


def test_two_threads_saving_one_path(tmp_path: Path) -> None:
    path = tmp_path / "shared.rls"
    graphs = [RolloutGraph(), RolloutGraph()]
    build_rollout(graphs[0], seed=1, turns=2)
    build_rollout(graphs[1], seed=2, turns=3)
    expected = {snapshot(g) for g in graphs}
    errors: list[BaseException] = []

    def saver(graph: RolloutGraph) -> None:
        try:
            for _ in range(15):
                graph.save(path)
                assert snapshot(RolloutGraph.load(path)) in expected
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=saver, args=(g,)) for g in graphs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert [p.name for p in tmp_path.iterdir()] == ["shared.rls"]


def _save_loop(path: str, seed: int, rounds: int) -> None:
    graph = RolloutGraph()
    build_rollout(graph, seed=seed, turns=2)
    for _ in range(rounds):
        graph.save(path)
        RolloutGraph.load(path)


def test_two_processes_saving_one_path(tmp_path: Path) -> None:
    path = tmp_path / "shared.rls"
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_save_loop, args=(str(path), s, 10)) for s in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert storage.verify(path).ok
    assert [p.name for p in tmp_path.iterdir()] == ["shared.rls"]


def test_save_over_a_log_another_graph_appends_to_is_refused(tmp_path: Path) -> None:
    """Issue 10, break 5: the appender went on writing to the replaced file."""
    path = tmp_path / "live.rls"
    with small_graph(path) as live:
        before = path.read_bytes()
        with pytest.raises(storage.FileLockedError, match="appending"):
            small_graph().save(path)
        assert path.read_bytes() == before
        live.add_turn(TurnNode(node_id="d", request_messages=[{"role": "user", "content": "d"}]))
    assert RolloutGraph.load(path).node_ids() == ["a", "b", "c", "d"]
    small_graph().save(path)  # closed: replacing it is fine
    assert RolloutGraph.load(path).node_ids() == ["a", "b", "c"]


def _hold_log(path: str, ready: object, done: object) -> None:
    with RolloutGraph.open(path):
        ready.set()  # type: ignore[attr-defined]
        done.wait(60)  # type: ignore[attr-defined]


def test_save_over_a_log_another_process_appends_to_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "live.rls"
    context = multiprocessing.get_context("spawn")
    ready, done = context.Event(), context.Event()
    proc = context.Process(target=_hold_log, args=(str(path), ready, done))
    proc.start()
    try:
        assert ready.wait(60)
        with pytest.raises(RolloutStoreError, match="appending"):
            small_graph().save(path)
    finally:
        done.set()
        proc.join(60)
    assert proc.exitcode == 0


# ---------------------------------------------------------------- verify means usable


def crafted_v2(tmp_path: Path, records: list[tuple[int, object]], **header_fields: object) -> Path:
    """A version-2 log of a header (plus `header_fields`) and the given records (bodies
    packed), chained right."""
    header = {
        "format": "rollout_store",
        "version": 2,
        "mode": "log",
        "share_threshold": 8,
        "file_id": 7,
        **header_fields,
    }
    out, chain = [MAGIC_V2], 0
    for kind, body in [(0, header), *records]:
        payload = body if isinstance(body, bytes) else msgpack.packb(body, use_bin_type=True)
        if kind == 1:  # a blob: digest, then text; its chain covers the digest
            parts, chain = framing.encode_blob_frame(kind, payload[:16], payload[16:], chain)
            out.extend(parts)
            continue
        frame, chain = encode_frame(kind, payload, chain)
        out.append(frame)
    path = tmp_path / "crafted.rls"
    path.write_bytes(b"".join(out))
    return path


def request_key(*plains: bytes) -> int:
    """The request key of non-system messages with these plain packings (BLAKE3 of them)."""
    return int.from_bytes(blake3.blake3(b"".join(plains)).digest()[:8], "little")


def turn_record(**changes: object) -> list[object]:
    """A turn record; without `keys`, those its content gives when its tail is an array of
    fewer than 16 messages that holds no blob reference or echo, and it has no base."""
    fields = dict.fromkeys(storage.TurnRecord._fields)
    fields.update(
        node_id="n", link=0, flags=0, meta=[None] * 5, tail=b"\x90", n_rest=0,
        keys=[None] * 4, refs=[0, 0], moves=[],
    )  # fmt: skip
    fields.update(changes)
    tail = fields["tail"]
    if "keys" not in changes and tail and fields["base"] is None:
        assert isinstance(tail, bytes)
        waits = fields["parent"] is None and fields["prompt"] is None and fields["n_rest"] == 1
        fields["keys"] = [request_key(tail[1:]), None, None, [request_key()] if waits else None]
    return list(fields.values())


def _nested(depth: int) -> bytes:
    return b"\x91" * (depth - 1) + b"\x90"


def _usable_graph(graph: RolloutGraph) -> None:
    for node_id in graph.node_ids():
        graph.get(node_id)
    json.dumps(export_session(graph, include_messages=True, include_discarded=True))


def _usable(path: Path, out: Path) -> None:
    graph = RolloutGraph.load(path)
    for node_id in graph.node_ids():
        graph.get(node_id)
        graph.sequence_for(node_id)
    json.dumps(export_session(graph, include_messages=True, include_discarded=True))
    with open(out, "w") as fp:
        write_session_json(graph, fp, include_messages=True)
    assert cli_main(["export", str(path), "--messages", "-o", str(out)]) == 0


CRAFTED = {
    "990 deep": turn_record(tail=b"\x91" + _nested(990), n_rest=1),
    "deep response": turn_record(response=_nested(MAX_DEPTH + 1)),
    "packed flag, array logprobs": turn_record(
        flags=8, sampled=["I", b"\1\0\0\0"], logprobs=["d", b"\0" * 8]
    ),
    "array flag, packed logprobs": turn_record(
        sampled=["I", b"\1\0\0\0"], logprobs=["j", b"\x91\x01"]
    ),
    "carried flags that do not cover the references": [
        (1, bytes(16) + b"x" * 10),
        turn_record(flags=2, tail=b"\x91\xd6\x04\x00\x00\x00\x00", n_rest=1),
    ],
    "bytes in a message": turn_record(tail=b"\x91\xc4\x01x", n_rest=1),
    "list as a key": turn_record(tail=b"\x91\x81\x90\x01", n_rest=1),
    "tuple marker second": turn_record(tail=b"\x91\x92\x01\xc7\x00\x01", n_rest=1),
    "unknown flags": turn_record(flags=1 << 12),
    "no messages but a tail": turn_record(flags=16, tail=b"\x91\x01", n_rest=1),
    "carried flags that do not cover the tuple": turn_record(
        flags=1, tail=b"\x91\x92\xc7\x00\x01\x01", n_rest=1
    ),
    "echo of a base without response": [
        (3, turn_record(node_id="a")),
        (3, turn_record(node_id="b", base=0, flags=32, tail=b"\x91\xc7\x00\x05", n_rest=1)),
    ],
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_what_verify_accepts_loads_queries_and_exports(tmp_path: Path, name: str) -> None:
    """Issue 10, break 6: files that passed verify crashed in export or get()."""
    case = CRAFTED[name]
    records = case if isinstance(case[0], tuple) else [case]
    records = [r if isinstance(r, tuple) else (3, r) for r in records]  # type: ignore[misc]
    if records[0][0] == 1:  # a blob: its digest must be right for the case to be about the turn
        from rollout_store.engine.blobs import content_digest

        text = records[0][1][16:]  # type: ignore[index]
        records[0] = (1, content_digest(text) + text)  # type: ignore[operator]
    path = crafted_v2(tmp_path, records)  # type: ignore[arg-type]
    report = storage.verify(path)
    # each case is a file version 1 let through: verify now refuses it, at its record
    assert not report.ok and "invalid turn record" in (report.error or ""), report.error
    assert report.error_offset is not None and report.error_offset > len(MAGIC_V2)
    with pytest.raises(CorruptFileError):
        RolloutGraph.load(path)
    # and what a record-by-record recovery keeps is usable
    try:
        recovered = RolloutGraph.load(path, recover=True)
    except CorruptFileError:
        return
    assert recovered.load_report is not None
    _usable_graph(recovered)


def test_the_deepest_value_intake_takes_verifies_and_exports(tmp_path: Path) -> None:
    value: object = "leaf"
    for _ in range(MAX_DEPTH - 2):
        value = [value]
    graph = RolloutGraph()
    graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": value}]))
    path = tmp_path / "deep.rls"
    graph.save(path)
    assert storage.verify(path).ok
    _usable(path, tmp_path / "out.json")


@pytest.mark.parametrize("role", ["system", "user"])
@pytest.mark.parametrize("how", ["log", "save"])
def test_the_deepest_message_intake_takes_loads(tmp_path: Path, role: str, how: str) -> None:
    """Intake bounds each message by MAX_DEPTH; the array of messages a file stores adds a
    level, which the reader refused: a turn was recorded whose file did not load."""
    value: object = "leaf"
    for _ in range(MAX_DEPTH - 1):
        value = [value]
    messages = [{"role": role, "content": value}, {"role": "user", "content": "then"}]
    path = tmp_path / "deep.rls"
    graph = RolloutGraph.open(path) if how == "log" else RolloutGraph()
    graph.add_turn(TurnNode(request_messages=messages))
    with pytest.raises(RolloutStoreError):  # one level deeper is refused at intake
        graph.add_turn(TurnNode(request_messages=[{"role": role, "content": [value]}]))
    if how == "save":
        graph.save(path)
    graph.close()
    report = storage.verify(path)
    assert report.ok, report.error
    assert RolloutGraph.load(path).get("turn-0").request_messages == messages
    _usable(path, tmp_path / "out.json")


def test_crafted_deep_nesting_fails_verify_with_its_offset(tmp_path: Path) -> None:
    path = crafted_v2(tmp_path, [(3, CRAFTED["990 deep"])])
    report = storage.verify(path)
    assert not report.ok and "nesting deeper" in (report.error or "")
    assert report.error_offset == frame_offsets(path.read_bytes())[1]


def test_framing_is_exported() -> None:
    assert framing.SYNC == SYNC


def test_a_crafted_record_of_many_containers_is_refused_before_decoding(tmp_path: Path) -> None:
    """A turn record is walked and bounded before msgpack builds it (200 Ki empty lists would
    take about 64 bytes each decoded)."""
    record = turn_record(moves=[[]] * (200 << 10))
    path = crafted_v2(tmp_path, [(3, record)])
    size = path.stat().st_size
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        report = storage.verify(path)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert not report.ok and "more containers" in (report.error or "")
    assert peak <= 4 * size


def test_cli_verify_names_a_torn_tail_or_the_next_intact_frame(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "log.rls"
    small_graph(path).close()
    data = path.read_bytes()
    starts = frame_offsets(data)
    path.write_bytes(data[:-3])
    assert cli_main(["verify", str(path)]) == 1
    assert "torn tail" in capsys.readouterr().err
    changed = bytearray(data)
    changed[starts[2] + HEADER.size] ^= 0xFF  # a middle frame's payload
    path.write_bytes(bytes(changed))
    assert cli_main(["verify", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"next intact frame starts at offset {starts[3]}" in err
    report = storage.verify(path)
    assert report.resync_offset == starts[3] and not report.truncated


def test_save_survives_short_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """writev may write less than asked: the rest follows, in order."""
    graph = RolloutGraph()
    build_rollout(graph, turns=2)
    real = os.writev

    def short_writev(fd: int, parts: list[bytes]) -> int:
        return real(fd, [b"".join(parts)[:7]])

    monkeypatch.setattr(os, "writev", short_writev)
    graph.save(tmp_path / "s.rls")
    monkeypatch.undo()
    assert snapshot(RolloutGraph.load(tmp_path / "s.rls")) == snapshot(graph)


@pytest.mark.parametrize(
    "text", ["a" * 5000, "é" * 3000, "€ and 😀" * 500, "\ud800 lone", ""], ids=repr
)
def test_a_blob_frame_of_a_str_is_the_frame_of_its_utf8(text: str) -> None:
    """The encoders take a blob's str as it is: the frame is byte for byte the one of its
    UTF-8 (`surrogatepass`), and an ASCII text is its part without a copy."""
    data = text.encode("utf-8", "surrogatepass")
    digest = b"\x01" * framing.DIGEST_SIZE
    parts, chain = framing.encode_blob_frame(frames.KIND_BLOB, digest, text, 7)
    assert (b"".join(parts), chain) == (
        b"".join(framing.encode_blob_frame(frames.KIND_BLOB, digest, data, 7)[0]),
        framing.encode_blob_frame(frames.KIND_BLOB, digest, data, 7)[1],
    )
    assert b"".join(frames.blob_frame(digest, text)) == b"".join(frames.blob_frame(digest, data))
    assert len(parts[-1]) == len(data) and bytes(parts[-1]) == data


def test_an_ascii_blob_is_framed_and_written_without_a_copy(tmp_path: Path) -> None:
    text = "x" * (4 << 20)
    digest = b"\x02" * framing.DIGEST_SIZE
    tracemalloc.start()
    try:
        parts, _ = framing.encode_blob_frame(frames.KIND_BLOB, digest, text, 0)
        v1_parts = frames.blob_frame(digest, text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10, f"framing a 4 MiB ASCII text allocated {peak} bytes"
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        os.writev(fd, parts)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"".join(parts)
    assert (tmp_path / "f").read_bytes().endswith(text.encode())
    assert bytes(v1_parts[-1]) == text.encode()


# ---------------------------------------------------------------- derived flags (issue 7)

_CONTENT_FLAGS = 1 | 2 | 64 | 128  # TAIL_REFS, RESPONSE_REFS, TAIL_SPECIAL, RESPONSE_SPECIAL


def _turn_flags_on_disk(data: bytes) -> list[int]:
    reader = framing.FrameReader(data, len(MAGIC_V2), digest_kinds=frozenset({1}), max_kind=5)
    records = [msgpack.unpackb(f.payload, raw=False) for f in reader if f.kind == 3]
    return [record[storage.TurnRecord._fields.index("flags")] for record in records]


def _recorded(
    path: Path, how: str, threshold: int, record: Callable[[RolloutGraph], object]
) -> RolloutGraph:
    """A graph that `record` filled, written to `path` as an append log (`how == "log"`, the
    log closed) or as a saved snapshot."""
    if how == "log":
        with RolloutGraph.open(path, share_threshold=threshold, fsync="never") as graph:
            record(graph)
        return graph
    graph = RolloutGraph(share_threshold=threshold)
    record(graph)
    graph.save(path)
    return graph


@pytest.mark.parametrize("threshold", [8, 1024])
@pytest.mark.parametrize("how", ["save", "log"])
def test_content_flags_are_derived_not_written(tmp_path: Path, threshold: int, how: str) -> None:
    """Issue 7: no derivable bit on disk. What the tail and response hold (blob references,
    tuples, big ints, surrogates) is read from them on load, exactly as intake set it."""
    path = tmp_path / "f.rls"
    graph = _recorded(path, how, threshold, lambda g: build_rollout(g, turns=4))
    # the request digest and key are kept once computed (a loaded turn learns them later)
    unknown = ~(TurnFlag.HAS_DIGEST | TurnFlag.HAS_KEY)
    live = [entry.turn.flags & unknown for entry in graph.journal_entries()]
    assert any(f & _CONTENT_FLAGS for f in live)  # the rollout holds what the flags say
    on_disk = _turn_flags_on_disk(path.read_bytes())
    assert len(on_disk) == len(live) and not any(f & _CONTENT_FLAGS for f in on_disk)
    loaded = RolloutGraph.load(path)
    assert [entry.turn.flags & unknown for entry in loaded.journal_entries()] == live
    assert json.dumps(export_session(loaded, include_messages=True)) == json.dumps(
        export_session(graph, include_messages=True)
    )


def test_records_that_carry_content_flags_still_load(tmp_path: Path) -> None:
    """A record written before the flags were derived carries them: checked, then derived."""
    from rollout_store.engine.blobs import content_digest

    text = b"x" * 10
    tail = b"\x91\x92\xc7\x00\x01\xd6\x04\x00\x00\x00\x00"  # a tuple of a blob reference
    keys = [request_key(b"\x92\xc7\x00\x01\xaa" + text), None, None, [request_key()]]
    for flags in (0, 1 | 64):
        blob = (1, content_digest(text) + text)
        record = turn_record(flags=flags, tail=tail, n_rest=1, keys=keys)
        path = crafted_v2(tmp_path, [blob, (3, record)])
        assert storage.verify(path).ok
        graph = RolloutGraph.load(path)
        assert graph.journal_entries()[0].turn.flags & _CONTENT_FLAGS == 1 | 64
        _usable_graph(graph)


# ------------------------------------------- flags the fields give (issue 7), files of main

_FIELD_FLAGS = 8 | 16 | 32  # LOGPROBS_PACKED, NO_MESSAGES, TAIL_ECHO


def _field_flag_rollout(graph: RolloutGraph) -> None:
    """A rollout whose turns have each of the field flags: an echo of the base's response,
    requests without messages, packed logprobs."""
    build_rollout(graph, turns=2)
    messages = [{"role": "user", "content": "hello " * 50}]
    response = {"role": "assistant", "content": "hi there " * 40}
    graph.add_turn(TurnNode(request_messages=messages, response_message=response))
    echoed = [*messages, response, {"role": "user", "content": "more"}]
    graph.add_turn(TurnNode(request_messages=echoed, response_message={"role": "assistant"}))
    ids = {"prompt_ids": [1, 2, 3], "sampled_ids": [4, 5], "sampled_logprobs": [1, -0.5]}
    graph.add_turn(TurnNode(request_messages=None, **ids))  # type: ignore[arg-type]
    graph.add_turn(TurnNode(request_messages=None, response_message={"role": "assistant"}))


def _header_of(data: bytes) -> dict[str, object]:
    reader = framing.FrameReader(data, len(MAGIC_V2), digest_kinds=frozenset({1}), max_kind=5)
    header = msgpack.unpackb(next(iter(reader)).payload, raw=False)
    assert isinstance(header, dict)
    return header


@pytest.mark.parametrize("how", ["save", "log"])
def test_field_flags_are_derived_not_written(tmp_path: Path, how: str) -> None:
    """Issue 7: packed logprobs, a request without messages and an echo in the tail are
    given by the record's fields: not written, derived on load exactly as intake set them."""
    path = tmp_path / "f.rls"
    graph = _recorded(path, how, 64, _field_flag_rollout)
    unknown = ~(TurnFlag.HAS_DIGEST | TurnFlag.HAS_KEY)
    live = [entry.turn.flags & unknown for entry in graph.journal_entries()]
    for bit in (8, 16, 32):  # the rollout holds each of them
        assert any(f & bit for f in live), bit
    data = path.read_bytes()
    assert _header_of(data)["derived_flags"] is True
    on_disk = _turn_flags_on_disk(data)
    assert len(on_disk) == len(live) and not any(f & _FIELD_FLAGS for f in on_disk)
    loaded = RolloutGraph.load(path)
    assert [entry.turn.flags & unknown for entry in loaded.journal_entries()] == live
    assert snapshot(loaded) == snapshot(graph)


@pytest.mark.parametrize("name", ["v2_snapshot.rls", "v2_log.rls"])
def test_version_2_files_of_an_earlier_main_load(tmp_path: Path, name: str) -> None:
    """Files written before the field flags were derived: their records carry them."""
    data = (DATA / name).read_bytes()
    assert "derived_flags" not in _header_of(data)
    assert any(f & _FIELD_FLAGS for f in _turn_flags_on_disk(data))
    assert storage.verify(DATA / name).ok
    loaded = RolloutGraph.load(DATA / name)
    expected = (DATA / f"{name}.expected").read_text()
    assert snapshot(loaded) == expected
    rewritten = tmp_path / "new.rls"
    loaded.save(rewritten)
    assert not any(f & _FIELD_FLAGS for f in _turn_flags_on_disk(rewritten.read_bytes()))
    assert snapshot(RolloutGraph.load(rewritten)) == expected


def test_an_earlier_log_keeps_carrying_the_field_flags(tmp_path: Path) -> None:
    """Appending to a log whose records carry the flags goes on writing them (every record
    of a file agrees with its header), and the whole log loads."""
    path = tmp_path / "log.rls"
    path.write_bytes((DATA / "v2_log.rls").read_bytes())
    with RolloutGraph.open(path, share_threshold=64, fsync="never") as graph:
        n = len(graph)
        _field_flag_rollout(graph)
        live = [entry.turn.flags & _FIELD_FLAGS for entry in graph.journal_entries()]
    data = path.read_bytes()
    assert "derived_flags" not in _header_of(data)
    assert [f & _FIELD_FLAGS for f in _turn_flags_on_disk(data)[n:]] == live[n:]
    assert any(live[n:])
    loaded = RolloutGraph.load(path)
    assert [entry.turn.flags & _FIELD_FLAGS for entry in loaded.journal_entries()] == live
    assert snapshot(loaded) == snapshot(graph)


_BLOB_TEXT = b"x" * 10
_ECHO_TAIL = b"\x92\xc7\x00\x05\x01"  # [echo of the base's response, 1]
FIELD_FLAG_CASES = {
    # name: (records, the flags the loaded last turn has)
    "packed logprobs": ([turn_record(logprobs=["j", b"\x91\x01"])], 8),
    "no messages": ([turn_record(tail=b"")], 16),
    "echo": (
        [
            turn_record(node_id="a", response=b"\x81\xa1r\x01"),
            turn_record(
                node_id="b",
                base=0,
                tail=_ECHO_TAIL,
                n_rest=2,
                keys=[
                    request_key(b"\x81\xa1r\x01", b"\x01"),
                    None,
                    None,
                    [request_key(), request_key(b"\x81\xa1r\x01")],
                ],
            ),
        ],
        32,
    ),
}


@pytest.mark.parametrize("name", list(FIELD_FLAG_CASES))
def test_field_flags_carried_by_an_earlier_record_must_agree(tmp_path: Path, name: str) -> None:
    records, bits = FIELD_FLAG_CASES[name]
    *before, last = records
    flags_at = storage.TurnRecord._fields.index("flags")

    def with_flags(flags: int) -> list[tuple[int, object]]:
        changed = list(last)
        changed[flags_at] = flags
        return [(3, r) for r in [*before, changed]]

    # a file whose header says the flags are derived: records without them load
    path = crafted_v2(tmp_path, with_flags(0), derived_flags=True)
    assert storage.verify(path).ok, storage.verify(path).error
    graph = RolloutGraph.load(path)
    assert graph.journal_entries()[-1].turn.flags & _FIELD_FLAGS == bits
    _usable_graph(graph)
    # ... and records that carry them are refused: nothing writes them there
    report = storage.verify(crafted_v2(tmp_path, with_flags(bits), derived_flags=True))
    assert not report.ok and "carries flags" in (report.error or ""), report.error
    # an earlier file: records carry them, agreeing with the fields
    path = crafted_v2(tmp_path, with_flags(bits))
    assert storage.verify(path).ok, storage.verify(path).error
    graph = RolloutGraph.load(path)
    assert graph.journal_entries()[-1].turn.flags & _FIELD_FLAGS == bits
    _usable_graph(graph)
    # ... or they are refused at their record's offset, whether missing or extra
    for flags in (0, bits | (_FIELD_FLAGS & ~bits & (8 | 16))):
        path = crafted_v2(tmp_path, with_flags(flags))
        report = storage.verify(path)
        assert not report.ok and "invalid turn record" in (report.error or ""), flags
        assert report.error_offset == frame_offsets(path.read_bytes())[-1]
        with pytest.raises(CorruptFileError):
            RolloutGraph.load(path)


@pytest.mark.parametrize("value", [False, 1, "yes", None])
def test_a_bad_derived_flags_header_is_refused(tmp_path: Path, value: object) -> None:
    path = crafted_v2(tmp_path, [(3, turn_record())], derived_flags=value)
    if value is False:  # the default, written out
        assert storage.verify(path).ok
        return
    report = storage.verify(path)
    assert not report.ok and "derived_flags" in (report.error or ""), report.error


# ---------------------------------------------------------------- packed fields, re-chained


def records_of(data: bytes) -> list[tuple[int, bytes]]:
    reader = framing.FrameReader(data, len(MAGIC_V2), digest_kinds=frozenset({1}), max_kind=5)
    return [(f.kind, bytes(f.payload)) for f in reader]


def rechained(records: list[tuple[int, bytes]]) -> bytes:
    """A version-2 file of these records (the header's first), each frame chained right."""
    out, chain = [MAGIC_V2], 0
    for kind, payload in records:
        if kind == 1:
            parts, chain = framing.encode_blob_frame(kind, payload[:16], payload[16:], chain)
            out.extend(parts)
        else:
            frame, chain = encode_frame(kind, payload, chain)
            out.append(frame)
    return b"".join(out)


_TAIL = storage.TurnRecord._fields.index("tail")
_RESPONSE = storage.TurnRecord._fields.index("response")


@pytest.fixture(scope="module")
def rollout_records(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, bytes]]:
    path = tmp_path_factory.mktemp("records") / "log.rls"
    with RolloutGraph.open(path, share_threshold=8, fsync="never") as graph:
        build_rollout(graph, turns=3)
    return records_of(path.read_bytes())


@given(st.data())
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_a_damaged_packed_field_fails_verify_or_loads_usable(
    rollout_records: list[tuple[int, bytes]], tmp_path: Path, data: st.DataObject
) -> None:
    """Verify means usable, past every frame check: a turn's tail or response changed and the
    file chained again (what a crafted file can do) either fails verify at its record, or
    loads, answers every query and exports."""
    turns = [i for i, (kind, _) in enumerate(rollout_records) if kind == 3]
    at = data.draw(st.sampled_from(turns))
    record = msgpack.unpackb(rollout_records[at][1], raw=False, unicode_errors="surrogatepass")
    field = data.draw(st.sampled_from([_TAIL, _RESPONSE]))
    packed = record[field]
    if not packed:
        return
    packed = bytearray(packed)
    where = data.draw(st.integers(0, len(packed) - 1))
    packed[where] = data.draw(st.integers(0, 255))
    record[field] = bytes(packed)
    records = list(rollout_records)
    records[at] = (3, msgpack.packb(record, use_bin_type=True, unicode_errors="surrogatepass"))
    path = tmp_path / "damaged.rls"
    path.write_bytes(rechained(records))
    report = storage.verify(path)
    if not report.ok:
        assert report.error_offset is not None and report.error_offset > len(MAGIC_V2)
        return
    graph = RolloutGraph.load(path)
    for node_id in graph.node_ids():
        graph.get(node_id)
        graph.sequence_for(node_id)
    json.dumps(export_session(graph, include_messages=True, include_discarded=True))


def test_a_recovered_graph_keeps_no_blob_or_value_of_the_turn_that_failed(
    rollout_records: list[tuple[int, bytes]], tmp_path: Path
) -> None:
    """A turn record that fails after its blob and value records were read left those in the
    recovered graph: saved again, the graph gave a file whose end record did not match."""
    kinds = [kind for kind, _ in rollout_records]
    # a turn record right after blob and value records of its own
    at = next(i for i in range(2, len(kinds)) if kinds[i] == 3 and kinds[i - 1] == 2 and i > 12)
    record = msgpack.unpackb(rollout_records[at][1], raw=False, unicode_errors="surrogatepass")
    record[_TAIL] = b"\xc1"  # not msgpack
    records = list(rollout_records)
    records[at] = (3, msgpack.packb(record, use_bin_type=True, unicode_errors="surrogatepass"))
    path = tmp_path / "damaged.rls"
    path.write_bytes(rechained(records))
    kept = RolloutGraph.load(path, recover=True)
    intact = tmp_path / "intact.rls"
    end = next(i for i in range(at, 0, -1) if kinds[i - 1] == 3)  # after the turn before
    intact.write_bytes(rechained(records[:end]))
    reference = RolloutGraph.load(intact)
    assert len(kept) == len(reference) and len(kept.blobs) == len(reference.blobs)
    assert kept.stats() == reference.stats()
    kept.save(tmp_path / "again.rls")
    assert snapshot(RolloutGraph.load(tmp_path / "again.rls")) == snapshot(reference)


@pytest.mark.parametrize("how", ["save", "log"])
def test_a_blob_with_lone_surrogates_is_special_after_load(tmp_path: Path, how: str) -> None:
    """The only special content is a long string with a lone surrogate, kept as a blob: the
    loader learns it from the blob table (a caller's ExtType imitating it must still be
    walked), so the loaded flags equal intake's."""
    path = tmp_path / "s.rls"
    messages = [{"role": "user", "content": "look \ud800 " * 20}]
    response = {"role": "assistant", "content": "seen \udfff " * 20}

    def record(graph: RolloutGraph) -> None:
        graph.add_turn(TurnNode(request_messages=messages, response_message=response))
        graph.add_turn(
            TurnNode(request_messages=[*messages, response, {"role": "user", "content": "go"}])
        )

    graph = _recorded(path, how, 8, record)
    special = TurnFlag.TAIL_SPECIAL | TurnFlag.RESPONSE_SPECIAL | TurnFlag.PREFIX_SPECIAL
    live = [entry.turn.flags & special for entry in graph.journal_entries()]
    assert live[0] & TurnFlag.TAIL_SPECIAL and live[0] & TurnFlag.RESPONSE_SPECIAL
    loaded = RolloutGraph.load(path)
    assert [entry.turn.flags & special for entry in loaded.journal_entries()] == live


# ---------------------------------------------------------------- the turn record's two decoders


def _decoded(payload: bytes) -> tuple[str, object]:
    """("typed", record) from msgspec, ("untyped", record) from the fallback, or the error."""
    try:
        return "typed", storage._RECORD_DECODER.decode(payload)
    except msgspec.DecodeError:
        pass
    try:
        return "untyped", storage._untyped_record(frames.unpack_payload(payload))
    except ValueError as exc:
        return "refused", str(exc)


_ODD_FIELDS = [None, True, False, -1, 0, 7, 2**64 - 1, 1.5, "x", b"x", [], [1], [None] * 5]


def test_the_typed_record_decoder_and_its_fallback_agree(tmp_path: Path) -> None:
    """msgspec checks a turn record's field types; msgpack and a field-by-field check take
    what it refuses. Both must accept exactly the same records, as the same values: every
    record of a rollout, and each with one field replaced by an odd value."""
    path = tmp_path / "f.rls"
    graph = RolloutGraph(share_threshold=64)
    _field_flag_rollout(graph)
    graph.save(path)
    records = [p for kind, p in records_of(path.read_bytes()) if kind == 3]
    assert records
    outcomes = {"typed": 0, "refused": 0}
    for payload in records:
        body = msgpack.unpackb(payload, raw=False)
        assert storage._untyped_record(list(body)) == storage._RECORD_DECODER.decode(payload)
        for at, odd in itertools.product(range(len(body) + 1), _ODD_FIELDS):
            changed = [*body, odd] if at == len(body) else [*body[:at], odd, *body[at + 1 :]]
            data = msgpack.packb(changed, use_bin_type=True)
            how, typed = _decoded(data)
            assert how != "untyped", (at, odd)  # no lone surrogates here: msgspec decides
            try:
                fallback: object = storage._untyped_record(frames.unpack_payload(data))
            except ValueError:
                fallback = None
            assert (how == "typed") == (fallback is not None), (at, odd, typed)
            if how == "typed":
                assert fallback == typed, (at, odd)
            outcomes[how] += 1
    assert outcomes["typed"] and outcomes["refused"]  # both kinds were tried


def test_a_record_with_lone_surrogates_takes_the_fallback(tmp_path: Path) -> None:
    path = tmp_path / "s.rls"
    graph = RolloutGraph()
    graph.add_turn(TurnNode(node_id="a\ud800", model="m\udc00", request_messages=[]))
    graph.save(path)
    (payload,) = [p for kind, p in records_of(path.read_bytes()) if kind == 3]
    how, record = _decoded(payload)
    assert how == "untyped" and isinstance(record, storage.TurnRecord)
    assert record.node_id == "a\ud800" and record.meta[0] == "m\udc00"
    assert RolloutGraph.load(path).node_ids() == ["a\ud800"]


@pytest.mark.parametrize(
    "ids",
    [["a", "a"], ["turn-0", "turn-0"], ["turn-1", "turn-1"], ["x", "turn-1", "x"]],
)
def test_a_repeated_node_id_is_refused_at_its_record(tmp_path: Path, ids: list[str]) -> None:
    """An id a turn read before has (named, or the default of its index) is refused at the
    record repeating it; the turns before it load."""
    path = crafted_v2(tmp_path, [(3, turn_record(node_id=node_id)) for node_id in ids])
    report = storage.verify(path)
    assert not report.ok and "repeated node id" in (report.error or ""), report.error
    assert report.error_offset == frame_offsets(path.read_bytes())[len(ids)]
    recovered = RolloutGraph.load(path, recover=True)
    assert recovered.node_ids() == ids[:-1]
    ok = crafted_v2(tmp_path, [(3, turn_record(node_id=n)) for n in ["turn-1", "turn-0"]])
    assert RolloutGraph.load(ok).node_ids() == ["turn-1", "turn-0"]


_REFS = storage.TurnRecord._fields.index("refs")


def _comparable(records: list[tuple[int, bytes]]) -> list[tuple[int, object]]:
    """A file's records but its header and end record, each turn record's reference counts
    blanked (a log counts them per turn, a snapshot in its end record)."""
    out: list[tuple[int, object]] = []
    for kind, payload in records[1:]:
        if kind == frames.KIND_TURN:
            body = frames.unpack_payload(payload)
            body[_REFS] = None
            out.append((kind, body))
        elif kind != frames.KIND_END:
            out.append((kind, payload))
    return out


@pytest.mark.parametrize("threshold", [8, 1024])
def test_a_snapshot_holds_the_records_that_appending_its_turns_writes(
    tmp_path: Path, threshold: int
) -> None:
    """save() makes a snapshot's frames in a loop of its own; its records are those that
    appending the same turns one by one writes: the same blobs and values in the same order,
    prompts referred back to the same turns, the same turn records."""
    log, snap = tmp_path / "log.rls", tmp_path / "snap.rls"
    with RolloutGraph.open(log, share_threshold=threshold, fsync="never") as graph:
        build_rollout(graph, turns=4)
        small = small_graph()
        for node_id in small.node_ids():
            node = small.get(node_id)
            graph.add_turn(
                TurnNode(
                    node_id=f"small-{node_id}",
                    request_messages=node.request_messages,
                    sampling_params=node.sampling_params,
                )
            )
        graph.save(snap)
    logged, saved = records_of(log.read_bytes()), records_of(snap.read_bytes())
    assert sum(kind == frames.KIND_TURN for kind, _ in saved) == len(graph)
    assert _comparable(saved) == _comparable(logged)

"""Recovery past damage (issue 24, item 3): `load(recover=True)`, `rollout-store recover` and
`repair --rewrite` keep every turn whose frame and whose referents are intact, and a log
damaged before intact records is never opened for appending without saying so."""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest

from rollout_store import (
    CorruptFileError,
    DirectoryStore,
    RolloutGraph,
    StoreObjectError,
    Timeline,
    TurnNode,
    content_key,
)
from rollout_store.cli import main as cli_main
from rollout_store.files import framing, storage
from rollout_store.files.framing import HEADER, MAGIC_V2


def frames_of(data: bytes) -> list[tuple[int, int, int]]:
    """(kind, start, end) of each frame of an intact version-2 file."""
    out, offset = [], len(MAGIC_V2)
    while offset < len(data):
        _, kind, length, _, _ = HEADER.unpack_from(data, offset)
        out.append((kind & 0x7F, offset, offset + HEADER.size + length))
        offset += HEADER.size + length
    return out


def turn_frames(data: bytes) -> list[tuple[int, int]]:
    return [(start, end) for kind, start, end in frames_of(data) if kind == 3]


def fields(graph: RolloutGraph, node_id: str) -> str:
    node = graph.get(node_id)
    return json.dumps(
        [
            node.request_messages,
            node.response_message,
            node.request_tools,
            node.sampling_params,
            node.prompt_ids,
            node.sampled_ids,
            node.sampled_logprobs,
            node.parent_id,
        ]
    )


def write(path: Path, mode: str, build: object, share_threshold: int | None = 1024) -> None:
    if mode == "log":
        with RolloutGraph.open(path, share_threshold=share_threshold, fsync="never") as graph:
            build(graph)  # type: ignore[operator]
    else:
        graph = RolloutGraph(share_threshold=share_threshold)
        build(graph)  # type: ignore[operator]
        graph.save(path)


def independent(graph: RolloutGraph) -> None:
    for i in range(8):
        graph.add_turn(
            TurnNode(
                f"n{i}",
                request_messages=[{"role": "user", "content": f"question {i}"}],
                response_message={"role": "assistant", "content": f"answer {i}", "odd": -0.0},
            )
        )


def flipped(data: bytes, at: int, mask: int = 0x40) -> bytes:
    changed = bytearray(data)
    changed[at] ^= mask
    return bytes(changed)


@pytest.mark.parametrize("mode", ["log", "snapshot"])
def test_one_flipped_byte_in_the_first_of_8_independent_turns_keeps_the_other_7(
    tmp_path: Path, mode: str
) -> None:
    path, damaged = tmp_path / "whole.rls", tmp_path / "damaged.rls"
    write(path, mode, independent)
    whole = RolloutGraph.load(path)
    data = path.read_bytes()
    start, end = turn_frames(data)[0]
    for at in range(start + HEADER.size, end):  # every byte of its payload
        damaged.write_bytes(flipped(data, at, 1 << (at % 8)))
        with pytest.raises(CorruptFileError):
            RolloutGraph.load(damaged)
        kept = RolloutGraph.load(damaged, recover=True)
        report = kept.load_report
        assert report is not None and not report.ok
        assert kept.node_ids() == [f"n{i}" for i in range(1, 8)], at
        assert report.damaged == [(start, end)] and report.lost_turns == 1
        assert report.dropped == [] and not report.lost_unknown
        assert report.turns_before_damage == 0 and report.error_offset == start
        for node_id in kept.node_ids():
            assert fields(kept, node_id) == fields(whole, node_id)
    # saved again, what was kept is a whole file
    again = tmp_path / "again.rls"
    kept.save(again)
    assert storage.verify(again).ok and len(RolloutGraph.load(again)) == 7


def test_recover_writes_the_turns_after_the_damage_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, out = tmp_path / "log.rls", tmp_path / "out.rls"
    write(path, "log", independent)
    data = path.read_bytes()
    end = turn_frames(data)[2][1]
    path.write_bytes(flipped(data, end - 3))
    assert cli_main(["recover", str(path), "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert said.startswith("recovered 7 turns, 2 from before the damage at offset")
    assert "and 5 after it" in said and "(1 turn record lost)" in said
    assert RolloutGraph.load(out).node_ids() == ["n0", "n1", "n3", "n4", "n5", "n6", "n7"]
    assert cli_main(["verify", str(path)]) == 1
    err = capsys.readouterr().err
    assert "saves the 2 complete turns before it to a new file, with every intact turn" in err
    assert f"rollout-store repair --rewrite {path}" in err


@pytest.mark.parametrize("mode", ["log", "snapshot"])
def test_a_frame_whose_header_alone_was_hit_loses_nothing(tmp_path: Path, mode: str) -> None:
    """Marker, kind, length and chain fields are given by the frame's neighbours: the frame
    is rebuilt and verified by its chain value, every turn kept."""
    path, damaged = tmp_path / "whole.rls", tmp_path / "damaged.rls"
    write(path, mode, independent)
    whole = RolloutGraph.load(path)
    data = path.read_bytes()
    start, end = turn_frames(data)[3]
    for at in range(start, start + HEADER.size):
        damaged.write_bytes(flipped(data, at))
        kept = RolloutGraph.load(damaged, recover=True)
        report = kept.load_report
        assert report is not None and not report.ok and report.error_offset == start
        assert kept.node_ids() == whole.node_ids(), at
        assert report.damaged == [(start, end)] and report.lost_turns == 0
        assert all(fields(kept, n) == fields(whole, n) for n in kept.node_ids())


def linked(graph: RolloutGraph) -> None:
    """A conversation c1 < c2 < c3 (each extends the one before), token turns t1 < t2 (t2
    extends t1's tokens), and independent turns after them."""
    system = {"role": "system", "content": "rules"}
    messages = [system, {"role": "user", "content": "q1"}]
    for k in (1, 2, 3):
        answer = {"role": "assistant", "content": f"a{k}"}
        graph.add_turn(TurnNode(f"c{k}", request_messages=list(messages), response_message=answer))
        messages += [answer, {"role": "user", "content": f"q{k + 1}"}]
    user = [{"role": "user", "content": "tokens"}]
    graph.add_turn(TurnNode("t1", [1, 2, 3], [4, 5], [-0.5, -0.25], request_messages=user))
    graph.add_turn(TurnNode("t2", [1, 2, 3, 4, 5, 6], [7], [-1.0], request_messages=user))
    for k in (1, 2):
        graph.add_turn(TurnNode(f"i{k}", request_messages=[{"role": "user", "content": f"i{k}"}]))


@pytest.mark.parametrize("mode", ["log", "snapshot"])
def test_a_turn_whose_base_or_tokens_were_lost_is_dropped_and_reported(
    tmp_path: Path, mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path, damaged = tmp_path / "whole.rls", tmp_path / "damaged.rls"
    write(path, mode, linked)
    whole = RolloutGraph.load(path)
    assert whole.parent("c2") == "c1" and whole.parent("t2") == "t1"
    data = path.read_bytes()
    turns = dict(zip(whole.node_ids(), turn_frames(data), strict=True))
    cases = {"c1": (["c2", "c3"], ["t1", "t2", "i1", "i2"]), "t1": (["t2"], ["i1", "i2"])}
    for victim, (dropped, kept_after) in cases.items():
        start, end = turns[victim]
        damaged.write_bytes(flipped(data, (start + end) // 2 + HEADER.size // 2))
        kept = RolloutGraph.load(damaged, recover=True)
        report = kept.load_report
        assert report is not None and report.lost_turns == 1
        assert [d.node_id for d in report.dropped] == dropped
        assert all("which was lost" in d.cause for d in report.dropped)
        assert set(kept_after) <= set(kept.node_ids())
        assert victim not in kept.node_ids() and not set(dropped) & set(kept.node_ids())
        for node_id in kept.node_ids():
            assert fields(kept, node_id) == fields(whole, node_id)
    out = tmp_path / "out.rls"
    assert cli_main(["recover", str(damaged), "-o", str(out)]) == 0
    assert "dropped 1 intact turn whose parent, base, tokens" in capsys.readouterr().out


def with_blobs(graph: RolloutGraph) -> None:
    """b0 holds long string A, b1 B, b2 B and C, b3 A and D (share_threshold 8)."""
    a, b, c, d = ("A" * 20, "B" * 20, "C \ud800" * 8, "D" * 20)
    for node_id, texts in (("b0", [a]), ("b1", [b]), ("b2", [b, c]), ("b3", [a, d])):
        content = [{"type": "text", "text": t} for t in texts]
        graph.add_turn(
            TurnNode(
                node_id,
                request_messages=[{"role": "user", "content": content}],
                response_message={"role": "assistant", "content": texts[-1]},
            )
        )


@pytest.mark.parametrize("mode", ["log", "snapshot"])
def test_a_lost_blob_drops_only_the_turns_that_refer_to_it(tmp_path: Path, mode: str) -> None:
    """Later records refer to blobs by their place in the file: with blob A lost, the turns
    that use B, C and D read exactly (their references turned into the graph's indexes)."""
    path, damaged = tmp_path / "whole.rls", tmp_path / "damaged.rls"
    write(path, mode, with_blobs, share_threshold=8)
    whole = RolloutGraph.load(path)
    data = path.read_bytes()
    blob_a = next((s, e) for kind, s, e in frames_of(data) if kind == 1)
    damaged.write_bytes(flipped(data, blob_a[1] - 2))
    kept = RolloutGraph.load(damaged, recover=True)
    report = kept.load_report
    assert report is not None and report.damaged == [blob_a] and report.lost_turns == 0
    assert kept.node_ids() == ["b1", "b2"]
    assert [d.node_id for d in report.dropped] == ["b0", "b3"]
    assert all("blob 0" in d.cause for d in report.dropped)
    for node_id in kept.node_ids():
        assert fields(kept, node_id) == fields(whole, node_id)
    again = tmp_path / "again.rls"
    kept.save(again)
    assert storage.verify(again).ok
    reloaded = RolloutGraph.load(again)
    assert [fields(reloaded, n) for n in reloaded.node_ids()] == [
        fields(whole, n) for n in ("b1", "b2")
    ]


def test_damage_of_unknown_extent_keeps_the_turns_that_refer_to_nothing_after_it(
    tmp_path: Path,
) -> None:
    """Garbage over the end of one frame and the start of the next: how many records it
    held cannot be told, so later places are unknown; turns that refer only to records
    before it (here: a shared value) are kept, exactly."""
    path, damaged = tmp_path / "whole.rls", tmp_path / "damaged.rls"
    write(path, "log", independent)
    whole = RolloutGraph.load(path)
    data = bytearray(path.read_bytes())
    (_, end2), (start3, _) = turn_frames(bytes(data))[2:4]
    data[end2 - 10 : start3 + 10] = b"\xaa" * 20
    damaged.write_bytes(bytes(data))
    kept = RolloutGraph.load(damaged, recover=True)
    report = kept.load_report
    assert report is not None and report.lost_unknown
    assert kept.node_ids() == ["n0", "n1", "n4", "n5", "n6", "n7"]
    assert all(fields(kept, n) == fields(whole, n) for n in kept.node_ids())


def test_reopening_a_log_damaged_before_intact_records_refuses_and_says_what_to_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "log.rls"
    write(path, "log", independent)
    data = path.read_bytes()
    start, end = turn_frames(data)[1]
    broken = flipped(data, end - 5)
    path.write_bytes(broken)
    for repair in (False, True):
        with pytest.raises(CorruptFileError) as info:
            RolloutGraph.open(path, repair=repair)
        message = str(info.value)
        assert f"offset {start}" in message and "intact records follow the damage" in message
        assert f"rollout-store repair --rewrite {path}" in message
        assert f"rollout-store recover {path} -o NEW" in message
        assert path.read_bytes() == broken  # nothing cut
    # plain repair still refuses; --rewrite keeps every intact turn, as an appendable log
    assert cli_main(["repair", str(path)]) == 1
    assert "repair does not apply" in capsys.readouterr().err
    assert path.read_bytes() == broken
    assert cli_main(["repair", "--rewrite", str(path)]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"rewrote {path} in place: kept 7 turns, 1 from before the damage")
    assert storage.verify(path).ok
    with RolloutGraph.open(path, fsync="never") as graph:
        assert graph.node_ids() == ["n0", "n2", "n3", "n4", "n5", "n6", "n7"]
        graph.add_turn(TurnNode("more", request_messages=[{"role": "user", "content": "m"}]))
    assert len(RolloutGraph.load(path)) == 8 and storage.verify(path).ok


def test_reopening_a_torn_log_says_how_to_cut_the_tail(tmp_path: Path) -> None:
    path = tmp_path / "log.rls"
    write(path, "log", independent)
    data = path.read_bytes()
    path.write_bytes(data[:-4])
    with pytest.raises(CorruptFileError, match="open it with repair=True"):
        RolloutGraph.open(path)
    assert path.read_bytes() == data[:-4]


def test_repair_rewrite_keeps_a_snapshot_a_snapshot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.rls"
    write(path, "snapshot", linked)
    data = path.read_bytes()
    end = turn_frames(data)[-1][1]  # i2
    path.write_bytes(flipped(data, end - 1))
    assert cli_main(["repair", "--rewrite", str(path)]) == 0
    assert "kept 6 turns" in capsys.readouterr().out
    report = storage.verify(path)
    assert report.ok and report.mode == "snapshot" and report.turns == 6


def test_resync_past_many_damaged_frames_hashes_each_byte_a_bounded_number_of_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every other turn frame damaged: the frames between are kept, and the bytes hashed
    while recovering stay within a constant multiple of the file (trying each kind on a
    damaged frame once, never a candidate at every offset)."""
    path = tmp_path / "log.rls"

    def many(graph: RolloutGraph) -> None:
        for i in range(200):
            text = f"question {i} " + "x" * (i % 50)
            graph.add_turn(TurnNode(f"n{i}", request_messages=[{"role": "user", "content": text}]))

    write(path, "log", many)
    data = bytearray(path.read_bytes())
    for start, end in turn_frames(bytes(data))[::2]:
        data[(start + HEADER.size + end) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    # the engine counts what it hashes: every reader and gap the loader makes reports to one
    counters = framing.ScanCounters()
    reader, gap = framing.FrameReader, framing.read_gap
    monkeypatch.setattr(framing, "FrameReader", partial(reader, counters=counters))
    monkeypatch.setattr(framing, "read_gap", partial(gap, counters=counters))
    kept = RolloutGraph.load(path, recover=True)
    assert kept.node_ids() == [f"n{i}" for i in range(1, 200, 2)]
    assert kept.load_report is not None and kept.load_report.lost_turns == 100
    assert len(data) // 2 <= counters.hashed_bytes <= 16 * len(data)


def test_a_blob_missing_from_the_store_drops_only_the_turns_that_use_it(tmp_path: Path) -> None:
    """A file of store references whose store lost one object: the turns that refer to
    that blob are dropped, every other turn is kept, exactly."""
    graph = RolloutGraph(share_threshold=8, store=DirectoryStore(tmp_path / "first"))
    with_blobs(graph)
    path = tmp_path / "s.rls"
    graph.save(path, blobs="store")
    shutil.copytree(tmp_path / "first", tmp_path / "objects")
    store = DirectoryStore(tmp_path / "objects", fsync=False)
    whole = RolloutGraph.load(path, store=store)
    name = content_key(("A" * 20).encode()).hex()
    (store.path / name[:2] / name[2:]).unlink()
    with pytest.raises(StoreObjectError):
        RolloutGraph.load(path, store=store)
    kept = RolloutGraph.load(path, recover=True, store=store)
    report = kept.load_report
    assert report is not None and isinstance(report.exception, StoreObjectError)
    assert kept.node_ids() == ["b1", "b2"]
    assert [d.node_id for d in report.dropped] == ["b0", "b3"]
    assert all(fields(kept, n) == fields(whole, n) for n in kept.node_ids())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["log", "snapshot"])
def test_every_flipped_byte_of_independent_turns_costs_at_most_one_turn(
    tmp_path: Path, mode: str
) -> None:
    """Wherever one byte flips outside the header and the value every turn shares, at most
    the turn whose frame holds it is lost, and every kept turn is exact."""
    path, damaged = tmp_path / "whole.rls", tmp_path / "damaged.rls"
    write(path, mode, independent)
    whole = RolloutGraph.load(path)
    data = path.read_bytes()
    shared = [(s, e) for kind, s, e in frames_of(data) if kind in (0, 2)]
    for at in range(len(data)):
        if at < len(MAGIC_V2) or any(s <= at < e for s, e in shared):
            continue
        damaged.write_bytes(flipped(data, at, 0xFF if at % 2 else 1 << (at // 2 % 8)))
        kept = RolloutGraph.load(damaged, recover=True)
        assert len(kept) >= 7, at
        assert all(fields(kept, n) == fields(whole, n) for n in kept.node_ids()), at


def _timeline(i: int) -> Timeline:
    return Timeline(1_750_000_000_000_000 + i * 1000, 5, 100 + i, 100 + i, 200 + i, 250 + i)


def test_damage_keeps_the_timelines_metadata_and_turns_after_it(tmp_path: Path) -> None:
    path, damaged = tmp_path / "log.rls", tmp_path / "damaged.rls"
    ids = [f"n{i}" for i in range(20)]  # more than a batch of timelines
    with RolloutGraph.open(path, fsync="never") as graph:
        for i, node_id in enumerate(ids):
            graph.add_turn(
                TurnNode(
                    node_id,
                    request_messages=[{"role": "user", "content": f"question {i}"}],
                    response_message={"role": "assistant", "content": f"answer {i}"},
                )
            )
            graph.set_timeline(node_id, _timeline(i))
        graph.add_labels("math", "hard")
        graph.set_reward(0.5)
        graph.set_reward(1.0, leaf="n2")
        graph.set_reward(-1.0, leaf="n7")
    data = path.read_bytes()
    start, end = turn_frames(data)[2]
    damaged.write_bytes(flipped(data, (start + end) // 2))
    kept = RolloutGraph.load(damaged, recover=True)
    report = kept.load_report
    assert report is not None and report.lost_turns == 1
    left = [node_id for node_id in ids if node_id != "n2"]
    assert kept.node_ids() == left
    assert kept.labels == ["math", "hard"] and kept.reward == 0.5
    assert kept.rewards == {"n7": -1.0}
    assert report.rewards_lost == ["n2"] and report.timelines_lost == 1
    assert kept.timelines() == {node_id: _timeline(int(node_id[1:])) for node_id in left}


def test_repair_rewrite_of_a_log_keeps_its_timelines_and_metadata(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log rewritten in place keeps what `load(recover=True)` keeps beside the turns:
    timelines, labels, rewards, annotations and group (the rewrite wrote the turns alone),
    and stays a log to append to."""
    path = tmp_path / "log.rls"
    ids = [f"n{i}" for i in range(6)]
    with RolloutGraph.open(path, fsync="never") as graph:
        for i, node_id in enumerate(ids):
            graph.add_turn(
                TurnNode(node_id, request_messages=[{"role": "user", "content": f"q {i}"}])
            )
            graph.set_timeline(node_id, _timeline(i))
            graph.set_reward(float(i), leaf=node_id)
        graph.add_labels("math")
        graph.annotate(task="t1")
        graph.set_group("g1")
    data = path.read_bytes()
    start, end = turn_frames(data)[1]
    path.write_bytes(flipped(data, (start + end) // 2))
    kept = RolloutGraph.load(path, recover=True)
    assert kept.node_ids() == [i for i in ids if i != "n1"]
    assert cli_main(["repair", "--rewrite", str(path)]) == 0
    capsys.readouterr()
    rewritten = RolloutGraph.load(path)
    assert storage.verify(path).ok and storage.verify(path).mode == "log"
    assert rewritten.node_ids() == kept.node_ids()
    assert rewritten.timelines() == kept.timelines() != {}
    assert rewritten.meta == kept.meta and rewritten.group == "g1"
    assert rewritten.rewards == {i: float(i[1:]) for i in kept.node_ids()}
    with RolloutGraph.open(path, fsync="never") as graph:
        graph.add_turn(TurnNode("more", request_messages=[{"role": "user", "content": "m"}]))
        graph.set_reward(9.0, leaf="more")
    again = RolloutGraph.load(path)
    assert again.rewards == {**rewritten.rewards, "more": 9.0} and again.group == "g1"
    assert again.timelines() == rewritten.timelines()


def _log_frames(path: Path, build: object) -> tuple[bytes, list[bytes]]:
    """A log built by `build`, and its frames (the magic apart)."""
    with RolloutGraph.open(path, fsync="never") as graph:
        build(graph)  # type: ignore[operator]
    data = path.read_bytes()
    return data[: len(MAGIC_V2)], [data[start:end] for _, start, end in frames_of(data)]


def _roots(n: int, who: str = "q") -> object:
    def build(graph: RolloutGraph) -> None:
        for i in range(n):  # independent roots: none refers to another
            graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": f"{who}{i}"}]))

    return build


def test_a_stale_copy_of_an_earlier_frame_past_damage_costs_only_itself(tmp_path: Path) -> None:
    """Past damaged bytes, a copy of turn 0's frame verifies by itself, but the frame after
    it does not follow it: it is damage too, and the intact turns after it are kept (the
    copy was read as a turn, its repeated id stopped the read and lost them)."""
    path = tmp_path / "log.rls"
    magic, frames = _log_frames(path, _roots(6))
    turns = [i for i, f in enumerate(frames) if f[5] & 0x7F == 3]
    frames[turns[2]] = b"\0" * 8 + frames[turns[0]]
    path.write_bytes(magic + b"".join(frames))
    kept = RolloutGraph.load(path, recover=True)
    assert kept.node_ids() == ["turn-0", "turn-1", "turn-3", "turn-4", "turn-5"]
    assert [kept.request_messages(n)[0]["content"] for n in kept.node_ids()] == [
        "q0",
        "q1",
        "q3",
        "q4",
        "q5",
    ]


def test_a_frame_of_another_file_past_damage_is_never_read_as_a_turn(tmp_path: Path) -> None:
    """A turn frame of another log spliced in after damaged bytes verifies by itself; the
    next frame of this log does not follow it: it is not read (its tail was joined to this
    file's base, a request neither file recorded), and the turn after it, which extends a
    turn the damage took, is dropped and counted."""

    def conversation(who: str) -> object:
        def build(graph: RolloutGraph) -> None:
            messages: list[object] = [{"role": "user", "content": f"{who} asks 1"}]
            for i in range(3):
                answer = {"role": "assistant", "content": f"{who} answer {i}"}
                graph.add_turn(TurnNode(request_messages=list(messages), response_message=answer))
                messages += [answer, {"role": "user", "content": f"{who} asks {i + 2}"}]

        return build

    magic, alice = _log_frames(tmp_path / "alice.rls", conversation("alice"))
    _, bob = _log_frames(tmp_path / "bob.rls", conversation("bob"))
    path = tmp_path / "damaged.rls"
    spliced = [*alice[:3], b"\0" * 10 + bob[3], *alice[4:]]  # alice's second turn's place
    path.write_bytes(magic + b"".join(spliced))
    kept = RolloutGraph.load(path, recover=True)
    report = kept.load_report
    assert report is not None
    assert kept.node_ids() == ["turn-0"]
    assert [d.node_id for d in report.dropped] == ["turn-2"]
    texts = json.dumps([kept.request_messages(n) for n in kept.node_ids()])
    assert "bob" not in texts


def test_a_log_missing_a_middle_frame_keeps_its_intact_last_frame(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The last frame is whole but names a frame that is gone: not a torn tail. Recover keeps
    it (it refers to nothing lost), and repair refuses to cut it (it cut it as a torn last
    record)."""
    path = tmp_path / "log.rls"
    magic, frames = _log_frames(path, _roots(4))
    del frames[-2]
    data = magic + b"".join(frames)
    path.write_bytes(data)
    kept = RolloutGraph.load(path, recover=True)
    report = kept.load_report
    assert report is not None and not report.truncated
    assert kept.node_ids() == ["turn-0", "turn-1", "turn-3"]
    assert kept.request_messages("turn-3") == [{"role": "user", "content": "q3"}]
    assert cli_main(["repair", str(path)]) == 1
    assert "repair does not apply" in capsys.readouterr().err
    assert path.read_bytes() == data
    with pytest.raises(CorruptFileError):
        RolloutGraph.open(path, repair=True)
    assert path.read_bytes() == data


def test_a_lost_metadata_or_timeline_record_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Damage inside the meta and timeline records of a snapshot: every turn is kept, and the
    report and recover say the metadata and the timelines were lost (they said nothing)."""
    path = tmp_path / "s.rls"
    graph = RolloutGraph()
    for i in range(3):
        graph.add_turn(TurnNode(f"n{i}", request_messages=[{"role": "user", "content": f"q{i}"}]))
        graph.set_timeline(f"n{i}", _timeline(i))
        graph.set_reward(float(i), leaf=f"n{i}")
    graph.set_group("g1")
    graph.save(path)
    data = bytearray(path.read_bytes())
    for kind, start, end in frames_of(bytes(data)):
        if kind in (6, 8):  # meta, timeline
            data[(start + HEADER.size + end) // 2] ^= 0x20
    path.write_bytes(bytes(data))
    kept = RolloutGraph.load(path, recover=True)
    report = kept.load_report
    assert report is not None and kept.node_ids() == ["n0", "n1", "n2"]
    assert report.meta_records_lost == 1 and report.timeline_records_lost == 1
    assert kept.group is None and kept.timelines() == {}
    assert cli_main(["recover", str(path), "-o", str(tmp_path / "out.rls")]) == 0
    said = capsys.readouterr().out
    assert "the graph's metadata record was lost there" in said
    assert "1 timeline record lost there" in said


def test_a_bad_value_record_is_named_a_value_record(tmp_path: Path) -> None:
    """A value record that fails (nested 600 deep) is applied with the turn after it: the
    error names the value record, at its place (it said "invalid turn record")."""
    import msgpack

    path = tmp_path / "log.rls"
    with RolloutGraph.open(path, fsync="never") as graph:
        graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": "hi"}]))
    data = path.read_bytes()
    records = [(kind, data[start + HEADER.size : end]) for kind, start, end in frames_of(data)]
    deep = msgpack.packb(b"\x91" * 600 + b"\xc0")
    records.insert(2, (2, deep))  # a value record before the turn's
    out, chain = [MAGIC_V2], 0
    for kind, payload in records:
        frame, chain = framing.encode_frame(kind, payload, chain)
        out.append(frame)
    path.write_bytes(b"".join(out))
    value_at = len(MAGIC_V2) + sum(HEADER.size + len(p) for _, p in records[:2])
    with pytest.raises(CorruptFileError, match="invalid value record") as info:
        RolloutGraph.load(path)
    assert info.value.offset == value_at and info.value.record == 2


def test_drift_entries_after_a_lost_turn_are_mapped_to_the_turns_kept(tmp_path: Path) -> None:
    path, damaged = tmp_path / "log.rls", tmp_path / "damaged.rls"
    with RolloutGraph.open(path, fsync="never") as graph:
        graph.add_turn(TurnNode("n0", request_messages=[{"role": "user", "content": "other"}]))
        messages: list[object] = [{"role": "user", "content": "q"}]
        prompt = [1, 2, 3]
        for k in range(3):  # the ids drop the thinking (50): each call drifts from the last
            answer = {"role": "assistant", "content": f"a{k}"}
            graph.add_turn(
                TurnNode(
                    f"d{k}",
                    request_messages=list(messages),
                    response_message=answer,
                    prompt_ids=prompt,
                    sampled_ids=[50, 60 + k],
                    sampled_logprobs=[-0.5, -0.25],
                )
            )
            messages += [answer, {"role": "user", "content": f"q{k}"}]
            prompt = [*prompt, 60 + k, 7]
    whole = RolloutGraph.load(path)
    assert len(whole.drift()) == 2
    data = path.read_bytes()
    start, end = turn_frames(data)[0]
    damaged.write_bytes(flipped(data, (start + end) // 2))
    kept = RolloutGraph.load(damaged, recover=True)
    report = kept.load_report
    assert report is not None and report.lost_turns == 1 and report.drifts_lost == 0
    assert kept.node_ids() == ["d0", "d1", "d2"]
    assert kept.drift() == whole.drift()

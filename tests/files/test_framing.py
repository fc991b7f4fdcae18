"""Frames of format version 2: chain binding, escaping, linear resync."""

from __future__ import annotations

import itertools
import os
import random

import pytest

from rollout_store import ChecksumMismatch, CorruptFileError
from rollout_store.engine.blobs import content_digest
from rollout_store.files.framing import (
    ESCAPE,
    HEADER,
    SYNC,
    FrameReader,
    ScanCounters,
    encode_blob_frame,
    encode_frame,
    next_frame,
)

BLOB = 1
KINDS = frozenset({BLOB})
START = 8  # frames start after an 8-byte magic in a file; here: any 8 bytes


def build(payloads: list[tuple[int, bytes]], file_id: bytes = b"id-0") -> tuple[bytes, list[int]]:
    """A frame sequence: a header frame holding `file_id`, then the given records. Returns
    the bytes (after an 8-byte lead) and every frame's offset."""
    out, offsets, chain = [b"\0" * START], [], 0
    size = START
    for kind, payload in [(0, b"header " + file_id), *payloads]:
        offsets.append(size)
        if kind == BLOB:
            parts, chain = encode_blob_frame(kind, content_digest(payload), payload, chain)
        else:
            frame, chain = encode_frame(kind, payload, chain)
            parts = [frame]
        out.extend(parts)
        size += sum(map(len, parts))
    return b"".join(out), offsets


def read_all(data: bytes) -> list[tuple[int, bytes]]:
    reader = FrameReader(data, START, digest_kinds=KINDS, max_kind=4)
    # a blob's payload is its digest, then its text
    return [(f.kind, bytes(f.payload[16:] if f.kind == BLOB else f.payload)) for f in reader]


def split(data: bytes, offsets: list[int]) -> list[bytes]:
    bounds = [*offsets, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


RECORDS = [
    (2, b"value one"),
    (BLOB, "a long string \u00e9".encode() * 20),
    (3, b"turn " + ESCAPE + b" with the marker's bytes " + SYNC + b" inside"),
    (2, b""),
    (3, b"last turn"),
]


def test_round_trip_with_escaped_payloads() -> None:
    data, offsets = build(RECORDS)
    got = read_all(data)
    assert got[1:] == RECORDS
    assert data.count(SYNC) == len(offsets)  # the marker inside a payload was escaped


def test_every_reorder_and_duplicate_of_frames_is_detected_with_its_offset() -> None:
    data, offsets = build(RECORDS)
    frames = split(data, offsets)
    n = len(frames)
    cases = 0
    for i, j in itertools.permutations(range(n), 2):
        swapped = list(frames)
        swapped[i], swapped[j] = frames[j], frames[i]
        duplicated = list(frames)
        duplicated.insert(j, frames[i])
        for variant in (swapped, duplicated):
            changed = data[:START] + b"".join(variant)
            first = next(k for k in range(len(variant)) if variant[k] != frames[k])
            at = START + sum(map(len, variant[:first]))
            with pytest.raises(CorruptFileError) as info:
                read_all(changed)
            assert info.value.offset == at, (i, j)
            assert "out of place" in str(info.value)
            cases += 1
    assert cases == 2 * n * (n - 1)


def test_frames_from_another_file_are_refused() -> None:
    mine, my_offsets = build(RECORDS, b"id-1")
    theirs, their_offsets = build(RECORDS, b"id-2")
    mixed = mine[: my_offsets[3]] + theirs[their_offsets[3] :]  # same records, other file
    with pytest.raises(CorruptFileError, match="out of place") as info:
        read_all(mixed)
    assert info.value.offset == my_offsets[3]


def test_flipped_bits_are_checksum_errors() -> None:
    data, offsets = build(RECORDS)
    for pos in range(START, len(data)):
        changed = bytearray(data)
        changed[pos] ^= 1 << (pos % 8)
        with pytest.raises(CorruptFileError) as info:
            read_all(bytes(changed))
        frame = max(o for o in offsets if o <= pos)
        assert info.value.offset is not None and info.value.offset <= frame


def test_blob_text_is_checked_by_its_digest() -> None:
    data, offsets = build(RECORDS)
    changed = bytearray(data)
    changed[offsets[3] - 1] ^= 0x01  # last byte of the blob's text
    with pytest.raises(ChecksumMismatch, match="blob") as info:
        read_all(bytes(changed))
    assert info.value.offset == offsets[2]


def test_a_payload_embedding_a_valid_frame_is_no_boundary() -> None:
    """Content that is itself a whole, valid frame (the attack that defeated repair)."""
    fake, _ = encode_frame(3, b"I look like a turn", 0)
    torn_turn = b"tool output: " + fake + b" more output " * 50
    data, offsets = build([*RECORDS, (3, torn_turn)])
    assert read_all(data)[-1] == (3, torn_turn)
    cut = data[: len(data) - 40]  # the last turn torn
    reader = FrameReader(cut, START, digest_kinds=KINDS, max_kind=4)
    with pytest.raises(CorruptFileError, match="ends inside"):
        list(reader)
    assert reader.cut and reader.resync is None
    assert next_frame(cut, offsets[-1], digest_kinds=KINDS) is None


def test_damage_followed_by_frames_is_not_a_torn_tail() -> None:
    data, offsets = build(RECORDS)
    changed = bytearray(data)
    changed[offsets[2] + HEADER.size + 3] ^= 0xFF  # inside a middle frame
    reader = FrameReader(bytes(changed), START, digest_kinds=KINDS, max_kind=4)
    with pytest.raises(CorruptFileError):
        list(reader)
    assert not reader.cut and reader.resync == offsets[3]


def _crafted_garbage(size: int, rng: random.Random) -> bytes:
    """Garbage dense with markers, each a header claiming a payload to the end."""
    out = bytearray()
    while len(out) < size:
        fake = HEADER.pack(SYNC, 3, size, rng.getrandbits(64), rng.getrandbits(64))
        out += fake + rng.randbytes(rng.randrange(0, 64))
    return bytes(out[:size])


@pytest.mark.parametrize("kind", ["random", "crafted", "markers"])
def test_resync_work_is_linear_in_the_damaged_bytes(kind: str) -> None:
    """Bytes searched and hashed per damaged byte stay flat from 64 KiB to 512 KiB (a count,
    not a timing: the timing ratio is in benchmarks/file_format.py)."""
    rng = random.Random(7)
    per_byte = []
    for size in (64 << 10, 512 << 10):
        if kind == "random":
            garbage = rng.randbytes(size)
        elif kind == "crafted":
            garbage = _crafted_garbage(size, rng)
        else:
            garbage = SYNC * (size // len(SYNC))
        data, _ = build(RECORDS)
        counters = ScanCounters()
        assert next_frame(data + garbage, len(data) - 1, counters=counters) is None
        work = counters.hashed_bytes + counters.searched_bytes
        per_byte.append(work / size)
    assert per_byte[1] <= 1.1 * per_byte[0] + 0.01
    assert per_byte[1] <= 8  # each byte searched a few times, hashed at most once


def test_resync_finds_the_frame_after_garbage() -> None:
    data, offsets = build(RECORDS)
    junk = os.urandom(5000) + SYNC + os.urandom(100)
    changed = data[: offsets[3]] + junk + data[offsets[3] :]
    assert next_frame(changed, offsets[3], digest_kinds=KINDS) == offsets[3] + len(junk)


def test_each_stored_byte_is_hashed_once() -> None:
    data, offsets = build(RECORDS)
    counters = ScanCounters()
    reader = FrameReader(data, START, digest_kinds=KINDS, max_kind=4, counters=counters)
    frames = list(reader)
    assert len(frames) == len(offsets)
    # what the hash functions were handed: every payload byte once (a blob's digest by the
    # chain, its text by the digest check), although the blob frame's chain covers its text
    assert counters.hashed_bytes == sum(len(f.payload) for f in frames)


def test_a_blob_whose_digest_holds_the_escape_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """About 13 in 2**32 digests hold the marker's first bytes: such a blob frame is escaped
    and still chained over its digest."""
    from rollout_store.files import framing

    text = b"a blob whose digest is unlucky"
    unlucky = b"\x01" * 6 + ESCAPE + b"\x02" * 6

    def digest(data: bytes | memoryview) -> bytes:
        return unlucky if bytes(data) == text else content_digest(data)

    monkeypatch.setattr(framing, "content_digest", digest)
    parts, chain = encode_blob_frame(BLOB, unlucky, text, 0)
    data = b"\0" * START + b"".join(parts)
    assert data.count(SYNC) == 1 and data[START + 5] & framing.ESCAPED
    frames = list(FrameReader(data, START, digest_kinds=KINDS, max_kind=4))
    assert bytes(frames[0].payload) == unlucky + text and frames[0].chain == chain


def _outcome(data: bytes, counters: ScanCounters | None) -> tuple[list[tuple[object, ...]], str]:
    """Every frame the reader yields (as tuples, payloads copied) and the damage it names."""
    reader = FrameReader(data, START, digest_kinds=KINDS, max_kind=4, counters=counters)
    out: list[tuple[object, ...]] = []
    try:
        for kind, payload, offset, record, end, chain in reader.tuples():
            out.append((kind, bytes(payload), offset, record, end, chain))
    except CorruptFileError as exc:
        return out, f"{type(exc).__name__} {exc} {exc.offset} {reader.cut} {reader.resync}"
    return out, ""


def test_the_one_step_path_reads_what_the_full_check_reads() -> None:
    """`FrameReader.tuples` takes plainly whole frames in one step; with counters every frame
    goes through the full check. Both must yield the same frames and the same damage, for
    the file and for every flipped byte, cut and swapped pair of frames."""
    data, offsets = build(RECORDS)
    variants = [data]
    rng = random.Random(7)
    for at in rng.sample(range(START, len(data)), 200):
        changed = bytearray(data)
        changed[at] ^= 1 << rng.randrange(8)
        variants.append(bytes(changed))
    variants.extend(data[:cut] for cut in range(START, len(data), 7))
    frames = split(data, offsets)
    for i, j in itertools.combinations(range(1, len(frames)), 2):
        swapped = list(frames)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        variants.append(data[:START] + b"".join(swapped))
    for variant in variants:
        assert _outcome(variant, None) == _outcome(variant, ScanCounters())
    assert _outcome(data, None)[1] == "" and len(_outcome(data, None)[0]) == len(offsets)

"""Frames of format version 1 through the facade over the engine: the bytes the format
defines, damage told from a torn tail, and the format's constants read from one place."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import xxhash

from rollout_store import ChecksumMismatch, CorruptFileError, _core
from rollout_store.files import frames, framing

DATA = Path(__file__).parent.parent / "data"


def _reference_frame(kind: int, payload: bytes) -> bytes:
    """A version-1 frame as the format defines it, spelled out here."""
    seed = (kind << 32) | len(payload)
    return struct.pack("<BIQ", kind, len(payload), xxhash.xxh3_64_intdigest(payload, seed=seed))


def _log(payloads: list[bytes]) -> tuple[bytes, list[int]]:
    data, offsets = frames.MAGIC, []
    for payload in payloads:
        offsets.append(len(data))
        data += frames.frame(frames.KIND_TURN, payload)
    return data, offsets


def test_frames_are_the_bytes_the_format_defines() -> None:
    for payload in (b"", b"turn", bytes(range(256)) * 300):
        assert frames.frame(3, payload) == _reference_frame(3, payload) + payload
    text = "a long string \u00e9".encode() * 40
    digest = xxhash.xxh3_128_digest(text)
    parts = frames.blob_frame(digest, text)
    assert parts[-1] is text  # the text is never copied
    payload = b"\x92\xc4\x10" + digest + b"\xc5" + len(text).to_bytes(2, "big") + text
    assert b"".join(parts) == _reference_frame(frames.KIND_BLOB, payload) + payload


def test_the_fixtures_read_whole() -> None:
    for name in ("v1_log.rls", "v1_snapshot.rls"):
        data = (DATA / name).read_bytes()
        counters = framing.ScanCounters()
        got = list(frames.FrameReader(data, len(frames.MAGIC), counters=counters).tuples())
        assert got[-1][4] == len(data) and [f[3] for f in got] == list(range(len(got)))
        for kind, payload, offset, _, end, chain in got:
            assert data[offset:end] == _reference_frame(kind, bytes(payload)) + payload
            assert chain == 0
        assert counters.hashed_bytes == sum(len(f[1]) for f in got)


def test_damage_in_the_middle_is_not_a_torn_tail() -> None:
    data, offsets = _log([b"one", b"two", b"three"])
    changed = bytearray(data)
    changed[offsets[1] + frames.FRAME.size] ^= 1
    reader = frames.FrameReader(bytes(changed), len(frames.MAGIC))
    with pytest.raises(ChecksumMismatch) as info:
        list(reader.tuples())
    assert (info.value.offset, info.value.record) == (offsets[1], 1)
    assert not reader.cut and reader.offset == offsets[1] and reader.records == 1
    assert frames.intact_end_after(bytes(changed), offsets[1])


def test_a_cut_or_garbage_after_damage_is_a_torn_tail() -> None:
    data, offsets = _log([b"one", b"two", b"three"])
    for torn in (data[:-2], data[: offsets[2] + 5], data[:-2] + b"\xff" * 40 + b"\0" * 30):
        reader = frames.FrameReader(torn, len(frames.MAGIC))
        with pytest.raises(CorruptFileError):
            list(reader.tuples())
        assert reader.cut
        counters = framing.ScanCounters()
        assert not frames.intact_end_after(torn, offsets[2], counters=counters)
        assert counters.searched_bytes <= len(torn) - offsets[2]


def test_the_format_constants_have_one_source() -> None:
    """The file layer reads the format's constants from the engine."""
    assert framing.HEADER.size == _core.HEADER_SIZE == 26
    assert frames.FRAME.size == _core.HEADER_SIZE_V1 == 13
    assert framing.MAGIC_V2 is _core.MAGIC_V2 and frames.MAGIC is _core.MAGIC_V1
    assert framing.SYNC is _core.SYNC and framing.ESCAPED == _core.ESCAPED == 0x80
    assert framing.SYNC[:4] == framing.ESCAPE == _core.ESCAPE
    assert framing.MAX_PAYLOAD == _core.MAX_PAYLOAD == (1 << 31) - 1
    assert framing.DIGEST_SIZE == _core.DIGEST_SIZE == 16
    assert frames.BLOB_PREFIX is _core.BLOB_PREFIX_V1

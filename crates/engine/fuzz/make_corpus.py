"""Write the fuzz targets' seed corpora (`corpus/<target>/`) from real inputs, deterministically.

    python crates/engine/fuzz/make_corpus.py

Each CI run of a target starts from its seeds instead of from nothing (see `.ci/run`, which
copies them to a scratch directory so that a run adds no file here):

- `json_ids`: the JSON texts below and token id arrays, alone and as an object's member;
- `json_parse`, `json_roundtrip`: JSON texts with what `json.loads` reads its own way (lone
  and paired surrogate escapes, ints beyond 64 bits, 1e400, NaN and the infinities, -0.0,
  duplicate keys, nesting at and past the parser's depth limit) and cut or broken ones;
- `packed_unpack`: values packed as the library packs them (`rollout_store._core.Packer`)
  and the payloads of the value and turn records of the files in `tests/data/`;
- `packed_check`: the same, each behind the flags byte the target reads (blob count, depth
  limit, echoes allowed, a turn record), with blob references where the packing has them;
- `frame_reader`: version-2 files of `tests/data/` (past the magic, behind the flags byte
  naming their kinds), whole while small, else their first frames; a torn tail, a flipped
  byte, stretches from further on;
- `frame_reader_v1`: the same of the version-1 files;
- `link_key`: chat messages and responses packed as the library packs them, alone and as
  response-message pairs (a response, 0xc1, its loosened echo or another message);
- `request_raw`: conversations as their texts of messages, each text after the first
  written as the previous one extended (see the target), some written whole again, with
  repeated keys, big ints, escapes, broken items and retries among them, and a tip nested
  deeper than the bound of the text that re-sends it.

Every seed is a few KiB at most. The files are rewritten on each run (the directories
emptied first), so a change to this script is a change to the corpora.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))  # the package of this checkout

from rollout_store import BlobTable  # noqa: E402
from rollout_store._core import MAGIC_V1, MAGIC_V2, FrameScan, Packer  # noqa: E402

DATA = ROOT / "tests" / "data"
MAX_SEED = 4096  # bytes
DEPTH_LIMIT = 500  # the parser's DEFAULT_MAX_DEPTH (crates/engine/src/json/parse.rs)
KIND_BLOB, KIND_VALUE, KIND_TURN, KIND_TIMELINE = 1, 2, 3, 8


def id_seeds() -> dict[str, bytes]:
    """Token id arrays as engines write them, alone and as an answer's member `ids`."""
    ids = [0, 7, 4294967295, 151643, 12]
    texts = {
        "ids_spaced": json.dumps(ids),
        "ids_compact": json.dumps(ids, separators=(",", ":")),
        "ids_empty": "[]",
        "ids_out_of_range": "[4294967296, -1, 01, 1.0, 1e3]",
        "member_ids": json.dumps({"id": "c", "choices": [{"ids": [9]}], "ids": ids}),
        "member_ids_twice": '{"ids": [1], "x": "\\"}", "ids": [2, 3]}',
    }
    return {f"{name}.json": text.encode() for name, text in texts.items()}


def json_seeds() -> dict[str, bytes]:
    texts = {
        "empty_containers": '[{}, [], "", 0, -0, 0.0, -0.0, 1, 1.0, true, false, null]',
        "lone_high_surrogate": '"\\ud800"',
        "lone_low_surrogate": '["\\udc00", "x\\udfffy"]',
        "surrogate_pair": '"\\ud83d\\ude00 and \\ud83d"',
        "pair_split_by_text": '"\\ud800a\\udc00"',
        "escapes": '"\\"\\\\\\/\\b\\f\\n\\r\\t\\u0000\\u001f\\u00e9\\u20ac"',
        "raw_utf8": json.dumps({"é": "日本語 🎉"}, ensure_ascii=False),
        "big_ints": "[18446744073709551615, 18446744073709551616, -9223372036854775809, "
        + str(2**200)
        + "]",
        "long_int": "9" * 4000,
        "floats": "[1e400, -1e400, 1e-400, 5e-324, 1.7976931348623157e308, 0.1, 1E+2, -0.0e0]",
        "nan_infinity": "[NaN, Infinity, -Infinity]",
        "duplicate_keys": '{"a": 1, "b": 2, "a": [3], "": {}, "": null}',
        "object_order": '{"z": 1, "a": {"y": 2, "b": 3}, "10": 4, "9": 5}',
        "whitespace": ' \t\n\r[ 1 , { "k" : [ ] } ]\r\n ',
        "chat_turn": json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "You are careful."},
                    {"role": "user", "content": "x" * 1200},
                ],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                "temperature": 0.7,
                "logprobs": [[-0.0, -1.5e-8], [None, 2**64]],
            }
        ),
        # nesting at the limit parses; one level more is refused
        "depth_at_limit": "[" * DEPTH_LIMIT + "]" * DEPTH_LIMIT,
        "depth_past_limit": "[" * (DEPTH_LIMIT + 1) + "]" * (DEPTH_LIMIT + 1),
        "depth_objects": '{"a":' * (DEPTH_LIMIT - 1) + "1" + "}" * (DEPTH_LIMIT - 1),
        # refused: cut, stray bytes, bad escapes, leading zeros, trailing text
        "cut_string": '{"a": "abc',
        "cut_escape": '"\\u12',
        "bad_escape": '"\\x41"',
        "leading_zero": "[01]",
        "trailing_text": "[1] x",
        "trailing_comma": "[1,]",
        "control_char": '"a\tb"',
    }
    seeds = {f"{name}.json": text.encode("utf-8") for name, text in texts.items()}
    seeds["invalid_utf8.json"] = b'"\xff\xfe \xed\xa0\x80"'
    seeds["bom.json"] = b"\xef\xbb\xbf[1]"
    return seeds


def packed_values() -> Iterator[tuple[str, object]]:
    yield "scalars", [None, True, False, 0, -1, 127, 128, -33, 2**31, -(2**63), 2**64 - 1]
    yield "big_ints", [2**64, -(2**63) - 1, 2**200, -(10**40)]
    yield "floats", [0.0, -0.0, 1.0, 1e300, float("nan"), float("inf"), float("-inf"), 5e-324]
    yield "strings", ["", "a", "é", "x" * 40, "y" * 300, "\ud800", "a\udc00b"]
    yield "containers", [{}, [], {"": []}, {"a": {"b": {"c": [1, 2, [3]]}}}, ("tuple", 1)]
    yield "key_order", {"z": 1, "a": 2, "10": 3, "": 4}
    yield (
        "chat",
        {
            "messages": [
                {"role": "system", "content": "You are careful. " * 3},
                {"role": "user", "content": "q" * 200},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
            ],
            "temperature": 0.7,
        },
    )
    yield "deep", [[[[[[[[[[[[[[[[["deep"]]]]]]]]]]]]]]]]]


def packed_seeds() -> tuple[dict[str, bytes], dict[str, bytes]]:
    """Seeds of `packed_unpack` and of `packed_check` (flags byte first)."""
    unpack: dict[str, bytes] = {}
    check: dict[str, bytes] = {}
    plain = Packer(None, None)
    table = BlobTable()
    sharing = Packer(table.intern, 16)  # strings of 16 characters on become blob references
    for name, value in packed_values():
        packed = plain.pack(value)
        unpack[f"{name}.msgpack"] = packed
        check[f"{name}.msgpack"] = bytes([15 << 2]) + packed  # depth 601, no blobs or echoes
        shared = sharing.pack(value)
        if shared != packed:
            n_blobs = min(len(table), 3)
            check[f"{name}_blobs.msgpack"] = bytes([n_blobs | 15 << 2]) + shared
    for value_or_turn, packed in record_payloads():
        name, kind = value_or_turn
        unpack[f"{name}.msgpack"] = packed
        if kind == KIND_TURN:  # a turn record: the record flag, a small container limit
            check[f"{name}.msgpack"] = bytes([128 | 64 | 3]) + packed
        else:
            check[f"{name}.msgpack"] = bytes([64 | 3 | 15 << 2]) + packed
    depth = b"\x91" * 600 + b"\xc0"  # nested one-element arrays past any depth limit
    unpack["deep_arrays.msgpack"] = depth
    check["deep_arrays.msgpack"] = bytes([3 << 2]) + depth  # limit 121
    out_of_range = b"\x92\xd6\x04\x05\x00\x00\x00\xc0"  # [a blob past a table of 1, None]
    check["blob_ref_out_of_range.msgpack"] = bytes([1 | 15 << 2]) + out_of_range
    ext8_ref = b"\xc7\x04\x04\x00\x00\x00\x00"  # blob 0 as ext 8, a form no version writes
    check["blob_ref_ext8.msgpack"] = bytes([2 | 3 << 2]) + ext8_ref
    return unpack, check


def v2_frames(path: Path) -> Iterator[tuple[int, bytes, int, int]]:
    """(kind, payload, offset, end) of each frame of a version-2 file."""
    data = path.read_bytes()
    scan = FrameScan(data, len(MAGIC_V2), 0, 0, 1 << KIND_BLOB, KIND_TIMELINE)
    for kind, payload, offset, _record, end, _chain in scan:
        yield kind, bytes(payload), offset, end


def v1_frames(path: Path) -> Iterator[tuple[int, bytes, int, int]]:
    data = path.read_bytes()
    for kind, payload, offset, _record, end, _chain in FrameScan.v1(data, len(MAGIC_V1), 0):
        yield kind, bytes(payload), offset, end


def record_payloads() -> Iterator[tuple[tuple[str, int], bytes]]:
    """A few value and turn record payloads of each file of `tests/data/` (as written)."""
    for path in sorted(DATA.glob("*.rls")):
        frames = v1_frames if path.name.startswith("v1_") else v2_frames
        taken = {KIND_VALUE: 0, KIND_TURN: 0}
        for kind, payload, _offset, _end in frames(path):
            if kind in taken and taken[kind] < 2 and len(payload) <= MAX_SEED:
                name = f"{path.stem}_{'value' if kind == KIND_VALUE else 'turn'}{taken[kind]}"
                taken[kind] += 1
                yield (name, kind), payload


def frame_seeds(version: int) -> dict[str, bytes]:
    """Seeds of `frame_reader` (version 2: the flags byte first, naming kind 1 a blob and 8 the
    largest kind, as the library reads) or of `frame_reader_v1`."""
    seeds: dict[str, bytes] = {}
    flags = b"" if version == 1 else bytes([KIND_TIMELINE << 1])
    magic = MAGIC_V1 if version == 1 else MAGIC_V2
    frames = v1_frames if version == 1 else v2_frames
    for path in sorted(DATA.glob(f"v{version}_*.rls")):
        data = path.read_bytes()
        found = list(frames(path))
        start = len(magic)
        whole = [end for _k, _p, _o, end in found if end - start <= MAX_SEED - 1]
        body = data[start : whole[-1]]  # the file, or its first frames
        stem = path.stem
        seeds[f"{stem}.bin"] = flags + body
        seeds[f"{stem}_torn.bin"] = flags + body[: len(body) - 3]
        flipped = bytearray(body)
        flipped[len(body) // 2] ^= 0x20
        seeds[f"{stem}_flipped.bin"] = flags + bytes(flipped)
        # frames from further on (version 2: a chain that does not start at 0, read past)
        for quarter in (1, 2, 3):
            later = [(o, e) for _k, _p, o, e in found[len(found) * quarter // 4 :]]
            first = later[0][0]
            ends = [e for _o, e in later if e - first <= MAX_SEED - 1]
            if ends and first >= whole[-1]:
                seeds[f"{stem}_at{quarter}of4.bin"] = flags + data[first : ends[-1]]
    return seeds


def request_seeds() -> dict[str, bytes]:
    """Texts of messages that extend one another: 0xff between texts, 0x01 to start a text
    from the previous one's last item (the target's own encoding)."""
    user = b'{"role": "user", "content": "hi"}'
    reply = b'{"role": "assistant", "content": "hello \\u00e9"}'
    odd = b'{"x": 1, "x": 18446744073709551616, "y": [1e400, -0.0, "\\ud800"]}'
    first = b"[" + user + b"]"
    go_on = b"\x01, " + reply + b", " + user + b"]"
    seeds = {
        "conversation": b"\xff".join([first, go_on, go_on, go_on]),
        "retry": b"\xff".join([first, b"\x01 ]", go_on, b"\x01]  "]),
        "odd_values": b"\xff".join([b"[" + odd + b"]", b"\x01," + odd + b"]", go_on]),
        "broken": b"\xff".join([first, b"\x01, nope]", b"\x01,]", b"\x01, 1] x", go_on]),
        "branches": b"\xff".join([first, go_on, first, go_on, b"[" + reply + b"]", go_on]),
        "not_arrays": b"\xff".join([b"{}", b"\x01, 1]", b"[1]", b"\x01, " + b"9" * 50 + b"]"]),
        # a tip nested deeper than the odd texts' bound, re-sent under it and then whole
        "deep": b"\xff".join([b"[" * 6 + b"1" + b"]" * 6, b"\x01, 1]", b"\x01]", b"\x01, 2]"]),
    }
    return seeds


def link_seeds() -> dict[str, bytes]:
    """Packed messages and (response, 0xc1, message) pairs for the link key."""
    pack = Packer(None, None).pack
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    response = {"role": "assistant", "content": "done", "refusal": None, "tool_calls": [call]}
    echo = {
        "content": [{"type": "text", "text": "do"}, {"type": "text", "text": "ne"}],
        "role": "assistant",
        "tool_calls": [{"function": {"arguments": '{"a":1.0}', "name": "f"}, "id": "d"}],
    }
    values = {
        "response": response,
        "user": {"role": "user", "content": "hi"},
        "no_role": {"content": None},
        "parts": {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
        "numbers": [1, 1.0, True, -0.0, 2**70, float("nan"), float("inf")],
        "tuple_role": {"role": ("a", None), "content": (1, 2)},
    }
    seeds = {name: pack(value) for name, value in values.items()}
    seeds["echo_pair"] = pack(response) + b"\xc1" + pack(echo)
    seeds["other_pair"] = pack(response) + b"\xc1" + pack(values["user"])
    return seeds


def blake3_seeds() -> dict[str, bytes]:
    """(repeat count, eight piece-size codes, bytes) for the compact BLAKE3 state: pieces of
    chunks and off by one, one chunk's bytes repeated into a few hundred KiB, a short text."""
    text = bytes(range(256)) * 4
    return {
        "chunks": bytes([3, 1 << 2 | 1, 2 << 2 | 1, 1 << 2 | 2, 4 << 2 | 3, 0, 9, 63 << 2 | 1, 5])
        + text,
        "wide": bytes([63, 63 << 2 | 1, 62 << 2 | 2, 16 << 2 | 3, 8, 32 << 2 | 1, 1, 2, 3]) + text,
        "short": bytes([0, 1, 2, 3, 4, 5, 6, 7, 8]) + b"a few bytes",
    }


def main() -> None:
    unpack, check = packed_seeds()
    json_texts = json_seeds()
    corpora = {
        "json_parse": json_texts,
        "json_roundtrip": json_texts,
        "json_ids": {**json_texts, **id_seeds()},
        "packed_unpack": unpack,
        "packed_check": check,
        "frame_reader": frame_seeds(2),
        "frame_reader_v1": frame_seeds(1),
        "request_raw": request_seeds(),
        "link_key": link_seeds(),
        "blake3_state": blake3_seeds(),
    }
    for target, seeds in corpora.items():
        out = HERE / "corpus" / target
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for name, data in seeds.items():
            assert len(data) <= MAX_SEED, (target, name, len(data))
            (out / name).write_bytes(data)
        print(f"{target}: {len(seeds)} seeds, {sum(map(len, seeds.values()))} bytes")


if __name__ == "__main__":
    main()

"""File size, save/load speed, load memory, resync and export memory of rollout_store's file
format on the multimodal workload, against unique content, the plain JSON export and a msgpack
floor. Every target is a ratio of two figures measured side by side in this one run. Writes
out/file_format.json (results/ with --update-results); ends with PASS/MISS lines for the
targets (never failing on them) and a one-line count of targets met and missed.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import io
import json
import os
import pstats
import sys
import tempfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from time import perf_counter
from typing import Any

import msgpack
import msgspec
from measure import (
    MiB,
    add_results_option,
    library_commit,
    record_traced,
    results_dir,
    shown,
    targets_summary,
)
from schemes import SHARE_THRESHOLD, RolloutStoreRecorder
from tqdm import tqdm
from workloads import iter_texts, multimodal, unique_content_bytes

from rollout_store import RolloutGraph, TurnNode, export_session, write_session_json
from rollout_store.files import framing, storage
from rollout_store.files.frames import KIND_BLOB, KIND_BLOB_REF, KIND_TURN

DEFAULT_TURNS = 100
QUICK_TURNS = 25
REPEAT = 15  # best of this many: the development machine is shared and busy

MAX_FILE_OVER_UNIQUE = 1.05
MAX_SAVE_OVER_PACKB_WRITE = 1.2  # save with os.fsync a no-op, over packb + write
MAX_LOAD_OVER_READ_UNPACKB = 1.5  # load, over reading the floor file + unpackb
MAX_PEAK_OVER_FILE = 4.0  # verify/load peak above what the loaded graph retains, / file size
MAX_RESYNC_RATIO = 1.5  # time per damaged byte, 32 MiB of damage over 4 MiB
DAMAGE_SIZES = (4 << 20, 32 << 20)
EMPTY_MAPS_FILE = 4 << 20  # bytes of the many-empty-maps file
STREAM_TURN_FACTOR = 2  # streaming peak <= retained + this x the largest turn
DATA = Path(__file__).resolve().parent.parent / "tests" / "data"  # version-1 files
IOV_PARTS = 1024  # IOV_MAX on Linux: one writev takes at most this many parts


class AppendRecorder(RolloutStoreRecorder):
    """RolloutStoreRecorder whose graph is an append-mode file (`RolloutGraph.open`)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.graph = RolloutGraph.open(path, share_threshold=SHARE_THRESHOLD, fsync="never")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=DEFAULT_TURNS, help="turns (default 100)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_TURNS} turns")
    parser.add_argument(
        "--profile", action="store_true", help="also print cProfile tables of save and load"
    )
    add_results_option(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.turns = QUICK_TURNS
    if args.turns < 1:
        parser.error("--turns must be positive")
    return args


def best_times(cases: dict[str, tuple[Callable[[], Any], Callable[[], None] | None]]) -> dict:
    """Best of REPEAT timings of each case's fn(), the cases interleaved round by round so
    that a busy moment of the machine hits the floor and the code alike; setup() and freeing
    fn's result happen outside the timed region."""
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(REPEAT):
        for name, (fn, setup) in cases.items():
            if setup is not None:
                setup()
            gc.collect()
            start = perf_counter()
            out = fn()
            best[name] = min(best[name], perf_counter() - start)
            del out
    return best


def _no_fsync(fd: int) -> None:
    pass


def export_text(graph: RolloutGraph, include_messages: bool) -> str:
    return json.dumps(export_session(graph, include_messages=include_messages))


def streamed_text(graph: RolloutGraph, path: Path, include_messages: bool) -> str:
    with open(path, "wb") as fp:
        write_session_json(graph, fp, include_messages=include_messages)
    return path.read_text(encoding="ascii")


# --- measurements -----------------------------------------------------------------------------


def measure_sizes(graph: RolloutGraph, texts: list[str], unique: int, tmp: Path) -> dict:
    snapshot = tmp / "snapshot.rls"
    graph.save(snapshot)
    log = tmp / "append.rls"
    recorder = AppendRecorder(log)
    for text in texts:
        recorder.add(json.loads(text))
    recorder.close()
    plain = len(export_text(graph, include_messages=True))
    file_bytes = snapshot.stat().st_size
    # the append-mode file must hold the same session as the graph
    reopened = RolloutGraph.load(log)
    assert export_text(reopened, True) == export_text(graph, True), "append file differs"
    return {
        "unique_bytes": unique,
        "file_bytes": file_bytes,
        "file_over_unique": file_bytes / unique,
        "append_file_bytes": log.stat().st_size,
        "append_over_unique": log.stat().st_size / unique,
        "plain_export_bytes": plain,
        "plain_over_file": plain / file_bytes,
    }


def file_frames(path: Path) -> list[tuple[int, bytes]]:
    """(kind, payload) of every frame of a version-2 file (blob payloads hold the digest)."""
    data = path.read_bytes()
    reader = framing.FrameReader(
        data, len(framing.MAGIC_V2), digest_kinds=frozenset({KIND_BLOB}), max_kind=KIND_BLOB_REF
    )
    return [(kind, bytes(payload)) for kind, payload, *_ in reader.tuples()]


def checked_load_floor(path: Path) -> list[Any]:
    """The least work any loader of a version-2 file that checks every frame must do, in
    pure Python: read the file, check every frame (marker, chain, a blob's digest over its
    text) with the library's frame reader, decode every blob's text to a str and every turn
    record with msgspec into `TurnRecord` (its field types checked in C). Nothing checked
    inside the records (references, packed values), no turn built, no graph."""
    with open(path, "rb") as fp:
        data = fp.read()
    decode = msgspec.msgpack.Decoder(storage.TurnRecord).decode
    digest = framing.DIGEST_SIZE
    reader = framing.FrameReader(
        data, len(framing.MAGIC_V2), digest_kinds=frozenset({KIND_BLOB}), max_kind=KIND_BLOB_REF
    )
    out: list[Any] = []
    for kind, payload, *_ in reader.tuples():
        if kind == KIND_BLOB:
            out.append(str(payload[digest:], "utf-8"))
        elif kind == KIND_TURN:
            out.append(decode(payload))
    return out


def framed_save_floor(path: Path, blobs: list[str], frames: list[tuple[int, bytes]]) -> None:
    """The least work any writer of a version-2 snapshot must do, in pure Python, with every
    turn record already built: encode each blob's text and frame it, pack each turn record
    (msgpack, as the library does) and frame it and every other record, and write it all to
    a new file with one writev (no temporary file, rename or fsync; past `IOV_PARTS` parts,
    with one write of the parts joined)."""
    pack = msgpack.Packer(use_bin_type=True, unicode_errors="surrogatepass").pack
    parts: list[bytes] = [framing.MAGIC_V2]
    chain, texts = 0, iter(blobs)
    for kind, payload in frames:
        if kind == KIND_BLOB:
            data = next(texts).encode("utf-8", "surrogatepass")
            blob, chain = framing.encode_blob_frame(
                kind, payload[: framing.DIGEST_SIZE], data, chain
            )
            parts += blob
        else:
            if kind == KIND_TURN:
                payload = pack(payload)
            frame, chain = framing.encode_frame(kind, payload, chain)
            parts.append(frame)
    data = b"".join(parts) if len(parts) > IOV_PARTS else None  # --turns beyond IOV_MAX
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = os.writev(fd, parts) if data is None else os.write(fd, data)
        total = sum(map(len, parts))
        if written < total:  # a short write (never seen for a regular file): the rest
            rest = memoryview(b"".join(parts))[written:]
            while rest:
                rest = rest[os.write(fd, rest) :]
    finally:
        os.close(fd)


def speed_cases(graph: RolloutGraph, path: Path, floor_path: Path, blobs: list[str]) -> dict:
    """The timed cases of `measure_speed`: (fn, untimed setup) by name."""
    packed = msgpack.packb(blobs, use_bin_type=True)
    graph.save(path)
    # the records of the file as the save floor packs them: turn records decoded (built)
    decode = msgspec.msgpack.Decoder(storage.TurnRecord).decode
    frames: list[tuple[int, Any]] = [
        (kind, decode(payload) if kind == KIND_TURN else payload)
        for kind, payload in file_frames(path)
    ]
    save_floor_path = floor_path.with_suffix(".framed")

    def save_no_fsync() -> None:
        real = os.fsync
        os.fsync = _no_fsync  # storage calls os.fsync: the disk's time, not the code's
        try:
            graph.save(path)
        finally:
            os.fsync = real

    def packb_write() -> None:
        with open(floor_path, "wb") as fp:
            fp.write(msgpack.packb(blobs, use_bin_type=True))

    def read_unpackb() -> list:
        with open(floor_path, "rb") as fp:
            return msgpack.unpackb(fp.read(), raw=False)

    def unlink() -> None:
        path.unlink(missing_ok=True)

    def unlink_floor() -> None:
        floor_path.unlink(missing_ok=True)

    def unlink_save_floor() -> None:
        save_floor_path.unlink(missing_ok=True)

    return {
        "packb_s": (lambda: msgpack.packb(blobs, use_bin_type=True), None),
        "unpackb_s": (lambda: msgpack.unpackb(packed, raw=False), None),
        "save_s": (lambda: graph.save(path), unlink),
        "save_no_fsync_s": (save_no_fsync, unlink),
        "packb_write_s": (packb_write, unlink_floor),
        "framed_save_floor_s": (
            lambda: framed_save_floor(save_floor_path, blobs, frames),
            unlink_save_floor,
        ),
        # the save and packb_write cases above leave these two files in place
        "load_s": (lambda: RolloutGraph.load(path), None),
        "read_unpackb_s": (read_unpackb, None),
        "checked_load_floor_s": (lambda: checked_load_floor(path), None),
    }


def measure_speed(graph: RolloutGraph, tmp: Path) -> dict:
    path, floor_path = tmp / "timed.rls", tmp / "floor.msgpack"
    blobs = [graph.blobs.string(i) for i in range(len(graph.blobs))]
    best = best_times(speed_cases(graph, path, floor_path, blobs))
    loaded = RolloutGraph.load(path)
    for include_messages in (False, True):
        assert export_text(loaded, include_messages) == export_text(graph, include_messages), (
            f"loaded graph's export differs (include_messages={include_messages})"
        )
    return {
        "blobs": len(blobs),
        "blob_chars": sum(map(len, blobs)),
        **best,
        "save_over_packb": best["save_s"] / best["packb_s"],
        "save_no_fsync_over_packb": best["save_no_fsync_s"] / best["packb_s"],
        "load_over_unpackb": best["load_s"] / best["unpackb_s"],
        "save_no_fsync_over_packb_write": best["save_no_fsync_s"] / best["packb_write_s"],
        "load_over_read_unpackb": best["load_s"] / best["read_unpackb_s"],
        "save_floor_over_packb_write": best["framed_save_floor_s"] / best["packb_write_s"],
        "save_no_fsync_over_save_floor": best["save_no_fsync_s"] / best["framed_save_floor_s"],
        "load_floor_over_read_unpackb": best["checked_load_floor_s"] / best["read_unpackb_s"],
        "load_over_load_floor": best["load_s"] / best["checked_load_floor_s"],
    }


def _small_log(path: Path) -> None:
    with RolloutGraph.open(path, share_threshold=64, fsync="never") as graph:
        for k in range(3):
            graph.add_turn(TurnNode(request_messages=[{"role": "user", "content": f"{k}" * 80}]))


def _torn_token_turn(path: Path, damage: int) -> None:
    """A log whose last turn (about `damage` bytes of token ids) was cut short."""
    _small_log(path)
    with RolloutGraph.open(path, share_threshold=64, fsync="never") as graph:
        graph.add_turn(TurnNode(prompt_ids=list(range(damage // 4)), sampled_ids=[1]))
    with open(path, "r+b") as fp:
        fp.truncate(path.stat().st_size - 64)


def _garbage_tail(path: Path, damage: int) -> None:
    _small_log(path)
    with open(path, "ab") as fp:
        fp.write(os.urandom(damage))


def _evict_caches() -> None:
    """Stream 64 MiB through the CPU caches, so that the next run reads its file from memory
    whatever its size (else a 4 MiB file stays in the last-level cache between repeats and a
    32 MiB one cannot: a hardware step, not the algorithm's)."""
    bytearray(64 << 20).find(b"\x01")


def measure_resync(tmp: Path) -> dict:
    """verify() of a small log followed by damage of two sizes: its time per damaged byte
    (each run after the caches are flushed, see `_evict_caches`)."""
    out: dict[str, Any] = {}
    for name, make in (("garbage", _garbage_tail), ("torn_turn", _torn_token_turn)):
        per_byte = []
        for damage in DAMAGE_SIZES:
            path = tmp / f"resync-{name}-{damage}.rls"
            make(path, damage)
            good = storage.verify(path).good_bytes
            damaged = path.stat().st_size - good
            report = storage.verify(path)
            assert not report.ok and report.truncated, f"{name}: damage not seen as a torn tail"
            assert report.error_offset is not None
            data = path.read_bytes()
            cases = {
                "verify": (lambda p=path: storage.verify(p), _evict_caches),
                # resync proper: finding the next intact frame after the damaged one
                "resync": (
                    lambda d=data, at=report.error_offset: framing.next_frame(d, at),
                    _evict_caches,
                ),
            }
            best = best_times(cases)
            del data
            key = f"{name}_{damage >> 20}MiB"
            out[f"{key}_s"] = best["verify"]
            out[f"{key}_resync_s"] = best["resync"]
            out[f"{key}_damaged_bytes"] = damaged
            per_byte.append((best["verify"] / damaged, best["resync"] / damaged))
            path.unlink()
        out[f"{name}_ratio"] = per_byte[1][0] / per_byte[0][0]
        out[f"{name}_resync_ratio"] = per_byte[1][1] / per_byte[0][1]
    return out


def _empty_maps_file(path: Path) -> None:
    """One turn whose request holds a message of about 4 MiB of empty maps (1 byte each packed)."""
    graph = RolloutGraph(share_threshold=None)
    graph.add_turn(
        TurnNode(request_messages=[{"role": "user", "content": [{}] * (EMPTY_MAPS_FILE - 64)}])
    )
    graph.save(path)


def memory_files(graph: RolloutGraph, tmp: Path) -> dict[str, Path]:
    """The files whose verify and load memory is measured: the multimodal snapshot, the
    many-empty-maps value, a log torn inside a 4 MiB token turn (loaded with recover=True),
    and the version-1 files the tests keep."""
    files = {"multimodal": tmp / "memory.rls", "empty_maps": tmp / "empty-maps.rls"}
    graph.save(files["multimodal"])
    _empty_maps_file(files["empty_maps"])
    files["torn_turn"] = tmp / "memory-torn.rls"
    _torn_token_turn(files["torn_turn"], DAMAGE_SIZES[0])
    for name in ("v1_snapshot", "v1_log"):
        files[name] = DATA / f"{name}.rls"
    return files


def measure_load_memory(graph: RolloutGraph, tmp: Path) -> dict:
    """Peak traced bytes of verify() and load() above the traced bytes before them, and what
    the loaded graph retains, on each of `memory_files`."""
    out: dict[str, Any] = {}
    files = memory_files(graph, tmp)
    storage.verify(files["multimodal"])  # lazy imports before the baseline
    tracemalloc.start()
    try:
        for name, path in files.items():
            size = path.stat().st_size
            verify_peak, _ = traced_delta(lambda p=path: storage.verify(p))
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            load_peak, loaded = traced_delta(lambda p=path: RolloutGraph.load(p, recover=True))
            gc.collect()
            retained = tracemalloc.get_traced_memory()[0] - before
            del loaded
            out[name] = {
                "file_bytes": size,
                "retained_bytes": retained,
                "verify_peak_bytes": verify_peak,
                "load_peak_bytes": load_peak,
                "verify_over_file": (verify_peak - retained) / size,
                "load_over_file": (load_peak - retained) / size,
            }
    finally:
        tracemalloc.stop()
    return out


def traced_delta(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(peak traced bytes during fn() minus traced bytes before it, fn's result)."""
    gc.collect()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    out = fn()
    return tracemalloc.get_traced_memory()[1] - before, out


def measure_memory(graph: RolloutGraph, retained: int, tmp: Path) -> dict:
    path = tmp / "stream.json"
    largest_get, largest_get_id = 0, None
    largest_json, largest_json_id = 0, None
    tracemalloc.start()
    try:
        for node_id in graph.node_ids():
            # a view builds its fields when read: replace() builds every one
            peak, turn = traced_delta(lambda n=node_id: dataclasses.replace(graph.get(n)))
            if peak > largest_get:
                largest_get, largest_get_id = peak, node_id
            size = len(
                json.dumps(
                    [turn.request_messages, turn.request_tools, turn.response_message]
                ).encode("utf-8")
            )
            if size > largest_json:
                largest_json, largest_json_id = size, node_id
            del turn
        with open(path, "wb") as fp:
            stream_peak, _ = traced_delta(
                lambda: write_session_json(graph, fp, include_messages=True)
            )
        dict_peak, text = traced_delta(lambda: export_text(graph, include_messages=True))
    finally:
        tracemalloc.stop()
    assert path.read_text(encoding="ascii") == text, "streamed bytes differ from json.dumps"
    del text
    assert streamed_text(graph, path, False) == export_text(graph, False), (
        "streamed bytes differ from json.dumps (include_messages=False)"
    )
    largest = max(largest_get, largest_json)
    return {
        "retained_bytes": retained,
        "largest_turn_get_peak_bytes": largest_get,
        "largest_turn_get_node": largest_get_id,
        "largest_turn_json_bytes": largest_json,
        "largest_turn_json_node": largest_json_id,
        "largest_turn_bytes": largest,
        "stream_peak_bytes": stream_peak,
        "dict_export_peak_bytes": dict_peak,
        "stream_total_bytes": retained + stream_peak,
        "stream_bound_bytes": retained + STREAM_TURN_FACTOR * largest,
        "dict_total_bytes": retained + dict_peak,
    }


# --- report -----------------------------------------------------------------------------------


def profiles(graph: RolloutGraph, tmp: Path, top: int = 15) -> str:
    """cProfile of REPEAT saves (os.fsync real) and REPEAT loads, by internal time."""
    path = tmp / "profiled.rls"
    text = []
    for title, fn in (
        ("save", lambda: graph.save(path)),
        ("load", lambda: RolloutGraph.load(path)),
    ):
        graph.save(path)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(REPEAT):
            fn()
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
        text.append(f"\ncProfile: {REPEAT} x {title}, top {top} by internal time")
        lines = out.getvalue().splitlines()
        start = next(i for i, line in enumerate(lines) if "ncalls" in line)
        text.extend(line for line in lines[start:] if line.strip())
    return "\n".join(text)


def _mib(n: int) -> str:
    return f"{n / MiB:10.2f} MiB"


def _ms(s: float) -> str:
    return f"{1e3 * s:10.2f} ms"


def print_report(turns: int, sizes: dict, speed: dict, memory: dict) -> None:
    print(f"rollout_store file format, multimodal workload, {turns} turns\n")
    print_sizes(sizes)
    print_speed(speed)
    print_export_memory(memory)


def print_sizes(sizes: dict) -> None:
    print("File size")
    print(f"  unique content                      {_mib(sizes['unique_bytes'])}")
    print(
        f"  save() snapshot file                {_mib(sizes['file_bytes'])}"
        f"   {sizes['file_over_unique']:.4f}x unique"
    )
    print(
        f"  append-mode file (fsync=never)      {_mib(sizes['append_file_bytes'])}"
        f"   {sizes['append_over_unique']:.4f}x unique"
    )
    print(
        f"  plain JSON export with messages     {_mib(sizes['plain_export_bytes'])}"
        f"   {sizes['plain_over_file']:.1f}x the snapshot file"
    )


def print_speed(speed: dict) -> None:
    print(f"\nSpeed (best of {REPEAT}; floor: msgpack of the {speed['blobs']} unique blob strings)")
    print(f"  msgpack.packb(blobs)                {_ms(speed['packb_s'])}")
    print(
        f"  graph.save(path)                    {_ms(speed['save_s'])}"
        f"   {speed['save_over_packb']:.2f}x packb"
    )
    print(
        f"  graph.save(path), os.fsync no-op    {_ms(speed['save_no_fsync_s'])}"
        f"   {speed['save_no_fsync_over_packb']:.2f}x packb"
    )
    print(f"  msgpack.unpackb(packed)             {_ms(speed['unpackb_s'])}")
    print(
        f"  RolloutGraph.load(path)             {_ms(speed['load_s'])}"
        f"   {speed['load_over_unpackb']:.2f}x unpackb"
    )
    print("  floors with the file I/O that save and load cannot avoid (for context):")
    print(
        f"  packb + write to a new file         {_ms(speed['packb_write_s'])}"
        f"   save with os.fsync a no-op is {speed['save_no_fsync_over_packb_write']:.2f}x this"
    )
    print(
        f"  read the file + unpackb             {_ms(speed['read_unpackb_s'])}"
        f"   load is {speed['load_over_read_unpackb']:.2f}x this"
    )
    print(
        "  pure-Python floors of this format (labelled floors, not targets; see their docstrings):"
    )
    print(
        f"  framed save floor, records built    {_ms(speed['framed_save_floor_s'])}"
        f"   {speed['save_floor_over_packb_write']:.2f}x packb + write;"
        f" save (os.fsync a no-op) is {speed['save_no_fsync_over_save_floor']:.2f}x this"
    )
    print(
        f"  checked load floor, no turn built   {_ms(speed['checked_load_floor_s'])}"
        f"   {speed['load_floor_over_read_unpackb']:.2f}x read + unpackb;"
        f" load is {speed['load_over_load_floor']:.2f}x this"
    )
    print(
        "  (cases interleaved per round; gc.collect() before each; each save writes a new file,"
        "\n  the previous one unlinked untimed; os.fsync a no-op covers the file and its folder)"
    )


def print_export_memory(memory: dict) -> None:
    print("\nExport memory (tracemalloc; peaks are above the traced memory before the call)")
    print(f"  graph retained                      {_mib(memory['retained_bytes'])}")
    print(
        f"  largest turn, peak of graph.get()   {_mib(memory['largest_turn_get_peak_bytes'])}"
        f"   ({memory['largest_turn_get_node']})"
    )
    print(
        f"  largest turn, UTF-8 JSON of msgs    {_mib(memory['largest_turn_json_bytes'])}"
        f"   ({memory['largest_turn_json_node']})"
    )
    print(
        f"  write_session_json peak (binary)    {_mib(memory['stream_peak_bytes'])}"
        f"   retained + peak = {memory['stream_total_bytes'] / MiB:.2f} MiB"
    )
    print(
        f"  json.dumps(export_session()) peak   {_mib(memory['dict_export_peak_bytes'])}"
        f"   retained + peak = {memory['dict_total_bytes'] / MiB:.2f} MiB"
    )
    print(
        "\n  largest turn = the larger of the two measures above (strings are shared with the"
        "\n  blob table, so graph.get() alone allocates little; the JSON text of a turn cannot"
        "\n  share). The loaded graph's export and the streamed bytes equal json.dumps(...)."
    )


def print_file_checks(load_memory: dict, resync: dict) -> None:
    print("\nLoad memory (tracemalloc peak above the traced bytes before the call)")
    for name, m in load_memory.items():
        print(
            f"  {name:<11} file {_mib(m['file_bytes'])}, graph retains {_mib(m['retained_bytes'])}"
        )
        print(
            f"              verify peak {_mib(m['verify_peak_bytes'])}, load peak"
            f" {_mib(m['load_peak_bytes'])}; (peak - retained) / file:"
            f" verify {m['verify_over_file']:.2f}x, load {m['load_over_file']:.2f}x"
        )
    print(
        f"\nResync: verify() of a small log followed by damage (best of {REPEAT}, caches"
        " flushed before each run)"
    )
    for name in ("garbage", "torn_turn"):
        for damage in DAMAGE_SIZES:
            key = f"{name}_{damage >> 20}MiB"
            seconds, damaged = resync[f"{key}_s"], resync[f"{key}_damaged_bytes"]
            alone = resync[f"{key}_resync_s"]
            print(
                f"  {name:<10} {damaged / MiB:6.1f} MiB damaged  verify {_ms(seconds)}"
                f" {1e9 * seconds / damaged:5.2f} ns/byte;  resync {_ms(alone)}"
                f" {1e9 * alone / damaged:5.2f} ns/byte"
            )
        print(
            f"  {name:<10} time per byte, 32 MiB over 4 MiB: resync"
            f" {resync[f'{name}_resync_ratio']:.2f}, whole verify {resync[f'{name}_ratio']:.2f}"
        )
    print(
        "  (resync: framing.next_frame from the damaged frame over the file's bytes; verify also"
        "\n  reads the file, and a 32 MiB read takes fresh pages from the OS where 4 MiB reuses"
        "\n  the heap's)"
    )


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def check_targets(
    sizes: dict, speed: dict, memory: dict, load_memory: dict, resync: dict
) -> list[str]:
    lines = []
    ratio = sizes["file_over_unique"]
    ok = ratio <= MAX_FILE_OVER_UNIQUE
    lines.append(f"{_verdict(ok)}  snapshot file/unique {ratio:.4f} <= {MAX_FILE_OVER_UNIQUE}")
    ratio = speed["save_no_fsync_over_packb_write"]
    ok = ratio <= MAX_SAVE_OVER_PACKB_WRITE
    lines.append(
        f"{_verdict(ok)}  save (os.fsync a no-op) / (packb + write) {ratio:.2f}"
        f" <= {MAX_SAVE_OVER_PACKB_WRITE}"
    )
    ratio = speed["load_over_read_unpackb"]
    ok = ratio <= MAX_LOAD_OVER_READ_UNPACKB
    lines.append(
        f"{_verdict(ok)}  load / (read + unpackb) {ratio:.2f} <= {MAX_LOAD_OVER_READ_UNPACKB}"
    )
    for name, m in load_memory.items():
        for what in ("verify", "load"):
            ratio = m[f"{what}_over_file"]
            ok = ratio <= MAX_PEAK_OVER_FILE
            lines.append(
                f"{_verdict(ok)}  {what} peak - retained, {name} file: {ratio:.2f}x file"
                f" <= {MAX_PEAK_OVER_FILE}x"
            )
    for name in ("garbage", "torn_turn"):
        for what, label in (("_resync", "resync"), ("", "whole verify()")):
            ratio = resync[f"{name}{what}_ratio"]
            ok = ratio <= MAX_RESYNC_RATIO
            lines.append(
                f"{_verdict(ok)}  {label} over {name}: time per damaged byte 32 MiB / 4 MiB"
                f" {ratio:.2f} <= {MAX_RESYNC_RATIO}"
            )
    total, bound = memory["stream_total_bytes"], memory["stream_bound_bytes"]
    ok = total <= bound
    lines.append(
        f"{_verdict(ok)}  streaming export retained + peak {total / MiB:.2f} MiB <="
        f" retained + {STREAM_TURN_FACTOR} x largest turn {bound / MiB:.2f} MiB"
    )
    stream, whole = memory["stream_peak_bytes"], memory["dict_export_peak_bytes"]
    ok = stream < whole
    lines.append(
        f"{_verdict(ok)}  streaming export peak {stream / MiB:.2f} MiB <"
        f" dict export peak {whole / MiB:.2f} MiB"
    )
    return lines


STEPS = (
    "unique content",
    "record graph",
    "file sizes",
    "save/load speed",
    "export memory",
    "load memory",
    "resync",
)


def measure_all(texts: list[str], profile: bool) -> dict:
    """Every measurement of the report, by section (and the profile text, or None)."""
    out: dict[str, Any] = {}
    with tqdm(total=len(STEPS), file=sys.stderr, unit="step", dynamic_ncols=True) as bar:

        def step(name: str) -> None:
            bar.update(name != STEPS[0])
            bar.set_description(name)

        step(STEPS[0])
        unique = unique_content_bytes(json.loads(text) for text in texts)
        step(STEPS[1])
        recorder, retained = record_traced(RolloutStoreRecorder, texts, [len(texts)])
        graph = recorder.graph
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            step(STEPS[2])
            out["sizes"] = measure_sizes(graph, texts, unique, tmp)
            step(STEPS[3])
            out["speed"] = measure_speed(graph, tmp)
            step(STEPS[4])
            out["memory"] = measure_memory(graph, retained[len(texts)], tmp)
            step(STEPS[5])
            out["load_memory"] = measure_load_memory(graph, tmp)
            step(STEPS[6])
            out["resync"] = measure_resync(tmp)
            bar.update()
            out["profile"] = profiles(graph, tmp) if profile else None
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    texts = list(iter_texts(multimodal, args.turns))
    m = measure_all(texts, args.profile)
    sizes, speed, memory = m["sizes"], m["speed"], m["memory"]
    load_memory, resync = m["load_memory"], m["resync"]
    print_report(args.turns, sizes, speed, memory)
    print_file_checks(load_memory, resync)
    checks = check_targets(sizes, speed, memory, load_memory, resync)
    print("\nTargets:")
    for line in checks:
        print("  " + line)
    if m["profile"]:
        print(m["profile"])
    report = {
        "commit": library_commit(),
        "workload": "multimodal",
        "turns": args.turns,
        "repeat": REPEAT,
        "sizes": sizes,
        "speed": speed,
        "memory": memory,
        "load_memory": load_memory,
        "resync": resync,
        "checks": checks,
    }
    path = results_dir(args.update_results) / "file_format.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {shown(path)}")
    print(targets_summary(checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The `rollout-store` command: inspect, verify, export, recover, repair and view rollout files.

Every command that reads a file tells a missing, an empty, a foreign (not a rollout file) and
a damaged file apart, and for a damaged one says whether `repair` (cut a torn last record off
a log in place) or `recover` (save every intact turn, before and after the damage, to a new
file) applies; `repair --rewrite` rewrites a file damaged before intact records in place,
with every intact turn. A file saved with its long strings in a content store
(`save(path, blobs="store")`) is read with `--store NAME`, the names `serve --store` takes;
the store is only read (a mistyped directory is not created), and one that lacks an object
the file names is reported as likely the wrong store, the file as intact. Every message about
a file starts with `rollout-store: FILE:`; `info` shows sizes for a reader (`--json`: exact
byte counts). Exit status: 0 done, 1 a file problem, 2 a usage error (an unknown option or
choice, with the valid ones listed). A reader closing the pipe
(`rollout-store export f.rls | head`) ends the command quietly with status 0.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from . import __version__
from .errors import (
    CorruptFileError,
    IndexKeyMismatch,
    IndexKeyRecomputeError,
    MissingStoreObjectError,
    RolloutStoreError,
    StoreRequiredError,
)
from .export.document import CAPTURE_LEVELS, write_session_json, write_trace_jsonl
from .export.figures import plain_export_bytes, store_figures
from .files import storage
from .files.atomic import create_private
from .files.storage import RolloutGraph
from .stores.content import ContentStore
from .stores.local import STORE_HELP, open_store, store_spec

__all__ = ["main"]

#: What the magic of every format version starts with.
_MAGIC_PREFIX = storage.MAGIC[:-1]  # (less its version byte)
#: Files at least this large get a progress bar when stderr is a terminal.
PROGRESS_MIN_BYTES = 32 << 20


class CommandError(Exception):
    """What stops a command (a file it cannot use, a busy port): the one-line message."""


@contextlib.contextmanager
def _progress(path: str, force: bool | None) -> Iterator[Callable[[int], None] | None]:
    size = os.path.getsize(path)
    show = force if force is not None else (size >= PROGRESS_MIN_BYTES and sys.stderr.isatty())
    if not show:
        yield None
        return
    from tqdm import tqdm  # a dependency of the package; imported only when a bar is drawn

    with tqdm(total=size, unit="B", unit_scale=True, desc="reading", file=sys.stderr) as bar:

        def update(offset: int) -> None:
            bar.update(offset - bar.n)

        yield update


def _check_file(path: str) -> int:
    """The file's size, or `CommandError` for a missing, empty or foreign file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fp:
            head = fp.read(len(storage.MAGIC))
    except FileNotFoundError:
        raise CommandError("no such file") from None
    except IsADirectoryError:
        raise CommandError("is a directory, not a rollout file") from None
    if size == 0:
        raise CommandError(
            "empty file (0 bytes): nothing was ever written to it, there is nothing to read"
        )
    if not head.strip(b"\0") and not _read_all(path).strip(b"\0"):
        raise CommandError(
            f"holds only zero bytes ({size}): nothing was written before a crash, there is "
            "nothing to read or recover"
        )
    # every version's magic starts alike; a cut inside the magic is damage, not a foreign file
    if not (head.startswith(_MAGIC_PREFIX) or _MAGIC_PREFIX.startswith(head)):
        guess = ""
        if head.lstrip()[:1] in (b"{", b"["):
            guess = " (it looks like JSON: an export is not read back; give the .rls file)"
        magic = _MAGIC_PREFIX.decode("ascii")
        raise CommandError(
            f"not a rollout_store file: it does not start with the {magic} magic{guess}"
        )
    return size


def _read_all(path: str) -> bytes:
    with open(path, "rb") as fp:
        return fp.read()


def _damage_advice(path: str, store: ContentStore | None) -> str:
    """What to do about a damaged file: which of `repair` and `recover` applies."""
    report = storage.verify(path, store=store)
    return _where_next(report) + _what_applies(report, path)


def _where_next(report: storage.LoadReport) -> str:
    if report.truncated or report.resync_offset is None:
        return ""
    # recover keeps only what precedes the damage: turns after it refer to what it lost
    return (
        f"the next intact frame starts at offset {report.resync_offset}, but no turn from "
        "there on can be kept (each refers to records the damage took); "
    )


def _what_applies(report: storage.LoadReport, path: str) -> str:
    if isinstance(report.exception, IndexKeyMismatch):
        return (
            f"the content is intact: `rollout-store recover {path} -o OUT` writes every turn "
            "before any later damage (verify stops here) to a new file with its index keys "
            "recomputed"
        )
    if isinstance(report.exception, IndexKeyRecomputeError):
        return (
            f"the content is intact: `rollout-store recover {path} -o OUT` writes every turn "
            "before any later damage (verify stops here) to a new file, this one under the "
            "index keys its record names"
        )
    after = not report.truncated and report.resync_offset is not None  # (version 2)
    if report.turns == 0 and not (report.truncated and report.mode == "log") and not after:
        return "no complete turn precedes the damage: nothing can be recovered"
    keep = f"the {report.turns} complete turn{'s' if report.turns != 1 else ''} before it"
    recover = f"`rollout-store recover {path} -o OUT` saves {keep} to a new file"
    if after:
        recover += ", with every intact turn after it"
    if report.truncated and report.mode == "log":
        # repair cuts back to the end of the last complete turn: the torn record and the
        # records of its unfinished turn before it
        cut = report.file_size - report.good_bytes
        return (
            f"a torn tail (a crash while writing): `rollout-store repair {path}` cuts its "
            f"last {_plural(cut, 'byte')} (from offset {report.good_bytes}, the end of the "
            f"last complete turn) in place and keeps {keep}; or {recover}"
        )
    why = "the file is a snapshot" if report.mode == "snapshot" else "intact records follow it"
    rewrite = f"`rollout-store repair --rewrite {path}` rewrites it in place with them"
    return f"{recover} (repair does not apply: {why}; {rewrite})"


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _file_store(args: argparse.Namespace) -> ContentStore | None:
    """The `--store` given, if the file keeps its long strings in a store; else None, so a
    self-contained file is read as it is and nothing is put into the store named."""
    store: ContentStore | None = args.content_store
    if store is None:
        return None
    return store if storage.needs_store(args.file) else None


def _not_found(args: argparse.Namespace, exc: MissingStoreObjectError) -> str:
    key = (exc.key or b"").hex()
    return (
        f"object {key} not found in store {args.store} (is it the right store?); the file "
        f"is intact: its blob record {exc.record} (offset {exc.offset}) names that key: pass "
        "the --store the file was saved with"
    )


def _load(args: argparse.Namespace, *, recover: bool = False) -> RolloutGraph:
    path = args.file
    _check_file(path)
    store = _file_store(args)
    try:
        with _progress(path, args.progress) as update:
            return storage.load(path, recover=recover, progress=update, store=store)
    except MissingStoreObjectError as exc:
        raise CommandError(_not_found(args, exc)) from None
    except CorruptFileError as exc:
        raise CommandError(f"damaged: {exc}; {_damage_advice(path, store)}") from None


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.1f}x" if b else "-"


def human_bytes(n: int) -> str:
    """`n` bytes for a reader: 812 B, 20.3 KiB, 1.45 MiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{n} B"
    return f"{value:.{1 if value >= 10 else 2}f} {unit}"


def _info(args: argparse.Namespace) -> int:
    graph = _load(args)
    figures = store_figures(graph)
    size = os.path.getsize(args.file)
    export = plain_export_bytes(graph)
    version = graph.load_report.version if graph.load_report else None
    if args.json:
        document = {
            "file": args.file,
            "format_version": version,
            **{k: figures[k] for k in ("turns", "roots", "leaves", "forks", "discarded")},
            "bytes_received": export,
            "bytes_stored": size,
            "unique_blob_bytes": figures["unique_blob_bytes"],
            "blob_bytes_sent": figures["blob_bytes_sent"],
            "tokens_received": figures["tokens_received"],
            "tokens_stored": figures["tokens_stored"],
        }
        timelines = list(graph.timelines().values())
        if timelines:
            engine = [t.engine for t in timelines]
            gaps = [t.gap_before for t in timelines if t.gap_before is not None]
            document["timing_us"] = {
                "calls": len(timelines),
                "engine_p50": _percentile(engine, 0.5),
                "engine_p99": _percentile(engine, 0.99),
                "engine_total": sum(engine),
                "tools_p50": _percentile(gaps, 0.5) if gaps else None,
                "tools_p99": _percentile(gaps, 0.99) if gaps else None,
                "tools_total": sum(gaps),
                "failed_attempts": sum(t.failed_attempts for t in timelines),
            }
        print(json.dumps(document, indent=2))
        return 0
    # sizes for a reader, each followed by its exact count of bytes
    lines = [
        ("file", args.file),
        ("format version", "-" if version is None else version),
        ("turns", figures["turns"]),
        ("roots", figures["roots"]),
        ("leaves", figures["leaves"]),
        ("forks", figures["forks"]),
        ("discarded", figures["discarded"]),
        ("bytes received (plain export)", _size(export)),
        ("bytes stored (this file)", _size(size)),
        ("saving over the plain export", _ratio(export, size)),
        ("long strings sent (each request whole)", _size(figures["blob_bytes_sent"])),
        ("long strings stored (unique)", _size(figures["unique_blob_bytes"])),
        ("tokens received", figures["tokens_received"]),
        ("tokens stored", figures["tokens_stored"]),
    ]
    drift = graph.drift()
    if drift:  # the drift audit: continuations by messages whose token ids do not extend
        first = drift[0]
        where = (
            f"message {first['message_index']}"
            if first["message_index"] is not None
            else f"the prompt of {first['parent_messages']} messages"
        )
        lines.append(
            (
                "token drift (roots)",
                f"{len(drift)}: first {first['node_id']} leaves {first['would_be_parent']} "
                f"at token {first['offset']} ({where})",
            )
        )
    timelines = list(graph.timelines().values())
    if timelines:  # where the time went: the engine's, and the agent's between calls
        lines += _timing_lines(timelines)
    meta = graph.meta
    if not meta.empty:
        lines += [
            ("group", meta.group if meta.group is not None else "-"),
            ("labels", ", ".join(meta.labels) or "-"),
            ("reward", meta.reward if meta.reward is not None else "-"),
            ("leaf rewards", len(meta.leaf_rewards)),
        ]
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        print(f"{name:<{width}}  {value}")
    return 0


def _percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(us: int) -> str:
    return f"{us / 1000:.1f} ms"


def _timing_lines(timelines: list[Any]) -> list[tuple[str, Any]]:
    """`info`'s summary of the calls' timelines: engine time (request sent upstream to its
    last byte) and the time between calls spent by the agent and its tools."""
    engine = [t.engine for t in timelines]
    gaps = [t.gap_before for t in timelines if t.gap_before is not None]
    overhead = [t.reply_sent - t.engine for t in timelines]
    lines: list[tuple[str, Any]] = [
        ("timed calls", len(timelines)),
        (
            "engine time p50 / p99",
            f"{_ms(_percentile(engine, 0.5))} / {_ms(_percentile(engine, 0.99))}",
        ),
        ("engine time total", _ms(sum(engine))),
        ("server time p50 (not engine)", _ms(_percentile(overhead, 0.5))),
    ]
    if gaps:
        lines += [
            (
                "tools time p50 / p99",
                f"{_ms(_percentile(gaps, 0.5))} / {_ms(_percentile(gaps, 0.99))}",
            ),
            ("tools time total", _ms(sum(gaps))),
        ]
    failed = sum(t.failed_attempts for t in timelines)
    if failed:
        lines.append(("failed upstream attempts", failed))
    return lines


def _bytes(n: int) -> str:
    """`n` bytes for a reader, with the exact count when it is rounded."""
    return f"{n} bytes" if n < 1024 else f"{human_bytes(n)} ({n} bytes)"


def _size(n: int) -> str:
    return f"{human_bytes(n):>10}  {n}"


def _verify(args: argparse.Namespace) -> int:
    _check_file(args.file)
    store = _file_store(args)
    with _progress(args.file, args.progress) as update:
        report = storage.verify(args.file, progress=update, store=store)
    if report.ok:
        print(
            f"ok: format version {report.version}, {_plural(report.records, 'record')}, "
            f"{_plural(report.turns, 'turn')}, {_plural(report.blobs, 'blob')}, "
            f"{_bytes(report.file_size)} verified"
        )
        return 0
    if isinstance(report.exception, MissingStoreObjectError):
        raise CommandError(_not_found(args, report.exception))
    raise CommandError(f"damaged: {report.error}; {_damage_advice(args.file, store)}")


def _export(args: argparse.Namespace) -> int:
    graph = _load(args)
    out: IO[Any]
    with contextlib.ExitStack() as stack:
        if args.output in (None, "-"):
            out = sys.stdout
        else:
            # 0600, as every file the library writes: an export holds the content
            fd = create_private(args.output, os.O_WRONLY | os.O_TRUNC)
            out = stack.enter_context(os.fdopen(fd, "w", encoding="ascii"))
        if args.jsonl:
            write_trace_jsonl(graph, out)
        else:
            write_session_json(
                graph,
                out,
                session_id=args.session_id,
                include_messages=args.messages,
                include_discarded=args.discarded,
                capture_level=args.capture_level,
            )
            out.write("\n")
    return 0


def _samples(args: argparse.Namespace) -> int:
    """Training rows of every FILE, written as they are made (see `rows`, `row_files`)."""
    from .export.row_files import write_rows
    from .export.rows import iter_token_samples, iter_tree_samples

    if args.group and args.format != "tree":
        raise CommandError("--group packs a forest: it goes with --format tree")
    store = args.content_store
    for path in args.files:
        try:
            _check_file(path)
        except CommandError as exc:  # (several files: which one)
            raise CommandError(f"{path}: {exc}") from None

    def load(path: str) -> RolloutGraph:
        try:
            return storage.load(path, store=store)
        except CorruptFileError as exc:
            raise CommandError(f"{path}: damaged: {exc}; {_damage_advice(path, store)}") from None

    def rows() -> Iterator[dict[str, Any]]:
        if args.group:  # one forest per group id (files without one: one forest of them)
            groups: dict[str | None, list[RolloutGraph]] = {}
            for path in args.files:
                graph = load(path)
                groups.setdefault(graph.group, []).append(graph)
            for graphs in groups.values():
                yield from iter_tree_samples(graphs)
            return
        for path in args.files:  # one file in memory at a time
            graph = load(path)
            yield from (
                iter_token_samples(graph) if args.format == "path" else iter_tree_samples(graph)
            )

    n = write_rows(rows(), args.output, args.format)
    print(f"wrote {n} {args.format} row(s) to {args.output}")
    return 0


def _recover(args: argparse.Namespace) -> int:
    if os.path.abspath(args.output) == os.path.abspath(args.file):
        raise CommandError("-o must name a new file: recover never writes over its input")
    graph = _load(args, recover=True)
    report = graph.load_report
    if report is not None and isinstance(report.exception, MissingStoreObjectError):
        raise CommandError(_not_found(args, report.exception))  # the file is not damaged
    if not len(graph) and report is not None and not report.ok:
        raise CommandError(
            f"damaged: {report.error}; no intact turn to keep{_losses(report)}, nothing written"
        )
    graph.save(args.output)
    said = _recovered(args.file, len(graph), report)
    if said is None:
        print(
            f"{args.file} is not damaged; wrote a snapshot of its {len(graph)} turns "
            f"to {args.output}"
        )
    else:
        print(f"{said}; wrote {args.output}")
    return 0


def _recovered(path: str, kept: int, report: storage.LoadReport | None) -> str | None:
    """What a recovering read kept, lost and dropped, in one line (None: the file is whole
    and nothing was rekeyed)."""
    rekeyed = report.keys_recomputed if report is not None else 0
    unkeyed = report.unkeyed if report is not None else []
    keys = ""
    if rekeyed:
        keys = f"; {rekeyed} of them with their index keys recomputed (their records named others)"
    if unkeyed:
        names = ", ".join(u.node_id for u in unkeyed[:5]) + (", ..." if len(unkeyed) > 5 else "")
        keys += (
            f"; {len(unkeyed)} of them ({names}) kept under the index keys their records name, "
            f"which could not be recomputed ({unkeyed[0].cause})"
        )
    if report is not None and not report.ok:
        before = report.turns_before_damage
        if kept == before:
            return (
                f"recovered {kept} turns from before the damage at offset "
                f"{report.error_offset} ({report.error}){keys}{_losses(report)}"
            )
        return (
            f"recovered {kept} turns, {before} from before the damage at offset "
            f"{report.error_offset} ({report.error}) and {kept - before} after it"
            f"{keys}{_losses(report)}"
        )
    if keys:
        return f"recovered all {kept} turns of {path}{keys}"
    return None


def _losses(report: storage.LoadReport) -> str:
    """The damaged stretches read past, the turns lost in them and those dropped."""
    if not report.damaged:
        return ""
    n = len(report.damaged)
    lost = "an unknown number of" if report.lost_unknown else str(report.lost_turns)
    records = "record" if lost == "1" else "records"
    text = f"; read past {n} damaged stretch{'es' if n != 1 else ''} ({lost} turn {records} lost)"
    if report.meta_records_lost:
        text += (
            "; the graph's metadata record was lost there (its labels, annotations, rewards "
            "and group as it set them)"
        )
    if report.timeline_records_lost:
        text += f"; {_plural(report.timeline_records_lost, 'timeline record')} lost there"
    dropped = report.dropped
    if dropped:
        names = ", ".join(str(d.node_id) for d in dropped[:5]) + (
            ", ..." if len(dropped) > 5 else ""
        )
        text += (
            f"; dropped {len(dropped)} intact turn{'s' if len(dropped) != 1 else ''} whose "
            f"parent, base, tokens, values or blobs were lost ({names})"
        )
    return text


def _repair(args: argparse.Namespace) -> int:
    _check_file(args.file)
    store = _file_store(args)
    report = storage.verify(args.file, store=store)
    if report.ok:
        print(f"{args.file} is not damaged: {_plural(report.turns, 'turn')}, nothing to repair")
        return 0
    if isinstance(report.exception, MissingStoreObjectError):
        raise CommandError(_not_found(args, report.exception))
    if args.rewrite and not (report.mode == "log" and report.truncated):
        kept = storage.rewrite_intact(args.file, store=store)
        said = _recovered(args.file, kept.turns, kept) or f"{kept.turns} turns"
        print(f"rewrote {args.file} in place: {said.replace('recovered', 'kept', 1)}")
        return 0
    if report.mode != "log" or not report.truncated:
        raise CommandError(f"damaged: {report.error}; {_damage_advice(args.file, store)}")
    before = report.file_size
    graph = RolloutGraph.open(args.file, repair=True, store=store)
    try:
        turns = len(graph)
    finally:
        graph.close()
    after = os.path.getsize(args.file)
    print(
        f"repaired {args.file}: cut its last {_plural(before - after, 'byte')} (a torn last "
        f"record and the rest of its unfinished turn), {_plural(turns, 'turn')} kept"
    )
    return 0


def _view(args: argparse.Namespace) -> int:
    from .viewer.app import Viewer, serve

    graph = _load(args)
    viewer = Viewer(graph, title=os.path.basename(args.file), file_size=os.path.getsize(args.file))
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(serve(viewer, port=args.port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            message = f"port {args.port} is in use: pass --port N (0: any free port)"
            raise CommandError(message) from None
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        print(f"viewing {args.file} at {url} (Ctrl-C to stop)", flush=True)
        if args.open:
            import webbrowser

            webbrowser.open(url)
        with contextlib.suppress(KeyboardInterrupt):
            while True:  # the server answers in its own thread until Ctrl-C
                time.sleep(3600)
    return 0


def _serve(args: argparse.Namespace) -> int:
    try:
        from .serve import server
    except ImportError as exc:
        print(f"rollout-store serve needs the server extra ({exc})", file=sys.stderr)
        return 1

    return server.main(args.serve_args)


_PROGRESS_HELP = (
    "draw a progress bar on stderr while reading the file (default: only for files of "
    f"{PROGRESS_MIN_BYTES >> 20} MiB or more when stderr is a terminal)"
)


def _run_command(args: argparse.Namespace) -> int:
    from .serve.capture import Capture, CaptureError

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise CommandError("run: name the command to run after --, e.g. -- python agent.py")
    local = args.server is None
    if not local and args.data is not None:
        raise CommandError("run: --data is for a server started for the run (--upstream)")
    started = Capture(
        server=args.server,
        upstream=args.upstream,
        data=(args.data or "rollouts") if local else None,
        labels=args.label,
        group=args.group,
        session_id=args.session_id,
        admin_key=(args.admin_key or os.environ.get("ROLLOUT_STORE_ADMIN_KEY")) if local else None,
    )
    try:
        started.start()
    except (CaptureError, OSError) as exc:
        raise CommandError(f"run: {exc}") from None
    try:
        code = _run_child(cmd, {**os.environ, **started.env()})
    finally:
        started.close()
    _say_where(started, args)
    return code


def _run_child(cmd: list[str], env: dict[str, str]) -> int:
    """Run `cmd`, forwarding SIGINT and SIGTERM to it; its exit status, as a shell gives it
    (128 + N when signal N ended it; 127 when it cannot be started)."""
    import signal
    import subprocess

    try:
        child = subprocess.Popen(cmd, env=env)
    except OSError as exc:
        print(f"rollout-store run: {cmd[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 127

    def forward(signum: int, frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def _say_where(run: Any, args: argparse.Namespace) -> None:
    """Where the rollout is: the session, its file (or server) and how to export it."""
    turns = "? turns"
    with contextlib.suppress(RolloutStoreError):
        turns = _plural(len(run.export().get("turns", [])), "turn")
    if run.log_path is not None:
        path = os.path.relpath(run.log_path)
        lines = [
            f"rollout-store run: session {run.session_id} ({turns}) in {path}",
            f"  export: rollout-store export {path}",
            f"  view:   rollout-store view {path}",
        ]
    else:
        lines = [
            f"rollout-store run: session {run.session_id} ({turns}) on {run.server_url}",
            f"  export: curl -H 'Authorization: Bearer {run.api_key}' "
            f"{run.server_url}/sessions/{run.session_id}/export",
        ]
    print("\n".join(lines), file=sys.stderr, flush=True)


def _progress_options(parser: argparse.ArgumentParser, default: Any) -> None:
    bar = parser.add_mutually_exclusive_group()
    bar.add_argument(
        "--progress", dest="progress", action="store_true", default=default, help=_PROGRESS_HELP
    )
    bar.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        default=default,
        help="never draw a progress bar",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-store",
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog="--progress and --no-progress go before or after the command.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _progress_options(parser, None)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str, help: str, run: Callable[[argparse.Namespace], int]
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.add_argument(
            "file", metavar="FILE", help="a rollout file (.rls) written by save() or open()"
        )
        _progress_options(sub, argparse.SUPPRESS)  # keeps a value given before the command
        sub.add_argument(
            "--store",
            type=store_spec,
            default=None,
            metavar="NAME",
            help="the content store a file saved with blobs='store' keeps its long strings "
            f"in: {STORE_HELP} (as for serve --store)",
        )
        sub.set_defaults(run=run)
        return sub

    info = command("info", "turns, structure, bytes received against stored, and the saving", _info)
    info.add_argument(
        "--json", action="store_true", help="the figures as JSON, sizes as exact byte counts"
    )
    command(
        "verify",
        "check every record, blob digest and index key; exit 1 and the reason if damaged",
        _verify,
    )
    export = command("export", "the session as JSON (default) or the trace as JSONL", _export)
    export.add_argument(
        "--messages",
        action="store_true",
        help="include each turn's request messages, tools and response message (default: ids, "
        "links, token counts, sampling parameters and training sequences only)",
    )
    export.add_argument(
        "--discarded", action="store_true", help="include turns discarded as retries, flagged"
    )
    export.add_argument(
        "--jsonl",
        action="store_true",
        help="one JSON line per turn with everything recorded (messages, tokens, logprobs)",
    )
    export.add_argument("--session-id", default=None, help="the session_id field of the JSON")
    export.add_argument(
        "--capture-level",
        default=None,
        choices=CAPTURE_LEVELS,
        help='what the engine returned: "tokens" (trainable) or lower ("logprobs", "text", '
        '"messages"); default: what the file holds ("tokens" when some turn has token ids)',
    )
    export.add_argument("-o", "--output", default=None, help="output file (default: stdout)")
    recover = command(
        "recover",
        "save every intact turn of FILE (before and after damage) to a new file OUT",
        _recover,
    )
    recover.add_argument("-o", "--output", required=True, metavar="OUT", help="the new file")
    repair = command(
        "repair", "cut a torn last record (a crash while appending) off a log, in place", _repair
    )
    repair.add_argument(
        "--rewrite",
        action="store_true",
        help="for damage followed by intact records: rewrite FILE in place with every intact "
        "turn (what recover keeps; the damaged bytes are dropped)",
    )
    samples = commands.add_parser(
        "samples",
        help="training rows of one or many files: per path or tree-packed, to Parquet or JSONL",
        description="Training rows of every FILE (see rollout_store.export.rows): one per "
        "root-to-leaf path (--format path) or tree-packed, each token once (--format tree).",
    )
    samples.add_argument("files", nargs="+", metavar="FILE", help="rollout files (.rls)")
    samples.add_argument(
        "--format",
        choices=("path", "tree"),
        default="path",
        help="path: one row per root-to-leaf path; tree: one row per trajectory (default: path)",
    )
    samples.add_argument(
        "--group",
        action="store_true",
        help="with --format tree: pack the files of one group id as one forest row",
    )
    samples.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT",
        help="the output file: OUT.parquet (needs pyarrow) or OUT.jsonl",
    )
    samples.add_argument(
        "--store",
        type=store_spec,
        default=None,
        metavar="NAME",
        help=f"content store: {STORE_HELP}",
    )
    _progress_options(samples, argparse.SUPPRESS)
    samples.set_defaults(run=_samples)
    view = command("view", "show the rollout in a web page on 127.0.0.1", _view)
    view.add_argument(
        "--port", type=int, default=8000, help="port to serve on (default 8000; 0: any free port)"
    )
    view.add_argument("--open", action="store_true", help="open the page in the default browser")
    run = commands.add_parser(
        "run",
        help="record a command's model calls: run CMD with its SDKs pointed at a new session",
        description="Run CMD with OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL and "
        "ANTHROPIC_API_KEY set to a new capture session: on the server named (--server), or "
        "on one started for the run (--upstream, logs in --data). Exits with CMD's status "
        "(128 + N when signal N ended it) and says where the rollout is.",
        usage="rollout-store run [--server URL | --upstream URL [--data DIR]] [--label L]... "
        "[--group G] [--admin-key K] -- CMD [ARGS...]",
    )
    where = run.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", default=None, help="URL of a running capture server")
    where.add_argument(
        "--upstream", default=None, help="the engine's URL, for a server started for the run"
    )
    run.add_argument(
        "--data",
        default=None,
        help="with --upstream: the directory of session logs (default: ./rollouts)",
    )
    run.add_argument(
        "--label", action="append", default=[], metavar="L", help="a label (repeatable)"
    )
    run.add_argument("--group", default=None, help="the group id (a GRPO group, say)")
    run.add_argument("--session-id", default=None, help="the session's id (default: minted)")
    run.add_argument(
        "--admin-key",
        default=None,
        help="with --upstream: the started server's admin key (default: "
        "$ROLLOUT_STORE_ADMIN_KEY, else a random one)",
    )
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]")
    run.set_defaults(run=_run_command)
    # the capture server parses its own options (it needs the server extra installed)
    serve = commands.add_parser(
        "serve", help="record agent traffic: see `serve --help`", add_help=False
    )
    serve.set_defaults(run=_serve, serve_args=[])
    return parser


def _run(args: argparse.Namespace) -> int:
    try:
        spec = getattr(args, "store", None)
        args.content_store = open_store(spec, readonly=True) if spec is not None else None
        return int(args.run(args))
    except StoreRequiredError:
        message = "keeps its long strings in a content store: pass --store NAME"
        print(f"rollout-store: {_where(args)}{message} ({STORE_HELP})", file=sys.stderr)
        return 1
    except (CommandError, RolloutStoreError) as exc:  # a file problem, a lock held elsewhere...
        print(f"rollout-store: {_where(args)}{exc}", file=sys.stderr)
        return 1


def _where(args: argparse.Namespace) -> str:
    """The file a message is about, as a prefix (commands without a file have none)."""
    file = getattr(args, "file", None)
    return f"{file}: " if file else ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "serve":
        args.serve_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        code = _run(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader closed the pipe (`| head`): what it wanted was written. Point stdout at
        # /dev/null so the interpreter's last flush does not fail again, and end quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else _where(args)
        print(f"rollout-store: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

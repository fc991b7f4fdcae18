"""The `rollout-store` command: inspect, verify and export rollout files.

`info FILE`, `verify FILE`, `export FILE [--messages] [--jsonl] [-o OUT]` and
`serve --upstream URL ...` (the capture server, `rollout_store.server`). A damaged file
gives exit status 1 and a one-line reason on stderr; a progress bar shows on stderr for long
files when tqdm is installed and stderr is a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from . import storage
from .errors import CorruptFileError
from .export import write_session_json, write_trace_jsonl
from .storage import RolloutGraph

__all__ = ["main"]

#: Files at least this large get a progress bar.
PROGRESS_MIN_BYTES = 32 << 20


@contextlib.contextmanager
def _progress(path: str, force: bool | None) -> Iterator[Callable[[int], None] | None]:
    size = os.path.getsize(path)
    show = force if force is not None else (size >= PROGRESS_MIN_BYTES and sys.stderr.isatty())
    if not show:
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a nicety; the command works without it
        yield None
        return
    with tqdm(total=size, unit="B", unit_scale=True, desc="reading", file=sys.stderr) as bar:

        def update(offset: int) -> None:
            bar.update(offset - bar.n)

        yield update


def _load(path: str, progress: bool | None) -> RolloutGraph:
    with _progress(path, progress) as update:
        return storage.load(path, progress=update)


def _info(args: argparse.Namespace) -> int:
    graph = _load(args.file, args.progress)
    stats = graph.stats()
    size = os.path.getsize(args.file)
    received = stats["blob_bytes"] + stats["blob_bytes_saved"]
    lines = [
        ("file", args.file),
        ("file bytes", size),
        ("format version", graph.load_report.version if graph.load_report else "-"),
        ("turns", stats["n_turns"]),
        ("roots", stats["n_roots"]),
        ("leaves", stats["n_leaves"]),
        ("forks", stats["n_forks"]),
        ("discarded", stats["n_discarded"]),
        ("blobs", stats["blobs"]),
        ("blob bytes", stats["blob_bytes"]),
        ("blob references", stats["blob_references"]),
        ("message bytes stored", stats["message_bytes_stored"]),
        ("tokens received", stats["tokens_received"]),
        ("tokens stored", stats["tokens_stored"]),
        (
            "dedup ratio (long strings)",
            f"{received / stats['blob_bytes']:.2f}x" if received else "-",
        ),
    ]
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        print(f"{name:<{width}}  {value}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    with _progress(args.file, args.progress) as update:
        report = storage.verify(args.file, progress=update)
    if report.ok:
        print(
            f"ok: format version {report.version}, {report.records} records, {report.turns} "
            f"turns, {report.blobs} blobs, {report.file_size} bytes verified"
        )
        return 0
    if report.truncated:
        after = "; a torn tail: nothing intact follows it (open with repair=True cuts it off)"
    elif report.resync_offset is not None:
        after = f"; the next intact frame starts at offset {report.resync_offset}"
    else:
        after = ""
    print(f"damaged: {report.error}{after}", file=sys.stderr)
    return 1


def _export(args: argparse.Namespace) -> int:
    graph = _load(args.file, args.progress)
    out: IO[Any]
    with contextlib.ExitStack() as stack:
        if args.output in (None, "-"):
            out = sys.stdout
        else:
            out = stack.enter_context(open(args.output, "w", encoding="ascii"))
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


def _serve(args: argparse.Namespace) -> int:
    try:
        from . import server
    except ImportError as exc:
        print(f"rollout-store serve needs the server extra ({exc})", file=sys.stderr)
        return 1

    return server.main(args.serve_args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-store", description=__doc__.splitlines()[0])
    bar = parser.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None)
    bar.add_argument("--no-progress", dest="progress", action="store_false")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="turns, roots, leaves, blobs, bytes, dedup ratio")
    info.add_argument("file")
    info.set_defaults(run=_info)
    verify = commands.add_parser("verify", help="check every record and blob digest")
    verify.add_argument("file")
    verify.set_defaults(run=_verify)
    export = commands.add_parser("export", help="the session as JSON, or the trace as JSONL")
    export.add_argument("file")
    export.add_argument("--messages", action="store_true", help="include request messages")
    export.add_argument("--discarded", action="store_true", help="include discarded turns")
    export.add_argument("--jsonl", action="store_true", help="one JSON line per turn")
    export.add_argument("--session-id", default=None)
    export.add_argument(
        "--capture-level",
        default="tokens",
        help='what the engine returned: "tokens" (trainable) or lower ("logprobs", "text")',
    )
    export.add_argument("-o", "--output", default=None, help="output file (default: stdout)")
    export.set_defaults(run=_export)
    # the capture server parses its own options (it needs the server extra installed)
    serve = commands.add_parser(
        "serve", help="record agent traffic: see `serve --help`", add_help=False
    )
    serve.set_defaults(run=_serve, serve_args=[])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "serve":
        args.serve_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return int(args.run(args))
    except CorruptFileError as exc:
        print(f"rollout-store: {args.file}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"rollout-store: {exc.filename or args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""Content store services on loopback ports of their own: a Redis server and moto's S3 server.

For trying the Redis and S3 stores on one machine, and what the test suite and the benchmarks
start when no service URL is given. `RedisServer(folder)` keeps an append-only file in
`folder` (its data survives a stop and a start); without a folder it keeps nothing on disk.
A server whose program is not installed, or that does not listen in time, raises
`StoreUnavailableError` saying how to install it. Of the package it imports only the error
tree; the servers are separate programs, started with `subprocess`.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from ..errors import StoreUnavailableError

__all__ = [
    "LoopbackServer",
    "MotoServer",
    "RedisServer",
    "free_port",
    "stop_process",
    "wait_for_port",
]

HOST = "127.0.0.1"


def stop_process(process: subprocess.Popen[Any], timeout: float = 10.0) -> int:
    """Stop `process`: SIGTERM, then SIGKILL if it has not exited within `timeout` seconds.
    Returns its exit status (at once if it had already exited)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)
    return process.returncode


def free_port() -> int:
    """A TCP port of the loopback interface that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout: float = 15.0) -> None:
    """Return once something accepts connections on the loopback `port`; raise
    `StoreUnavailableError` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((HOST, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise StoreUnavailableError(f"nothing listens on {HOST}:{port} after {timeout} s")


class LoopbackServer:
    """A server program of our own on a free loopback port: `start`, `stop`, `url`; also a
    context manager (started on entry, stopped on exit)."""

    #: How to install the program, for the error raised when it is missing.
    install = ""
    #: Seconds to wait for the port after starting.
    start_timeout = 15.0

    def __init__(self) -> None:
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        raise NotImplementedError

    def command(self) -> list[str]:
        """The program (a path) and its arguments."""
        raise NotImplementedError

    def start(self) -> None:
        argv = self.command()
        if not Path(argv[0]).exists():
            raise StoreUnavailableError(f"{Path(argv[0]).name} is not installed ({self.install})")
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_port(self.port, self.start_timeout)
        except StoreUnavailableError:
            self.stop()
            raise

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            stop_process(process)

    def __enter__(self) -> LoopbackServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


class RedisServer(LoopbackServer):
    """`redis-server` on a free loopback port (Debian: `apt-get install -y redis-server`)."""

    install = "apt-get install -y redis-server"

    def __init__(self, folder: str | Path | None = None) -> None:
        super().__init__()
        self.folder = Path(folder) if folder is not None else None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def command(self) -> list[str]:
        binary = shutil.which("redis-server") or "redis-server"
        argv = [binary, "--bind", HOST, "--port", str(self.port), "--save", ""]
        if self.folder is None:
            return [*argv, "--appendonly", "no"]
        return [*argv, "--dir", str(self.folder), "--appendonly", "yes", "--appendfsync", "always"]


class MotoServer(LoopbackServer):
    """moto's S3 server on a free loopback port (`pip install 'moto[s3]' flask flask-cors`)."""

    install = "pip install 'moto[s3]' flask flask-cors"
    start_timeout = 30.0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        binary = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
        return [binary, "-H", HOST, "-p", str(self.port)]

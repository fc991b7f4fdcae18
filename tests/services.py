"""Real services for the store tests: a Redis server and moto's S3 server on loopback.

CI (`.ci/run`) starts both and exports their URLs in ROLLOUT_STORE_REDIS_URL and
ROLLOUT_STORE_S3_URL; without them a fixture starts its own instance for the session. With
CI=true a service that cannot be reached or started fails the test, never skips it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"
S3_CREDENTIALS = {
    "aws_access_key_id": "test",
    "aws_secret_access_key": "test",
    "region_name": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def unavailable(what: str) -> None:
    """Fail under CI, skip elsewhere: `what` cannot be started here."""
    if IN_CI:
        pytest.fail(f"{what} (CI=true: a missing service is a failure)")
    pytest.skip(what)


class RedisServer:
    """A redis-server of the test's own on a loopback port, with an append-only file in
    `folder` so that its data survives a stop and start."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            unavailable("redis-server is not installed (apt-get install -y redis-server)")
        self.process = subprocess.Popen(
            [
                binary,  # type: ignore[list-item]
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                str(self.folder),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


class MotoServer:
    """moto's S3 server on a loopback port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        binary = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
        if not Path(binary).exists():
            unavailable("moto_server is not installed (pip install 'moto[server]')")
        self.process = subprocess.Popen(
            [binary, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port, timeout=30)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = os.environ.get("ROLLOUT_STORE_REDIS_URL")
    if url:
        yield url
        return
    if IN_CI:
        pytest.fail("CI=true but ROLLOUT_STORE_REDIS_URL is not set (.ci/run starts Redis)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_url() -> Iterator[str]:
    url = os.environ.get("ROLLOUT_STORE_S3_URL")
    if url:
        yield url
        return
    if IN_CI:
        pytest.fail("CI=true but ROLLOUT_STORE_S3_URL is not set (.ci/run starts moto_server)")
    server = MotoServer()
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis server this test starts, stops and restarts itself."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()

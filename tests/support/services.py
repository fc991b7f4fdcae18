"""Real services for the store tests: a Redis server and moto's S3 server on loopback.

CI (`.ci/run`) starts both and exports their URLs in ROLLOUT_STORE_REDIS_URL and
ROLLOUT_STORE_S3_URL; without them a fixture starts its own instance for the session
(`rollout_store.serve.loopback`, which the benchmarks use too). With CI=true a service that cannot
be reached or started fails the test, never skips it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from rollout_store import StoreUnavailableError
from rollout_store.serve.loopback import LoopbackServer, MotoServer, RedisServer, free_port

__all__ = ["IN_CI", "S3_CREDENTIALS", "RedisServer", "free_port", "started", "unavailable"]

IN_CI = os.environ.get("CI", "").lower() == "true"
S3_CREDENTIALS = {
    "aws_access_key_id": "test",
    "aws_secret_access_key": "test",
    "region_name": "us-east-1",
}


def unavailable(what: str) -> None:
    """Fail under CI, skip elsewhere: `what` cannot be started here."""
    if IN_CI:
        pytest.fail(f"{what} (CI=true: a missing service is a failure)")
    pytest.skip(what)


Server = TypeVar("Server", bound=LoopbackServer)


def started(server: Server) -> Server:
    """`server`, started; a server that cannot start fails (CI) or skips the test."""
    try:
        server.start()
    except StoreUnavailableError as exc:
        unavailable(str(exc))
    return server


def _service(env: str, make: type[LoopbackServer], *args: Path) -> Iterator[str]:
    url = os.environ.get(env)
    if url:
        yield url
        return
    if IN_CI:
        pytest.fail(f"CI=true but {env} is not set (.ci/run starts the store services)")
    server = started(make(*args))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _service("ROLLOUT_STORE_REDIS_URL", RedisServer, tmp_path_factory.mktemp("redis"))


@pytest.fixture(scope="session")
def s3_url() -> Iterator[str]:
    yield from _service("ROLLOUT_STORE_S3_URL", MotoServer)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis server this test starts, stops and restarts itself."""
    server = started(RedisServer(tmp_path))
    try:
        yield server
    finally:
        server.stop()

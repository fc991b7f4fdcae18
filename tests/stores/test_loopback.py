"""The loopback service launcher the tests and benchmarks share (`rollout_store.serve.loopback`)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from services import started

from rollout_store import RedisStore, StoreUnavailableError, content_key
from rollout_store.serve.loopback import MotoServer, RedisServer, free_port, wait_for_port


def test_a_missing_program_says_how_to_install_it(tmp_path: Path) -> None:
    class Missing(RedisServer):
        def command(self) -> list[str]:
            return [str(tmp_path / "redis-server"), "--port", str(self.port)]

    server = Missing()
    with pytest.raises(StoreUnavailableError, match=r"redis-server is not installed \(apt-get"):
        server.start()
    assert server.process is None
    server.stop()  # stopping what never started is a no-op


def test_nothing_listening_times_out_clearly() -> None:
    port = free_port()
    with pytest.raises(StoreUnavailableError, match=f"127.0.0.1:{port}"):
        wait_for_port(port, timeout=0.3)


def test_commands_stay_on_loopback(tmp_path: Path) -> None:
    durable = RedisServer(tmp_path).command()
    assert durable[durable.index("--bind") + 1] == "127.0.0.1"
    assert durable[durable.index("--appendonly") + 1] == "yes"
    assert str(tmp_path) in durable
    assert RedisServer().command()[-2:] == ["--appendonly", "no"]
    moto = MotoServer().command()
    assert moto[moto.index("-H") + 1] == "127.0.0.1"


@pytest.mark.slow
def test_a_redis_server_serves_until_stopped(tmp_path: Path) -> None:
    server = started(RedisServer(tmp_path))
    try:
        store = RedisStore(server.url)
        key = store.put(b"kept")
        assert key == content_key(b"kept") and store.get(key) == b"kept"
        store.close()
    finally:
        server.stop()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", server.port), 0.5):
        pass

"""`RedisStore`: a content store on a Redis server (redis-py), for many processes and machines.

Each object is one Redis string under `<prefix><key hex>`, written by a Lua script that runs
atomically on the server: it stores the value when the key is absent or holds other bytes
(a damaged object: every writer of a key writes its one content), and leaves an intact object
alone. So concurrent writers of one content store it once, a damaged object is replaced by
the next put of its content, and a reader sees a whole value or nothing. Every read is
checked against its key. Calls that fail on a dropped
connection or a timeout are retried with a bounded backoff (`RetryPolicy`), then raise
`StoreUnavailableError`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..errors import InvalidArgumentError, MissingObjectError, StoreError
from .content import RetryPolicy, check_key, content_key, verified

__all__ = ["RedisStore"]

#: Objects at least this large are read back and compared before they are sent: a present,
#: intact one is not sent again (a Lua script's argument of that size costs the server more
#: than the read; Redis can hash only with SHA-1, slower still).
CHECK_FIRST_BYTES = 16 * 1024

#: Put-if-absent-or-damaged: 0 the intact object was there, 1 stored, 2 replaced a damaged one
#: (other bytes, or a value of another Redis type: SET replaces any).
_PUT_SCRIPT = """
local kind = redis.call('TYPE', KEYS[1]).ok
local present = false
if kind == 'string' then present = redis.call('GET', KEYS[1]) end
if present == ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
if kind ~= 'none' then return 2 end
return 1
"""

#: What Redis answers a GET of a key holding another type (a list, a hash): no object there.
_WRONG_TYPE = "WRONGTYPE"


class RedisStore:
    """Objects in Redis at `url` (for example ``redis://127.0.0.1:6379/0``).

    `timeout` bounds each network call in seconds; `retry` the attempts. A ready-made
    `redis.Redis` client may be passed as `client` instead of a URL (its retries should be
    off: this store does its own). Thread-safe: redis-py's connection pool is.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        prefix: str = "rollout_store:",
        timeout: float = 2.0,
        retry: RetryPolicy | None = None,
        client: Any = None,
    ) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:  # pragma: no cover - depends on the installation
            raise ImportError(
                "RedisStore needs redis-py: pip install 'rollout_store[redis]'"
            ) from None
        if client is None:
            if url is None:
                raise InvalidArgumentError("RedisStore needs a url or a client")
            client = redis.Redis.from_url(
                url,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False,
            )
        self._client = client
        self._prefix = prefix.encode()
        self._retry = retry or RetryPolicy()
        self._transient: tuple[type[BaseException], ...] = (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            OSError,
        )
        self._redis_error: type[BaseException] = redis.exceptions.RedisError
        self._response_error: type[BaseException] = redis.exceptions.ResponseError
        self._put_script = client.register_script(_PUT_SCRIPT)
        self.url = url

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r})"

    @property
    def client(self) -> Any:
        """The `redis.Redis` client (share it between stores with other prefixes)."""
        return self._client

    def _name(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    def _get(self, key: bytes, name: bytes) -> bytes | bool | None:
        """The string value under `name`; None: absent; False: a value of another Redis type
        (damage: no object, replaced by the next put of the content)."""

        def get() -> Any:
            try:
                return self._client.get(name)
            except self._response_error as error:
                if str(error).startswith(_WRONG_TYPE):
                    return False
                raise

        value: bytes | bool | None = self._call("GET", key, get)
        return value

    def _call(self, what: str, key: bytes | None, call: Any) -> Any:
        try:
            return self._retry.run(f"Redis {what} on {self.url}", call, self._transient, key)
        except self._redis_error as error:  # a server error that no retry mends
            raise StoreError(f"Redis {what} on {self.url} failed: {error}", key=key) from error

    def put(self, data: bytes) -> bytes:
        data = bytes(data)
        key = content_key(data)
        name = self._name(key)
        if len(data) >= CHECK_FIRST_BYTES and self._get(key, name) == data:
            return key
        self._call("put", key, lambda: self._put_script([name], [data]))
        return key

    def get(self, key: bytes) -> bytes:
        name = self._name(check_key(key))
        data = self._get(key, name)
        if data is None:
            raise MissingObjectError(f"no such object in Redis at {self.url}", key=key)
        if data is False:
            raise MissingObjectError(
                f"a value of another Redis type stands where the object must be in Redis at "
                f"{self.url}; a put of its content replaces it",
                key=key,
            )
        return verified(key, bytes(data), f"Redis at {self.url}")

    def contains(self, key: bytes) -> bool:
        name = self._name(check_key(key))
        return bool(self._call("TYPE", key, lambda: self._client.type(name)) == b"string")

    def keys(self) -> Iterator[bytes]:
        """Every key under this store's prefix (SCAN: may miss objects added meanwhile)."""
        names = self._call(
            "SCAN", None, lambda: list(self._client.scan_iter(match=self._prefix + b"*"))
        )
        for name in names:
            yield bytes.fromhex(name[len(self._prefix) :].decode())

    def close(self) -> None:
        """Close the connections of the client this store created or was given."""
        self._client.close()

"""`S3Store`: a content store on any S3-compatible object store (boto3).

Each object is one S3 object under `<prefix><key hex>`, written with `PutObject` and
`IfNoneMatch="*"`: S3 creates an object atomically and refuses to replace one (HTTP 412), so
concurrent writers of one content store it once and nothing is ever half-written under a key.
On 412 the object there is read and compared with the content: a damaged one is replaced with
`IfMatch=<its ETag>`, so a concurrent writer's object is never overwritten unread (a changed
ETag answers 412 again, and the object is read again). Every read is checked against its key
(a tampered object in the bucket is detected and never returned). Connection errors,
timeouts, throttling and 5xx answers are retried with a bounded backoff (`RetryPolicy`), then
raise `StoreUnavailableError`.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

from ..errors import MissingObjectError, StoreError, StoreUnavailableError
from .content import RetryPolicy, check_key, content_key, verified

__all__ = ["S3Store"]

#: Objects at least this large are read back and compared before they are sent: an intact
#: one is not sent again. (Its ETag would not do: a service's stored MD5 can outlive damage
#: to the bytes.)
CHECK_FIRST_BYTES = 64 * 1024
#: Rounds of read-compare-replace a put makes while other writers keep changing the object.
HEAL_ROUNDS = 4

_MISSING = {"404", "NoSuchKey", "NotFound"}
_EXISTS = {"412", "PreconditionFailed"}
_GONE = {"NoSuchKey"}
_TRANSIENT = {
    "409",  # ConditionalRequestConflict: a concurrent conditional write; retry
    "ConditionalRequestConflict",
    "500",
    "502",
    "503",
    "504",
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
}


class _Transient(Exception):
    """Internal: an S3 answer worth retrying."""


class S3Store:
    """Objects in `bucket` of the S3 service at `endpoint_url` (AWS when None).

    `client_options` go to `boto3.client("s3", ...)` (credentials, region). `timeout` bounds
    each connect and read in seconds; `retry` the attempts. A ready-made boto3 client may be
    passed as `client` (boto3 clients are thread-safe; its own retries should be off).
    `create_bucket=True` creates the bucket when it does not exist.
    """

    def __init__(
        self,
        bucket: str,
        *,
        endpoint_url: str | None = None,
        prefix: str = "rollout_store/",
        timeout: float = 5.0,
        retry: RetryPolicy | None = None,
        client: Any = None,
        create_bucket: bool = False,
        **client_options: Any,
    ) -> None:
        try:
            import boto3
            import botocore.config
            import botocore.exceptions
        except ImportError:  # pragma: no cover - depends on the installation
            raise ImportError("S3Store needs boto3: pip install 'rollout_store[s3]'") from None
        if client is None:
            config = botocore.config.Config(
                connect_timeout=timeout,
                read_timeout=timeout,
                retries={"max_attempts": 1, "mode": "standard"},
                # the store builds every request itself (a bucket, a key, bytes): checking
                # them against the service model only costs time, and leaves per-call
                # strings in the interpreter's attribute cache
                parameter_validation=False,
            )
            client = boto3.client("s3", endpoint_url=endpoint_url, config=config, **client_options)
        self._client = client
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self._prefix = prefix
        self._retry = retry or RetryPolicy()
        self._client_error: type[Exception] = botocore.exceptions.ClientError
        self._transient: tuple[type[BaseException], ...] = (
            _Transient,
            botocore.exceptions.BotoCoreError,  # connection, timeout, truncated body
            OSError,
        )
        if create_bucket and not self._bucket_exists():
            self._call("CreateBucket", None, lambda: self._client.create_bucket(Bucket=bucket))

    def __repr__(self) -> str:
        return f"S3Store({self.bucket!r}, endpoint_url={self.endpoint_url!r})"

    @property
    def client(self) -> Any:
        """The boto3 S3 client (share it between stores with other prefixes or buckets)."""
        return self._client

    def _where(self) -> str:
        return f"s3://{self.bucket}/{self._prefix}" + (
            f" at {self.endpoint_url}" if self.endpoint_url else ""
        )

    def _name(self, key: bytes) -> str:
        return self._prefix + key.hex()

    def _code(self, error: Exception) -> str:
        response = getattr(error, "response", {}) or {}
        code = str(response.get("Error", {}).get("Code", ""))
        status = str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        return code if code and not code.isdigit() else status or code

    def _call(self, what: str, key: bytes | None, call: Any, *expected: set[str]) -> Any:
        """Run `call`; return the error code when it is one of `expected`, else its result."""
        accepted = set().union(*expected)

        def attempt() -> Any:
            try:
                return call()
            except self._client_error as error:
                code = self._code(error)
                status = str(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode"))  # type: ignore[attr-defined]
                if code in accepted or status in accepted:
                    return _Answer(code if code in accepted else status)
                if code in _TRANSIENT or status in _TRANSIENT:
                    raise _Transient(f"{code} (HTTP {status})") from error
                raise StoreError(
                    f"S3 {what} on {self._where()} failed: {code} (HTTP {status})", key=key
                ) from error

        return self._retry.run(f"S3 {what} on {self._where()}", attempt, self._transient, key)

    def _bucket_exists(self) -> bool:
        answer = self._call(
            "HeadBucket", None, lambda: self._client.head_bucket(Bucket=self.bucket), _MISSING
        )
        return not isinstance(answer, _Answer)

    def put(self, data: bytes) -> bytes:
        data = bytes(data)
        key = content_key(data)
        name = self._name(key)
        condition: dict[str, str] = {"IfNoneMatch": "*"}
        if len(data) >= CHECK_FIRST_BYTES:  # read back rather than sent again when intact
            present = self._read(key, name)
            if present is not None:
                if present[0] == data:
                    return key
                condition = {"IfMatch": present[1]}
        for _ in range(HEAL_ROUNDS):
            answer = self._call(
                "PutObject",
                key,
                partial(
                    self._client.put_object, Bucket=self.bucket, Key=name, Body=data, **condition
                ),
                _EXISTS,
                _GONE,  # (only with IfMatch: the object was deleted meanwhile)
            )
            if not isinstance(answer, _Answer):
                return key
            if answer.code in _GONE:
                condition = {"IfNoneMatch": "*"}
                continue
            present = self._read(key, name)  # 412: an object is there; is it intact?
            if present is None:
                condition = {"IfNoneMatch": "*"}
            elif present[0] == data:
                return key
            else:  # damaged: replace exactly that object
                condition = {"IfMatch": present[1]}
        raise StoreUnavailableError(
            f"S3 PutObject on {self._where()}: the object kept changing under its key "
            f"({HEAL_ROUNDS} rounds of read and conditional replace)",
            key=key,
        )

    def _read(self, key: bytes, name: str) -> tuple[bytes, str] | None:
        """The object under `name` and its ETag, unverified; None if absent."""

        def read() -> Any:
            answer = self._client.get_object(Bucket=self.bucket, Key=name)
            return answer["Body"].read(), answer["ETag"]

        found = self._call("GetObject", key, read, _MISSING)
        return None if isinstance(found, _Answer) else (bytes(found[0]), str(found[1]))

    def get(self, key: bytes) -> bytes:
        name = self._name(check_key(key))

        def read() -> Any:
            return self._client.get_object(Bucket=self.bucket, Key=name)["Body"].read()

        data = self._call("GetObject", key, read, _MISSING)
        if isinstance(data, _Answer):
            raise MissingObjectError(f"no such object in {self._where()}", key=key)
        return verified(key, bytes(data), self._where())

    def contains(self, key: bytes) -> bool:
        name = self._name(check_key(key))
        answer = self._call(
            "HeadObject",
            key,
            lambda: self._client.head_object(Bucket=self.bucket, Key=name),
            _MISSING,
        )
        return not isinstance(answer, _Answer)

    def keys(self) -> Iterator[bytes]:
        """Every key under this store's prefix."""

        def listing() -> list[str]:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._prefix
            )
            return [item["Key"] for page in pages for item in page.get("Contents", ())]

        for name in self._call("ListObjectsV2", None, listing):
            yield bytes.fromhex(name[len(self._prefix) :])


class _Answer:
    """Internal: an expected error answer (`code`), returned instead of raised."""

    __slots__ = ("code",)

    def __init__(self, code: str) -> None:
        self.code = code

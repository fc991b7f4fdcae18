"""Child processes of the store tests: run as `python store_workers.py VERB SPEC SEED`.

SPEC is a JSON list naming a store (see `open_store`). `put` writes shared and own objects
and prints their keys; `forever` keeps writing large objects until it is killed.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

from rollout_store.stores.content import ContentStore
from rollout_store.stores.local import DirectoryStore
from rollout_store.stores.redis_store import RedisStore
from rollout_store.stores.s3_store import S3Store

S3_CREDENTIALS = {
    "aws_access_key_id": "test",
    "aws_secret_access_key": "test",
    "region_name": "us-east-1",
}


def open_store(spec: list[Any]) -> ContentStore:
    kind = spec[0]
    if kind == "directory":
        return DirectoryStore(spec[1])
    if kind == "redis":
        return RedisStore(spec[1], prefix=spec[2])
    if kind == "s3":
        return S3Store(spec[2], endpoint_url=spec[1], prefix=spec[3], **S3_CREDENTIALS)
    raise ValueError(kind)


def shared_objects(n: int) -> list[bytes]:
    """The objects every writer puts (the same in every process)."""
    rng = random.Random(0)
    return [rng.randbytes(rng.randrange(1, 300_000)) for _ in range(n)]


def put(store: ContentStore, seed: int) -> None:
    rng = random.Random(seed)
    objects = shared_objects(12) + [rng.randbytes(rng.randrange(1, 50_000)) for _ in range(12)]
    rng.shuffle(objects)
    for data in objects:
        print(store.put(data).hex(), flush=True)


def forever(store: ContentStore, seed: int) -> None:
    rng = random.Random(seed)
    n = 0
    while True:
        store.put(rng.randbytes(rng.randrange(200_000, 2_000_000)))
        n += 1
        print(n, flush=True)


if __name__ == "__main__":
    verb, spec, seed = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    {"put": put, "forever": forever}[verb](open_store(spec), seed)

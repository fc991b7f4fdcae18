"""Run by test_server.py in a child process: what an idle session of the capture server keeps.

    python tests/idle_memory.py FOLDER memory|directory

Prints JSON {turns: [bytes while loaded, bytes kept once released, whether the reopened
graph links its last turn by tokens]}. The session measured repeats one already recorded and
released, so the shared content store and string cache hold its content already and do not
grow: what it keeps is its own.
"""

from __future__ import annotations

import gc
import json
import pathlib
import random
import string
import sys
import tracemalloc
from pathlib import Path
from typing import Any

from rollout_store import DirectoryStore, MemoryStore, TurnNode
from rollout_store.serve.sessions import Session, Sessions

INTERNING = pathlib.__file__


def record(session: Session, turns: int) -> None:
    rng = random.Random(turns)

    def text(n: int) -> str:
        return "".join(rng.choices(string.ascii_letters + " ", k=n))

    messages: list[Any] = [
        {"role": "system", "content": text(3000)},
        {"role": "user", "content": "go"},
    ]
    prompt = list(range(100, 400))
    for _ in range(turns):
        sampled = [rng.randrange(1000, 5000) for _ in range(50)]
        reply = {"role": "assistant", "content": text(2000)}
        node = TurnNode(
            prompt_ids=prompt,
            sampled_ids=sampled,
            request_messages=messages,
            response_message=reply,
        )
        with session.use() as graph:
            graph.add_turn(node)
        messages = [*messages, reply, {"role": "user", "content": text(1500)}]
        prompt = prompt + sampled + [rng.randrange(1000, 5000) for _ in range(300)]


def main() -> None:
    folder, kind = Path(sys.argv[1]), sys.argv[2]
    figures: dict[int, list[Any]] = {}
    for turns in (4, 40):
        objects = folder / f"objects{turns}"
        shared = MemoryStore() if kind == "memory" else DirectoryStore(objects)
        sessions = Sessions(folder / f"data{turns}", fsync="never", store=shared)
        record(sessions.create(), turns)  # the same content, in the store and cache already
        assert sessions.release_idle(0) == 1
        tracemalloc.start()
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        session = sessions.create()
        record(session, turns)
        gc.collect()
        loaded = tracemalloc.get_traced_memory()[0] - base
        assert sessions.release_idle(0) == 1 and not session.loaded
        assert session.info()["turns"] == turns  # counted without reopening
        gc.collect()
        # less the interpreter's table of interned strings, which pathlib grows (once) with
        # a directory store's file names and which never shrinks
        now = tracemalloc.get_traced_memory()[0]
        table = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, INTERNING)])
        retained = now - base - sum(stat.size for stat in table.statistics("filename"))
        tracemalloc.stop()
        graph = session.graph  # reopened from the log
        ids = graph.node_ids()
        relinked = graph.parent(ids[-1]) == ids[-2] and graph.link_kind(ids[-1]) == "tokens"
        figures[turns] = [loaded, retained, relinked]
        sessions.close()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

"""Write the compatibility fixtures of format version 2 beside this script, deterministically.

    python tests/data/make_fixtures.py

Files written by a given version of the library, which every later version must load, verify
and export byte for byte (tests/test_compat_fixtures.py):

- `v2_inline_snapshot.rls`: `save(path)`, every long string inline;
- `v2_store_snapshot.rls` and `v2_store_objects/`: `save(path, blobs="store")` over a
  `DirectoryStore`, and that store's objects;
- `v2_append_log.rls`: a log written turn by turn (`RolloutGraph.open`);

each with `<name>.expected`: `json.dumps` of the export (`export_session`, messages and
discarded turns included) and of each turn's token ids, logprobs and parent. The rollout
holds forks (by messages and by tokens), a retry, token turns, ints beyond 64 bits, lone
surrogates, NaN, infinities and -0.0, a failed call (no sampled ids) and odd values (1, 1.0,
True, empty containers). A file's id is random where the
library writes it; here it is fixed, so the script writes the same bytes every run.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # the package of this checkout

from rollout_store import DirectoryStore, RolloutGraph, TurnNode, export_session  # noqa: E402
from rollout_store.files import framing  # noqa: E402

SHARE = 16  # share_threshold: short strings already go to the blob table
ODD = [1, 1.0, True, -0.0, float("nan"), float("inf"), -float("inf"), 2**70, -(10**40), {}, []]
FILE_ID = 0x5EED_F1E1_D0C5_0002


def build(graph: RolloutGraph) -> None:
    system = {"role": "system", "content": "You are careful. " * 3}
    tools = [{"type": "function", "function": {"name": "grep", "description": "search " * 4}}]
    user = {"role": "user", "content": "Find the bug in storage.py, please."}
    answer = {"role": "assistant", "content": "Looking at the frames first.", "refusal": None}
    graph.add_turn(
        TurnNode(
            "m1",
            request_messages=[system, user],
            response_message=answer,
            request_tools=tools,
            sampling_params={"temperature": 1.0, "seed": 7},
            model="m",
            finish_reason="stop",
        )
    )
    odd = {"role": "user", "content": "odd values", "odd": ODD}
    graph.add_turn(  # extends m1
        TurnNode(
            "m2",
            request_messages=[system, user, answer, odd],
            response_message={"role": "assistant", "content": float("nan"), "x": -0.0},
            request_tools=tools,
            sampling_params={"temperature": 1.0, "seed": 7},
        )
    )
    lone = {"role": "user", "content": "caf\u00e9 \ud800"}
    graph.add_turn(  # a fork of m1's conversation, with a lone surrogate
        TurnNode(
            "m3",
            request_messages=[system, user, answer, lone],
            response_message={"role": "assistant", "content": "\udfff lone " * 3},
            request_tools=tools,
        )
    )
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    graph.add_turn(TurnNode("t1", prompt, [9, 10], [-0.5, -0.25], request_messages=[user]))
    graph.add_turn(TurnNode("t2", [*prompt, 9, 10, 11], [], request_messages=[user]))  # failed
    graph.add_turn(  # extends t1 by tokens
        TurnNode("t3", [*prompt, 9, 10, 11], [12, 13], [-1.0, -0.0], request_messages=[user])
    )
    graph.add_turn(  # a retry of t3 (same prompt)
        TurnNode("t4", [*prompt, 9, 10, 11], [12, 14], [-1.0, -2.0], request_messages=[user])
    )
    graph.add_turn(  # a fork by tokens, huge ids
        TurnNode("t5", [1, 2, 3, 99], [2**70, 2**64], None, request_messages=[user])
    )
    graph.add_turn(TurnNode(prompt_ids=[2**40, -3], sampled_ids=[], sampled_logprobs=[0]))
    graph.add_turn(
        TurnNode(
            request_messages=[{"role": "user", "content": [{"type": "text", "text": "x" * 40}]}],
            response_message={"role": "assistant", "content": "x" * 40, "n": 10**30},
            requested_sampling_params={"max_tokens": 5},
        )
    )


def expected(graph: RolloutGraph) -> str:
    """`json.dumps` of the export and of every turn's token fields and parent, in order."""
    doc = export_session(graph, include_messages=True, include_discarded=True)
    turns = [graph.get(node_id) for node_id in graph.node_ids()]
    tokens = [[t.prompt_ids, t.sampled_ids, t.sampled_logprobs, t.parent_id] for t in turns]
    return json.dumps({"export": doc, "tokens": tokens})


def main() -> None:
    framing.new_file_id = lambda: FILE_ID  # type: ignore[assignment]  # fixed bytes
    inline = RolloutGraph(share_threshold=SHARE)
    build(inline)
    inline.save(HERE / "v2_inline_snapshot.rls")
    (HERE / "v2_inline_snapshot.rls.expected").write_text(expected(inline))

    objects = HERE / "v2_store_objects"
    shutil.rmtree(objects, ignore_errors=True)
    stored = RolloutGraph(share_threshold=SHARE, store=DirectoryStore(objects, fsync=False))
    build(stored)
    stored.save(HERE / "v2_store_snapshot.rls", blobs="store")
    (HERE / "v2_store_snapshot.rls.expected").write_text(expected(stored))
    shutil.rmtree(objects / "tmp")  # the store's scratch folder, empty

    log = HERE / "v2_append_log.rls"
    log.unlink(missing_ok=True)
    with RolloutGraph.open(log, share_threshold=SHARE, fsync="never") as graph:
        build(graph)
    (HERE / "v2_append_log.rls.expected").write_text(expected(RolloutGraph.load(log)))


if __name__ == "__main__":
    main()

"""The session document and the JSONL trace, as dicts or streamed to a file.

`export_session` builds the whole document; `write_session_json` writes the same bytes that
`json.dumps(export_session(...))` would, holding one turn's materialized values at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import IO, Any

from .graph import Graph
from .materialize import Streamed, write_document, writer_for

__all__ = ["export_session", "iter_turn_records", "write_session_json", "write_trace_jsonl"]


def _turn_record(
    graph: Graph, node_id: str, discarded: bool, include_messages: bool, stream: bool
) -> dict[str, Any]:
    turn = graph.get(node_id) if include_messages else None
    info = graph.summary(node_id)
    record: dict[str, Any] = {
        "node_id": node_id,
        "index": info["index"],
        "root_id": graph.root_of(node_id),
        "parent_id": info["parent_id"],
        "n_prompt": info["n_prompt"],
        "n_sampled": info["n_sampled"],
        "n_tools": info["n_tools"],
        "model": info["model"],
        "finish_reason": info["finish_reason"],
        "harness_session_id": info["harness_session_id"],
        "sampling_params": graph.sampling_params(node_id),
        "discarded": discarded,
    }
    if turn is not None:
        messages = turn.request_messages
        # streamed one message at a time: a long conversation's JSON is never whole in memory
        record["request_messages"] = (
            Streamed(messages) if stream and isinstance(messages, list | tuple) else messages
        )
        record["request_tools"] = turn.request_tools
        record["response_message"] = turn.response_message
    return record


def _parts(
    graph: Graph,
    session_id: str | None,
    metadata: Any,
    include_messages: bool,
    include_discarded: bool,
    stream: bool = False,
) -> tuple[dict[str, Any], Iterator[dict[str, Any]], Iterator[dict[str, Any]], dict[str, int]]:
    discarded = set(graph.discarded_nodes())
    kept = [n for n in graph.nodes() if include_discarded or n not in discarded]
    leaves = [n for n in graph.leaves() if include_discarded or n not in discarded]
    head = {"session_id": session_id, "metadata": metadata}
    turns = (_turn_record(graph, n, n in discarded, include_messages, stream) for n in kept)
    sequences = (graph.sequence_for(leaf) for leaf in leaves)
    full = graph.stats()
    stats = {
        "turns": full["turns"],
        "roots": full["roots"],
        "leaves": full["leaves"],
        "forks": full["forks"],
        "discarded": len(discarded),
        "exported_turns": len(kept),
        "sequences": len(leaves),
    }
    return head, turns, sequences, stats


def export_session(
    graph: Graph,
    *,
    session_id: str | None = None,
    metadata: Any = None,
    include_messages: bool = False,
    include_discarded: bool = False,
) -> dict[str, Any]:
    """The session as one JSON-ready dict: turns, training sequences and counts.

    Without `include_discarded`, turns dropped as retries (see `discarded_nodes`) and their
    sequences are left out; every exported turn says whether it was discarded.
    """
    with graph.lock:  # one consistent snapshot, even while other threads add turns
        head, turns, sequences, stats = _parts(
            graph, session_id, metadata, include_messages, include_discarded
        )
        return {**head, "turns": list(turns), "sequences": list(sequences), "stats": stats}


def write_session_json(
    graph: Graph,
    fp: IO[Any],
    *,
    session_id: str | None = None,
    metadata: Any = None,
    include_messages: bool = False,
    include_discarded: bool = False,
) -> None:
    """Write exactly `json.dumps(export_session(graph, ...))`, one turn in memory at a time."""
    with graph.lock:  # one consistent snapshot: add_turn in other threads waits
        head, turns, sequences, stats = _parts(
            graph, session_id, metadata, include_messages, include_discarded, stream=True
        )
        document = {**head, "turns": Streamed(turns), "sequences": Streamed(sequences)}
        write_document(fp, {**document, "stats": stats})


def iter_turn_records(graph: Graph) -> Iterator[dict[str, Any]]:
    """Each turn in arrival order as a flat record for training pipelines.

    A generator: turns added while it runs may re-link turns not yet yielded. For one
    consistent snapshot under concurrent recording use `write_trace_jsonl`, which holds the
    graph's lock throughout.
    """
    for node_id in graph.nodes():
        turn = graph.get(node_id)
        yield {
            "node_id": turn.node_id,
            "parent_id": turn.parent_id,
            "index": turn.index,
            "model": turn.model,
            "finish_reason": turn.finish_reason,
            "harness_session_id": turn.harness_session_id,
            "request_messages": turn.request_messages,
            "request_tools": turn.request_tools,
            "sampling_params": turn.sampling_params,
            "response_message": turn.response_message,
            "prompt_ids": turn.prompt_ids,
            "sampled_ids": turn.sampled_ids,
            "sampled_logprobs": turn.sampled_logprobs,
        }


def write_trace_jsonl(graph: Graph, fp: IO[Any]) -> None:
    """One JSON line per turn (request, response, token ids, logprobs)."""
    write = writer_for(fp)
    with graph.lock:
        for record in iter_turn_records(graph):
            write(json.dumps(record))
            write("\n")

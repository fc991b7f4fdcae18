"""Store figures: what a graph received against what it keeps.

`store_figures` gathers the cheap counts of `RolloutGraph.stats()`; `plain_export_bytes`
streams the plain JSON export (every turn with its messages, as a capture graph that keeps
each decoded request would hold them) into a counter, so its size is known without ever
holding it.
"""

from __future__ import annotations

import io
from typing import Any

from ..graph import Graph
from .document import write_session_json

__all__ = ["plain_export_bytes", "store_figures"]


class _Counter(io.TextIOBase):
    """A text sink that only counts what is written to it (the export is ASCII)."""

    def __init__(self) -> None:
        super().__init__()
        self.size = 0

    def write(self, text: str) -> int:
        self.size += len(text)
        return len(text)


def plain_export_bytes(graph: Graph) -> int:
    """Bytes of the plain export: `json.dumps(export_session(graph, include_messages=True,
    include_discarded=True))`, counted as it streams."""
    counter = _Counter()
    write_session_json(graph, counter, include_messages=True, include_discarded=True)  # type: ignore[arg-type]
    return counter.size


def store_figures(graph: Graph) -> dict[str, Any]:
    """Counts of turns and structure, long strings and tokens: what is cheap to count.

    The bytes received (the plain export's size) cost a pass over every turn's messages:
    `plain_export_bytes`.
    """
    stats = graph.stats()
    return {
        "turns": len(graph),
        "roots": len(graph.root_ids()),
        "leaves": len(graph.leaf_ids()),
        "forks": len(graph.fork_ids()),
        "discarded": len(graph.discarded_ids()),
        "blobs": int(stats.get("blobs", 0)),
        "unique_blob_bytes": int(stats.get("blob_bytes", 0)),
        "blob_bytes_sent": int(stats.get("blob_bytes_sent", 0)),
        "message_bytes_stored": int(stats.get("message_bytes_stored", 0)),
        "tokens_received": int(stats.get("tokens_received", 0)),
        "tokens_stored": int(stats.get("tokens_stored", 0)),
    }

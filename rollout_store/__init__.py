"""rollout_store: record LLM agent rollouts with memory proportional to unique content."""

from .blobs import BlobTable, Handle
from .errors import (
    ChecksumMismatch,
    CorruptFileError,
    DuplicateNodeError,
    FileLockedError,
    InvalidValueError,
    RolloutStoreError,
    UnsupportedVersionError,
)
from .export import export_session, iter_turn_records, write_session_json, write_trace_jsonl
from .graph import Graph, TurnNode, common_prefix_len
from .intake import MAX_DEPTH
from .raw import RawJSON
from .storage import RolloutGraph
from .training import TrainingSequence

__all__ = [
    "MAX_DEPTH",
    "BlobTable",
    "ChecksumMismatch",
    "CorruptFileError",
    "DuplicateNodeError",
    "FileLockedError",
    "Graph",
    "Handle",
    "InvalidValueError",
    "RawJSON",
    "RolloutGraph",
    "RolloutStoreError",
    "TrainingSequence",
    "TurnNode",
    "UnsupportedVersionError",
    "common_prefix_len",
    "export_session",
    "iter_turn_records",
    "write_session_json",
    "write_trace_jsonl",
]

"""rollout_store: record LLM agent rollouts with memory proportional to unique content."""

from .blobs import BlobTable, Handle
from .errors import (
    ChecksumMismatch,
    CorruptFileError,
    DuplicateNodeError,
    InvalidValueError,
    RolloutStoreError,
    UnsupportedVersionError,
)
from .graph import RolloutGraph, TurnNode
from .intake import MAX_DEPTH

__all__ = [
    "MAX_DEPTH",
    "BlobTable",
    "ChecksumMismatch",
    "CorruptFileError",
    "DuplicateNodeError",
    "Handle",
    "InvalidValueError",
    "RolloutGraph",
    "RolloutStoreError",
    "TurnNode",
    "UnsupportedVersionError",
]

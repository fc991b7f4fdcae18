"""rollout_store: record LLM agent rollouts with memory proportional to unique content."""

from ._core import __version__  # the package version, Cargo's (the one version source)
from .engine.blobs import BlobTable, Handle
from .engine.intake import MAX_DEPTH
from .errors import (
    ChecksumMismatch,
    CorruptFileError,
    CorruptObjectError,
    DamagedStoreObjectError,
    DuplicateNodeError,
    FileLockedError,
    FileSyncError,
    FileWriteError,
    IndexKeyMismatch,
    IndexKeyRecomputeError,
    InvalidArgumentError,
    InvalidValueError,
    MissingObjectError,
    MissingStoreObjectError,
    ReadOnlyError,
    RecordTooLargeError,
    RolloutStoreError,
    StoreError,
    StoreObjectError,
    StoreRequiredError,
    StoreUnavailableError,
    UnknownNodeError,
    UnsupportedVersionError,
)
from .export.document import (
    export_session,
    iter_turn_records,
    write_session_json,
    write_trace_jsonl,
)
from .export.row_files import write_rows
from .export.rows import (
    iter_token_samples,
    iter_tree_samples,
    token_samples,
    tree_attention_mask,
    tree_samples,
)
from .files.storage import RolloutGraph
from .graph import Graph
from .metadata import GraphMeta
from .model.nodes import COUNT_TOOLS, TurnNode, common_prefix_len
from .model.raw import RawJSON
from .model.timeline import Timeline
from .model.training import TrainingSequence
from .serve.capture import Capture, CaptureError, capture
from .stores.content import ContentStore, RetryPolicy, StringCache, content_key
from .stores.local import DirectoryStore, MemoryStore
from .stores.redis_store import RedisStore
from .stores.s3_store import S3Store

__all__ = [
    "COUNT_TOOLS",
    "__version__",
    "MAX_DEPTH",
    "BlobTable",
    "Capture",
    "CaptureError",
    "capture",
    "Timeline",
    "ChecksumMismatch",
    "ContentStore",
    "CorruptObjectError",
    "DirectoryStore",
    "MemoryStore",
    "MissingObjectError",
    "RedisStore",
    "RetryPolicy",
    "S3Store",
    "StoreError",
    "StoreObjectError",
    "MissingStoreObjectError",
    "DamagedStoreObjectError",
    "StoreRequiredError",
    "StoreUnavailableError",
    "StringCache",
    "content_key",
    "CorruptFileError",
    "DuplicateNodeError",
    "FileLockedError",
    "FileSyncError",
    "FileWriteError",
    "Graph",
    "GraphMeta",
    "Handle",
    "IndexKeyMismatch",
    "IndexKeyRecomputeError",
    "InvalidArgumentError",
    "InvalidValueError",
    "RawJSON",
    "ReadOnlyError",
    "RecordTooLargeError",
    "RolloutGraph",
    "RolloutStoreError",
    "TrainingSequence",
    "TurnNode",
    "UnknownNodeError",
    "UnsupportedVersionError",
    "common_prefix_len",
    "export_session",
    "iter_token_samples",
    "iter_tree_samples",
    "token_samples",
    "tree_attention_mask",
    "tree_samples",
    "write_rows",
    "iter_turn_records",
    "write_session_json",
    "write_trace_jsonl",
]

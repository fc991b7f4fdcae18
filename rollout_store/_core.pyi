"""The compiled engine (`rollout_store._core`): content table and exact JSON."""

from typing import Any, Final, final

__all__ = ["ContentTable", "dumps", "loads", "DecodeError", "__version__", "DEFAULT_MAX_DEPTH"]

__version__: Final[str]
#: nesting bound of `loads` and `dumps` when none is given
DEFAULT_MAX_DEPTH: Final[int]

class DecodeError(ValueError):
    """JSON text that is not JSON (or nested too deeply); `offset` is the byte it was found at."""

    offset: int

def loads(data: bytes, /, *, max_depth: int = ...) -> Any:
    """The value `json.loads(data)` gives, built by the engine."""

def dumps(obj: Any, /, *, max_depth: int = ...) -> str:
    """`json.dumps(obj)` for JSON values (dict, list, tuple, str, int, float, bool, None)."""

@final
class ContentTable:
    """Distinct byte strings, each stored once: xxh3-128 keys, every hit confirmed by comparing
    the bytes, reference counted."""

    def __new__(cls) -> ContentTable: ...
    def intern(self, data: bytes) -> int:
        """Store `data` once (or take one more reference) and return its handle."""
    def get(self, handle: int) -> bytes:
        """The bytes under `handle` (`KeyError` when it names no content)."""
    def find(self, data: bytes) -> int | None:
        """The handle of the content equal to `data`, or None."""
    def release(self, handle: int) -> None:
        """Drop one reference to `handle`; the content goes with its last reference."""
    def refcount(self, handle: int) -> int:
        """References held on `handle` (0 when it names no content)."""
    def __len__(self) -> int: ...
    def __contains__(self, data: bytes, /) -> bool: ...
    @property
    def content_bytes(self) -> int:
        """Bytes of content held, each distinct string once."""
    @property
    def nbytes(self) -> int:
        """Bytes the engine holds for the table (content, slots and index), which
        `tracemalloc` does not see."""
    def _panic_for_tests(self, data: bytes) -> None:
        """Tests only: look `data` up with the lock held, then panic before storing it (a
        `pyo3_runtime.PanicException`, a `BaseException`); the table stays as it was."""

"""Taking recorded values in: the validating walk and packing (the engine's `Packer`), token
ids and logprobs as compact arrays.

The walk is the slow path, taken only for content the graph has not seen. It raises
`InvalidValueError` naming the exact path of a bad value; the path is assembled only while
the error propagates, so valid input pays nothing for it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from operator import index as _as_int

# MAX_DEPTH: containers nested deeper than this are refused (json.dumps itself fails near 1000)
from .._core import MAX_DEPTH, Packer, RefusedValue, json_u32_ids, u32_ids
from ..errors import InvalidValueError
from .blobs import BlobTable

__all__ = [
    "MAX_DEPTH",
    "Encoder",
    "PackedIds",
    "encode",
    "float_array",
    "plain_numbers",
    "real_numbers",
    "token_array",
    "compact_ids",
    "packed_ids",
]

_INT64_MIN = -(2**63)
_UINT64_MAX = 2**64 - 1

_TOO_MANY_DIGITS = (
    "an int with more digits than Python writes as text (sys.get_int_max_str_digits()): "
    "json.dumps cannot write it either"
)


class Encoder:
    """Validates values and packs them, long strings as references into `blobs` (the walk
    and the packing are the engine's `Packer`).

    With `blobs=None` every string stays inline: the canonical plain packing of any value.
    Not thread-safe: the graph uses it under its lock.
    """

    __slots__ = ("_packer", "blobs", "last_longest", "last_refs", "threshold")

    def __init__(self, blobs: BlobTable | None, threshold: int | None) -> None:
        self.blobs = blobs
        self.threshold = threshold
        # made at first use: a graph keeps no packer (nor its buffer) between turns
        self._packer: Packer | None = None
        self.last_refs = False  # whether the last packing holds blob references
        self.last_longest = 0  # the length of its longest string held as a reference

    def release(self) -> None:
        """Let the packer go (the graph's turn is done): the next `encode` makes one."""
        self._packer = None

    def encode(self, value: object, path: str) -> tuple[bytes, bool]:
        """The packing of `value` and whether it holds a tuple, a big int or a lone
        surrogate (the ext types a caller's own `msgpack.ExtType` objects could imitate).

        Raises `InvalidValueError` naming `path` plus the position inside `value`. The caller
        rolls the blob table back when a later step of the same turn fails.
        """
        packer = self._packer
        if packer is None:
            blobs = self.blobs
            intern = None if blobs is None else blobs.packer_intern
            packer = self._packer = Packer(intern, self.threshold)
        try:
            packed = packer.pack(value)
        except RefusedValue as refused:
            message, where = refused.args
            raise InvalidValueError(message, path + where) from None
        self.last_refs = packer.last_refs
        self.last_longest = packer.last_longest
        return packed, packer.last_special


def encode(
    value: object, path: str, blobs: BlobTable | None, threshold: int | None
) -> tuple[bytes, bool]:
    """`Encoder(blobs, threshold).encode(value, path)`, for one-off use."""
    return Encoder(blobs, threshold).encode(value, path)


def _is_numpy(x: object) -> bool:
    return type(x).__module__.split(".")[0] == "numpy"


def _as_sequence(values: object, path: str) -> object:
    """A 1-D numpy array as a list of Python numbers; a subclass of list or tuple as what
    iterating it yields (what json.dumps writes of it, not what it holds); anything else as
    it is."""
    kind = type(values)
    if kind is list or kind is tuple:
        return values
    if isinstance(values, list):
        return list(values)
    if isinstance(values, tuple):
        return tuple(values)
    if _is_numpy(values) and hasattr(values, "tolist"):
        ndim = getattr(values, "ndim", None)
        if ndim != 1:
            raise InvalidValueError(f"expected a 1-D array, got a {ndim}-D array", path)
        return values.tolist()
    return values


class PackedIds:
    """Token ids read from their JSON text straight into an `array('I')`'s bytes (`data`), by
    `packed_ids`: what a raw token field (a long context's ids, as an engine wrote them)
    becomes without one Python int per id. Made inside the library only."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data) // 4

    def tolist(self) -> list[int]:
        """The ids as the list `json.loads` would have read."""
        return self.array().tolist()

    def array(self) -> array[int]:
        ids = array("I")
        ids.frombytes(self.data)
        return ids


def packed_ids(text: bytes) -> PackedIds | None:
    """The token ids of a JSON array text, when they are ints in [0, 2**32) written as JSON
    writes them; else None (decode the text as `json.loads` would: its values or its error)."""
    data = json_u32_ids(text)
    return None if data is None else PackedIds(data)


def token_array(ids: object, path: str) -> array[int] | tuple[int, ...]:
    """Token ids as compact typed storage: array('I') when they fit, else exact ints.

    Accepts a list or tuple of ints (numpy integer scalars too), a 1-D numpy array, or the
    library's own `PackedIds`. Raises `InvalidValueError` for anything else (bools included:
    they would come back as 0 and 1).
    """
    if type(ids) is PackedIds:
        return ids.array()
    if type(ids) is list:
        # the common case in one pass at C speed: exact ints (no bool), all of them 32-bit
        packed = u32_ids(ids)
        if packed is not None:
            ids32 = array("I")
            ids32.frombytes(packed)
            return ids32
        # else the checks below say what is wrong, or find the storage that fits
    ids = _as_sequence(ids, path)
    if not isinstance(ids, list | tuple):
        raise InvalidValueError(f"expected a list of int, got {type(ids).__name__}", path)
    types = set(map(type, ids))
    if types and types != {int}:
        for i, x in enumerate(ids):
            if type(x) is not int:
                if isinstance(x, int) and not isinstance(x, bool):
                    continue
                if _is_numpy(x) and hasattr(x, "__index__"):
                    try:
                        _as_int(x)
                        continue
                    except TypeError:  # numpy bools refuse __index__
                        pass
                raise InvalidValueError(f"expected int, got {type(x).__name__}", f"{path}[{i}]")
        ids = [_as_int(x) for x in ids]
    compact = compact_ids(ids)
    if type(compact) is tuple:
        for i, x in enumerate(ids):  # beyond 64 bits: each must be an int Python writes as text
            if not _INT64_MIN <= x <= _UINT64_MAX:
                try:
                    str(x)
                except ValueError:
                    raise InvalidValueError(_TOO_MANY_DIGITS, f"{path}[{i}]") from None
    return compact


def compact_ids(ids: Sequence[int]) -> array[int] | tuple[int, ...]:
    """Checked or already recorded token ids in their compact storage, without checking
    them again: a recorded int is written as it is, even one with more digits than this
    process writes as text (a file written where the limit was raised)."""
    try:
        return array("I", ids)
    except OverflowError:
        pass
    try:
        return array("q", ids)
    except OverflowError:
        pass
    return tuple(ids)


def plain_numbers(values: object, path: str) -> object:
    """Logprobs with numpy arrays and numpy scalars turned into Python lists and numbers.

    Other items are left as they are (they are recorded as JSON values).
    """
    values = _as_sequence(values, path)
    if isinstance(values, list | tuple) and any(
        kind.__module__.split(".")[0] == "numpy"
        for kind in set(map(type, values))  # each kind once (mostly: float alone)
    ):
        converted = [x.item() if _is_numpy(x) and hasattr(x, "item") else x for x in values]
        return tuple(converted) if isinstance(values, tuple) else converted
    return values


def float_array(values: object, path: str) -> array[float] | None:
    """Logprobs as array('d') when every item is an exact float, else None (kept as JSON)."""
    if isinstance(values, list | tuple) and set(map(type, values)) <= {float}:
        return array("d", values)
    return None


def real_numbers(values: object) -> bool:
    """Whether every item is an int or float (not a bool): logprobs a trainer can use."""
    return isinstance(values, list | tuple) and all(
        type(x) is float or (type(x) is int) for x in values
    )

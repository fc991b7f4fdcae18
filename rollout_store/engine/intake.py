"""Walking a recorded value once: validate it, rebuild its containers, replace long strings.

The walk is the slow path, taken only for content the graph has not seen. It raises
`InvalidValueError` naming the exact path of a bad value; the path is assembled only while
the error propagates, so valid input pays nothing for it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from operator import index as _as_int
from typing import Any

import msgpack
import msgspec

from ..errors import InvalidValueError
from .blobs import BlobTable, Handle
from .encoding import EXT_BIGINT, EXT_BLOB, EXT_SURROGATE, TUPLE_MARK

__all__ = [
    "MAX_DEPTH",
    "Encoder",
    "encode",
    "float_array",
    "plain_numbers",
    "real_numbers",
    "token_array",
    "compact_ids",
]

#: Containers nested deeper than this are rejected (json.dumps itself fails near 1000).
MAX_DEPTH = 500

_INT64_MIN = -(2**63)
_UINT64_MAX = 2**64 - 1


class _Bad(Exception):
    """Internal: a bad value; `trail` collects path pieces, innermost first."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.trail: list[str] = []
        self.containers: list[int] = []


def _format_path(root: str, trail: list[str]) -> str:
    return root + "".join(reversed(trail))


def _key_piece(key: object) -> str:
    if isinstance(key, str) and key.isidentifier():
        return f".{key}"
    return f"[{key!r}]"


def _pack_default(obj: object) -> msgpack.ExtType:
    if type(obj) is Handle:
        return msgpack.ExtType(EXT_BLOB, obj.index.to_bytes(4, "big"))
    raise TypeError(f"cannot pack {type(obj).__name__}")  # unreachable for walked trees


class _Walker:
    """One validating walk; `special` tells whether the packing holds a forgeable ext type."""

    __slots__ = ("blobs", "longest", "refs", "short", "special", "threshold")

    def __init__(self, blobs: BlobTable | None, threshold: int | None) -> None:
        self.blobs = blobs
        self.threshold = threshold if blobs is not None else None
        # ASCII strings shorter than this need no further look
        self.short = min(64, self.threshold or 64)
        self.special = False
        self.refs = False  # a long string became a blob reference
        self.longest = 0  # the length of the longest string that did

    def string(self, s: str) -> Any:
        if type(s) is not str:
            s = str.__str__(s)
        threshold = self.threshold
        if threshold is not None and len(s) >= threshold:
            handle = self.blobs.intern(s)  # type: ignore[union-attr]
            self.refs = True
            if len(s) > self.longest:
                self.longest = len(s)
            if handle.surrogates:  # its plain packing is an EXT_SURROGATE
                self.special = True
            return handle
        if not s.isascii():
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                self.special = True
                return msgpack.ExtType(EXT_SURROGATE, s.encode("utf-8", "surrogatepass"))
        return s

    def key(self, k: object) -> Any:
        t = type(k)
        if t is str:
            return self.string(k) if not k.isascii() else k  # type: ignore[arg-type,attr-defined]
        if isinstance(k, str):
            return self.string(str.__str__(k))
        if t is bool or k is None:
            return k
        if isinstance(k, int):
            return self.integer(_as_int(k))
        if isinstance(k, float):
            return float.__float__(k)
        raise _Bad(f"dict key of type {t.__name__} (JSON keys are str, int, float, bool, None)")

    def integer(self, n: int) -> Any:
        if _INT64_MIN <= n <= _UINT64_MAX:
            return n
        self.special = True
        return msgpack.ExtType(EXT_BIGINT, _digits(n).encode("ascii"))

    def value(self, v: object, depth: int) -> Any:
        t = type(v)
        if t is str:
            if len(v) < self.short and v.isascii():  # type: ignore[arg-type,attr-defined]
                return v
            return self.string(v)  # type: ignore[arg-type]
        if v is None or t is bool or t is float:
            return v
        if t is int:
            return self.integer(v)  # type: ignore[arg-type]
        if t is msgpack.ExtType:  # a tuple subclass, but never JSON
            raise _Bad("value of type ExtType cannot be represented in JSON")
        if t is dict or t is list or t is tuple or isinstance(v, dict | list | tuple):
            if depth >= MAX_DEPTH:
                raise _Bad(f"nesting deeper than {MAX_DEPTH} levels")
            # containers are walked here, not in a helper, so a level costs one Python frame;
            # short ASCII strings (most leaves) are taken inline
            depth += 1
            short = self.short
            try:
                if isinstance(v, dict):
                    out: Any = {}
                    for k, item in v.items():
                        key = k if type(k) is str and k.isascii() else self.key(k)
                        if type(item) is str and len(item) < short and item.isascii():
                            out[key] = item
                            continue
                        try:
                            out[key] = self.value(item, depth)
                        except _Bad as bad:
                            bad.trail.append(_key_piece(k))
                            raise
                    return out
                items = []
                for i, item in enumerate(v):  # type: ignore[arg-type]
                    if type(item) is str and len(item) < short and item.isascii():
                        items.append(item)
                        continue
                    try:
                        items.append(self.value(item, depth))
                    except _Bad as bad:
                        bad.trail.append(f"[{i}]")
                        raise
                if isinstance(v, tuple):
                    self.special = True
                    return [TUPLE_MARK, *items]
                return items
            except _Bad as bad:
                bad.containers.append(id(v))
                raise
        if isinstance(v, str):
            return self.string(v)
        if isinstance(v, bool):
            return bool(v)
        if isinstance(v, int):
            return self.integer(_as_int(v))
        if isinstance(v, float):
            return float.__float__(v)
        raise _Bad(_not_json(v))


def _digits(n: int) -> str:
    """`str(n)`; an int with more digits than Python writes as text is a bad value (json.dumps
    cannot write it either)."""
    try:
        return str(n)
    except ValueError:
        raise _Bad(_TOO_MANY_DIGITS) from None


_TOO_MANY_DIGITS = (
    "an int with more digits than Python writes as text (sys.get_int_max_str_digits()): "
    "json.dumps cannot write it either"
)


def _not_json(v: object) -> str:
    """Why `v` is refused, and what to pass instead (for the objects people pass by mistake)."""
    t = type(v)
    name = t.__name__
    if callable(getattr(v, "model_dump", None)):  # a pydantic (v2) model
        return (
            f"a pydantic model ({name}) is not a JSON value: pass what the SDK would send, "
            f'`value.model_dump(mode="json", exclude_unset=True)`'
        )
    if callable(getattr(v, "dict", None)) and hasattr(t, "__fields__"):  # pydantic v1
        return f"a pydantic model ({name}) is not a JSON value: pass `json.loads(value.json())`"
    if t.__module__.split(".")[0] == "numpy":
        if hasattr(v, "ndim") and getattr(v, "ndim", 0) > 0:
            return f"a numpy array ({name}) is not a JSON value: pass `value.tolist()`"
        return f"a numpy value ({name}) is not a JSON value: pass `value.item()`"
    if hasattr(t, "__dataclass_fields__"):
        return f"a dataclass ({name}) is not a JSON value: pass `dataclasses.asdict(value)`"
    return f"value of type {name} cannot be represented in JSON"


class Encoder:
    """Validates values and packs them, long strings as references into `blobs`.

    With `blobs=None` every string stays inline: the canonical plain packing of any value.
    Not thread-safe: the graph uses it under its lock.
    """

    __slots__ = ("_packer", "blobs", "last_longest", "last_refs", "threshold")

    def __init__(self, blobs: BlobTable | None, threshold: int | None) -> None:
        self.blobs = blobs
        self.threshold = threshold
        self._packer: msgpack.Packer | None = None  # made at first use: most graphs' plain
        # encoder never packs
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
        walker = _Walker(self.blobs, self.threshold)
        try:
            tree = walker.value(value, 0)
        except _Bad as bad:
            raise _error(bad, path) from None
        packer = self._packer or _new_packer()
        packed = packer.pack(tree)
        # do not keep a large buffer alive
        self._packer = None if len(packed) > _KEEP_BUFFER else packer
        self.last_refs = walker.refs
        self.last_longest = walker.longest
        return packed, walker.special


_KEEP_BUFFER = 1 << 12  # a graph keeps at most this much of a packing buffer


def _new_packer() -> msgpack.Packer:
    return msgpack.Packer(use_bin_type=True, default=_pack_default, buf_size=256)


def _error(bad: _Bad, path: str) -> InvalidValueError:
    message = bad.message
    trail = bad.trail
    if message.startswith("nesting deeper") and len(set(bad.containers)) < len(bad.containers):
        message = "reference cycle (a container contains itself)"
        # report the place where the cycle closes
        seen: set[int] = set()
        for cut, cid in enumerate(reversed(bad.containers)):
            if cid in seen:
                trail = bad.trail[len(bad.trail) - cut :]
                break
            seen.add(cid)
    return InvalidValueError(message, _format_path(path, trail))


def encode(
    value: object, path: str, blobs: BlobTable | None, threshold: int | None
) -> tuple[bytes, bool]:
    """`Encoder(blobs, threshold).encode(value, path)`, for one-off use."""
    return Encoder(blobs, threshold).encode(value, path)


def _is_numpy(x: object) -> bool:
    return type(x).__module__.split(".")[0] == "numpy"


def _as_sequence(values: object, path: str) -> object:
    """A 1-D numpy array as a list of Python numbers; anything else as it is."""
    if not isinstance(values, list | tuple) and _is_numpy(values) and hasattr(values, "tolist"):
        ndim = getattr(values, "ndim", None)
        if ndim != 1:
            raise InvalidValueError(f"expected a 1-D array, got a {ndim}-D array", path)
        return values.tolist()
    return values


def _exact_ints(ids: list[Any]) -> list[int]:
    """`ids` if every item is an int (not a bool) within 64 bits, else ValidationError."""
    return msgspec.convert(ids, list[int], strict=True)


def token_array(ids: object, path: str) -> array[int] | tuple[int, ...]:
    """Token ids as compact typed storage: array('I') when they fit, else exact ints.

    Accepts a list or tuple of ints (numpy integer scalars too) or a 1-D numpy array.
    Raises `InvalidValueError` for anything else (bools included: they would come back as
    0 and 1).
    """
    if type(ids) is list:
        try:  # the common case at C speed: exact ints (bools refused), most of them 32-bit
            return array("I", _exact_ints(ids))
        except (msgspec.ValidationError, OverflowError):
            pass  # the checks below say what is wrong, or find the storage that fits
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

"""The library's former pure-Python validating walk and msgpack rebuild, kept as the oracle
of the differential tests of the engine's `Packer` and `unpack` (test_values_differential.py).

The engine replaced them byte for byte: these must agree with it on every value.
"""

# ruff: noqa
# mypy: ignore-errors

from __future__ import annotations

from operator import index as _as_int
from typing import Any

import msgpack

from rollout_store.blobs import BlobTable, Handle
from rollout_store.encoding import (
    EXT_BIGINT,
    EXT_BLOB,
    EXT_ECHO,
    EXT_SURROGATE,
    EXT_TUPLE,
    TUPLE_MARK,
    int_from_digits,
)
from rollout_store.errors import InvalidValueError

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


class _TupleMark:
    __slots__ = ()


_MARK = _TupleMark()


def _list_hook(items):
    if items and items[0] is _MARK:
        return tuple(items[1:])
    return items


def _make_hook(blob, echo):
    def hook(code, data):
        if code == EXT_BLOB:
            return blob(int.from_bytes(data, "big"))
        if code == EXT_TUPLE and not data:
            return _MARK
        if code == EXT_BIGINT:
            return int_from_digits(data)
        if code == EXT_SURROGATE:
            return data.decode("utf-8", "surrogatepass")
        if code == EXT_ECHO and echo is not None:
            return echo()
        raise ValueError(f"unknown extension type {code}")

    return hook


def unpack(data, blob, echo=None):
    return msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=False,
        ext_hook=_make_hook(blob, echo),
        list_hook=_list_hook,
    )

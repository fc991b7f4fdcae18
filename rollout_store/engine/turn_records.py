"""Turn records in a content store: a graph over Redis, S3 or a directory keeps references.

Over an out-of-process store the blob table already keeps long strings out of the process;
what stayed in it was each turn's own packed bytes: its request tail (the messages after its
base's, long strings as references) and its packed response, about half a kilobyte a turn in
a tool-calling rollout. Here a turn's *record* (tail and response, one object) is put into the
graph's store before the turn is committed, and the turn keeps two 32-byte keys instead:

- the record's store key, where the tail was (`Turn.data` keeps its layout: the tail region
  holds the key);
- the SHA-256 of the response's plain packing, where the response was. A re-sent request
  echoes the base turn's response: the echo is confirmed by the SHA-256 of its fresh plain
  packing, with no fetch.

Reading a tail or a response (`turn.tail`, `turn.response` of a `RemoteTurn`) fetches the
record through the graph's `StringCache`, verified against its key by the store. A turn
whose record is shorter than `MIN_RECORD_BYTES` stays as it was (in the process), unless its
response holds blob references: then its echo could only be confirmed in the process by
fetching those strings, and it is kept in the store whatever its size. A turn read from a
file whose response holds blob references stays in the process (its plain packing, which
its echo is confirmed by, is not at hand without fetching the strings).

A put that fails raises in `add_turn` before anything is committed (the graph and its file
stay as they were); an object left unreferenced by a rejected turn is harmless, as for
blobs. The put comes before the turn is appended to the graph's file: a file write that then
fails (`FileWriteError`) leaves the graph, its references and the file as they were, and the
store keeps that complete record, referenced by nothing (adding the turn again reuses it).
That is the one accepted leftover: putting the record after the write could leave a file
naming an object the store lacks, which is worse.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from ..errors import CorruptObjectError
from ..stores.content import KEY_SIZE, ContentStore, StringCache, content_key
from .stored import Turn, TurnFlag

__all__ = ["MIN_RECORD_BYTES", "RemoteTurn", "TurnRecords", "echo_by_key", "tail_bytes"]

#: A turn's tail and response are put into the store when they pack to at least this many
#: bytes (below, the two keys a turn then keeps and the round trip cost more than they save),
#: or when its response holds blob references (see the module docstring).
MIN_RECORD_BYTES = 128

_U32 = struct.Struct("<I")

# the setters of the plain `Turn` (they rebuild `data` around the parts they set)
_set_tail: Callable[[Turn, bytes], None] = vars(Turn)["tail"].fset
_set_response: Callable[[Turn, bytes | None], None] = vars(Turn)["response"].fset


class TurnRecords:
    """The records of one graph's turns in `store`, read through `cache` (see the module
    docstring). Used under the graph's lock; the store and the cache are thread-safe."""

    __slots__ = ("cache", "sealed_tail_bytes", "store")

    def __init__(self, store: ContentStore, cache: StringCache | None) -> None:
        self.store = store
        self.cache = cache
        self.sealed_tail_bytes = 0  # bytes of the tails in the store (stats, with no fetch)

    def new_turn(self) -> RemoteTurn:
        """A fresh turn that can be sealed (its record kept in the store)."""
        return RemoteTurn()

    def put(
        self, turn: Turn, response_plain: Callable[[], bytes | None] | None = None
    ) -> tuple[bytes, bytes | None] | None:
        """Put the record of `turn` (built, not yet committed) into the store; returns what
        `seal` needs, or None when the turn stays in the process. Store errors propagate.

        A response holding blob references is not its plain packing: `response_plain` gives
        that (from the fresh value), whose SHA-256 its echo is confirmed by; without it such
        a turn stays in the process."""
        if type(turn) is not RemoteTurn or turn.records is not None:
            return None
        tail, response = turn.tail, turn.response
        refs = response is not None and turn.flags & TurnFlag.RESPONSE_REFS
        if not refs and len(tail) + (len(response or b"")) < MIN_RECORD_BYTES:
            return None
        plain = response
        if refs:
            plain = response_plain() if response_plain is not None else None
            if plain is None:
                return None
        record = b"".join((_U32.pack(len(tail)), tail, response or b""))
        key = self.store.put(record)
        return key, (content_key(plain) if plain is not None else None)

    def seal(self, turn: Turn, keys: tuple[bytes, bytes | None] | None) -> None:
        """Keep only the keys `put` returned in `turn` (the commit: nothing can fail)."""
        if keys is None or type(turn) is not RemoteTurn:
            return
        record_key, response_key = keys
        self.sealed_tail_bytes += len(turn.tail)
        turn.build((record_key,), turn.n_rest, response_key, turn.digest, turn.rkey)
        turn.records = self

    def fetch(self, key: bytes, has_response: bool) -> tuple[bytes, bytes | None]:
        """The tail and response stored under `key`: from the cache, else from the store
        (verified against the key there), then cached."""
        cache = self.cache
        record = cache.get_bytes(key) if cache is not None else None
        if record is None:
            record = self.store.get(key)
            if cache is not None:
                cache.put_bytes(key, record)
        if len(record) < 4 or _U32.unpack_from(record)[0] > len(record) - 4:
            raise CorruptObjectError(
                "a turn record is malformed", key=key, actual=content_key(record)
            )
        end = 4 + _U32.unpack_from(record)[0]
        if not has_response and end != len(record):
            raise CorruptObjectError(
                "a turn record holds a response its turn does not have",
                key=key,
                actual=content_key(record),
            )
        return record[4:end], (record[end:] if has_response else None)


class RemoteTurn(Turn):
    """A `Turn` whose tail and response may be kept in a content store (`records` is then
    the graph's `TurnRecords`; None while they are in `data`, as in any turn).

    Reading `tail` or `response` of a sealed turn fetches its record; setting either brings
    the record back into the process first.
    """

    __slots__ = ("records",)

    records: TurnRecords | None

    def __init__(self) -> None:
        super().__init__()
        self.records = None

    def _record(self) -> tuple[bytes, bytes | None]:
        records = self.records
        assert records is not None
        return records.fetch(super().tail, bool(self.flags & TurnFlag.HAS_RESPONSE))

    def echo_key(self) -> bytes | None:
        """The SHA-256 of the response's plain packing when the response is kept in the
        store (None when it is in `data`, or there is none)."""
        if self.records is None or not self.flags & TurnFlag.HAS_RESPONSE:
            return None
        return super().response

    def unseal(self) -> None:
        """Bring the tail and the response back into `data` (a fetch)."""
        records = self.records
        if records is not None:
            tail, response = self._record()
            records.sealed_tail_bytes -= len(tail)
            self.records = None
            self.build((tail,), self.n_rest, response, self.digest, self.rkey)

    @property
    def tail(self) -> bytes:
        if self.records is None:
            return super().tail
        return self._record()[0]

    @tail.setter
    def tail(self, tail: bytes) -> None:
        self.unseal()
        _set_tail(self, tail)

    @property
    def response(self) -> bytes | None:
        if self.records is None or not self.flags & TurnFlag.HAS_RESPONSE:
            return super().response
        return self._record()[1]

    @response.setter
    def response(self, response: bytes | None) -> None:
        self.unseal()
        _set_response(self, response)


def tail_bytes(turns: list[Turn], records: TurnRecords | None) -> int:
    """The bytes of the request tails of `turns` (a graph's, over `records`), reading none
    from the store."""
    if records is None:
        return sum(len(turn.tail) for turn in turns)
    kept = (t for t in turns if type(t) is not RemoteTurn or t.records is None)
    return sum(len(turn.tail) for turn in kept) + records.sealed_tail_bytes


def echo_by_key(turn: Turn, plain: bytes) -> bool | None:
    """Whether `plain` is the plain packing of the response of `turn`, told by its key when
    the response is kept in a store; None when it is in the process (compare the bytes)."""
    if type(turn) is not RemoteTurn:
        return None
    key = turn.echo_key()
    if key is None:
        return None
    return len(key) == KEY_SIZE and content_key(plain) == key

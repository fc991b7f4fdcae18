"""The compiled engine (`rollout_store._core`): content table, exact JSON, packed values,
file frames of versions 2 and 1 and the file format's constants."""

import os
from collections.abc import Callable
from typing import Any, Final, final

__all__ = [
    "answer_reply",
    "AsciiText",
    "Blake3",
    "body_too_deep",
    "direct_tail",
    "check_packed",
    "ContentTable",
    "DataPlane",
    "dumps",
    "loads",
    "DecodeError",
    "encode_blob_frame",
    "encode_blob_frame_v1",
    "encode_frame",
    "encode_frame_v1",
    "intact_end_after_v1",
    "json_fields",
    "json_member_ids",
    "json_u32_ids",
    "frame_chain_value",
    "FrameScan",
    "FrameTooLarge",
    "Unconfirmed",
    "KeyNumbers",
    "Ledger",
    "next_frame",
    "read_gap",
    "__version__",
    "DEFAULT_MAX_DEPTH",
    "MAX_DEPTH",
    "BLOB_PREFIX_V1",
    "DIGEST_SIZE",
    "ESCAPE",
    "ESCAPED",
    "HEADER_LAYOUT",
    "HEADER_LAYOUT_V1",
    "HEADER_SIZE",
    "HEADER_SIZE_V1",
    "MAGIC_V1",
    "MAGIC_V2",
    "MAX_PAYLOAD",
    "MAX_PAYLOAD_V1",
    "SYNC",
    "Packer",
    "PendingTip",
    "RequestTable",
    "SizedIndex",
    "link_echoes",
    "splice",
    "RefusedValue",
    "unpack",
    "u32_ids",
]

__version__: Final[str]
#: nesting bound of `loads` and `dumps` when none is given
DEFAULT_MAX_DEPTH: Final[int]

#: containers a recorded value may nest (one more is refused)
MAX_DEPTH: Final[int]

#: the magic a version-1 file starts with
MAGIC_V1: Final[bytes]
#: the magic a version-2 file starts with
MAGIC_V2: Final[bytes]
#: bytes valid UTF-8 never holds: a version-2 payload holding them is written escaped
ESCAPE: Final[bytes]
#: the marker every version-2 frame starts with
SYNC: Final[bytes]
#: kind bit of a version-2 frame: the payload is escaped on disk
ESCAPED: Final[int]
#: a version-2 frame header as a `struct` format: sync, kind, length, previous chain, chain
HEADER_LAYOUT: Final[str]
HEADER_SIZE: Final[int]
#: a version-1 frame header as a `struct` format: kind, length, checksum
HEADER_LAYOUT_V1: Final[str]
HEADER_SIZE_V1: Final[int]
#: the largest payload a version-2 frame holds on disk
MAX_PAYLOAD: Final[int]
#: the largest payload a version-1 frame holds
MAX_PAYLOAD_V1: Final[int]
#: a blob payload's leading digest (xxh3-128)
DIGEST_SIZE: Final[int]
#: how a version-1 blob payload starts: a msgpack array of 2, then `bin` of 16 (the digest)
BLOB_PREFIX_V1: Final[bytes]

class RefusedValue(ValueError):
    """A value the library cannot record: `args` are the message and the path inside the value."""

@final
class Packer:
    """Validates and packs values for one graph (not shared between threads: the graph uses it
    under its lock)."""

    def __new__(cls, intern: Callable[[str], int] | None, threshold: int | None) -> Packer:
        """`intern`: str -> the blob's number << 1 | whether it holds lone surrogates (a blob
        table's `packer_intern`), or None: every string inline."""
    @property
    def last_special(self) -> bool: ...
    @property
    def last_refs(self) -> bool: ...
    @property
    def last_longest(self) -> int: ...
    def pack(self, value: Any) -> bytes:
        """The packing of `value`; `last_special` then tells whether it holds a tuple, a big int
        or a lone surrogate. `RefusedValue(message, path)` for a bad value; exceptions of
        `intern` pass through."""
    def _pack_then_panic(self, value: Any) -> bytes:
        """Tests only: `pack`, then a Rust panic before anything is returned (blobs interned by
        the walk stay interned: the caller's rollback must undo them)."""
    def release(self) -> None:
        """Let the kept buffer go."""

@final
class Blake3:
    """A BLAKE3 state: `update` with bytes-like objects, `copy`, `digest` (32 bytes). Kept
    compactly (the engine's `digest::State`: its subtrees' chaining values and its last
    chunk, a few hundred bytes where BLAKE3's own state takes about 1.9 KB)."""

    def __new__(cls, data: bytes | memoryview | None = None) -> Blake3: ...
    def update(self, data: bytes | memoryview) -> None:
        """Feed the bytes of a contiguous bytes-like object (bytes, a memoryview of bytes)."""
    def update_hollow(
        self, data: bytes, start: int, end: int, holes: list[tuple[int, int, str]]
    ) -> bool:
        """Feed `data[start:end]` but its holes, when each hole `(hole_start, hole_end, text)`
        (in order, inside that range) holds exactly the UTF-8 of its `str`; else False, and
        nothing is fed. An ASCII text is compared in place (no copy of it)."""
    def copy(self) -> Blake3:
        """A state of its own that has seen what this one has."""
    def digest(self) -> bytes:
        """The digest of everything fed so far (the state goes on)."""
    @property
    def nbytes(self) -> int:
        """Bytes of heap the state holds (what `tracemalloc` does not see)."""

def json_member_ids(text: bytes, key: str) -> tuple[int, int, bytes] | None:
    """`(start, end, ids)`: where the last top-level member `key` (written without escapes) of
    the JSON object `text` holds its array of ids, packed as `json_u32_ids` packs them; None
    when it holds anything else, or is missing, or `text` is not an object the scan can
    follow. The other members are skipped, not checked: decode `text` with that span put out
    of the way, which checks them. The GIL is released for texts from `DETACH_FROM` bytes."""

def answer_reply(answer: bytes, token_ids: bool, logprobs: bool) -> bytes | None:
    """The reply to a complete answer the upstream sent with a 2xx status: `answer` itself
    when neither `token_ids` nor `logprobs` is to be taken out, else the answer with those
    capture fields taken out as a streamed chunk's are (`prompt_token_ids` and each choice's
    `token_ids` removed, each choice's `logprobs` made null), written compactly; None when
    `answer` is not surely a JSON object that `json.loads` reads (strict UTF-8, nested at
    most `DEFAULT_MAX_DEPTH` deep, no int of more than 18 digits), or a key of the fields
    looked at is escaped: decode it then. The GIL is released for answers from
    `DETACH_FROM` bytes."""

def direct_tail(
    body: bytes, capture_tokens: bool, max_digits: int, anthropic: bool = False
) -> tuple[int, bytes] | None:
    """The upstream body of a model call the data plane's direct lane sends by itself (`--ack
    fast`), as `(head, tail)`: the body's own `body[:head]`, then `tail`; None when the
    control plane prepares the call (`gateway::direct::body_tail`; `anthropic`: a
    `/v1/messages` call). For tests: the lane must send what the control plane's
    `upstream_parts` makes of the body."""

def body_too_deep(body: bytes, anthropic: bool) -> str | None:
    """The first field (in the body's order) of a model call's body that nests deeper than
    it may, by name, as the data plane's depth check judges it before anything else of the
    body; None when none does, or the check leaves the body to the control plane. For the
    Python server to refuse such a body for that reason first, as the data plane does. The
    GIL is released for bodies from `DETACH_FROM` bytes."""

def json_fields(text: bytes) -> list[tuple[str, int, int]] | None:
    """The top-level fields of a JSON object text as `(key, start, end)` (each value's byte
    range), in the text's order, a repeated key each time; None when the text is not one
    object or a key is written with an escape. The structure is followed, the tokens are not
    checked: the capture server's data plane hands these to `split_body` for a body its full
    decode found valid strict UTF-8."""

def json_u32_ids(text: bytes) -> bytes | None:
    """Token ids as native-endian u32 (an `array('I')`'s bytes) read from `text`, a JSON array
    of ints in [0, 2**32) as JSON writes them; else None (decode it as `json.loads` would).
    The GIL is released for texts from `DETACH_FROM` bytes."""

def u32_ids(ids: list[Any]) -> bytes | None:
    """Token ids as native-endian u32 (an `array('I')`'s bytes) when `ids` holds only exact
    ints in [0, 2**32); else None (a bool, an int subclass, anything else). One pass."""

def check_packed(
    data: bytes | memoryview,
    n_blobs: int,
    max_depth: int,
    *,
    blob_surrogates: Callable[[int], bool] | None = None,
    echo_ok: bool = False,
    record: bool = False,
    max_containers: int | None = None,
) -> tuple[int, bool, int, bytes]:
    """Check one stored packed value without building it (see the engine's `packed_check`):
    `(top_items, special, echoes, blob_refs)`, `blob_refs` the offsets of the blob references
    as native-endian u32 (an `array('I')`'s bytes). `blob_surrogates(index)` tells whether a
    blob holds a lone surrogate. `ValueError` naming what is wrong and its byte offset."""

def unpack(data: bytes, blob: Callable[[int], Any], echo: Callable[[], Any] | None = None) -> Any:
    """Rebuild one packed value: fresh containers, a tuple where one was recorded, each blob
    reference as what `blob(index)` returns (the table's own `str`), the echo placeholder as
    what `echo()` returns (refused without one)."""

def link_echoes(response: bytes, message: bytes) -> bool | None:
    """Whether the message whose plain packing is `message` echoes, loosely, the response
    whose plain packing is `response` (their link keys equal, as the library's
    `response_link_key` and `link_key` compare in Python); None where bytes cannot tell (a
    NaN, a text part whose text is not a string, a packing that is not plain): Python decides
    then."""

def splice(data: bytes, refs: bytes, blob: Callable[[int], str]) -> bytes:
    """The plain packing of a stored packed value: each blob reference (at the offsets `refs`
    gives, as `check_packed` found them: native-endian u32s) replaced by the plain packing of
    its string, `blob(index)`, as `Packer(None, None)` packs a str (`EXT_SURROGATE` with a
    lone surrogate); the bytes between are kept as they are. `ValueError` when an offset is
    not a blob reference's (out of order, past the end, another type)."""

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

@final
class KeyNumbers:
    """64-bit keys to the numbers filed under them (ints below 2**32, each key's in filing
    order): a content table's index, with no Python object an entry."""

    def __new__(cls) -> KeyNumbers: ...
    def add(self, key: int, number: int) -> None:
        """File `number` under `key`, after the numbers filed there before."""
    def get(self, key: object) -> int | tuple[int, ...] | None:
        """The numbers under `key`: None (none, or `key` is no 64-bit int), the one number, or a
        tuple of them in filing order (what `engine.index.index_members` reads)."""
    def pop_last(self, key: int, number: int) -> bool:
        """Take `number` out from under `key` if it is the number filed there last (a rolled-back
        addition); whether it was."""
    def shared(self) -> list[tuple[int, ...]]:
        """The numbers of each key under which several are filed, each key's as a tuple in
        filing order (the keys in no set order): a table's contents that share a key."""
    def __len__(self) -> int:
        """How many keys."""
    @property
    def nbytes(self) -> int:
        """Bytes of heap the index holds (what `tracemalloc` does not see)."""

@final
class SizedIndex:
    """Turn numbers under 64-bit keys, each filed with a length; a key of more than `small`
    turns holds them by length, a large length group by content digest (see
    `engine::sized_index`).

    The content functions are Python callables, called with nothing held: filing asks the
    index what it needs, computes it, then files (asking again if the index changed
    meanwhile)."""

    def __new__(cls, small: int = 8) -> SizedIndex: ...
    def add(
        self, key: int, item: int, length: int, content: Callable[[int], int] | None = None
    ) -> None:
        """File turn `item` under `key` with `length`. `content(turn)`, if given, is the content
        digest (a 64-bit int) a large length group holds turns by; called only when needed."""
    def add_all(self, keys: list[int], item: int, length: int) -> None:
        """File turn `item` under each of `keys` with `length`, no content digests (a root
        under its prompt's heads and blocks): one call for them all."""
    def remove_all(self, keys: list[int], item: int, length: int) -> int:
        """Take turn `item`, filed with `length`, from under each of `keys`; how many held it."""
    def remove(self, key: int, item: int, length: int) -> bool:
        """Take turn `item`, filed with `length`, from under `key`; whether it was there."""
    def members(self, key: int, low: int = 0, high: int = ...) -> list[int]:
        """The turns under `key` that may have a length in `[low, high)`: every turn of a key of
        few (the caller checks each), the groups in range of a large one."""
    def exact(self, key: int, low: int, high: int, content_at: Callable[[int], int]) -> list[int]:
        """`members`, but of a group held by content only the turns whose digest is
        `content_at(length)` (a 64-bit int; the caller still checks each)."""
    def __contains__(self, key: object, /) -> bool: ...
    def __len__(self) -> int:
        """Keys that hold a turn."""
    def items(self) -> list[tuple[int, list[int]]]:
        """Every key with its turns, as `(key, [turn, ...])` (in no set order of keys)."""
    @property
    def visited(self) -> int:
        """Turns handed out by `members` and `exact` so far (what tests hold to bounds)."""
    @property
    def nbytes(self) -> int:
        """Bytes of heap the index holds (what `tracemalloc` does not see)."""

@final
class RequestTable:
    """A graph's filed requests and the one base-finder: `find` the longest filed request a
    request starts with (the first filed of twins), `file` a request under its digest. Raw
    texts of messages are read as `json.loads` reads them, from the latest raw tip they
    re-send (`find_json`, `add_json`)."""

    def __new__(cls, *, hole_min: int = ...) -> RequestTable:
        """`hole_min`: strings of this many code points or more (1,024 by default) are a
        decoded tip's holes (see `add_messages`)."""
    def find(
        self, plains: list[bytes], *, refuted: list[int] = ...
    ) -> tuple[int | None, int, bool, bytes]:
        """`(base, base_len, echo, digest)` for a request whose non-system messages pack as
        `plains`: the filed turn it extends (None: none) and its message count, whether the
        message after those has the xxh3 of that turn's response (confirm it with the bytes),
        and the request's digest.
        `Unconfirmed` when it may extend a turn filed by its key alone (`file_key`) and not
        in `refuted`."""
    def find_after(
        self, state: Blake3, first: int, plains: list[bytes], *, refuted: list[int] = ...
    ) -> tuple[int | None, int, bool, bytes]:
        """`find` for a request whose first `first` messages are known to be those of a
        filed request whose packings `state` has hashed (a raw tip's), the others packing
        as `plains`: only those are hashed. No base shorter than `first` messages is looked
        for."""
    def find_messages(
        self, packer: Packer, messages: list[Any], *, refuted: list[int] = ...
    ) -> tuple[int, list[bytes], tuple[int | None, int, bool, bytes]]:
        """`(first, plains, (base, base_len, echo, digest))` for a request whose non-system
        messages are `messages` (Python values), packed by `packer` (a plain one: no
        `intern`) in one walk with no `bytes` object a message: `plains` are the packings of
        messages `first` on (the base's message count: the messages a stored tail holds).
        Raises what `Packer.pack` raises for a message it refuses (the path starts with its
        index), and `Unconfirmed` as `find`."""
    def find_tipped(
        self, packer: Packer, messages: list[Any], *, refuted: list[int] = ...
    ) -> tuple[int, list[bytes], tuple[int | None, int, bool, bytes], PendingTip | None]:
        """`find_messages`, and the decoded tip the request would leave (see
        `add_messages`), for `file` to keep when the request is filed (None: it leaves
        none)."""
    def add_messages(
        self,
        turn: int,
        packer: Packer,
        messages: list[Any],
        response: bytes | None = None,
        *,
        refuted: list[int] = ...,
    ) -> tuple[int, list[bytes], tuple[int | None, int, bool, bytes]]:
        """`find_messages`, then `file` the request as turn `turn` (with its response's plain
        packing). A request holding strings of `hole_min` code points or more becomes its
        conversation's decoded tip: a later request that re-sends it is known by comparing
        those strings (not hashing them again) and only its new messages are hashed. Nothing
        is filed when it raises."""
    def drop_tips(self) -> None:
        """Let go of the decoded tips: they only spare a later request hashing what it
        re-sends."""
    @property
    def decoded_tips(self) -> int:
        """Decoded tips kept (see `add_messages`)."""
    def tip_strings(self) -> list[str]:
        """The long strings the decoded tips hold, oldest tip first (for tests)."""
    @property
    def decoded_tip_hits(self) -> int:
        """Requests filed by `add_messages` that were read from a decoded tip on (their long
        strings compared, only their new messages hashed)."""
    def find_json(
        self, text: bytes, /, *, max_depth: int = ..., refuted: list[int] = ...
    ) -> tuple[int, list[bytes], tuple[int | None, int, bool, bytes]]:
        """`(first, plains, (base, base_len, echo, digest))` for a request given as the JSON
        text of its non-system messages (an array), read as `json.loads` reads it: `plains`
        are the packings of messages `first` on (those before are the raw tip's it re-sends,
        not read again). `DecodeError` for text that is not JSON or nests deeper than
        `max_depth` (by default each message as deep as the graph takes a value:
        `MAX_DEPTH + 1`), `ValueError` for one that is not an array or holds an int
        `json.loads` refuses."""
    def add_json(
        self,
        turn: int,
        text: bytes,
        response: bytes | None = None,
        *,
        max_depth: int = ...,
        refuted: list[int] = ...,
    ) -> tuple[int, list[bytes], tuple[int | None, int, bool, bytes]]:
        """`find_json`, then `file` the request as turn `turn` (with its response's plain
        packing): it becomes its conversation's raw tip, the one a text re-sending it is read
        from. Nothing is filed when it raises."""
    @staticmethod
    def tail(plains: list[bytes], base_len: int, echo: bool) -> bytes:
        """The stored tail of a request whose messages pack as `plains`, found to extend a
        request of `base_len` messages (`echo`: the next is its response): an array header,
        then the packings after the base's, the first as the echo placeholder if it is one."""
    def file(
        self,
        turn: int,
        n_rest: int,
        digest: bytes,
        response: bytes | None = None,
        *,
        tip: PendingTip | None = None,
    ) -> None:
        """File turn `turn`'s request of `n_rest` messages under its 32-byte `digest`, with
        its response's plain packing (None: no response), and keep the decoded tip
        `find_tipped` gave for it. Turns are filed in increasing order; `ValueError`
        otherwise, and nothing changes."""
    def file_key(self, turn: int, n_rest: int, key: int, response: bytes | None = None) -> None:
        """File turn `turn`'s request of `n_rest` messages by its 8-byte index `key` alone (a
        turn read from a file, whose record names that key), with its response's plain
        packing: unconfirmed until `confirm` (`find` raises `Unconfirmed` where it may be a
        base)."""
    def confirm(self, turn: int, digest: bytes) -> bool | None:
        """Confirm a turn filed by its key: its request's bytes were found equal to those of a
        request whose digest is `digest` (as `Unconfirmed` gives it). True: confirmed (or so
        already); False: `digest` is not under its key, or it is confirmed with another, and
        nothing changes; None: not filed."""
    @property
    def unconfirmed(self) -> int:
        """Turns filed by their key and not confirmed yet."""
    def prefixes(
        self, plains: list[bytes], *, most: int | None = None
    ) -> list[tuple[int, bytes, list[int]]]:
        """Every boundary of a request whose non-system messages pack as `plains` where it
        extends filed turns, longest first: `(len, digest, turns)`, the turns in filing
        order (a turn filed by its key alone is named where its key and count are met:
        compare the bytes, then `confirm` it), at most `most` of them (None: all)."""
    @staticmethod
    def keys(plains: list[bytes]) -> list[int]:
        """The index key of every prefix of a request whose messages pack as `plains`
        (`keys[m]`: of its first `m` messages)."""
    def note_child(self, turn: int) -> bool:
        """Note that a filed turn has a child (False: it is not filed)."""
    def has_children(self, turn: int) -> bool | None:
        """Whether a filed turn has a child (None: not filed)."""
    def filed_under(self, key: int) -> list[int]:
        """The turns filed under the index key `key` (a digest's first 8 bytes,
        little-endian, or the key a turn was filed by alone), in filing order."""
    def digest(self, turn: int) -> bytes | None:
        """The digest of a filed turn's request (None: not filed, or filed by its key alone
        and not confirmed)."""
    def n_rest(self, turn: int) -> int | None:
        """The message count of a filed turn's request (None: not filed)."""
    def echoes(self, turn: int, packed: bytes) -> bool | None:
        """Whether `packed` may be a filed turn's response: it has the xxh3 the row keeps
        (None: not filed; False: not, or no response). Confirm with the bytes."""
    @property
    def raw_tip_hits(self) -> int:
        """Raw texts filed that were read from a tip on (only their new messages read)."""
    def __len__(self) -> int: ...
    @property
    def nbytes(self) -> int:
        """Bytes the table holds, spare capacity included (what `tracemalloc` cannot see)."""

@final
class PendingTip:
    """The decoded tip a request leaves (`RequestTable.find_tipped`), kept by `file` with the
    request, or let go."""

    @property
    def n_rest(self) -> int:
        """The message count of the request it is the tip of."""
    def adopt(self, canonical: Callable[[str], str | None]) -> None:
        """Hold the graph's own object of each long string of the request's new messages:
        `canonical(s)` answers the string equal to `s` that the graph holds already, or
        None."""
    def strings(self) -> list[str]:
        """The long strings the tip holds, in order (for tests)."""

class Unconfirmed(LookupError):
    """The base of a request is undecided: it may extend a turn read from a file by its key
    alone. `args` are the message, that turn, its message count and the request's digest
    there: compare the bytes, then `confirm` the turn with that digest, or pass it in
    `refuted`."""

class FrameTooLarge(ValueError):
    """A record or string larger than a frame can hold (the message says which and its size)."""

def frame_chain_value(kind_byte: int, length: int, prev: int, hashed: bytes) -> int:
    """The chain value of a frame (`hashed`: its unescaped payload, a blob's: its digest)."""

def encode_frame(kind: int, payload: bytes, prev: int) -> tuple[bytes, int]:
    """(frame bytes, its chain value) for a record of `kind` after the frame valued `prev`."""

def encode_blob_frame(
    kind: int, digest: bytes, data: bytes | str, prev: int
) -> tuple[list[bytes | AsciiText], int]:
    """A blob frame as parts (header, digest, text) and its chain value; a whole escaped frame
    when the digest holds the escape bytes. The text is never copied: a `bytes` of UTF-8 is
    the part itself, an ASCII `str` is its storage (`AsciiText`); any other `str` is encoded
    with `surrogatepass` into a new `bytes`."""

@final
class AsciiText:
    """A blob's ASCII text as a frame's part: the str's own storage (which is its UTF-8) as a
    read-only buffer, so `os.writev` and `bytes.join` take it where the text would otherwise
    be encoded into a copy first."""

    def __len__(self) -> int: ...
    def __bytes__(self) -> bytes: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

def next_frame(
    data: bytes, after: int, digest_kinds: int, max_kind: int
) -> tuple[int | None, int, int, int]:
    """`(offset or None, hashed bytes, searched bytes, candidates)`: the first whole frame that
    verifies by itself after `after`, found with the GIL released."""

def read_gap(
    data: bytes,
    start: int,
    end: int,
    prev: int,
    record: int,
    digest_kinds: int,
    max_kind: int,
) -> tuple[int, int, list[int] | None, tuple[int, memoryview, int, int, int, int] | None, int]:
    """`(start, end, kinds or None, repaired frame tuple or None, hashed bytes)`: what the
    damaged bytes `[start, end)` held (`prev`: the chain value before them, `record`: the
    number of the first damaged frame), found with the GIL released."""

def encode_frame_v1(kind: int, payload: bytes) -> bytes:
    """The version-1 frame of a record of `kind` (to extend a version-1 log)."""

def encode_blob_frame_v1(kind: int, digest: bytes, data: bytes | str) -> list[bytes | AsciiText]:
    """A version-1 blob frame as parts: its header and payload up to the text, then the text
    (as `encode_blob_frame` holds it)."""

def intact_end_after_v1(data: bytes, start: int) -> tuple[bool, int, int, int]:
    """`(intact, hashed bytes, searched bytes, candidates)`: whether the version-1 file `data`
    ends with an intact frame that starts after the damaged one at `start`, found with the
    GIL released."""

@final
class FrameScan:
    """The frames of a file from `start`, verified in order with the GIL released when the scan
    is made (version 2: each bound to the one before it; `FrameScan.v1`: version 1, each by
    its own checksum); iterating yields them as (kind, payload, offset, record, end, chain)
    and stops at the end or at the first damage, which `damage` then describes."""

    def __new__(
        cls, data: bytes, start: int, chain: int, record: int, digest_kinds: int, max_kind: int
    ) -> FrameScan: ...
    @staticmethod
    def v1(data: bytes, start: int, record: int) -> FrameScan:
        """The frames of a version-1 file from `start` (numbered from `record`), each verified
        by its checksum (chain values 0); at damage, `torn` says whether it is a torn tail."""
    def __iter__(self) -> FrameScan: ...
    def __next__(self) -> tuple[int, memoryview, int, int, int, int]: ...
    @property
    def offset(self) -> int:
        """Where the frame after the last one read starts."""
    @property
    def chain(self) -> int:
        """The chain value the frame at `offset` must name."""
    @property
    def records(self) -> int:
        """The record number of the frame at `offset`."""
    @property
    def damage(
        self,
    ) -> tuple[str, int, int, tuple[str, int, int] | tuple[str, bytes, bytes] | None] | None:
        """None, or `(message, offset, record, checksum)` of the first damaged frame;
        `checksum` is None or `(what, expected, actual)` for a checksum that does not match
        (ints for a record's chain value, bytes for a blob's digest)."""
    @property
    def resync(self) -> int | None:
        """Where the next whole frame after the damage starts (None: a torn tail, or no
        damage)."""
    @property
    def torn(self) -> bool:
        """Whether the damage is a torn tail: no intact frame follows it (False: no damage)."""
    @property
    def counters(self) -> tuple[int, int, int]:
        """`(hashed bytes, searched bytes, candidates)`: the work the scan did."""

@final
class Ledger:
    """The `--ack fast` ledger's file: the one appender of the control plane's lines and of the
    data plane's direct lane (`gateway::ledger::Ledger`), one `write` a line."""

    def __new__(cls) -> Ledger: ...
    def open(self, path: str | os.PathLike[str], header: bytes) -> None:
        """Open `path` for appending (created 0600 if missing), unless a file is open already,
        `header` written first (no line of the direct lane comes before it)."""
    @property
    def is_open(self) -> bool:
        """Whether a file is open."""
    def close(self) -> None:
        """Let the file go."""
    def append(self, data: bytes) -> None:
        """Append `data` (whole lines) in one `write`; `OSError` when no file is open or the
        write fails."""
    def replace(self, fresh: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
        """Put `fresh` (the rewritten ledger, synced whole) in place of `path` and append to it
        from now on, the direct lane's lines not applied yet appended to it first (a deleted
        session's not)."""
    def applied(self, entry: int) -> None:
        """The direct lane's line `entry` (the number `adopt` was given with it) is known to the
        control plane."""
    @property
    def unapplied(self) -> int:
        """The direct lane's lines the control plane does not know yet."""

@final
class DataPlane:
    """The data plane: the model routes served by hyper on a runtime of its own, the rest
    proxied to the control plane's listener; the control plane's callbacks (`prepare`,
    `adopt`, `waits`, `finish`, `finish_stream`, `record`, `dropped`, `sent`) are methods of
    `control` (`record` returns the indices of the calls it set aside, `sent` False to be
    called again). `stop` ends it.
    `callers`: threads the callbacks run on (one when a callback never waits on I/O).
    `forward_only`: a floor for benchmarks (calls go upstream and come back as they came,
    with no key, no callback and nothing recorded).
    `direct`: `--ack fast`'s direct lane, `(capture_tokens, max_digits, Chat Completions
    headers, Anthropic headers, ledger)` (a header with no value: the call's own): the model
    calls sent upstream and answered with no callback, their
    ack ledger line written (to `ledger`, the control plane's, unless None) before the reply;
    the recorder hands each to the control's `adopt` first (None: every call is prepared)."""

    def __new__(
        cls,
        control: object,
        *,
        host: str,
        port: int,
        backend_port: int,
        upstream: str,
        hosts: list[str] | None,
        open_mode: bool,
        max_body_bytes: int,
        body_timeout: float,
        body_timeout_text: str,
        upstream_timeout: float,
        stream_keepalive: float,
        fast: bool,
        ack_queue: int,
        workers: int = 2,
        callers: int = 1,
        forward_only: bool = False,
        direct: tuple[
            bool,
            int,
            list[tuple[str, str | None]],
            list[tuple[str, str | None]],
            Ledger | None,
        ]
        | None = None,
    ) -> DataPlane: ...
    @property
    def port(self) -> int:
        """The port the listener is bound to."""
    def set_key(self, key: bytes, session_id: str, session: object | None = None) -> None:
        """Let `key` (UTF-8 bytes) open the session `session_id`; `session`: the control's
        object of it, which a call of the direct lane holds until it is answered (None: the
        session's calls are all prepared)."""
    def remove_key(self, key: bytes) -> bool:
        """Forget `key`; whether it was known."""
    def stream_begun(self, session_id: str) -> None:
        """A stream of `session_id` passes through, its turn not queued yet: the direct lane
        leaves the session's calls to `waits` until `stream_ended`."""
    def stream_ended(self, session_id: str) -> None:
        """One such stream's turn is queued, or let go."""
    def turns_sent(self) -> int:
        """The turns sent to the recorder so far (see `handed_through`)."""
    def handed_through(self, sent: int) -> bool:
        """Whether the recorder has handed the first `sent` turns to the control: every call
        answered before `turns_sent` said `sent` is known to it (the direct lane's adopted)."""
    def pending(self) -> int:
        """Turns queued (`fast`) and waiting for the recorder."""
    def settle(self, timeout: float) -> bool:
        """Wait at most `timeout` seconds until every queued turn is recorded or dropped;
        whether it was."""
    def stop(self, drain: float = 10.0) -> None:
        """Stop serving; the queued turns are recorded for at most `drain` seconds (the rest
        are reported dropped). Stopping twice does nothing."""

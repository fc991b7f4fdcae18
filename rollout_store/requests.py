"""Request storage: a turn's messages as an earlier turn's request plus a packed tail.

Fresh messages are packed at C speed and compared byte for byte with what is stored; only new
content takes the validating walk. Shared values (system messages, tools, sampling parameters)
are stored once per graph.
"""

from __future__ import annotations

from typing import Any

from .confirm import Probe, prefix_digest, prefix_keys
from .encoding import NotPackable, array_header, unpack
from .errors import InvalidValueError
from .messages import leading_system_count, link_key
from .turns import (
    ECHO_PACKED,
    MESSAGES_TUPLE,
    NO_MESSAGES,
    PREFIX_SPECIAL,
    RESPONSE_REFS,
    RESPONSE_SPECIAL,
    TAIL_ECHO,
    TAIL_REFS,
    TAIL_SLOW,
    TAIL_SPECIAL,
    Scratch,
    Turn,
    TurnNode,
    finish_tail,
    index_members,
    no_echo,
)


class _FastPrefixes:
    """Prefix keys, plains and confirmation of a request packed in one piece (`Probe`)."""

    __slots__ = ("_confirmed", "_graph", "_probe", "n_valid")

    def __init__(self, graph: RequestStore, probe: Probe) -> None:
        self._graph = graph
        self._probe = probe
        self._confirmed: dict[int, bool] = {}
        self.n_valid = probe.n

    def key(self, j: int) -> int:
        return self._probe.key(j)

    def plain(self, i: int) -> bytes | None:
        return self._probe.plain(i)

    def confirm(self, candidate: Turn, j: int) -> bool:
        """Whether the stored request of `candidate` is exactly the first `j` messages."""
        ok = self._confirmed.get(candidate.index)
        if ok is not None:
            return ok
        probe = self._probe
        if candidate.n_rest != j:
            ok = False
        elif candidate.digest is not None:
            ok = candidate.digest == probe.digest(j)
        else:  # not confirmed since it was read from a file: compare bytes once
            plains: list[bytes | None] = probe.all_plains()  # type: ignore[assignment]
            ok = self._graph._request_matches(candidate, plains, probe.messages)
            if ok:
                candidate.digest = probe.digest(j)
        if ok and candidate.flags & PREFIX_SPECIAL:
            valid = self._graph._valid
            messages = probe.messages
            ok = all(valid(messages[i], probe.plain(i)) for i in range(j))
        self._confirmed[candidate.index] = ok
        return ok

    def root_keys(self) -> list[int]:
        """Keys of every shorter prefix, the empty one too."""
        return self._probe.keys()[:-1]

    def own_digest(self) -> bytes:
        return self._probe.digest(self._probe.n)


class _SlowPrefixes:
    """The same for a request some of whose messages need the validating walk."""

    __slots__ = ("_confirmed", "_graph", "_keys", "_messages", "_plains", "n_valid")

    def __init__(
        self, graph: RequestStore, plains: list[bytes | None], messages: list[Any] | tuple[Any, ...]
    ) -> None:
        self._graph = graph
        self._plains = plains
        self._messages = messages
        self._confirmed: dict[int, bool] = {}
        self.n_valid = plains.index(None) if None in plains else len(plains)
        self._keys = prefix_keys(plains[: self.n_valid])  # type: ignore[arg-type]

    def key(self, j: int) -> int:
        return self._keys[j]

    def plain(self, i: int) -> bytes | None:
        return self._plains[i]

    def confirm(self, candidate: Turn, j: int) -> bool:
        ok = self._confirmed.get(candidate.index)
        if ok is None:
            ok = candidate.n_rest == j and self._graph._request_matches(
                candidate, self._plains, self._messages
            )
            self._confirmed[candidate.index] = ok
        return ok

    def root_keys(self) -> list[int]:
        return self._keys[:-1]

    def own_digest(self) -> bytes | None:
        if self.n_valid != len(self._plains):
            return None
        return prefix_digest(b"".join(self._plains))  # type: ignore[arg-type]


_Prefixes = _FastPrefixes | _SlowPrefixes


class RequestStore:
    """The request-storage half of `RolloutGraph` (a mixin: it uses the graph's tables)."""

    def _encode(self, value: Any, path: str) -> tuple[bytes, bool]:
        return self._encoder.encode(value, path)

    def _encode_response(self, value: Any, turn: Turn) -> bytes | None:
        if value is None:
            return None
        packed, special = self._encode(value, "response_message")
        if self._encoder.last_refs:  # else the packing is the plain one, nothing to expand
            turn.flags |= RESPONSE_REFS
        if special:
            turn.flags |= RESPONSE_SPECIAL
        return packed

    def _shared(
        self,
        items: list[Any] | tuple[Any, ...],
        path: str,
        plains: list[bytes | None],
        pending: list[tuple[bytes, bytes]],
        as_array: bool,
    ) -> bytes:
        """Items packed (as one array, or the single item), stored once per graph.

        Found again by the plain packing. Values holding tuples, big ints or lone surrogates
        are never shared this way, so a hit can never be imitated by a caller's own
        `msgpack.ExtType` objects.
        """
        header = array_header(len(items)) if as_array else b""
        plain = None if None in plains else header + b"".join(plains)  # type: ignore[arg-type]
        if plain is not None:
            found = self._values.find(plain)
            if found is None:
                found = next((stored for p, stored in pending if p == plain), None)
            if found is not None:
                return found
        if as_array:
            packed = [self._encode(item, f"{path}[{i}]") for i, item in enumerate(items)]
        else:
            packed = [self._encode(items[0], path)]
        stored = header + b"".join(b for b, _ in packed)
        if plain is not None and not any(special for _, special in packed):
            pending.append((plain, stored))
        return stored

    def _shared_value(self, value: Any, path: str, pending: list[tuple[bytes, bytes]]) -> Any:
        if value is None:
            return None
        return self._shared([value], path, [self._plain(value)], pending, as_array=False)

    def _valid(self, value: Any, plain: bytes | None) -> bool:
        """Whether `plain` is the packing of `value` by the validating walk."""
        try:
            return plain is not None and self._canonical.encode(value, "")[0] == plain
        except InvalidValueError:
            return False

    def _is_echo(self, base: Turn, message: Any, plain: bytes | None) -> bool:
        """Whether `message` is exactly the response of `base`."""
        if plain is None or base.response is None or plain != self._response_plain(base):
            return False
        return not base.flags & RESPONSE_SPECIAL or self._valid(message, plain)

    def _prepare_request(self, turn: Turn, node: TurnNode, scratch: Scratch) -> bytes | None:
        """Store the request as system part + base turn + tail; return the system plain."""
        messages = node.request_messages
        pending = scratch.pending
        if messages is None:
            turn.system, turn.base, turn.tail, turn.n_rest = None, None, b"", 0
            turn.first = turn.body_start = 0
            turn.flags |= NO_MESSAGES
            return None
        if not isinstance(messages, list | tuple):
            raise InvalidValueError(
                f"expected a list of messages, got {type(messages).__name__}", "request_messages"
            )
        if isinstance(messages, tuple):
            turn.flags |= MESSAGES_TUPLE
        n_sys = leading_system_count(messages)
        rest = messages[n_sys:]
        pack = self._pack_plain
        probe: Probe | None
        try:
            probe = Probe(rest, pack, self._message_size)
            if probe.plains:
                self._message_size = len(probe.plains[-1]) // 2 + self._message_size // 2
        except Exception:  # some message needs the validating walk: find which
            probe = None
        try:
            system_plains: list[bytes | None] = [pack(m) for m in messages[:n_sys]]
        except Exception:
            system_plains = [self._plain(m) for m in messages[:n_sys]]

        # system part: shared whole through the value table
        system_plain = None
        turn.system = None
        if n_sys:
            turn.system = self._shared(
                messages[:n_sys], "request_messages", system_plains, pending, as_array=True
            )
            if None not in system_plains:
                system_plain = b"".join(system_plains)  # type: ignore[arg-type]

        if probe is not None:
            prefixes: _Prefixes = _FastPrefixes(self, probe)
        else:
            prefixes = _SlowPrefixes(self, [self._plain(m) for m in rest], rest)
        n_valid = prefixes.n_valid
        if n_valid == len(rest):
            scratch.request_digest = prefixes.key(n_valid)
            scratch.prefixes = prefixes  # for root keys and the digest, at commit

        want_parent = node.parent_id is None and node.prompt_ids is None
        base: Turn | None = None
        parent: Turn | None = None
        exact = prefixes.confirm

        # Deepest first: the storage base is the longest stored request that this one
        # extends; the parent, the longest whose response is echoed next (an exact echo
        # preferred to a loose one).
        for j in range(n_valid, -1, -1):
            can_link = want_parent and j < len(rest)
            if base is not None and not can_link:
                if not want_parent:
                    break
                continue
            found = self._request_index.get(prefixes.key(j))
            if found is None:
                continue
            members = [c for c in index_members(found) if c.n_rest == j]
            if not members:
                continue
            if base is None:
                base = next((c for c in members if exact(c, j)), None)
                if base is None:
                    continue
                if j == len(rest):  # identical requests whose continuations may move here
                    scratch.twins = [c for c in members if c.children and exact(c, j)]
            if not can_link:
                continue
            message, plain = rest[j], prefixes.plain(j)
            parent = next(
                (c for c in members if self._is_echo(c, message, plain) and exact(c, j)), None
            ) or next((c for c in members if self._echoes(c, message, plain) and exact(c, j)), None)
            if parent is not None:
                break
        scratch.message_parent = parent

        start = base.n_rest if base is not None else 0
        pieces: list[bytes] = []
        for i in range(start, len(rest)):
            p = prefixes.plain(i)
            if i == start and base is not None and self._is_echo(base, rest[i], p):
                pieces.append(ECHO_PACKED)
                turn.flags |= TAIL_ECHO
                continue
            packed, special = self._encode(rest[i], f"request_messages[{n_sys + i}]")
            if packed != p:
                turn.flags |= TAIL_REFS
            if special:
                turn.flags |= TAIL_SPECIAL
            pieces.append(packed)
        turn.base = base
        turn.tail = array_header(len(pieces)) + b"".join(pieces)
        turn.n_rest = len(rest)
        finish_tail(turn)
        return system_plain

    def _request_matches(
        self, turn: Turn, plains: list[bytes | None], messages: list[Any] | tuple[Any, ...]
    ) -> bool:
        """Whether the non-system request of `turn` is exactly `messages[:turn.n_rest]`.

        `plains` are the messages' plain packings; the stored tails are compared with them
        byte for byte, after rebuilding tails that hold blob references.
        """
        end = turn.n_rest
        if end > len(plains):
            return False
        join = b"".join
        node: Turn | None = turn
        try:
            while node is not None:
                start = node.first
                if node.flags & TAIL_SLOW:
                    if not self._tail_matches(node, plains, messages, start, end):
                        return False
                else:
                    # the common case inline: a plain tail, maybe after the echo of the
                    # base's plain response
                    if node.flags & TAIL_ECHO:
                        if start >= end or plains[start] != node.base.response:  # type: ignore[union-attr]
                            return False
                        body = join(plains[start + 1 : end])  # type: ignore[arg-type]
                    else:
                        body = join(plains[start:end])  # type: ignore[arg-type]
                    tail = node.tail
                    if len(body) + node.body_start != len(tail) or not tail.endswith(body):
                        return False
                end = start
                node = node.base
        except TypeError:  # a message with no plain packing never matches
            return False
        return end == 0

    def _tail_matches(
        self,
        turn: Turn,
        plains: list[bytes | None],
        messages: list[Any] | tuple[Any, ...],
        start: int,
        end: int,
    ) -> bool:
        """Whether the tail of `turn` is exactly `messages[start:end]`."""
        tail = turn.tail
        i = start
        echo = turn.flags & TAIL_ECHO
        if echo:
            base = turn.base
            if i >= end or base is None or not self._is_echo(base, messages[i], plains[i]):
                return False
            i += 1
        if turn.flags & TAIL_REFS:
            # blob references: rebuild the values (blobs are the table's own strings, no
            # copy) and pack them with every string inline, then compare bytes
            try:
                values = unpack(tail, self.blobs.string, no_echo)
            except ValueError:  # a stored value that cannot be rebuilt never matches
                return False
            if echo:
                del values[0]
            if len(values) != end - i:
                return False
            plain = self._plain
            if any(plain(value) != plains[k] for k, value in enumerate(values, i)):
                return False
        else:
            try:
                joined = b"".join(plains[i:end])  # type: ignore[arg-type]
            except TypeError:  # a message with no plain packing
                return False
            overhead = len(array_header(end - start)) + (i - start) * len(ECHO_PACKED)
            if len(joined) + overhead != len(tail) or not tail.endswith(joined):
                return False
        if turn.flags & TAIL_SPECIAL:
            return all(self._valid(messages[k], plains[k]) for k in range(i, end))
        return True

    def _plain(self, value: Any) -> bytes | None:
        """The exact packing of a value with every string inline, or None if it is invalid.

        msgpack packs almost every value at C speed; lone surrogates, subclasses and very deep
        tuples take the validating walk (with no blob table) instead.
        """
        try:
            return self._pack_plain(value)
        except (NotPackable, ValueError, TypeError, OverflowError, RecursionError, BufferError):
            pass
        try:
            return self._canonical.encode(value, "")[0]
        except (InvalidValueError, RecursionError):
            return None

    def _expand(self, stored: bytes) -> bytes | None:
        """The plain packing of a stored value: its blobs inline again."""
        try:
            return self._plain(unpack(stored, self.blobs.string))
        except ValueError:
            return None

    def _response_value(self, turn: Turn) -> Any:
        return None if turn.response is None else unpack(turn.response, self.blobs.string)

    def _response_plain(self, turn: Turn) -> bytes | None:
        if turn.response is None:
            return None
        if not turn.flags & RESPONSE_REFS:
            return turn.response
        return self._expand(turn.response)

    def _echoes(self, turn: Turn, message: Any, plain: bytes | None) -> bool:
        """Whether `message` is the echo of the turn's response (exactly or loosely)."""
        if turn.response is None:
            return False
        if self._is_echo(turn, message, plain):
            return True
        try:
            return bool(link_key(self._response_value(turn)) == link_key(message))
        except Exception:  # a malformed fresh message simply does not match
            return False

    def _rest_values(self, turn: Turn) -> list[Any]:
        chain: list[Turn] = []
        node: Turn | None = turn
        while node is not None:
            chain.append(node)
            node = node.base
        out: list[Any] = []
        for owner in reversed(chain):
            base = owner.base
            echo = (lambda b=base: self._response_value(b)) if base is not None else None
            out.extend(unpack(owner.tail, self.blobs.string, echo))
        return out

    def _request_messages(self, turn: Turn) -> list[Any] | tuple[Any, ...] | None:
        if turn.flags & NO_MESSAGES:
            return None
        messages: list[Any] = []
        if turn.system is not None:
            messages.extend(unpack(turn.system, self.blobs.string))
        messages.extend(self._rest_values(turn))
        return tuple(messages) if turn.flags & MESSAGES_TUPLE else messages

    def _value(self, packed: bytes | None) -> Any:
        return None if packed is None else unpack(packed, self.blobs.string)

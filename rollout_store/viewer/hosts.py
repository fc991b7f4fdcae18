"""Which `Host` (and `Origin`) a local server answers: the one check against DNS rebinding.

A page on another site can make a browser send requests to a server on the user's machine
by pointing a name it controls at 127.0.0.1 (DNS rebinding); the requests then carry that
name in their `Host` header. A server that answers only the names it was bound under (the
loopback names, its `--host`, and names it was told to allow) refuses them. The viewer
(`rollout-store view`) and the capture server (`rollout-store serve`) both call
`host_allowed`; the capture server also refuses a request whose `Origin` (which browsers
send on cross-site requests) names a host it would not answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

__all__ = [
    "ANY_HOST",
    "LOOPBACK_HOSTS",
    "WILDCARD_BINDS",
    "allowed_hosts",
    "host_allowed",
    "host_name",
    "origin_allowed",
]

#: The names of the loopback interface a browser sends in `Host`.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]"})
#: Given to `allowed_hosts`: answer any `Host` (behind a proxy that checks it).
ANY_HOST = "*"
#: Addresses that bind every interface: no name of their own to answer.
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::", "[::]"})


def host_name(value: str | None) -> str:
    """The host of a `Host` header value, lowercased, without its port ("" if none, or if
    what follows the host is not a port: `[::1]evil.example` names no host of ours)."""
    text = (value or "").strip().lower()
    if text.startswith("["):  # an IPv6 literal: "[::1]:8100"
        end = text.find("]")
        host, rest = (text[: end + 1], text[end + 1 :]) if end > 0 else ("", "")
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
        rest = ":" + port
    else:
        host, rest = text, ""
    port = rest[1:]
    if rest and not (rest[0] == ":" and (not port or (port.isascii() and port.isdigit()))):
        return ""
    return host


def _as_host(name: str) -> str:
    name = name.strip().lower()
    return f"[{name}]" if ":" in name and not name.startswith("[") else name


def allowed_hosts(bound: str | None = None, extra: Iterable[str] = ()) -> frozenset[str] | None:
    """The names a server bound to `bound` answers: the loopback names, `bound` itself
    (unless it is a wildcard such as 0.0.0.0) and `extra`; None (any) if `extra` has `*`."""
    names = set(LOOPBACK_HOSTS)
    if bound is not None and bound.strip() not in WILDCARD_BINDS:
        names.add(_as_host(bound))
    for name in extra:
        if name.strip() == ANY_HOST:
            return None
        names.add(_as_host(name))
    return frozenset(names)


def host_allowed(value: str | None, allowed: frozenset[str] | None) -> bool:
    """Whether a request with this `Host` header value is answered (`allowed` None: any)."""
    return allowed is None or host_name(value) in allowed


def origin_allowed(value: str | None, allowed: frozenset[str] | None) -> bool:
    """Whether a request with this `Origin` header value is answered: none (not a browser's
    cross-site request), or one naming an allowed host."""
    if value is None or allowed is None:
        return True
    try:
        netloc = urlsplit(value.strip()).netloc
    except ValueError:
        return False
    return bool(netloc) and host_name(netloc) in allowed

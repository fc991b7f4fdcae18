"""Several capture servers behind HAProxy: the balancer's configuration.

Each replica (`rollout-store serve --replica NAME`) mints keys that carry its name
(`rsk-NAME-...`), so the balancer sends every call made with a key to the replica that holds
its session: the name is read from the key, not hashed, and stays right when replicas are
added, removed or restarted. What the balancer reads as the key, in the order the server
itself reads it: `Authorization: Bearer KEY`, else `x-api-key: KEY` (the Anthropic SDKs'),
else a viewer's `?key=` or its cookie; it is copied into `X-Session-Key` (a client's own
`X-Session-Key` is dropped first). Requests whose key carries no replica's name (the admin
key, keys of sessions made before the replicas) are spread by a consistent hash of that
header; `POST /sessions` with a `session_id` in its body hashes that id, so two creates of
one id meet on one replica (the second gets 409); without one it goes round robin.
`X-Replica: NAME` sends a request (an admin's `GET /sessions`) to one replica.

`python -m rollout_store.serve.replicas --bind 127.0.0.1:8100 r1=127.0.0.1:8101 r2=...` prints the
configuration (`deploy/haproxy.cfg` is its output for two replicas on one host).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from ..errors import InvalidArgumentError

__all__ = ["REPLICA_NAME", "haproxy_config", "main", "replica_key_prefix"]

#: What a replica's name may be: letters and digits (no '-': the key's next character ends it).
REPLICA_NAME = re.compile(r"[A-Za-z0-9]{1,32}")
_ADDRESS = re.compile(r"[A-Za-z0-9.:\[\]-]+:[0-9]{1,5}")


def replica_key_prefix(name: str) -> str:
    """The prefix of the keys replica `name` mints (`rsk-NAME-`)."""
    if not REPLICA_NAME.fullmatch(name):
        raise InvalidArgumentError(
            f"replica name {name!r} must be 1-32 letters or digits (it is part of the "
            "session keys the balancer routes on)"
        )
    return f"rsk-{name}-"


def haproxy_config(
    replicas: Sequence[tuple[str, str]],
    bind: str = "127.0.0.1:8100",
    *,
    timeout_s: int = 660,
    body_timeout_s: int = 35,
    health_host: str = "127.0.0.1",
) -> str:
    """An HAProxy configuration balancing `replicas` ((name, "host:port") each) at `bind`.

    `timeout_s` bounds a call (keep it above the servers' `--upstream-timeout`, 600 s by
    default); `body_timeout_s` a request's headers and body (above `--body-timeout`).
    `health_host`: the `Host` the health checks send (a name the replicas answer).
    """
    if not replicas:
        raise InvalidArgumentError("replicas: give at least one NAME=HOST:PORT")
    names = [name for name, _ in replicas]
    for name, address in replicas:
        replica_key_prefix(name)
        if not _ADDRESS.fullmatch(address):
            raise InvalidArgumentError(f"replica {name}: address {address!r} must be HOST:PORT")
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"replica names must differ: {', '.join(names)}")
    if not _ADDRESS.fullmatch(bind):
        raise InvalidArgumentError(f"bind {bind!r} must be HOST:PORT")
    routes = "".join(
        f"    use-server {name} if {{ req.hdr(x-session-key) -m beg {replica_key_prefix(name)} }}\n"
        f"    use-server {name} if {{ req.hdr(x-replica) -m str {name} }}\n"
        for name in names
    )
    servers = "".join(
        f"    server {name} {address} check inter 1s fall 2 rise 1\n" for name, address in replicas
    )
    return f"""\
# rollout-store replicas behind HAProxy (made by `python -m rollout_store.serve.replicas`).
# A key names its replica (rsk-NAME-...): calls with it go there; other keys, and the
# session_id of POST /sessions, are hashed (consistent); see docs/replicas.md.
global
    maxconn 4096

defaults
    mode http
    option http-keep-alive
    timeout connect 2s
    timeout http-request {body_timeout_s}s
    timeout client {timeout_s}s
    timeout server {timeout_s}s

frontend rollout_store
    bind {bind}
    # the body is read before routing (POST /sessions is routed by its session_id)
    option http-buffer-request
    # the session key, as the server reads it: Bearer, else x-api-key, else the viewer's
    acl view_cookie req.cook(rollout_store_key) -m found
    acl view_query url_param(key) -m found
    acl x_api_key req.hdr(x-api-key) -m found
    acl bearer req.hdr(authorization) -m beg -i "bearer "
    acl create method POST
    acl create path /sessions
    http-request del-header x-session-key
    http-request set-header x-session-key %[req.cook(rollout_store_key)] if view_cookie
    http-request set-header x-session-key %[url_param(key)] if view_query
    http-request set-header x-session-key %[req.hdr(x-api-key)] if x_api_key
    http-request set-header x-session-key %[req.hdr(authorization),word(2,' ')] if bearer
    http-request set-var(txn.session_id) req.body,json_query('$.session_id') if create
    acl named var(txn.session_id) -m found
    http-request set-header x-session-key %[var(txn.session_id)] if named
    default_backend replicas

backend replicas
    balance hdr(x-session-key)
    hash-type consistent
{routes}    option httpchk
    http-check send meth GET uri /health ver HTTP/1.1 hdr host {health_host}
    http-check expect status 200
{servers}"""


def _replica(value: str) -> tuple[str, str]:
    name, sep, address = value.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=HOST:PORT")
    return name, address


def main(argv: Sequence[str] | None = None) -> int:
    """Print the HAProxy configuration for the replicas given as NAME=HOST:PORT."""
    parser = argparse.ArgumentParser(
        prog="python -m rollout_store.serve.replicas", description=__doc__.splitlines()[0]
    )
    parser.add_argument("replicas", nargs="+", type=_replica, metavar="NAME=HOST:PORT")
    parser.add_argument("--bind", default="127.0.0.1:8100", help="where HAProxy listens")
    parser.add_argument("--timeout", type=int, default=660, help="seconds a call may take")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(haproxy_config(args.replicas, args.bind, timeout_s=args.timeout))
    except InvalidArgumentError as exc:
        print(f"rollout_store.serve.replicas: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

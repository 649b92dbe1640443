"""A request's class as the mesh set it, for every front.

The filter decides a request's class at the edge and sends it as `x-infermesh-class` (it strips any
`x-infermesh-*` header a client sent). The sidecar takes that header only from a trusted peer, the
mesh's proxy (`server.trusted_peers`: loopback by default, where the local mesh's Envoy and Istio's
sidecar proxy connect from). Anything else a caller says about its class (the header from another
peer, gRPC's `GenerateRequest.request_class`) is ignored: the request gets the pool's default class,
as admission gives any request without a known class.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any
from urllib.parse import unquote

from .config import SidecarConfig

CLASS_HEADER = "x-infermesh-class"
POOL_HEADER = "x-infermesh-pool"

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@lru_cache(maxsize=64)
def _networks(cidrs: tuple[str, ...]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(c) for c in cidrs)


def peer_address(peer: Any) -> Address | None:
    """The IP address of a connection's peer, or None when it has none (a Unix socket, a test
    client's made-up host). Takes gRPC's `context.peer()` (`ipv4:127.0.0.1:5000`,
    `ipv6:%5B::1%5D:5000`), Starlette's `request.client` (host, port) or a bare address."""
    if peer is None:
        return None
    if not isinstance(peer, str):  # Starlette's Address, or any (host, port)
        host = getattr(peer, "host", None)
        if host is None and isinstance(peer, tuple) and peer:
            host = peer[0]
        if not isinstance(host, str):
            return None
    else:
        kind, sep, rest = peer.partition(":")
        if sep and kind in ("ipv4", "ipv6"):
            rest = unquote(rest)
            if rest.startswith("["):
                host, bracket, _ = rest[1:].partition("]")
                if not bracket:
                    return None
            else:
                host = rest.rpartition(":")[0] or rest
        elif sep and kind in ("unix", "unix-abstract"):
            return None
        else:
            host = peer
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped  # a dual-stack socket's view of an IPv4 peer
    return addr


def trusted(config: SidecarConfig, peer: Any) -> bool:
    """Whether `peer` is the mesh's proxy: its address is in one of `server.trusted_peers`."""
    addr = peer_address(peer)
    if addr is None:
        return False
    return any(addr.version == net.version and addr in net for net in _networks(tuple(config.server.trusted_peers)))


def _header(headers: Mapping[str, str] | Iterable[tuple[str, str]] | None, name: str) -> str:
    if headers is None:
        return ""
    if isinstance(headers, Mapping) or hasattr(headers, "get"):
        value = headers.get(name)
        return value if isinstance(value, str) else ""
    value = ""
    for key, v in headers:  # gRPC metadata: (key, value) pairs, keys lower-case
        if key == name and isinstance(v, str):
            value = v
    return value


def mesh_header(config: SidecarConfig, headers: Any, peer: Any, name: str) -> str:
    """The value of the mesh's header `name` when the peer is trusted, else "" (the caller's own)."""
    return _header(headers, name) if trusted(config, peer) else ""


def mesh_class(config: SidecarConfig, headers: Any, peer: Any) -> str:
    """The class the mesh set for this request (`x-infermesh-class` from a trusted peer), or ""
    when there is none to take: admission then gives the pool's default class, as it does to a
    name that is not one of the policy's classes. `headers`: HTTP headers or gRPC metadata."""
    return mesh_header(config, headers, peer, CLASS_HEADER)


def mesh_pool(config: SidecarConfig, headers: Any, peer: Any) -> str | None:
    """The pool the mesh bound this request for (`x-infermesh-pool` from a trusted peer), or None."""
    return mesh_header(config, headers, peer, POOL_HEADER) or None

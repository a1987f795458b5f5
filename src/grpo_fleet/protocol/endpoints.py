"""Endpoint rules: wildcard and loopback hosts, the address a peer should dial, free ports.

Every place that turns a bind address into one another machine can reach asks
here, so "what counts as a wildcard" has one answer.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Optional
from urllib.parse import urlsplit

# Hosts a socket can bind that no peer can dial: every interface of this machine.
# "" is what an endpoint without a host (tcp://:5555) parses to.
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "*", "::"})


def is_wildcard_host(host: Optional[str]) -> bool:
    """True for a bind-only host (all interfaces, or none given)."""
    return (host or "").strip("[]") in WILDCARD_HOSTS


def endpoint_host(endpoint: str) -> str:
    """The host of 'tcp://HOST:PORT', without IPv6 brackets; '' when there is none."""
    return urlsplit(endpoint).hostname or ""


def with_host(endpoint: str, host: str) -> str:
    """The same scheme and port with another host (an IPv6 literal gets its brackets)."""
    parts = urlsplit(endpoint)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{parts.scheme}://{host}:{parts.port}"


def reachable_host(host: Optional[str], fallback: str) -> str:
    """`host`, or `fallback` when `host` is a wildcard no peer can dial."""
    return fallback if is_wildcard_host(host) else str(host)


def dialable(endpoint: str, fallback_host: str) -> str:
    """`endpoint` as a peer dials it: a wildcard host is replaced by `fallback_host`."""
    return with_host(endpoint, reachable_host(endpoint_host(endpoint), fallback_host))


def pub_endpoint_for(bind: str) -> str:
    """Default PUB address: the ROUTER's host with the next port (or a random port)."""
    parsed = urlsplit(bind)
    port = parsed.port or 0
    return f"tcp://{parsed.hostname}:{port + 1 if port else 0}"


def advertised(endpoint: str, advertise_host: Optional[str]) -> str:
    """The PUB endpoint as the learner announces it: `advertise_host` replaces the bound host when set.

    A wildcard left here is resolved by the actor, to the host it reached the learner on.
    """
    parsed = urlsplit(endpoint)
    host = advertise_host or parsed.hostname
    return f"tcp://{host}:{parsed.port}"


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for tcp://127.x / localhost / [::1] and for ipc/inproc endpoints."""
    parsed = urlsplit(endpoint)
    if parsed.scheme in ("ipc", "inproc"):
        return True
    return is_loopback_host(parsed.hostname)


def is_loopback_host(host: Optional[str]) -> bool:
    """True for 127.x, localhost and ::1: an address only this machine can reach."""
    host = (host or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a wildcard (*, "") or an interface name reaches the network


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now (it may be taken by the time it is used)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def loopback_endpoint(port: Optional[int] = None) -> str:
    """tcp://127.0.0.1:PORT, on a free port unless one is given."""
    return f"tcp://127.0.0.1:{free_port() if port is None else port}"

"""Where a process listens and the address it tells others to reach it by.

Every server sparkstep starts (a state worker's Flight server, the runtime's control endpoint
and Spark driver) binds one host and advertises another:

- ``bind``: the local address the socket listens on. Loopback (``127.0.0.1``) is the default,
  so a single-machine run is reachable from this host only; ``0.0.0.0`` (or ``::``) listens on
  every interface, as a process in a container or on a cluster host must.
- ``advertise``: the host name or address the process puts in its ready line and that the
  others dial (the runtime and Spark executors dial the workers, the coordinator dials the
  runtime). It must be reachable from every host that dials it; sparkstep cannot check that.

:func:`advertised_host` is the one rule for the default: the bind address itself, unless it is
a wildcard, which nobody can dial; then the host's name (``socket.gethostname()``), which is
what Spark advertises by default too and, in a container, its name on the container network.
"""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["DEFAULT_BIND", "advertised_host", "host_port", "is_loopback", "is_wildcard"]

DEFAULT_BIND = "127.0.0.1"


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` listens on every interface (``0.0.0.0``, ``::``, empty)."""
    if host in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:  # a host name
        return False


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or ``localhost`` (reachable from this host only)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # another host name: it may resolve to anything
        return False


def advertised_host(bind: str, advertise: str | None) -> str:
    """The host others dial: ``advertise`` if given, else ``bind`` unless it is a wildcard, else
    this host's name."""
    if advertise:
        return advertise
    if is_wildcard(bind):
        return socket.gethostname()
    return bind


def host_port(host: str, port: int) -> str:
    """``HOST:PORT``, with an IPv6 literal in brackets (``[::1]:8080``)."""
    try:
        if ipaddress.ip_address(host.strip("[]")).version == 6:
            return f"[{host.strip('[]')}]:{port}"
    except ValueError:  # a host name
        pass
    return f"{host}:{port}"

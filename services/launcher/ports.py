"""The fixed ports of a topology, held by the launcher from before any service starts until it exits.

The kernel hands out ephemeral ports (``connect()``, and ``bind()`` to port 0 as UCX's listeners do)
from ``net.ipv4.ip_local_port_range``, which can contain fixed ports: 50051 lies inside Linux's
default 32768-60999, and a small range in a container or namespace may hold them all. A gRPC client,
a health check or a NIXL agent could then take a port before the service that owns it binds it
("cannot listen on 127.0.0.1:50051"), or while a crashed service waits to be restarted.

A port that some socket has bound is never handed out as an ephemeral port. So the launcher binds
every fixed port first, with ``SO_REUSEADDR`` and without listening on it: the service that owns the
port still binds and listens there (Linux allows it when both sockets set ``SO_REUSEADDR`` and the
holder does not listen; gRPC and uvicorn set it), while ``connect()`` and ``bind(port 0)`` in every
process skip it. The holder never listens, so it receives no connection, and its socket is not
inherited by the children (Python's sockets are close-on-exec).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable

import psutil


class PortReservation:
    """Holds ``binds`` ((host, port) pairs) until ``close``.

    Attributes:
        taken: the pairs that could not be held because something already listens there (or holds
            them without ``SO_REUSEADDR``); a port in TIME_WAIT counts as free, as for the servers.
        holders: for each taken pair, the TCP sockets on that port ("pid 12 python LISTEN 127.0.0.1:8000").
    """

    def __init__(self, binds: Iterable[tuple[str, int]]) -> None:
        self.taken: list[tuple[str, int]] = []
        self.holders: dict[tuple[str, int], list[str]] = {}
        self._sockets: list[socket.socket] = []
        for host, port in dict.fromkeys(binds):
            holder = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                holder.bind((host, port))
            except OSError:
                holder.close()
                self.taken.append((host, port))
                self.holders[(host, port)] = _holders(port)
            else:
                self._sockets.append(holder)

    def close(self) -> None:
        for holder in self._sockets:
            holder.close()
        self._sockets.clear()

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _holders(port: int) -> list[str]:
    """This namespace's TCP sockets on local ``port``, described for an error message."""
    found = []
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port:
            try:
                name = psutil.Process(conn.pid).name() if conn.pid else "?"
            except psutil.Error:
                name = "?"
            remote = f" -> {conn.raddr.ip}:{conn.raddr.port}" if conn.raddr else ""
            found.append(f"pid {conn.pid} {name} {conn.status} {conn.laddr.ip}:{port}{remote}")
    return found

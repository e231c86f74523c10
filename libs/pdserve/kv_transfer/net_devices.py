"""Which network interface NIXL's UCX backend may use: the one that holds the internal address.

Left to itself UCX opens a TCP listener on every interface (e.g. ``eth0`` and ``lo``), so KV pages
could be written over, and listeners opened on, the public network even when every service binds
``127.0.0.1``. ``UCX_NET_DEVICES`` names the interfaces UCX may use; it is read when the agent's UCX
context is created, so it must be set before ``KVTransferAgent``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket

import psutil

logger = logging.getLogger(__name__)

UCX_NET_DEVICES = "UCX_NET_DEVICES"


def interface_of(host: str) -> str | None:
    """The name of the interface that holds address ``host`` (a host name is resolved first):
    ``lo`` for ``127.0.0.1``. None for a wildcard (``0.0.0.0``, ``::``: every interface) or an
    address no interface holds.

    Raises:
        OSError: ``host`` is a name that does not resolve.
    """
    addresses = {ipaddress.ip_address(info[4][0]) for info in socket.getaddrinfo(host, None)}
    if any(address.is_unspecified for address in addresses):
        return None
    loopback = any(address.is_loopback for address in addresses)
    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            if entry.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            mine = ipaddress.ip_address(entry.address.split("%", 1)[0])
            if mine in addresses or (loopback and mine.is_loopback):
                return name
    return None


def restrict_ucx_to(host: str) -> str | None:
    """Set ``UCX_NET_DEVICES`` to ``interface_of(host)`` unless the environment already sets it
    (an RDMA device such as ``mlx5_0:1`` for instance); returns the value now in force (None: UCX's
    own choice, every interface)."""
    if UCX_NET_DEVICES in os.environ:
        return os.environ[UCX_NET_DEVICES]
    device = interface_of(host)
    if device is not None:
        os.environ[UCX_NET_DEVICES] = device
        logger.info("NIXL/UCX restricted to %s, the interface of %s", device, host)
    return device

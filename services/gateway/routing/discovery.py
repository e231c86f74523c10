"""Where a gateway finds its workers: fixed ``host:port`` addresses, and ``dns:<name>:<port>`` entries
that stand for every address ``<name>`` resolves to, resolved again every ``--discovery-interval``.

In Kubernetes ``<name>`` is a scheduler StatefulSet's headless Service, whose name resolves to the
IP of each of its pods: workers added by a scale-up (KEDA, HPA, ``kubectl scale``) are routed to
once they answer their health checks, and a pod that is gone from DNS is dropped. A worker being
scaled down drains first (SIGTERM: it turns NOT_SERVING for new requests and finishes what it
holds, see ``services.common.drain``), so by the time it leaves DNS it holds nothing; anything a
removed worker still held is ended with an error (``WorkerMonitor.remove``). A failed resolution
keeps the previous set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable

from pdserve.services.gateway.routing.workers import Worker, WorkerPool

logger = logging.getLogger(__name__)

DNS_PREFIX = "dns:"
DEFAULT_INTERVAL_S = 5.0

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve(host: str, port: int) -> list[str]:
    """Every ``ip:port`` (``[ip]:port`` for IPv6) that ``host`` resolves to, sorted.

    Raises:
        OSError: the name does not resolve (socket.gaierror).
    """
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    ips = {info[4][0] for info in infos}
    return sorted(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips)


def parse_dns_target(entry: str) -> tuple[str, int]:
    """``dns:<name>:<port>`` -> (name, port). Raises ValueError on anything else."""
    host, sep, port = entry.removeprefix(DNS_PREFIX).rpartition(":")
    if not entry.startswith(DNS_PREFIX) or not sep or not host or not port.isdigit():
        raise ValueError(f"expected dns:<name>:<port>, got {entry!r}")
    return host, int(port)


class Discovery:
    """The worker pools of a gateway, one per role, kept in step with DNS.

    Args:
        specs: role -> its addresses flag (comma-separated ``host:port`` and ``dns:<name>:<port>``).
        resolver: name, port -> addresses (``resolve``; tests pass their own).

    Attributes:
        on_removed: called with ``(role, worker)`` for each worker that left DNS.

    Raises:
        ValueError: a malformed ``dns:`` entry.
    """

    def __init__(self, specs: dict[str, str], resolver: Resolver = resolve) -> None:
        self.resolver = resolver
        self.on_removed: Callable[[str, Worker], None] | None = None
        self._static: dict[str, list[str]] = {}
        self._targets: dict[str, list[tuple[str, int]]] = {}
        self._pools: dict[str, WorkerPool] = {}
        for role, value in specs.items():
            entries = [a.strip() for a in value.split(",") if a.strip()]
            self._static[role] = [e for e in entries if not e.startswith(DNS_PREFIX)]
            self._targets[role] = [parse_dns_target(e) for e in entries if e.startswith(DNS_PREFIX)]
            self._pools[role] = WorkerPool(role, self._static[role], dynamic=bool(self._targets[role]))
        self._task: asyncio.Task | None = None

    def pool(self, role: str) -> WorkerPool:
        return self._pools[role]

    async def refresh(self) -> None:
        """Resolve every ``dns:`` entry once and update the pools (a name that fails keeps its workers)."""
        for role, targets in self._targets.items():
            if not targets:
                continue
            pool = self._pools[role]
            found: list[str] = []
            for host, port in targets:
                try:
                    found += await self.resolver(host, port)
                except OSError as e:
                    logger.warning("cannot resolve %s workers at %s: %s; keeping the last set", role, host, e)
                    found += [w.address for w in pool.workers if w.address.endswith(f":{port}")]
            added, removed = pool.update([*self._static[role], *found])
            for address in added:
                logger.info("%s worker %s discovered", role, address)
            for worker in removed:
                logger.info("%s worker %s left DNS: removed", role, worker.address)
                if self.on_removed is not None:
                    self.on_removed(role, worker)

    async def start(self, interval: float) -> None:
        """Resolve now, then every ``interval`` seconds in the background (nothing without ``dns:``)."""
        if not any(self._targets.values()):
            return
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._run(interval))

    async def _run(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.refresh()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

"""Background health checks of every backend worker and load polling of the schedulers.

Every ``interval`` seconds each worker of each pool gets a grpc.health.v1 Check. A worker that fails
``failure_threshold`` probes in a row (one slow answer on a saturated machine is not a death) is
taken out of routing, the router forgets its cache, and the requests that depended on it are ended;
it is put back as soon as it answers SERVING again. A scheduler is asked about its own service: when
that is NOT_SERVING while the server as a whole is SERVING, it is draining (SIGTERM): it gets no new
requests but keeps those it holds (it is alive; nothing is ended), unless ``on_drain`` moves them
(the gateway migrates them: ``requests.migration``). Live schedulers are asked
``GetLoad``: their load (for the least-load and cache-aware policies), their capacity (for the
gateway's default pending limit) and their incarnation: a scheduler that restarted (whether or not it
was seen down) holds none of the requests routed to its previous process, which are ended like a dead
worker's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc

from pdserve.services.gateway.routing.router import Router
from pdserve.services.gateway.routing.workers import Worker, WorkerPool
from pdserve.services.gateway.transport.backend_clients import BackendClients
from pdserve.services.gateway.transport.convert import SCHEDULER_SERVICES

logger = logging.getLogger(__name__)

SCHEDULER_ROLES = ("decode", "prefill")


class WorkerMonitor:
    """Keeps ``Worker.healthy`` and ``Worker.reported_load`` of every pool current.

    Args:
        clients: backend channels.
        pools: role -> pool, for every configured role (tokenizer, detokenizer, decode, prefill).
        router: told to forget a worker that went unhealthy.
        on_down: called with ``(role, address)`` when a worker is taken out.
        on_drain: called with ``(role, address)`` when a live worker starts draining.
        interval: seconds between rounds.
        failure_threshold: failed probes in a row that take a worker out.
    """

    def __init__(
        self,
        clients: BackendClients,
        pools: dict[str, WorkerPool],
        router: Router,
        on_down: Callable[[str, str], None],
        interval: float = 1.0,
        failure_threshold: int = 3,
        on_drain: Callable[[str, str], None] | None = None,
    ) -> None:
        self.clients = clients
        self.pools = {role: pool for role, pool in pools.items() if pool}
        self.router = router
        self.on_down, self.on_drain = on_down, on_drain
        self.interval = interval
        self.failure_threshold = failure_threshold
        self._task: asyncio.Task | None = None

    async def check_once(self) -> dict[str, dict[str, bool]]:
        """Probe every worker now; returns role -> address -> answered SERVING to this probe."""
        pairs = [(role, w) for role, pool in self.pools.items() for w in pool.workers]
        results = await asyncio.gather(*(self._probe(role, w) for role, w in pairs))
        status: dict[str, dict[str, bool]] = {role: {} for role in self.pools}
        for (role, worker), ok in zip(pairs, results, strict=True):
            status[role][worker.address] = ok
        return status

    async def _probe(self, role: str, worker: Worker) -> bool:
        """One probe of ``worker``; True when it takes new requests."""
        service = SCHEDULER_SERVICES.get(role, "")
        answer = await self.clients.serving_status(worker.address, service)
        # only a worker that answered (other than SERVING) is asked about the server as a whole: one
        # that did not answer at all (hung) costs one probe timeout, not two, and is not mistaken for
        # draining when it wakes up between the two calls
        draining = answer is False and bool(service)
        draining = draining and bool(await self.clients.serving_status(worker.address))
        if draining != worker.draining:
            state = "is draining: no new requests" if draining else "takes new requests again"
            logger.warning("%s worker %s %s", role, worker.address, state)
            worker.draining = draining
            if draining and self.on_drain is not None:
                self.on_drain(role, worker.address)
        ok = bool(answer) or draining  # alive
        if ok and role in SCHEDULER_ROLES:
            await self._read_load(role, worker)  # before it is routed to again: a restart ends its requests
        worker.failed_probes = 0 if ok else worker.failed_probes + 1
        if ok and not worker.healthy:
            logger.warning("%s worker %s is back", role, worker.address)
            worker.healthy = True
        elif worker.healthy and worker.failed_probes >= self.failure_threshold:
            logger.warning(
                "%s worker %s failed %d probes: taken out", role, worker.address, worker.failed_probes
            )
            worker.healthy = False
            self.router.forget(role, worker)
            self.on_down(role, worker.address)
        return ok and not worker.draining

    def remove(self, role: str, worker: Worker) -> None:
        """``worker`` left the pool (``discovery``): forget it and end what it still held."""
        self.router.forget(role, worker)
        self.on_down(role, worker.address)

    async def _read_load(self, role: str, worker: Worker) -> None:
        try:
            report = await self.clients.load(role, worker.address)
        except grpc.aio.AioRpcError as e:
            logger.debug("GetLoad %s failed: %s", worker.address, e.code())
            return
        restarted = bool(worker.incarnation) and report.incarnation != worker.incarnation
        worker.reported_load = report.load
        worker.capacity, worker.max_queued = report.capacity, report.max_queued
        worker.incarnation = report.incarnation
        worker.lora_resident = report.lora_resident
        if restarted:
            logger.warning("%s worker %s restarted: ending what its old process held", role, worker.address)
            self.router.forget(role, worker)
            self.on_down(role, worker.address)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self.check_once()
            await asyncio.sleep(self.interval)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

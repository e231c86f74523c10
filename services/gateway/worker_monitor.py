"""Background health checks of every backend worker and load polling of the schedulers.

Every ``interval`` seconds each worker of each pool gets a grpc.health.v1 Check; a worker that does
not answer SERVING is taken out of routing (and the router forgets its cache) and put back once it
answers SERVING again. Healthy schedulers are asked ``GetLoad`` for the least-load and cache-aware
policies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc
from pdserve.services.gateway.backend_clients import BackendClients
from pdserve.services.gateway.router import Router, Worker, WorkerPool

logger = logging.getLogger(__name__)

SCHEDULER_ROLES = ("decode", "prefill")


class WorkerMonitor:
    """Keeps ``Worker.healthy`` and ``Worker.reported_load`` of every pool current.

    Args:
        clients: backend channels.
        pools: role -> pool, for every configured role (tokenizer, detokenizer, decode, prefill).
        router: told to forget a worker that went unhealthy.
        on_down: called with ``(role, address)`` when a worker goes unhealthy.
        interval: seconds between rounds.
    """

    def __init__(
        self,
        clients: BackendClients,
        pools: dict[str, WorkerPool],
        router: Router,
        on_down: Callable[[str, str], None],
        interval: float = 1.0,
    ) -> None:
        self.clients = clients
        self.pools = {role: pool for role, pool in pools.items() if pool}
        self.router = router
        self.on_down = on_down
        self.interval = interval
        self._task: asyncio.Task | None = None

    async def check_once(self) -> dict[str, dict[str, bool]]:
        """Probe every worker now; returns role -> address -> serving."""
        pairs = [(role, w) for role, pool in self.pools.items() for w in pool.workers]
        results = await asyncio.gather(*(self._probe(role, w) for role, w in pairs))
        status: dict[str, dict[str, bool]] = {role: {} for role in self.pools}
        for (role, worker), ok in zip(pairs, results, strict=True):
            status[role][worker.address] = ok
        return status

    async def _probe(self, role: str, worker: Worker) -> bool:
        ok = await self.clients.is_serving(worker.address)
        if ok != worker.healthy:
            logger.warning("%s worker %s is %s", role, worker.address, "back" if ok else "down; taken out")
            if not ok:
                self.router.forget(role, worker)
                self.on_down(role, worker.address)
        worker.healthy = ok
        if ok and role in SCHEDULER_ROLES and self.router.policy_name != "round_robin":
            try:
                worker.reported_load = await self.clients.load(role, worker.address)
            except grpc.aio.AioRpcError as e:
                logger.debug("GetLoad %s failed: %s", worker.address, e.code())
        return ok

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

"""The gateway's subscriptions to the KV events of every scheduler of a pool, one asyncio task each.

Each task keeps its worker's ``KVIndex``: it subscribes (``SubscribeKVEvents``), applies the snapshot
and every batch after it, and when the stream ends or breaks subscribes again, ``interval`` seconds
later, from the last batch applied + 1 of the same incarnation (a replay: nothing is missed). The
scheduler answers with a snapshot when it cannot replay (a restarted process, batches it no longer
holds), and the index is replaced. While a worker is down the call waits on the channel's reconnect
backoff (``BackendClients``). Membership follows the pool (``discovery``): checked every
``interval``, a new worker gets a task, a removed one's is cancelled.

Every replica of the gateway applies the same events, so every replica's indexes agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

import grpc
from prometheus_client.core import GaugeMetricFamily

from pdserve.services.gateway.routing.kv_index import KVIndex, KVIndexGap
from pdserve.services.gateway.routing.workers import WorkerPool
from pdserve.services.gateway.transport.backend_clients import BackendClients

logger = logging.getLogger(__name__)


class KVIndexes:
    """``KVIndex`` per worker of ``pool`` (a ``decode`` or ``prefill`` pool), kept by subscriptions.

    Args:
        clients: backend channels.
        pool: the workers to follow.
        interval: seconds between membership checks, and before a broken stream is subscribed again.
    """

    def __init__(self, clients: BackendClients, pool: WorkerPool, interval: float = 1.0) -> None:
        self.clients = clients
        self.pool = pool
        self.interval = interval
        self.indexes: dict[str, KVIndex] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None

    def get(self, address: str) -> KVIndex | None:
        return self.indexes.get(address)

    def block_size(self) -> int | None:
        """The block size of the first worker that stored a block (None: none has yet)."""
        return next((i.block_size for i in self.indexes.values() if i.block_size), None)

    def start(self) -> None:
        """Subscribe to every worker now and follow the pool's membership in the background."""
        self.sync()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def sync(self) -> None:
        """One subscription task per current worker of the pool, none for a removed one."""
        current = {w.address for w in self.pool.workers}
        for address in current - self._tasks.keys():
            index = self.indexes[address] = KVIndex(self.pool.role, address)
            self._tasks[address] = asyncio.get_running_loop().create_task(self._follow(index))
        for address in self._tasks.keys() - current:
            self._tasks.pop(address).cancel()
            del self.indexes[address]

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.sync()

    async def _follow(self, index: KVIndex) -> None:
        role = self.pool.role
        while True:
            from_seq = None if index.seq is None else index.seq + 1
            stream = self.clients.kv_events(role, index.address, from_seq, index.incarnation)
            try:
                async with contextlib.aclosing(stream):  # the call ends with the loop, however it ends
                    async for incarnation, batch in stream:
                        index.connected = True
                        index.apply(incarnation, batch, time.monotonic())
            except grpc.aio.AioRpcError as e:
                logger.info("%s worker %s: KV event stream broke (%s)", role, index.address, e.code().name)
            except KVIndexGap as e:
                logger.warning("%s; subscribing again from a snapshot", e)
                index.reset()
            index.connected = False
            await asyncio.sleep(self.interval)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Prometheus gauges of every index (a collector for the gateway's registry)."""
        labels = ["pool", "backend"]
        blocks = GaugeMetricFamily(
            "pdserve:router_kv_index_blocks", "KV blocks in a worker's index", labels=labels
        )
        age = GaugeMetricFamily(
            "pdserve:router_kv_index_age_seconds",
            "Seconds since a worker's index applied a KV event batch (-1: none yet)",
            labels=labels,
        )
        connected = GaugeMetricFamily(
            "pdserve:router_kv_index_connected", "1 while a worker's KV event stream is open", labels=labels
        )
        now = time.monotonic()
        for address, index in self.indexes.items():
            values = [self.pool.role, address]
            blocks.add_metric(values, len(index.blocks))
            age.add_metric(values, -1.0 if index.last_batch_at is None else now - index.last_batch_at)
            connected.add_metric(values, float(index.connected))
        yield from (blocks, age, connected)

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

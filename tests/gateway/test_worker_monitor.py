"""WorkerMonitor over real gRPC health checks: a dead port is out after 3 failed probes, back once SERVING."""

from __future__ import annotations

import asyncio

from pdserve.rpc.server import GrpcServer
from pdserve.services.gateway.routing.router import Router
from pdserve.services.gateway.routing.worker_monitor import WorkerMonitor
from pdserve.services.gateway.routing.workers import WorkerPool
from pdserve.services.gateway.transport.backend_clients import BackendClients
from tests.stack import free_port_block


async def test_dead_worker_is_taken_out_after_threshold_and_back_when_serving(local_gateway) -> None:
    dead = f"127.0.0.1:{free_port_block(1)}"
    pools = {
        "tokenizer": WorkerPool("tokenizer", [local_gateway.tokenizer_address]),
        "decode": WorkerPool("decode", [dead]),
        "prefill": WorkerPool("prefill", []),
    }
    router = Router(pools["decode"], pools["prefill"], "cache_aware")
    router.route([1, 2, 3]).release()  # the cache-aware tree now remembers the dead worker
    downs: list[tuple[str, str]] = []
    clients = BackendClients(probe_timeout=1.0)
    monitor = WorkerMonitor(clients, pools, router, on_down=lambda role, a: downs.append((role, a)))
    try:
        for probe in range(1, 4):
            status = await monitor.check_once()
            assert status == {"tokenizer": {local_gateway.tokenizer_address: True}, "decode": {dead: False}}
            assert pools["decode"].workers[0].healthy is (probe < 3)
        assert downs == [("decode", dead)]
        assert router._decode_policy.tree.match([1, 2, 3]) == {}
        assert pools["tokenizer"].workers[0].healthy
        # A process that answers SERVING on that address again is back at once.
        revived = GrpcServer(dead, [])
        await revived.start()
        await revived.set_serving(True)
        try:
            for _ in range(30):  # the channel reconnects within its (1 s max) backoff
                if (await monitor.check_once())["decode"] == {dead: True}:
                    break
                await asyncio.sleep(0.1)
            assert pools["decode"].workers[0].healthy and pools["decode"].workers[0].failed_probes == 0
        finally:
            await revived.stop(0)
    finally:
        await clients.close()

"""A stuck forward makes a scheduler worker fail its liveness check, and a resumed one passes it again.

In process, over real gRPC: the real ``DecodeServicer`` (colocated ``mixed`` role, the real model on
CPU) behind a grpc.aio server with its ``StepWatchdog``. The forward of its first step is held on
an event (the injected fault: a forward that does not return) while a ``HealthWatch`` polls the
server as the launcher and the decode workers do; with the overlapped loop (the forward runs on its
own thread while the loop schedules the next step) and without it.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine.model_runner import ModelRunner
from pdserve.model_source import resolve_model
from pdserve.rpc.health_watch import HealthWatch
from pdserve.rpc.server import GrpcServer
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.scheduler import Scheduler, SchedulerConfig
from pdserve.services.common.convert import sampling_params_to_pb
from pdserve.services.common.liveness import start_watchdog
from pdserve.services.decode.servicer import DecodeServicer
from pdserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.reference import chat_ids

WATCHDOG_TIMEOUT = 1.0
DEAD_AFTER = 1.0
PROMPT = chat_ids([{"role": "user", "content": "Say hi."}])


@pytest.fixture(scope="module")
def scheduler() -> Scheduler:
    torch.set_num_threads(2)
    runner = ModelRunner(resolve_model(), dtype="float32", page_size=16, max_total_tokens=1024)
    return Scheduler(runner, SchedulerConfig(role="mixed"))


async def status(channel: grpc.aio.Channel) -> int:
    resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return resp.status


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
async def test_a_stuck_forward_reports_not_serving_until_it_returns(
    scheduler: Scheduler, overlap: bool
) -> None:
    gate = threading.Event()
    real_run_batch = scheduler.run_batch

    def stuck_run_batch(batch):
        gate.wait(60)
        return real_run_batch(batch)

    scheduler.run_batch = stuck_run_batch
    server = GrpcServer("127.0.0.1:0", [])
    servicer = DecodeServicer(scheduler, server.address, agent=None, overlap=overlap)
    server.add(scheduler_pb2_grpc.add_DecodeSchedulerServicer_to_server, servicer)
    await server.start()
    await server.set_serving(True)
    stop = asyncio.Event()
    loop_task = asyncio.create_task(servicer.loop.run(stop))
    watchdog = start_watchdog(servicer.loop.heartbeat, server.set_serving, WATCHDOG_TIMEOUT, stop)
    channel = grpc.aio.insecure_channel(server.address)
    watch = HealthWatch(channel, DEAD_AFTER)
    try:
        await asyncio.sleep(2 * WATCHDOG_TIMEOUT)  # idle: the loop beats every 50 ms
        assert await status(channel) == health_pb2.HealthCheckResponse.SERVING
        params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
        await scheduler_pb2_grpc.DecodeSchedulerStub(channel).Generate(
            scheduler_pb2.TokenizedGenerateReqInput(
                rid="stuck", input_ids=PROMPT, sampling_params=sampling_params_to_pb(params)
            )
        )
        t0 = time.monotonic()
        silent_for = await asyncio.wait_for(watch.wait_silent(), 10)
        noticed = time.monotonic() - t0
        # the watchdog flips within its timeout plus a check; the watch needs DEAD_AFTER more
        assert await status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert silent_for >= DEAD_AFTER and noticed < WATCHDOG_TIMEOUT + 1.5 * DEAD_AFTER + 2.0, noticed
        assert "stuck" in scheduler.reqs  # the event loop itself still serves: only the step is stuck
        gate.set()
        for _ in range(200):
            if not scheduler.reqs and not watch.silent.is_set():
                break
            await asyncio.sleep(0.05)
        assert not scheduler.reqs and not watch.silent.is_set()
        assert await status(channel) == health_pb2.HealthCheckResponse.SERVING
        scheduler.check_invariants()
        print(f"stuck forward noticed by the health watch after {noticed:.2f} s")
    finally:
        gate.set()
        scheduler.run_batch = real_run_batch
        await watch.close()
        await channel.close()
        stop.set()
        await watchdog
        await loop_task
        await server.stop(0)
        await servicer.close()

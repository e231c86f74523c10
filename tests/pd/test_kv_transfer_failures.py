"""PD KV transfers in process: streamed chunks equal HF, and failures corrupt nothing.

The real ``PrefillServicer`` and ``DecodeServicer`` (the real model on CPU, prefill in chunks of 64
tokens so a prompt's pages stream while later chunks compute) behind real gRPC servers, their NIXL
agents writing over UCX loopback. Failures are injected at a seam of the real transfer path (the
third WRITE raises; the decode side stops handling notifications): the request ends with a clear
error, both schedulers end idle with their pools conserved, and the next request still equals HF
token for token.
"""

from __future__ import annotations

import asyncio
import inspect
import threading

import grpc
import pytest
import pytest_asyncio
import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.kv_transfer.sender import KVSender
from pdserve.model_source import resolve_model
from pdserve.rpc.server import GrpcServer
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.req import Req
from pdserve.scheduler.scheduler import Scheduler, SchedulerConfig
from pdserve.services.common.bootstrap import build_kv_agent
from pdserve.services.common.convert import sampling_params_to_pb
from pdserve.services.common.events import Abort
from pdserve.services.decode.servicer import DecodeServicer
from pdserve.services.prefill.servicer import PrefillServicer
from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.pd.test_dead_detokenizer import start_detokenizer, wait_until
from tests.reference import chat_ids, hf_greedy


def prompt(topic: str) -> list[int]:
    """A prompt of several chunks; each test fails requests on its own topic, so that the decode
    side's radix cache (which keeps an earlier test's prompt) never shrinks the transfer under test."""
    return chat_ids([{"role": "user", "content": f"List five facts about {topic}. " * 40}])


PROMPT = prompt("the moon")
MAX_NEW = 8
TRANSFER_TIMEOUT_S = 2.0


def _scheduler(role: str) -> Scheduler:
    runner = ModelRunner(resolve_model(), dtype="float32", page_size=16, max_total_tokens=4096)
    return Scheduler(runner, SchedulerConfig(role=role, chunked_prefill_size=64))


@pytest.fixture(scope="module")
def schedulers() -> tuple[Scheduler, Scheduler]:
    torch.set_num_threads(2)
    return _scheduler("prefill"), _scheduler("decode")


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def pd(schedulers):
    """Prefill and decode servicers behind gRPC, their loops running, and a detokenizer endpoint."""
    prefill_sched, decode_sched = schedulers
    servers, stop, tasks = [], asyncio.Event(), []
    prefill_server = GrpcServer("127.0.0.1:0", [])
    prefill = PrefillServicer(
        prefill_sched,
        prefill_server.address,
        build_kv_agent(prefill_sched, "prefill", prefill_server.address, "127.0.0.1"),
        transfer_timeout_s=TRANSFER_TIMEOUT_S,
    )
    prefill_server.add(scheduler_pb2_grpc.add_PrefillSchedulerServicer_to_server, prefill)
    decode_server = GrpcServer("127.0.0.1:0", [])
    decode_agent = build_kv_agent(decode_sched, "decode", decode_server.address, "127.0.0.1")
    decode = DecodeServicer(decode_sched, decode_server.address, decode_agent, prefill_retries=0)
    decode_server.add(scheduler_pb2_grpc.add_DecodeSchedulerServicer_to_server, decode)
    for server, servicer in ((prefill_server, prefill), (decode_server, decode)):
        await server.start()
        servers.append(server)
        tasks.append(asyncio.create_task(servicer.loop.run(stop)))
    detok_server, detok = await start_detokenizer()
    channel = grpc.aio.insecure_channel(decode_server.address)
    try:
        yield (
            scheduler_pb2_grpc.DecodeSchedulerStub(channel),
            prefill_server.address,
            detok_server.address,
            detok,
            prefill,
            decode_agent,
            decode,
        )
    finally:
        await channel.close()
        for server in (*servers, detok_server):
            await server.stop(0)
        stop.set()
        await asyncio.gather(*tasks)
        await decode.close()
        decode_agent.close()
        prefill.agent.close()


async def _submit(pd, rid: str, input_ids: list[int]) -> None:
    """Send a greedy Generate of ``input_ids`` to the decode worker (its outputs go to the detokenizer)."""
    stub, prefill_address, detok_address, *_ = pd
    await stub.Generate(
        scheduler_pb2.TokenizedGenerateReqInput(
            rid=rid,
            input_ids=input_ids,
            sampling_params=sampling_params_to_pb(SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)),
            prefill_address=prefill_address,
            output_address=detok_address,
            gateway_address="127.0.0.1:1",
        )
    )


async def _run(pd, rid: str, input_ids: list[int] = PROMPT) -> tuple[list[int], int, str]:
    """Generate ``input_ids`` greedily; returns (token ids, finish reason, error) once it finished."""
    detok = pd[3]
    await _submit(pd, rid, input_ids)
    await wait_until(lambda: detok.finish(rid), timeout=120)
    outputs = detok.outputs[rid]
    return [t for out in outputs for t in out.token_ids], outputs[-1].finish_reason, outputs[-1].error


async def _idle_and_conserved(schedulers) -> None:
    for scheduler in schedulers:
        await wait_until(lambda s=scheduler: not s.reqs and not s.prefill.draining, timeout=30)
        assert scheduler.ledger.used_pages() == 0
        scheduler.check_invariants()


async def test_streamed_transfer_equals_hf(schedulers, pd):
    assert len(PROMPT) > 4 * 64  # several chunks, each written as its own group
    tokens, finish, error = await _run(pd, "streamed")
    assert (finish, error) in ((common_pb2.FINISH_REASON_LENGTH, ""), (common_pb2.FINISH_REASON_STOP, ""))
    assert tokens == hf_greedy(PROMPT, MAX_NEW)
    assert schedulers[0].metrics.kv_transfer_seconds.collect()[0].samples
    await _idle_and_conserved(schedulers)


async def test_an_abort_during_the_prefill_holds_the_pages_until_the_prefill_worker_stopped(
    schedulers, pd, monkeypatch
):
    """Aborted on the decode side while its prompt is being prefilled in chunks (each chunk's pages
    written as it is done), a request's decode pages are not freed at once: the prefill worker, still
    writing, could land bytes in them after another request got them. They stay held (counted used)
    until the prefill worker, asked to stop, has ended the request and its call, and are freed then,
    once."""
    prefill_sched, decode_sched = schedulers
    stub, _, _, detok, prefill, *_ = pd
    rid, comet = "aborted-mid-prefill", prompt("comets")
    releases = []
    real_drained = decode_sched.kv_drained

    def drained(r: str) -> None:
        if r == rid:  # what the prefill worker still holds when the decode side lets the pages go
            releases.append(
                (r in decode_sched.prefill.draining, r in prefill_sched.reqs, r in prefill.sends.transfers)
            )
            again = Req(rid=r, origin_input_ids=[1, 2, 3], sampling_params=SamplingParams())
            with pytest.raises(ValueError, match="duplicate rid"):  # not reused while it drains
                decode_sched.add_request(again)
        real_drained(r)

    monkeypatch.setattr(decode_sched, "kv_drained", drained)
    await _submit(pd, rid, comet)
    await wait_until(lambda: (r := prefill_sched.reqs.get(rid)) is not None and r.num_computed > 0, 60)
    assert prefill_sched.reqs[rid].num_computed < len(comet)  # chunks still to come
    await stub.Abort(scheduler_pb2.AbortRequest(rid=rid, reason="client went away"))
    await wait_until(lambda: detok.finish(rid), timeout=30)
    assert detok.outputs[rid][-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    await wait_until(lambda: releases, timeout=30)
    assert releases == [(True, False, False)]  # held until then; the prefill worker was done with it
    await _idle_and_conserved(schedulers)
    tokens, finish, _ = await _run(pd, "after-abort", comet)
    assert tokens == hf_greedy(comet, MAX_NEW)
    await _idle_and_conserved(schedulers)


async def test_an_abort_applied_before_its_prefill_task_ran_drains_the_pages(schedulers, pd, monkeypatch):
    """Aborted at the step input point right after its admission, before the loop yielded to the
    prefill task just created for it (a speculative step's loop iteration never yields there), a
    request's prefill task is cancelled before its first turn and never enters its body. Its pages
    drain all the same (``KVDrained`` comes from the task's done callback) instead of staying held,
    counted used on an idle worker, for ever."""
    prefill_sched, _ = schedulers
    detok, decode = pd[3], pd[-1]
    rid, tasks = "aborted-before-its-prefill-ran", []
    real_start = decode.prefills.start

    def start_then_abort() -> None:  # the Abort as the next step's inputs apply it, no yield between
        real_start()
        if (task := decode.prefills.tasks.get(rid)) is not None:
            tasks.append((task, inspect.getcoroutinestate(task.get_coro())))
            decode._abort(Abort(rid, "client went away"))

    monkeypatch.setattr(decode.prefills, "start", start_then_abort)
    await _submit(pd, rid, prompt("Jupiter"))
    await wait_until(lambda: detok.finish(rid), timeout=30)
    assert detok.outputs[rid][-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    await _idle_and_conserved(schedulers)
    assert [(state, task.cancelled()) for task, state in tasks] == [(inspect.CORO_CREATED, True)]
    assert rid not in decode.prefills.tasks and rid not in prefill_sched.reqs


async def test_a_write_failing_mid_transfer_fails_the_request_and_corrupts_nothing(
    schedulers, pd, monkeypatch
):
    real, calls = KVSender._post, []

    def third_write_fails(self, group):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected: the wire broke")
        return real(self, group)

    monkeypatch.setattr(KVSender, "_post", third_write_fails)
    sun = prompt("the sun")
    tokens, finish, error = await _run(pd, "broken", sun)
    monkeypatch.undo()
    assert finish == common_pb2.FINISH_REASON_ERROR and "prefill failed" in error and "wire broke" in error
    assert len(calls) >= 3
    await _idle_and_conserved(schedulers)
    tokens, finish, _ = await _run(pd, "after-broken", sun)  # reuses the failed request's freed pages
    assert tokens == hf_greedy(sun, MAX_NEW)
    await _idle_and_conserved(schedulers)


async def test_a_decode_side_that_stalls_times_out_and_frees_once(schedulers, pd, monkeypatch):
    """The decode side stops handling notifications (its notification thread hangs): its receive
    never counts the pages landed and times out; both sides free the request's pages once. When the
    decode side moves again, the late LANDED messages count for nothing and the next request lands."""
    stalled, real = threading.Event(), KVReceiver.on_landed

    def hung(self, sender, landed):
        stalled.wait(30)
        real(self, sender, landed)

    monkeypatch.setattr(KVReceiver, "on_landed", hung)
    mars = prompt("Mars")
    tokens, finish, error = await _run(pd, "stalled", mars)
    assert finish == common_pb2.FINISH_REASON_ERROR and "prefill failed" in error, error
    await _idle_and_conserved(schedulers)
    stalled.set()
    monkeypatch.undo()
    tokens, finish, _ = await _run(pd, "after-stall", mars)
    assert tokens == hf_greedy(mars, MAX_NEW)
    await _idle_and_conserved(schedulers)


async def test_a_prefill_call_cancelled_while_its_add_is_queued_aborts_it(schedulers, pd):
    """Cancelled before the loop's next step applies its add (a decode side aborting early), the
    Prefill call still aborts the request: its transfer is cancelled at once and the request ends at
    that same step input point, instead of being prefilled and holding its pages until the transfer
    times out. (The handler is called directly, so it is cancelled exactly at that await.)"""
    *_, prefill, decode_agent, _ = pd
    prefill.agent.add_peer(decode_agent.local_info())  # what the decode side's handshake does
    local = decode_agent.local_info()
    request = scheduler_pb2.PrefillRequest(
        rid="cancelled-early",
        input_ids=prompt("Venus"),
        sampling_params=sampling_params_to_pb(SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)),
        dst_agent_name=local.agent_name,
        dst_incarnation=local.incarnation,
    )
    call = asyncio.create_task(prefill.Prefill(request, None))
    while "cancelled-early" not in prefill.sends.opening:  # the call is awaiting its add, its transfer open
        await asyncio.sleep(0)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert "cancelled-early" not in prefill.sends.opening and "cancelled-early" not in prefill.sends.transfers
    await _idle_and_conserved(schedulers)

"""PrefillScheduler servicer: prefill prompts for decode workers; their KV goes over NIXL (``kv_sends``).

Handlers submit events (``events``) that the scheduler loop applies at the top of an iteration.
Under tensor parallelism the same servicer runs on every rank (without a gRPC server on ranks > 0):
every rank prefills the same requests and writes its KV heads into the decode worker's ranks that
hold them (``head_map``: rank ``i`` into rank ``i`` under equal TP sizes; same transfer id, its own
NIXL agent); rank 0 answers.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve.distributed import SINGLE_RANK, TpGroup
from pdserve.kv_transfer import KVAgentInfo, KVLayoutMismatch, KVTransferAgent, KVTransferError
from pdserve.observability import tracing
from pdserve.scheduler.req import Req
from pdserve.scheduler.schedule_batch import StepOutput
from pdserve.scheduler.scheduler import Scheduler
from pdserve.services.common import convert
from pdserve.services.common.events import Abort, AddKVPeers
from pdserve.services.common.forward_lock import ForwardLock
from pdserve.services.common.intake import check_tp, queue_request
from pdserve.services.common.kv_event_stream import flush_cache, subscribe_kv_events
from pdserve.services.common.lora_calls import load_lora_adapter, unload_lora_adapter
from pdserve.services.common.scheduler_loop import SchedulerLoop
from pdserve.services.prefill.kv_sends import TRANSFER_TIMEOUT_S, KVSends
from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["PrefillScheduler"].full_name
add_to_server = scheduler_pb2_grpc.add_PrefillSchedulerServicer_to_server


class PrefillServicer(scheduler_pb2_grpc.PrefillSchedulerServicer):
    """Prefill-scheduler service.

    ``Prefill`` queues the request and waits; the KV pages decode lacks are written into decode's
    pages as they are computed, and the call answers with the first token once all are written. A
    cancelled call (decode aborted, or gone) aborts the request and frees its pages here. While
    ``draining`` (SIGTERM, see ``drain``) new Prefill calls are refused (UNAVAILABLE) and the ones
    taken are finished.

    Args:
        scheduler: the prefill-role scheduler.
        address: this service's advertised "host:port".
        agent: this rank's NIXL agent.
        stream_chunks: send a chunked prompt's finished pages after each chunk (else all at the end).
        transfer_timeout_s: how long a transfer may wait for the decode side (``KVSends``).
        tp: this rank's TP group.
        rank_agents: every rank's agent (rank order), answered in the handshake.
        overlap: overlap each step's CPU work with the next forward (``SchedulerLoop``).
        forward_lock: the forwards' turn among schedulers sharing a CPU's cores (``SchedulerLoop``).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        address: str,
        agent: KVTransferAgent,
        stream_chunks: bool = True,
        transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
        tp: TpGroup = SINGLE_RANK,
        rank_agents: list[KVAgentInfo] | None = None,
        overlap: bool = True,
        forward_lock: ForwardLock | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.address = address
        self.agent = agent
        self.tp = tp
        self.rank_agents = rank_agents or [agent.local_info()]
        self.loop = SchedulerLoop(
            scheduler, self._on_outputs, self._after_schedule, {Abort: self._abort}, tp, overlap, forward_lock
        )
        layouts = [info.layout for info in self.rank_agents]
        self.sends = KVSends(
            scheduler, self.loop, agent, layouts, self._answer, stream_chunks, transfer_timeout_s
        )
        self.waiters: dict[str, asyncio.Future] = {}  # rank 0: the Prefill calls, by rid
        self.draining = False
        scheduler.set_hooks(on_request_end=lambda req: tracing.end_request_span(req, "prefill"))

    async def ExchangeKVAgentInfo(
        self, request: scheduler_pb2.KVAgentInfo, context
    ) -> scheduler_pb2.KVAgentInfo:
        agents = convert.kv_rank_agents_from_pb(request)
        try:
            self.sends.add_peers(agents)  # this rank's decode peers; the others' at their next step
        except KVLayoutMismatch as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV layout mismatch with prefill: {e}")
        if self.tp.size > 1:
            self.loop.inputs.submit(AddKVPeers(agents))
            self.loop.wake()
        return convert.kv_rank_agents_to_pb([self.agent.local_info(), *self.rank_agents[1:]])

    async def Prefill(self, request: scheduler_pb2.PrefillRequest, context) -> scheduler_pb2.PrefillResponse:
        if self.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"prefill worker {self.address} is shutting down: use another"
            )
        if not self.agent.has_peer(request.dst_agent_name, request.dst_incarnation):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "unknown decode agent: exchange agent info first"
            )
        try:
            req = convert.prefill_req_from_pb(request)
        except TypeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await check_tp(req, self.loop, context)
        route = req.route
        prompt_pages = -(-len(request.input_ids) // self.scheduler.page_size)
        if (
            route.kv_dst_start_page < 0
            or route.kv_dst_start_page + len(route.kv_dst_pages) > prompt_pages
            or len(route.kv_dst_local_pages) > len(route.kv_dst_pages)
        ):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"destination pages [{route.kv_dst_start_page}, +{len(route.kv_dst_pages)}) (local layers':"
                f" the last {len(route.kv_dst_local_pages)}) exceed the prompt's {prompt_pages} pages",
            )
        try:
            transfer = self.sends.open(req)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except KVTransferError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        if req.rid in self.waiters:
            transfer.cancel()
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"duplicate rid {req.rid!r}")
        self.sends.opening[req.rid] = transfer
        tracing.start_request_span(req, "prefill")
        waiter = self.waiters[req.rid] = asyncio.get_running_loop().create_future()
        try:  # a call cancelled while its add is queued still aborts it (the add is applied anyway)
            await queue_request(req, self.loop, context)
            return await waiter
        except asyncio.CancelledError:
            self.abort(req.rid, "prefill call cancelled")
            raise
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        finally:
            self.waiters.pop(req.rid, None)
            if waiter.done() and not waiter.cancelled():
                waiter.exception()  # (retrieved: a call refused at its grammar was failed by the step too)

    async def Abort(self, request: scheduler_pb2.AbortRequest, context) -> scheduler_pb2.AbortResponse:
        return scheduler_pb2.AbortResponse(found=self.abort(request.rid, request.reason or "aborted"))

    async def GetLoad(self, request, context) -> common_pb2.LoadInfo:
        return convert.load_to_pb(self.scheduler.load())

    async def GetMetrics(self, request, context) -> common_pb2.MetricsResponse:
        return convert.metrics_to_pb("prefill", self.address, self.scheduler.metrics.text())

    async def SubscribeKVEvents(self, request: scheduler_pb2.KVEventsRequest, context):
        async for batch in subscribe_kv_events(self.loop, request, context):
            yield batch

    async def FlushCache(self, request, context) -> scheduler_pb2.FlushCacheResponse:
        return await flush_cache(self.loop)

    async def LoadLoraAdapter(self, request, context) -> scheduler_pb2.LoraAdapterResponse:
        return await load_lora_adapter(self.loop, request, context)

    async def UnloadLoraAdapter(self, request, context) -> scheduler_pb2.LoraAdapterResponse:
        return await unload_lora_adapter(self.loop, request, context)

    def busy(self) -> bool:
        """Prefills taken and not yet answered (queued, computing, or writing their KV)."""
        return self.scheduler.busy() or self.sends.busy()

    def abort(self, rid: str, reason: str) -> bool:
        """Cancel rank 0's transfer of ``rid`` at once (no page of it is read any more) and end the
        request at the next step on every rank (``_abort``); False if it is not held here."""
        found = self.scheduler.request(rid) is not None or rid in self.sends.opening
        self.sends.cancel(rid)
        self.loop.abort(rid, reason)
        return found

    def _after_schedule(self) -> None:
        self.sends.start()  # send what the step's chunks will have computed; finish prefilled requests

    def _abort(self, event: Abort) -> None:
        """On every rank: stop the transfer before the scheduler frees the pages it reads."""
        self.sends.cancel(event.rid)
        if event.rid in self.sends.written:
            self.sends.settle(event.rid, event.reason)
        else:
            self.scheduler.abort_request(event.rid, event.reason)

    def _answer(self, req: Req, error: str, nbytes: int, seconds: float) -> None:
        """Answer ``req``'s Prefill call (rank 0; once): its first token, or ``error``."""
        waiter = self.waiters.get(req.rid)
        if waiter is None or waiter.done():
            return
        if error:
            waiter.set_exception(RuntimeError(error))
            return
        self.scheduler.metrics.kv_transfer_bytes.inc(nbytes)
        self.scheduler.metrics.kv_transfer_seconds.observe(seconds)
        waiter.set_result(convert.prefill_response_to_pb(req, nbytes))

    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        """Only failures and aborts come out of a prefill scheduler's steps (rank 0; the other ranks
        stop those transfers at their next step, in ``KVSends.start``)."""
        for out in outputs:
            self.sends.cancel(out.req.rid)
            waiter = self.waiters.get(out.req.rid)
            if waiter is not None and not waiter.done():
                waiter.set_exception(RuntimeError(out.req.error or "aborted"))

    def fail_all(self, error: str) -> None:
        """The rank group is going down: every Prefill call in flight fails with ``error``."""
        for waiter in self.waiters.values():
            if not waiter.done():
                waiter.set_exception(RuntimeError(error))

    async def close(self) -> None:
        """Stop awaiting the writes still in flight (the NIXL agent is the caller's)."""
        for task in self.sends.finishing.values():
            task.cancel()

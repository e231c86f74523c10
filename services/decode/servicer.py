"""DecodeScheduler servicer: gRPC in, token ids out to the detokenizers.

Handlers submit events (``events``) that the scheduler loop applies at the top of an iteration;
under tensor parallelism the same servicer runs on every rank without a gRPC server
(``tp.rank > 0``): it applies the events rank 0 hands it, never calls a prefill worker and emits
nothing. In PD (a decode worker with prefill workers) the ``PrefillCoordinator`` gets each admitted
request's prompt KV from a prefill worker.
"""

from __future__ import annotations

import logging

import grpc

from pdserve.distributed import SINGLE_RANK, TpGroup
from pdserve.kv_transfer import KVTransferAgent
from pdserve.observability import tracing
from pdserve.rpc.client_stream import DEFAULT_DEAD_AFTER_S, ClientStreamPool
from pdserve.scheduler.req import FinishReason
from pdserve.scheduler.schedule_batch import StepOutput
from pdserve.scheduler.scheduler import Scheduler
from pdserve.services.common import convert
from pdserve.services.common.events import Abort, NewRequest
from pdserve.services.common.forward_lock import ForwardLock
from pdserve.services.common.intake import check_tp, queue_request
from pdserve.services.common.kv_event_stream import flush_cache, subscribe_kv_events
from pdserve.services.common.lora_calls import load_lora_adapter, unload_lora_adapter
from pdserve.services.common.scheduler_loop import SchedulerLoop
from pdserve.services.decode.kv_ranks import KVRanks
from pdserve.services.decode.prefill_client import DEFAULT_PREFILL_DEAD_AFTER_S
from pdserve.services.decode.prefill_coordinator import PrefillCoordinator
from pdserve.v1 import common_pb2, output_pb2, output_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["DecodeScheduler"].full_name
add_to_server = scheduler_pb2_grpc.add_DecodeSchedulerServicer_to_server


class DecodeServicer(scheduler_pb2_grpc.DecodeSchedulerServicer):
    """Decode (or colocated ``mixed``) scheduler service.

    Args:
        scheduler: the scheduler core (role ``decode`` or ``mixed``).
        address: this service's advertised "host:port" (the detokenizer aborts here on stop strings).
        agent: the NIXL agent (role ``decode`` only).
        prefill_retries: how many other prefill workers a failed prefill is retried on.
        detokenizer_dead_after: seconds a detokenizer may stay unreachable before it counts as gone;
            then every request whose outputs go there is aborted (pages freed by the normal abort path).
        prefill_dead_after: seconds a prefill worker may leave its health checks unanswered while
            it holds our prefills before they are given up on it (and retried on another one).
        tp: this rank's TP group.
        overlap: overlap each step's CPU work with the next forward (``SchedulerLoop``).
        forward_lock: the forwards' turn among schedulers sharing a CPU's cores (``SchedulerLoop``).
        stream_interval: tokens per output of a request (its first and last go out at once).

    Attributes:
        draining: set by ``drain`` (SIGTERM): Generate is refused (UNAVAILABLE), the rest goes on.
        prefills: the PD coordinator (None in the mixed role: it prefills itself).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        address: str,
        agent: KVTransferAgent | None,
        prefill_retries: int = 1,
        detokenizer_dead_after: float = DEFAULT_DEAD_AFTER_S,
        prefill_dead_after: float = DEFAULT_PREFILL_DEAD_AFTER_S,
        tp: TpGroup = SINGLE_RANK,
        overlap: bool = True,
        stream_interval: int = 1,
        forward_lock: ForwardLock | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.stream_interval = stream_interval
        self.address = address
        self.agent = agent
        self.tp = tp
        self.loop = SchedulerLoop(
            scheduler, self._emit, self._after_schedule, {Abort: self._abort}, tp, overlap, forward_lock
        )
        self.prefills: PrefillCoordinator | None = None
        if agent is not None:
            kv = KVRanks(agent, scheduler, self.loop)
            stub = scheduler_pb2_grpc.PrefillSchedulerStub
            self.prefills = PrefillCoordinator(
                scheduler, self.loop, kv, stub, prefill_retries, prefill_dead_after
            )
        self.outputs = ClientStreamPool(
            lambda ch: output_pb2_grpc.DetokenizerStub(ch).StreamTokenIDs,
            dead_after=detokenizer_dead_after,
            on_dead=self._detokenizer_gone,
        )
        self.sent: dict[str, int] = {}  # rid -> tokens sent, once its first output went out
        self.draining = False
        scheduler.set_hooks(on_request_end=lambda req: tracing.end_request_span(req, scheduler.role))

    # ---- gRPC ---------------------------------------------------------------------------
    async def Generate(
        self, request: scheduler_pb2.TokenizedGenerateReqInput, context
    ) -> scheduler_pb2.GenerateAck:
        if self.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"decode worker {self.address} is shutting down: retry on another",
            )
        try:
            req = convert.generate_req_from_pb(request, self.address)
        except TypeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await check_tp(req, self.loop, context)
        if self.prefills is not None and not request.prefill_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "decode worker needs a prefill_address")
        tracing.start_request_span(req, self.scheduler.role)  # from arrival; ended when the request ends
        position = await queue_request(req, self.loop, context)
        return scheduler_pb2.GenerateAck(rid=req.rid, queue_position=position)

    async def Abort(self, request: scheduler_pb2.AbortRequest, context) -> scheduler_pb2.AbortResponse:
        finish_reason = convert.finish_reason_from_pb(request.finish_reason)  # STOP: a stop string ended it
        return scheduler_pb2.AbortResponse(
            found=self.abort(request.rid, request.reason or "aborted", finish_reason)
        )

    async def GetLoad(self, request, context) -> common_pb2.LoadInfo:
        return convert.load_to_pb(self.scheduler.load())

    async def GetMetrics(self, request, context) -> common_pb2.MetricsResponse:
        return convert.metrics_to_pb(self.scheduler.role, self.address, self.scheduler.metrics.text())

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
        """Requests still held (queued for the next step, waiting for KV, running, or ended with their
        pages still held while a prefill worker may write them)."""
        return self.scheduler.busy() or any(isinstance(e, NewRequest) for e in self.loop.inputs.pending())

    def abort(self, rid: str, reason: str, finish_reason: FinishReason = FinishReason.ABORT) -> bool:
        """Abort ``rid`` at the next step on every rank (``_abort`` also stops its prefill in flight),
        counted as ended by ``finish_reason``; False if it is neither held nor queued for the next
        step."""
        found = self.scheduler.request(rid) is not None or any(
            isinstance(e, NewRequest) and e.req.rid == rid for e in self.loop.inputs.pending()
        )
        self.loop.abort(rid, reason, finish_reason)
        return found

    def _after_schedule(self) -> None:
        if self.prefills is not None:
            self.prefills.start()  # ask prefill workers for the requests just admitted

    def _abort(self, event: Abort) -> bool:
        """Abort the request in the scheduler, and stop its prefill in flight (rank 0)."""
        if self.prefills is not None:
            self.prefills.stop(event.rid, event.reason)
        return self.scheduler.abort_request(event.rid, event.reason, event.finish_reason)

    # ---- outputs ------------------------------------------------------------------------
    def _emit(self, outputs: list[StepOutput]) -> None:
        """One BatchTokenIDOutput per detokenizer for one step's outputs.

        With ``stream_interval`` N > 1 a request's tokens go out N at a time (and always with its
        first token and its finish): fewer messages, decodes and SSE events per token.
        """
        batches: dict[str, convert.TokenIDBatchBuilder] = {}
        interval = self.stream_interval
        for out in outputs:
            req = out.req
            target = req.route.output_address
            if not target:
                continue
            first = req.rid not in self.sent
            sent = self.sent.get(req.rid, 0)
            if not (first or out.finished) and len(req.output_ids) - sent < interval:
                continue
            self.sent[req.rid] = len(req.output_ids)
            if out.finished:
                del self.sent[req.rid]
                if self.prefills is not None:
                    self.prefills.stop(req.rid, req.error or "finished")
            new_ids = req.output_ids[sent:] if interval > 1 else out.new_token_ids
            builder = batches.get(target)
            if builder is None:
                builder = batches[target] = convert.TokenIDBatchBuilder()
            builder.add(req, new_ids, out.finished, first)
        for target, builder in batches.items():
            self.outputs.send(target, builder.build())

    def _detokenizer_gone(self, address: str, dropped: list[output_pb2.BatchTokenIDOutput]) -> None:
        """Abort every request whose outputs go to the detokenizer at ``address``: no one reads them."""
        reqs = [self.scheduler.request(rid) for rid in self.scheduler.held_rids()]
        reqs = [req for req in reqs if req.route.output_address == address]
        logger.warning(
            "detokenizer %s is gone: aborting its %d requests (%d output batches undelivered)",
            address,
            len(reqs),
            len(dropped),
        )
        for req in reqs:
            req.route.output_address = ""  # its abort output has nowhere to go
            self.sent.pop(req.rid, None)
            self.abort(req.rid, f"detokenizer {address} is gone")

    async def fail_all(self, error: str) -> None:
        """The rank group is going down: every request (queued or not yet applied) ends with ``error``,
        and the outputs that say so are delivered (a few seconds at most)."""
        outputs = self.scheduler.fail_all(error)
        for event in self.loop.inputs.pending():
            if isinstance(event, NewRequest):
                event.req.retryable = True
                event.req.finish(FinishReason.ERROR, error)
                outputs.append(StepOutput(event.req, finished=True))
        self._emit(outputs)
        await self.outputs.close()

    async def close(self) -> None:
        """Stop the prefills in flight and the output streams (the NIXL agent is the caller's)."""
        if self.prefills is not None:
            await self.prefills.close()
        await self.outputs.close()

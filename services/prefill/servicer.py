"""PrefillScheduler servicer: prefill prompts for decode workers and write their KV over NIXL.

Handlers submit events (``step_inputs``) that the scheduler loop applies at the top of an
iteration. Under tensor parallelism the same servicer runs on every rank (without a gRPC server on
ranks > 0): every rank prefills the same requests, and rank ``i`` writes its KV shard into rank
``i`` of the decode worker. Each rank reports when its own write ended; once every rank's write
landed (or one failed) every rank frees or caches the pages at the same step, and rank 0 answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from pdserve.distributed import SINGLE_RANK, TpGroup
from pdserve.kv_transfer import KVAgentInfo, KVLayoutMismatch, KVTransferAgent
from pdserve.scheduler.overload import QueueFull
from pdserve.scheduler.req import Req
from pdserve.scheduler.scheduler import Scheduler, StepOutput
from pdserve.services.common.convert import (
    kv_agent_info_to_pb,
    kv_rank_agents_from_pb,
    sampling_params_from_pb,
    token_logprob_to_pb,
)
from pdserve.services.common.scheduler_loop import SchedulerLoop
from pdserve.services.common.step_inputs import Abort, NewRequest
from pdserve.services.decode.servicer import load_info
from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

TRANSFER_TIMEOUT_S = 30.0


@dataclass(slots=True)
class AddKVPeers:
    """A decode worker's agents, one per rank: rank ``i`` of this group loads ``agents[i]``."""

    agents: list[KVAgentInfo]


@dataclass(slots=True)
class KVWritten:
    """Rank ``rank``'s KV write for ``rid`` ended: ``error`` is empty when every byte landed."""

    rid: str
    rank: int
    error: str
    nbytes: int


class PrefillServicer(scheduler_pb2_grpc.PrefillSchedulerServicer):
    """Prefill-scheduler service.

    ``Prefill`` queues the request and waits; when the scheduler has its first token, the KV pages
    decode lacks are written into decode's pages, then the call answers. A cancelled call (decode
    aborted, or gone) aborts the request and frees its pages here.

    Args:
        scheduler, address, agent: the scheduler core, this service's address, this rank's NIXL agent.
        tp: this rank's TP group.
        rank_agents: every rank's agent (rank order), answered in the handshake.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        address: str,
        agent: KVTransferAgent,
        tp: TpGroup = SINGLE_RANK,
        rank_agents: list[KVAgentInfo] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.address = address
        self.agent = agent
        self.tp = tp
        self.rank_agents = rank_agents or [agent.local_info()]
        handlers = {Abort: self._abort, AddKVPeers: self._add_rank_peer, KVWritten: self._written}
        self.loop = SchedulerLoop(scheduler, self._on_outputs, self._start_transfers, handlers, tp)
        self.waiters: dict[str, asyncio.Future] = {}
        self.transfers: dict[str, asyncio.Task] = {}  # this rank's KV writes in flight
        self.written: dict[str, dict[int, KVWritten]] = {}  # prefilled rids: each rank's ended write
        self.rank_peer: dict[str, str] = {}  # decode rank 0's agent -> the agent this rank writes to

    async def ExchangeKVAgentInfo(
        self, request: scheduler_pb2.KVAgentInfo, context
    ) -> scheduler_pb2.KVAgentInfo:
        agents = kv_rank_agents_from_pb(request)
        if len(agents) != self.tp.size:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"KV layout mismatch with prefill: tp_size: decode {len(agents)}, prefill {self.tp.size}"
                " (prefill rank i writes decode rank i: both need the same TP size)",
            )
        try:
            self.agent.add_peer(agents[0])
        except KVLayoutMismatch as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV layout mismatch with prefill: {e}")
        if self.tp.size > 1:
            self.loop.inputs.submit(AddKVPeers(agents))
            self.loop.wake()
        response = kv_agent_info_to_pb(self.agent.local_info())
        response.tp_rank_agents.extend(kv_agent_info_to_pb(info) for info in self.rank_agents[1:])
        return response

    async def Prefill(self, request: scheduler_pb2.PrefillRequest, context) -> scheduler_pb2.PrefillResponse:
        if not self.agent.has_peer(request.dst_agent_name, request.dst_incarnation):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "unknown decode agent: exchange agent info first"
            )
        try:
            params = sampling_params_from_pb(request.sampling_params)
        except TypeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        req = Req(
            rid=request.rid,
            origin_input_ids=list(request.input_ids),
            sampling_params=params,
            deadline=request.deadline_unix_s,
            meta={
                "dst_agent": request.dst_agent_name,
                "dst_pages": list(request.dst_page_indices),
                "dst_start_page": request.dst_start_page,
            },
        )
        try:
            if req.rid in self.waiters:
                raise ValueError(f"duplicate rid {req.rid!r}")
            pending = sum(isinstance(e, NewRequest) for e in self.loop.inputs.pending())
            self.scheduler.check_request(req, pending)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        waiter = self.waiters[req.rid] = asyncio.get_running_loop().create_future()
        self.loop.inputs.submit(NewRequest(req))
        self.loop.wake()
        try:
            return await waiter
        except asyncio.CancelledError:
            self.loop.inputs.submit(Abort(req.rid, "prefill call cancelled"))
            self.loop.wake()
            raise
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        finally:
            self.waiters.pop(req.rid, None)

    async def Abort(self, request: scheduler_pb2.AbortRequest, context) -> scheduler_pb2.AbortResponse:
        found = request.rid in self.waiters
        self.loop.inputs.submit(Abort(request.rid, request.reason or "aborted"))
        self.loop.wake()
        return scheduler_pb2.AbortResponse(found=found)

    async def GetLoad(self, request, context) -> common_pb2.LoadInfo:
        return load_info(self.scheduler)

    async def GetMetrics(self, request, context) -> common_pb2.MetricsResponse:
        return common_pb2.MetricsResponse(
            role="prefill", worker=self.address, text=self.scheduler.metrics.text()
        )

    # ---- inputs: applied on every rank, in rank 0's order ---------------------------------
    def _abort(self, event: Abort) -> None:
        if event.rid in self.written:
            self._finish_transfer(event.rid, event.reason)
        else:
            self.scheduler.abort_request(event.rid, event.reason)

    def _add_rank_peer(self, event: AddKVPeers) -> None:
        """This rank's decode peer (rank 0 loaded its own in the handshake). A peer that cannot be
        loaded here fails this rank's writes to it, which fails those prefills cleanly."""
        agents = event.agents
        if self.tp.is_driver:
            return
        try:
            self.agent.add_peer(agents[self.tp.rank])
        except Exception as e:
            logger.error(
                "TP rank %d cannot add KV peer %s: %s", self.tp.rank, agents[self.tp.rank].agent_name, e
            )
            return
        self.rank_peer[agents[0].agent_name] = agents[self.tp.rank].agent_name

    def _written(self, event: KVWritten) -> None:
        ended = self.written.get(event.rid)
        if ended is None:
            return  # aborted or failed already
        ended[event.rank] = event
        if event.error:
            self._finish_transfer(event.rid, f"KV transfer failed on TP rank {event.rank}: {event.error}")
        elif len(ended) == self.tp.size:
            self._finish_transfer(event.rid, "")

    def _finish_transfer(self, rid: str, error: str) -> None:
        """Every rank's write for ``rid`` landed (``error`` empty) or one failed: cache or free its
        pages on every rank at this same step; rank 0 answers the Prefill call."""
        ended = self.written.pop(rid)
        task = self.transfers.pop(rid, None)
        if task is not None:
            task.cancel()
        req = self.scheduler.reqs.get(rid)
        self.scheduler.prefill_sent(rid, ok=not error, error=error)
        waiter = self.waiters.get(rid)
        if req is None or waiter is None or waiter.done():
            return
        if error:
            waiter.set_exception(RuntimeError(error))
            return
        nbytes = sum(e.nbytes for e in ended.values())
        self.scheduler.metrics.kv_transfer_bytes.inc(nbytes)
        response = scheduler_pb2.PrefillResponse(
            rid=rid,
            first_token_id=req.output_ids[-1],
            cached_tokens=req.cached_tokens,
            transferred_bytes=nbytes,
        )
        if req.output_logprobs:
            token, logprob, top = req.output_logprobs[-1]
            response.first_logprob.CopyFrom(token_logprob_to_pb(token, logprob, top))
        waiter.set_result(response)

    # ---- outputs and transfers ------------------------------------------------------------
    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        """Only failures and aborts come out of a prefill scheduler's steps."""
        for out in outputs:
            waiter = self.waiters.get(out.req.rid)
            if waiter is not None and not waiter.done():
                waiter.set_exception(RuntimeError(out.req.error or "aborted"))

    def fail_all(self, error: str) -> None:
        """The rank group is going down: every Prefill call in flight fails with ``error``."""
        for waiter in self.waiters.values():
            if not waiter.done():
                waiter.set_exception(RuntimeError(error))

    def _start_transfers(self) -> None:
        for req in self.scheduler.pop_prefilled():
            self.written[req.rid] = {}
            self.transfers[req.rid] = asyncio.create_task(self._transfer(req))

    async def _transfer(self, req: Req) -> None:
        """This rank's write of ``req``'s KV shard; its end is reported to every rank."""
        start = req.meta["dst_start_page"]
        dst_pages = req.meta["dst_pages"]
        src_pages = req.pages[start : start + len(dst_pages)]
        peer = self.rank_peer.get(req.meta["dst_agent"], req.meta["dst_agent"])
        timeout = TRANSFER_TIMEOUT_S
        if req.deadline:
            timeout = max(0.1, min(timeout, req.deadline - time.time()))
        try:
            nbytes = await self.agent.write_pages(
                peer, src_pages, dst_pages, notif=req.rid.encode(), timeout_s=timeout
            )
            event = KVWritten(req.rid, self.tp.rank, "", nbytes)
        except asyncio.CancelledError:
            return
        except Exception as e:
            logger.warning("KV write for %s failed: %s", req.rid, e)
            event = KVWritten(req.rid, self.tp.rank, str(e) or type(e).__name__, 0)
        self.transfers.pop(req.rid, None)
        self.loop.inputs.report(event)
        self.loop.wake()

"""PrefillScheduler servicer: prefill prompts for decode workers and write their KV over NIXL."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve.kv_transfer import KVLayoutMismatch, KVTransferAgent
from pdserve.scheduler.overload import QueueFull
from pdserve.scheduler.req import Req
from pdserve.scheduler.scheduler import Scheduler, StepOutput
from pdserve.services.common.convert import (
    kv_agent_info_from_pb,
    kv_agent_info_to_pb,
    sampling_params_from_pb,
    token_logprob_to_pb,
)
from pdserve.services.common.grammar_wait import grammar_error
from pdserve.services.common.scheduler_loop import SchedulerLoop
from pdserve.services.decode.servicer import load_info
from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

TRANSFER_TIMEOUT_S = 30.0


class PrefillServicer(scheduler_pb2_grpc.PrefillSchedulerServicer):
    """Prefill-scheduler service.

    ``Prefill`` queues the request and waits; when the scheduler has its first token, the KV pages
    decode lacks are written into decode's pages, then the call answers. A cancelled call (decode
    aborted, or gone) aborts the request and frees its pages here.
    """

    def __init__(self, scheduler: Scheduler, address: str, agent: KVTransferAgent) -> None:
        self.scheduler = scheduler
        self.address = address
        self.agent = agent
        self.loop = SchedulerLoop(scheduler, self._on_outputs, self._start_transfers)
        self.waiters: dict[str, asyncio.Future] = {}
        self.transfers: dict[str, asyncio.Task] = {}

    async def ExchangeKVAgentInfo(
        self, request: scheduler_pb2.KVAgentInfo, context
    ) -> scheduler_pb2.KVAgentInfo:
        try:
            self.agent.add_peer(kv_agent_info_from_pb(request))
        except KVLayoutMismatch as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV layout mismatch with prefill: {e}")
        return kv_agent_info_to_pb(self.agent.local_info())

    async def Prefill(self, request: scheduler_pb2.PrefillRequest, context) -> scheduler_pb2.PrefillResponse:
        if not self.agent.has_peer(request.dst_agent_name, request.dst_incarnation):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "unknown decode agent: exchange agent info first"
            )
        try:
            params = sampling_params_from_pb(request.sampling_params)
        except TypeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        ids = list(request.input_ids)
        generated = min(max(request.num_output_ids, 0), max(len(ids) - 1, 0))
        req = Req(
            rid=request.rid,
            origin_input_ids=ids[: len(ids) - generated],
            output_ids=ids[len(ids) - generated :],
            sampling_params=params,
            deadline=request.deadline_unix_s,
            meta={
                "dst_agent": request.dst_agent_name,
                "dst_pages": list(request.dst_page_indices),
                "dst_start_page": request.dst_start_page,
            },
        )
        try:
            self.scheduler.add_request(req)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        waiter = self.waiters[req.rid] = asyncio.get_running_loop().create_future()
        self.loop.wake()
        try:
            error = await grammar_error(self.scheduler, req.rid)
            if error:
                if waiter.done():
                    waiter.exception()  # the scheduler failed it too: retrieved, not logged
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
            self.loop.wake()
            return await waiter
        except asyncio.CancelledError:
            self._abort(req.rid, "prefill call cancelled")
            raise
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        finally:
            self.waiters.pop(req.rid, None)

    async def Abort(self, request: scheduler_pb2.AbortRequest, context) -> scheduler_pb2.AbortResponse:
        return scheduler_pb2.AbortResponse(found=self._abort(request.rid, request.reason or "aborted"))

    async def GetLoad(self, request, context) -> common_pb2.LoadInfo:
        return load_info(self.scheduler)

    async def GetMetrics(self, request, context) -> common_pb2.MetricsResponse:
        return common_pb2.MetricsResponse(
            role="prefill", worker=self.address, text=self.scheduler.metrics.text()
        )

    # ---- internals ----------------------------------------------------------------------
    def _abort(self, rid: str, reason: str) -> bool:
        task = self.transfers.pop(rid, None)
        if task is not None:
            task.cancel()
            self.scheduler.prefill_sent(rid, ok=False, error=reason)
            found = True
        else:
            found = self.scheduler.abort_request(rid, reason)
        self.loop.wake()
        return found

    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        """Only failures and aborts come out of a prefill scheduler's steps."""
        for out in outputs:
            waiter = self.waiters.get(out.req.rid)
            if waiter is not None and not waiter.done():
                waiter.set_exception(RuntimeError(out.req.error or "aborted"))

    def _start_transfers(self) -> None:
        for req in self.scheduler.pop_prefilled():
            self.transfers[req.rid] = asyncio.create_task(self._transfer(req))

    async def _transfer(self, req: Req) -> None:
        start = req.meta["dst_start_page"]
        dst_pages = req.meta["dst_pages"]
        src_pages = req.pages[start : start + len(dst_pages)]
        timeout = TRANSFER_TIMEOUT_S
        if req.deadline:
            timeout = max(0.1, min(timeout, req.deadline - time.time()))
        try:
            nbytes = await self.agent.write_pages(
                req.meta["dst_agent"], src_pages, dst_pages, notif=req.rid.encode(), timeout_s=timeout
            )
        except asyncio.CancelledError:
            return
        except Exception as e:
            logger.warning("KV write for %s failed: %s", req.rid, e)
            self.transfers.pop(req.rid, None)
            self.scheduler.prefill_sent(req.rid, ok=False, error=str(e))
            waiter = self.waiters.get(req.rid)
            if waiter is not None and not waiter.done():
                waiter.set_exception(RuntimeError(f"KV transfer failed: {e}"))
            return
        self.transfers.pop(req.rid, None)
        self.scheduler.metrics.kv_transfer_bytes.inc(nbytes)
        response = scheduler_pb2.PrefillResponse(
            rid=req.rid,
            first_token_id=req.output_ids[-1],
            cached_tokens=req.cached_tokens,
            transferred_bytes=nbytes,
        )
        if req.output_logprobs:
            token, logprob, top = req.output_logprobs[-1]
            response.first_logprob.CopyFrom(token_logprob_to_pb(token, logprob, top))
        self.scheduler.prefill_sent(req.rid, ok=True)
        waiter = self.waiters.get(req.rid)
        if waiter is not None and not waiter.done():
            waiter.set_result(response)
        self.loop.wake()

"""PrefillScheduler servicer: prefill prompts for decode workers and write their KV over NIXL.

A request's KV transfer opens when its Prefill call arrives. After every scheduling step the pages its
processed chunks filled are sent (``stream_chunks``; with the overlapped loop a chunk whose batch is
still outstanding is not, ``Scheduler.computed_tokens``), so they move while later chunks compute; the rest
go once the last chunk has sampled the first token, and the call answers when every byte is written.
A transfer is cancelled (no page of it read any more) before the scheduler's pages of an ended
request can be handed to another one: on abort, and at the first step after a scheduler-side end.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve.kv_transfer import KVLayoutMismatch, KVTransfer, KVTransferAgent, KVTransferError
from pdserve.observability import tracing
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

    ``Prefill`` queues the request and waits; the KV pages decode lacks are written into decode's
    pages as they are computed, and the call answers with the first token once all are written. A
    cancelled call (decode aborted, or gone) aborts the request and frees its pages here. While
    ``draining`` (SIGTERM, see ``drain``) new Prefill calls are refused (UNAVAILABLE) and the ones
    taken are finished.

    Args:
        scheduler: the prefill-role scheduler.
        address: this service's advertised "host:port".
        agent: the NIXL agent.
        stream_chunks: send a chunked prompt's finished pages after each chunk (else all at the end).
        transfer_timeout_s: how long a transfer may wait for the decode side (a free slot, a WRITE's
            completion), and at most for the end of its write after the prompt's last chunk.
        overlap: overlap each step's CPU work with the next forward (``SchedulerLoop``).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        address: str,
        agent: KVTransferAgent,
        stream_chunks: bool = True,
        transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
        overlap: bool = True,
    ) -> None:
        self.scheduler = scheduler
        self.address = address
        self.agent = agent
        self.stream_chunks = stream_chunks
        self.transfer_timeout_s = transfer_timeout_s
        self.loop = SchedulerLoop(scheduler, self._on_outputs, self._start_transfers, overlap=overlap)
        self.waiters: dict[str, asyncio.Future] = {}
        self.transfers: dict[str, KVTransfer] = {}  # open, by rid
        self.finishing: dict[str, asyncio.Task] = {}  # prefilled, awaiting the end of their write
        self.draining = False
        scheduler.on_request_end = lambda req: tracing.end_request_span(req, "prefill")

    async def ExchangeKVAgentInfo(
        self, request: scheduler_pb2.KVAgentInfo, context
    ) -> scheduler_pb2.KVAgentInfo:
        try:
            self.agent.add_peer(kv_agent_info_from_pb(request))
        except KVLayoutMismatch as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV layout mismatch with prefill: {e}")
        return kv_agent_info_to_pb(self.agent.local_info())

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
            meta={"dst_start_page": request.dst_start_page, "sent_pages": 0},
        )
        dst_pages = list(request.dst_page_indices)
        prompt_pages = -(-len(request.input_ids) // self.scheduler.page_size)
        if request.dst_start_page < 0 or request.dst_start_page + len(dst_pages) > prompt_pages:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"destination pages [{request.dst_start_page}, +{len(dst_pages)}) exceed the prompt's"
                f" {prompt_pages} pages",
            )
        tid = (request.kv_transfer_id or request.rid).encode()
        try:
            transfer = self.agent.start_transfer(
                request.dst_agent_name, tid, dst_pages, self.transfer_timeout_s
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except KVTransferError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        self.transfers[req.rid] = transfer
        tracing.start_request_span(req, "prefill")
        waiter = self.waiters[req.rid] = asyncio.get_running_loop().create_future()
        try:  # a call cancelled while its add is queued still aborts it (the add is applied anyway)
            try:
                await self.loop.add(req)
            except (ValueError, QueueFull) as e:
                self.transfers.pop(req.rid, None)
                transfer.cancel()
                code = (
                    grpc.StatusCode.INVALID_ARGUMENT
                    if isinstance(e, ValueError)
                    else grpc.StatusCode.RESOURCE_EXHAUSTED
                )
                await context.abort(code, str(e))
            error = await grammar_error(self.scheduler, req.rid)
            self.loop.wake()  # a compiled grammar moves its request on at the next step
            if error:
                if waiter.done():
                    waiter.exception()  # the scheduler failed it too: retrieved, not logged
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
            return await waiter
        except asyncio.CancelledError:
            self.abort(req.rid, "prefill call cancelled")
            raise
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        finally:
            self.waiters.pop(req.rid, None)

    async def Abort(self, request: scheduler_pb2.AbortRequest, context) -> scheduler_pb2.AbortResponse:
        return scheduler_pb2.AbortResponse(found=self.abort(request.rid, request.reason or "aborted"))

    async def GetLoad(self, request, context) -> common_pb2.LoadInfo:
        return load_info(self.scheduler)

    async def GetMetrics(self, request, context) -> common_pb2.MetricsResponse:
        return common_pb2.MetricsResponse(
            role="prefill", worker=self.address, text=self.scheduler.metrics.text()
        )

    def busy(self) -> bool:
        """Prefills taken and not yet answered (computing, or writing their KV)."""
        return bool(self.scheduler.reqs or self.transfers or self.finishing)

    def abort(self, rid: str, reason: str) -> bool:
        """Cancel ``rid``'s transfer now and end it in the scheduler at the next step's input point;
        False if the scheduler does not hold it."""
        found = rid in self.scheduler.reqs
        transfer = self.transfers.pop(rid, None)
        if transfer is not None:
            transfer.cancel()  # before the scheduler frees the pages it reads
        task = self.finishing.pop(rid, None)
        if task is not None:
            task.cancel()
            self.loop.call(Scheduler.prefill_sent, rid, False, reason)
        else:
            self.loop.abort(rid, reason)
        return found

    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        """Only failures and aborts come out of a prefill scheduler's steps."""
        for out in outputs:
            transfer = self.transfers.pop(out.req.rid, None)
            if transfer is not None:
                transfer.cancel()
            waiter = self.waiters.get(out.req.rid)
            if waiter is not None and not waiter.done():
                waiter.set_exception(RuntimeError(out.req.error or "aborted"))

    def _start_transfers(self) -> None:
        """After each schedule (before the forward): stop transfers of requests that ended, send the
        pages of finished chunks, and finish the transfers of requests whose prefill is complete."""
        for rid in [rid for rid in self.transfers if rid not in self.scheduler.reqs]:
            self.transfers.pop(rid).cancel()
        if self.stream_chunks:
            for req in self.scheduler.prefilling:
                self._send_ready_pages(req, self.scheduler.computed_tokens(req) // self.scheduler.page_size)
        for req in self.scheduler.pop_prefilled():
            transfer = self.transfers.get(req.rid)
            if transfer is None:
                continue
            self._send_ready_pages(req, len(req.pages))
            transfer.finish()
            self.finishing[req.rid] = asyncio.create_task(self._finish(req, transfer))

    def _send_ready_pages(self, req: Req, ready_pages: int) -> None:
        """Send the decode pages whose prompt pages ``< ready_pages`` are computed and not sent yet."""
        transfer = self.transfers.get(req.rid)
        if transfer is None:
            return
        start, sent = req.meta["dst_start_page"], req.meta["sent_pages"]
        end = min(ready_pages - start, len(transfer.dst_pages))
        if end > sent:
            transfer.send(req.pages[start + sent : start + end], sent)
            req.meta["sent_pages"] = end

    async def _finish(self, req: Req, transfer: KVTransfer) -> None:
        """Await the end of ``req``'s write, then answer its Prefill call and release its pages."""
        prefilled = time.monotonic()
        timeout = self.transfer_timeout_s
        if req.deadline:
            timeout = max(0.1, min(timeout, req.deadline - time.time()))
        try:
            nbytes = await transfer.wait(timeout)
        except asyncio.CancelledError:
            return
        except KVTransferError as e:
            logger.warning("KV write for %s failed: %s", req.rid, e, extra={"rid": req.rid})
            self.finishing.pop(req.rid, None)
            self.transfers.pop(req.rid, None)
            self.loop.call(Scheduler.prefill_sent, req.rid, False, str(e))
            waiter = self.waiters.get(req.rid)
            if waiter is not None and not waiter.done():
                waiter.set_exception(RuntimeError(f"KV transfer failed: {e}"))
            return
        self.finishing.pop(req.rid, None)
        self.transfers.pop(req.rid, None)
        self.scheduler.metrics.kv_transfer_bytes.inc(nbytes)
        self.scheduler.metrics.kv_transfer_seconds.observe(time.monotonic() - prefilled)
        response = scheduler_pb2.PrefillResponse(
            rid=req.rid,
            first_token_id=req.output_ids[-1],
            cached_tokens=req.cached_tokens,
            transferred_bytes=nbytes,
        )
        if req.output_logprobs:
            token, logprob, top = req.output_logprobs[-1]
            response.first_logprob.CopyFrom(token_logprob_to_pb(token, logprob, top))
        self.loop.call(Scheduler.prefill_sent, req.rid, True)
        waiter = self.waiters.get(req.rid)
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

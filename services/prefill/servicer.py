"""PrefillScheduler servicer: prefill prompts for decode workers and write their KV over NIXL.

A request's KV transfer opens when its Prefill call arrives. After every scheduling step the pages its
processed chunks filled are sent (``stream_chunks``; with the overlapped loop a chunk whose batch is
still outstanding is not, ``Scheduler.computed_tokens``), so they move while later chunks compute; the rest
go once the last chunk has sampled the first token, and the call answers when every byte is written.
A transfer is cancelled (no page of it read any more) before the scheduler's pages of an ended
request can be handed to another one: on abort, and at the first step after a scheduler-side end.

Handlers submit events (``step_inputs``) that the scheduler loop applies at the top of an
iteration. Under tensor parallelism the same servicer runs on every rank (without a gRPC server on
ranks > 0): every rank prefills the same requests and rank ``i`` opens, streams and finishes the
transfer of its KV head shard into rank ``i`` of the decode worker (same transfer id, its own NIXL
agent). Each rank reports when its own write ended;
once every rank's write landed (or one failed) every rank caches or frees the pages at the same
step, and rank 0 answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from pdserve.distributed import SINGLE_RANK, TpGroup
from pdserve.kv_transfer import KVAgentInfo, KVLayoutMismatch, KVTransfer, KVTransferAgent, KVTransferError
from pdserve.observability import tracing
from pdserve.scheduler.overload import QueueFull
from pdserve.scheduler.req import Req
from pdserve.scheduler.scheduler import Scheduler, StepOutput
from pdserve.services.common.convert import (
    kv_agent_info_to_pb,
    kv_rank_agents_from_pb,
    sampling_params_from_pb,
    token_logprob_to_pb,
)
from pdserve.services.common.grammar_wait import grammar_error, tp_refusal
from pdserve.services.common.scheduler_loop import SchedulerLoop, refusal_status
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
        transfer_timeout_s: how long a transfer may wait for the decode side (a free slot, a WRITE's
            completion), and at most for the end of its write after the prompt's last chunk.
        tp: this rank's TP group.
        rank_agents: every rank's agent (rank order), answered in the handshake.
        overlap: overlap each step's CPU work with the next forward (``SchedulerLoop``).
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
    ) -> None:
        self.scheduler = scheduler
        self.address = address
        self.agent = agent
        self.stream_chunks = stream_chunks
        self.transfer_timeout_s = transfer_timeout_s
        self.tp = tp
        self.rank_agents = rank_agents or [agent.local_info()]
        handlers = {
            NewRequest: self._add,
            Abort: self._abort,
            AddKVPeers: self._add_rank_peer,
            KVWritten: self._written,
        }
        self.loop = SchedulerLoop(scheduler, self._on_outputs, self._start_transfers, handlers, tp, overlap)
        self.waiters: dict[str, asyncio.Future] = {}
        self.opening: dict[str, KVTransfer] = {}  # rank 0: opened by the handler, request not queued yet
        self.transfers: dict[str, KVTransfer] = {}  # this rank's open transfers, by rid
        self.finishing: dict[str, asyncio.Task] = {}  # prefilled, awaiting the end of this rank's write
        self.written: dict[str, dict[int, KVWritten]] = {}  # prefilled rids: each rank's ended write
        self.rank_peer: dict[str, str] = {}  # decode rank 0's agent -> the agent this rank writes to
        self.draining = False
        scheduler.on_request_end = lambda req: tracing.end_request_span(req, "prefill")

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
        refusal = tp_refusal(params, self.tp)
        if refusal:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
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
        req.meta.update(dst_agent=request.dst_agent_name, dst_pages=dst_pages, tid=tid)
        try:
            transfer = self.agent.start_transfer(
                request.dst_agent_name, tid, dst_pages, self.transfer_timeout_s
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except KVTransferError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        if req.rid in self.waiters:
            transfer.cancel()
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"duplicate rid {req.rid!r}")
        self.opening[req.rid] = transfer
        tracing.start_request_span(req, "prefill")
        waiter = self.waiters[req.rid] = asyncio.get_running_loop().create_future()
        try:  # a call cancelled while its add is queued still aborts it (the add is applied anyway)
            try:
                await self.loop.add(req)
            except (ValueError, QueueFull) as e:
                await context.abort(refusal_status(e), str(e))
            error = await grammar_error(self.scheduler, req)
            self.loop.wake()  # a compiled grammar moves its request on at the next step
            if error:
                if waiter.done():
                    waiter.exception()  # the scheduler failed it too: retrieved, not logged
                await context.abort(*error)
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
        """Prefills taken and not yet answered (queued, computing, or writing their KV)."""
        return bool(self.scheduler.reqs or self.opening or self.transfers or self.finishing or self.written)

    def abort(self, rid: str, reason: str) -> bool:
        """Cancel rank 0's transfer of ``rid`` at once (no page of it is read any more) and end the
        request at the next step on every rank (``_abort``); False if it is not held here."""
        found = rid in self.scheduler.reqs or rid in self.opening
        for transfers in (self.opening, self.transfers):
            transfer = transfers.pop(rid, None)
            if transfer is not None:
                transfer.cancel()
        self.loop.abort(rid, reason)
        return found

    # ---- inputs: applied on every rank, in rank 0's order ---------------------------------
    def _add(self, event: NewRequest) -> int:
        """Queue the request with this rank's transfer open (rank 0 opened its own in the handler).
        A rank that cannot open one still queues the request, so every rank schedules the same; its
        write then fails at once, which fails the prefill on every rank at the same step."""
        req = event.req
        opening = self.opening.pop(req.rid, None)
        transfer = opening if self.tp.is_driver else self._open_rank_transfer(req)
        try:
            position = self.loop.add_request(event)
        except Exception:  # refused (on every rank alike): nothing reads its pages
            if transfer is not None:
                transfer.cancel()
            raise
        if transfer is not None:
            self.transfers[req.rid] = transfer
        return position

    def _open_rank_transfer(self, req: Req) -> KVTransfer | None:
        dst_agent = req.meta["dst_agent"]
        peer = self.rank_peer.get(dst_agent, dst_agent)
        try:
            return self.agent.start_transfer(
                peer, req.meta["tid"], req.meta["dst_pages"], self.transfer_timeout_s
            )
        except (ValueError, KVTransferError) as e:
            logger.error("TP rank %d cannot open the KV transfer of %s: %s", self.tp.rank, req.rid, e)
            return None

    def _abort(self, event: Abort) -> None:
        transfer = self.transfers.pop(event.rid, None)
        if transfer is not None:
            transfer.cancel()  # before the scheduler frees the pages it reads
        if event.rid in self.written:
            self._finish_transfer(event.rid, event.reason)
        else:
            self.scheduler.abort_request(event.rid, event.reason)

    def _add_rank_peer(self, event: AddKVPeers) -> None:
        """This rank's decode peer (rank 0 loaded its own in the handshake). A peer that cannot be
        loaded here fails this rank's transfers to it, which fails those prefills cleanly."""
        if self.tp.is_driver:
            return
        mine = event.agents[self.tp.rank]
        try:
            self.agent.add_peer(mine)
        except Exception as e:
            logger.error("TP rank %d cannot add KV peer %s: %s", self.tp.rank, mine.agent_name, e)
            return
        self.rank_peer[event.agents[0].agent_name] = mine.agent_name

    def _written(self, event: KVWritten) -> None:
        ended = self.written.get(event.rid)
        if ended is None:
            return  # aborted or failed already
        ended[event.rank] = event
        if event.error:
            where = f" on TP rank {event.rank}" if self.tp.size > 1 else ""
            self._finish_transfer(event.rid, f"KV transfer failed{where}: {event.error}")
        elif len(ended) == self.tp.size:
            self._finish_transfer(event.rid, "")

    def _finish_transfer(self, rid: str, error: str) -> None:
        """Every rank's write for ``rid`` landed (``error`` empty) or one failed: cache or free its
        pages on every rank at this same step; rank 0 answers the Prefill call."""
        ended = self.written.pop(rid)
        task = self.finishing.pop(rid, None)
        if task is not None:
            task.cancel()
        transfer = self.transfers.pop(rid, None)
        if transfer is not None:
            transfer.cancel()  # no-op once complete
        req = self.scheduler.reqs.get(rid)
        self.scheduler.prefill_sent(rid, ok=not error, error=error)
        if req is not None:
            self._answer(req, error, sum(e.nbytes for e in ended.values()))

    def _answer(self, req: Req, error: str, nbytes: int) -> None:
        """Answer ``req``'s Prefill call (rank 0; once): its first token, or ``error``."""
        waiter = self.waiters.get(req.rid)
        if waiter is None or waiter.done():
            return
        if error:
            waiter.set_exception(RuntimeError(error))
            return
        self.scheduler.metrics.kv_transfer_bytes.inc(nbytes)
        self.scheduler.metrics.kv_transfer_seconds.observe(time.monotonic() - req.meta["prefilled_at"])
        response = scheduler_pb2.PrefillResponse(
            rid=req.rid,
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
        """Only failures and aborts come out of a prefill scheduler's steps (rank 0; the other ranks
        stop those transfers at their next step, in ``_start_transfers``)."""
        for out in outputs:
            transfer = self.transfers.pop(out.req.rid, None)
            if transfer is not None:
                transfer.cancel()
            waiter = self.waiters.get(out.req.rid)
            if waiter is not None and not waiter.done():
                waiter.set_exception(RuntimeError(out.req.error or "aborted"))

    def fail_all(self, error: str) -> None:
        """The rank group is going down: every Prefill call in flight fails with ``error``."""
        for waiter in self.waiters.values():
            if not waiter.done():
                waiter.set_exception(RuntimeError(error))

    def _start_transfers(self) -> None:
        """After each schedule (before the forward): stop transfers of requests that ended, send the
        pages of finished chunks, and finish the transfers of requests whose prefill is complete."""
        for rid in [rid for rid in self.transfers if rid not in self.scheduler.reqs]:
            self.transfers.pop(rid).cancel()
        if self.stream_chunks:
            for req in self.scheduler.prefilling:
                ready = self.scheduler.computed_tokens(req) // self.scheduler.page_size
                self._send_ready_pages(req, ready)
        for req in self.scheduler.pop_prefilled():
            self.written[req.rid] = {}
            req.meta["prefilled_at"] = time.monotonic()
            transfer = self.transfers.get(req.rid)
            if transfer is None:
                self.loop.inputs.report(KVWritten(req.rid, self.tp.rank, "no KV transfer open for it", 0))
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
        """Await the end of this rank's write of ``req``'s KV; report it (every rank learns it at the
        next step, where the pages are cached or freed). With one rank the call answers at once."""
        timeout = self.transfer_timeout_s
        if req.deadline:
            timeout = max(0.1, min(timeout, req.deadline - time.time()))
        try:
            nbytes = await transfer.wait(timeout)
            event = KVWritten(req.rid, self.tp.rank, "", nbytes)
        except asyncio.CancelledError:
            return
        except KVTransferError as e:
            logger.warning("KV write for %s failed: %s", req.rid, e, extra={"rid": req.rid})
            event = KVWritten(req.rid, self.tp.rank, str(e) or type(e).__name__, 0)
        self.finishing.pop(req.rid, None)
        if self.tp.size == 1:
            self._answer(req, event.error and f"KV transfer failed: {event.error}", event.nbytes)
        self.loop.inputs.report(event)
        self.loop.wake()

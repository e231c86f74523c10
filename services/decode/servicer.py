"""DecodeScheduler servicer: translates gRPC to the scheduler core and streams token ids out.

Handlers submit events (``step_inputs``) that the scheduler loop applies at the top of an
iteration; under tensor parallelism the same servicer runs on every rank without a gRPC server
(``tp.rank > 0``): it applies the events rank 0 hands it, never calls a prefill worker and emits
nothing. In PD, prefill rank ``i`` writes its KV head shard into this group's rank ``i``; rank 0
drives every rank's receiving side (``kv_ranks``) and queues the request to decode (``KVReady``,
applied on every rank at one step) only once the prefill worker answered and every rank's shard
landed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import grpc

from pdserve.distributed import SINGLE_RANK, TpGroup
from pdserve.kv_transfer import KVTransferAgent, KVTransferError
from pdserve.observability import tracing
from pdserve.rpc.client_stream import DEFAULT_DEAD_AFTER_S, ClientStreamPool
from pdserve.scheduler.overload import QueueFull
from pdserve.scheduler.req import FinishReason, Req
from pdserve.scheduler.scheduler import Scheduler, StepOutput
from pdserve.services.common.convert import TokenIDBatchBuilder, sampling_params_from_pb
from pdserve.services.common.grammar_wait import grammar_error, tp_refusal
from pdserve.services.common.scheduler_loop import SchedulerLoop, refusal_status
from pdserve.services.common.step_inputs import Abort, NewRequest
from pdserve.services.decode.kv_ranks import KVRanks
from pdserve.services.decode.prefill_client import DEFAULT_PREFILL_DEAD_AFTER_S, PrefillHung, PrefillPeer
from pdserve.v1 import common_pb2, output_pb2, output_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

PREFILL_TIMEOUT_S = 120.0
# errors that another prefill worker would return too
_NOT_RETRYABLE = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.CANCELLED)
# failures of the prefill pool's state (down, full, slow): the client may retry the request later
_SERVER_STATE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)
# the process's identity in GetLoad: the gateway fails what it routed to an earlier incarnation
INCARNATION = uuid.uuid4().hex


@dataclass(slots=True)
class KVReady:
    """A prefill worker wrote ``rid``'s prompt KV (every rank's shard) and sampled its first token."""

    rid: str
    first_token_id: int
    logprob: tuple[float, list[tuple[int, float]]] | None
    cached_tokens: int
    transferred_bytes: int


@dataclass(slots=True)
class KVFailed:
    """Every prefill attempt for ``rid`` failed (``retryable``: each for the prefill pool's state)."""

    rid: str
    error: str
    retryable: bool


@dataclass(slots=True)
class KVDrained:
    """Rank 0's prefill task for ``rid`` ended: no Prefill call of it is in flight, so no prefill
    worker writes into its pages any more (those of a request that ended meanwhile are released)."""

    rid: str


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
        stream_interval: tokens per output of a request (its first and last go out at once).

    Attributes:
        draining: set by ``drain`` (SIGTERM): Generate is refused (UNAVAILABLE), the rest goes on.
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
    ) -> None:
        self.scheduler = scheduler
        self.prefill_dead_after = prefill_dead_after
        self.stream_interval = stream_interval
        self.prefill_retries = prefill_retries
        self.address = address
        self.agent = agent
        self.tp = tp
        handlers = {
            Abort: self._abort,
            KVReady: self._kv_ready,
            KVFailed: self._kv_failed,
            KVDrained: lambda event: self.scheduler.kv_drained(event.rid),
        }
        self.loop = SchedulerLoop(scheduler, self._emit, self._start_prefills, handlers, tp, overlap)
        self.outputs = ClientStreamPool(
            lambda ch: output_pb2_grpc.DetokenizerStub(ch).StreamTokenIDs,
            dead_after=detokenizer_dead_after,
            on_dead=self._detokenizer_gone,
        )
        self.peers: dict[str, PrefillPeer] = {}
        self.prefill_tasks: dict[str, asyncio.Task] = {}
        self.prefilling_on: dict[str, PrefillPeer] = {}  # rid -> the worker its Prefill call is on
        self.prefill_aborts: set[asyncio.Task] = set()
        self.kv = KVRanks(agent, scheduler, self.loop) if agent is not None else None
        if self.kv is not None:
            scheduler.on_kv_abandoned = self.kv.abandon
        self.started: set[str] = set()  # rids whose first output went out
        self.draining = False
        scheduler.on_request_end = lambda req: tracing.end_request_span(req, scheduler.role)

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
            params = sampling_params_from_pb(request.sampling_params)
        except TypeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        refusal = tp_refusal(params, self.tp)
        if refusal:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        if self.scheduler.role == "decode" and not request.prefill_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "decode worker needs a prefill_address")
        req = Req(
            rid=request.rid,
            origin_input_ids=list(request.input_ids),
            sampling_params=params,
            deadline=request.deadline_unix_s,
            arrival_time=request.arrival_unix_s or time.time(),
            meta={
                "prefill_address": request.prefill_address,
                "fallback_prefill_addresses": list(request.fallback_prefill_addresses),
                "output_address": request.output_address,
                "gateway_address": request.gateway_address,
                "scheduler_address": self.address,
            },
        )
        tracing.start_request_span(req, self.scheduler.role)  # from arrival; ended when the request ends
        try:
            position = await self.loop.add(req)
        except (ValueError, QueueFull) as e:
            await context.abort(refusal_status(e), str(e))
        error = await grammar_error(self.scheduler, req)
        self.loop.wake()  # a compiled grammar moves its request on at the next step
        if error:
            await context.abort(*error)
        return scheduler_pb2.GenerateAck(rid=req.rid, queue_position=position)

    async def Abort(self, request: scheduler_pb2.AbortRequest, context) -> scheduler_pb2.AbortResponse:
        stop = request.finish_reason == common_pb2.FINISH_REASON_STOP  # a stop string ended it
        finish_reason = FinishReason.STOP if stop else FinishReason.ABORT
        return scheduler_pb2.AbortResponse(
            found=self.abort(request.rid, request.reason or "aborted", finish_reason)
        )

    def busy(self) -> bool:
        """Requests still held (queued for the next step, waiting for KV, running, or ended with their
        pages still held while a prefill worker may write them)."""
        return bool(self.scheduler.reqs or self.scheduler.kv_draining) or any(
            isinstance(e, NewRequest) for e in self.loop.inputs.pending()
        )

    def abort(self, rid: str, reason: str, finish_reason: FinishReason = FinishReason.ABORT) -> bool:
        """Abort ``rid`` at the next step on every rank (``_abort`` also stops its prefill in flight),
        counted as ended by ``finish_reason``; False if it is neither held nor queued for the next
        step."""
        found = rid in self.scheduler.reqs or any(
            isinstance(e, NewRequest) and e.req.rid == rid for e in self.loop.inputs.pending()
        )
        self.loop.abort(rid, reason, finish_reason)
        return found

    # ---- inputs: applied on every rank, in rank 0's order ---------------------------------
    def _abort(self, event: Abort) -> bool:
        """Abort the request in the scheduler, and stop its prefill in flight (rank 0)."""
        self._stop_prefill(event.rid, event.reason)
        return self.scheduler.abort_request(event.rid, event.reason, event.finish_reason)

    def _stop_prefill(self, rid: str, reason: str) -> None:
        """Stop ``rid``'s prefill task (rank 0). With a Prefill call in flight, the prefill worker is
        asked to stop and the call left to end (with an error, at once): until it has, that worker
        may still write the pages, which the scheduler holds (``kv_draining``) until the task's
        ``KVDrained``. Before the call went out (connecting, expecting), the task is cancelled."""
        peer = self.prefilling_on.get(rid)
        if peer is not None:
            task = asyncio.get_running_loop().create_task(peer.abort(rid, reason))
            self.prefill_aborts.add(task)
            task.add_done_callback(self.prefill_aborts.discard)
        elif (task := self.prefill_tasks.get(rid)) is not None:
            task.cancel()

    def _kv_failed(self, event: KVFailed) -> list[StepOutput]:
        out = self.scheduler.kv_failed(event.rid, event.error, event.retryable)
        return [out] if out is not None else []

    def _kv_ready(self, event: KVReady) -> list[StepOutput]:
        """Every rank's KV shard landed (rank 0 saw each rank's receive complete)."""
        req = self.scheduler.waiting_for_kv.get(event.rid)
        if req is None:
            return []  # aborted meanwhile
        self.scheduler.metrics.kv_transfer_bytes.inc(event.transferred_bytes)
        req.cached_tokens = max(req.cached_tokens, event.cached_tokens)
        out = self.scheduler.kv_ready(event.rid, event.first_token_id, event.logprob)
        return [out] if out is not None else []

    async def GetLoad(self, request, context) -> common_pb2.LoadInfo:
        return load_info(self.scheduler)

    async def GetMetrics(self, request, context) -> common_pb2.MetricsResponse:
        return common_pb2.MetricsResponse(
            role=self.scheduler.role, worker=self.address, text=self.scheduler.metrics.text()
        )

    # ---- outputs ------------------------------------------------------------------------
    def _emit(self, outputs: list[StepOutput]) -> None:
        """One BatchTokenIDOutput per detokenizer for one step's outputs.

        With ``stream_interval`` N > 1 a request's tokens go out N at a time (and always with its
        first token and its finish): fewer messages, decodes and SSE events per token.
        """
        batches: dict[str, TokenIDBatchBuilder] = {}
        interval = self.stream_interval
        for out in outputs:
            req = out.req
            target = req.meta.get("output_address", "")
            if not target:
                continue
            first = req.rid not in self.started
            sent = req.meta.get("sent", 0)
            if not (first or out.finished) and len(req.output_ids) - sent < interval:
                continue
            self.started.add(req.rid)
            if out.finished:
                self.started.discard(req.rid)
                self._stop_prefill(req.rid, req.error or "finished")
            new_ids = req.output_ids[sent:] if interval > 1 else out.new_token_ids
            req.meta["sent"] = len(req.output_ids)
            builder = batches.get(target)
            if builder is None:
                builder = batches[target] = TokenIDBatchBuilder()
            builder.add(req, new_ids, out.finished, first)
        for target, builder in batches.items():
            self.outputs.send(target, builder.build())

    def _detokenizer_gone(self, address: str, dropped: list[output_pb2.BatchTokenIDOutput]) -> None:
        """Abort every request whose outputs go to the detokenizer at ``address``: no one reads them."""
        rids = [rid for rid, req in self.scheduler.reqs.items() if req.meta.get("output_address") == address]
        logger.warning(
            "detokenizer %s is gone: aborting its %d requests (%d output batches undelivered)",
            address,
            len(rids),
            len(dropped),
        )
        for rid in rids:
            self.scheduler.reqs[rid].meta["output_address"] = ""  # its abort output has nowhere to go
            self.started.discard(rid)
            self.abort(rid, f"detokenizer {address} is gone")

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

    # ---- PD: ask prefill workers ------------------------------------------------------------
    def _start_prefills(self) -> None:
        reqs = self.scheduler.pop_kv_requests()
        if self.tp.is_driver:  # the other ranks get the KV from their prefill rank, the token from rank 0
            for req in reqs:
                self.prefill_tasks[req.rid] = asyncio.create_task(self._prefill(req))

    def _peer(self, address: str) -> PrefillPeer:
        peer = self.peers.get(address)
        if peer is None:
            peer = self.peers[address] = PrefillPeer(address, self.kv, self.prefill_dead_after)
        return peer

    async def _prefill(self, req: Req) -> None:
        """Get ``req``'s prompt KV from a prefill worker, trying the router's fallbacks on failure.

        A worker that is unreachable, dies mid-transfer, hangs (``PrefillHung``) or times out costs
        one attempt; the decode pages stay reserved and the next worker overwrites them. Invalid
        requests are not retried. A request that fails on every worker for such reasons of the
        servers' state fails as retryable (503 at the gateway).
        """
        rid = req.rid
        addresses = [req.meta["prefill_address"], *req.meta.get("fallback_prefill_addresses", ())]
        attempts = addresses[: 1 + self.prefill_retries]
        errors: list[str] = []
        retryable = True
        event = None
        try:
            resp = None
            for address in attempts:
                if self.scheduler.waiting_for_kv.get(rid) is not req:
                    break  # ended meanwhile (aborted): no other worker is asked
                try:
                    with tracing.request_context(req):
                        resp = await self._prefill_once(req, address)
                    break
                except (grpc.aio.AioRpcError, KVTransferError, PrefillHung) as e:
                    msg = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                    errors.append(f"{address}: {msg}")
                    logger.warning("prefill of %s on %s failed: %s", rid, address, msg, extra={"rid": rid})
                    if isinstance(e, grpc.aio.AioRpcError):
                        retryable = retryable and e.code() in _SERVER_STATE
                        if e.code() in _NOT_RETRYABLE:
                            break
            if resp is None:
                event = KVFailed(rid, "prefill failed: " + "; ".join(errors), retryable)
            else:
                logprob = None
                if resp.HasField("first_logprob"):
                    lp = resp.first_logprob
                    logprob = (lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
                event = KVReady(rid, resp.first_token_id, logprob, resp.cached_tokens, resp.transferred_bytes)
        except asyncio.CancelledError:
            pass  # ended before its Prefill call went out (``_stop_prefill``), or the servicer closes
        except Exception as e:  # not a prefill failure we know: this request fails, its pages drain
            logger.exception("prefill of %s failed", rid, extra={"rid": rid})
            event = KVFailed(rid, f"prefill failed: {e}", retryable=False)
        finally:
            self.prefill_tasks.pop(rid, None)
            if event is not None:
                self.loop.submit(event)
            self.loop.submit(KVDrained(rid))

    async def _prefill_once(self, req: Req, address: str) -> scheduler_pb2.PrefillResponse:
        """The Prefill of ``req`` on ``address`` (``_prefill_call``). A worker restarted since our
        handshake (a drain and restart, a crash) refuses it, not knowing our agent
        (FAILED_PRECONDITION): the agent info is exchanged again and, the worker being a new
        incarnation, the call made once more on it."""
        peer = self._peer(address)
        known = peer.peer_incarnation
        try:
            return await self._prefill_call(req, peer)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION or not known:
                raise
            await peer.connect(_prefill_timeout(req))  # the failure reset the handshake
            if peer.peer_incarnation == known:
                raise  # the same process refused it
            logger.info("prefill worker %s restarted: handshake redone", address, extra={"rid": req.rid})
            return await self._prefill_call(req, peer)

    async def _prefill_call(self, req: Req, peer: PrefillPeer) -> scheduler_pb2.PrefillResponse:
        """One Prefill call; returns once its response came and every page of its KV has landed (on
        every TP rank: each rank receives its head shard from the prefill worker's rank of its index).

        The transfer is expected (by a fresh id, so a late write of an earlier attempt never counts)
        before the call goes out, and cancelled on any failure: after that nothing writes its pages.
        """
        timeout = _prefill_timeout(req)
        await peer.connect(timeout)
        tid = f"{req.rid}/{uuid.uuid4().hex[:12]}".encode()
        start = time.monotonic()
        landing = await self.kv.expect(req, peer.address, tid, timeout)
        self.prefilling_on[req.rid] = peer
        try:
            if self.scheduler.waiting_for_kv.get(req.rid) is not req:  # ended while expect ran
                raise KVTransferError(f"{req.rid} ended before its prefill worker was asked")
            resp = await peer.prefill(req, tid, timeout)
            await landing.wait(max(0.1, timeout - (time.monotonic() - start)))
        finally:
            self.prefilling_on.pop(req.rid, None)
            landing.cancel()  # on every rank; no-op once every page landed
        return resp

    async def close(self) -> None:
        for task in (*self.prefill_tasks.values(), *self.prefill_aborts):
            task.cancel()
        await self.outputs.close()
        for peer in self.peers.values():
            await peer.close()


def _prefill_timeout(req: Req) -> float:
    """Seconds a Prefill call of ``req`` may take: ``PREFILL_TIMEOUT_S``, less by its deadline."""
    if req.deadline:
        return max(0.1, min(PREFILL_TIMEOUT_S, req.deadline - time.time()))
    return PREFILL_TIMEOUT_S


def load_info(scheduler: Scheduler) -> common_pb2.LoadInfo:
    """The scheduler's load, limits and this process's incarnation (``GetLoad``)."""
    ledger = scheduler.ledger
    return common_pb2.LoadInfo(
        num_running_reqs=len(scheduler.running) + len(scheduler.prefilling) + len(scheduler.waiting_for_kv),
        num_queue_reqs=len(scheduler.waiting) + len(scheduler.grammar_queue),
        kv_pages_used=ledger.used_pages(),
        kv_pages_free=ledger.free_pages(),
        kv_pages_cached=ledger.cached_pages(),
        kv_pages_total=scheduler.usable_pages,
        page_size=scheduler.page_size,
        request_capacity=scheduler.request_capacity,
        max_queued_requests=scheduler.max_queued_requests,
        incarnation=INCARNATION,
    )

"""The decode side of the PD handshake: ask prefill workers for the prompt KV of admitted requests.

After every schedule, rank 0 starts a task for each request the scheduler admitted for KV
(``Scheduler.pop_kv_requests``, its pages reserved). The task asks the router's prefill worker, then
its fallbacks, to prefill the prompt and WRITE the pages this worker lacks (``PrefillPeer``), expects
the transfer on every rank (``KVRanks``), and ends in events the loop applies on every rank at one
step: ``KVReady`` (the first token, once every rank's shard landed) or ``KVFailed``, then always
``KVDrained`` (no Prefill call of it is in flight any more: pages of a request that ended meanwhile
can be freed). A request that ends while its prefill runs has its Prefill call stopped (``stop``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc

from pdserve.kv_transfer import KVTransferError
from pdserve.observability import tracing
from pdserve.scheduler.req import Req
from pdserve.scheduler.scheduler import Scheduler
from pdserve.services.common.events import KVDrained, KVFailed, KVReady
from pdserve.services.common.scheduler_loop import SchedulerLoop
from pdserve.services.decode.kv_ranks import KVRanks
from pdserve.services.decode.prefill_client import DEFAULT_PREFILL_DEAD_AFTER_S, PrefillHung, PrefillPeer

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


class PrefillCoordinator:
    """This decode worker's prefills in flight (rank 0 asks; every rank applies the outcome).

    Args:
        scheduler: the decode-role scheduler.
        loop: its loop (the events' handlers are registered there).
        kv: this worker's KV receiving side, on every rank.
        stub: the PrefillScheduler stub of a channel (the servicer's generated code).
        prefill_retries: how many other prefill workers a failed prefill is retried on.
        dead_after: seconds a prefill worker may leave its health checks unanswered while it holds
            our prefills before they are given up on it (and retried on another one).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        loop: SchedulerLoop,
        kv: KVRanks,
        stub: Callable[[grpc.aio.Channel], Any],
        prefill_retries: int = 1,
        dead_after: float = DEFAULT_PREFILL_DEAD_AFTER_S,
    ) -> None:
        self.scheduler = scheduler
        self.loop = loop
        self.kv = kv
        self.stub = stub
        self.prefill_retries = prefill_retries
        self.dead_after = dead_after
        self.peers: dict[str, PrefillPeer] = {}
        self.tasks: dict[str, asyncio.Task] = {}  # rid -> its prefill task (rank 0)
        self.calling: dict[str, PrefillPeer] = {}  # rid -> the worker its Prefill call is on
        self.aborts: set[asyncio.Task] = set()
        loop.handlers[KVReady] = self._ready
        loop.handlers[KVFailed] = self._failed
        loop.handlers[KVDrained] = lambda event: scheduler.kv_drained(event.rid)
        scheduler.set_hooks(on_kv_abandoned=kv.abandon)

    # ---- events, applied on every rank in rank 0's order ------------------------------------
    def _ready(self, event: KVReady) -> list:
        """Every rank's KV shard landed (rank 0 saw each rank's receive complete)."""
        out = self.scheduler.kv_ready(
            event.rid,
            event.first_token_id,
            event.logprob,
            event.cached_tokens,
            event.transferred_bytes,
            event.prompt_logprobs,
            event.embedding,
        )
        return [out] if out is not None else []  # (none: it ended meanwhile)

    def _failed(self, event: KVFailed) -> list:
        out = self.scheduler.kv_failed(event.rid, event.error, event.retryable)
        return [out] if out is not None else []

    # ---- rank 0 -----------------------------------------------------------------------------
    def start(self) -> None:
        """After each schedule: a prefill task for every request just admitted (rank 0; the other
        ranks get the KV from their prefill rank and the token from rank 0)."""
        reqs = self.scheduler.pop_kv_requests()
        if self.loop.tp.is_driver:
            for req in reqs:
                task = self.tasks[req.rid] = asyncio.create_task(self._prefill(req))
                task.add_done_callback(lambda task, rid=req.rid: self._ended(rid, task))

    def _ended(self, rid: str, task: asyncio.Task) -> None:
        """``rid``'s prefill task is done, however it ended: no Prefill call of it is in flight any
        more (``KVDrained``, after the task's own ``KVReady`` / ``KVFailed``). A done callback, not
        the task's ``finally``: a task cancelled before its first turn (``stop`` of a request aborted
        at the step right after ``start``, before the loop yielded: a speculative step's loop
        iteration never yields there) never runs its body, and its pages would stay draining."""
        if self.tasks.get(rid) is task:
            del self.tasks[rid]
        self.loop.submit(KVDrained(rid))

    def stop(self, rid: str, reason: str) -> None:
        """Stop ``rid``'s prefill task (rank 0). With a Prefill call in flight, the prefill worker is
        asked to stop and the call left to end (with an error, at once): until it has, that worker
        may still write the pages, which the scheduler holds (draining) until the task's
        ``KVDrained``. Before the call went out (connecting, expecting), the task is cancelled."""
        peer = self.calling.get(rid)
        if peer is not None:
            task = asyncio.get_running_loop().create_task(peer.abort(rid, reason))
            self.aborts.add(task)
            task.add_done_callback(self.aborts.discard)
        elif (task := self.tasks.get(rid)) is not None:
            task.cancel()

    async def close(self) -> None:
        for task in (*self.tasks.values(), *self.aborts):
            task.cancel()
        for peer in self.peers.values():
            await peer.close()

    def _peer(self, address: str) -> PrefillPeer:
        peer = self.peers.get(address)
        if peer is None:
            peer = self.peers[address] = PrefillPeer(address, self.kv, self.stub, self.dead_after)
        return peer

    def _waits(self, req: Req) -> bool:
        """Whether ``req`` still waits for its KV (it did not end meanwhile)."""
        return self.scheduler.waiting_for_kv(req.rid) is req

    async def _prefill(self, req: Req) -> None:
        """Get ``req``'s prompt KV from a prefill worker, trying the router's fallbacks on failure.

        A worker that is unreachable, dies mid-transfer, hangs (``PrefillHung``) or times out costs
        one attempt; the decode pages stay reserved and the next worker overwrites them. Invalid
        requests are not retried. A request that fails on every worker for such reasons of the
        servers' state fails as retryable (503 at the gateway).
        """
        rid = req.rid
        attempts = req.route.prefill_addresses[: 1 + self.prefill_retries]
        errors: list[str] = []
        retryable = True
        event = None
        try:
            ready = None
            for address in attempts:
                if not self._waits(req):
                    break  # ended meanwhile (aborted): no other worker is asked
                try:
                    with tracing.request_context(req):
                        ready = await self._prefill_once(req, address)
                    break
                except (grpc.aio.AioRpcError, KVTransferError, PrefillHung) as e:
                    msg = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                    errors.append(f"{address}: {msg}")
                    logger.warning("prefill of %s on %s failed: %s", rid, address, msg, extra={"rid": rid})
                    if isinstance(e, grpc.aio.AioRpcError):
                        retryable = retryable and e.code() in _SERVER_STATE
                        if e.code() in _NOT_RETRYABLE:
                            break
            event = ready or KVFailed(rid, "prefill failed: " + "; ".join(errors), retryable)
        except asyncio.CancelledError:
            pass  # ended before its Prefill call went out (``stop``), or the worker closes
        except Exception as e:  # not a prefill failure we know: this request fails, its pages drain
            logger.exception("prefill of %s failed", rid, extra={"rid": rid})
            event = KVFailed(rid, f"prefill failed: {e}", retryable=False)
        finally:
            if event is not None:
                self.loop.submit(event)

    async def _prefill_once(self, req: Req, address: str) -> KVReady:
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
            await peer.connect(prefill_timeout(req))  # the failure reset the handshake
            if peer.peer_incarnation == known:
                raise  # the same process refused it
            logger.info("prefill worker %s restarted: handshake redone", address, extra={"rid": req.rid})
            return await self._prefill_call(req, peer)

    async def _prefill_call(self, req: Req, peer: PrefillPeer) -> KVReady:
        """One Prefill call; returns once its response came and every page of its KV has landed (on
        every TP rank: each rank receives its head shard from the prefill worker's rank of its index).

        The transfer is expected (by a fresh id, so a late write of an earlier attempt never counts)
        before the call goes out, and cancelled on any failure: after that nothing writes its pages.
        """
        timeout = prefill_timeout(req)
        await peer.connect(timeout)
        tid = f"{req.rid}/{uuid.uuid4().hex[:12]}".encode()
        start = time.monotonic()
        landing = await self.kv.expect(req, peer.address, tid, timeout)
        self.calling[req.rid] = peer
        try:
            if not self._waits(req):  # ended while expect ran
                raise KVTransferError(f"{req.rid} ended before its prefill worker was asked")
            ready = await peer.prefill(req, tid, timeout)
            await landing.wait(max(0.1, timeout - (time.monotonic() - start)))
        finally:
            self.calling.pop(req.rid, None)
            landing.cancel()  # on every rank; no-op once every page landed
        return ready


def prefill_timeout(req: Req) -> float:
    """Seconds a Prefill call of ``req`` may take: ``PREFILL_TIMEOUT_S``, less by its deadline."""
    if req.deadline:
        return max(0.1, min(PREFILL_TIMEOUT_S, req.deadline - time.time()))
    return PREFILL_TIMEOUT_S

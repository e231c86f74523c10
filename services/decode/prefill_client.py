"""Decode side of the PD handshake: agent exchange (once per peer) and Prefill calls.

A prefill worker that hangs (stopped, stuck event loop, or a stuck step: it then reports
NOT_SERVING) is noticed by its health checks within a few seconds: the Prefill calls in flight to it
are given up (``PrefillHung``), so that the decode worker, which owns the request and its pages,
retries them on another prefill worker; its NIXL peer is dropped and the agent handshake redone
once it answers again (a restarted worker is a new incarnation anyway).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import grpc

from pdserve.rpc import tls
from pdserve.rpc.health_watch import HealthWatch
from pdserve.rpc.server import GRPC_OPTIONS
from pdserve.scheduler.req import Req
from pdserve.services.common.convert import (
    abort_request_to_pb,
    kv_rank_agents_from_pb,
    kv_rank_agents_to_pb,
    kv_ready_from_pb,
    prefill_request_to_pb,
)
from pdserve.services.common.events import KVReady
from pdserve.services.decode.kv_ranks import KVRanks

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_PREFILL_DEAD_AFTER_S = 5.0
ABORT_TIMEOUT_S = 5.0


class PrefillHung(Exception):
    """The prefill worker left its health checks unanswered for ``dead_after`` seconds."""


class PrefillPeer:
    """One prefill worker as seen from a decode worker: channel, stub, the agent handshake and a
    ``HealthWatch`` (polling from the first call on) that gives up calls to it when it hangs.

    Args:
        address: the prefill worker's "host:port".
        ranks: this decode worker's KV receiving side (its NIXL agent; under TP every rank's, each
            receiving its KV heads from the prefill ranks holding them).
        stub: the PrefillScheduler stub of a channel.
        dead_after: seconds without a SERVING health answer after which calls to it fail.
    """

    def __init__(
        self,
        address: str,
        ranks: KVRanks,
        stub: Callable[[grpc.aio.Channel], Any],
        dead_after: float = DEFAULT_PREFILL_DEAD_AFTER_S,
    ) -> None:
        self.address = address
        self.ranks = ranks
        self.agent = ranks.agent
        self.channel = tls.internal_channel(address, GRPC_OPTIONS)
        self.stub = stub(self.channel)
        self.health = HealthWatch(self.channel, dead_after)
        self.peer_incarnation = ""

    async def handshake(self, timeout: float) -> None:
        """Send our agent info, learn the peer's; done once per peer and redone after a restart.

        Raises grpc.aio.AioRpcError (FAILED_PRECONDITION on KV layouts that cannot be paired, refused
        by the prefill worker) or KVLayoutMismatch (refused here).
        """
        infos = await self.ranks.describe()
        answer = await self.stub.ExchangeKVAgentInfo(kv_rank_agents_to_pb(infos), timeout=timeout)
        peers = kv_rank_agents_from_pb(answer)
        await self.ranks.add_peers(self.address, infos, peers)
        self.peer_incarnation = peers[0].incarnation

    async def connect(self, timeout: float) -> None:
        """The handshake, unless done since the peer last (re)started; under the health watch.

        Raises:
            grpc.aio.AioRpcError: the call failed (FAILED_PRECONDITION on a KV layout mismatch).
            PrefillHung: the peer stopped answering its health checks first (the call is cancelled).
        """
        if not self.peer_incarnation:
            await self._watched(self.handshake(timeout))

    async def prefill(self, req: Req, tid: bytes, timeout: float) -> KVReady:
        """Ask the peer to prefill ``req`` and write the pages we lack as transfer ``tid``; returns its
        first token (the pages may still be landing: await the transfer's ``KVReceive`` too).

        Raises:
            grpc.aio.AioRpcError: the call failed (FAILED_PRECONDITION on a KV layout mismatch).
            PrefillHung: the peer stopped answering its health checks first (the call is cancelled).
        """
        return await self._watched(self._prefill(req, tid, timeout))

    async def _watched(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro``'s result, unless the peer's health checks go unanswered first (``PrefillHung``)."""
        self.health.start()
        call = asyncio.ensure_future(coro)
        silent = asyncio.ensure_future(self.health.wait_silent(since=time.monotonic()))
        try:
            await asyncio.wait({call, silent}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            silent.cancel()
            if not call.done():
                call.cancel()
        if not call.done() or call.cancelled():
            self._forget_peer()
            raise PrefillHung(
                f"prefill worker {self.address} did not answer its health checks for "
                f"{self.health.silent_for():.1f} s (hung or stopped)"
            )
        return call.result()

    def _forget_peer(self) -> None:
        """Drop the hung peer's NIXL connection; the handshake is redone when it answers again."""
        self.ranks.forget_peers(self.address)
        self.peer_incarnation = ""

    async def _prefill(self, req: Req, tid: bytes, timeout: float) -> KVReady:
        local_pages = self.ranks.scheduler.ledger.arriving_local_pages(req)
        request = prefill_request_to_pb(req, tid, self.agent.local_info(), local_pages)
        try:
            return kv_ready_from_pb(req.rid, await self.stub.Prefill(request, timeout=timeout))
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE):
                self.peer_incarnation = ""  # the peer may have restarted: handshake again next time
            raise

    async def abort(self, rid: str, reason: str) -> None:
        """Ask the peer to stop prefilling ``rid`` (its Prefill call then answers with an error once its
        transfer is cancelled). Failures are logged: the call ends anyway, by its own timeout or the
        health watch."""
        try:
            await self.stub.Abort(abort_request_to_pb(rid, reason), timeout=ABORT_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            logger.info(
                "abort of %s on prefill worker %s: %s", rid, self.address, e.details(), extra={"rid": rid}
            )

    async def close(self) -> None:
        await self.health.close()
        await self.channel.close()

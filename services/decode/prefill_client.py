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

import grpc

from pdserve.kv_transfer import KVAgentInfo, KVTransferAgent
from pdserve.rpc import tls
from pdserve.rpc.health_watch import HealthWatch
from pdserve.rpc.server import GRPC_OPTIONS
from pdserve.scheduler.req import Req
from pdserve.services.common.convert import (
    kv_agent_info_from_pb,
    kv_agent_info_to_pb,
    sampling_params_to_pb,
)
from pdserve.v1 import scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_DEAD_AFTER_S = 5.0


class PrefillHung(Exception):
    """The prefill worker left its health checks unanswered for ``dead_after`` seconds."""


class PrefillPeer:
    """One prefill worker as seen from a decode worker: channel, stub, the agent handshake and a
    ``HealthWatch`` (polling from the first call on) that gives up calls to it when it hangs.

    Args:
        address: the prefill worker's "host:port".
        agent: this decode worker's NIXL agent.
        rank_agents: the NIXL agents of every rank of this decode worker (rank 0's is ``agent``'s):
            prefill rank ``i`` writes its KV shard into the pool of decode rank ``i``.
        dead_after: seconds without a SERVING health answer after which calls to it fail.
    """

    def __init__(
        self,
        address: str,
        agent: KVTransferAgent,
        rank_agents: list[KVAgentInfo],
        dead_after: float = DEFAULT_PREFILL_DEAD_AFTER_S,
    ) -> None:
        self.address = address
        self.agent = agent
        self.rank_agents = rank_agents
        self.channel = tls.internal_channel(address, GRPC_OPTIONS)
        self.stub = scheduler_pb2_grpc.PrefillSchedulerStub(self.channel)
        self.health = HealthWatch(self.channel, dead_after)
        self.peer_incarnation = ""
        self.peer_agent_name = ""

    async def handshake(self, timeout: float) -> None:
        """Send our agent info, learn the peer's; done once per peer and redone after a restart.

        Raises grpc.aio.AioRpcError (FAILED_PRECONDITION on a KV layout or TP size mismatch).
        """
        local = kv_agent_info_to_pb(self.agent.local_info())
        local.tp_rank_agents.extend(kv_agent_info_to_pb(info) for info in self.rank_agents[1:])
        info = await self.stub.ExchangeKVAgentInfo(local, timeout=timeout)
        self.agent.add_peer(kv_agent_info_from_pb(info))
        self.peer_incarnation = info.incarnation
        self.peer_agent_name = info.agent_name

    async def prefill(self, req: Req, timeout: float) -> scheduler_pb2.PrefillResponse:
        """Ask the peer to prefill ``req`` and write the pages we lack; returns its first token.

        Raises:
            grpc.aio.AioRpcError: the call failed (FAILED_PRECONDITION on a KV layout mismatch).
            PrefillHung: the peer stopped answering its health checks first (the call is cancelled).
        """
        self.health.start()
        call = asyncio.ensure_future(self._prefill(req, timeout))
        silent = asyncio.ensure_future(self.health.wait_silent())
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
        if self.peer_agent_name:
            self.agent.remove_peer(self.peer_agent_name)
        self.peer_incarnation = ""

    async def _prefill(self, req: Req, timeout: float) -> scheduler_pb2.PrefillResponse:
        if not self.peer_incarnation:
            await self.handshake(timeout)
        local = self.agent.local_info()
        request = scheduler_pb2.PrefillRequest(
            rid=req.rid,
            input_ids=req.fill_ids,
            sampling_params=sampling_params_to_pb(req.sampling_params),
            dst_agent_name=local.agent_name,
            dst_incarnation=local.incarnation,
            dst_page_indices=req.pages[req.num_prefix_pages :],
            dst_start_page=req.num_prefix_pages,
            deadline_unix_s=req.deadline,
        )
        try:
            return await self.stub.Prefill(request, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE):
                self.peer_incarnation = ""  # the peer may have restarted: handshake again next time
            raise

    async def close(self) -> None:
        await self.health.close()
        await self.channel.close()

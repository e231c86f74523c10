"""Decode side of the PD handshake: agent exchange (once per peer) and Prefill calls."""

from __future__ import annotations

import logging

import grpc

from pdserve.kv_transfer import KVAgentInfo, KVTransferAgent
from pdserve.rpc import tls
from pdserve.rpc.server import GRPC_OPTIONS
from pdserve.scheduler.req import Req
from pdserve.services.common.convert import (
    kv_agent_info_from_pb,
    kv_agent_info_to_pb,
    sampling_params_to_pb,
)
from pdserve.v1 import scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)


class PrefillPeer:
    """One prefill worker as seen from a decode worker: channel, stub and the agent handshake.

    ``rank_agents`` are the NIXL agents of every rank of this decode worker (rank 0's is ``agent``'s):
    prefill rank ``i`` writes its KV shard into the pool of decode rank ``i``.
    """

    def __init__(self, address: str, agent: KVTransferAgent, rank_agents: list[KVAgentInfo]) -> None:
        self.address = address
        self.agent = agent
        self.rank_agents = rank_agents
        self.channel = tls.internal_channel(address, GRPC_OPTIONS)
        self.stub = scheduler_pb2_grpc.PrefillSchedulerStub(self.channel)
        self.peer_incarnation = ""

    async def handshake(self, timeout: float) -> None:
        """Send our agent info, learn the peer's; done once per peer and redone after a restart.

        Raises grpc.aio.AioRpcError (FAILED_PRECONDITION on a KV layout or TP size mismatch).
        """
        local = kv_agent_info_to_pb(self.agent.local_info())
        local.tp_rank_agents.extend(kv_agent_info_to_pb(info) for info in self.rank_agents[1:])
        info = await self.stub.ExchangeKVAgentInfo(local, timeout=timeout)
        self.agent.add_peer(kv_agent_info_from_pb(info))
        self.peer_incarnation = info.incarnation

    async def prefill(self, req: Req, timeout: float) -> scheduler_pb2.PrefillResponse:
        """Ask the peer to prefill ``req`` and write the pages we lack; returns its first token."""
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
        await self.channel.close()

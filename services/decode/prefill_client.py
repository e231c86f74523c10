"""Decode side of the PD handshake: agent exchange (once per peer) and Prefill calls."""

from __future__ import annotations

import logging

import grpc

from pdserve.kv_transfer import KVTransferAgent
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

    The decode agent grants the worker a receive lane (staging slots it may write gathered pages
    into), kept for its address across reconnects: a worker restarted on the same address is a new
    process, the old one gone.
    """

    def __init__(self, address: str, agent: KVTransferAgent) -> None:
        self.address = address
        self.agent = agent
        self.channel = tls.internal_channel(address, GRPC_OPTIONS)
        self.stub = scheduler_pb2_grpc.PrefillSchedulerStub(self.channel)
        self.peer_name = ""
        self.peer_incarnation = ""

    async def handshake(self, timeout: float) -> None:
        """Send our agent info (and its lane), learn the peer's; done once per peer and redone after a
        restart.

        Raises grpc.aio.AioRpcError (FAILED_PRECONDITION on a KV layout mismatch).
        """
        lane = self.agent.lane_for(self.address)
        info = await self.stub.ExchangeKVAgentInfo(
            kv_agent_info_to_pb(self.agent.local_info(lane)), timeout=timeout
        )
        self.agent.add_peer(kv_agent_info_from_pb(info), lane=lane)
        self.peer_name = info.agent_name
        self.peer_incarnation = info.incarnation

    async def prefill(self, req: Req, tid: bytes, timeout: float) -> scheduler_pb2.PrefillResponse:
        """Ask the peer to prefill ``req`` and write the pages we lack as transfer ``tid``; returns its
        first token (the pages may still be landing: await the transfer's ``KVReceive`` too)."""
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
            kv_transfer_id=tid.decode(),
        )
        try:
            return await self.stub.Prefill(request, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE):
                self.peer_incarnation = ""  # the peer may have restarted: handshake again next time
            raise

    async def close(self) -> None:
        await self.channel.close()

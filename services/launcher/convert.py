"""The ``pdserve.v1`` messages and stubs the launcher uses (a scheduler's ``GetLoad``)."""

from __future__ import annotations

import grpc

from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

_STUBS = {
    "prefill": scheduler_pb2_grpc.PrefillSchedulerStub,
    "decode": scheduler_pb2_grpc.DecodeSchedulerStub,
}


def scheduler_stub(role: str, channel: grpc.aio.Channel):
    """The client stub of the ``role`` ("prefill" or "decode") scheduler service on ``channel``."""
    return _STUBS[role](channel)


def load_request() -> scheduler_pb2.LoadRequest:
    return scheduler_pb2.LoadRequest()


def kv_pool_tokens(info: common_pb2.LoadInfo) -> int:
    """Tokens the scheduler's KV pool holds: its pages times the page size."""
    return info.kv_pages_total * info.page_size

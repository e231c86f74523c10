"""The ``pdserve.v1`` messages the launcher sends and reads (a scheduler's ``GetLoad``)."""

from __future__ import annotations

from pdserve.v1 import common_pb2, scheduler_pb2


def load_request() -> scheduler_pb2.LoadRequest:
    return scheduler_pb2.LoadRequest()


def kv_pool_tokens(info: common_pb2.LoadInfo) -> int:
    """Tokens the scheduler's KV pool holds: its pages times the page size."""
    return info.kv_pages_total * info.page_size

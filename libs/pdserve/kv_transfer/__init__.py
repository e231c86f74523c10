"""KV transfer between schedulers over NIXL: agents, pool registration, page-list WRITE, notifications.

The prefill scheduler WRITEs a request's KV pages into the decode scheduler's pages (decode-driven PD
handshake, see ARCHITECTURE.md); both exchange ``KVAgentInfo`` once per peer over gRPC.
"""

from pdserve.kv_transfer.agent import KVTransferAgent, KVWrite
from pdserve.kv_transfer.descriptors import coalesce
from pdserve.kv_transfer.errors import KVLayoutMismatch, KVTransferError, KVTransferTimeout
from pdserve.kv_transfer.layout import POOL_LAYOUT, KVAgentInfo, KVLayout, check_compatible

__all__ = [
    "POOL_LAYOUT",
    "KVAgentInfo",
    "KVLayout",
    "KVLayoutMismatch",
    "KVTransferAgent",
    "KVTransferError",
    "KVTransferTimeout",
    "KVWrite",
    "check_compatible",
    "coalesce",
]

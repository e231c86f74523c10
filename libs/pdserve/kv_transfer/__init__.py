"""KV transfer between schedulers over NIXL: agents, registration, staged page WRITEs, notifications.

The prefill scheduler WRITEs a request's KV pages into the decode scheduler's pages (decode-driven PD
handshake, see ARCHITECTURE.md); both exchange ``KVAgentInfo`` once per peer over gRPC.
"""

from pdserve.kv_transfer.agent import KVTransferAgent
from pdserve.kv_transfer.descriptors import coalesce
from pdserve.kv_transfer.errors import KVLayoutMismatch, KVTransferError, KVTransferTimeout
from pdserve.kv_transfer.layout import POOL_LAYOUT, KVAgentInfo, KVLayout, check_compatible
from pdserve.kv_transfer.receiver import KVReceive
from pdserve.kv_transfer.sender import KVTransfer
from pdserve.kv_transfer.staging import Lane, StagingConfig

__all__ = [
    "POOL_LAYOUT",
    "KVAgentInfo",
    "KVLayout",
    "KVLayoutMismatch",
    "KVReceive",
    "KVTransfer",
    "KVTransferAgent",
    "KVTransferError",
    "KVTransferTimeout",
    "Lane",
    "StagingConfig",
    "check_compatible",
    "coalesce",
]

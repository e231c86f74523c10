"""Tensor and expert parallelism: the rank group of one scheduler and how a tensor is sharded across it."""

from pdserve.distributed.expert_parallel import ExpertShard, expert_shard
from pdserve.distributed.parallel_state import (
    SINGLE_RANK,
    TpGroup,
    destroy_tp_groups,
    init_tp_group,
    rendezvous_store,
)
from pdserve.distributed.sharding import HeadShard, head_shard, split_range, vocab_shard

__all__ = [
    "SINGLE_RANK",
    "ExpertShard",
    "HeadShard",
    "TpGroup",
    "destroy_tp_groups",
    "expert_shard",
    "head_shard",
    "init_tp_group",
    "rendezvous_store",
    "split_range",
    "vocab_shard",
]

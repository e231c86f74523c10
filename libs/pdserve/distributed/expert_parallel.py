"""Expert parallelism (``--enable-expert-parallel``): which experts of a mixture-of-experts layer each
rank of a TP group holds, instead of a slice of every expert (GShard, Lepikhin et al. 2020; SGLang's
and vLLM's ``--enable-expert-parallel``).

Attention stays tensor-parallel, so after its all-reduce every rank holds every token's hidden state:
dispatch is each rank selecting the tokens routed to its own experts (no collective), and combine is
one all-reduce of the ranks' partial sums, the collective a tensor-parallel MoE layer ends with too,
entered once per layer by every rank in the same order. (An all-to-all dispatch pays off only when
ranks hold different tokens, i.e. data-parallel attention, which this engine does not run.)
"""

from __future__ import annotations

from typing import NamedTuple

from pdserve.distributed.sharding import split_range


class ExpertShard(NamedTuple):
    """A rank's part of one MoE layer: experts ``[expert_start, expert_start + num_experts)`` and, of
    each, intermediate channels ``[channel_start, channel_start + num_channels)``."""

    expert_start: int
    num_experts: int
    channel_start: int
    num_channels: int


def expert_shard(
    num_experts: int, intermediate_size: int, tp_size: int, rank: int, expert_parallel: bool
) -> ExpertShard:
    """With ``expert_parallel``, ``rank`` holds whole experts (``split_range``: the first
    ``num_experts % tp_size`` ranks one more); otherwise every expert, split by intermediate channels
    as a dense MLP is.

    Raises:
        ValueError: fewer experts (or channels) than ranks.
    """
    if expert_parallel:
        if num_experts < tp_size:
            raise ValueError(
                f"--enable-expert-parallel: {num_experts} experts cannot be spread over {tp_size} ranks"
            )
        return ExpertShard(*split_range(num_experts, tp_size, rank), 0, intermediate_size)
    if intermediate_size < tp_size:
        raise ValueError(
            f"expert intermediate_size {intermediate_size} is smaller than the TP size {tp_size}"
        )
    return ExpertShard(0, num_experts, *split_range(intermediate_size, tp_size, rank))

"""What the mixture-of-experts models (Mixtral, Qwen3-MoE, gpt-oss) share: the expert-parallel switch
of their constructor, and (Mixtral, Qwen3-MoE) SwiGLU experts behind a softmax top-k router, built
per layer by the model's ``make_mlp``."""

from __future__ import annotations

from typing import Any

from pdserve.distributed import SINGLE_RANK, TpGroup
from pdserve.layers.activation import SiluAndMul
from pdserve.layers.moe.fused_moe import FusedMoE
from pdserve.layers.moe.router import RouterSpec, TopKRouter
from pdserve.layers.moe.sparse_moe_block import SparseMoeBlock


def swiglu_moe(
    config: Any,
    tp: TpGroup,
    expert_parallel: bool,
    num_experts: int,
    intermediate_size: int,
    spec: RouterSpec,
) -> SparseMoeBlock:
    """A SwiGLU MoE block of ``num_experts`` experts of ``intermediate_size`` channels, routed to
    ``config.num_experts_per_tok`` of them with ``spec``.

    Raises:
        ValueError: a ``hidden_act`` other than silu.
    """
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (silu only)")
    router = TopKRouter(config.hidden_size, num_experts, config.num_experts_per_tok, spec)
    experts = FusedMoE(
        num_experts,
        config.hidden_size,
        intermediate_size,
        SiluAndMul(),
        tp=tp,
        expert_parallel=expert_parallel,
    )
    return SparseMoeBlock(router, experts, tp)


class MoeCausalLM:
    """Mixed into a ``LlamaForCausalLM`` subclass whose ``make_mlp`` builds MoE blocks: takes
    ``expert_parallel`` (whole experts per rank, ``--enable-expert-parallel``) before the layers
    are built."""

    has_experts = True

    def __init__(
        self, config: Any, max_position: int, tp: TpGroup = SINGLE_RANK, expert_parallel: bool = False
    ):
        self.expert_parallel = expert_parallel
        super().__init__(config, max_position, tp)

"""Qwen3-MoE (Qwen team 2025): Qwen3's attention (per-head q/k RMSNorm) with sparse MoE MLPs of
``num_experts`` SwiGLU experts of ``moe_intermediate_size`` channels, top-``num_experts_per_tok``
routing over the softmax of all experts, renormalised when ``norm_topk_prob``. Layers listed in
``mlp_only_layers``, or off the ``decoder_sparse_step`` grid, keep a dense MLP."""

from __future__ import annotations

from typing import Any

from torch import nn

from pdserve.distributed import TpGroup
from pdserve.layers.moe.router import RouterSpec, Scoring
from pdserve.layers.moe.sparse_moe_block import expert_checkpoint_target
from pdserve.models.llama import LlamaMLP
from pdserve.models.moe import MoeCausalLM, swiglu_moe
from pdserve.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(MoeCausalLM, Qwen3ForCausalLM):
    checkpoint_target = staticmethod(expert_checkpoint_target)

    def make_mlp(self, config: Any, layer_id: int, tp: TpGroup) -> nn.Module:
        sparse = (
            layer_id not in config.mlp_only_layers
            and config.num_experts > 0
            and (layer_id + 1) % config.decoder_sparse_step == 0
        )
        if not sparse:
            return LlamaMLP(config, tp)
        spec = RouterSpec(Scoring.SOFTMAX_TOPK, renormalize=config.norm_topk_prob)
        return swiglu_moe(
            config, tp, self.expert_parallel, config.num_experts, config.moe_intermediate_size, spec
        )

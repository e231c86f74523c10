"""Mixtral (Jiang et al. 2024, "Mixtral of Experts"): the Mistral decoder with every MLP a sparse MoE
block of ``num_local_experts`` SwiGLU experts, top-``num_experts_per_tok`` routing, the selected
softmax weights renormalised and kept in float32 (as transformers' ``MixtralTopKRouter``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from pdserve.distributed import TpGroup
from pdserve.layers.moe.router import RouterSpec, Scoring
from pdserve.layers.moe.sparse_moe_block import expert_checkpoint_target
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.moe import MoeCausalLM, swiglu_moe


class MixtralForCausalLM(MoeCausalLM, LlamaForCausalLM):
    """Module names are transformers 5's (``mlp.gate``, ``mlp.experts``); checkpoints as Mixtral
    ships them (``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2``) load as well."""

    def make_mlp(self, config: Any, layer_id: int, tp: TpGroup) -> nn.Module:
        spec = RouterSpec(Scoring.SOFTMAX_TOPK, renormalize=True, float32_weights=True)
        return swiglu_moe(
            config, tp, self.expert_parallel, config.num_local_experts, config.intermediate_size, spec
        )

    @staticmethod
    def checkpoint_target(name: str) -> tuple[str, Any] | None:
        """Mixtral's shipped ``block_sparse_moe`` is transformers 5's ``mlp``; experts by their names."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return expert_checkpoint_target(name) or ((name, None) if ".mlp.gate." in name else None)

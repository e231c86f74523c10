"""gpt-oss (OpenAI 2025, the gpt-oss model card): a Llama-style decoder whose attention layers
alternate sliding-window (128 keys) and full attention (``layer_types``), with q/k/v/o biases and
a learned attention sink per head (``self_attn.sinks``), YaRN rotary embeddings, and a
mixture-of-experts MLP in every layer: a router with a bias whose top-k logits are softmaxed, and
experts with biases and the clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``), their gate/up
stored interleaved as ``[E, hidden, 2 * intermediate]`` (``FusedMoE``'s ``gpt_oss`` layout).

Checkpoints whose experts ship MXFP4-quantized (the released ones) are refused at start
(``quantization_config``); a dequantized bfloat16 checkpoint loads.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pdserve.distributed import TpGroup
from pdserve.layers.activation import ClampedSwiGLU
from pdserve.layers.moe.fused_moe import FusedMoE
from pdserve.layers.moe.router import RouterSpec, Scoring, TopKRouter
from pdserve.layers.moe.sparse_moe_block import SparseMoeBlock, expert_checkpoint_target
from pdserve.models.llama import AttentionOptions, LlamaForCausalLM
from pdserve.models.moe import MoeCausalLM


class GptOssForCausalLM(MoeCausalLM, LlamaForCausalLM):
    checkpoint_target = staticmethod(expert_checkpoint_target)

    @staticmethod
    def attention_options(config: Any) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, sinks=True)

    def make_mlp(self, config: Any, layer_id: int, tp: TpGroup) -> nn.Module:
        num_experts = config.num_local_experts
        router = TopKRouter(
            config.hidden_size,
            num_experts,
            config.num_experts_per_tok,
            RouterSpec(Scoring.TOPK_SOFTMAX),
            bias=True,
        )
        experts = FusedMoE(
            num_experts,
            config.hidden_size,
            config.intermediate_size,
            ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit),
            bias=True,
            tp=tp,
            expert_parallel=self.expert_parallel,
            layout="gpt_oss",
        )
        return SparseMoeBlock(router, experts, tp, router_name="router")

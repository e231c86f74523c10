"""Qwen2 (Yang et al. 2024): the Llama decoder with biases on the q/k/v projections (not on o)."""

from __future__ import annotations

from typing import Any

from pdserve.models.llama import AttentionOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)

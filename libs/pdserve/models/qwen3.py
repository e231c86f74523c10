"""Qwen3 (Qwen team 2025): the Llama decoder with per-head RMSNorm on q and k before the rotary embedding."""

from __future__ import annotations

from typing import Any

from pdserve.models.llama import AttentionOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: Any) -> AttentionOptions:
        bias = getattr(config, "attention_bias", False)
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)

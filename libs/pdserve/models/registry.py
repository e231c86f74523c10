"""Model classes by the ``architectures`` name of config.json, imported only when used."""

from __future__ import annotations

import importlib

from torch import nn

MODEL_REGISTRY = {
    "Gemma3ForCausalLM": "pdserve.models.gemma3:Gemma3ForCausalLM",
    "GptOssForCausalLM": "pdserve.models.gpt_oss:GptOssForCausalLM",
    "LlamaForCausalLM": "pdserve.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pdserve.models.llama:MistralForCausalLM",
    "MixtralForCausalLM": "pdserve.models.mixtral:MixtralForCausalLM",
    "Qwen2ForCausalLM": "pdserve.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "pdserve.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "pdserve.models.qwen3_moe:Qwen3MoeForCausalLM",
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The model class for an ``architectures`` entry.

    Raises:
        ValueError: the architecture is not supported.
    """
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}"
        )
    module_name, class_name = MODEL_REGISTRY[architecture].split(":")
    return getattr(importlib.import_module(module_name), class_name)

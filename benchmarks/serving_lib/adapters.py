"""Random LoRA adapters in PEFT's format for the base model's shapes (``make bench-lora`` and
``make bench --lora-mix``): rank-``r`` A and B on every projection of every layer (q/k/v/o,
gate/up/down), B small so the adapters change the base's outputs a little, as fine-tunes do."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(
    directory: Path, shapes: dict[tuple[int, str], tuple[int, int]], rank: int, seed: int
) -> Path:
    """A random PEFT LoRA adapter of ``rank`` on every ``(layer, module)`` of ``shapes`` (``(out, in)``)."""
    directory.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for (layer, module), (out_features, in_features) in shapes.items():
        part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        key = f"base_model.model.model.layers.{layer}.{part}.{module}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) / in_features**0.5
        tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.01
    save_file(tensors, directory / "adapter_model.safetensors")
    modules = sorted({module for _, module in shapes})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def model_shapes(checkpoint: Path) -> dict[tuple[int, str], tuple[int, int]]:
    """``(out, in)`` of each ``(layer, module)`` of ``MODULES`` in the checkpoint's HF config."""
    config = AutoConfig.from_pretrained(checkpoint)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = {
        "q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
        "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter),
    }  # fmt: skip
    return {(layer, m): per_layer[m] for layer in range(config.num_hidden_layers) for m in MODULES}


def write_adapters(directory: Path, checkpoint: Path, count: int, rank: int) -> list[tuple[str, Path]]:
    """``count`` random adapters ``a0 .. a{count-1}`` of ``rank`` for ``checkpoint`` under ``directory``."""
    shapes = model_shapes(checkpoint)
    return [(f"a{i}", write_adapter(directory / f"a{i}", shapes, rank, seed=i)) for i in range(count)]

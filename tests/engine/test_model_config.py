"""ModelConfig facts, dtype resolution, the model registry and the loader's checks."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.model_config import ModelConfig, cpu_has_bf16, resolve_dtype
from pdserve.models.registry import get_model_class


def test_smollm2_config(model_path):
    cfg = ModelConfig.from_pretrained(model_path, dtype="float32")
    hf = json.loads((model_path / "config.json").read_text())
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        hf["num_hidden_layers"],
        hf["num_attention_heads"],
        hf["num_key_value_heads"],
    )
    assert cfg.head_dim == hf["hidden_size"] // hf["num_attention_heads"]
    assert cfg.vocab_size == hf["vocab_size"] and cfg.context_length == hf["max_position_embeddings"]
    assert cfg.eos_token_ids == [hf["eos_token_id"]] and cfg.dtype == torch.float32


def test_dtype_resolution():
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if cpu_has_bf16() else torch.float32)
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", "cpu")


def test_registry_and_loader_reject_what_they_cannot_serve(model_path, tmp_path):
    assert get_model_class("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match="not supported"):
        get_model_class("GPT2LMHeadModel")
    from pdserve.engine.model_runner import ModelRunner

    for name in ("config.json", "tokenizer.json"):
        shutil.copy(model_path / name, tmp_path / name)
    weights = load_file(model_path / "model.safetensors")
    del weights["model.layers.3.self_attn.k_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.3\.self_attn\.qkv_proj\.weight"):
        ModelRunner(tmp_path, dtype="float32", max_total_tokens=256)

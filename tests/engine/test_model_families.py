"""Qwen2, Qwen3 and a Llama variant (qkv/o bias, llama3 RoPE scaling, tied embeddings) from tiny
random-weight checkpoints: our loader and model give HF's greedy tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from pdserve.engine.model_runner import ModelRunner
from pdserve.sampling.sampling_params import SamplingParams
from tests.engine.driver import Driver
from tests.families import hf_greedy

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,  # peaked logits: greedy choices far from ties
    eos_token_id=None,
)
FAMILIES = {
    "qwen2": (Qwen2Config(**TINY, tie_word_embeddings=False, rope_theta=20000.0), Qwen2ForCausalLM),
    "qwen3": (Qwen3Config(**TINY, head_dim=24, tie_word_embeddings=False), Qwen3ForCausalLM),
    "llama": (
        LlamaConfig(
            **TINY,
            attention_bias=True,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        LlamaForCausalLM,
    ),
}
NEW_TOKENS = 12


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_checkpoint_greedy_matches_hf(family, tmp_path):
    config, model_class = FAMILIES[family]
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    runner = ModelRunner(tmp_path, dtype="float32", page_size=4, max_total_tokens=512, max_running_requests=4)
    assert runner.model_config.architecture == model_class.__name__
    prompts = torch.randint(0, TINY["vocab_size"], (60,), generator=torch.Generator().manual_seed(1)).tolist()
    prompts = [prompts[:3], prompts[3:40], prompts[40:57]]
    driver = Driver(runner)
    seqs = [driver.add(p, SamplingParams(temperature=0.0)) for p in prompts]
    driver.generate(seqs, NEW_TOKENS)
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_ids == hf_greedy(hf, prompt, NEW_TOKENS)

"""Tiny random-weight checkpoints of every served model family, made from transformers' own config
and model classes and saved as the families ship (``save_pretrained``), and the HF fp32 greedy
reference on them. Engine tests use a 300-token vocabulary; stack tests give the checkpoint
SmolLM2's tokenizer (and its 49,152-token vocabulary) so that the real services can serve it.

Windows are short (12-16 keys) and pages small, so that prompts of ~100 tokens and a few dozen new
ones slide each window several times; the MoE families route 2 of 8 experts.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

WINDOW = 12
_LAYERS3 = ["sliding_attention", "sliding_attention", "full_attention"]
_ROPE_PER_TYPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
}
_YARN = {
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 150000.0,
    "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
}  # fmt: skip


@dataclass(frozen=True)
class Family:
    """A family's config and model class names in transformers, and what its config sets."""

    config: str
    model: str
    fields: dict[str, Any]
    moe: bool = False
    windowed: bool = True

    def make_config(self, vocab_size: int, **overrides) -> Any:
        base = dict(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            initializer_range=0.2,  # peaked logits: greedy choices far from ties
            eos_token_id=None,
            tie_word_embeddings=False,
        )
        return getattr(transformers, self.config)(**{**base, **self.fields, **overrides})


FAMILIES = {
    "mistral": Family(
        "MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW, num_key_value_heads=1)
    ),
    "mixtral": Family(
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=16),
        moe=True,
    ),
    "qwen3_moe": Family(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            num_key_value_heads=1,
            mlp_only_layers=[1],
        ),
        moe=True,
        windowed=False,
    ),
    "gemma3": Family(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            sliding_window=WINDOW,
            layer_types=_LAYERS3,
            rope_parameters=_ROPE_PER_TYPE,
            query_pre_attn_scalar=24,
        ),
    ),
    "gemma3_tied_capped": Family(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            sliding_window=WINDOW,
            layer_types=_LAYERS3,
            tie_word_embeddings=True,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "gpt_oss": Family(
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            layer_types=_LAYERS3,
            rope_parameters=_YARN,
        ),
        moe=True,
    ),
}


def make_checkpoint(
    name: str | Family, path: Path, vocab_size: int = 300, tokenizer: Path | None = None
) -> Path:
    """Save family ``name``'s tiny model (seeded random weights; or the ``Family`` given) to ``path``,
    with the tokenizer files of the checkpoint directory ``tokenizer`` when given; returns ``path``."""
    family = FAMILIES[name] if isinstance(name, str) else name
    torch.manual_seed(0)
    model = getattr(transformers, family.model)(family.make_config(vocab_size))
    model.save_pretrained(path)
    if tokenizer is not None:
        for file in tokenizer.iterdir():
            if (
                file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges"))
                or file.suffix == ".jinja"
            ):
                shutil.copy(file, path / file.name)
    return path


def hf_model(path: Path, **config_overrides) -> Any:
    """The checkpoint at ``path`` in transformers, float32, eval (``config_overrides`` change its config)."""
    config = transformers.AutoConfig.from_pretrained(path, **config_overrides)
    return transformers.AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()


def hf_greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """HF's greedy ``new_tokens`` after ``prompt`` (no early stop)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()

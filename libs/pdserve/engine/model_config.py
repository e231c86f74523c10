"""``ModelConfig``: the facts of a checkpoint the engine and scheduler need, read with transformers."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.distributed import head_shard
from pdserve.layers.native import cpu_has
from pdserve.layers.pooler import model_pooling
from pdserve.model_source import capped_context_length

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_bf16() -> bool:
    """True when the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16)."""
    return cpu_has("avx512_bf16", "amx_bf16")


def resolve_dtype(dtype: str, device: str | torch.device) -> torch.dtype:
    """``auto`` → bfloat16 where the device computes it natively (CUDA with bf16, CPUs with
    AVX512-BF16/AMX), else float32; otherwise the named dtype.

    Raises:
        ValueError: an unknown dtype name.
    """
    if dtype == "auto":
        if str(device).startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass(slots=True)
class ModelConfig:
    """Shapes and token facts of a decoder-only checkpoint.

    Attributes:
        hf_config: the transformers config (model code reads its architecture-specific fields).
        architecture: ``architectures[0]`` of config.json, the model registry key.
        context_length: longest sequence served: ``max_position_embeddings`` (sliding-window
            layers attend their window of it: ``RadixAttention.sliding_window``).
        eos_token_ids: ids that end generation (config.json and generation_config.json).
        dtype: weight, activation and KV dtype.
        pooling: how ``/v1/embeddings`` pools its hidden states (``pdserve.layers.pooler.model_pooling``:
            ``last``, ``mean``, or None where the checkpoint's pooling is not served).
        tp_size / tp_rank: the tensor-parallel ranks the model is split over and the one this
            config describes; ``num_heads`` / ``num_kv_heads`` are the whole model's,
            ``num_local_heads`` / ``num_local_kv_heads`` this rank's (what its attention backend and
            KV pool hold; ranks may differ: ``pdserve.distributed.head_shard``).
    """

    hf_config: Any
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    context_length: int
    eos_token_ids: list[int]
    dtype: torch.dtype
    tp_size: int = 1
    tp_rank: int = 0
    pooling: str | None = "last"

    @property
    def num_local_heads(self) -> int:
        return head_shard(self.num_heads, self.num_kv_heads, self.tp_size, self.tp_rank).num_heads

    @property
    def num_local_kv_heads(self) -> int:
        return head_shard(self.num_heads, self.num_kv_heads, self.tp_size, self.tp_rank).num_kv_heads

    @property
    def local_kv_head_start(self) -> int:
        """The model's first KV head that this rank holds."""
        return head_shard(self.num_heads, self.num_kv_heads, self.tp_size, self.tp_rank).kv_start

    @classmethod
    def from_pretrained(
        cls,
        model_path: Path,
        dtype: str = "auto",
        device: str | torch.device = "cpu",
        max_model_len: int | None = None,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> ModelConfig:
        """Read ``model_path/config.json`` (and ``generation_config.json`` when present); the context
        is capped at ``max_model_len``.

        Raises:
            ValueError: ``max_model_len`` exceeds the model's context; the attention heads cannot be
                split over ``tp_size`` ranks, or there are fewer intermediate channels than ranks
                (the message says which).
        """
        from transformers import AutoConfig, GenerationConfig

        hf = AutoConfig.from_pretrained(model_path)
        eos = _as_list(hf.eos_token_id)
        with contextlib.suppress(OSError):  # no generation_config.json
            generation_eos = _as_list(GenerationConfig.from_pretrained(model_path).eos_token_id)
            eos += [t for t in generation_eos if t not in eos]
        context_length = capped_context_length(hf.max_position_embeddings, max_model_len)
        num_heads = hf.num_attention_heads
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
        head_shard(num_heads, num_kv_heads, tp_size, tp_rank)
        if hf.intermediate_size < tp_size:
            raise ValueError(
                f"intermediate_size {hf.intermediate_size} is smaller than the TP size {tp_size}"
            )
        return cls(
            hf_config=hf,
            architecture=(hf.architectures or ["LlamaForCausalLM"])[0],
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
            hidden_size=hf.hidden_size,
            vocab_size=hf.vocab_size,
            context_length=context_length,
            eos_token_ids=eos,
            dtype=resolve_dtype(dtype, device),
            tp_size=tp_size,
            tp_rank=tp_rank,
            pooling=model_pooling(model_path),
        )


def _as_list(token_ids: int | list[int] | None) -> list[int]:
    if token_ids is None:
        return []
    return [token_ids] if isinstance(token_ids, int) else list(token_ids)

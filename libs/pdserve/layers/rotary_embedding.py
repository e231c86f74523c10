"""Rotary position embedding (RoFormer, Su et al. 2021), NeoX "rotate half" layout as in Llama.

Frequencies follow the Hugging Face config: ``rope_parameters`` (transformers 5; older
``rope_theta`` / ``rope_scaling`` configs are normalised into it by transformers), with the
scaled variants (linear, llama3, yarn, ...) computed by transformers' own ``ROPE_INIT_FUNCTIONS``.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.layers.cpu_fused_ops import load_fused_ops

_DYNAMIC_ROPE_TYPES = {"dynamic", "longrope"}  # frequencies change with the sequence length


class RotaryEmbedding(nn.Module):
    """Precomputed float32 cos/sin of every position; ``forward`` rotates a batch's q and k.

    Args:
        head_dim: rotated dimension (the whole head).
        max_position: positions ``[0, max_position)`` are cached.
        inv_freq: float32 ``[head_dim // 2]`` inverse frequencies.
        attention_scaling: factor on cos/sin (1 except for yarn-like scalings).
    """

    def __init__(
        self, head_dim: int, max_position: int, inv_freq: torch.Tensor, attention_scaling: float = 1.0
    ):
        super().__init__()
        if inv_freq.numel() * 2 != head_dim:
            rotated = inv_freq.numel() * 2
            raise ValueError(f"partial rotary embeddings are not supported ({rotated} of {head_dim} dims)")
        self.head_dim = head_dim
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated ``q`` ``[T, Hq * D]`` and ``k`` ``[T, Hk * D]`` at ``positions`` (int64 ``[T]``).

        On CPU both are rotated in place by one fused C call (``cpu_fused_ops``; rows may be
        views into a fused qkv tensor); elsewhere new tensors are returned. cos/sin are cast to
        the activation dtype first and each product rounded, as Hugging Face's ``apply_rotary_pos_emb``.
        """
        ops = load_fused_ops()
        if ops is not None and ops.supports(q) and q.stride(1) == 1 and k.stride(1) == 1:
            ops.rotary_(q, k, self.head_dim, self.cos_sin_cache, positions)
            return q, k
        cos, sin = self.cos_sin_cache[positions].to(q.dtype)[:, None, :].chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, H * D]`` (halves ``[x1, x2]`` → ``[x1 cos - x2 sin, x2 cos + x1 sin]``)."""
    shape = x.shape
    x1, x2 = x.reshape(shape[0], -1, 2 * cos.shape[-1]).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).view(shape)


def get_rope(hf_config, head_dim: int, max_position: int, layer_type: str | None = None) -> RotaryEmbedding:
    """RoPE of a Hugging Face config (``rope_parameters``); with ``layer_type``, that layer type's
    own parameters where the config keeps them per type (Gemma 3: ``sliding_attention`` /
    ``full_attention``).

    Raises:
        NotImplementedError: a rope type whose frequencies depend on the sequence length.
    """
    params = hf_config.rope_parameters or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    else:
        layer_type = None
    rope_type = params.get("rope_type", "default")
    if rope_type in _DYNAMIC_ROPE_TYPES:
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported")
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", layer_type=layer_type)
    return RotaryEmbedding(head_dim, max_position, inv_freq, scaling)

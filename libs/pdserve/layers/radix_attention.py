"""The attention layer models call; the batch's attention backend does the work."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from pdserve.engine.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    """Paged attention of one layer over the KV pool (SGLang's ``RadixAttention``).

    Args:
        num_heads / num_kv_heads: query and KV heads (GQA when different; ``num_heads`` must be a
            multiple of ``num_kv_heads``).
        head_dim: per-head dimension ``D``.
        scaling: softmax scale, usually ``D ** -0.5``.
        layer_id: index of this layer's K/V in the KV pool.
    """

    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """``q`` ``[T, Hq * D]``, ``k``/``v`` ``[T, Hkv * D]`` → ``[T, Hq * D]``; stores k/v in the pool."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)

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
        sliding_window: keys a query attends in a sliding-window layer (Beltagy et al. 2020's local
            attention as Mistral and Gemma use it): the query at position ``p`` sees keys
            ``(p - sliding_window, p]``, Hugging Face's convention; 0 for full causal attention.
        logit_cap: soft-capping of the scores, ``cap * tanh(s / cap)`` before the softmax (Gemma 2's
            ``attn_logit_softcapping``); 0 for none.

    Attributes:
        sinks: float ``[num_heads]`` or None: per-head attention-sink logits (gpt-oss; Xiao et al.
            2023's sink as a learned logit): one more softmax term ``exp(sink)`` that takes weight
            from every key and contributes no value. The model sets it after loading.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        sliding_window: int = 0,
        logit_cap: float = 0.0,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        if sliding_window < 0 or logit_cap < 0:
            raise ValueError(f"sliding_window {sliding_window} and logit_cap {logit_cap} must be >= 0")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.sliding_window = sliding_window
        self.logit_cap = logit_cap
        self.sinks: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """``q`` ``[T, Hq * D]``, ``k``/``v`` ``[T, Hkv * D]`` → ``[T, Hq * D]``; stores k/v in the pool."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)


def layer_windows(model: torch.nn.Module) -> list[int]:
    """Each layer's sliding window in tokens (0: a global layer), from ``model``'s ``RadixAttention``
    modules in ``layer_id`` order."""
    layers = sorted((m.layer_id, m.sliding_window) for m in model.modules() if isinstance(m, RadixAttention))
    return [window for _, window in layers]

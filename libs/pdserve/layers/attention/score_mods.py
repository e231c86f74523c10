"""Attention whose scores are modified before the softmax, which neither SDPA nor the CPU C kernels
take: soft-capping (Gemma 2's ``attn_logit_softcapping``: ``s = cap * tanh(s / cap)``) and attention
sinks (gpt-oss: a learned logit per query head that joins each row of the softmax and contributes
no value, Xiao et al. 2023's sink as a parameter). Computed as Hugging Face's eager attention of
these models computes it: scores, then the cap, the mask, the sink column, the row's max taken
off, softmax, the sink dropped, times V.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.layers.radix_attention import RadixAttention


def needs_score_mods(layer: RadixAttention) -> bool:
    """Whether ``layer``'s scores are capped or joined by sinks."""
    return bool(layer.logit_cap) or layer.sinks is not None


def attend_with_score_mods(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, layer: RadixAttention, max_q: int
) -> torch.Tensor:
    """Attention of ``q`` ``[B, Hkv, G * Lq, D]`` (the ``G`` query heads of each KV head folded into
    the query axis, head-major: row ``g * Lq + i`` is query ``i`` of head ``hkv * G + g``) over ``k`` /
    ``v`` ``[B, Hkv, Lk, D]`` under the boolean ``mask`` ``[B, 1, G * Lq, Lk]`` (True: attend), with
    ``layer``'s scale, soft-cap and sinks. Returns ``[B, Hkv, G * Lq, D]`` in q's dtype; every row
    needs at least one key its mask allows."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * layer.scaling
    if layer.logit_cap:
        scores = torch.tanh(scores / layer.logit_cap) * layer.logit_cap
    scores = scores.masked_fill(~mask, float("-inf"))
    if layer.sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, v)
    heads = layer.sinks.to(scores.dtype).view(1, q.shape[1], -1, 1)  # [1, Hkv, G, 1]
    sinks = heads.repeat_interleave(max_q, dim=2).expand(q.shape[0], -1, -1, -1)
    logits = torch.cat([scores, sinks], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    weights = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(weights.to(v.dtype), v)

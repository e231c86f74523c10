"""Top-k routing of a mixture-of-experts layer (Shazeer et al. 2017), with each family's
normalisation of the selected experts' weights, computed as its Hugging Face router does.

- ``softmax_topk``: softmax over all experts (float32), the top k, renormalised to sum to 1 when
  ``renormalize`` (Mixtral always; Qwen3-MoE with ``norm_topk_prob``).
- ``topk_softmax``: the top k logits, then a softmax over those k (gpt-oss).

The router's weight stays unquantized and replicated on every TP rank (it is ``[E, H]``, tiny), so
every rank routes every token alike.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.layers.linear import PackedWeight, linear, prepack_weight


class Scoring(enum.Enum):
    SOFTMAX_TOPK = "softmax_topk"
    TOPK_SOFTMAX = "topk_softmax"


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """How a family turns router logits into expert weights.

    Attributes:
        scoring: softmax over all experts then top-k, or top-k then softmax over the k.
        renormalize: (softmax_topk) divide the k weights by their sum.
        float32_weights: keep the weights in float32 (Mixtral); else cast to the model dtype
            (Qwen3-MoE, gpt-oss), which changes how the experts' outputs round when scaled.
    """

    scoring: Scoring
    renormalize: bool = True
    float32_weights: bool = False


class TopKRouter(nn.Module):
    """``forward(x)`` for ``x`` ``[T, H]``: ``(weights, ids)``, both ``[T, top_k]``: the selected
    experts (int64, in descending score order, as ``torch.topk`` gives them) and their weights.

    Args:
        hidden_size / num_experts: the gate weight is ``[num_experts, hidden_size]``.
        top_k: experts per token (``num_experts_per_tok``).
        bias: the gate has a bias ``[num_experts]`` (gpt-oss).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, spec: RouterSpec, bias: bool = False):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, {num_experts}]")
        self.top_k, self.spec = top_k, spec
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias else None
        self.packed: PackedWeight | None = None

    def process_weights_after_loading(self) -> None:
        """A packed copy of the gate (bfloat16 on CPU: ``F.linear`` on an unpacked bfloat16 weight
        reorders it on every call, ~0.6 ms of a 0.1 ms product at 16 tokens x 128 experts)."""
        self.packed = prepack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x, self.weight, self.bias, self.packed)
        if self.spec.scoring is Scoring.TOPK_SOFTMAX:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=1, dtype=top.dtype), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.spec.renormalize:
            top /= top.sum(dim=-1, keepdim=True)
        return (top if self.spec.float32_weights else top.to(logits.dtype)), ids

"""A mixture-of-experts MLP (Shazeer et al. 2017; Fedus et al. 2021): route each token to its top-k
experts, run the experts grouped by expert, combine across TP / EP ranks with one all-reduce."""

from __future__ import annotations

import re

import torch
from torch import nn

from pdserve.distributed import SINGLE_RANK, TpGroup
from pdserve.layers.moe.fused_moe import FusedMoE
from pdserve.layers.moe.router import TopKRouter


class SparseMoeBlock(nn.Module):
    """``forward(x)`` ``[T, H]`` → ``[T, H]``, the weighted sum of each token's experts.

    Args:
        router: the gate (its module name in the checkpoint is ``router_name``: ``gate`` for
            Mixtral and Qwen3-MoE, ``router`` for gpt-oss).
        experts: the layer's experts (this rank's share).
    """

    def __init__(
        self, router: TopKRouter, experts: FusedMoE, tp: TpGroup = SINGLE_RANK, router_name: str = "gate"
    ):
        super().__init__()
        setattr(self, router_name, router)
        self.router_name = router_name
        self.experts = experts
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = getattr(self, self.router_name)(x)
        return self.tp.all_reduce(self.experts(x, ids, weights))


# A checkpoint's per-expert matrices (as models ship: ``experts.{e}.gate_proj.weight``; Mixtral's
# ``w1`` gate, ``w3`` up, ``w2`` down) and the stacked ones of transformers 5's modules.
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)(_bias)?$")
_KINDS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def expert_checkpoint_target(name: str) -> tuple[str, tuple[int | None, str]] | None:
    """The ``FusedMoE`` parameter and shard ``(expert or None, kind)`` of checkpoint tensor ``name``,
    or None when it is not an expert tensor."""
    if match := _PER_EXPERT.match(name):
        prefix, expert, part = match.groups()
        kind = _KINDS[part]
        return f"{prefix}.{'down_proj' if kind == 'down' else 'gate_up_proj'}", (int(expert), kind)
    if match := _STACKED.match(name):
        prefix, part, bias = match.groups()
        return f"{prefix}.{part}{bias or ''}", (None, "down" if part == "down_proj" else "gate_up")
    return None

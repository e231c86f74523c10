"""Linear layers whose parameters carry their own ``weight_loader`` (nano-vllm's loading scheme).

Parameters are allocated uninitialised: every value comes from the checkpoint. A merged layer
(fused q/k/v, fused gate/up) stacks several checkpoint matrices along the output dimension and
its loader copies each one into its shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into ``param`` (casting the dtype).

    Raises:
        ValueError: the shapes differ.
    """
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


class Linear(nn.Module):
    """``y = x W^T (+ b)``, ``W`` of shape ``[out_features, in_features]``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several linear maps of one input fused into one matmul; output = concatenated shards.

    Args:
        output_sizes: output features of each shard, in order.
        shard_names: the name a checkpoint uses for each shard (e.g. ``["q", "k", "v"]``).
    """

    def __init__(
        self, in_features: int, output_sizes: Sequence[int], shard_names: Sequence[str], bias: bool = False
    ):
        super().__init__(in_features, sum(output_sizes), bias)
        offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self.shards = {
            name: (off, size) for name, off, size in zip(shard_names, offsets, output_sizes, strict=True)
        }
        self.output_sizes = list(output_sizes)
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        """Copy one checkpoint shard (weight ``[size, in]`` or bias ``[size]``) into its rows."""
        offset, size = self.shards[shard]
        default_weight_loader(param.data.narrow(0, offset, size), loaded)

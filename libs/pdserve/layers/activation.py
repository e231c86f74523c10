"""Gated activation of the SwiGLU MLP (Shazeer 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = [gate | up]`` of shape ``[T, 2 * d]``; returns ``[T, d]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

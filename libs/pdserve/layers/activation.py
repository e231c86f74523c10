"""Gated activation of the SwiGLU MLP (Shazeer 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.cpu_fused_ops import load_fused_ops


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = [gate | up]`` of shape ``[T, 2 * d]``; returns ``[T, d]``
    (one fused C call on CPU, ``cpu_fused_ops``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = load_fused_ops()
        if ops is not None and ops.supports(x) and x.dim() == 2 and x.is_contiguous():
            return ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

"""Gated activations of the MLPs: SwiGLU (Shazeer 2020), GeGLU with the tanh GELU (Gemma), and
gpt-oss's clamped SwiGLU. Each takes ``x = [gate | up]`` of shape ``[T, 2 * d]`` and returns ``[T, d]``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.cpu_fused_ops import load_fused_ops


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` (one fused C call on CPU, ``cpu_fused_ops``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = load_fused_ops()
        if ops is not None and ops.supports(x) and x.dim() == 2 and x.is_contiguous():
            return ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """``gelu(gate) * up`` with the tanh approximation (Hugging Face's ``gelu_pytorch_tanh``, Gemma's
    ``hidden_activation``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class ClampedSwiGLU(nn.Module):
    """gpt-oss's gated activation: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = clamp(gate, max=limit)`` (OpenAI 2025, the gpt-oss model card; ``swiglu_alpha``,
    ``swiglu_limit`` of its config)."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

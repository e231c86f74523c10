"""RMSNorm (Zhang & Sennrich 2019) with the residual add fused in, as in SGLang / nano-vllm, and
Gemma's variant."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.cpu_fused_ops import load_fused_ops


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, the statistics in float32 (as Hugging Face's LlamaRMSNorm).

    ``forward(x)`` returns the normalised ``x``; ``forward(x, residual)`` first adds ``residual``
    and returns ``(normalised sum, sum)`` so the next residual needs no separate add; on CPU the
    sum is written into ``residual`` in place (one fused C call, ``cpu_fused_ops``).
    Shapes: ``[..., hidden_size]``, any float dtype (kept).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = load_fused_ops()
        if ops is not None and ops.supports(x) and x.dim() == 2 and x.stride(1) == 1:
            if residual is None:
                return ops.add_rmsnorm(x, None, self.weight, self.eps)
            if residual.is_contiguous():
                return ops.add_rmsnorm(x, residual, self.weight, self.eps), residual
        if residual is not None:
            x = x + residual
            residual = x
        out = self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``, all in float32 and rounded to
    x's dtype once at the end (Hugging Face's ``Gemma3RMSNorm``; the checkpoint stores ``weight``
    centred on 0). ``forward(x, residual)`` adds ``residual`` first, as ``RMSNorm``'s does."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps) * (1.0 + self.weight.float())
        out = normed.to(x.dtype)
        return out if residual is None else (out, residual)

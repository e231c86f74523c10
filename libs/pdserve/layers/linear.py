"""Linear layers whose parameters carry their own ``weight_loader`` (nano-vllm's loading scheme).

Parameters are allocated uninitialised: every value comes from the checkpoint. A merged layer
(fused q/k/v, fused gate/up) stacks several checkpoint matrices along the output dimension and
its loader copies each one into its shard. After loading, ``process_weights_after_loading``
(vLLM's name for the hook) gives bfloat16 CPU weights a packed copy: for our kernel
(``pdserve.layers.cpu_gemm``: AMX tiles or AVX512-BF16 vector instructions) where the CPU and
the shape allow, otherwise oneDNN's blocked layout, which its matmul reads 15–35% faster than a
plain row-major weight it must reorder on every call (``benchmarks/engine.py`` shows the step
time), and on CPUs where oneDNN has no bfloat16 path (AVX2 only) ``pdserve.layers.cpu_matmul``'s
bfloat16 panels. Our kernels compute every row in the same order whatever the batch (oneDNN's
AMX kernels block differently by the number of rows, so a request's result would depend on its
batch-mates); ``PDSERVE_BF16_MATMUL=onednn`` takes oneDNN wherever it runs, for comparisons.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.cpu_gemm import PanelWeight, load_cpu_gemm
from pdserve.layers.cpu_matmul import MatmulWeight, load_cpu_matmul


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor | Any) -> None:
    """Copy a checkpoint tensor, or all of a lazy safetensors slice, into ``param`` (casting the dtype).

    Raises:
        ValueError: the shapes differ.
    """
    if not isinstance(loaded, torch.Tensor):
        loaded = loaded[:]  # a safetensors slice reads its bytes only now
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


def checkpoint_shape(loaded: torch.Tensor | Any) -> tuple[int, ...]:
    """Shape of a checkpoint tensor or of a lazy safetensors slice (read without loading it)."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


_PACK_BATCH_HINT = 64  # rows oneDNN tunes the layout for; any number of rows works
BF16_MATMUL_ENV = "PDSERVE_BF16_MATMUL"  # auto (our kernels where they run) or onednn


class OneDNNWeight:
    """A bfloat16 weight ``[N, K]`` in oneDNN's blocked layout; ``matmul(x, bias)`` is
    ``F.linear(x, W, bias)`` for bfloat16 ``x`` ``[..., K]``, bit for bit."""

    def __init__(self, weight: torch.Tensor):
        self.data = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)

    def matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """``F.linear(x, W, bias)``, converted to ``out_dtype`` when given (oneDNN writes bfloat16)."""
        out = torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")
        return out if out_dtype is None else out.to(out_dtype)


PackedWeight = PanelWeight | OneDNNWeight | MatmulWeight


def prepack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """A packed copy of ``weight`` ``[out, in]`` for ``linear``, or None where plain ``F.linear``
    is the right kernel (not on CPU, not bfloat16, or neither packed kernel runs here).

    Only bfloat16 is packed: float32 matmuls stay on MKL, whose results the exactness tests
    compare with Hugging Face's.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    gemm = load_cpu_gemm() if os.environ.get(BF16_MATMUL_ENV, "auto") != "onednn" else None
    if gemm is not None and gemm.supports(weight):
        return gemm.pack(weight)
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return OneDNNWeight(weight)
    matmul = load_cpu_matmul()  # CPUs without AVX-512: bfloat16 widened in registers, float32 FMAs
    return matmul.pack(weight, "bf16") if matmul is not None and matmul.supports(weight, "bf16") else None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: PackedWeight | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x W^T (+ b)`` for ``x`` ``[..., in]``, through ``packed`` (from ``prepack_weight``) when given.

    ``out_dtype`` (packed only; default x's dtype): float32 keeps the CPU kernels' float32 sums
    unrounded (oneDNN's bfloat16 result is converted); ``F.linear`` returns x's dtype.
    """
    if packed is None:
        return F.linear(x, weight, bias)
    return packed.matmul(x, bias, out_dtype)


class Linear(nn.Module):
    """``y = x W^T (+ b)``, ``W`` of shape ``[out_features, in_features]``.

    Attributes:
        packed: the packed copy of ``weight`` (``prepack_weight``) once ``process_weights_after_loading``
            ran (bfloat16 on CPU only; None otherwise).
        lora: the stacked LoRA adapter weights of this layer (``pdserve.lora.layer.LoraSlots``), set
            by a ``LoraManager``; each token of an adapter gets its low-rank delta on top of the base
            output (after any quantized matmul). None: no adapters.
        quant_method: set by the loader before ``process_weights_after_loading`` when the model is
            quantized (``pdserve.layers.quantization``); it then transforms the weight and runs the matmul.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: PackedWeight | None = None
        self.quant_method = None
        self.lora = None

    def process_weights_after_loading(self) -> None:
        if self.quant_method is not None:
            self.quant_method.process_weights_after_loading(self)
        else:
            self.packed = prepack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            y = self.quant_method.apply(self, x)
        else:
            y = linear(x, self.weight, self.bias, self.packed)
        return y if self.lora is None else self.lora.add(x, y)


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

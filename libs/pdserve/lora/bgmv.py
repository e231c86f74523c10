"""The mixed-adapter LoRA delta of one linear layer as one C call (``c-kernels/lora.c``), after
Punica's BGMV (batched gather matrix-vector product, Chen et al. 2023): each token gathers its own
adapter's ``A^T`` / ``B^T`` from the layer's stacked slots, so any mix of adapters in a batch costs
one call (tokens of one adapter, tiles of up to 8, share each load of its weights, as in Punica's
SGMV) instead of ~8 torch ops per adapter present (``lora/layer.py`` keeps those for where the
kernel cannot run: another device, another dtype, a row that is not unit-stride).

Sums in float32: a token's row of ``y`` becomes ``round(y + (x @ A^T) @ B^T)``, the same float32
delta added once as the torch path adds it (only the order of the float32 sums differs).
``load_bgmv`` returns None when the CPU kernels are off.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from pdserve.layers.native import kernel_library, per_variant

_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGTYPES = [_P, _I, _P, _I, _P, _P, _I, _I, _P, _P, _P, _I, _I, _C]


class BgmvWeights:
    """The C view of one layer's stacked adapter buffers (``LoraSlots.a`` / ``.b``), made once: the
    buffers are written in place, never reallocated, so their addresses stay valid.

    Args:
        a: float32 ``[slots, in, S * R]``, contiguous.
        b: per shard, float32 ``[slots, R, size_s]``, contiguous.
    """

    def __init__(self, a: torch.Tensor, b: Sequence[torch.Tensor]):
        self.a, self.b = a, list(b)  # kept alive with the pointers below
        self.in_features, self.rank = a.shape[1], b[0].shape[1]
        self.b_ptrs = (ctypes.c_void_p * len(b))(*(t.data_ptr() for t in b))
        self.sizes = (ctypes.c_int64 * len(b))(*(t.shape[2] for t in b))


class Bgmv:
    """The kernel of one built library, for float32 or bfloat16 ``x`` and ``y`` (any pairing)."""

    def __init__(self, lib: ctypes.CDLL):
        self._fns = {}
        for x_dtype, x_suffix in _SUFFIXES.items():
            for y_dtype, y_suffix in _SUFFIXES.items():
                fn = getattr(lib, f"lora_bgmv_{x_suffix}_{y_suffix}")
                fn.restype, fn.argtypes = None, _ARGTYPES
                self._fns[x_dtype, y_dtype] = fn

    @staticmethod
    def supports(x: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether the kernel takes ``x`` ``[T, in]`` and ``y`` ``[T, out]``: on the CPU, float32 or
        bfloat16, unit stride within a row."""
        return all(t.device.type == "cpu" and t.dtype in _SUFFIXES and t.stride(1) == 1 for t in (x, y))

    def add_(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        token_slots: torch.Tensor,
        order: torch.Tensor,
        weights: BgmvWeights,
    ) -> None:
        """``y[t] += (x[t] @ A^T[slot]) @ B^T[slot]`` shard by shard, in place, for every token ``t``
        of ``order``, ``slot = token_slots[t]`` (the other rows of ``y`` are not touched).

        Args:
            x: ``[T, in]``, ``y``: ``[T, out]`` (``supports``); ``out`` is the sum of the shard sizes.
            token_slots: int64 ``[T]``, contiguous, each -1 or a slot of ``weights`` (not checked:
                the ``LoraManager`` assigns them).
            order: int64 ``[n]``, contiguous: the tokens with a slot, those of one slot next to each
                other (``LoraBatch.order``; the kernel works as well on any order, at more loads).
            weights: the layer's buffers.
        """
        self._fns[x.dtype, y.dtype](
            x.data_ptr(),
            x.stride(0),
            y.data_ptr(),
            y.stride(0),
            token_slots.data_ptr(),
            order.data_ptr(),
            order.shape[0],
            weights.in_features,
            weights.a.data_ptr(),
            weights.b_ptrs,
            weights.sizes,
            len(weights.b),
            weights.rank,
            torch.get_num_threads(),
        )


@per_variant
def load_bgmv(variant: str) -> Bgmv:
    """The selected CPU kernel variant's ``Bgmv`` (None when the kernels are off)."""
    return Bgmv(kernel_library(variant))

"""An MoE layer's experts, everything after the router, in one C call on CPU
(``pdserve/c-kernels/moe.c``).

Called expert by expert from Python, a decode step of Qwen3-30B-A3B's shape makes two matmul calls
for each of its ~100 active experts per layer (a batch of 16 routes 128 rows over 128 experts),
and each call's fixed cost (argument checks, ctypes, an OpenMP team) exceeded its few rows of
arithmetic; the sort, gather, scaling and scatter-add around them were ten more PyTorch ops. Here
the kernel sorts the slots by expert, runs each active expert (a work item of one parallel region)
through the same kernels the per-expert calls ran (``cpu_matmul``'s packed formats: int8, int4,
w8a8, w4a8 and bfloat16; bfloat16 experts on AVX512-BF16 CPUs as ``cpu_gemm``'s panels, whose
``vdpbf16ps`` does four times the multiply-adds of widening them: ``pack_bf16``), SiLU-and-mul in
the gate/up epilogue, and adds each token's weighted outputs in ascending expert id with Hugging
Face's roundings (``FusedMoE.forward``'s contract).
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.layers.cpu_decoder import LinearStruct, linear_struct
from pdserve.layers.cpu_gemm import CpuGemm, PanelWeight
from pdserve.layers.cpu_matmul import MatmulWeight, load_cpu_matmul
from pdserve.layers.native import kernel_library, selected_variant

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_GEMM_BF16 = 3  # linear.h's LINEAR_GEMM_BF16


def pack_bf16(weight: torch.Tensor) -> PanelWeight | MatmulWeight | None:
    """An expert's bfloat16 matrix ``[N, K]`` packed for this kernel: ``cpu_gemm``'s panels where the
    CPU kernels' variant has them (AVX512-BF16; also on AMX CPUs, where a ``Linear`` takes oneDNN:
    an expert's few rows are no work for AMX tiles), else ``cpu_matmul``'s bfloat16 format; None
    when the kernels are off or the shape fits neither."""
    variant = selected_variant()
    if variant is None or weight.device.type != "cpu":
        return None
    lib = kernel_library(variant)
    if lib.gemm_supported() and CpuGemm.supports(weight):
        return CpuGemm(lib).pack(weight)
    matmul = load_cpu_matmul()
    return matmul.pack(weight, "bf16") if matmul.supports(weight, "bf16") else None


def _struct(packed: MatmulWeight | PanelWeight, bias: torch.Tensor | None, keep: list) -> LinearStruct:
    if isinstance(packed, MatmulWeight):
        return linear_struct(packed, bias, keep)
    n, k, data = packed.out_features, packed.in_features, packed.data.data_ptr()
    return LinearStruct(_GEMM_BF16, 0, 0, n, k, packed.halves, data, None, None, None)


class CpuExperts:
    """``experts(x, ids, weights)``: ``FusedMoE.forward`` for ``x`` ``[T, H]`` (float32 or bfloat16),
    the routed experts' global ids (int64) and weights ``[T, k]``, over the experts
    ``[first_expert, first_expert + len(packed))`` packed in ``packed`` ``[(gate_up, down)]``.

    Build with ``CpuExperts.build`` (None where it does not apply).

    Raises (on call):
        MemoryError: the kernel's scratch buffers could not be allocated.
    """

    def __init__(
        self, lib: ctypes.CDLL, packed: list[tuple[MatmulWeight, MatmulWeight]], biases: list, first: int
    ):
        self._fn = lib.moe_experts
        self._fn.restype = _C
        self._fn.argtypes = [_P, _P, _I, _I, _P, _P, _I, _I, _P, _P, _C, _I, _I, _C]
        self._keep: list = []
        structs = [
            (_struct(p13, b13, self._keep), _struct(p2, b2, self._keep))
            for (p13, p2), (b13, b2) in zip(packed, biases, strict=True)
        ]
        self._gate_up = (LinearStruct * len(packed))(*(s for s, _ in structs))
        self._down = (LinearStruct * len(packed))(*(s for _, s in structs))
        self.first_expert, self.num_experts = first, len(packed)
        self.hidden, self.intermediate = packed[0][1].out_features, packed[0][1].in_features

    @classmethod
    def build(cls, packed: list[tuple[object, object]], biases: list, first_expert: int) -> CpuExperts | None:
        """The kernel over ``packed`` (and their ``biases``: ``[(gate_up, down)]``, None or float), or
        None unless the CPU kernels are on and every weight is a ``MatmulWeight`` or a bias-free
        bfloat16 ``PanelWeight``, gate/up in halves."""
        variant = selected_variant()
        if variant is None or not packed:
            return None
        for (p13, p2), (b13, b2) in zip(packed, biases, strict=True):
            if not (p13.halves and _runs(p13, b13) and _runs(p2, b2)):
                return None
        return cls(kernel_library(variant), packed, biases, first_expert)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        x, ids, weights = x.contiguous(), ids.contiguous(), weights.float().contiguous()
        out = torch.empty_like(x)
        tokens, slots = ids.shape
        status = self._fn(
            self._gate_up, self._down, self.first_expert, self.num_experts, ids.data_ptr(),
            weights.data_ptr(), tokens, slots, x.data_ptr(), out.data_ptr(), x.dtype == torch.bfloat16,
            self.hidden, self.intermediate, torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise MemoryError(
                f"MoE experts ({tokens} tokens): out of memory for the kernel's scratch buffers"
            )
        return out


def _runs(packed: object, bias: torch.Tensor | None) -> bool:
    """Whether the kernel multiplies by ``packed`` (with ``bias``)."""
    if isinstance(packed, PanelWeight):
        return bias is None
    return isinstance(packed, MatmulWeight)

"""Fused element-wise ops for CPUs: residual-add + RMSNorm, in-place rotary embedding, SiLU-and-mul,
storing a step's K/V rows in the pool, the greedy argmax, and the per-row int8 quantization of
W8A8 activations (``quantize.h``, the code ``cpu_matmul``'s ``w8a8`` kernel runs inside; exposed
so the tests can rebuild that kernel's integers).

A decoder layer is mostly small element-wise steps around its four matmuls; as PyTorch ops each
costs a dispatch, a temporary and a pass over memory (``rms_norm`` alone is five ops with the
float32 statistics and the dtype casts around it). At decode batch sizes those fixed costs, not
arithmetic, set the step time, so each step here is one C call instead (SGLang's ``sgl-kernel``
and vLLM's ``_C`` ops fuse the same three for the same reason; written anew here).

Each op rounds exactly where the Hugging Face modules round in the same dtype (float32 statistics,
results cast back to the activation dtype before the weight multiply, products rounded before
sums in bfloat16 rotary), so outputs match the PyTorch ops they replace: bitwise in bfloat16
apart from summation order in the RMS and the exponential in SiLU (AVX-512 code computes it with
its own polynomial, within 3e-7 relative of libm, which moves ~1 in 10^4 bfloat16 results by a
rounding step), and to float32 rounding in float32.

C source: ``pdserve/c-kernels/fused_ops.c`` (``pdserve.layers.native`` loads it); ``load_fused_ops``
returns None when the kernels are off and callers use PyTorch ops. Supported dtypes: float32 and
bfloat16, contiguous rows.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.layers.native import kernel_library, per_variant

_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "add_rmsnorm": [_P, _I, _P, _P, _P, _I, _I, _F, _C],
    "rotary": [_P, _I, _I, _P, _I, _I, _I, _P, _P, _I, _C],
    "silu_and_mul": [_P, _P, _I, _I, _C],
    "quantize_rows": [_P, _I, _I, _I, _P, _P, _C],
    "argmax": [_P, _I, _I, _P, _C],
}


class FusedOps:
    """The fused ops of one built library; each checks nothing beyond what its docstring states."""

    def __init__(self, lib: ctypes.CDLL):
        self._fns: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}
        for name, argtypes in _SIGNATURES.items():
            for dtype, suffix in _SUFFIXES.items():
                fn = getattr(lib, f"{name}_{suffix}")
                fn.restype, fn.argtypes = None, argtypes
                self._fns[name, dtype] = fn
        self._store_kv = lib.store_kv
        self._store_kv.restype, self._store_kv.argtypes = (
            None,
            [_P, _I, _P, _I, _P, _P, _P, _I, _I, _I, _C, _I, _I, _C],
        )

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """Whether ``x`` (an activation) can go through these ops: CPU, float32 or bfloat16."""
        return x.device.type == "cpu" and x.dtype in _SUFFIXES

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """RMSNorm of ``x`` (``[T, H]``, unit stride along ``H``) or, with ``residual``, of
        ``x + residual``, which is also written into ``residual`` (contiguous ``[T, H]``).
        Returns a new ``[T, H]`` tensor; ``weight`` ``[H]`` in x's dtype."""
        rows, hidden = x.shape
        out = torch.empty((rows, hidden), dtype=x.dtype)
        self._fns["add_rmsnorm", x.dtype](
            x.data_ptr(),
            x.stride(0),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            hidden,
            eps,
            torch.get_num_threads(),
        )
        return out

    def rotary_(
        self, q: torch.Tensor, k: torch.Tensor, head_dim: int, cos_sin: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Rotate ``q`` ``[T, Hq * D]`` and ``k`` ``[T, Hk * D]`` in place (rows may be strided views
        into one fused qkv tensor, unit stride within a row); ``cos_sin`` float32 ``[P, D]``,
        ``positions`` int64 ``[T]``, all < P."""
        self._fns["rotary", q.dtype](
            q.data_ptr(),
            q.stride(0),
            q.shape[1] // head_dim,
            k.data_ptr(),
            k.stride(0),
            k.shape[1] // head_dim,
            head_dim,
            cos_sin.data_ptr(),
            positions.data_ptr(),
            q.shape[0],
            torch.get_num_threads(),
        )

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of contiguous ``x = [gate | up]`` ``[T, 2d]`` → new ``[T, d]``."""
        rows, width = x.shape
        out = torch.empty((rows, width // 2), dtype=x.dtype)
        self._fns["silu_and_mul", x.dtype](
            x.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads()
        )
        return out

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Symmetric per-row int8 of ``x`` ``[M, K]`` (unit stride along ``K``), stored offset by 128:
        uint8 ``[M, K]`` and float32 scales ``[M]`` with ``x ≈ (q - 128) * scale`` (``scale =
        max|x_row| / 127``)."""
        rows, cols = x.shape
        q = torch.empty((rows, cols), dtype=torch.uint8)
        scales = torch.empty(rows, dtype=torch.float32)
        self._fns["quantize_rows", x.dtype](
            x.data_ptr(), x.stride(0), rows, cols, q.data_ptr(), scales.data_ptr(), torch.get_num_threads()
        )
        return q, scales

    @staticmethod
    def stores_kv(k: torch.Tensor, pool_dtype: torch.dtype) -> bool:
        """Whether ``store_kv`` takes rows of ``k``'s dtype into a pool of ``pool_dtype``: the same
        dtype, or float32 rows into a bfloat16 pool."""
        return k.dtype == pool_dtype or (k.dtype, pool_dtype) == (torch.float32, torch.bfloat16)

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        loc: torch.Tensor,
    ) -> None:
        """Copy row ``t`` of ``k`` and ``v`` (``[T, Hkv * D]``, rows may be strided views into a fused
        qkv tensor, unit stride within a row) to token slot ``loc[t]`` (int64 ``[T]``, contiguous:
        offset ``loc % page_size`` of page ``loc // page_size``) of ``k_pages`` / ``v_pages``
        (``[num_pages, page_size, Hkv, D]``, each page contiguous, pages ``stride(0)`` apart, the same
        for both): rows and pages of one dtype, or float32 rows rounded into bfloat16 pages
        (``stores_kv``)."""
        size = k.element_size()
        self._store_kv(
            k.data_ptr(),
            k.stride(0) * size,
            v.data_ptr(),
            v.stride(0) * size,
            k_pages.data_ptr(),
            v_pages.data_ptr(),
            loc.data_ptr(),
            k.shape[0],
            k.shape[1],
            size,
            k.dtype != k_pages.dtype,
            k_pages.shape[1],
            k_pages.stride(0) * k_pages.element_size(),
            torch.get_num_threads(),
        )

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """int64 ``[R]``: the first index of each row's largest value of contiguous float32 or
        bfloat16 ``x`` ``[R, C]`` (as ``torch.argmax(x, -1)``; rows must hold no NaN)."""
        rows, cols = x.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._fns["argmax", x.dtype](x.data_ptr(), rows, cols, out.data_ptr(), torch.get_num_threads())
        return out


@per_variant
def load_fused_ops(variant: str) -> FusedOps:
    """The ops of the selected kernel variant (``pdserve.layers.native``); None when the kernels are off."""
    return FusedOps(kernel_library(variant))

"""Paged extend attention on CPU: query tiles of one request, a vector lane per query.

An extend computes ``n`` new tokens of a request after ``p`` cached ones; query ``i`` (position
``p + i``) attends keys ``[0, p + i]``. One query at a time (``cpu_decode_kernel``) each key's
score is a dot product summed across the lanes of a vector, and the horizontal sums cost more than
the products; gathering the pages for SDPA instead copies every key and builds a mask per layer
(a fresh 128-token prompt of SmolLM2 on AVX2: ~18% of its prefill step). Here a work item is a
tile of queries of one request, one query per lane, so a key's scores for the whole tile come out
of one vector (FlashAttention's tiling, Dao et al. 2022, laid out for CPU vector lanes). Two
kernels:

- the lane kernel (every variant; float32 or bfloat16 q and KV): tiles of 16 queries (AVX-512) or
  8 (AVX2) or 4 (portable) and one KV head with all of its query heads; the queries transposed once,
  each score vector ``sum_d q[., d] * k_t[d]`` by FMAs with the key's element
  broadcast (eight keys as independent chains), an online softmax per lane, and
  ``acc[., d] += p_t * v_t[d]`` with eight outputs' accumulators in registers. bfloat16 K/V rows
  are widened once per block and KV head. Everything float32; the output rounded to the dtype.
- the pair kernel (bfloat16, head_dim 64 or 128, on AVX512_BF16):

1. the tile's queries of one head are transposed once into pairs ``qt[j] = (q[., 2j], q[., 2j+1])``
   (16 lanes of two bfloat16); the score vector of key ``t`` is ``sum_j qt[j] . k_t[2j:2j+2]`` by
   ``vdpbf16ps`` with the key's pair broadcast, exact products summed in float32, with no
   cross-lane work; eight keys run as independent chains;
2. the online softmax over a block of 16 keys is lane-wise (each lane is one query's running max
   and sum), keys past a query's own position masked;
3. ``acc[i] += sum_t p[t, i] * v_t`` by ``vdpbf16ps`` over key pairs: the probabilities rounded to
   bfloat16 pairs ``(p[t], p[t+1])`` (the softmax sums taken over the rounded values) and V rows
   ``t``, ``t+1`` interleaved element-wise, once for the few queries whose float32 accumulators
   stay in registers together.

   Scores, softmax and accumulation are float32 and the output is rounded to nearest-even
   bfloat16, as in the decode kernel; rounding the probabilities adds an error of at most 2^-8 of
   the weights over ``|V|`` (the tests' bound).

Layout as in ``cpu_decode_kernel``: q and out rows ``[T, Hq, D]`` (q rows may be strided), K/V
``[num_pages, page_size, Hkv, D]`` (each page contiguous, pages ``stride(0)`` apart) addressed through
each request's page table. head_dim a multiple of 8 up to 512 (``supports``).
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.layers.attention.cpu_decode_kernel import pool_page_stride
from pdserve.layers.native import kernel_library, per_variant


class ExtendAttentionKernel:
    """``kernel(q, k_pages, v_pages, page_table, prefix_lens, extend_lens, row_starts, scale) -> out``
    (``window=`` for a sliding-window layer).

    Args (CPU tensors; q, the pages and out all float32 or all bfloat16):
        q: ``[T, Hq, D]``; each row's ``Hq * D`` elements contiguous (rows may be strided).
        k_pages / v_pages: ``[num_pages, page_size, Hkv, D]``, one layer's K and V.
        page_table: int64 ``[R, max_pages]``: each request's KV pages.
        prefix_lens / extend_lens / row_starts: int64 ``[R]``: cached keys, new queries (>= 1) and
            the row of q holding the first of them, per request.
        scale: softmax scale.
        window: a sliding-window layer's keys per query: the query at position ``p`` attends keys
            ``(p - window, p]``; 0 (default) attends ``[0, p]``.
        out: ``[T, Hq, D]`` written in the requests' rows (others untouched); allocated when None.
    Returns ``out``.

    Raises:
        ValueError: a head_dim without a tile kernel (``supports`` says which).
        TypeError: q and the pages of other dtypes, or not all one dtype.
        MemoryError: the kernel's scratch buffers could not be allocated.
    """

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.extend_attention
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = (
            [ctypes.c_void_p, ctypes.c_int64]
            + [ctypes.c_void_p] * 7
            + [ctypes.c_int64] * 8
            + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
        )

    @staticmethod
    def supports(dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in (torch.float32, torch.bfloat16) and head_dim % 8 == 0 and 0 < head_dim <= 512

    def __call__(
        self,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        page_table: torch.Tensor,
        prefix_lens: torch.Tensor,
        extend_lens: torch.Tensor,
        row_starts: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
        window: int = 0,
    ) -> torch.Tensor:
        if q.dtype not in (torch.float32, torch.bfloat16) or {k_pages.dtype, v_pages.dtype} != {q.dtype}:
            kinds = f"{q.dtype}, {k_pages.dtype}"
            raise TypeError(f"q and the K/V pages must be all float32 or all bfloat16, got {kinds}")
        tokens, num_heads, head_dim = q.shape
        _, page_size, num_kv_heads, _ = k_pages.shape
        page_stride = pool_page_stride(k_pages, v_pages)
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        if out is None:
            out = torch.empty((tokens, num_heads, head_dim), dtype=q.dtype)
        page_table, prefix_lens, extend_lens, row_starts = (
            t.contiguous() for t in (page_table, prefix_lens, extend_lens, row_starts)
        )
        status = self._fn(
            q.data_ptr(),
            q.stride(0),
            k_pages.data_ptr(),
            v_pages.data_ptr(),
            out.data_ptr(),
            page_table.data_ptr(),
            prefix_lens.data_ptr(),
            extend_lens.data_ptr(),
            row_starts.data_ptr(),
            len(prefix_lens),
            page_table.shape[1],
            page_size,
            page_stride,
            num_heads,
            num_kv_heads,
            head_dim,
            window,
            scale,
            q.dtype == torch.bfloat16,
            torch.get_num_threads(),
        )
        if status == -1:
            raise ValueError(f"no extend tile kernel for head_dim {head_dim}")
        if status:
            raise MemoryError(f"extend attention ({tokens} tokens): out of memory for its scratch buffers")
        return out


@per_variant
def load_extend_kernel(variant: str) -> ExtendAttentionKernel | None:
    """The kernel of the selected variant (``pdserve.layers.native``); None when the kernels are off."""
    return ExtendAttentionKernel(kernel_library(variant))

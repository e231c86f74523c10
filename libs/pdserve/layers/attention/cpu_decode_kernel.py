"""Paged attention for CPUs, one query per row: a small OpenMP C kernel (``c-kernels/decode_attention.c``),
for every token of a step, decoding or extending.

Decode attention does little arithmetic per byte (one query per request) but must read every
cached key and value; PyTorch ops need a gathered copy of the KV plus a generic SDPA, which costs
several times the reads themselves. This kernel reads the K/V pages in place through the page
table (flash-decoding, Dao et al. 2023; the CPU decode kernel idea of SGLang's ``sgl-kernel``,
written anew here). A token of an extend (a prefill, a chunk, the tokens after a radix-cache hit)
is a row like a decoding one: its request's pages and its own length, position + 1 (the causal
mask). So a token's attention is computed the same way whether it is decoded, prefilled in one
piece or in chunks, or comes after a cached prefix, and whatever else is in the batch: batch
invariance (as SGLang's deterministic mode and ThinkingMachines' batch-invariant kernels require).
On 128-token prompts this costs about what the query-tile extend kernel it replaced did (within
~15% on 2,048 tokens, bfloat16, one thread on the Sapphire Rapids this project runs on).

Layout: q and out ``[T, Hq, D]``; K and V ``[num_pages, page_size, Hkv, D]``, one layer's view of the
page-major pool (``KVPool``): position ``j`` of request ``r`` is row ``j % page_size`` of page
``page_table[r, j // page_size]``; a page's rows (all ``Hkv`` heads of its tokens, ``D`` contiguous
elements each) are one contiguous run, and pages lie ``k_pages.stride(0)`` elements apart; row ``t``
belongs to request ``row_req[t]``.

Algorithm. A work item is a range of 512 of a row's keys (flash-decoding's split-K at fixed
positions, so a long row's work is shared by the threads the same way in any batch) for one KV
head and its ``G = Hq / Hkv`` query heads; a last pass merges each row's splits in order. An item
walks its positions in blocks of 16 keys (any page size); while it computes one, it prefetches the
next block's rows into L2, one per row computed (a steady stream keeps the memory busy). The ``G``
query heads are done together, with AVX-512 in register tiles of up to 3 heads that load each
64-byte chunk of a K or V row once:

1. scores ``s[g, t] = scale * q_g . k_t``: one vector of partial products per (head, key), the 16
   keys' vectors then summed into one vector of 16 scores by a transpose-and-add tree; bfloat16
   dot products by ``vdpbf16ps`` where the CPU has AVX512_BF16 (pairwise products, exact in
   float32, summed in float32);
2. online softmax per query head: the running max ``m`` is kept unless a score exceeds it (then
   the accumulator is rescaled), the sums ``l`` are kept per lane and added up at the end, and
   ``exp`` is a branch-free polynomial, vectorised over the block;
3. ``acc[g] += sum_t p[g, t] * v_t``: a bfloat16 chunk of 32 elements read as 16 int32 lanes gives
   its even and odd elements as floats by a shift and a mask, so V is never widened into a copy.

A sliding-window layer's row starts at its window's first key (the splits counted from there); a
soft-capped layer caps each block's scores before step 2; a head's attention sink joins the last
pass's max and sum.

Arithmetic is float32; bfloat16 outputs are rounded to nearest-even. Each CPU class's library
(``setup.py``, loaded by ``pdserve.layers.native``) has its own steps: AVX-512 or AVX2 code for
head_dim 64, 128 and 256, the same algorithm in portable C (which the compiler vectorises) for
other head dims and CPUs. With the kernels off ``load_decode_kernel`` returns None and callers fall
back to PyTorch ops.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.layers.native import kernel_library, per_variant

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's F32 and BF16


class DecodeAttentionKernel:
    """``kernel(q, k_pages, v_pages, page_table, seq_lens, scale, row_req=None, window=0, cap=0.0,
    sinks=None) -> out``.

    Args (tensors on CPU, contiguous, q and pages of one dtype: float32 or bfloat16):
        q: ``[T, Hq, D]``, one query per row; ``Hq`` a multiple of ``Hkv``. Its rows may be
            strided (a view into a fused projection's output).
        k_pages / v_pages: ``[num_pages, page_size, Hkv, D]``, one layer's K and V.
        page_table: int64 ``[R, max_pages]``: the pages of each request.
        seq_lens: int64 ``[T]``, each >= 1: row ``t`` attends to keys ``[0, seq_lens[t])`` of its
            request.
        scale: softmax scale (usually ``D ** -0.5``).
        row_req: int64 ``[T]``, the request (row of ``page_table``) of each row; None: row ``t`` is
            request ``t``.
        num_threads: OpenMP threads (default torch's).
        window: a sliding-window layer's keys per query (Mistral, Gemma 3's local layers): row
            ``t`` attends the last ``window`` of its keys, ``[seq_lens[t] - window, seq_lens[t])``
            (the token at position ``p``: keys ``(p - window, p]``); 0 (default) attends all.
        cap: soft-capping of the scores (Gemma 2's ``attn_logit_softcapping``): each scaled score
            ``s`` becomes ``cap * tanh(s / cap)`` before the softmax; 0 (default) for none.
        sinks: float32 ``[Hq]`` attention-sink logits (gpt-oss; Xiao et al. 2023): each head's joins
            its softmax's max and sum and adds no value; None (default) for none.

    Returns ``[T, Hq, D]`` in q's dtype.

    Raises:
        MemoryError: the kernel's scratch buffers could not be allocated.
    """

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.decode_attention
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = (
            [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
            + [ctypes.c_void_p] * 6
            + [ctypes.c_int64] * 8
            + [ctypes.c_float, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        )

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in _DTYPES

    def __call__(
        self,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        row_req: torch.Tensor | None = None,
        num_threads: int | None = None,
        window: int = 0,
        cap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, num_heads, head_dim = q.shape
        _, page_size, num_kv_heads, _ = k_pages.shape
        page_stride = pool_page_stride(k_pages, v_pages)
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype)
        status = self._fn(
            _DTYPES[q.dtype],
            q.data_ptr(),
            q.stride(0),
            k_pages.data_ptr(),
            v_pages.data_ptr(),
            out.data_ptr(),
            page_table.data_ptr(),
            None if row_req is None else row_req.data_ptr(),
            seq_lens.data_ptr(),
            batch,
            page_table.shape[1],
            page_size,
            page_stride,
            num_heads,
            num_kv_heads,
            head_dim,
            window,
            scale,
            cap,
            None if sinks is None else sinks.data_ptr(),
            num_threads or torch.get_num_threads(),
        )
        if status:
            raise MemoryError(f"paged attention ({batch} rows): out of memory for its scratch buffers")
        return out


def pool_page_stride(k_pages: torch.Tensor, v_pages: torch.Tensor) -> int:
    """Elements between consecutive pages of ``k_pages`` and ``v_pages`` (``[num_pages, page_size, Hkv,
    D]``), the kernels' ``page_stride``.

    Raises:
        ValueError: a page's rows are not contiguous, or K and V pages lie differently apart.
    """
    _, page_size, heads, dim = k_pages.shape
    for pages in (k_pages, v_pages):
        if pages.shape != k_pages.shape or pages.stride()[1:] != (heads * dim, dim, 1):
            raise ValueError(
                f"KV pages {tuple(pages.shape)} with strides {pages.stride()}: a page must be contiguous"
            )
    if k_pages.stride(0) != v_pages.stride(0):
        raise ValueError(f"K pages {k_pages.stride(0)} and V pages {v_pages.stride(0)} elements apart")
    return k_pages.stride(0)


@per_variant
def load_decode_kernel(variant: str) -> DecodeAttentionKernel:
    """The kernel of the selected variant (``pdserve.layers.native``); None when the kernels are off."""
    return DecodeAttentionKernel(kernel_library(variant))

"""Paged decode attention for CPUs: a small OpenMP C kernel, built with the system C compiler on first use.

Decode attention does almost no arithmetic (one query per request) but must read every cached
key and value; PyTorch ops need a gathered copy of the KV plus a generic SDPA, which costs
several times the reads themselves. This kernel reads each request's K/V pages in place through
its page table, one pass per request with an online softmax per query head (flash-decoding
style; the CPU decode kernel idea of SGLang's ``sgl-kernel``, written anew here). Arithmetic is
float32; bfloat16 inputs are widened on load and the output rounded to nearest-even.

The shared library is cached under ``$PDSERVE_CACHE_DIR/kernels`` keyed by the source, flags and
the CPU's flags; without a C compiler ``load_decode_kernel`` returns None and callers fall back
to PyTorch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pdserve.model_source import cache_dir

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float load_f32(float x) { return x; }
static inline float store_f32(float x) { return x; }
static inline float load_bf16(uint16_t x) {
  uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t store_bf16(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);  /* round to nearest even */
  return (uint16_t)(u >> 16);
}

/* q, out: [batch, num_heads, head_dim]; k, v: [num_pages * page_size, num_kv_heads, head_dim];
   page_table: [batch, max_pages]; seq_lens: [batch]. Position j of request b is token slot
   page_table[b][j / page_size] * page_size + j % page_size. One task per request walks its pages
   in order (each page's K and V rows of all heads are contiguous, and the next page is
   prefetched), keeping an online softmax (running max m, sum l) per query head. */
#define DECODE_PARAMS(T)                                                                           \
  const T* q, const T* k, const T* v, T* out, const int64_t* page_table, const int64_t* seq_lens,  \
  int64_t batch, int64_t max_pages, int64_t page_size, int64_t num_heads, int64_t num_kv_heads,     \
  int64_t head_dim_arg, float scale, int num_threads
#define DECODE_ARGS                                                                                \
  q, k, v, out, page_table, seq_lens, batch, max_pages, page_size, num_heads, num_kv_heads,         \
  head_dim_arg, scale, num_threads

/* HEAD_DIM is a constant for the common sizes, so the inner loops compile to fixed vector code. */
#define DEFINE_DECODE(NAME, T, LOAD, STORE, HEAD_DIM)                                              \
static void NAME(DECODE_PARAMS(T)) {                                                               \
  const int64_t head_dim = HEAD_DIM;                                                               \
  const int64_t group = num_heads / num_kv_heads, stride = num_kv_heads * head_dim;                \
  const int64_t page_bytes = page_size * stride * (int64_t)sizeof(T);                              \
  _Pragma("omp parallel for schedule(dynamic) num_threads(num_threads)")                           \
  for (int64_t b = 0; b < batch; ++b) {                                                            \
    float* qf = malloc(sizeof(float) * num_heads * (2 * head_dim + page_size + 2));                \
    float *acc = qf + num_heads * head_dim, *p = acc + num_heads * head_dim;                       \
    float *m = p + num_heads * page_size, *l = m + num_heads;                                      \
    for (int64_t hq = 0; hq < num_heads; ++hq) {                                                   \
      const T* qp = q + (b * num_heads + hq) * head_dim;                                           \
      for (int64_t d = 0; d < head_dim; ++d) qf[hq * head_dim + d] = LOAD(qp[d]) * scale;          \
      m[hq] = -FLT_MAX;                                                                            \
      l[hq] = 0.f;                                                                                 \
    }                                                                                              \
    memset(acc, 0, sizeof(float) * num_heads * head_dim);                                          \
    const int64_t len = seq_lens[b], *pages = page_table + b * max_pages;                          \
    for (int64_t start = 0, i = 0; start < len; start += page_size, ++i) {                         \
      const int64_t n = len - start < page_size ? len - start : page_size;                         \
      const T *kp = k + pages[i] * page_size * stride, *vp = v + pages[i] * page_size * stride;    \
      if (start + page_size < len) {                                                               \
        const char *nk = (const char*)(k + pages[i + 1] * page_size * stride);                     \
        const char *nv = (const char*)(v + pages[i + 1] * page_size * stride);                     \
        for (int64_t off = 0; off < page_bytes; off += 64) {                                       \
          __builtin_prefetch(nk + off);                                                            \
          __builtin_prefetch(nv + off);                                                            \
        }                                                                                          \
      }                                                                                            \
      for (int64_t hq = 0; hq < num_heads; ++hq) {                                                 \
        const int64_t hk = hq / group;                                                             \
        const float* qh = qf + hq * head_dim;                                                      \
        float *ph = p + hq * page_size, *ah = acc + hq * head_dim, page_max = -FLT_MAX, sum = 0.f; \
        for (int64_t t = 0; t < n; ++t) {                                                          \
          const T* kt = kp + t * stride + hk * head_dim;                                           \
          float s = 0.f;                                                                           \
          for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * LOAD(kt[d]);                         \
          ph[t] = s;                                                                               \
          page_max = s > page_max ? s : page_max;                                                  \
        }                                                                                          \
        const float new_max = page_max > m[hq] ? page_max : m[hq];                                 \
        const float correction = expf(m[hq] - new_max);                                            \
        for (int64_t t = 0; t < n; ++t) {                                                          \
          ph[t] = expf(ph[t] - new_max);                                                           \
          sum += ph[t];                                                                            \
        }                                                                                          \
        l[hq] = l[hq] * correction + sum;                                                          \
        m[hq] = new_max;                                                                           \
        for (int64_t d = 0; d < head_dim; ++d) ah[d] *= correction;                                \
        for (int64_t t = 0; t < n; ++t) {                                                          \
          const T* vt = vp + t * stride + hk * head_dim;                                           \
          const float pt = ph[t];                                                                  \
          for (int64_t d = 0; d < head_dim; ++d) ah[d] += pt * LOAD(vt[d]);                        \
        }                                                                                          \
      }                                                                                            \
    }                                                                                              \
    for (int64_t hq = 0; hq < num_heads; ++hq) {                                                   \
      T* op = out + (b * num_heads + hq) * head_dim;                                               \
      const float inv = 1.f / l[hq];                                                               \
      for (int64_t d = 0; d < head_dim; ++d) op[d] = STORE(acc[hq * head_dim + d] * inv);          \
    }                                                                                              \
    free(qf);                                                                                      \
  }                                                                                                \
}

#define DEFINE_DISPATCH(NAME, T, LOAD, STORE)                                                      \
DEFINE_DECODE(NAME##_64, T, LOAD, STORE, 64)                                                       \
DEFINE_DECODE(NAME##_128, T, LOAD, STORE, 128)                                                     \
DEFINE_DECODE(NAME##_any, T, LOAD, STORE, head_dim_arg)                                            \
void NAME(DECODE_PARAMS(T)) {                                                                      \
  if (head_dim_arg == 64) NAME##_64(DECODE_ARGS);                                                  \
  else if (head_dim_arg == 128) NAME##_128(DECODE_ARGS);                                           \
  else NAME##_any(DECODE_ARGS);                                                                    \
}

DEFINE_DISPATCH(decode_attention_f32, float, load_f32, store_f32)
DEFINE_DISPATCH(decode_attention_bf16, uint16_t, load_bf16, store_bf16)
"""

# -ffast-math lets the dot products and exponentials vectorise (no inf/NaN: masks are lengths here)
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_SYMBOLS = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}


class DecodeAttentionKernel:
    """``kernel(q, k_pages, v_pages, page_table, seq_lens, scale) -> out``.

    Args (tensors on CPU, contiguous, q and pages of one dtype: float32 or bfloat16):
        q: ``[B, Hq, D]``, one query per request.
        k_pages / v_pages: ``[num_pages, page_size, Hkv, D]``, one layer's K and V.
        page_table: int64 ``[B, max_pages]``; seq_lens: int64 ``[B]`` (keys ``[0, seq_len)``).
    Returns ``[B, Hq, D]`` in q's dtype.
    """

    def __init__(self, lib: ctypes.CDLL):
        self._fns = {}
        for dtype, symbol in _SYMBOLS.items():
            fn = getattr(lib, symbol)
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]
            self._fns[dtype] = fn

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._fns

    def __call__(
        self,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        batch, num_heads, head_dim = q.shape
        _, page_size, num_kv_heads, _ = k_pages.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        self._fns[q.dtype](
            q.data_ptr(),
            k_pages.data_ptr(),
            v_pages.data_ptr(),
            out.data_ptr(),
            page_table.data_ptr(),
            seq_lens.data_ptr(),
            batch,
            page_table.shape[1],
            page_size,
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
            torch.get_num_threads(),
        )
        return out


@functools.cache
def load_decode_kernel() -> DecodeAttentionKernel | None:
    """Build (once per source and CPU) and load the kernel; None when no C compiler works here."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("no C compiler found: CPU decode attention falls back to PyTorch ops")
        return None
    key = hashlib.sha1("\n".join([_SOURCE, *_FLAGS, compiler, _cpu_flags()]).encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"decode_attention-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            source, built = Path(tmp) / "decode_attention.c", Path(tmp) / "lib.so"
            source.write_text(_SOURCE)
            run = subprocess.run(
                [compiler, *_FLAGS, str(source), "-o", str(built), "-lm"], capture_output=True, text=True
            )
            if run.returncode != 0:
                logger.warning("building the CPU decode kernel failed, using PyTorch ops:\n%s", run.stderr)
                return None
            built.replace(path)  # atomic: concurrent builders each install a complete file
    return DecodeAttentionKernel(ctypes.CDLL(str(path)))


def _cpu_flags() -> str:
    try:
        return next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return ""

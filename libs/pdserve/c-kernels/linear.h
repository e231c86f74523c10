/* A linear layer's packed weight (pdserve.layers.cpu_matmul.MatmulWeight) and the one call that
   multiplies by it in whichever kernel its format needs: what the fused decoder layers
   (decoder.c) and the grouped experts (moe.c) share. */
#ifndef PDSERVE_LINEAR_H
#define PDSERVE_LINEAR_H

#include "common.h"

/* The matmuls of matmul.c. */
int matmul_float(const void*, int64_t, int, int, const void*, const void*, const void*, const float*, void*,
                 int64_t, int, int, int, int, int, int, int);
int matmul_w8a8(const void*, int64_t, int, const int8_t*, const float*, const float*, void*, int64_t, int,
                int, int, int, int, int, int);
int matmul_w4a8(const void*, int64_t, int, const uint8_t*, int, const void*, const void*, const float*, void*,
                int64_t, int, int, int, int, int, int, int);
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define HAS_GEMM_BF16 1 /* gemm.c's AVX512-BF16 kernel is in this variant */
void gemm_bf16(const bf16*, int64_t, const bf16*, const bf16*, void*, int64_t, int, int, int, int, int, int, int);
#else
#define HAS_GEMM_BF16 0
#endif

/* Which matmul a Linear runs: matmul_float (in `format`), matmul_w8a8, matmul_w4a8 (in `planes`), or
   gemm_bf16 (bfloat16 activations, no bias; variants with HAS_GEMM_BF16). */
enum { LINEAR_FLOAT = 0, LINEAR_W8A8 = 1, LINEAR_W4A8 = 2, LINEAR_GEMM_BF16 = 3 };

/* A linear layer's packed weight (pdserve.layers.cpu_matmul.MatmulWeight, or for LINEAR_GEMM_BF16
   pdserve.layers.cpu_gemm.PanelWeight). */
typedef struct {
  int kernel, format, planes, N, K, halves;
  const void *data, *scale, *mins;
  const float* bias;
} Linear;

/* Returns 0, or -1 when out of memory (or a LINEAR_GEMM_BF16 weight in a variant without it). */
INLINE int linear(const Linear* w, const void* x, int64_t lda, void* out, int64_t ldc, int bf16, int T, int silu,
                  int threads) {
  if (w->kernel == LINEAR_GEMM_BF16) {
#if HAS_GEMM_BF16
    gemm_bf16(x, lda, w->data, NULL, out, ldc, 0, T, w->N, w->K, w->halves, silu, threads);
    return 0;
#else
    return -1;
#endif
  }
  if (w->kernel == LINEAR_W8A8)
    return matmul_w8a8(x, lda, bf16, (const int8_t*)w->data, (const float*)w->scale, w->bias, out, ldc, bf16, T,
                       w->N, w->K, w->halves, silu, threads);
  if (w->kernel == LINEAR_W4A8)
    return matmul_w4a8(x, lda, bf16, (const uint8_t*)w->data, w->planes, w->scale, w->mins, w->bias, out, ldc,
                       bf16, T, w->N, w->K, w->halves, silu, threads);
  return matmul_float(x, lda, bf16, w->format, w->data, w->scale, w->mins, w->bias, out, ldc, bf16, T, w->N, w->K,
                      w->halves, silu, threads);
}

#endif

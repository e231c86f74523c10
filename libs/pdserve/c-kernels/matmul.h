/* What the matmul sources share (matmul.c: float and W8A8; w4a8.c: W4A8; amx.c: the tile paths):
   weight panels of NR = 16 output columns, groups of 32 inputs, and the epilogue that stores a
   row's finished sums (see pdserve/layers/cpu_matmul.py). */
#ifndef PDSERVE_MATMUL_H
#define PDSERVE_MATMUL_H

#include "common.h"

#define NR 16
#define GROUP 32 /* grouped formats: inputs per scale */

/* One matmul's arguments (the activations and format only where the kernel reads them from here). */
typedef struct {
  const float* x; /* activations, float32 [M, lda] */
  int64_t lda;
  const char* packed;
  int format;
  const f16 *scale, *mins;   /* W_I4, W_I8G: scale (and W_I4's mins) [N / 16, K / 32, 16] */
  const float* col_scale;    /* W_I8 (also once dequantized into a float32 copy): [N] */
  const float* bias;         /* [N] or NULL */
  void* out;
  int64_t ldc;
  int out_bf16, M, N, K, halves, silu;
} Mat;

/* Output columns of panel n: its first 8 (col0) and last 8 (col1) accumulators. */
INLINE void panel_cols(const Mat* g, int n, int* col0, int* col1) {
  *col0 = g->halves ? n * NR / 2 : n * NR;
  *col1 = g->halves ? g->N / 2 + *col0 : *col0 + NR / 2;
}

/* One row's finished sums v0 (columns col0..col0+7) and v1 (col1..) into out row c. Never inlined:
   one copy of its arithmetic for every tile size, so that no copy fuses a caller's multiply with
   the bias add into an FMA where another does not (a row's result would then depend on the
   number of rows in its tile, i.e. on the batch). */
__attribute__((noinline, unused)) static void store_row_f32(const Mat* g, float v0[8], float v1[8], int col0, int col1, char* c) {
  for (int j = 0; j < 8; ++j) {
    if (g->col_scale) v0[j] *= g->col_scale[col0 + j], v1[j] *= g->col_scale[col1 + j];
    if (g->bias) v0[j] += g->bias[col0 + j], v1[j] += g->bias[col1 + j];
  }
  if (g->out_bf16) {
    bf16* o = (bf16*)c;
    if (g->silu) {
#ifdef __AVX2__
      const __m256 gate = bf16_to_f32_8(round8_bf16(_mm256_loadu_ps(v0)));
      const __m256 up = bf16_to_f32_8(round8_bf16(_mm256_loadu_ps(v1)));
      store8_bf16(o + col0, _mm256_mul_ps(bf16_to_f32_8(round8_bf16(silu256(gate))), up));
#else
      for (int j = 0; j < 8; ++j) {
        const float gate = round_bf16(v0[j]), up = round_bf16(v1[j]);
        o[col0 + j] = f32_to_bf16(round_bf16(gate / (1.f + expf(-gate))) * up);
      }
#endif
    } else {
      for (int j = 0; j < 8; ++j) o[col0 + j] = f32_to_bf16(v0[j]), o[col1 + j] = f32_to_bf16(v1[j]);
    }
  } else {
    float* o = (float*)c;
    if (g->silu) {
#ifdef __AVX2__
      _mm256_storeu_ps(o + col0, _mm256_mul_ps(silu256(_mm256_loadu_ps(v0)), _mm256_loadu_ps(v1)));
#else
      for (int j = 0; j < 8; ++j) o[col0 + j] = v0[j] / (1.f + expf(-v0[j])) * v1[j];
#endif
    } else {
      for (int j = 0; j < 8; ++j) o[col0 + j] = v0[j], o[col1 + j] = v1[j];
    }
  }
}

#endif

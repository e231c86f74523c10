/* The AMX tile kernels of amx.c, for gemm.c and w4a8.c (declared in the `amx` variant only,
   whose compiler flags define __AMX_TILE__). */
#ifndef PDSERVE_AMX_H
#define PDSERVE_AMX_H

#include "common.h"

/* 0 when this process may use the tiles (asked of Linux once), -1 otherwise. */
int amx_enable(void);

#ifdef __AMX_TILE__
enum { AMX_BF16 = 0, AMX_W4A8 = 1 };
#define AMX_ROWS 16 /* rows of an A tile: callers pad their activations to a multiple of it */

void amx_configure(int kind);
void amx_release(void);
void amx_bf16_block(const bf16* x, int64_t lda, const bf16* panel, int64_t K, float sums[32][32]);
typedef void AmxEmit(void* ctx, int n, int64_t m0, float sums[16][16]);
int amx_w4a8_panels(const int8_t* xq, const float* xd, const float* xm, int64_t K, int64_t M, const uint8_t* packed,
                    int planes, const f16* scale, const f16* mins, int lo, int hi, AmxEmit* emit, void* ctx);
#endif

#endif

/* AMX tile kernels (Intel Sapphire Rapids and later; the `amx` variant only): the block sums of
   the bfloat16 panel matmul (gemm.c) and of the W4A8 matmul (w4a8.c), which their callers finish
   with the same epilogues as their vector kernels.

   Determinism: every output element is one row of A against one column of B, and AMX computes
   each element of a C tile from its own row and column alone, so a row's result never depends on
   the other rows of its tile (padding included) or on the batch. The K order is fixed by the shape:
     - bfloat16: chunks of 32 inputs in order, each chunk summed by TDPBF16PS into the float32 C
       tile. TDPBF16PS does not round as VDPBF16PS does (measured: ~74% of elements differ after
       one 32-input chunk), so a bfloat16 matmul whose K allows tiles runs here for every M;
     - W4A8: TDPBSUD gives each group's integer sum exactly, the same integer VPDPBUSD gives, and
       the float epilogue is the vector kernel's, instruction for instruction, so the sums are
       bit-identical to w4a8.c's VNNI tiles and the caller may pick either by M.

   Linux gives a process the tile state only after arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)
   (amx_enable); each thread loads its tile configuration on entry (amx_configure) and releases the
   tiles on exit, so a context switch saves no tile data. */
#define _GNU_SOURCE /* syscall */
#include "amx.h"

#ifdef __AMX_TILE__
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int amx_enable(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) ? -1 : 0; }

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* Tiles 0-3: C (16 rows of 16 int32 / float32); 4-5: A (16 rows of `a_bytes`); 6-7: B (`b_rows`
   rows of 64 bytes). bfloat16: a_bytes 64 (32 inputs), b_rows 16 (input pairs); W4A8: a_bytes 32
   (one group of int8), b_rows 8 (input quads). */
void amx_configure(int kind) {
  TileConfig cfg = {0};
  cfg.palette = 1;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) cfg.rows[t] = 16, cfg.colsb[t] = kind == AMX_BF16 ? 64 : 32;
  for (int t = 6; t < 8; ++t) cfg.rows[t] = kind == AMX_BF16 ? 16 : 8, cfg.colsb[t] = 64;
  __asm__ volatile("" : : "r"(&cfg) : "memory"); /* the intrinsic reads it as another type: keep the stores */
  _tile_loadconfig(&cfg);
}

void amx_release(void) { _tile_release(); }

/* ---- bfloat16: sums [32][32] float32 of rows m0..m0+31 of x (row stride lda elements, 32
   readable rows) times panel `panel` ([K / 2, 32, 2] bfloat16), K a multiple of 32. C tile
   (i, h): rows m0 + 16 i, panel half h (columns 16 h ..). */
void amx_bf16_block(const bf16* x, int64_t lda, const bf16* panel, int64_t K, float sums[32][32]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(4, x + k, lda * 2);
    _tile_loadd(5, x + 16 * lda + k, lda * 2);
    _tile_loadd(6, panel + k * 32, 128);      /* pairs k / 2 .. k / 2 + 15, columns 0-15 */
    _tile_loadd(7, panel + k * 32 + 32, 128); /* the same pairs, columns 16-31 */
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, &sums[0][0], 128);
  _tile_stored(1, &sums[0][16], 128);
  _tile_stored(2, &sums[16][0], 128);
  _tile_stored(3, &sums[16][16], 128);
}

/* ---- W4A8 */

/* The B tiles of one panel (w4a8.c's layout, `planes` 4-bit planes) for every group:
   b [K / 32, 8, 64] bytes, row 2v + h of a group holding inputs 8v + 4h .. 8v + 4h + 3 of each
   of the 16 columns as unsigned bytes (q in 0..15, or q + 128 from two planes). */
static void amx_w4a8_unpack(const uint8_t* panel, int planes, int64_t K, uint8_t* b) {
  __asm__ volatile("" : : : "memory"); /* tile loads of b's previous panel (asm without a memory operand) come first */
  const __m512i low = _mm512_set1_epi8(15);
  for (int64_t g = 0; g < K / 32; ++g)
    for (int v = 0; v < 4; ++v) {
      const __m512i p0 = _mm512_loadu_si512(panel + (g * planes) * 256 + v * 64);
      __m512i lo = _mm512_and_si512(p0, low), hi = _mm512_and_si512(_mm512_srli_epi16(p0, 4), low);
      if (planes == 2) {
        const __m512i p1 = _mm512_loadu_si512(panel + (g * planes + 1) * 256 + v * 64);
        lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(p1, low), 4));
        hi = _mm512_or_si512(hi, _mm512_andnot_si512(_mm512_set1_epi8(15), p1));
      }
      _mm512_storeu_si512(b + g * 512 + (2 * v) * 64, lo);
      _mm512_storeu_si512(b + g * 512 + (2 * v + 1) * 64, hi);
    }
}

/* Group g of the next work item (rows next_m0.., B tiles next_b) into next_isum[g] through C tile
   c, A tile a and B tile bt (two such sets in turn, so one group's tiles load while the other's
   multiply). */
#define W4A8_ISSUE(c, a, bt, g)                                              \
  do {                                                                       \
    _tile_loadd(a, xq + next_m0 * K + (g) * 32, K);                          \
    _tile_loadd(bt, next_b + (g) * 512, 64);                                 \
    _tile_zero(c);                                                           \
    _tile_dpbsud(c, a, bt);                                                  \
    _tile_stored(c, next_isum + (g) * 256, 64);                              \
  } while (0)

/* The AMX path of the W4A8 matmul for panels lo..hi (w4a8.c's layout, `planes` 4-bit planes,
   float16 scales / minimums [N / 16, K / 32, 16]): the quantized activations xq [M padded to 16
   rows, K] with d and d * sum q per group (xd, xm [., K / 32]). Work items are (panel, block of
   16 rows), in order; while item i's epilogue runs group by group (w4a8.c's float steps in its
   order, accumulators in registers), the tiles compute item i + 1's integer sums, so neither
   waits for the other. emit(ctx, n, m0, sums) takes each finished item. Returns 0, or -1 when out
   of memory. */
int amx_w4a8_panels(const int8_t* xq, const float* xd, const float* xm, int64_t K, int64_t M, const uint8_t* packed,
                    int planes, const f16* scale, const f16* mins, int lo, int hi, AmxEmit* emit, void* ctx) {
  const int64_t groups = K / 32, blocks = (M + 15) / 16, items = (hi - lo) * blocks;
  uint8_t* b = aligned_alloc(64, 2 * groups * 512);      /* two panels' B tiles */
  int32_t* isum = aligned_alloc(64, 2 * groups * 1024); /* two items' integer sums */
  if (!b || !isum || !items) {
    free(b), free(isum);
    return items ? -1 : 0;
  }
  amx_configure(AMX_W4A8);
  float sums[16][16] __attribute__((aligned(64)));
  const uint8_t* next_b = b;
  int32_t* next_isum = isum;
  int64_t next_m0 = 0;
  amx_w4a8_unpack(packed + (int64_t)lo * groups * planes * 256, planes, K, b);
  for (int64_t g = 0; g < groups; ++g) {
    if (g & 1) W4A8_ISSUE(1, 5, 7, g);
    else W4A8_ISSUE(0, 4, 6, g);
  }
  for (int64_t i = 0; i < items; ++i) {
    const int n = lo + (int)(i / blocks);
    const int64_t m0 = i % blocks * 16;
    const int32_t* cur = isum + (i & 1) * groups * 256;
    const int more = i + 1 < items;
    if (more) {
      const int next_n = lo + (int)((i + 1) / blocks);
      next_m0 = (i + 1) % blocks * 16;
      next_b = b + ((next_n - lo) & 1) * groups * 512;
      next_isum = isum + ((i + 1) & 1) * groups * 256;
      if (next_m0 == 0) amx_w4a8_unpack(packed + (int64_t)next_n * groups * planes * 256, planes, K, (uint8_t*)next_b);
    }
    const f16 *s = scale + (int64_t)n * groups * 16, *mn = mins + (int64_t)n * groups * 16;
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      if (more && (g & 1)) W4A8_ISSUE(1, 5, 7, g);
      else if (more) W4A8_ISSUE(0, 4, 6, g);
      const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256((const void*)(s + g * 16)));
      const __m512 wm = _mm512_cvtph_ps(_mm256_loadu_si256((const void*)(mn + g * 16)));
      for (int r = 0; r < 16; ++r) { /* w4a8.c's tile_w4a8 float steps, in its order */
        const int64_t at = (m0 + r) * groups + g;
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(cur + g * 256 + r * 16));
        acc[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(ws, _mm512_set1_ps(xd[at])), acc[r]);
        acc[r] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xm[at]), acc[r]);
      }
    }
    for (int r = 0; r < 16; ++r) _mm512_store_ps(sums[r], acc[r]);
    emit(ctx, n, m0, sums);
  }
  amx_release();
  free(b), free(isum);
  return 0;
}

#else
int amx_enable(void) { return -1; }
#endif

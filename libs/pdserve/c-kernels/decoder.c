/* A whole step's decoder layers of a Llama-family model in one call (see
   pdserve/layers/cpu_decoder.py): per layer, the same kernels the modules call one by one from
   Python (add + RMSNorm, the q/k/v matmul, rotary, storing K/V, paged attention (a row per token),
   the o matmul, add + RMSNorm, gate/up with SiLU-and-mul, down), without a Python call, a tensor
   allocation or an argument conversion between them: at batch 1 those cost as much as the
   matmuls' own weight reads. Same kernels, same order, so the same results. */
#include "linear.h"

/* The kernels of the other sources. */
void add_rmsnorm_f32(const float*, int64_t, float*, const float*, float*, int64_t, int64_t, float, int);
void add_rmsnorm_bf16(const bf16*, int64_t, bf16*, const bf16*, bf16*, int64_t, int64_t, float, int);
void rotary_f32(float*, int64_t, int64_t, float*, int64_t, int64_t, int64_t, const float*, const int64_t*,
                int64_t, int);
void rotary_bf16(bf16*, int64_t, int64_t, bf16*, int64_t, int64_t, int64_t, const float*, const int64_t*,
                 int64_t, int);
void store_kv(const char*, int64_t, const char*, int64_t, char*, char*, const int64_t*, int64_t, int64_t, int64_t,
              int, int64_t, int64_t, int);
int decode_attention(int, const void*, int64_t, const void*, const void*, void*, const int64_t*, const int64_t*,
                     const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                     float, const float*, int);

/* One decoder layer: its norms' weights (activation dtype), matmuls, KV pool pages, and the keys its
   attention sees (a sliding window; 0: all). */
typedef struct {
  const void *input_norm, *post_norm;
  Linear qkv, o, gate_up, down;
  void *k_pages, *v_pages;
  int64_t window;
} Layer;

/* The step: T tokens, their positions and KV slots, each a row of the decode-attention kernel (its
   request's pages, row_req [T] into page_table [requests, max_pages], and seq_lens [T] = position +
   1), whether it decodes or is one of an extend's tokens. Activations bfloat16 (bf16) or float32;
   the KV pool bfloat16 (kv_bf16) or float32, float32 only under float32 activations. */
typedef struct {
  int T, bf16, kv_bf16, hidden, num_heads, num_kv_heads, head_dim, intermediate, threads;
  int64_t max_pages, page_size, page_stride; /* page_stride: elements between the pool's pages */
  float eps, scale;
  const float* cos_sin;
  const int64_t *positions, *loc, *page_table, *row_req, *seq_lens;
} Step;

static void norm(const Step* s, const void* x, void* residual, const void* w, void* out) {
  if (s->bf16)
    add_rmsnorm_bf16(x, s->hidden, residual, w, out, s->T, s->hidden, s->eps, s->threads);
  else
    add_rmsnorm_f32(x, s->hidden, residual, w, out, s->T, s->hidden, s->eps, s->threads);
}

/* Attention of the step's T tokens for layer L: q rows in qkv (row stride q_stride elements), out
   [T, num_heads * D] in the kernel's dtype, the pool's. Returns 0, or nonzero when out of memory. */
static int attention(const Layer* L, const Step* s, const char* q, int64_t q_stride, char* out) {
  return decode_attention(s->kv_bf16, q, q_stride, L->k_pages, L->v_pages, out, s->page_table, s->row_req,
                          s->seq_lens, s->T, s->max_pages, s->page_size, s->page_stride, s->num_heads,
                          s->num_kv_heads, s->head_dim, L->window, s->scale, 0.f, NULL, s->threads);
}

/* hidden [T, H]: the embeddings in, the last layer's MLP output out; residual [T, H]: written
   (the running sum the final norm adds). Float32 activations over a bfloat16 pool attend as a
   bfloat16 model does: the queries rounded to bfloat16, the output widened back. Returns 0, or -1
   when a kernel failed (out of memory). */
int decoder_layers(const Layer* layers, int num_layers, const Step* s, void* hidden, void* residual) {
  const int64_t e = s->bf16 ? 2 : 4, T = s->T, D = s->head_dim;
  const int64_t q_size = s->num_heads * D, kv_size = s->num_kv_heads * D, qkv_size = q_size + 2 * kv_size;
  const int narrow = s->kv_bf16 && !s->bf16; /* float32 activations, bfloat16 pool */
  char* normed = malloc(T * s->hidden * e);
  char* qkv = malloc(T * qkv_size * e);
  char* attn = malloc(T * q_size * e);
  char* act = malloc(T * s->intermediate * e);
  bf16 *q16 = narrow ? malloc(T * q_size * 2) : NULL, *attn16 = narrow ? malloc(T * q_size * 2) : NULL;
  if (!normed || !qkv || !attn || !act || (narrow && (!q16 || !attn16))) {
    free(normed), free(qkv), free(attn), free(act), free(q16), free(attn16);
    return -1;
  }
  int failed = 0;
  for (int i = 0; i < num_layers; ++i) {
    const Layer* L = layers + i;
    if (i == 0) { /* the first layer's residual is its input */
      memcpy(residual, hidden, T * s->hidden * e);
      norm(s, hidden, NULL, L->input_norm, normed);
    } else {
      norm(s, hidden, residual, L->input_norm, normed);
    }
    if ((failed = linear(&L->qkv, normed, s->hidden, qkv, qkv_size, s->bf16, s->T, 0, s->threads))) break;
    char *q = qkv, *k = qkv + q_size * e, *v = k + kv_size * e;
    if (s->bf16)
      rotary_bf16((bf16*)q, qkv_size, s->num_heads, (bf16*)k, qkv_size, s->num_kv_heads, D, s->cos_sin,
                  s->positions, T, s->threads);
    else
      rotary_f32((float*)q, qkv_size, s->num_heads, (float*)k, qkv_size, s->num_kv_heads, D, s->cos_sin,
                 s->positions, T, s->threads);
    store_kv(k, qkv_size * e, v, qkv_size * e, L->k_pages, L->v_pages, s->loc, T, kv_size, e, narrow,
             s->page_size, s->page_stride * (s->kv_bf16 ? 2 : 4), s->threads);
    if (narrow) {
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < q_size; ++j) q16[t * q_size + j] = f32_to_bf16(((const float*)q)[t * qkv_size + j]);
      if ((failed = attention(L, s, (const char*)q16, q_size, (char*)attn16))) break;
      for (int64_t j = 0; j < T * q_size; ++j) ((float*)attn)[j] = bf16_to_f32(attn16[j]);
    } else if ((failed = attention(L, s, q, qkv_size, attn))) {
      break;
    }
    if ((failed = linear(&L->o, attn, q_size, hidden, s->hidden, s->bf16, s->T, 0, s->threads))) break;
    norm(s, hidden, residual, L->post_norm, normed);
    if ((failed = linear(&L->gate_up, normed, s->hidden, act, s->intermediate, s->bf16, s->T, 1, s->threads) ||
                  linear(&L->down, act, s->intermediate, hidden, s->hidden, s->bf16, s->T, 0, s->threads)))
      break;
  }
  free(normed), free(qkv), free(attn), free(act), free(q16), free(attn16);
  return failed ? -1 : 0;
}

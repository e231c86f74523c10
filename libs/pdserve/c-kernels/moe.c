/* The experts of one mixture-of-experts layer, everything after the router in one call (see
   pdserve/layers/moe/cpu_experts.py): at decode batch sizes a Python call and two matmul calls per
   active expert, plus the sort, gather, scale and scatter around them, cost more than the experts'
   own arithmetic (Qwen3-30B-A3B's shape: ~100 of 128 experts active in a batch of 16, a few rows
   each). */
#include "linear.h"

/* Slot s = t * k + j is token t's j-th routed expert ids[s] (global id; this rank holds experts
   [first_expert, first_expert + num_experts), the others' slots are skipped). Counting sort of the
   held slots by expert, tokens in order within an expert: order[offsets[e] .. offsets[e + 1]). */
static void sort_slots(const int64_t* ids, int64_t slots, int64_t first_expert, int64_t num_experts,
                       int64_t* offsets, int64_t* order) {
  memset(offsets, 0, sizeof(int64_t) * (num_experts + 1));
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t e = ids[s] - first_expert;
    if (e >= 0 && e < num_experts) ++offsets[e + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  int64_t* next = malloc(sizeof(int64_t) * (num_experts + 1));
  memcpy(next, offsets, sizeof(int64_t) * (num_experts + 1));
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t e = ids[s] - first_expert;
    if (e >= 0 && e < num_experts) order[next[e]++] = s;
  }
  free(next);
}

/* out [T, hidden] = for each token, the sum over its held experts e, in ascending id, of
   weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t): gate_up[e] packed in halves (SiLU-and-mul in
   its epilogue), down[e]. x and out in the activation dtype (bfloat16 with is_bf16, else float32);
   ids int64 and weights float32 [T, k]. In bfloat16 each expert's output and each weighted term are
   rounded, and each add, as Hugging Face's loop over experts rounds them (index_add_ into a bfloat16
   sum), so a token's result depends on its own experts only. The experts are the work items of
   one parallel region, scheduled dynamically (their row counts differ); each gathers its rows and
   runs its two matmuls alone on its thread, so an expert's weights are read once, by one core.
   Returns 0, or -1 when out of memory (out then incomplete). */
int moe_experts(const Linear* gate_up, const Linear* down, int64_t first_expert, int64_t num_experts,
                const int64_t* ids, const float* weights, int64_t T, int64_t k, const void* x, void* out,
                int is_bf16, int64_t hidden, int64_t intermediate, int threads) {
  const int64_t esize = is_bf16 ? 2 : 4, row_bytes = hidden * esize;
  int64_t* offsets = malloc(sizeof(int64_t) * (num_experts + 1));
  int64_t* order = malloc(sizeof(int64_t) * (T * k + 1));
  int64_t* where = malloc(sizeof(int64_t) * (T * k + 1)); /* slot -> its row of y, or -1 */
  char* y = malloc(T * k * row_bytes + 1);                 /* each held slot's expert output */
  if (!offsets || !order || !where || !y) {
    free(offsets), free(order), free(where), free(y);
    return -1;
  }
  sort_slots(ids, T * k, first_expert, num_experts, offsets, order);
  int64_t most = 0;
  for (int64_t e = 0; e < num_experts; ++e)
    most = offsets[e + 1] - offsets[e] > most ? offsets[e + 1] - offsets[e] : most;
  for (int64_t s = 0; s < T * k; ++s) where[s] = -1;
  for (int64_t i = 0; i < offsets[num_experts]; ++i) where[order[i]] = i;
  int failed = 0;
  #pragma omp parallel num_threads(threads)
  {
    char *rows = malloc(most * row_bytes + 1), *act = malloc(most * intermediate * esize + 1);
    float* sum = malloc(sizeof(float) * hidden);
    if (!rows || !act || !sum) {
      #pragma omp atomic write
      failed = 1;
    }
    #pragma omp for schedule(dynamic)
    for (int64_t e = 0; e < num_experts; ++e) {
      const int64_t first = offsets[e], n = offsets[e + 1] - first;
      if (!rows || !act || !sum || !n) continue; /* every thread still takes part in the worksharing loops */
      for (int64_t i = 0; i < n; ++i)
        memcpy(rows + i * row_bytes, (const char*)x + order[first + i] / k * row_bytes, row_bytes);
      if (linear(&gate_up[e], rows, hidden, act, intermediate, is_bf16, (int)n, 1, 1) ||
          linear(&down[e], act, intermediate, y + first * row_bytes, hidden, is_bf16, (int)n, 0, 1)) {
        #pragma omp atomic write
        failed = 1;
      }
    }
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      if (!rows || !act || !sum) continue;
      for (int64_t h = 0; h < hidden; ++h) sum[h] = 0.f;
      int64_t done = -1; /* the slots of t in ascending expert id: selection over its k slots */
      for (int64_t pass = 0; pass < k; ++pass) {
        int64_t next = -1;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t s = t * k + j;
          if (where[s] < 0 || (done >= 0 && ids[s] <= ids[done])) continue;
          if (next < 0 || ids[s] < ids[next]) next = s;
        }
        if (next < 0) break;
        done = next;
        const char* yrow = y + where[next] * row_bytes;
        const float w = weights[next];
        if (is_bf16) {
          const bf16* yb = (const bf16*)yrow;
          for (int64_t h = 0; h < hidden; ++h) sum[h] = round_bf16(sum[h] + round_bf16(bf16_to_f32(yb[h]) * w));
        } else {
          const float* yf = (const float*)yrow;
          for (int64_t h = 0; h < hidden; ++h) sum[h] += yf[h] * w;
        }
      }
      char* o = (char*)out + t * row_bytes;
      if (is_bf16)
        for (int64_t h = 0; h < hidden; ++h) ((bf16*)o)[h] = f32_to_bf16(sum[h]);
      else
        memcpy(o, sum, row_bytes);
    }
    free(rows), free(act), free(sum);
  }
  free(offsets), free(order), free(where), free(y);
  return failed ? -1 : 0;
}

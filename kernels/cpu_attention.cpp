// Paged decode attention for x86-64 with AVX2 + FMA, float32; built by kernels/native.py.
//
// The same contract as kernels/numba_kernels.py (paged_decode): sequence i's single query
// row q[rows[i]] ([Hq, D]) attends to its context_lens[i] cached positions, position p
// living at k_cache[tables[i, p / block_size], p % block_size] ([Hkv, D]); query head j
// reads KV head j / (Hq / Hkv) (GQA). Writes out[rows[i]] and nothing else.
//
// Why not numba: its dot products end in one horizontal sum per key, and its accumulators
// live in memory. Here 8 keys' dot products are reduced together (one transposing hadd
// tree per 8 keys), the score pass keeps a K block in L1 while every query head of the
// group reads it, and the V pass keeps a head's output in registers for a whole block.
//
// Two passes per sequence: all scores first ([Hq, ctx], 18 KiB at 512 positions), one exact
// softmax over them, then the weighted sum of V — no online rescaling. Threads: one OpenMP
// task per sequence (dynamic, chunk 1: context lengths differ). The OpenMP calls bind to
// torch's libgomp (kernels/numba_kernels.py promotes it to global scope before this
// library loads), so torch, numba and this kernel share one pool of workers.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// exp(x) for x <= 0, 8 lanes: 2^k * 2^f, |f| <= 1/2, degree-6 polynomial for 2^f
// (relative error ~1e-7); x below -87 clamps (exp(-87) ~ 1e-38 is still normal).
inline __m256 exp_nonpos(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 v = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));  // log2(e)
  __m256 k = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_sub_ps(v, k);
  __m256 p = _mm256_set1_ps(0.0001540353f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.001333355f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.009618129f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.05550411f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.2402265f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.6931472f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);  // 2.0f ** k
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// exp(x) for x <= 0 to ~1 ulp at any magnitude (SwiGLU needs it for large |x|, where
// exp_nonpos's x * log2(e) loses ~|x| * 6e-8 of the exponent): Cody-Waite reduction
// x = k ln2 + r, |r| <= ln2 / 2, with ln2 split in two, then a degree-7 Taylor series of
// e^r. x below -87 clamps, as exp_nonpos.
inline __m256 exp_nonpos_exact(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);  // ln2's high part
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);  // and its low part
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);  // 2.0f ** k
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// Lane t of the result = the sum of a[t]'s 8 lanes.
inline __m256 hsum8(const __m256 a[8]) {
  __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Pool element types: float32, or 16-bit (--kv-cache-dtype) widened to float32 on load.
struct Half { uint16_t bits; };   // IEEE float16 (F16C converts)
struct BHalf { uint16_t bits; };  // bfloat16: the top half of a float32

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const BHalf* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 1
#endif

// Streams block table[b + PREFETCH_BLOCKS] of a pool into cache while block b is computed,
// a few lines at a time: blocks sit anywhere in the pool, so the hardware prefetcher cannot
// guess the next one, and a burst of a whole block's prefetches would stall the core on
// its miss buffers just as a demand miss does. One block ahead, not two: 5-8 % faster at
// batch 32 / context 192 and batch 64 / 512 (fp32, 2 threads, alternating builds in one
// process, 2026-12-02); 4 and 8 ahead were slower still, none 40 % slower.
struct Prefetcher {
  const char* next = nullptr;
  const char* end = nullptr;
  template <typename T>
  void start(const T* pool, const int64_t* table, int64_t b, int64_t num_blocks,
             int64_t block_elems) {
    if (b + PREFETCH_BLOCKS >= num_blocks) {
      next = end = nullptr;
      return;
    }
    next = reinterpret_cast<const char*>(pool + table[b + PREFETCH_BLOCKS] * block_elems);
    end = next + block_elems * sizeof(T);
  }
  void step(int lines) {
    for (; lines > 0 && next < end; --lines, next += 64) _mm_prefetch(next, _MM_HINT_T0);
  }
};

struct Shape {
  int64_t num_heads, num_kv_heads, block_size, table_stride;
};

// Prefetches per inner step of either pass, so a block's lines are requested over the
// computation of the block before it: lines of a block / (query heads x 8-key tiles).
inline int prefetch_lines(const Shape& s, int64_t row_bytes) {
  const int64_t steps = s.num_heads * ((s.block_size + 7) / 8);
  return int((s.block_size * row_bytes / 64 + steps - 1) / steps);
}

// scores[j * ctx + p] = q[j] . k[p] (q pre-scaled), for every query head j.  DV = D / 8.
template <int DV, typename T>
void score_pass(const float* qs, const T* k_cache, const int64_t* table, int64_t ctx,
                const Shape& s, float* scores) {
  const int64_t group = s.num_heads / s.num_kv_heads, row = s.num_kv_heads * DV * 8;
  const int64_t num_blocks = (ctx + s.block_size - 1) / s.block_size;
  const int lines = prefetch_lines(s, row * int64_t(sizeof(T)));
  Prefetcher pf;
  for (int64_t b = 0; b < num_blocks; ++b) {
    pf.start(k_cache, table, b, num_blocks, s.block_size * row);
    const T* block = k_cache + table[b] * s.block_size * row;
    const int64_t p0 = b * s.block_size, n = std::min(s.block_size, ctx - p0);
    for (int64_t h = 0; h < s.num_kv_heads; ++h) {
      const T* kh = block + h * DV * 8;
      for (int64_t j = h * group; j < (h + 1) * group; ++j) {
        const float* qj = qs + j * DV * 8;
        float* out = scores + j * ctx + p0;
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) {  // 8 keys at once, reduced together
          pf.step(lines);
          __m256 acc[8];
          for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
          for (int d = 0; d < DV; ++d) {
            __m256 qv = _mm256_loadu_ps(qj + d * 8);
            for (int u = 0; u < 8; ++u)
              acc[u] = _mm256_fmadd_ps(qv, load8(kh + (t + u) * row + d * 8), acc[u]);
          }
          _mm256_storeu_ps(out + t, hsum8(acc));
        }
        for (; t < n; ++t) {  // the tail of a partly filled block
          __m256 acc = _mm256_setzero_ps();
          for (int d = 0; d < DV; ++d)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(qj + d * 8),
                                  load8(kh + t * row + d * 8), acc);
          out[t] = hsum(acc);
        }
      }
    }
  }
}

// scores[j] <- softmax(scores[j]) for each head, in place; exact max, then exp and sum.
// stats (when not null): [2 j] = head j's max score, [2 j + 1] = its sum of exponentials.
void softmax_rows(float* scores, int64_t num_heads, int64_t ctx, float* stats = nullptr) {
  for (int64_t j = 0; j < num_heads; ++j) {
    float* x = scores + j * ctx;
    float top = -INFINITY;
    for (int64_t p = 0; p < ctx; ++p) top = std::max(top, x[p]);
    const __m256 top8 = _mm256_set1_ps(top);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t p = 0;
    for (; p + 8 <= ctx; p += 8) {
      __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(x + p), top8));
      _mm256_storeu_ps(x + p, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum(sum8);
    if (p < ctx) {  // the tail through a padded copy, same polynomial
      alignas(32) float tail[8];
      for (int u = 0; u < 8; ++u) tail[u] = p + u < ctx ? x[p + u] - top : -87.0f;
      _mm256_store_ps(tail, exp_nonpos(_mm256_load_ps(tail)));
      for (int64_t u = 0; p + u < ctx; ++u) {
        x[p + u] = tail[u];
        sum += tail[u];
      }
    }
    const float inv = 1.0f / sum;
    for (p = 0; p < ctx; ++p) x[p] *= inv;
    if (stats != nullptr) stats[2 * j] = top, stats[2 * j + 1] = sum;
  }
}

// out[j] = sum_p weights[j * ctx + p] * v[p], head by head; out [Hq, D].
template <int DV, typename T>
void value_pass(const float* weights, const T* v_cache, const int64_t* table, int64_t ctx,
                const Shape& s, float* out) {
  const int64_t group = s.num_heads / s.num_kv_heads, row = s.num_kv_heads * DV * 8;
  memset(out, 0, sizeof(float) * s.num_heads * DV * 8);
  const int64_t num_blocks = (ctx + s.block_size - 1) / s.block_size;
  const int lines = prefetch_lines(s, row * int64_t(sizeof(T)));
  Prefetcher pf;
  for (int64_t b = 0; b < num_blocks; ++b) {
    pf.start(v_cache, table, b, num_blocks, s.block_size * row);
    const T* block = v_cache + table[b] * s.block_size * row;
    const int64_t p0 = b * s.block_size, n = std::min(s.block_size, ctx - p0);
    for (int64_t h = 0; h < s.num_kv_heads; ++h) {
      const T* vh = block + h * DV * 8;
      for (int64_t j = h * group; j < (h + 1) * group; ++j) {
        const float* w = weights + j * ctx + p0;
        float* oj = out + j * DV * 8;
        __m256 acc[DV];
        for (int d = 0; d < DV; ++d) acc[d] = _mm256_loadu_ps(oj + d * 8);
        for (int64_t t = 0; t < n; ++t) {
          if (t % 8 == 0) pf.step(lines);
          __m256 wt = _mm256_set1_ps(w[t]);
          for (int d = 0; d < DV; ++d)
            acc[d] = _mm256_fmadd_ps(wt, load8(vh + t * row + d * 8), acc[d]);
        }
        for (int d = 0; d < DV; ++d) _mm256_storeu_ps(oj + d * 8, acc[d]);
      }
    }
  }
}

template <int DV, typename T>
void attend(const float* q, const T* k_cache, const T* v_cache, const int64_t* table,
            int64_t ctx, const Shape& s, float scale, float* out, std::vector<float>& scratch,
            float* stats) {
  const int64_t dim = DV * 8;
  scratch.resize(s.num_heads * (dim + ctx));
  float* qs = scratch.data();  // [Hq, D], pre-scaled
  float* scores = qs + s.num_heads * dim;  // [Hq, ctx]
  for (int64_t i = 0; i < s.num_heads * dim; ++i) qs[i] = q[i] * scale;
  score_pass<DV, T>(qs, k_cache, table, ctx, s, scores);
  softmax_rows(scores, s.num_heads, ctx, stats);
  value_pass<DV, T>(scores, v_cache, table, ctx, s, out);
}

// Rows r[0..7] (8 lanes each) become columns: r[j] lane i <- old r[i] lane j.
inline void transpose8(__m256 r[8]) {
  __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20), r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20), r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20), r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20), r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// One head of rope_qkv_f32 (rope: rotate-half RoPE, else a plain copy) for tokens
// [t0, t0 + n), n <= 8: x [D, T] hidden-major rows -> out[t * out_row + d]. No FMA
// contraction here (GCC would fuse the intrinsics' multiply and add otherwise).
__attribute__((optimize("fp-contract=off"))) void head_rows(const float* x, const float* cos, const float* sin, bool rope, int64_t dim,
               int64_t tokens, int64_t t0, int64_t n, float* out, int64_t out_row) {
  const int64_t half = dim / 2;
  if (n == 8) {
    for (int64_t d0 = 0; d0 < dim; d0 += 8) {
      __m256 r[8];
      for (int64_t i = 0; i < 8; ++i) {
        const int64_t d = d0 + i, at = d * tokens + t0;
        r[i] = _mm256_loadu_ps(x + at);
        if (rope) {  // mul then add / sub, never an FMA: the same rounding as torch's ops
          const int64_t partner = (d < half ? d + half : d - half) * tokens + t0;
          const __m256 a = _mm256_mul_ps(r[i], _mm256_loadu_ps(cos + at));
          const __m256 b = _mm256_mul_ps(_mm256_loadu_ps(x + partner), _mm256_loadu_ps(sin + at));
          r[i] = d < half ? _mm256_sub_ps(a, b) : _mm256_add_ps(a, b);
        }
      }
      transpose8(r);
      for (int64_t j = 0; j < 8; ++j) _mm256_storeu_ps(out + (t0 + j) * out_row + d0, r[j]);
    }
    return;
  }
  for (int64_t t = t0; t < t0 + n; ++t)
    for (int64_t d = 0; d < dim; ++d) {
      const int64_t at = d * tokens + t;
      __m128 v = _mm_set_ss(x[at]);
      if (rope) {
        const int64_t partner = (d < half ? d + half : d - half) * tokens + t;
        const __m128 a = _mm_mul_ss(v, _mm_set_ss(cos[at]));
        const __m128 b = _mm_mul_ss(_mm_set_ss(x[partner]), _mm_set_ss(sin[at]));
        v = d < half ? _mm_sub_ss(a, b) : _mm_add_ss(a, b);
      }
      out[t * out_row + d] = _mm_cvtss_f32(v);
    }
}

template <typename T>
using AttendFn = void (*)(const float*, const T*, const T*, const int64_t*, int64_t,
                          const Shape&, float, float*, std::vector<float>&, float*);

// Contexts longer than this many positions are attended in parts of this size (whole blocks),
// each part a task of its own, and the parts' outputs merged by their softmax statistics
// (flash-decoding's split): one long sequence then keeps every thread busy instead of one.
// The split depends on the sequence's own length only, never on the batch, so a sequence's
// output does not depend on what else is in the step.
constexpr int64_t kSplitPositions = 2048;

// out [Hq, D] = the parts' outputs [parts][Hq, D], weighted by each part's share of the
// softmax mass: sum_j exp(m_j - M) l_j o_j / sum_j exp(m_j - M) l_j, per head.
void merge_parts(const float* outs, const float* stats, int64_t parts, int64_t num_heads,
                 int64_t dim, float* out) {
  for (int64_t h = 0; h < num_heads; ++h) {
    float top = -INFINITY;
    for (int64_t j = 0; j < parts; ++j) top = std::max(top, stats[j * 2 * num_heads + 2 * h]);
    float total = 0.0f;
    for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = 0.0f;
    for (int64_t j = 0; j < parts; ++j) {
      const float* st = stats + j * 2 * num_heads + 2 * h;
      const float w = std::exp(st[0] - top) * st[1];
      total += w;
      const float* o = outs + (j * num_heads + h) * dim;
      for (int64_t d = 0; d < dim; ++d) out[h * dim + d] += w * o[d];
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < dim; ++d) out[h * dim + d] *= inv;
  }
}

template <typename T>
void paged_decode(const float* q, const T* k_cache, const T* v_cache, const int64_t* rows,
                  const int64_t* tables, int64_t table_stride, const int64_t* context_lens,
                  int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                  int64_t head_dim, float scale, float* out, int num_threads) {
  static const AttendFn<T> by_dv[17] = {
      nullptr,         attend<1, T>,  attend<2, T>,  attend<3, T>,  attend<4, T>,
      attend<5, T>,    attend<6, T>,  attend<7, T>,  attend<8, T>,  attend<9, T>,
      attend<10, T>,   attend<11, T>, attend<12, T>, attend<13, T>, attend<14, T>,
      attend<15, T>,   attend<16, T>};
  const AttendFn<T> fn = by_dv[head_dim / 8];
  const Shape s{num_heads, num_kv_heads, block_size, table_stride};
  const int64_t q_row = num_heads * head_dim;
  // Tasks: (sequence, first part, parts); a long sequence's parts write into `partial`
  // (outputs, then statistics) at its offset, and are merged once all tasks are done.
  const int64_t part_blocks = std::max<int64_t>(1, kSplitPositions / block_size);
  const int64_t part_len = part_blocks * block_size;
  struct Task { int64_t seq, part, slot; };  // part -1: the whole sequence
  struct Split { int64_t seq, first_slot, parts; };
  std::vector<Task> tasks;
  std::vector<Split> split;
  int64_t slots = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t parts = context_lens[i] > kSplitPositions
                              ? (context_lens[i] + part_len - 1) / part_len : 1;
    if (parts == 1) {
      tasks.push_back({i, -1, 0});
      continue;
    }
    split.push_back({i, slots, parts});
    for (int64_t j = 0; j < parts; ++j) tasks.push_back({i, j, slots + j});
    slots += parts;
  }
  std::vector<float> partial(slots * num_heads * (head_dim + 2));
  float* part_out = partial.data();
  float* part_stats = part_out + slots * q_row;
  const int64_t num_tasks = tasks.size(), num_split = split.size();
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < num_tasks; ++u) {
      const Task& task = tasks[u];
      const int64_t i = task.seq;
      const int64_t* table = tables + i * table_stride;
      if (task.part < 0) {
        fn(q + rows[i] * q_row, k_cache, v_cache, table, context_lens[i], s, scale,
           out + rows[i] * q_row, scratch, nullptr);
        continue;
      }
      const int64_t p0 = task.part * part_len;
      fn(q + rows[i] * q_row, k_cache, v_cache, table + task.part * part_blocks,
         std::min(part_len, context_lens[i] - p0), s, scale, part_out + task.slot * q_row,
         scratch, part_stats + task.slot * 2 * num_heads);
    }
#pragma omp for schedule(static)
    for (int64_t u = 0; u < num_split; ++u) {
      const Split& sp = split[u];
      merge_parts(part_out + sp.first_slot * q_row, part_stats + sp.first_slot * 2 * num_heads,
                  sp.parts, num_heads, head_dim, out + rows[sp.seq] * q_row);
    }
  }
}

}  // namespace

extern "C" {

// 1 if head_dim is one this library was built for (8 .. 128 in steps of 8), else 0.
int paged_decode_supports(int64_t head_dim) {
  return head_dim % 8 == 0 && head_dim >= 8 && head_dim <= 128;
}

// q [T, Hq, D], out [T, Hq, D] float32 contiguous; k_cache, v_cache [num_blocks, block_size,
// Hkv, D] contiguous, of element type `kind` (0 float32, 1 float16, 2 bfloat16); rows,
// context_lens [num_seqs], tables [num_seqs, table_stride] int64. Runs on num_threads
// OpenMP threads (1: in the calling thread).
void paged_decode_kv(const float* q, const void* k_cache, const void* v_cache,
                     const int64_t* rows, const int64_t* tables, int64_t table_stride,
                     const int64_t* context_lens, int64_t num_seqs, int64_t num_heads,
                     int64_t num_kv_heads, int64_t block_size, int64_t head_dim, float scale,
                     float* out, int num_threads, int kind) {
#define CONTINUUM_DECODE(T)                                                                  \
  paged_decode<T>(q, static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), rows,  \
                  tables, table_stride, context_lens, num_seqs, num_heads, num_kv_heads,      \
                  block_size, head_dim, scale, out, num_threads)
  if (kind == 1) {
    CONTINUUM_DECODE(Half);
  } else if (kind == 2) {
    CONTINUUM_DECODE(BHalf);
  } else {
    CONTINUUM_DECODE(float);
  }
#undef CONTINUUM_DECODE
}

// RMSNorm over the hidden axis of hidden-major activations (executor_svc/model.py), fused
// with the residual add before it: x += delta (when delta is not null), then
// out[h, t] = w[h] * (x[h, t] / sqrt(mean_h x[h, t]^2 + eps)). x, delta, out [H, T], w [H],
// float32 contiguous. One call instead of the ~8 torch ops, each of which opened an OpenMP
// region. One thread below kParallelTokens tokens (a decode step's [576, 64] is ~40 us);
// from there the tokens are split between OpenMP's threads (a 2,048-token prefill chunk took
// ~4 ms a call on one core). Each token's sum runs over h in the same order either way: the
// same bits.
constexpr int64_t kParallelTokens = 256;

void add_rms_norm_f32(float* x, const float* delta, const float* w, float* out, int64_t hidden,
                      int64_t tokens, float eps) {
#pragma omp parallel if (tokens >= kParallelTokens)
  {
    const int64_t parts = omp_get_num_threads(), per = (tokens + parts - 1) / parts;
    const int64_t t0 = std::min(tokens, omp_get_thread_num() * per);
    const int64_t t1 = std::min(tokens, t0 + per);
    if (delta != nullptr)
      for (int64_t h = 0; h < hidden; ++h)
        for (int64_t t = t0; t < t1; ++t) x[h * tokens + t] += delta[h * tokens + t];
    std::vector<float> scale(t1 - t0, 0.0f);
    for (int64_t h = 0; h < hidden; ++h)
      for (int64_t t = t0; t < t1; ++t) scale[t - t0] += x[h * tokens + t] * x[h * tokens + t];
    for (int64_t t = t0; t < t1; ++t)
      scale[t - t0] = 1.0f / std::sqrt(scale[t - t0] / static_cast<float>(hidden) + eps);
    for (int64_t h = 0; h < hidden; ++h)
      for (int64_t t = t0; t < t1; ++t)
        out[h * tokens + t] = w[h] * (x[h * tokens + t] * scale[t - t0]);
  }
}

// The SwiGLU activation: out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)) as
// torch's (rounded to float, then multiplied). e = exp(-|g|) never overflows: g >= 0 gives
// g / (1 + e), g < 0 g e / (1 + e). Within a few ulp of torch's SiLU (silu(-inf) is -inf
// here, NaN in torch). One pass instead of torch's two (silu_, mul_); both threads for a
// decode step's [1536, 64].
void silu_mul_f32(const float* gate, const float* up, float* out, int64_t n, int num_threads) {
  const int64_t vectors = n / 8;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  auto eight = [&](__m256 g, __m256 u) {
    const __m256 e = exp_nonpos_exact(_mm256_or_ps(g, sign));  // exp(-|g|)
    const __m256 num = _mm256_blendv_ps(_mm256_mul_ps(g, e), g,
                                        _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
    return _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(one, e)), u);
  };
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && n >= 16384) \
    schedule(static)
  for (int64_t b = 0; b < vectors; ++b)
    _mm256_storeu_ps(out + 8 * b,
                     eight(_mm256_loadu_ps(gate + 8 * b), _mm256_loadu_ps(up + 8 * b)));
  if (const int64_t rest = n - vectors * 8) {  // the tail through padded copies, same math
    alignas(32) float g[8] = {}, u[8] = {};
    memcpy(g, gate + vectors * 8, rest * sizeof(float));
    memcpy(u, up + vectors * 8, rest * sizeof(float));
    _mm256_store_ps(g, eight(_mm256_load_ps(g), _mm256_load_ps(u)));
    memcpy(out + vectors * 8, g, rest * sizeof(float));
  }
}

// A layer's fused q/k/v projection output -> the token-major rows attention and the KV
// cache take, RoPE applied to q and k: qkv [(Hq + 2 Hkv) D, T] hidden-major (q heads, k
// heads, v heads), cos / sin [D, T]; q_out [T, Hq, D], k_out / v_out [T, Hkv, D]. The same
// values as executor_svc/model.py's apply_rope + copies (separate multiply and add, as
// torch), in one call instead of ~8 ops. head_dim a multiple of 8. One thread below
// kParallelTokens tokens; from there the 8-token groups, which write disjoint rows, are
// split between OpenMP's threads (a 2,048-token chunk took ~6 ms a layer on one core).
void rope_qkv_f32(const float* qkv, const float* cos, const float* sin, float* q_out,
                  float* k_out, float* v_out, int64_t num_heads, int64_t num_kv_heads,
                  int64_t head_dim, int64_t tokens) {
  const int64_t head = head_dim * tokens;
#pragma omp parallel for if (tokens >= kParallelTokens) schedule(static)
  for (int64_t t0 = 0; t0 < tokens; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, tokens - t0);
    for (int64_t h = 0; h < num_heads; ++h)
      head_rows(qkv + h * head, cos, sin, true, head_dim, tokens, t0, n, q_out + h * head_dim,
                num_heads * head_dim);
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      head_rows(qkv + (num_heads + h) * head, cos, sin, true, head_dim, tokens, t0, n,
                k_out + h * head_dim, num_kv_heads * head_dim);
      head_rows(qkv + (num_heads + num_kv_heads + h) * head, cos, sin, false, head_dim, tokens,
                t0, n, v_out + h * head_dim, num_kv_heads * head_dim);
    }
  }
}

// A step's K and V rows (float32) into their cache slots: k_pool[slots[t]] = k[t], the
// same for v; rows of `row` elements ([Hkv, D]); the pools of element type `kind` (0 float32,
// 1 float16, 2 bfloat16: rounded to nearest even, as torch's .to()). Returns the number of
// slots outside [0, num_slots) (nothing is written then: the caller raises). One thread: a
// decode step writes 64 x 768 B.
int64_t kv_write_kv(const float* k, const float* v, void* k_pool, void* v_pool,
                    const int64_t* slots, int64_t tokens, int64_t row, int64_t num_slots,
                    int kind) {
  int64_t bad = 0;
  for (int64_t t = 0; t < tokens; ++t) bad += slots[t] < 0 || slots[t] >= num_slots;
  if (bad) return bad;
  if (kind == 1 || kind == 2) {
    for (int64_t t = 0; t < tokens; ++t)
      for (int side = 0; side < 2; ++side) {
        const float* src = (side ? v : k) + t * row;
        uint16_t* dst = static_cast<uint16_t*>(side ? v_pool : k_pool) + slots[t] * row;
        int64_t i = 0;
        if (kind == 1)
          for (; i + 8 <= row; i += 8)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < row; ++i) {
          if (kind == 1) {
            dst[i] = static_cast<uint16_t>(_cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT));
            continue;
          }
          uint32_t bits;
          memcpy(&bits, src + i, 4);
          dst[i] = std::isnan(src[i]) ? 0x7FC0
                                      : static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
        }
      }
    return 0;
  }
  float* kf = static_cast<float*>(k_pool);
  float* vf = static_cast<float*>(v_pool);
  // Whole 64-byte lines go out as streaming stores: no read-for-ownership of pool lines that
  // are about to be overwritten (the copy is bound by those misses, not by bandwidth).
  const bool stream = row % 16 == 0 && reinterpret_cast<uintptr_t>(kf) % 64 == 0 &&
                      reinterpret_cast<uintptr_t>(vf) % 64 == 0;
  for (int64_t t = 0; t < tokens; ++t) {
    float* kd = kf + slots[t] * row;
    float* vd = vf + slots[t] * row;
    if (!stream) {
      memcpy(kd, k + t * row, row * sizeof(float));
      memcpy(vd, v + t * row, row * sizeof(float));
      continue;
    }
    for (int64_t i = 0; i < row; i += 8) {
      _mm256_stream_ps(kd + i, _mm256_loadu_ps(k + t * row + i));
      _mm256_stream_ps(vd + i, _mm256_loadu_ps(v + t * row + i));
    }
  }
  _mm_sfence();
  return 0;
}

}  // extern "C"

// Paged decode attention for x86-64 with AVX2 + FMA, float32; built by kernels/native.py.
//
// The same contract as kernels/numba_kernels.py (paged_decode): sequence i's single query
// row q[rows[i]] ([Hq, D]) attends to its context_lens[i] cached positions, position p
// living at k_cache[tables[i, p / block_size], p % block_size] ([Hkv, D]); query head j
// reads KV head j / (Hq / Hkv) (GQA). Writes out[rows[i]] and nothing else. With a sliding
// window W > 0 (kernels/attention.py: the query at position ctx - 1 sees positions
// > ctx - 1 - W) only positions [max(0, ctx - W), ctx) are read: the blocks wholly before
// the window are skipped, never touched, and the first block is read from the window's
// first slot on. W = 0 is full attention, the same loops with a first position of 0.
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

// The slots [t0, t0 + n) of block b that positions [lo, hi) cover.
struct BlockRange {
  int64_t t0, n;
  BlockRange(int64_t b, int64_t block_size, int64_t lo, int64_t hi)
      : t0(std::max<int64_t>(0, lo - b * block_size)),
        n(std::min(block_size, hi - b * block_size) - t0) {}
};

// scores[j * (hi - lo) + p - lo] = q[j] . k[p] (q pre-scaled) for positions p in [lo, hi),
// every query head j; the blocks before lo's are not read.  DV = D / 8.
template <int DV, typename T>
void score_pass(const float* qs, const T* k_cache, const int64_t* table, int64_t lo,
                int64_t hi, const Shape& s, float* scores) {
  const int64_t group = s.num_heads / s.num_kv_heads, row = s.num_kv_heads * DV * 8;
  const int64_t num_blocks = (hi + s.block_size - 1) / s.block_size, len = hi - lo;
  const int lines = prefetch_lines(s, row * int64_t(sizeof(T)));
  Prefetcher pf;
  for (int64_t b = lo / s.block_size; b < num_blocks; ++b) {
    pf.start(k_cache, table, b, num_blocks, s.block_size * row);
    const BlockRange r(b, s.block_size, lo, hi);
    const T* block = k_cache + (table[b] * s.block_size + r.t0) * row;
    const int64_t n = r.n;
    for (int64_t h = 0; h < s.num_kv_heads; ++h) {
      const T* kh = block + h * DV * 8;
      for (int64_t j = h * group; j < (h + 1) * group; ++j) {
        const float* qj = qs + j * DV * 8;
        float* out = scores + j * len + b * s.block_size + r.t0 - lo;
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
// ctx here: the number of scores per head (the positions attended).
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

// out[j] = sum_p weights[j * (hi - lo) + p - lo] * v[p] over p in [lo, hi), head by head;
// out [Hq, D].
template <int DV, typename T>
void value_pass(const float* weights, const T* v_cache, const int64_t* table, int64_t lo,
                int64_t hi, const Shape& s, float* out) {
  const int64_t group = s.num_heads / s.num_kv_heads, row = s.num_kv_heads * DV * 8;
  memset(out, 0, sizeof(float) * s.num_heads * DV * 8);
  const int64_t num_blocks = (hi + s.block_size - 1) / s.block_size, len = hi - lo;
  const int lines = prefetch_lines(s, row * int64_t(sizeof(T)));
  Prefetcher pf;
  for (int64_t b = lo / s.block_size; b < num_blocks; ++b) {
    pf.start(v_cache, table, b, num_blocks, s.block_size * row);
    const BlockRange r(b, s.block_size, lo, hi);
    const T* block = v_cache + (table[b] * s.block_size + r.t0) * row;
    const int64_t n = r.n;
    for (int64_t h = 0; h < s.num_kv_heads; ++h) {
      const T* vh = block + h * DV * 8;
      for (int64_t j = h * group; j < (h + 1) * group; ++j) {
        const float* w = weights + j * len + b * s.block_size + r.t0 - lo;
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

// One query row [Hq, D] over positions [lo, hi) of its table.
template <int DV, typename T>
void attend(const float* q, const T* k_cache, const T* v_cache, const int64_t* table,
            int64_t lo, int64_t hi, const Shape& s, float scale, float* out,
            std::vector<float>& scratch, float* stats) {
  const int64_t dim = DV * 8, len = hi - lo;
  scratch.resize(s.num_heads * (dim + len));
  float* qs = scratch.data();  // [Hq, D], pre-scaled
  float* scores = qs + s.num_heads * dim;  // [Hq, len]
  for (int64_t i = 0; i < s.num_heads * dim; ++i) qs[i] = q[i] * scale;
  score_pass<DV, T>(qs, k_cache, table, lo, hi, s, scores);
  softmax_rows(scores, s.num_heads, len, stats);
  value_pass<DV, T>(scores, v_cache, table, lo, hi, s, out);
}

template <typename T>
using AttendFn = void (*)(const float*, const T*, const T*, const int64_t*, int64_t, int64_t,
                          const Shape&, float, float*, std::vector<float>&, float*);

// Windows longer than this many positions are attended in parts of this size (whole blocks
// when the window starts at 0), each part a task of its own, and the parts' outputs merged
// by their softmax statistics (flash-decoding's split): one long sequence then keeps every
// thread busy instead of one. The split depends on the sequence's own length and window
// only, never on the batch, so a sequence's output does not depend on what else is in the
// step.
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

// A step's work: one task per sequence, or per part of a long window, whose positions are
// [lo, hi); a split sequence's parts write into `partial` (outputs, then statistics) at
// `slot`, and are merged once all tasks are done.
struct DecodeTasks {
  struct Task { int64_t seq, lo, hi, slot; };  // slot -1: the whole sequence, into out
  struct Split { int64_t seq, first_slot, parts; };
  std::vector<Task> tasks;
  std::vector<Split> split;
  int64_t slots = 0;

  DecodeTasks(const int64_t* context_lens, int64_t num_seqs, int64_t block_size,
              int64_t window) {
    const int64_t part_len = std::max<int64_t>(1, kSplitPositions / block_size) * block_size;
    for (int64_t i = 0; i < num_seqs; ++i) {
      const int64_t hi = context_lens[i];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, hi - window) : 0;
      if (hi - lo <= kSplitPositions) {
        tasks.push_back({i, lo, hi, -1});
        continue;
      }
      const int64_t parts = (hi - lo + part_len - 1) / part_len;
      split.push_back({i, slots, parts});
      for (int64_t j = 0; j < parts; ++j)
        tasks.push_back({i, lo + j * part_len, std::min(hi, lo + (j + 1) * part_len), slots + j});
      slots += parts;
    }
  }
};

template <typename T>
void paged_decode(const float* q, const T* k_cache, const T* v_cache, const int64_t* rows,
                  const int64_t* tables, int64_t table_stride, const int64_t* context_lens,
                  int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                  int64_t head_dim, float scale, float* out, int num_threads, int64_t window) {
  static const AttendFn<T> by_dv[17] = {
      nullptr,         attend<1, T>,  attend<2, T>,  attend<3, T>,  attend<4, T>,
      attend<5, T>,    attend<6, T>,  attend<7, T>,  attend<8, T>,  attend<9, T>,
      attend<10, T>,   attend<11, T>, attend<12, T>, attend<13, T>, attend<14, T>,
      attend<15, T>,   attend<16, T>};
  const AttendFn<T> fn = by_dv[head_dim / 8];
  const Shape s{num_heads, num_kv_heads, block_size, table_stride};
  const int64_t q_row = num_heads * head_dim;
  const DecodeTasks plan(context_lens, num_seqs, block_size, window);
  std::vector<float> partial(plan.slots * num_heads * (head_dim + 2));
  float* part_out = partial.data();
  float* part_stats = part_out + plan.slots * q_row;
  const int64_t num_tasks = plan.tasks.size(), num_split = plan.split.size();
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < num_tasks; ++u) {
      const DecodeTasks::Task& task = plan.tasks[u];
      const int64_t i = task.seq;
      const bool whole = task.slot < 0;
      fn(q + rows[i] * q_row, k_cache, v_cache, tables + i * table_stride, task.lo, task.hi, s,
         scale, whole ? out + rows[i] * q_row : part_out + task.slot * q_row, scratch,
         whole ? nullptr : part_stats + task.slot * 2 * num_heads);
    }
#pragma omp for schedule(static)
    for (int64_t u = 0; u < num_split; ++u) {
      const DecodeTasks::Split& sp = plan.split[u];
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
// OpenMP threads (1: in the calling thread). window: the sliding window (0: full attention).
void paged_decode_kv(const float* q, const void* k_cache, const void* v_cache,
                     const int64_t* rows, const int64_t* tables, int64_t table_stride,
                     const int64_t* context_lens, int64_t num_seqs, int64_t num_heads,
                     int64_t num_kv_heads, int64_t block_size, int64_t head_dim, float scale,
                     float* out, int num_threads, int kind, int64_t window) {
#define CONTINUUM_DECODE(T)                                                                  \
  paged_decode<T>(q, static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), rows,  \
                  tables, table_stride, context_lens, num_seqs, num_heads, num_kv_heads,      \
                  block_size, head_dim, scale, out, num_threads, window)
  if (kind == 1) {
    CONTINUUM_DECODE(Half);
  } else if (kind == 2) {
    CONTINUUM_DECODE(BHalf);
  } else {
    CONTINUUM_DECODE(float);
  }
#undef CONTINUUM_DECODE
}


}  // extern "C"

// Small-batch fp32 GEMM for x86-64 with AVX2 + FMA: C = W @ X for a layer's weight W
// [M, K] and a step's activations X [K, N], N = tokens (decode batches: 8..128), built by
// kernels/native.py into the same library as cpu_attention.cpp.
//
// Why not MKL: on this AMD CPU MKL's sgemm runs a decode step's shapes (M = 576..49,152,
// K = 576..1,536, N = 16..128, weights streaming from memory) at 50-110 GFLOP/s on two
// cores; a BLIS-style 6 x 16 register tile over pre-packed weights runs them at 120-145.
//
// Layout. The weight is packed once, at model load, into panels of 6 rows interleaved along
// K ([ceil(M / 6)][K][6], the last panel zero-padded), so the kernel's 6 broadcasts per k
// come from one sequential stream. Each call packs X into blocks of 16 columns ([N / 16][K]
// [16], the last block zero-padded; a thread-local buffer, ~150 KiB at K = 576, N = 64) so
// the 2 vector loads per k are sequential too. The register tile: 6 rows x 16 columns = 12
// ymm accumulators + 2 X vectors + 1 broadcast of the 16 registers; per k, 12 FMAs for 8
// loads. Loop order: column chunks of <= 128 (X stays in L2), then weight panels (split
// between threads; each panel stays in L1 while every column block of the chunk reads it),
// then column blocks; the first column block of a panel prefetches the next panel. Each
// output is one sequential sum over k, like a naive dot product. X of 1-4 columns (small
// decode batches) goes through a narrow kernel instead (narrow_gemm below).
//
// Output: C[m, n] at c + m * ldc_m + n * ldc_n, so the LM head writes token-major logits
// [N, M] directly (ldc_m = 1) instead of transposing a 12 MB result afterwards.

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <chrono>

namespace {

constexpr int64_t MR = 6, NR = 16, N_CHUNK = 128;

// out[r * ldo + j] = sum_k wp[k * MR + r] * xp[k * NR + j] for the tile's 6 x 16 entries.
// kRows: the panel is row-major [6][K] instead (cpu_qgemm.cpp's dequantized rows, written
// without an interleaving pass); the same sums in the same order.
template <bool kRows = false>
inline void tile(const float* __restrict wp, const float* __restrict xp, int64_t K,
                 float* __restrict out, int64_t ldo, const char* next) {
  const int64_t rs = kRows ? K : 1, ks = kRows ? 1 : MR;  // row and k strides in wp
  __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps();
  __m256 a10 = _mm256_setzero_ps(), a11 = _mm256_setzero_ps();
  __m256 a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps();
  __m256 a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
  __m256 a40 = _mm256_setzero_ps(), a41 = _mm256_setzero_ps();
  __m256 a50 = _mm256_setzero_ps(), a51 = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k++, wp += ks, xp += NR) {
    if (next != nullptr && (k & 1) == 0) _mm_prefetch(next + k * MR * 4, _MM_HINT_T0);
    const __m256 x0 = _mm256_load_ps(xp), x1 = _mm256_load_ps(xp + 8);
    __m256 b = _mm256_broadcast_ss(wp);
    a00 = _mm256_fmadd_ps(b, x0, a00), a01 = _mm256_fmadd_ps(b, x1, a01);
    b = _mm256_broadcast_ss(wp + 1 * rs);
    a10 = _mm256_fmadd_ps(b, x0, a10), a11 = _mm256_fmadd_ps(b, x1, a11);
    b = _mm256_broadcast_ss(wp + 2 * rs);
    a20 = _mm256_fmadd_ps(b, x0, a20), a21 = _mm256_fmadd_ps(b, x1, a21);
    b = _mm256_broadcast_ss(wp + 3 * rs);
    a30 = _mm256_fmadd_ps(b, x0, a30), a31 = _mm256_fmadd_ps(b, x1, a31);
    b = _mm256_broadcast_ss(wp + 4 * rs);
    a40 = _mm256_fmadd_ps(b, x0, a40), a41 = _mm256_fmadd_ps(b, x1, a41);
    b = _mm256_broadcast_ss(wp + 5 * rs);
    a50 = _mm256_fmadd_ps(b, x0, a50), a51 = _mm256_fmadd_ps(b, x1, a51);
  }
  _mm256_storeu_ps(out + 0 * ldo, a00), _mm256_storeu_ps(out + 0 * ldo + 8, a01);
  _mm256_storeu_ps(out + 1 * ldo, a10), _mm256_storeu_ps(out + 1 * ldo + 8, a11);
  _mm256_storeu_ps(out + 2 * ldo, a20), _mm256_storeu_ps(out + 2 * ldo + 8, a21);
  _mm256_storeu_ps(out + 3 * ldo, a30), _mm256_storeu_ps(out + 3 * ldo + 8, a31);
  _mm256_storeu_ps(out + 4 * ldo, a40), _mm256_storeu_ps(out + 4 * ldo + 8, a41);
  _mm256_storeu_ps(out + 5 * ldo, a50), _mm256_storeu_ps(out + 5 * ldo + 8, a51);
}

// Writes the valid rows x cols of a tile (row-major [MR][NR] in `t`) to C: edges and
// token-major output.
inline void store_tile(const float* t, int64_t rows, int64_t cols, float* c, int64_t ldc_m,
                       int64_t ldc_n) {
  if (ldc_n == 1) {
    for (int64_t r = 0; r < rows; r++) memcpy(c + r * ldc_m, t + r * NR, cols * sizeof(float));
  } else {  // token-major output (the LM head): column j of the tile is a row of C
    for (int64_t j = 0; j < cols; j++)
      for (int64_t r = 0; r < rows; r++) c[j * ldc_n + r * ldc_m] = t[r * NR + j];
  }
}

// X[k, n0 + j] (strides ldx_k, ldx_n) for j < cols into xp [K][NR], zero-padded columns.
void pack_x_block(const float* x, int64_t ldx_k, int64_t ldx_n, int64_t K, int64_t n0,
                  int64_t cols, float* xp) {
  if (ldx_n == 1 && cols == NR) {
    for (int64_t k = 0; k < K; k++) memcpy(xp + k * NR, x + k * ldx_k + n0, NR * sizeof(float));
    return;
  }
  if (cols < NR)
    for (int64_t k = 0; k < K; k++) memset(xp + k * NR + cols, 0, (NR - cols) * sizeof(float));
  for (int64_t j = 0; j < cols; j++) {  // a transposed view (ldx_k = 1) reads rows in order
    const float* src = x + (n0 + j) * ldx_n;
    for (int64_t k = 0; k < K; k++) xp[k * NR + j] = src[k * ldx_k];
  }
}

struct Buffer {
  float* data = nullptr;
  int64_t capacity = 0;
  ~Buffer() { free(data); }
  float* get(int64_t floats) {
    if (floats > capacity) {
      free(data);
      capacity = std::max(floats, 2 * capacity);
      data = static_cast<float*>(aligned_alloc(64, ((capacity * 4 + 63) / 64) * 64));
    }
    return data;
  }
};


// Narrow X (NN <= 4 columns: a batch-1..4 decode, where the 16-column tile would waste
// 4-16x its FLOPs): per k one 8-lane load of the panel's 6 weights (lanes 6, 7 read the
// next k's and are discarded) and NN broadcasts of X. Memory-bound: the weights stream once.
template <int NN>
inline void narrow_panel(const float* __restrict wp, const float* __restrict x, int64_t ldx_k,
                         int64_t ldx_n, int64_t K, float* __restrict t) {
  __m256 acc[NN];
  for (int n = 0; n < NN; n++) acc[n] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k++, wp += MR) {
    if ((k & 7) == 0) {  // the weight stream, 4 KiB ahead: 3 lines per 8 k (192 bytes)
      const char* ahead = reinterpret_cast<const char*>(wp) + 4096;
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
      _mm_prefetch(ahead + 128, _MM_HINT_T0);
    }
    const __m256 w = _mm256_loadu_ps(wp);
    for (int n = 0; n < NN; n++)
      acc[n] = _mm256_fmadd_ps(w, _mm256_set1_ps(x[k * ldx_k + n * ldx_n]), acc[n]);
  }
  for (int n = 0; n < NN; n++) _mm256_storeu_ps(t + n * 8, acc[n]);  // t[n * 8 + r]
}

template <int NN>
void narrow_gemm(const float* wp, int64_t M, int64_t K, const float* x, int64_t ldx_k,
                 int64_t ldx_n, float* c, int64_t ldc_m, int64_t ldc_n, int num_threads) {
  const int64_t panels = (M + MR - 1) / MR;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1) schedule(static)
  for (int64_t p = 0; p < panels; p++) {
    alignas(32) float t[NN * 8];
    narrow_panel<NN>(wp + p * MR * K, x, ldx_k, ldx_n, K, t);
    const int64_t m0 = p * MR, rows = std::min(MR, M - m0);
    for (int64_t n = 0; n < NN; n++)
      for (int64_t r = 0; r < rows; r++) c[(m0 + r) * ldc_m + n * ldc_n] = t[n * 8 + r];
  }
}

// The wide (N > 4) GEMM over panels that `src` supplies: src(p, scratch) -> panel p in the
// [K][6] layout (the packed weight itself, or cpu_qgemm.cpp's dequantized copy in
// `scratch`, MR * K floats per thread, row-major: Source::kRows); src.next(p): where to
// prefetch panel p + 1 from.
template <class Source>
void wide_gemm(const Source& src, int64_t M, int64_t K, const float* x, int64_t ldx_k,
               int64_t ldx_n, int64_t N, float* c, int64_t ldc_m, int64_t ldc_n,
               int num_threads) {
  static thread_local Buffer xbuf;
  const int64_t panels = (M + MR - 1) / MR;
  float* xp = xbuf.get(K * N_CHUNK);
  for (int64_t n0 = 0; n0 < N; n0 += N_CHUNK) {
    const int64_t width = std::min(N_CHUNK, N - n0), blocks = (width + NR - 1) / NR;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#pragma omp for schedule(static)
      for (int64_t b = 0; b < blocks; b++)
        pack_x_block(x, ldx_k, ldx_n, K, n0 + b * NR, std::min(NR, width - b * NR),
                     xp + b * K * NR);
      alignas(64) float t[MR * NR];
      static thread_local Buffer panel_buf;
      float* scratch = src.needs_scratch ? panel_buf.get(MR * K) : nullptr;
#pragma omp for schedule(static)
      for (int64_t p = 0; p < panels; p++) {
        const int64_t m0 = p * MR, rows = std::min(MR, M - m0);
        const float* wpp = src(p, scratch);
        for (int64_t b = 0; b < blocks; b++) {
          const int64_t j0 = n0 + b * NR, cols = std::min(NR, N - j0);
          // The first column block streams the next panel in (weights come from memory).
          const char* next = b == 0 && p + 1 < panels ? src.next(p) : nullptr;
          if (rows == MR && cols == NR && ldc_n == 1) {  // straight into C
            tile<Source::kRows>(wpp, xp + b * K * NR, K, c + m0 * ldc_m + j0, ldc_m, next);
          } else {
            tile<Source::kRows>(wpp, xp + b * K * NR, K, t, NR, next);
            store_tile(t, rows, cols, c + m0 * ldc_m + j0 * ldc_n, ldc_m, ldc_n);
          }
        }
      }
    }
  }
}

struct PackedSource {  // gemm_pack_weight_f32's panels, read in place
  static constexpr bool needs_scratch = false, kRows = false;
  const float* wp;
  int64_t K;
  const float* operator()(int64_t p, float*) const { return wp + p * MR * K; }
  const char* next(int64_t p) const { return reinterpret_cast<const char*>(wp + (p + 1) * MR * K); }
};

using PanelFn = const float* (*)(const void* ctx, int64_t panel, float* scratch);

struct CallbackSource {  // panels built per call (cpu_qgemm.cpp's dequantization)
  static constexpr bool needs_scratch = true, kRows = true;  // rows [6][K]
  PanelFn fn;
  const void* ctx;
  const float* operator()(int64_t p, float* scratch) const { return fn(ctx, p, scratch); }
  const char* next(int64_t) const { return nullptr; }
};

}  // namespace

extern "C" {

// + 8: the narrow kernel loads 8 lanes at the last k of the last panel.
int64_t gemm_packed_floats(int64_t M, int64_t K) { return (M + MR - 1) / MR * MR * K + 8; }

// w [M, K] row-major -> wp [ceil(M / 6)][K][6] (gemm_packed_floats(M, K) floats).
void gemm_pack_weight_f32(const float* w, float* wp, int64_t M, int64_t K) {
  const int64_t panels = (M + MR - 1) / MR;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; p++) {
    float* dst = wp + p * MR * K;
    for (int64_t r = 0; r < MR; r++) {
      const int64_t m = p * MR + r;
      for (int64_t k = 0; k < K; k++) dst[k * MR + r] = m < M ? w[m * K + k] : 0.0f;
    }
  }
}

// C = W @ X: wp packed by gemm_pack_weight_f32 from W [M, K]; X [K, N] at x + k * ldx_k +
// n * ldx_n; C [M, N] at c + m * ldc_m + n * ldc_n. Runs on num_threads OpenMP threads.
void gemm_packed_f32(const float* wp, int64_t M, int64_t K, const float* x, int64_t ldx_k,
                     int64_t ldx_n, int64_t N, float* c, int64_t ldc_m, int64_t ldc_n,
                     int num_threads) {
  switch (N) {
    case 1: return narrow_gemm<1>(wp, M, K, x, ldx_k, ldx_n, c, ldc_m, ldc_n, num_threads);
    case 2: return narrow_gemm<2>(wp, M, K, x, ldx_k, ldx_n, c, ldc_m, ldc_n, num_threads);
    case 3: return narrow_gemm<3>(wp, M, K, x, ldx_k, ldx_n, c, ldc_m, ldc_n, num_threads);
    case 4: return narrow_gemm<4>(wp, M, K, x, ldx_k, ldx_n, c, ldc_m, ldc_n, num_threads);
    default: break;
  }
  wide_gemm(PackedSource{wp, K}, M, K, x, ldx_k, ldx_n, N, c, ldc_m, ldc_n, num_threads);
}

// The FMA issue ceiling, GFLOP/s summed over num_threads threads: each runs `rounds` rounds
// of 12 independent 8-lane FMA chains held in registers (no loads: what the 6 x 16 tile's
// 12 accumulators could reach if every operand were already in a register), timed on its
// own clock. benchmarks/bench_executor.py prints the GEMM's share of it. 0 for rounds <= 0.
volatile double fma_peak_sink;

double fma_peak_gflops(int64_t rounds, int num_threads) {
  if (rounds <= 0) return 0.0;
  double total = 0.0, sink = 0.0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total, sink)
  {
    __m256 a[12];
    for (int j = 0; j < 12; j++) a[j] = _mm256_set1_ps(1e-3f * j);
    const __m256 m = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(1e-6f);
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < rounds; i++)
      for (int j = 0; j < 12; j++) a[j] = _mm256_fmadd_ps(a[j], m, c);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                         .count();
    total += 12.0 * 16.0 * double(rounds) / s / 1e9;
    alignas(32) float out[8];
    for (int j = 0; j < 12; j++) {  // keeps the chains live
      _mm256_store_ps(out, a[j]);
      sink += out[0];
    }
  }
  fma_peak_sink = sink;  // the chains' results are used: the loop cannot be removed
  return total;
}

// C = W @ X (N > 4) where panel p of W [M, K] comes from panel(ctx, p, scratch): the fp32
// tile over panels built per call (cpu_qgemm.cpp's dequantized blocks).
void gemm_panels_f32(PanelFn panel, const void* ctx, int64_t M, int64_t K, const float* x,
                     int64_t ldx_k, int64_t ldx_n, int64_t N, float* c, int64_t ldc_m,
                     int64_t ldc_n, int num_threads) {
  wide_gemm(CallbackSource{panel, ctx}, M, K, x, ldx_k, ldx_n, N, c, ldc_m, ldc_n, num_threads);
}

}  // extern "C"

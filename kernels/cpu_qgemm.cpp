// GEMM over weights kept in their GGUF block formats (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, F16,
// BF16): C = W @ X with fp32 activations and fp32 accumulation, the blocks dequantized inside
// the kernel. Built by kernels/native.py into the same library as cpu_gemm.cpp, but compiled
// on its own with -ffp-contract=off: every dequantized value must EQUAL what
// gguf.quants.dequantize gives (what transformers loads), and numpy rounds each product and
// sum; a contracted FMA would round once and differ in the last bit. (Explicit FMAs appear
// only where the product is exact, so one rounding equals numpy's two: Q4_1's d * q + m.)
//
// Two shapes of work. Few columns (N <= 8: decode batches of 1-8, weight-streaming bound):
// each row's blocks are dequantized into an L1 buffer and multiplied into N accumulators at
// once, so the quantized bytes stream from memory exactly once per step (4.5-8.5 bits per
// weight instead of fp32's 32). More columns (larger batches and prefill): each 6-row panel
// is dequantized once per 128-column chunk into a row-major fp32 panel [6][K] (SIMD
// stores, no interleaving pass) and cpu_gemm.cpp's 6 x 16 register tile runs over it
// (gemm_panels_f32, the tile's kRows layout): the same sums as the fp32 GEMM over the
// dequantized weights. Each output's summation order is part of the contract (greedy output
// is token-exact only while every C[m, n] keeps its bits): tests/kernels/test_qgemm.py
// recomputes both orders with exactly rounded FMAs and compares bit for bit.
//
// Where the time goes on AVX2 (Zen 3, measured): at N <= 4 the dequantization (~20 FP-port
// uops per 32-value block against 4-16 FMAs); at N = 5..8 one X load per FMA and only N
// dependent FMA chains (A = 1): 50-66 GF/s a core at N = 8 of ~75. Register-blocking rows to
// share X loads was tried (and a two-phase dequantize-then-tile kernel): no robust gain
// with g++'s allocation, so the one-row loop stays.
//
// A weight is a chain of row segments (QWeight.next): q/k/v (and gate/up) are fused into one
// projection even when their formats differ (Q4_K_M files keep attn_v in Q6_K). Format 0 is
// an fp32 weight packed by gemm_pack_weight_f32 (ggml's F32 type id), which goes to the fp32
// GEMM unchanged; the others are ggml type ids with rows of row_bytes bytes.

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

extern "C" void gemm_packed_f32(const float* wp, int64_t M, int64_t K, const float* x,
                                int64_t ldx_k, int64_t ldx_n, int64_t N, float* c,
                                int64_t ldc_m, int64_t ldc_n, int num_threads);
using PanelFn = const float* (*)(const void* ctx, int64_t panel, float* scratch);
extern "C" void gemm_panels_f32(PanelFn panel, const void* ctx, int64_t M, int64_t K,
                                const float* x, int64_t ldx_k, int64_t ldx_n, int64_t N,
                                float* c, int64_t ldc_m, int64_t ldc_n, int num_threads);

extern "C" {
struct QWeight {  // kernels/quant.py's _QWeight
  int32_t format;
  int64_t rows, cols, row_bytes;
  const void* data;
  const QWeight* next;
  // The first segment's only: null, or the whole weight dequantized and packed for
  // cpu_gemm.cpp (one fp32 segment), which calls with N > kNarrow go to instead: the
  // same sums in the same order as the panels over the blocks (their tile reads the same
  // values), at fp32's speed on the compute-bound shapes (no dequantization per panel).
  const QWeight* wide;
};
}

namespace {

enum Format : int32_t {
  kPacked = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14, kBF16 = 30
};
constexpr int64_t MR = 6;  // cpu_gemm.cpp's panel height
constexpr int64_t kNarrow = 8;  // N up to this: the narrow kernel (one pass over the blocks)

inline float half(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);  // exact, as numpy's float16 -> float32
}

// The two fp16 values at p, p + 2 (p's 4 bytes must be readable), exactly as half() converts
// them, as vectors [p0 p1 p0 p1 ...]: one broadcast load and one conversion; permute_ps(.,
// 0x00) broadcasts the first, 0x55 the second (in-lane shuffles, cheaper than two scalar
// conversions and broadcasts).
inline __m256 half_pair(const uint8_t* p) {
  float bits;
  memcpy(&bits, p, 4);
  return _mm256_cvtph_ps(_mm_castps_si128(_mm_set1_ps(bits)));
}

// 16 bytes of nibbles -> the 32 values, low nibbles first (ggml's Q4 layout), as int32 x 4.
// Both 128-bit lanes hold the 16 bytes; one in-lane byte shuffle spreads 8 of them into
// dwords (zero-extended), then a mask gives the low nibbles and a shift the high ones: 2
// shuffles per block instead of 6 (byte-to-dword extensions and lane moves), which shared
// the FP ports with the GEMM's FMAs.
inline void nibbles(const uint8_t* qs, __m256i out[4]) {
  const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m256i first = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                         4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i second = _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,
                                          12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1);
  const __m256i b0 = _mm256_shuffle_epi8(q, first), b1 = _mm256_shuffle_epi8(q, second);
  const __m256i mask = _mm256_set1_epi32(0x0F);
  out[0] = _mm256_and_si256(b0, mask), out[1] = _mm256_and_si256(b1, mask);
  out[2] = _mm256_srli_epi32(b0, 4), out[3] = _mm256_srli_epi32(b1, 4);
}

// Each format: kBlock values in kBytes; block(src, out) writes the kBlock values of one
// block, each rounded exactly as gguf.quants' numpy code rounds it.
template <int F> struct Fmt;

template <> struct Fmt<kQ4_0> {  // d f16, 16 bytes of nibbles: d * (q - 8)
  static constexpr int64_t kBlock = 32, kBytes = 18;
  static void block(const uint8_t* b, float* out) {
    const __m256 d = _mm256_permute_ps(half_pair(b), 0x00);  // b + 2: the nibbles
    __m256i q[4];
    nibbles(b + 2, q);
    for (int i = 0; i < 4; i++)
      _mm256_store_ps(out + 8 * i, _mm256_mul_ps(
          d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[i], _mm256_set1_epi32(8)))));
  }
};

template <> struct Fmt<kQ4_1> {  // d, m f16, nibbles: (d * q) + m, two roundings
  static constexpr int64_t kBlock = 32, kBytes = 20;
  // d * q is exact in fp32 (an 11-bit significand times a 4-bit integer), so one fused
  // multiply-add rounds exactly as numpy's multiply then add: one FP op instead of two.
  static void block(const uint8_t* b, float* out) {
    const __m256 dm = half_pair(b);
    const __m256 d = _mm256_permute_ps(dm, 0x00), m = _mm256_permute_ps(dm, 0x55);
    __m256i q[4];
    nibbles(b + 4, q);
    for (int i = 0; i < 4; i++)
      _mm256_store_ps(out + 8 * i, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[i]), m));
  }
};

template <> struct Fmt<kQ8_0> {  // d f16, 32 int8: q * d
  static constexpr int64_t kBlock = 32, kBytes = 34;
  static void block(const uint8_t* b, float* out) {
    const __m256 d = _mm256_permute_ps(half_pair(b), 0x00);  // b + 2: the int8s
    for (int i = 0; i < 4; i++) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i));
      _mm256_store_ps(out + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
    }
  }
};

template <> struct Fmt<kF16> {
  static constexpr int64_t kBlock = 32, kBytes = 64;
  static void block(const uint8_t* b, float* out) {
    for (int i = 0; i < 4; i++)
      _mm256_store_ps(out + 8 * i, _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * i))));
  }
};

template <> struct Fmt<kBF16> {  // the top 16 bits of an fp32
  static constexpr int64_t kBlock = 32, kBytes = 64;
  static void block(const uint8_t* b, float* out) {
    for (int i = 0; i < 4; i++) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * i));
      _mm256_store_ps(out + 8 * i, _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
  }
};

// Q4_K (144 bytes per 256): d, dmin f16, 12 bytes of 6-bit scales/mins for 8 sub-blocks of
// 32, 128 bytes of nibbles (per 64 values: 32 low nibbles, then the same bytes' high ones).
// value = (d * sc) * q - (dmin * m), each product rounded, as Q4_K.dequantize_blocks. Both
// products are exact in fp32 (11-bit significands times 6-bit then 4-bit integers), so
// the SIMD multiply and subtract give numpy's values.
template <> struct Fmt<kQ4_K> {
  static constexpr int64_t kBlock = 256, kBytes = 144;
  static void block(const uint8_t* b, float* out) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* s = b + 4;
    const uint8_t* qs = b + 16;
    for (int j = 0; j < 8; j += 2) {  // sub-blocks j (low nibbles) and j + 1 (high)
      __m256i q[2][4];
      nibbles(qs + 16 * j, q[0]), nibbles(qs + 16 * j + 16, q[1]);
      for (int h = 0; h < 2; h++) {
        const int jj = j + h;
        int sc, mn;
        if (jj < 4) {
          sc = s[jj] & 0x3F, mn = s[jj + 4] & 0x3F;
        } else {
          sc = (s[jj + 4] & 0x0F) | ((s[jj - 4] >> 2) & 0x30);
          mn = (s[jj + 4] >> 4) | ((s[jj] >> 2) & 0x30);
        }
        const __m256 ds = _mm256_set1_ps(d * float(sc)), dm = _mm256_set1_ps(dmin * float(mn));
        float* o = out + 32 * jj;
        for (int i = 0; i < 4; i++)  // values 8i..8i+7: bytes 8i..8i+7 of the 32
          _mm256_store_ps(o + 8 * i, _mm256_sub_ps(_mm256_mul_ps(
              ds, _mm256_cvtepi32_ps(q[i / 2][2 * h + i % 2])), dm));
      }
    }
  }
};

// Q6_K (210 bytes per 256): 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales
// (one per 16 values), d f16. value = (d * scale) * (q - 32): d * scale is exact (11 times 8
// bits), the second product rounded once, by numpy and by the SIMD multiply alike. Values
// 128h + 32g + i (i < 32) take the low (g < 2) or high nibble of ql[64h + 32(g % 2) + i]
// and bits 2g, 2g + 1 of qh[32h + i]: 32 of them per pass in byte lanes.
template <> struct Fmt<kQ6_K> {
  static constexpr int64_t kBlock = 256, kBytes = 210;
  static void block(const uint8_t* b, float* out) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half(b + 208);
    const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(0x03);
    for (int h = 0; h < 2; h++) {
      const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
      for (int g = 0; g < 4; g++) {
        __m256i L = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32 * (g % 2)));
        if (g >= 2) L = _mm256_srli_epi16(L, 4);
        const __m256i hi = _mm256_slli_epi16(
            _mm256_and_si256(_mm256_srl_epi16(H, _mm_cvtsi32_si128(2 * g)), low2), 4);
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(L, low4), hi),
                                          _mm256_set1_epi8(32));
        const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
        const __m256i v[4] = {_mm256_cvtepi8_epi32(q0), _mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8)),
                              _mm256_cvtepi8_epi32(q1), _mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))};
        float* o = out + 128 * h + 32 * g;
        for (int k = 0; k < 4; k++) {
          const __m256 ds = _mm256_set1_ps(d * float(sc[8 * h + 2 * g + k / 2]));
          _mm256_store_ps(o + 8 * k, _mm256_mul_ps(ds, _mm256_cvtepi32_ps(v[k])));
        }
      }
    }
  }
};

template <int F>
void dequant_row(const uint8_t* row, int64_t K, float* out) {
  for (int64_t k = 0; k < K; k += Fmt<F>::kBlock)
    Fmt<F>::block(row + k / Fmt<F>::kBlock * Fmt<F>::kBytes, out + k);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// C[m, n] for the segment's rows, NN <= kNarrow columns of xt [NN][K] (token-major, contiguous):
// the row's blocks dequantized into `buf` (L1; the compiler keeps them in registers) and
// multiplied into 1-2 accumulators per column. Accumulator a of column n sums the 8-lane
// chunks j = a (mod A) in k order, lane by lane; C = hsum of the A sums added. (Several rows
// at once, sharing each X load, measured slower: g++ then reloads X per row and spills
// accumulators.)
template <int F, int NN>
void narrow(const QWeight& w, const float* xt, float* c, int64_t ldc_m, int64_t ldc_n,
            int threads) {
  using B = Fmt<F>;
  const int64_t K = w.cols;
  const uint8_t* data = static_cast<const uint8_t*>(w.data);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t m = 0; m < w.rows; m++) {
    alignas(64) float buf[B::kBlock];
    const uint8_t* row = data + m * w.row_bytes;
#ifdef __AVX512F__
    __m512 acc[NN];
    for (int n = 0; n < NN; n++) acc[n] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += B::kBlock) {
      B::block(row + k0 / B::kBlock * B::kBytes, buf);
      for (int64_t j = 0; j < B::kBlock; j += 16) {
        const __m512 wv = _mm512_load_ps(buf + j);
        for (int n = 0; n < NN; n++)
          acc[n] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xt + n * K + k0 + j), acc[n]);
      }
    }
    for (int n = 0; n < NN; n++) c[m * ldc_m + n * ldc_n] = _mm512_reduce_add_ps(acc[n]);
#else
    constexpr int A = NN <= 4 ? 2 : 1;  // accumulators per column: 2 hide FMA latency
    __m256 acc[NN][A];
    for (int n = 0; n < NN; n++)
      for (int a = 0; a < A; a++) acc[n][a] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += B::kBlock) {
      B::block(row + k0 / B::kBlock * B::kBytes, buf);
      for (int64_t j = 0; j < B::kBlock; j += 16) {
        const __m256 w0 = _mm256_load_ps(buf + j), w1 = _mm256_load_ps(buf + j + 8);
        for (int n = 0; n < NN; n++) {
          const float* xk = xt + n * K + k0 + j;
          acc[n][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xk), acc[n][0]);
          acc[n][A - 1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xk + 8), acc[n][A - 1]);
        }
      }
    }
    for (int n = 0; n < NN; n++)
      c[m * ldc_m + n * ldc_n] = hsum(A == 2 ? _mm256_add_ps(acc[n][0], acc[n][A - 1])
                                             : acc[n][0]);
#endif
  }
}

// gemm_panels_f32's source: panel p's 6 rows dequantized, row-major [6][K] (the tile's
// kRows layout: no interleaving pass), rows past the end zero.
template <int F>
const float* panel(const void* ctx, int64_t p, float* scratch) {
  const QWeight& w = *static_cast<const QWeight*>(ctx);
  const int64_t K = w.cols;
  for (int64_t r = 0; r < MR; r++) {
    const int64_t m = p * MR + r;
    if (m < w.rows)
      dequant_row<F>(static_cast<const uint8_t*>(w.data) + m * w.row_bytes, K, scratch + r * K);
    else
      memset(scratch + r * K, 0, K * sizeof(float));
  }
  return scratch;
}

template <int F>
void segment_gemm(const QWeight& w, const float* x, int64_t ldx_k, int64_t ldx_n, int64_t N,
                  const float* xt, float* c, int64_t ldc_m, int64_t ldc_n, int threads) {
  switch (N) {
    case 1: return narrow<F, 1>(w, xt, c, ldc_m, ldc_n, threads);
    case 2: return narrow<F, 2>(w, xt, c, ldc_m, ldc_n, threads);
    case 3: return narrow<F, 3>(w, xt, c, ldc_m, ldc_n, threads);
    case 4: return narrow<F, 4>(w, xt, c, ldc_m, ldc_n, threads);
    case 5: return narrow<F, 5>(w, xt, c, ldc_m, ldc_n, threads);
    case 6: return narrow<F, 6>(w, xt, c, ldc_m, ldc_n, threads);
    case 7: return narrow<F, 7>(w, xt, c, ldc_m, ldc_n, threads);
    case 8: return narrow<F, 8>(w, xt, c, ldc_m, ldc_n, threads);
    default:
      gemm_panels_f32(panel<F>, &w, w.rows, w.cols, x, ldx_k, ldx_n, N, c, ldc_m, ldc_n, threads);
  }
}

bool known(int32_t f) {
  return f == kPacked || f == kF16 || f == kQ4_0 || f == kQ4_1 || f == kQ8_0 || f == kQ4_K ||
         f == kQ6_K || f == kBF16;
}

void dequant_any(int32_t f, const uint8_t* row, int64_t K, float* out) {
  switch (f) {
    case kF16: return dequant_row<kF16>(row, K, out);
    case kQ4_0: return dequant_row<kQ4_0>(row, K, out);
    case kQ4_1: return dequant_row<kQ4_1>(row, K, out);
    case kQ8_0: return dequant_row<kQ8_0>(row, K, out);
    case kQ4_K: return dequant_row<kQ4_K>(row, K, out);
    case kQ6_K: return dequant_row<kQ6_K>(row, K, out);
    case kBF16: return dequant_row<kBF16>(row, K, out);
    default: break;
  }
}

}  // namespace

extern "C" {

// 1 if cpu_qgemm reads `format` (a ggml type id, 0 = packed fp32), else 0.
int qweight_supports(int32_t format) { return known(format) ? 1 : 0; }

// C = W @ X for every segment of w (rows stacked in order): X [K, N] at x + k * ldx_k +
// n * ldx_n, C at c + m * ldc_m + n * ldc_n.
void qweight_gemm(const QWeight* w, const float* x, int64_t ldx_k, int64_t ldx_n, int64_t N,
                  float* c, int64_t ldc_m, int64_t ldc_n, int threads) {
  if (N <= 0) return;
  if (N > kNarrow && w->wide != nullptr) w = w->wide;
  const int64_t K = w->cols;
  static thread_local std::vector<float> xt_buf;
  const float* xt = nullptr;
  bool blocks = false;  // any segment in GGUF blocks (packed fp32 reads X as it is)
  for (const QWeight* s = w; s != nullptr; s = s->next) blocks |= s->format != kPacked;
  if (N <= kNarrow && blocks) {  // the narrow kernel reads X token-major: [N][K], K contiguous
    // 64-byte aligned (K is a multiple of 32): malloc's 16-byte alignment split every other
    // 32-byte X load across two cache lines, one load per FMA at N = 5..8 (-20-25%, and a
    // per-process lottery in A/B runs).
    if (int64_t(xt_buf.size()) < N * K + 16) xt_buf.resize(N * K + 16);
    float* t = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(xt_buf.data()) + 63) &
                                        ~uintptr_t(63));
    for (int64_t n = 0; n < N; n++)
      for (int64_t k = 0; k < K; k++) t[n * K + k] = x[k * ldx_k + n * ldx_n];
    xt = t;
  }
  for (const QWeight* s = w; s != nullptr; s = s->next) {
    switch (s->format) {
      case kPacked:
        gemm_packed_f32(static_cast<const float*>(s->data), s->rows, K, x, ldx_k, ldx_n, N, c,
                        ldc_m, ldc_n, threads);
        break;
      case kF16: segment_gemm<kF16>(*s, x, ldx_k, ldx_n, N, xt, c, ldc_m, ldc_n, threads); break;
      case kQ4_0: segment_gemm<kQ4_0>(*s, x, ldx_k, ldx_n, N, xt, c, ldc_m, ldc_n, threads); break;
      case kQ4_1: segment_gemm<kQ4_1>(*s, x, ldx_k, ldx_n, N, xt, c, ldc_m, ldc_n, threads); break;
      case kQ8_0: segment_gemm<kQ8_0>(*s, x, ldx_k, ldx_n, N, xt, c, ldc_m, ldc_n, threads); break;
      case kQ4_K: segment_gemm<kQ4_K>(*s, x, ldx_k, ldx_n, N, xt, c, ldc_m, ldc_n, threads); break;
      case kQ6_K: segment_gemm<kQ6_K>(*s, x, ldx_k, ldx_n, N, xt, c, ldc_m, ldc_n, threads); break;
      case kBF16: segment_gemm<kBF16>(*s, x, ldx_k, ldx_n, N, xt, c, ldc_m, ldc_n, threads); break;
      default: break;  // kernels/quant.py admits only qweight_supports formats
    }
    c += s->rows * ldc_m;
  }
}

// out[i * K ...] = row ids[i] of w dequantized (an embedding lookup). Returns the number of
// ids outside [0, rows) (then nothing is written) or of rows in an unreadable format.
int64_t qweight_rows(const QWeight* w, const int64_t* ids, int64_t n, float* out) {
  int64_t total = 0, bad = 0;
  for (const QWeight* s = w; s != nullptr; s = s->next) {
    total += s->rows;
    if (s->format == kPacked) bad++;
  }
  for (int64_t i = 0; i < n; i++) bad += ids[i] < 0 || ids[i] >= total;
  if (bad) return bad;
  for (int64_t i = 0; i < n; i++) {
    int64_t r = ids[i];
    const QWeight* s = w;
    while (r >= s->rows) r -= s->rows, s = s->next;
    dequant_any(s->format, static_cast<const uint8_t*>(s->data) + r * s->row_bytes, s->cols,
                out + i * s->cols);
  }
  return 0;
}

}  // extern "C"

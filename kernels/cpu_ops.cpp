// The element-wise and layout kernels of a decoder layer, for x86-64 with AVX2 + FMA +
// F16C, float32: fused residual add + RMSNorm, SwiGLU, RoPE + the q/k/v layout, the KV
// write. Built by kernels/native.py into one library with cpu_attention.cpp (the paged
// attention), cpu_gemm.cpp and cpu_decoder.cpp, which calls these in a layer's order.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

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

}  // namespace

extern "C" {

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

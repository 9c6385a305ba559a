// Every decoder layer of a step in one native call; built by kernels/native.py
// into the same library as cpu_attention.cpp and cpu_gemm.cpp, whose exported functions it
// calls in the order executor_svc/model.py's _Layer.forward calls them.
//
// Why: between a layer's two big phases (the GEMMs stream ~14 MB of weights, attention ~50
// MB of K/V at batch 64) every cache level has been flushed, so each of the ~12 Python and
// torch calls per layer (norms, RoPE, the KV write, views, SiLU, the multiply) starts cold:
// measured in the model, 40-230 us each instead of 5-90 hot, ~25 ms of a 280 ms batch-64
// step, and a larger share of a batch-1 step. Here those calls are plain C++ calls over
// buffers that stay put from step to step. The values are the per-op path's bit for bit:
// the same kernels on the same inputs in the same order (tests/executor/test_model.py).

#include <stdint.h>

#include <chrono>
#include <vector>

extern "C" {
void paged_decode_kv(const float* q, const void* k_cache, const void* v_cache,
                     const int64_t* rows, const int64_t* tables, int64_t table_stride,
                     const int64_t* context_lens, int64_t num_seqs, int64_t num_heads,
                     int64_t num_kv_heads, int64_t block_size, int64_t head_dim, float scale,
                     float* out, int num_threads, int kind, int64_t window);
void add_rms_norm_f32(float* x, const float* delta, const float* w, float* out, int64_t hidden,
                      int64_t tokens, float eps);
void rope_qkv_f32(const float* qkv, const float* cos, const float* sin, float* q_out,
                  float* k_out, float* v_out, int64_t num_heads, int64_t num_kv_heads,
                  int64_t head_dim, int64_t tokens);
int64_t kv_write_kv(const float* k, const float* v, void* k_pool, void* v_pool,
                    const int64_t* slots, int64_t tokens, int64_t row, int64_t num_slots,
                    int kind);
struct QWeight;  // cpu_qgemm.cpp's: packed fp32 or GGUF blocks, row segments
void qweight_gemm(const QWeight* w, const float* x, int64_t ldx_k, int64_t ldx_n, int64_t N,
                  float* c, int64_t ldc_m, int64_t ldc_n, int threads);
void silu_mul_f32(const float* gate, const float* up, float* out, int64_t n, int num_threads);

// One layer's weights: the norms [H] as they are, the projections QWeights (fp32 packed by
// gemm_pack_weight_f32, which goes to gemm_packed_f32 as before, or GGUF blocks) (wqkv [(Hq + 2 Hkv) D, H], wo [H, Hq D], w13 [2 I, H] gate rows then
// up rows, w2 [H, I]); window: the layer's sliding window (kernels/attention.py), 0 for
// full attention.
struct DecoderLayer {
  const float* attn_norm;
  const QWeight* wqkv;
  const QWeight* wo;
  const float* ffn_norm;
  const QWeight* w13;
  const QWeight* w2;
  int64_t window;
};

struct DecoderShape {
  int64_t hidden, inter, num_heads, num_kv_heads, head_dim;
  float eps, scale;
};

// Attention for the step's multi-token chunks (prefill), which the caller runs (torch's
// SDPA: a matmul beats this library's decode kernel there): reads the step buffers q, k, v
// and the pool's layer `layer`, writes the chunks' rows of o (under the layer's window). Returns 0, or nonzero to
// stop the step (the caller keeps the error).
typedef int (*ChunkAttentionFn)(int64_t layer);

// The step's layout, as kernels/numba_backend.py prepares it: sequence i of the num_seqs
// that decode one token has query row rows[i]; every other row belongs to a chunk, whose
// attention `chunks` computes (null when there are none). pool [layers, 2, num_blocks,
// block_size, Hkv, D] contiguous, element type `kind` (0 float32, 1 float16, 2 bfloat16).
// q, o [T, Hq, D] and k, v [T, Hkv, D]: the caller's buffers, so that `chunks` can read and
// write them.
struct DecodeStep {
  int64_t tokens;
  const float* cos;  // [D, T]
  const float* sin;  // [D, T]
  const int64_t* slots;  // [T]
  void* pool;
  int64_t num_blocks, block_size;
  int kind;
  const int64_t* rows;  // [num_seqs]
  const int64_t* tables;  // [num_seqs, table_stride]
  int64_t table_stride;
  const int64_t* context_lens;  // [num_seqs]
  int64_t num_seqs;
  int attention_threads, threads;
  ChunkAttentionFn chunks;
  float *q, *k, *v, *o;
};

// Where the time goes, when the caller asks (phase_seconds not null: seconds are added to
// its entries): a steady_clock read between phases, ~20 ns each, 10 per layer.
enum Phase { kNorms, kMatmuls, kRope, kKvWrite, kAttention, kSwiglu, kPhases };

struct Clock {
  double* out;
  std::chrono::steady_clock::time_point last;
  explicit Clock(double* seconds) : out(seconds) {
    if (out) last = std::chrono::steady_clock::now();
  }
  void lap(Phase phase) {
    if (!out) return;
    const auto now = std::chrono::steady_clock::now();
    out[phase] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

// x [H, T] hidden-major, the embeddings on entry; on return the residual stream after the
// last layer (its FFN output added), ready for the final norm. Returns 0; the number of
// slots outside the pool (then nothing of that layer's K/V was written and x is partial: the
// caller raises, as KVCache.write does); or -1 if `chunks` failed. phase_seconds: null, or
// kPhases doubles (above).
int64_t decode_layers_f32(const DecoderLayer* layers, int64_t num_layers,
                          const DecoderShape* shape, const DecodeStep* step, float* x,
                          double* phase_seconds) {
  const DecoderShape& s = *shape;
  const DecodeStep& st = *step;
  const int64_t t = st.tokens, qd = s.num_heads * s.head_dim, kvd = s.num_kv_heads * s.head_dim;
  const int64_t es = st.kind == 0 ? 4 : 2;
  const int64_t side_bytes = st.num_blocks * st.block_size * kvd * es;
  // Scratch kept across calls: a step allocates nothing once the batch size has been seen.
  static thread_local std::vector<float> buf;
  constexpr int kPieces = 6;
  const int64_t sizes[kPieces] = {s.hidden * t, (qd + 2 * kvd) * t, s.hidden * t,
                                  2 * s.inter * t, s.inter * t, s.hidden * t};
  int64_t total = 0;
  for (int64_t n : sizes) total += (n + 15) / 16 * 16;  // 64-byte aligned pieces
  if (int64_t(buf.size()) < total + 16) buf.resize(total + 16);
  float* base = buf.data();
  base += (16 - (reinterpret_cast<uintptr_t>(base) / 4) % 16) % 16;
  float* piece[kPieces];
  for (int i = 0; i < kPieces; ++i) {
    piece[i] = base;
    base += (sizes[i] + 15) / 16 * 16;
  }
  float *h = piece[0], *qkv = piece[1], *attn = piece[2], *gate_up = piece[3];
  float *act = piece[4], *ffn = piece[5];
  float *q = st.q, *k = st.k, *v = st.v, *o = st.o;

  Clock clock(phase_seconds);
  for (int64_t i = 0; i < num_layers; ++i) {
    const DecoderLayer& L = layers[i];
    char* k_pool = static_cast<char*>(st.pool) + 2 * i * side_bytes;
    char* v_pool = k_pool + side_bytes;
    add_rms_norm_f32(x, i ? ffn : nullptr, L.attn_norm, h, s.hidden, t, s.eps);
    clock.lap(kNorms);
    qweight_gemm(L.wqkv, h, t, 1, t, qkv, t, 1, st.threads);
    clock.lap(kMatmuls);
    rope_qkv_f32(qkv, st.cos, st.sin, q, k, v, s.num_heads, s.num_kv_heads, s.head_dim, t);
    clock.lap(kRope);
    const int64_t bad = kv_write_kv(k, v, k_pool, v_pool, st.slots, t, kvd,
                                    st.num_blocks * st.block_size, st.kind);
    if (bad) return bad;
    clock.lap(kKvWrite);
    paged_decode_kv(q, k_pool, v_pool, st.rows, st.tables, st.table_stride, st.context_lens,
                    st.num_seqs, s.num_heads, s.num_kv_heads, st.block_size, s.head_dim, s.scale,
                    o, st.attention_threads, st.kind, L.window);
    if (st.chunks != nullptr && st.chunks(i) != 0) return -1;
    clock.lap(kAttention);
    // o [T, Hq D] read as its transpose [Hq D, T]: the GEMM packs it column by column.
    qweight_gemm(L.wo, o, 1, qd, t, attn, t, 1, st.threads);
    clock.lap(kMatmuls);
    add_rms_norm_f32(x, attn, L.ffn_norm, h, s.hidden, t, s.eps);
    clock.lap(kNorms);
    qweight_gemm(L.w13, h, t, 1, t, gate_up, t, 1, st.threads);
    clock.lap(kMatmuls);
    silu_mul_f32(gate_up, gate_up + s.inter * t, act, s.inter * t, st.threads);
    clock.lap(kSwiglu);
    qweight_gemm(L.w2, act, t, 1, t, ffn, t, 1, st.threads);
    clock.lap(kMatmuls);
  }
  if (num_layers)
    for (int64_t j = 0; j < s.hidden * t; ++j) x[j] += ffn[j];
  clock.lap(kNorms);
  return 0;
}

}  // extern "C"

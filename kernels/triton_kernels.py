"""The Triton kernels behind kernels/triton_attention.py; importing this module imports triton.

Only triton_attention.py imports it, and only once it has decided triton is usable, so the
rest of the executor runs where triton is absent. Cache layout (executor_svc/kv_cache.py):
``[num_blocks, block_size, Hkv, D]`` per layer, last dim contiguous; position ``p`` of a
sequence lives at block ``table[p // block_size]``, slot ``p % block_size``. Positions are
gathered a tile at a time through the table, so any block size and any table (holes, blocks
out of order) work, and no tile reads a slot past the sequence's context.

Numerics: scores and the softmax run in float32 (exp2 with the scale folded into log2 e).
``DOT_F32`` picks the matmul inputs: float32 or the cache's own 16-bit type (tensor cores).
float32 dots run as "tf32x3" (float32-level error; "ieee" FMA dots took minutes to build
per prefill variant). The interpreter cannot do bfloat16, so under TRITON_INTERPRET the
launchers ask for float32.

Sliding windows (kernels/attention.py): ``SLIDING`` is a constexpr, so full attention
compiles to the kernels it always was; a windowed launch passes ``window`` W and each row
reads only positions p - W < k <= p, its tiles starting at its window (whole tiles before
it are never loaded).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    """a @ b with float32 accumulation; inputs in float32, or in b's (the cache's) 16-bit
    type, to which a (q of the same type, or the float32 probabilities) is cast."""
    if DOT_F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
    else:
        out = tl.dot(a.to(b.dtype), b, out_dtype=tl.float32)
    return out


@triton.jit
def _tile(cache, table_row, pos, live, kv_head, d, d_live, block_size,
          stride_b, stride_s, stride_h):
    """[BLOCK_N, BLOCK_D] cache entries at positions ``pos`` (``live`` ones only, others 0)."""
    block = tl.load(table_row + pos // block_size, mask=live, other=0).to(tl.int64)
    row = block * stride_b + (pos % block_size) * stride_s + kv_head * stride_h
    return tl.load(cache + row[:, None] + d[None, :], mask=live[:, None] & d_live[None, :],
                   other=0.0)


@triton.jit
def decode_split_kernel(
    Q, K, V, TABLES, CTX, QSTART, SEQS, OUT, PART_O, PART_LSE, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_tb, block_size, num_heads, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_F32: tl.constexpr, SLIDING: tl.constexpr,
):
    """One decode row, one KV head (all its GROUP query heads), one split of the context.

    Grid (decode rows, Hkv, NUM_SPLITS). With one split the result goes straight to OUT;
    otherwise each split leaves its normalised output and log2-sum-exp in PART_O / PART_LSE
    ([rows, Hq, NUM_SPLITS, (D)], float32) for ``decode_reduce_kernel``. An empty split (past
    a short context) leaves lse = -inf, which the reduction weighs as zero. Each row cuts its
    own context into NUM_SPLITS tile-aligned pieces, so no launch argument depends on the
    step's lengths (a fixed NUM_SPLITS can be captured in a CUDA graph). SLIDING: the row
    sees positions [ctx - window, ctx) only, and the splits cut that range.
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(SEQS + b)
    ctx = tl.load(CTX + seq)
    row = tl.load(QSTART + seq)
    lo = 0
    if SLIDING:
        lo = tl.maximum(ctx - window, 0)
    split_len = tl.cdiv(tl.cdiv(ctx - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, ctx)

    g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + g
    h_live = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_live = d < HEAD_DIM
    q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=h_live[:, None] & d_live[None, :], other=0.0)
    table_row = TABLES + seq * stride_tb

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        live = pos < end
        k = _tile(K, table_row, pos, live, kv_head, d, d_live, block_size,
                  stride_kb, stride_ks, stride_kh)
        s = _dot(q, tl.trans(k), DOT_F32) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _tile(V, table_row, pos, live, kv_head, d, d_live, block_size,
                  stride_vb, stride_vs, stride_vh)
        acc = acc * alpha[:, None] + _dot(p, v, DOT_F32)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_mask = h_live[:, None] & d_live[None, :]
    if NUM_SPLITS == 1:
        tl.store(OUT + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=o_mask)
    else:
        part = (b * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(PART_O + part[:, None] * HEAD_DIM + d[None, :], out, mask=o_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(PART_LSE + part, lse, mask=h_live)


@triton.jit
def decode_reduce_kernel(
    PART_O, PART_LSE, QSTART, SEQS, OUT, stride_ot, stride_oh, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Grid (decode rows, Hq): merges a row's splits, weighted by 2^(lse - max lse)."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(QSTART + tl.load(SEQS + b))
    s = tl.arange(0, BLOCK_S)
    s_live = s < NUM_SPLITS
    base = (b * num_heads + head) * NUM_SPLITS
    lse = tl.load(PART_LSE + base + s, mask=s_live, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty: the max is finite
    d = tl.arange(0, BLOCK_D)
    d_live = d < HEAD_DIM
    o = tl.load(PART_O + (base + s)[:, None] * HEAD_DIM + d[None, :],
                mask=s_live[:, None] & d_live[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(OUT + row * stride_ot + head * stride_oh + d, out.to(OUT.dtype.element_ty),
             mask=d_live)


@triton.jit
def prefill_kernel(
    Q, K, V, TABLES, CTX, QSTART, SEQS, OUT, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_tb, block_size, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr,
    SLIDING: tl.constexpr,
):
    """Grid (chunks, Hq, query tiles): a tile of one chunk's rows against its paged context.

    Chunk ``c`` is sequence ``SEQS[c]``: rows ``QSTART[seq] : QSTART[seq + 1]`` sit at the
    last positions of its ``CTX[seq]``, so row j (position ctx - n + j) sees the whole cached
    prefix and the chunk causally: keys at positions <= its own, all read from the cache
    (the caller wrote this step's K/V first). Tiles past a short chunk store nothing.
    SLIDING: row j sees only positions > its own - window; the tile's keys start at its first
    row's window.
    """
    c = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    seq = tl.load(SEQS + c)
    row0 = tl.load(QSTART + seq)
    n = tl.load(QSTART + seq + 1) - row0
    ctx = tl.load(CTX + seq)
    kv_head = head // GROUP

    j = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    j_live = j < n
    q_pos = ctx - n + j
    d = tl.arange(0, BLOCK_D)
    d_live = d < HEAD_DIM
    io_mask = j_live[:, None] & d_live[None, :]
    q = tl.load(Q + (row0 + j)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=io_mask, other=0.0)
    table_row = TABLES + seq * stride_tb
    # Keys up to the tile's last live row; a tile wholly past the chunk reads none.
    kv_end = tl.where(tile * BLOCK_M < n, tl.minimum(ctx, ctx - n + (tile + 1) * BLOCK_M), 0)
    kv_start = 0
    if SLIDING:
        kv_start = tl.maximum(ctx - n + tile * BLOCK_M - window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        live = pos < kv_end
        k = _tile(K, table_row, pos, live, kv_head, d, d_live, block_size,
                  stride_kb, stride_ks, stride_kh)
        s = _dot(q, tl.trans(k), DOT_F32) * qk_scale  # [BLOCK_M, BLOCK_N]
        keep = live[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING:
            keep = keep & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
        # Without a window every row sees position 0 in the first tile, so m_new is finite
        # from then on; with one, a row may see nothing in a tile: m_safe keeps that 0 * 0.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _tile(V, table_row, pos, live, kv_head, d, d_live, block_size,
                  stride_vb, stride_vs, stride_vh)
        acc = acc * alpha[:, None] + _dot(p, v, DOT_F32)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(OUT + (row0 + j)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=io_mask)


@triton.jit
def kv_write_kernel(
    K, V, SLOTS, K_CACHE, V_CACHE, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (tokens,): token t's K and V [Hkv, D] into slot SLOTS[t] of both caches, in the
    caches' dtype (K_CACHE and V_CACHE share strides). A negative slot (padding) is skipped."""
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    i = tl.arange(0, BLOCK)
    h = i // HEAD_DIM
    d = i % HEAD_DIM
    live = i < tl.where(slot >= 0, NUM_KV_HEADS * HEAD_DIM, 0)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + h * stride_ch + d
    k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=live, other=0.0)
    tl.store(K_CACHE + dst, k.to(K_CACHE.dtype.element_ty), mask=live)
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=live, other=0.0)
    tl.store(V_CACHE + dst, v.to(V_CACHE.dtype.element_ty), mask=live)

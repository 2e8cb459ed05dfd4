"""The prefix-prefill kernel, composed from :mod:`pagedprefill.triton.blocks`.

One program computes one tile: ``BLOCK_M`` rows, each a (new token, query head) pair, where
``HEADS_PER_TILE`` query heads of one KV group share the tile so that every K/V tile is loaded once for
all of them (GQA packing). The program walks the keys it can see in two phases, the cached prefix (paged)
and the new tokens (dense), and in each phase runs the mask-free middle tiles without mask arithmetic and
only the edge tiles (window start, cache tail, causal diagonal) with masks. Tiles wholly outside the
sliding window are never visited.

Backends differ only by the :class:`~pagedprefill.tiling.TileConfig` their policy picks (tile sizes,
warps, pipelining depth, packing, whether to split masked tiles), never by a copy of this body.
"""

import triton
import triton.language as tl

from .blocks import (
    LOG2E,
    aligned,
    cache_kv_offsets,
    finish_rows,
    load_keys,
    load_values,
    logits,
    new_kv_offsets,
    online_softmax_step,
    round_to_fp8_e4m3,
    scalar_or_load,
    split_range,
    tile_pages,
    tile_rows,
    tile_sequence,
    visible,
)


@triton.jit
def _cache_phase(acc, m_i, l_i, q, q_pos, alibi2, start, end, kv_len, window, softcap, qk_scale,
                 K_cache, V_cache, block_row_ptr, stride_table_col, table_width, num_blocks, block_size, kv_head,
                 offs_d, d_mask, stride_kb, stride_kh, stride_kd, stride_kt, stride_kx,
                 stride_vb, stride_vh, stride_vd, stride_vt,
                 X: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                 WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, EVEN_D: tl.constexpr, SPLIT_CACHE: tl.constexpr):
    """Attend to cached positions ``[start, end)`` of the paged cache, ``BLOCK_N`` at a time.

    ``kv_len`` is how many positions the cache holds for the sequence; ``CAUSAL`` masks keys after each
    row's own position (needed only when the new tokens' keys are read from the cache too).
    """
    offs_n = tl.arange(0, BLOCK_N)
    if PAGE_SIZE > 0:
        page_size = PAGE_SIZE
    else:
        page_size = block_size
    # Block numbers are read one tile ahead: no K/V address then depends on a load of its own iteration,
    # and the software pipeliner streams cached tiles with asynchronous copies as it does dense ones.
    pages = tile_pages(block_row_ptr, stride_table_col, table_width, num_blocks, start, page_size,
                       BLOCK_N, PAGE_SIZE)
    for n0 in range(start, end, BLOCK_N):
        next_pages = tile_pages(block_row_ptr, stride_table_col, table_width, num_blocks, n0 + BLOCK_N, page_size,
                                BLOCK_N, PAGE_SIZE)
        pos = n0 + offs_n
        k_valid = pos < kv_len
        k_off, v_off = cache_kv_offsets(pages, pos, page_size, kv_head, offs_d,
                                        stride_kb, stride_kh, stride_kd, stride_kt, stride_kx,
                                        stride_vb, stride_vh, stride_vd, stride_vt, X)
        k = load_keys(K_cache + k_off, k_valid, d_mask, MASKED, EVEN_D)
        # Cached addresses are always inside the cache (pages and slots are clamped), so masked split-layout
        # tiles may load whole and zero the keys past the end.
        v = load_values(V_cache + v_off, k_valid, d_mask, MASKED, EVEN_D, SPLIT_CACHE)
        s = logits(q, k.to(q.dtype), qk_scale, softcap, alibi2, q_pos, pos, SOFTCAP, ALIBI, DOT_PRECISION)
        if MASKED:
            s = tl.where(visible(q_pos, pos, k_valid, window, CAUSAL, WINDOW), s, float("-inf"))
        acc, m_i, l_i = online_softmax_step(s, v.to(q.dtype), acc, m_i, l_i, DOT_PRECISION)
        pages = next_pages
    return acc, m_i, l_i


@triton.jit
def _new_phase(acc, m_i, l_i, q, q_pos, alibi2, start, end, ctx_len, q_len, seq_row0, num_tokens, window,
               softcap, qk_scale, K, V, kv_head, offs_d, d_mask, stride_kt, stride_kh, stride_vt, stride_vh,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
               SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr):
    """Attend to new tokens ``[start, end)`` (indices within the sequence's new tokens)."""
    offs_n = tl.arange(0, BLOCK_N)
    for j0 in range(start, end, BLOCK_N):
        j = j0 + offs_n
        rows = seq_row0 + j
        k_off, v_off = new_kv_offsets(rows, kv_head, offs_d, stride_kt, stride_kh, stride_vt, stride_vh)
        pos = ctx_len + j
        k_valid = (j < q_len) & (rows >= 0) & (rows < num_tokens)
        k = load_keys(K + k_off, k_valid, d_mask, MASKED, EVEN_D)
        v = load_values(V + v_off, k_valid, d_mask, MASKED, EVEN_D)
        s = logits(q, k, qk_scale, softcap, alibi2, q_pos, pos, SOFTCAP, ALIBI, DOT_PRECISION)
        if MASKED:
            s = tl.where(visible(q_pos, pos, k_valid, window, CAUSAL, WINDOW), s, float("-inf"))
        acc, m_i, l_i = online_softmax_step(s, v, acc, m_i, l_i, DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def prefix_prefill_kernel(
    Q, K, V, Out, K_cache, V_cache, block_table, query_start, seq_lens, ctx_lens, alibi_slopes, sinks,
    k_scale_ptr, v_scale_ptr, out_scale_ptr,
    sm_scale, k_scale, v_scale, out_scale, softcap, window,
    num_seqs, num_tokens, num_blocks, table_width, block_size, group_size,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_ckb, stride_ckh, stride_ckd, stride_ckt, stride_ckx,
    stride_cvb, stride_cvh, stride_cvd, stride_cvt,
    stride_table_seq, stride_table_col,
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr, X: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_PER_TILE: tl.constexpr, HEAD_CHUNKS: tl.constexpr,
    SPLIT_MASKS: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    SINKS: tl.constexpr, K_SCALE_PTR: tl.constexpr, V_SCALE_PTR: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SPLIT_CACHE: tl.constexpr, K_ALIGN: tl.constexpr, V_ALIGN: tl.constexpr,
    CAUSAL: tl.constexpr, SKIP_DECODE: tl.constexpr, NEW_KV_IN_CACHE: tl.constexpr, OUT_SCALE: tl.constexpr,
    OUT_SCALE_PTR: tl.constexpr, OUT_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    TOKENS_PER_TILE: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    EVEN_D: tl.constexpr = HEAD_SIZE == HEAD_SIZE_PADDED
    seq, tok0, seq_row0, ctx_len, q_len, done = tile_sequence(tl.program_id(0), query_start, seq_lens, ctx_lens,
                                                              num_seqs, TOKENS_PER_TILE, SKIP_DECODE)
    if done:
        return
    kv_head = tl.program_id(1) // HEAD_CHUNKS
    chunk = tl.program_id(1) % HEAD_CHUNKS

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    d_mask = offs_d < HEAD_SIZE
    head, q_rows, row_ok, q_pos = tile_rows(offs_m, tok0, kv_head, chunk, group_size, seq_row0, ctx_len, q_len,
                                            num_tokens, HEADS_PER_TILE, TOKENS_PER_TILE)

    q_off = q_rows.to(tl.int64)[:, None] * stride_qt + head.to(tl.int64)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(Q + q_off, mask=row_ok[:, None] & d_mask[None, :], other=0.0)

    k_scale_v = scalar_or_load(k_scale, k_scale_ptr, K_SCALE_PTR)
    v_scale_v = scalar_or_load(v_scale, v_scale_ptr, V_SCALE_PTR)
    # FP8 scales are folded, never applied per element: k_scale into the cached keys' logit scale, v_scale
    # into the accumulator once the cached phase is done (new tokens' K/V are not quantised).
    if SOFTCAP:
        qk_scale = sm_scale
    else:
        qk_scale = sm_scale * LOG2E
    qk_scale_cache = qk_scale * k_scale_v
    alibi2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ALIBI:
        alibi2 = tl.load(alibi_slopes + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E

    # The launcher guarantees these strides are multiples of K_ALIGN / V_ALIGN elements (the unit strides,
    # K's innermost and V's slot (split) or head dim (NHD), are left alone).
    stride_ckb = aligned(stride_ckb, K_ALIGN)
    stride_ckh = aligned(stride_ckh, K_ALIGN)
    stride_ckd = aligned(stride_ckd, K_ALIGN)
    stride_ckt = aligned(stride_ckt, K_ALIGN)
    stride_cvb = aligned(stride_cvb, V_ALIGN)
    stride_cvh = aligned(stride_cvh, V_ALIGN)
    if SPLIT_CACHE:
        stride_cvd = aligned(stride_cvd, V_ALIGN)
    else:
        stride_cvt = aligned(stride_cvt, V_ALIGN)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)

    tok_last = tl.minimum(tok0 + TOKENS_PER_TILE, q_len) - 1
    pos_first = ctx_len + tok0
    pos_last = ctx_len + tok_last
    # Lowest key any row of the tile sees; with a window, keys below it are skipped entirely.
    lo = 0
    if WINDOW:
        lo = tl.maximum(pos_first - window + 1, 0)
    # Keys every row sees (no window mask needed) start here:
    full_from = 0
    if WINDOW:
        full_from = tl.maximum(pos_last - window + 1, 0)

    # Cached phase. With the new tokens' K/V already written to the cache it covers them too (causally).
    if NEW_KV_IN_CACHE:
        kv_len = ctx_len + q_len
        if CAUSAL:
            c_end = pos_last + 1
            full_to = pos_first + 1
        else:
            c_end = kv_len
            full_to = kv_len
    else:
        kv_len = ctx_len
        c_end = ctx_len
        full_to = ctx_len
    block_row_ptr = block_table + seq.to(tl.int64) * stride_table_seq
    c_start = (lo // BLOCK_N) * BLOCK_N
    # A table without columns or a cache without blocks holds nothing to read, whatever ctx_len claims.
    c_end = tl.where((table_width > 0) & (num_blocks > 0), c_end, 0)
    if SPLIT_MASKS:
        a, b = split_range(c_start, c_end, full_from, full_to, BLOCK_N)
    else:
        a, b = c_start, c_start
    CACHE_CAUSAL: tl.constexpr = NEW_KV_IN_CACHE and CAUSAL
    acc, m_i, l_i = _cache_phase(acc, m_i, l_i, q, q_pos, alibi2, c_start, a, kv_len, window, softcap,
                                 qk_scale_cache, K_cache, V_cache, block_row_ptr, stride_table_col, table_width,
                                 num_blocks, block_size, kv_head, offs_d, d_mask,
                                 stride_ckb, stride_ckh, stride_ckd, stride_ckt, stride_ckx,
                                 stride_cvb, stride_cvh, stride_cvd, stride_cvt,
                                 X, BLOCK_N, True, CACHE_CAUSAL, WINDOW, SOFTCAP, ALIBI, DOT_PRECISION, PAGE_SIZE,
                                 EVEN_D, SPLIT_CACHE)
    acc, m_i, l_i = _cache_phase(acc, m_i, l_i, q, q_pos, alibi2, a, b, kv_len, window, softcap,
                                 qk_scale_cache, K_cache, V_cache, block_row_ptr, stride_table_col, table_width,
                                 num_blocks, block_size, kv_head, offs_d, d_mask,
                                 stride_ckb, stride_ckh, stride_ckd, stride_ckt, stride_ckx,
                                 stride_cvb, stride_cvh, stride_cvd, stride_cvt,
                                 X, BLOCK_N, False, CACHE_CAUSAL, WINDOW, SOFTCAP, ALIBI, DOT_PRECISION, PAGE_SIZE,
                                 EVEN_D, SPLIT_CACHE)
    acc, m_i, l_i = _cache_phase(acc, m_i, l_i, q, q_pos, alibi2, b, c_end, kv_len, window, softcap,
                                 qk_scale_cache, K_cache, V_cache, block_row_ptr, stride_table_col, table_width,
                                 num_blocks, block_size, kv_head, offs_d, d_mask,
                                 stride_ckb, stride_ckh, stride_ckd, stride_ckt, stride_ckx,
                                 stride_cvb, stride_cvh, stride_cvd, stride_cvt,
                                 X, BLOCK_N, True, CACHE_CAUSAL, WINDOW, SOFTCAP, ALIBI, DOT_PRECISION, PAGE_SIZE,
                                 EVEN_D, SPLIT_CACHE)
    acc = acc * v_scale_v

    if not NEW_KV_IN_CACHE:
        # New tokens, indexed from 0 within the sequence: causally up to the tile's last token, or all.
        n_start = (tl.maximum(lo - ctx_len, 0) // BLOCK_N) * BLOCK_N
        # Mask-free tiles must also lie inside q/k/v whatever the metadata says.
        in_tensors = tl.where(seq_row0 >= 0, num_tokens - seq_row0, 0)
        if CAUSAL:
            n_end = tok_last + 1
            full_to = tl.minimum(tok0 + 1, in_tensors)
        else:
            n_end = q_len
            full_to = tl.minimum(q_len, in_tensors)
        if SPLIT_MASKS:
            a, b = split_range(n_start, n_end, full_from - ctx_len, full_to, BLOCK_N)
        else:
            a, b = n_start, n_start
        acc, m_i, l_i = _new_phase(acc, m_i, l_i, q, q_pos, alibi2, n_start, a, ctx_len, q_len, seq_row0,
                                   num_tokens, window, softcap, qk_scale, K, V, kv_head, offs_d, d_mask, stride_kt,
                                   stride_kh, stride_vt, stride_vh, BLOCK_N, True, CAUSAL, WINDOW, SOFTCAP, ALIBI,
                                   DOT_PRECISION, EVEN_D)
        acc, m_i, l_i = _new_phase(acc, m_i, l_i, q, q_pos, alibi2, a, b, ctx_len, q_len, seq_row0,
                                   num_tokens, window, softcap, qk_scale, K, V, kv_head, offs_d, d_mask, stride_kt,
                                   stride_kh, stride_vt, stride_vh, BLOCK_N, False, CAUSAL, WINDOW, SOFTCAP, ALIBI,
                                   DOT_PRECISION, EVEN_D)
        acc, m_i, l_i = _new_phase(acc, m_i, l_i, q, q_pos, alibi2, b, n_end, ctx_len, q_len, seq_row0,
                                   num_tokens, window, softcap, qk_scale, K, V, kv_head, offs_d, d_mask, stride_kt,
                                   stride_kh, stride_vt, stride_vh, BLOCK_N, True, CAUSAL, WINDOW, SOFTCAP, ALIBI,
                                   DOT_PRECISION, EVEN_D)

    sink2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINKS:
        sink2 = tl.load(sinks + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    inv_out_scale = 1.0
    if OUT_SCALE:
        inv_out_scale = 1.0 / scalar_or_load(out_scale, out_scale_ptr, OUT_SCALE_PTR)
    out = finish_rows(acc, m_i, l_i, sink2, inv_out_scale, SINKS)
    if OUT_SCALE:
        out = round_to_fp8_e4m3(out, OUT_MAX)  # quantised output saturates
    o_off = q_rows.to(tl.int64)[:, None] * stride_ot + head.to(tl.int64)[:, None] * stride_oh + offs_d[None, :]
    tl.store(Out + o_off, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])

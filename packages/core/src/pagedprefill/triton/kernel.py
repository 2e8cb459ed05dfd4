"""The prefix-prefill kernel, composed from :mod:`pagedprefill.triton.blocks` and the key ranges and masks of
:mod:`pagedprefill.triton.masks`.

One program computes one tile: ``BLOCK_M`` rows, each a (new token, query head) pair, where
``HEADS_PER_TILE`` query heads of one KV group share the tile so that every K/V tile is loaded once for
all of them (GQA packing). The program walks the keys it can see in two phases, the cached prefix (paged)
and the new tokens (dense), and in each phase runs the mask-free middle tiles without mask arithmetic and
only the edge tiles (window start, cache tail, causal diagonal) with masks. Tiles wholly outside the
sliding window are never visited.

Backends differ only by the :class:`~pagedprefill.tiling.TileConfig` their policy picks (tile sizes,
warps, pipelining depth, packing, whether to split masked tiles), never by a copy of this body.
"""

from collections import namedtuple

import triton
import triton.language as tl

from .arguments import VARYING_EXTENTS
from .blocks import (
    FP8_E4M3_MAX,
    LOG2E,
    aligned_cache_strides,
    cache_kv_offsets,
    finish_rows,
    load_keys,
    load_values,
    logits,
    new_kv_offsets,
    online_softmax_step,
    partial_index,
    partial_rows,
    round_to_fp8_e4m3,
    scalar_or_load,
    tile_pages,
    tile_rows,
    tile_sequence,
    widen_query,
)
from .masks import new_token_keys, split_range, split_tiles, visible, visible_keys

# Groups the kernel builds for its phases (the launcher's groups are in :mod:`.arguments`).
#: The tile's queries: ``q`` ``[M, D]``, each row's key position ``pos`` (-1 for rows that do not exist) and
#: ALiBi slope times log2(e).
QueryTile = namedtuple("QueryTile", ["q", "pos", "alibi_slope_log2"])
#: How raw scores become logits: the scale (with k_scale for cached keys), the softcap, the window.
Scoring = namedtuple("Scoring", ["qk_scale", "softcap", "window"])
#: The cache as one sequence sees it: tensors, its block-table row, bounds, page size (a constexpr when
#: page-wise) and the aligned strides.
PagedCache = namedtuple("PagedCache", ["key", "value", "table_row", "table_col_stride", "table_width", "num_blocks",
                                       "page_size", "key_strides", "value_strides"])
#: The new tokens' keys and values of one sequence: tensors, strides, the sequence's first row, its context
#: length, and how many of its new tokens lie inside ``k``/``v`` (its query length, for valid metadata).
NewKV = namedtuple("NewKV", ["k", "v", "k_strides", "v_strides", "seq_row0", "ctx_len", "in_bounds_len"])


@triton.jit
def _attend(state, query, k, v, k_pos, k_valid, scoring, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
            TILE: tl.constexpr, FEATURES: tl.constexpr):
    """Fold one key tile into the softmax ``state``: the query tile's logits with keys ``k`` (converted to the
    query's dtype, which an FP8 cache needs), the masks where ``MASKED``, then one online-softmax step with
    values ``v``."""
    DOT_PRECISION: tl.constexpr = TILE.DOT_PRECISION
    SOFTCAP: tl.constexpr = FEATURES.SOFTCAP
    ALIBI: tl.constexpr = FEATURES.ALIBI
    WINDOW: tl.constexpr = FEATURES.WINDOW
    q_dtype = query.q.dtype
    s = logits(query, k.to(q_dtype), k_pos, scoring, SOFTCAP, ALIBI, DOT_PRECISION)
    if MASKED:
        s = tl.where(visible(query.pos, k_pos, k_valid, scoring.window, CAUSAL, WINDOW), s, float("-inf"))
    return online_softmax_step(s, v.to(q_dtype), state, DOT_PRECISION)


@triton.jit
def _cache_phase(state, query, scoring, paged, kv_head, offs_d, d_mask, start, end, kv_len,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, TILE: tl.constexpr,
                 LAYOUT: tl.constexpr, FEATURES: tl.constexpr):
    """Attend to cached positions ``[start, end)`` of the paged cache, ``BLOCK_N`` at a time.

    ``kv_len`` is how many positions the cache holds for the sequence; ``CAUSAL`` masks keys after each
    row's own position (needed only when the new tokens' keys are read from the cache too).
    """
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    SPLIT: tl.constexpr = LAYOUT.SPLIT
    offs_n = tl.arange(0, BLOCK_N)
    # Block numbers are read one tile ahead: no K/V address then depends on a load of its own iteration,
    # and the software pipeliner streams cached tiles with asynchronous copies as it does dense ones.
    pages = tile_pages(paged, start, BLOCK_N, LAYOUT)
    for n0 in range(start, end, BLOCK_N):
        next_pages = tile_pages(paged, n0 + BLOCK_N, BLOCK_N, LAYOUT)
        pos = n0 + offs_n
        k_valid = pos < kv_len
        k_off, v_off = cache_kv_offsets(pages, pos, paged, kv_head, offs_d, LAYOUT)
        k = load_keys(paged.key + k_off, k_valid, d_mask, MASKED, EVEN_D)
        # Cached addresses are always inside the cache (pages and slots are clamped), so masked split-layout
        # tiles may load whole and zero the keys past the end.
        v = load_values(paged.value + v_off, k_valid, d_mask, MASKED, EVEN_D, SPLIT)
        state = _attend(state, query, k, v, pos, k_valid, scoring, MASKED, CAUSAL, TILE, FEATURES)
        pages = next_pages
    return state


@triton.jit
def _new_phase(state, query, scoring, new_kv, kv_head, offs_d, d_mask, start, end,
               MASKED: tl.constexpr, EVEN_D: tl.constexpr, TILE: tl.constexpr, FEATURES: tl.constexpr):
    """Attend to new tokens ``[start, end)`` (indices within the sequence's new tokens)."""
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    CAUSAL: tl.constexpr = FEATURES.CAUSAL
    offs_n = tl.arange(0, BLOCK_N)
    for j0 in range(start, end, BLOCK_N):
        j = j0 + offs_n
        rows = new_kv.seq_row0 + j
        k_off, v_off = new_kv_offsets(rows, kv_head, offs_d, new_kv.k_strides, new_kv.v_strides)
        pos = new_kv.ctx_len + j
        k_valid = j < new_kv.in_bounds_len  # and j >= 0: the caller's loop bounds are in [0, in_bounds_len]
        k = load_keys(new_kv.k + k_off, k_valid, d_mask, MASKED, EVEN_D)
        v = load_values(new_kv.v + v_off, k_valid, d_mask, MASKED, EVEN_D)
        state = _attend(state, query, k, v, pos, k_valid, scoring, MASKED, CAUSAL, TILE, FEATURES)
    return state


@triton.jit(do_not_specialize=VARYING_EXTENTS)
def prefix_prefill_kernel(
    tokens, cache, batch, per_head, scale_tensors, partials,
    scales, softcap, window, num_seqs, num_tokens, num_blocks, table_width, block_size, group_size, token_strides,
    cache_strides,
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr, TILE: tl.constexpr, LAYOUT: tl.constexpr,
    FEATURES: tl.constexpr, SCALE_FROM_TENSOR: tl.constexpr,
):
    """Prefix-prefill attention; the argument groups are described in :mod:`pagedprefill.triton.arguments`."""
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    HEADS_PER_TILE: tl.constexpr = TILE.HEADS_PER_TILE
    CAUSAL: tl.constexpr = FEATURES.CAUSAL
    WINDOW: tl.constexpr = FEATURES.WINDOW
    NEW_KV_IN_CACHE: tl.constexpr = FEATURES.NEW_KV_IN_CACHE
    TOKENS_PER_TILE: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    EVEN_D: tl.constexpr = HEAD_SIZE == HEAD_SIZE_PADDED
    SKIP_DECODE: tl.constexpr = FEATURES.SKIP_DECODE
    seq, tok0, seq_row0, ctx_len, q_len, done = tile_sequence(tl.program_id(0), batch.query_start, batch.seq_lens,
                                                              batch.context_lens, num_seqs, TOKENS_PER_TILE,
                                                              SKIP_DECODE, FEATURES.CONTEXT_FROM_STARTS)
    if done:
        return
    kv_head = tl.program_id(1) // TILE.HEAD_CHUNKS
    chunk = tl.program_id(1) % TILE.HEAD_CHUNKS

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    d_mask = offs_d < HEAD_SIZE
    head, q_rows, row_ok, q_pos = tile_rows(offs_m, tok0, kv_head, chunk, group_size, seq_row0, ctx_len,
                                            q_len, num_tokens, HEADS_PER_TILE, TOKENS_PER_TILE)
    # A sequence whose first row is negative reads no new key (``in_bounds_len`` below): none of its rows is
    # written, as a row without any key would be 0 / 0.
    row_ok = row_ok & (seq_row0 >= 0)

    q_strides = token_strides.q
    q_off = q_rows.to(tl.int64)[:, None] * q_strides.token + head.to(tl.int64)[:, None] * q_strides.head \
        + offs_d[None, :]
    QUERY_WIDENED_TO: tl.constexpr = FEATURES.QUERY_WIDENED_TO
    q = widen_query(tl.load(tokens.q + q_off, mask=row_ok[:, None] & d_mask[None, :], other=0.0), QUERY_WIDENED_TO)

    K_SCALE_FROM_TENSOR: tl.constexpr = SCALE_FROM_TENSOR.K
    V_SCALE_FROM_TENSOR: tl.constexpr = SCALE_FROM_TENSOR.V
    k_scale = scalar_or_load(scales.k, scale_tensors.k, K_SCALE_FROM_TENSOR)
    v_scale = scalar_or_load(scales.v, scale_tensors.v, V_SCALE_FROM_TENSOR)
    # FP8 scales are folded, never applied per element: k_scale into the cached keys' logit scale, v_scale
    # into the accumulator once the cached phase is done (new tokens' K/V are not quantised).
    if FEATURES.SOFTCAP:
        qk_scale = scales.softmax
    else:
        qk_scale = scales.softmax * LOG2E
    if SCALE_FROM_TENSOR.Q:  # an FP8 q's descale, given as a tensor (as a number it is in scales.softmax)
        qk_scale = qk_scale * tl.load(scale_tensors.q).to(tl.float32)
    qk_scale_cache = qk_scale * k_scale
    alibi_slope_log2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if FEATURES.ALIBI:
        alibi_slope_log2 = tl.load(per_head.alibi_slopes + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    query = QueryTile(q, q_pos, alibi_slope_log2)

    key_strides, value_strides = aligned_cache_strides(cache_strides, LAYOUT)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)
    state = (acc, m_i, l_i)

    tok_last = tl.minimum(tok0 + TOKENS_PER_TILE, q_len) - 1
    # Keys below lo are never visited (the window); every row sees those from full_from on without a window
    # mask. The cached phase covers the new tokens too when their K/V are in the cache already (causally).
    lo, full_from, c_end, full_to, kv_len = visible_keys(ctx_len, q_len, tok0, tok_last, window, CAUSAL, WINDOW,
                                                         NEW_KV_IN_CACHE)
    table_row = cache.block_table + seq.to(tl.int64) * cache_strides.table.seq
    if LAYOUT.PAGEWISE:
        page_size = LAYOUT.PAGE_SIZE
    else:
        page_size = block_size
    paged = PagedCache(cache.key, cache.value, table_row, cache_strides.table.col, table_width, num_blocks, page_size,
                       key_strides, value_strides)
    c_start = (lo // BLOCK_N) * BLOCK_N
    # A table without columns or a cache without blocks holds nothing to read, whatever ctx_len claims.
    c_end = tl.where((table_width > 0) & (num_blocks > 0), c_end, 0)
    KEY_SPLITS: tl.constexpr = TILE.KEY_SPLITS
    if KEY_SPLITS > 1:
        # This program's share of the walk (cached tiles, then new ones); its rows become partial rows.
        n_start, n_end, new_full_to, in_bounds_len = new_token_keys(lo, ctx_len, q_len, tok0, tok_last, seq_row0,
                                                                    num_tokens, BLOCK_N, CAUSAL, NEW_KV_IN_CACHE)
        cache_first, cache_count, new_first, new_count = split_tiles(
            tl.cdiv(tl.maximum(c_end - c_start, 0), BLOCK_N), tl.cdiv(tl.maximum(n_end - n_start, 0), BLOCK_N),
            tl.program_id(2), KEY_SPLITS)
        c_start = c_start + cache_first * BLOCK_N
        c_end = tl.minimum(c_start + cache_count * BLOCK_N, c_end)
        n_start = n_start + new_first * BLOCK_N
        n_end = tl.minimum(n_start + new_count * BLOCK_N, n_end)
    if TILE.SPLIT_MASKS:
        free_start, free_end = split_range(c_start, c_end, full_from, full_to, BLOCK_N)
    else:
        free_start, free_end = c_start, c_start
    CACHE_CAUSAL: tl.constexpr = NEW_KV_IN_CACHE and CAUSAL
    cache_scoring = Scoring(qk_scale_cache, softcap, window)
    state = _cache_phase(state, query, cache_scoring, paged, kv_head, offs_d, d_mask, c_start, free_start, kv_len,
                         True, CACHE_CAUSAL, EVEN_D, TILE, LAYOUT, FEATURES)
    state = _cache_phase(state, query, cache_scoring, paged, kv_head, offs_d, d_mask, free_start, free_end, kv_len,
                         False, CACHE_CAUSAL, EVEN_D, TILE, LAYOUT, FEATURES)
    state = _cache_phase(state, query, cache_scoring, paged, kv_head, offs_d, d_mask, free_end, c_end, kv_len,
                         True, CACHE_CAUSAL, EVEN_D, TILE, LAYOUT, FEATURES)
    acc, m_i, l_i = state
    state = (acc * v_scale, m_i, l_i)

    if not NEW_KV_IN_CACHE:
        if KEY_SPLITS == 1:  # (found here, not before the cached phase: fewer values live across its loop)
            n_start, n_end, new_full_to, in_bounds_len = new_token_keys(lo, ctx_len, q_len, tok0, tok_last, seq_row0,
                                                                        num_tokens, BLOCK_N, CAUSAL, NEW_KV_IN_CACHE)
        if TILE.SPLIT_MASKS:
            free_start, free_end = split_range(n_start, n_end, full_from - ctx_len, new_full_to, BLOCK_N)
        else:
            free_start, free_end = n_start, n_start
        new_kv = NewKV(tokens.k, tokens.v, token_strides.k, token_strides.v, seq_row0, ctx_len, in_bounds_len)
        scoring = Scoring(qk_scale, softcap, window)
        state = _new_phase(state, query, scoring, new_kv, kv_head, offs_d, d_mask, n_start, free_start,
                           True, EVEN_D, TILE, FEATURES)
        state = _new_phase(state, query, scoring, new_kv, kv_head, offs_d, d_mask, free_start, free_end,
                           False, EVEN_D, TILE, FEATURES)
        state = _new_phase(state, query, scoring, new_kv, kv_head, offs_d, d_mask, free_end, n_end,
                           True, EVEN_D, TILE, FEATURES)

    acc, m_i, l_i = state
    if KEY_SPLITS > 1:
        # The combine launch (:mod:`.combine`) adds the sinks, normalises across the splits and stores the output.
        num_heads = (tl.num_programs(1) // TILE.HEAD_CHUNKS) * group_size
        part, lse = partial_rows(acc, m_i, l_i)
        index = partial_index(tl.program_id(2), q_rows, head, num_tokens, num_heads)
        tl.store(partials.lse + index, lse, mask=row_ok)
        tl.store(partials.out + index[:, None] * HEAD_SIZE_PADDED + offs_d[None, :], part, mask=row_ok[:, None])
        return
    SINKS: tl.constexpr = FEATURES.SINKS
    OUT_SCALE: tl.constexpr = FEATURES.OUT_SCALE
    OUT_SCALE_FROM_TENSOR: tl.constexpr = SCALE_FROM_TENSOR.OUT
    sink_log2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINKS:
        sink_log2 = tl.load(per_head.sinks + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    inv_out_scale = 1.0
    if OUT_SCALE:
        inv_out_scale = 1.0 / scalar_or_load(scales.out, scale_tensors.out, OUT_SCALE_FROM_TENSOR)
    out = finish_rows(acc, m_i, l_i, sink_log2, inv_out_scale, SINKS)
    if OUT_SCALE:
        out = round_to_fp8_e4m3(out, FP8_E4M3_MAX)  # quantised output saturates
    o_strides = token_strides.out
    o_off = q_rows.to(tl.int64)[:, None] * o_strides.token + head.to(tl.int64)[:, None] * o_strides.head \
        + offs_d[None, :]
    out_ptr = tokens.out
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])

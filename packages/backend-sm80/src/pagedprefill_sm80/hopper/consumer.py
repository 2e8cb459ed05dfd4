"""The Hopper kernel's consumer partitions: for each key tile, ``S = Q K^T`` as a warpgroup MMA straight from
shared memory (on FP8 operands under ``FP8_SCORES``), one online-softmax step in registers (core's
:func:`~pagedprefill.triton.blocks.scale_logits` and :func:`~pagedprefill.triton.blocks.softmax_step`), and
``O += P V`` with P in registers; then the epilogue (:mod:`.epilogue`).

A consumer never waits for a load the producer could have issued earlier and meets no CTA-wide barrier in the
key loop. Under ``PINGPONG`` each of two consumer warpgroups is a partition of its own with half of the tile's
rows, so that the two do not wait for each other at every key tile and one's softmax runs under the other's
MMAs.
"""

from pagedprefill.triton.blocks import LOG2E, scalar_or_load, scale_logits, softmax_step, tile_rows
from pagedprefill.triton.masks import cached_length, visible, walk_tile
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .epilogue import merge_if_last, store_partials, store_rows

#: Under ``LAZY_RESCALE``, how far (log2 units) a tile's maximum may exceed a row's running max before the max
#: moves and the accumulator is rescaled: P's entries then stay at most 2^8.
RESCALE_GROWTH = gl.constexpr(8.0)


@gluon.jit
def wait_tile(cfg, ring, it, from_cache):
    """Wait until key tile ``it`` has landed in its buffer. Cached tiles the producer wrote with its own
    instructions (``WRITTEN``) are ordinary shared-memory writes: fenced before the MMA's reads."""
    ring.keys.wait_ready(it)
    if cfg.WRITTEN:
        if from_cache:
            fence_async_shared()


@gluon.jit
def hand_back(cfg, ring, tiles):
    """Hand each of ``tiles`` buffers back as it lands, reading none of it: what a consumer whose rows hold no
    query does, so that the other consumer and the producer keep their pace. It waits for each tile (not only
    arrives) because the ring's release counts arrivals: an arrival ahead of the other consumer's would free a
    buffer it still reads."""
    for it in range(tiles):
        ring.keys.wait_ready(it)
        ring.keys.release(it)
        if cfg.SCHEDULE.SOFTMAX_UNDER_PV:  # the values' buffers have barriers of their own
            ring.values.wait_ready(it)
            ring.values.release(it)


#: Rows of a V tile (keys) or of a V^T page (head columns, every key of the page) cleared per step by
#: :func:`clear_stale_values`: slices small enough to pass through the consumer's registers beside its
#: accumulator.
CLEAR_ROWS = gl.constexpr(32)
CLEAR_ROWS_T = gl.constexpr(16)


@gluon.jit
def clear_stale_values(cfg, values, valid_keys, KEYS_ON_COLUMNS: gl.constexpr):
    """Zero the values of the tile's keys from ``valid_keys`` on, in ``values`` (``[BLOCK_N, HEAD_SIZE]``, or a
    V^T page ``[HEAD_SIZE, BLOCK_N]`` with ``KEYS_ON_COLUMNS``): the slots past a sequence's keys that a page box
    brought in. A cache may hold anything there (an engine's never-written or reused slots, NaN in an FP8 byte
    pattern among them), and a masked key's P of 0 times a NaN or an infinite value is NaN. Both consumers may
    clear one tile: they write the same zeros, and each fences its own writes before its MMA reads them."""
    rows: gl.constexpr = values.shape[0]
    cols: gl.constexpr = values.shape[1]
    STEP: gl.constexpr = CLEAR_ROWS_T if KEYS_ON_COLUMNS else CLEAR_ROWS
    if KEYS_ON_COLUMNS:
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [cfg.CONSUMER_WARPS, 1], [1, 0])
    else:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [cfg.CONSUMER_WARPS, 1], [1, 0])
    for c in gl.static_range(rows // STEP):
        part = values.slice(c * STEP, STEP)
        if KEYS_ON_COLUMNS:
            keys = gl.expand_dims(gl.arange(0, cols, gl.SliceLayout(0, layout)), 0)
        else:
            keys = gl.expand_dims(c * STEP + gl.arange(0, STEP, gl.SliceLayout(1, layout)), 1)
        stale = keys >= valid_keys
        if KEYS_ON_COLUMNS or (c + 1) * STEP > valid_keys:
            tile = part.load(layout)
            part.store(gl.where(stale, gl.zeros_like(tile), tile))
    fence_async_shared()
    gl.thread_barrier()  # every warp's zeros are in before the warpgroup's MMA reads the tile


@gluon.jit
def scores_mma(cfg, q_smem, k_tile, s_layout: gl.constexpr, WAIT: gl.constexpr = True):
    """``S = Q K^T`` for one key tile (``k_tile``: ``[BLOCK_N, HEAD_SIZE]``) over the head's columns only: a padded
    head as two chained MMAs over its panels (``WIDE`` and ``NARROW`` columns), so that the zero columns past
    it cost the tensor cores nothing. Without ``WAIT`` the MMA is left in flight for the caller's
    ``warpgroup_mma_wait``; the panels always wait (the one caller that overlaps, ``SOFTMAX_UNDER_PV``, runs on
    heads that fill the tile)."""
    zeros = gl.zeros([cfg.ROWS, cfg.BLOCK_N], gl.float32, s_layout)
    if cfg.PANELS:
        gl.static_assert(WAIT, "scores over panels are waited for: no caller keeps them in flight")
        scores = warpgroup_mma(q_smem.slice(0, cfg.WIDE, dim=1), k_tile.slice(0, cfg.WIDE, dim=1).permute((1, 0)),
                               zeros, use_acc=False, is_async=True)
        scores = warpgroup_mma(q_smem.slice(cfg.WIDE, cfg.NARROW, dim=1),
                               k_tile.slice(cfg.WIDE, cfg.NARROW, dim=1).permute((1, 0)), scores, is_async=True)
        scores = warpgroup_mma_wait(0, deps=[scores])
    elif WAIT:
        scores = warpgroup_mma(q_smem, k_tile.permute((1, 0)), zeros, use_acc=False)
    else:
        scores = warpgroup_mma(q_smem, k_tile.permute((1, 0)), zeros, use_acc=False, is_async=True)
    return scores


@gluon.jit
def values_mma_panels(cfg, p_wide, p_narrow, values, acc, acc_narrow):
    """``O += P V`` for a padded head, one MMA per panel: ``values`` is the tile's ``[BLOCK_N, HEAD_SIZE]`` operand
    (V rows, or a V^T page permuted), ``acc`` and ``acc_narrow`` the accumulators of its ``WIDE`` and ``NARROW``
    columns, ``p_wide`` and ``p_narrow`` P in each one's operand layout. Returns both accumulators."""
    acc = warpgroup_mma(p_wide, values.slice(0, cfg.WIDE, dim=1), acc, is_async=True)
    acc_narrow = warpgroup_mma(p_narrow, values.slice(cfg.WIDE, cfg.NARROW, dim=1), acc_narrow, is_async=True)
    return warpgroup_mma_wait(0, deps=[acc, acc_narrow])


@gluon.jit
def rescaled(acc, alpha, o_layout: gl.constexpr):
    """The accumulator ``acc`` with each row times ``alpha`` (an online-softmax step's correction)."""
    return acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)


@gluon.jit
def softmax_tile(cfg, scores, m_i, l_i, it, q_pos, alibi2, offs_n, rows, walk, kv_len, window, softcap,
                 qk_scale,
                 p_layout: gl.constexpr, p_dtype: gl.constexpr):
    """One online-softmax step on the raw scores of key tile ``it`` of ``walk``: log2-domain logits, the masks
    only where the tile needs them (past the keys, the causal diagonal, the window's start), the running max and
    sum, and P as the next MMA's operand (core's :func:`~pagedprefill.triton.masks.walk_tile` and
    :func:`~pagedprefill.triton.masks.visible`). ``kv_len``: the positions the cache holds for the sequence. Under
    ``FUSED_SCALE`` (without softcap and ALiBi, which need the scaled scores) the scale is folded into each key's
    exponent.

    Returns ``(P, alpha, m, l)``; the caller rescales its accumulator by ``alpha``.
    """
    features: gl.constexpr = cfg.FEATURES
    n0, key_end, needs_mask = walk_tile(it, walk.cache_start, walk.cache_tiles, walk.new_start, rows.ctx_len,
                                        rows.q_len, kv_len, walk.pos_first, walk.full_from, cfg.BLOCK_N,
                                        features.CAUSAL, features.WINDOW, features.NEW_KV_IN_CACHE)
    k_pos = n0 + offs_n
    SCALE_IN_EXP: gl.constexpr = cfg.SCHEDULE.FUSED_SCALE and not features.SOFTCAP and not features.ALIBI
    scores = scale_logits(scores, k_pos, q_pos, alibi2, qk_scale, softcap, features.SOFTCAP, features.ALIBI,
                          SCALE_IN_EXP)
    if needs_mask:
        scores = gl.where(visible(q_pos, k_pos, k_pos < key_end, window, features.CAUSAL, features.WINDOW), scores,
                          float("-inf"))
    MAX_GROWTH: gl.constexpr = RESCALE_GROWTH if cfg.SCHEDULE.LAZY_RESCALE else 0.0
    p, alpha, m_new, l_i = softmax_step(scores, m_i, l_i, qk_scale, SCALE_IN_EXP, MAX_GROWTH)
    return gl.convert_layout(p.to(p_dtype), p_layout), alpha, m_new, l_i


@gluon.jit
def clear_if_last_cached(cfg, ring, walk, kv_len, it):
    """Clear the stale values of key tile ``it`` where the cached keys end inside it (:func:`clear_stale_values`):
    its page boxes brought in slots past them."""
    if it < walk.cache_tiles:
        valid_keys = kv_len - (walk.cache_start + it * cfg.BLOCK_N)
        if valid_keys < cfg.BLOCK_N:
            clear_stale_values(cfg, ring.v.index(ring.stage(it)), valid_keys, False)


@gluon.jit
def softmax_under_values(cfg, q_smem, ring, walk, kv_len, acc, m_i, l_i, q_pos, alibi2, offs_n, rows, window,
                         softcap, qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr,
                         p_layout: gl.constexpr):
    """The key loop under ``SOFTMAX_UNDER_PV`` (the NHD layout's 16-bit tiles, a head that fills the tile): for
    tile ``it``, ``Q K^T`` and the previous tile's ``P V`` are issued together, the keys handed back once the scores
    are in, and tile ``it``'s softmax runs while ``P V`` is in flight; the accumulator is rescaled when it lands and
    the previous tile's values handed back. The first tile's scores come alone, the last tile's ``P V`` after the
    loop. The accumulator is rescaled on every tile (``LAZY_RESCALE`` does not apply). Returns ``(acc, m, l)``."""
    tiles = walk.cache_tiles + walk.new_tiles
    p_op = gl.zeros([cfg.ROWS, cfg.BLOCK_N], ring.v.dtype, p_layout)
    if tiles > 0:
        ring.keys.wait_ready(0)
        scores = scores_mma(cfg, q_smem, ring.k.index(0), s_layout)
        gl.thread_barrier()  # every warp's scores are in: one arrival hands the keys back
        ring.keys.release(0)
        p_op, alpha, m_i, l_i = softmax_tile(cfg, scores, m_i, l_i, 0, q_pos, alibi2, offs_n, rows, walk, kv_len,
                                             window, softcap, qk_scale, p_layout, ring.v.dtype)
    for it in range(1, tiles):
        ring.keys.wait_ready(it)
        scores = scores_mma(cfg, q_smem, ring.k.index(ring.stage(it)), s_layout, WAIT=False)
        ring.values.wait_ready(it - 1)
        clear_if_last_cached(cfg, ring, walk, kv_len, it - 1)
        acc = warpgroup_mma(p_op, ring.v.index(ring.stage(it - 1)), acc, is_async=True)
        # The older group, the scores, is in; P V may still run.
        scores = warpgroup_mma_wait(1, deps=[scores])
        gl.thread_barrier()
        ring.keys.release(it)
        p_op, alpha, m_i, l_i = softmax_tile(cfg, scores, m_i, l_i, it, q_pos, alibi2, offs_n, rows, walk, kv_len,
                                             window, softcap, qk_scale, p_layout, ring.v.dtype)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()
        ring.values.release(it - 1)
        acc = rescaled(acc, alpha, o_layout)
    if tiles > 0:
        last = tiles - 1
        ring.values.wait_ready(last)
        clear_if_last_cached(cfg, ring, walk, kv_len, last)
        acc = warpgroup_mma(p_op, ring.v.index(ring.stage(last)), acc)
        gl.thread_barrier()
        ring.values.release(last)
    return acc, m_i, l_i


@gluon.jit
def consumer(cfg, consumed, q_smem, ROW0: gl.constexpr):
    """Consume the ring for rows ``ROW0 .. ROW0 + ROWS`` of the tile (``q_smem`` holds those rows): scores,
    online softmax and ``P V`` per key tile; then normalise and store (:func:`~.epilogue.store_rows`).

    ``consumed`` is what every consumer reads: ``(ring, rows, walk, per_head, scoring, scales, output)``, with
    ``per_head`` core's ALiBi slopes and sinks, ``scoring`` ``(window, softcap, qk_scale)`` (``qk_scale`` has
    ``log2(e)`` folded in unless there is a softcap), ``scales`` core's ``Scales`` and ``ScaleTensors``, ``output``
    ``(out, its row strides, core's Partials, the splits' arrival counters)``. An FP8 cache's ``k_scale`` is
    folded into the cached tiles' logit scale and ``v_scale`` into the accumulator once the cached tiles (which
    come first) are done.
    """
    # Cached values in the V^T ring: the split layout's, unless an FP8 cache's are widened into the V ring.
    CACHED_VT: gl.constexpr = cfg.LAYOUT.SPLIT and not cfg.SCHEDULE.WIDEN_TO_V
    ring, rows, walk, per_head, scoring, scales, output = consumed
    window, softcap, qk_scale = scoring
    values, tensors = scales
    if cfg.SCALE_FROM_TENSOR.Q:  # an FP8 q's descale, given as a tensor (as a number it is in qk_scale)
        qk_scale = qk_scale * gl.load(tensors.q).to(gl.float32)
    qk_scale_cache = qk_scale
    v_scale = 1.0
    if cfg.LAYOUT.FP8_CACHE:
        qk_scale_cache = qk_scale * scalar_or_load(values.k, tensors.k, cfg.SCALE_FROM_TENSOR.K)
        v_scale = scalar_or_load(values.v, tensors.v, cfg.SCALE_FROM_TENSOR.V)
    # An MMA instruction takes 32 bytes of each row: 16 keys' columns of 16-bit operands, 32 of FP8 ones.
    SCORES_K: gl.constexpr = 256 // q_smem.dtype.primitive_bitwidth
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[cfg.CONSUMER_WARPS, 1],
                                                       instr_shape=[16, cfg.BLOCK_N, SCORES_K])
    # The accumulator of the head's columns, or of a padded head's wide panel (and beside it the narrow one's).
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[cfg.CONSUMER_WARPS, 1],
                                                       instr_shape=[16, cfg.WIDE, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    on_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[cfg.CONSUMER_WARPS, 1],
                                                        instr_shape=[16, cfg.NARROW if cfg.PANELS else cfg.WIDE, 16])
    pn_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=on_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    key_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    head, out_rows, row_ok, q_pos = tile_rows(ROW0 + gl.arange(0, cfg.ROWS, row_s), rows.tok0, rows.kv_head,
                                              rows.chunk, rows.group_size, rows.seq_row0, rows.ctx_len, rows.q_len,
                                              rows.num_tokens, cfg.TILE.HEADS_PER_TILE, cfg.TOKENS_PER_TILE)
    alibi2 = gl.zeros([cfg.ROWS], gl.float32, row_s)
    if cfg.FEATURES.ALIBI:
        alibi2 = gl.load(per_head[0] + head, mask=row_ok, other=0.0).to(gl.float32) * LOG2E
    m_i = gl.full([cfg.ROWS], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([cfg.ROWS], gl.float32, row_s)
    acc = gl.zeros([cfg.ROWS, cfg.WIDE], gl.float32, o_layout)
    if cfg.PANELS:
        acc_narrow = gl.zeros([cfg.ROWS, cfg.NARROW], gl.float32, on_layout)
    offs_n = gl.arange(0, cfg.BLOCK_N, key_s)
    kv_len = cached_length(rows.ctx_len, rows.q_len, cfg.FEATURES.NEW_KV_IN_CACHE)

    cache_tiles = walk.cache_tiles
    # Under IDLE_HALF a consumer whose first row's token is past the sequence's (the second half of a decode or
    # speculative row's tile, a short last tile) holds no query row: it runs no MMA and only hands buffers back.
    idle = False
    if cfg.SCHEDULE.IDLE_HALF and ROW0 > 0:
        idle = rows.tok0 + ROW0 // cfg.TILE.HEADS_PER_TILE >= rows.q_len
    if idle:
        hand_back(cfg, ring, cache_tiles + walk.new_tiles)
    else:
        if cfg.SCHEDULE.SOFTMAX_UNDER_PV:
            acc, m_i, l_i = softmax_under_values(cfg, q_smem, ring, walk, kv_len, acc, m_i, l_i, q_pos, alibi2,
                                                 offs_n, rows, window, softcap, qk_scale, s_layout, o_layout,
                                                 p_layout)
        else:
            for it in range(cache_tiles + walk.new_tiles):
                s = ring.stage(it)
                from_cache = it < cache_tiles
                wait_tile(cfg, ring, it, from_cache)
                if from_cache:
                    # The cached keys end inside this tile: its page boxes brought in slots past them. Cleared before
                    # the scores, while only the accumulator and the row statistics hold registers.
                    valid_keys = kv_len - (walk.cache_start + it * cfg.BLOCK_N)
                    if valid_keys < cfg.BLOCK_N:
                        if CACHED_VT:
                            clear_stale_values(cfg, ring.vt.index(s), valid_keys, True)
                        else:
                            clear_stale_values(cfg, ring.v.index(s), valid_keys, False)
                if cfg.LAYOUT.FP8_CACHE:
                    if it == cache_tiles:  # the cached tiles are done: their values' scale, once
                        acc = acc * v_scale
                        if cfg.PANELS:
                            acc_narrow = acc_narrow * v_scale
                scores = scores_mma(cfg, q_smem, ring.k.index(s), s_layout)
                tile_scale = qk_scale
                if cfg.LAYOUT.FP8_CACHE and from_cache:
                    tile_scale = qk_scale_cache
                m_old = m_i
                p_op, alpha, m_i, l_i = softmax_tile(cfg, scores, m_i, l_i, it, q_pos, alibi2, offs_n, rows, walk,
                                                     kv_len, window, softcap, tile_scale, p_layout, ring.v.dtype)
                max_moved = True
                if cfg.SCHEDULE.LAZY_RESCALE:
                    # alpha is exactly 1 on every row whose max stayed: one vote of the consumer's rows decides.
                    max_moved = gl.max((m_i != m_old).to(gl.int32), 0) > 0
                if max_moved:
                    acc = rescaled(acc, alpha, o_layout)
                    if cfg.PANELS:
                        acc_narrow = rescaled(acc_narrow, alpha, on_layout)
                # Cached values arrive transposed (V^T pages) in their own ring, new tokens' values as rows.
                if cfg.PANELS:
                    p_narrow = gl.convert_layout(p_op, pn_layout)
                    if CACHED_VT and from_cache:
                        acc, acc_narrow = values_mma_panels(cfg, p_op, p_narrow, ring.vt.index(s).permute((1, 0)), acc,
                                                            acc_narrow)
                    else:
                        acc, acc_narrow = values_mma_panels(cfg, p_op, p_narrow, ring.v.index(s), acc, acc_narrow)
                elif CACHED_VT and from_cache:
                    acc = warpgroup_mma(p_op, ring.vt.index(s).permute((1, 0)), acc)
                else:
                    acc = warpgroup_mma(p_op, ring.v.index(s), acc)
                # Every warp of this consumer is done with the buffer (its MMAs are synchronous): one arrival for all.
                gl.thread_barrier()
                ring.keys.release(it)
        if cfg.LAYOUT.FP8_CACHE:
            if walk.new_tiles == 0:  # no new tile followed the cached ones
                acc = acc * v_scale
                if cfg.PANELS:
                    acc_narrow = acc_narrow * v_scale

        if cfg.TILE.KEY_SPLITS > 1:
            store_partials(cfg, acc, 0, m_i, l_i, head, out_rows, row_ok, rows, output, o_layout)
            if cfg.PANELS:
                store_partials(cfg, acc_narrow, cfg.WIDE, m_i, l_i, head, out_rows, row_ok, rows, output, on_layout)
            merge_if_last(cfg, head, out_rows, row_ok, rows, per_head, scales, output, o_layout, on_layout,
                          ROW0 // cfg.ROWS)
        else:
            store_rows(cfg, acc, 0, m_i, l_i, head, out_rows, row_ok, per_head, scales, output, o_layout)
            if cfg.PANELS:
                store_rows(cfg, acc_narrow, cfg.WIDE, m_i, l_i, head, out_rows, row_ok, per_head, scales, output,
                           on_layout)

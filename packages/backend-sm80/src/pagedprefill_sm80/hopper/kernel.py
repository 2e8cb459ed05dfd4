"""The Hopper (sm90) prefix-prefill kernel: warp-specialised, TMA-fed, warpgroup MMA.

One program computes the same tile as core's portable kernel (``BLOCK_M`` rows of (new token, query head)
pairs, ``HEADS_PER_TILE`` heads of one KV group packed together), with the work split by role, each role a
module of its own:

* the **producer** (:mod:`.producer`, with the loads of each cache layout in :mod:`.loads`): a warp (or a
  warpgroup) with few registers that reads the block table and brings each key tile's K and V into a ring of
  ``STAGES`` shared-memory buffers;
* the **consumers** (:mod:`.consumer`): one or two warpgroups running the MMAs and the online softmax, and the
  **epilogue** (:mod:`.epilogue`) that stores their rows.

This module composes them: it finds the tile's sequence and rows (core's tile order and schedule,
:func:`~pagedprefill.triton.blocks.program_tile` and :func:`~pagedprefill.triton.blocks.tile_sequence`: heaviest
tiles first under ``HEAVY_FIRST``), the key tiles it visits (:func:`key_walk`: core's key ranges,
:mod:`pagedprefill.triton.masks`, counted in tiles), loads the Q tile, allocates the ring and its barriers, and
starts the partitions. Arguments are core's groups and this kernel's own (:mod:`.arguments`); the
partitions share :mod:`.state`'s aggregates. A head size that is not a power of two (96) runs on the next power of
two, its boxes and copies reading the columns past the head as zeros.

Every TMA box is bounds-checked by the hardware against the tensor it was described on, table columns and block
numbers are clamped, and query rows outside ``q`` are masked, so inconsistent metadata cannot read or write
outside the caller's tensors.
"""

from pagedprefill.triton.arguments import VARYING_EXTENTS
from pagedprefill.triton.blocks import program_tile, tile_rows, tile_sequence
from pagedprefill.triton.masks import new_token_keys, split_tiles, visible_keys
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .consumer import consumer
from .producer import producer
from .state import KernelConfig, KeyWalk, Ring, Sources, TileRows, allocate_channel


@gluon.constexpr_function
def compute_dtype(q_dtype, widened_to):
    """The 16-bit type a call computes in: ``q``'s, or the one an FP8 q is widened to (core's
    ``Features.QUERY_WIDENED_TO``)."""
    return {"float16": gl.float16, "bfloat16": gl.bfloat16}.get(str(widened_to), q_dtype)


@gluon.jit
def allocate_ring(cfg, v_cache_t, k_cache, dtype: gl.constexpr):
    """The ring's buffers and barriers (:class:`~.state.Ring`), initialised. ``v_cache_t`` names the layout of
    the split layout's V^T page boxes, ``k_cache`` an FP8 cache's element type. Under ``FP8_SCORES`` the K ring
    holds the cache's FP8 keys, which the NHD layout's boxes land there directly (no FP8 ring for them)."""
    STAGES: gl.constexpr = cfg.TILE.STAGES
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([cfg.BLOCK_N, cfg.HEAD_SIZE], dtype)
    if cfg.SCHEDULE.FP8_SCORES:
        k_dtype: gl.constexpr = k_cache.dtype
        k_smem = gl.allocate_shared_memory(k_dtype, [STAGES, cfg.BLOCK_N, cfg.HEAD_SIZE],
                                           gl.NVMMASharedLayout.get_default_for([cfg.BLOCK_N, cfg.HEAD_SIZE], k_dtype))
    else:
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, cfg.BLOCK_N, cfg.HEAD_SIZE], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, cfg.BLOCK_N, cfg.HEAD_SIZE], kv_layout)
    if cfg.LAYOUT.SPLIT and cfg.SCHEDULE.WIDEN_TO_V:
        vt_smem = v_smem  # not read: every tile's values are widened or copied into the V ring
    elif cfg.LAYOUT.SPLIT:
        if cfg.LAYOUT.FP8_CACHE:  # widened by the producer into the layout the MMA reads best
            vt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([cfg.HEAD_SIZE, cfg.BLOCK_N], dtype)
        elif cfg.PADDED:  # the boxes' rank-3 layout, seen as the [D, BLOCK_N] tile it fills
            vt_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=v_cache_t.layout.swizzle_byte_width,
                                                           element_bitwidth=dtype.primitive_bitwidth, rank=2)
        else:  # cached values as V^T pages by TMA: [D, BLOCK_N], each page a column block of the box's swizzle
            vt_layout: gl.constexpr = v_cache_t.layout
        vt_smem = gl.allocate_shared_memory(dtype, [STAGES, cfg.HEAD_SIZE, cfg.BLOCK_N], vt_layout)
    else:
        vt_smem = v_smem
    if cfg.LAYOUT.FP8_CACHE:
        # Cached tiles in FP8 as they arrive; the producer widens each into the 16-bit ring.
        c_dtype: gl.constexpr = k_cache.dtype
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([cfg.BLOCK_N, cfg.HEAD_SIZE], c_dtype)
        gl.static_assert(not cfg.SCHEDULE.FP8_BOXES or (cfg.LAYOUT.SPLIT and not cfg.PADDED),
                         "FP8_BOXES: the split layout's FP8 cache at a head size that is a power of two")
        if cfg.SCHEDULE.FP8_BOXES:
            # One whole block per box, the pages one after another: the keys' [D / X, box, X] (seen as rows of X)
            # and the values' V^T [D, box].
            X: gl.constexpr = cfg.LAYOUT.X
            k8_smem = gl.allocate_shared_memory(c_dtype, [STAGES, cfg.HEAD_SIZE // X * cfg.BLOCK_N, X],
                                                gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8,
                                                                     rank=2))
            v8_smem = gl.allocate_shared_memory(c_dtype, [STAGES, cfg.BLOCK_N // cfg.BOX * cfg.HEAD_SIZE, cfg.BOX],
                                                v_cache_t.layout)
        else:
            if cfg.SCHEDULE.FP8_SCORES and not cfg.LAYOUT.SPLIT:
                k8_smem = k_smem  # not read: the keys' boxes land in the K ring
            else:
                k8_smem = gl.allocate_shared_memory(c_dtype, [STAGES, cfg.BLOCK_N, cfg.HEAD_SIZE], c_layout)
            if cfg.LAYOUT.SPLIT:  # the values as V^T pages, [D, BLOCK_N], by 16-byte copies
                vt8_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([cfg.HEAD_SIZE, cfg.BLOCK_N], c_dtype)
                v8_smem = gl.allocate_shared_memory(c_dtype, [STAGES, cfg.HEAD_SIZE, cfg.BLOCK_N], vt8_layout)
            else:
                v8_smem = gl.allocate_shared_memory(c_dtype, [STAGES, cfg.BLOCK_N, cfg.HEAD_SIZE], c_layout)
    else:
        k8_smem = k_smem
        v8_smem = v_smem
    # Value boxes issued before the keys' loads: a cached tile's barrier then waits for the boxes' expect and for
    # an arrival after the keys' stores (a new-token tile's arrives twice at once). FP8_SCORES (NHD): for the keys'
    # boxes' expect and an arrival after the values are widened.
    TWO_ARRIVALS: gl.constexpr = cfg.SCHEDULE.VALUES_FIRST or (cfg.SCHEDULE.FP8_SCORES and not cfg.LAYOUT.SPLIT)
    keys = allocate_channel(STAGES, 2 if TWO_ARRIVALS else 1, cfg.CONSUMERS)
    ready8 = keys.ready  # an FP8 cache: the FP8 ring's own barriers (its bytes landed), seen by the producer only
    if cfg.LAYOUT.FP8_CACHE:
        ready8 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready8.index(i), count=1)
    values = keys
    if cfg.SCHEDULE.SOFTMAX_UNDER_PV:
        gl.static_assert(not TWO_ARRIVALS and not cfg.WRITTEN and not cfg.PANELS,
                         "SOFTMAX_UNDER_PV: the NHD layout's 16-bit boxes at a head size that fills the tile")
        values = allocate_channel(STAGES, 1, cfg.CONSUMERS)
    fence_async_shared()
    return Ring(k_smem, v_smem, vt_smem, k8_smem, v8_smem, keys, values, ready8)


@gluon.jit
def key_walk(cfg, rows, window, table_width, num_blocks):
    """The key tiles the query tile visits (:class:`~.state.KeyWalk`): the cached prefix from the first tile
    the window reaches, then the new tokens up to the causal diagonal, or (their K/V in the cache) one cached
    walk over both. With split keys, this program's share of that walk (core's
    :func:`~pagedprefill.triton.masks.split_tiles`): the producer and the consumers walk it as they would a
    whole one.

    The ranges are core's (:mod:`pagedprefill.triton.masks`, as the portable kernel's); the walk differs in its
    form. The producer and the consumers count tiles in one loop, so each part is a first key and a number of
    tiles (each tile then judged by core's :func:`~pagedprefill.triton.masks.walk_tile`); and the new tokens'
    range is the metadata's, not cut to k/v (``IN_TENSORS`` off): their TMA boxes are bounds-checked by the
    hardware."""
    ctx_len, q_len, tok0 = rows.ctx_len, rows.q_len, rows.tok0
    tok_last = gl.minimum(tok0 + cfg.TOKENS_PER_TILE, q_len) - 1
    lo, full_from, cache_end, _, _ = visible_keys(ctx_len, q_len, tok0, tok_last, window, cfg.FEATURES.CAUSAL,
                                                  cfg.FEATURES.WINDOW, cfg.FEATURES.NEW_KV_IN_CACHE)
    cache_start = (lo // cfg.BLOCK_N) * cfg.BLOCK_N
    cache_tiles = gl.cdiv(gl.maximum(cache_end - cache_start, 0), cfg.BLOCK_N)
    # A table without columns or a cache without blocks holds nothing to read, whatever ctx_len claims.
    cache_tiles = gl.where((table_width > 0) & (num_blocks > 0), cache_tiles, 0)
    new_start = 0
    new_tiles = 0
    if not cfg.FEATURES.NEW_KV_IN_CACHE:
        new_start, new_end, _, _ = new_token_keys(lo, ctx_len, q_len, tok0, tok_last, rows.seq_row0, rows.num_tokens,
                                                  cfg.BLOCK_N, cfg.FEATURES.CAUSAL, cfg.FEATURES.NEW_KV_IN_CACHE, False)
        new_tiles = gl.cdiv(gl.maximum(new_end - new_start, 0), cfg.BLOCK_N)
    if cfg.TILE.KEY_SPLITS > 1:
        cache_first, cache_tiles, new_first, new_tiles = split_tiles(cache_tiles, new_tiles, gl.program_id(2),
                                                                     cfg.TILE.KEY_SPLITS)
        cache_start = cache_start + cache_first * cfg.BLOCK_N
        new_start = new_start + new_first * cfg.BLOCK_N
    return KeyWalk(cache_start, cache_tiles, new_start, new_tiles, ctx_len + tok0, full_from)


@gluon.jit(do_not_specialize=VARYING_EXTENTS)
def hopper_prefill_kernel(
    tokens, k_cache, v_cache, k_new, v_new, v_cache_t, cache, batch, per_head, scale_tensors, partials, arrivals,
    qk_scale, scales, softcap, window, num_seqs, num_tokens, num_blocks, table_width, block_size, group_size, strides,
    TILE: gl.constexpr, LAYOUT: gl.constexpr, FEATURES: gl.constexpr, SCALE_FROM_TENSOR: gl.constexpr,
    SCHEDULE: gl.constexpr,
):
    """Prefix-prefill attention of one query tile on sm90 (see the module docstring).

    NHD cache: ``k_cache``/``v_cache`` are TMA descriptors over the cache viewed as ``[blocks * PAGE, Hkv * D]``
    (rank 3, ``[.., Hkv, D]``, for a padded head unless ``WIDE_BOXES``). Split cache: ``cache.key`` is the key
    cache itself, copied or loaded 16 bytes at a time with ``strides``' key strides, and ``v_cache_t`` a TMA
    descriptor over the value cache viewed as ``[blocks * Hkv * D, PAGE]``; under ``FP8_BOXES`` ``k_cache``
    describes the key cache by pages.
    ``k_new``/``v_new`` describe the new tokens' K/V viewed as ``[T, Hkv * D]``. Descriptors a layout or feature
    does not use are placeholders. ``arrivals``: with split keys, one zeroed int32 counter per (tile, head chunk,
    consumer) of the grid (:func:`~.epilogue.merge_if_last`); a placeholder otherwise.
    """
    cfg = KernelConfig(TILE, LAYOUT, FEATURES, SCALE_FROM_TENSOR, SCHEDULE)
    tile = program_tile(gl.program_id(0), gl.num_programs(0), SCHEDULE.HEAVY_FIRST)
    seq, tok0, seq_row0, ctx_len, q_len, done = tile_sequence(tile, batch[0], batch[1], batch[2], num_seqs,
                                                              cfg.TOKENS_PER_TILE, FEATURES.SKIP_DECODE,
                                                              FEATURES.CONTEXT_FROM_STARTS)
    if done:
        return
    kv_head = gl.program_id(1) // TILE.HEAD_CHUNKS
    chunk = gl.program_id(1) % TILE.HEAD_CHUNKS
    rows = TileRows(tok0, kv_head, chunk, group_size, seq_row0, num_tokens, ctx_len, q_len)

    # Rows of the tile: (token, head) pairs, read from q with ordinary loads (any strides, any packing).
    Q = tokens[0]
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [cfg.CONSUMER_WARPS, 1], [1, 0])
    offs_m = gl.arange(0, TILE.BLOCK_M, gl.SliceLayout(1, load_layout))
    offs_d = gl.arange(0, cfg.HEAD_SIZE, gl.SliceLayout(0, load_layout))
    head, q_rows, row_ok, _ = tile_rows(offs_m, tok0, kv_head, chunk, group_size, seq_row0, ctx_len, q_len,
                                        num_tokens, TILE.HEADS_PER_TILE, cfg.TOKENS_PER_TILE)
    q_off = (gl.expand_dims(q_rows.to(gl.int64) * strides.q.token + head.to(gl.int64) * strides.q.head, 1)
             + gl.expand_dims(offs_d, 0))
    q_ok = gl.expand_dims(row_ok, 1)
    if cfg.PADDED:
        # Columns past a padded head are zeros: the keys' columns there (zeros too) add nothing to the scores.
        q_ok = q_ok & gl.expand_dims(offs_d < LAYOUT.HEAD_DIM, 0)
    q = gl.load(Q + q_off, mask=q_ok, other=0.0)
    # The 16-bit type of the MMAs' operands (the V ring, P), whatever q's type.
    dtype: gl.constexpr = compute_dtype(Q.dtype.element_ty, FEATURES.QUERY_WIDENED_TO)
    if not SCHEDULE.FP8_SCORES:  # an FP8 q is widened exactly, its descale in the logits' scale
        q = q.to(dtype)

    walk = key_walk(cfg, rows, window, table_width, num_blocks)

    q_smem = gl.allocate_shared_memory(q.dtype, [TILE.BLOCK_M, cfg.HEAD_SIZE],
                                       gl.NVMMASharedLayout.get_default_for([TILE.BLOCK_M, cfg.HEAD_SIZE], q.dtype), q)
    ring = allocate_ring(cfg, v_cache_t, k_cache, dtype)
    table = (cache[2] + seq.to(gl.int64) * strides.table_seq, table_width, num_blocks)
    sources = Sources(k_cache, v_cache, k_new, v_new, v_cache_t,
                      (cache[0], strides.key_block, strides.key_head, strides.key_chunk),
                      (cache[1], strides.value_rows_per_block, strides.value_row))
    # What every consumer reads, and what the producer does: each partition's arguments, written once.
    consumed = (ring, rows, walk, per_head, (window, softcap, qk_scale), (scales, scale_tensors),
                (tokens[3], strides.out, partials, arrivals))
    produced = (cfg, sources, ring, table, rows, walk)
    if SCHEDULE.PINGPONG:
        gl.warp_specialize([
            (consumer, (cfg, consumed, q_smem.slice(0, cfg.ROWS), 0)),
            (consumer, (cfg, consumed, q_smem.slice(cfg.ROWS, cfg.ROWS), cfg.ROWS)),
            (producer, produced),
        ], [cfg.CONSUMER_WARPS, SCHEDULE.PRODUCER_WARPS], [SCHEDULE.CONSUMER_REGS, SCHEDULE.PRODUCER_REGS])
    else:
        gl.warp_specialize([(consumer, (cfg, consumed, q_smem, 0)), (producer, produced)],
                           [SCHEDULE.PRODUCER_WARPS], [SCHEDULE.PRODUCER_REGS])

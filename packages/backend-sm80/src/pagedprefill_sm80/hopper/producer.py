"""The Hopper kernel's producer partition: fills the ring with each key tile's K and V, in the order the
consumers drain it (:class:`~.state.KeyWalk`).

For each tile it waits until the tile's buffer is free (``empty``), issues the copies (:mod:`.loads`) and lets
the ``ready`` barrier count their bytes (TMA) and their completion (asynchronous copies, stores). An FP8 cache's
tiles land in an FP8 ring first, up to ``STAGES`` tiles ahead, and the producer's warps widen each into the
16-bit ring once, for both consumers.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier

from .loads import (
    cached_boxes,
    copy_rows,
    split_boxed_tile,
    split_keys_async,
    split_keys_loaded,
    split_tile_keys,
    split_value_boxes,
    split_values_async,
    widen,
)


@gluon.jit
def split_cached_tile(cfg, sources, table, kv_head, col, n0, barrier, k_dst, vt_dst, VALUE_COPIES: gl.constexpr,
                      EARLY_KEYS: gl.constexpr, loaded):
    """One split-layout tile of cached keys into ``k_dst`` (``[BLOCK_N, D]``: 16-byte copies, or under the
    schedule's ``KEY_LOADS`` loads and stores, that many keys per chunk) and of its values into ``vt_dst`` as V^T
    (``[D, BLOCK_N]``): one TMA box per page, or with ``VALUE_COPIES`` (an FP8 cache) 16-byte copies. ``barrier``
    completes once every copy has landed. Under ``VALUES_FIRST`` the boxes are issued before the keys are loaded,
    and ``barrier`` takes two arrivals, the boxes' expect and one after the keys' stores. ``EARLY_KEYS``: the keys
    were loaded before the buffer was free, ``loaded`` (:func:`~.loads.split_tile_keys`; unread otherwise); only
    their stores are left."""
    v_cache_t, split_keys, split_values = sources.v_cache_t, sources.split_keys, sources.split_values
    v_rows_per_block = split_values[1]
    if cfg.SCHEDULE.VALUES_FIRST:
        mbarrier.expect(barrier, cfg.tile_bytes(v_cache_t.dtype))
        split_value_boxes(cfg, v_cache_t, table, kv_head, col, n0, v_rows_per_block, barrier, vt_dst)
    if EARLY_KEYS:
        first, second = loaded
        k_dst.slice(0, cfg.SCHEDULE.KEY_LOADS).store(first)
        if cfg.BLOCK_N > cfg.SCHEDULE.KEY_LOADS:
            k_dst.slice(cfg.SCHEDULE.KEY_LOADS, cfg.SCHEDULE.KEY_LOADS).store(second)
    elif cfg.SCHEDULE.KEY_LOADS:
        split_keys_loaded(cfg, split_keys, k_dst, table, kv_head, n0)
    else:
        split_keys_async(cfg, split_keys, k_dst, table, kv_head, n0)
    if VALUE_COPIES:
        split_values_async(cfg, split_values, vt_dst, table, kv_head, n0)
    # Arrives once this lane's copies have landed; issued before the TMA's expect, so the barrier cannot
    # complete on the value bytes alone.
    async_copy.mbarrier_arrive(barrier)
    if cfg.SCHEDULE.KEY_LOADS:
        # The keys are ordinary stores: ordered before the MMA's reads, and every producer warp's done before
        # the one arrival below.
        fence_async_shared()
        gl.thread_barrier()
    if VALUE_COPIES or cfg.SCHEDULE.VALUES_FIRST:
        mbarrier.arrive(barrier, count=1)
    else:
        mbarrier.expect(barrier, cfg.tile_bytes(v_cache_t.dtype))
        split_value_boxes(cfg, v_cache_t, table, kv_head, col, n0, v_rows_per_block, barrier, vt_dst)


@gluon.jit
def fp8_cached_tile(cfg, sources, table, kv_head, col, n0, barrier, k_dst, v_dst):
    """One FP8 tile of cached keys and values into the FP8 ring's ``k_dst`` and ``v_dst`` (V^T in the split
    layout), completing ``barrier``: TMA boxes per page (NHD), the split layout's page boxes (``FP8_BOXES``,
    :func:`~.loads.split_boxed_tile`) or its 16-byte copies."""
    k_cache, v_cache = sources.k_cache, sources.v_cache
    if cfg.LAYOUT.SPLIT and cfg.SCHEDULE.FP8_BOXES:
        split_boxed_tile(cfg, k_cache, sources.split_keys, sources.v_cache_t, table, kv_head, col, n0,
                         sources.split_values[1], barrier, k_dst, v_dst)
    elif cfg.LAYOUT.SPLIT:
        split_cached_tile(cfg, sources, table, kv_head, col, n0, barrier, k_dst, v_dst, True, False, k_dst)
    elif cfg.SCHEDULE.FP8_SCORES:  # the values alone: the keys' boxes land in the K ring (keys_to_ring)
        cached_boxes(cfg, k_cache, v_cache, table, kv_head, col, n0, barrier, k_dst, v_dst, KEYS=False)
    else:
        cached_boxes(cfg, k_cache, v_cache, table, kv_head, col, n0, barrier, k_dst, v_dst)


@gluon.jit
def keys_to_ring(cfg, sources, table, kv_head, col, n0, barrier, k_dst):
    """``FP8_SCORES`` in the NHD layout: one tile of cached FP8 keys by TMA straight into the K ring's ``k_dst``
    (the MMA reads them as they are), counted in bytes by ``barrier``."""
    cached_boxes(cfg, sources.k_cache, sources.v_cache, table, kv_head, col, n0, barrier, k_dst, k_dst, VALUES=False)


@gluon.jit
def widen_tile(cfg, ring, s):
    """Widen the FP8 ring's tile in buffer ``s`` into the 16-bit ring: the keys, and the values into V^T (split
    layout), or into V (NHD, and the split layout under ``WIDEN_TO_V``); page blocks under ``FP8_BOXES``. Under
    ``FP8_SCORES`` the K ring is FP8: the split layout's keys are only laid out for the MMA there (the NHD
    layout's are there already)."""
    k_dst = ring.k.index(s)
    # FP8_BOXES: from the boxes' blocks, the keys by pages of 16-byte columns, V^T by pages.
    VALUE_BLOCK: gl.constexpr = cfg.BOX if cfg.SCHEDULE.FP8_BOXES else 0
    KEYS_VIA_F32: gl.constexpr = cfg.SCHEDULE.F32_WIDENING and not cfg.SCHEDULE.FP8_SCORES
    if cfg.SCHEDULE.FP8_BOXES:
        widen(cfg, ring.k8.index(s), k_dst, cfg.HEAD_SIZE, KEYS_VIA_F32, cfg.LAYOUT.X, cfg.BLOCK_N // VALUE_BLOCK)
    elif cfg.LAYOUT.SPLIT or not cfg.SCHEDULE.FP8_SCORES:
        widen(cfg, ring.k8.index(s), k_dst, cfg.HEAD_SIZE, KEYS_VIA_F32)
    if cfg.SCHEDULE.WIDEN_TO_V:  # V^T in FP8, V in the 16-bit ring
        widen(cfg, ring.v8.index(s), ring.v.index(s), cfg.BLOCK_N, cfg.SCHEDULE.F32_WIDENING, VALUE_BLOCK, 1, True)
    elif cfg.LAYOUT.SPLIT:  # V^T, [D, BLOCK_N]
        widen(cfg, ring.v8.index(s), ring.vt.index(s), cfg.BLOCK_N, cfg.SCHEDULE.F32_WIDENING, VALUE_BLOCK)
    else:
        widen(cfg, ring.v8.index(s), ring.v.index(s), cfg.HEAD_SIZE, cfg.SCHEDULE.F32_WIDENING)


@gluon.jit
def keys_then_values(cfg, sources, ring, table, rows, walk, col, it):
    """Under ``SOFTMAX_UNDER_PV``: key tile ``it``'s keys into its K buffer (free: the caller waited), counted by
    the ring's ``keys`` channel, then its values once the consumers have handed that V buffer back, counted by its
    ``values`` channel. The
    consumers hand a tile's keys back when its scores are in, and its values a tile later, when its ``P V`` is
    done: each buffer is refilled as soon as it is free."""
    s = ring.stage(it)
    k_dst = ring.k.index(s)
    v_dst = ring.v.index(s)
    if it < walk.cache_tiles:
        n0 = walk.cache_start + it * cfg.BLOCK_N
        cached_boxes(cfg, sources.k_cache, sources.v_cache, table, rows.kv_head, col, n0, ring.keys.ready.index(s),
                     k_dst, k_dst, VALUES=False)
        ring.values.wait_empty(it)
        cached_boxes(cfg, sources.k_cache, sources.v_cache, table, rows.kv_head, col, n0, ring.values.ready.index(s),
                     v_dst, v_dst, KEYS=False)
    else:
        row = rows.seq_row0 + walk.new_start + (it - walk.cache_tiles) * cfg.BLOCK_N
        mbarrier.expect(ring.keys.ready.index(s), cfg.tile_bytes(sources.k_new.dtype))
        copy_rows(cfg, sources.k_new, row, rows.kv_head, col, ring.keys.ready.index(s), k_dst, 0, cfg.BLOCK_N)
        ring.values.wait_empty(it)
        mbarrier.expect(ring.values.ready.index(s), cfg.tile_bytes(sources.v_new.dtype))
        copy_rows(cfg, sources.v_new, row, rows.kv_head, col, ring.values.ready.index(s), v_dst, 0, cfg.BLOCK_N)


@gluon.jit
def producer(cfg, sources, ring, table, rows, walk):
    """Fill the ring with the key tiles of ``walk``, for the query tile at ``rows``.

    ``sources`` (:class:`~.state.Sources`) are the TMA descriptors and the split layout's keys and values with
    their strides; ``table`` the sequence's block-table row with the table's width
    and the cache's block count. A head narrower than the tile (NHD, ``PADDED``) comes through rank-3 descriptors
    (``[rows, heads, head size]``), whose boxes of ``HEAD_SIZE`` columns read the columns past the head as zeros,
    or under ``WIDE_BOXES`` through the 2-D ones, whose boxes read the next head's columns there (no panel of
    ``HEAD_PANELS`` reads them).
    Under ``EARLY_KEYS`` a cached tile's keys are loaded into registers before the wait for its buffer, so that
    their latency passes while the consumers still hold the buffer.
    """
    gl.static_assert(not cfg.SCHEDULE.EARLY_KEYS
                     or (cfg.LAYOUT.SPLIT and cfg.SCHEDULE.KEY_LOADS > 0 and not cfg.LAYOUT.FP8_CACHE
                         and cfg.BLOCK_N <= 2 * cfg.SCHEDULE.KEY_LOADS),
                     "EARLY_KEYS: the split layout's 16-bit key loads, a tile of one or two chunks")
    k_new, v_new = sources.k_new, sources.v_new
    kv_head = rows.kv_head
    cache_start = walk.cache_start
    cache_tiles = walk.cache_tiles
    col = kv_head * cfg.LAYOUT.HEAD_DIM
    if cfg.LAYOUT.FP8_CACHE:  # the first FP8 tiles in flight before any 16-bit buffer is free
        for j in range(gl.minimum(cache_tiles, cfg.TILE.STAGES)):
            fp8_cached_tile(cfg, sources, table, kv_head, col, cache_start + j * cfg.BLOCK_N,
                            ring.ready8.index(j), ring.k8.index(j), ring.v8.index(j))
    first_new = 0
    if cfg.SCHEDULE.EARLY_KEYS:
        # The cached tiles first, each one's keys loaded before its buffer is free; then the new tokens' tiles.
        for it in range(cache_tiles):
            s = ring.stage(it)
            n0 = cache_start + it * cfg.BLOCK_N
            loaded = split_tile_keys(cfg, sources.split_keys, table, kv_head, n0)
            ring.keys.wait_empty(it)
            split_cached_tile(cfg, sources, table, kv_head, col, n0, ring.keys.ready.index(s), ring.k.index(s),
                              ring.vt.index(s), False, True, loaded)
        first_new = cache_tiles
    for it in range(first_new, cache_tiles + walk.new_tiles):
        s = ring.stage(it)
        ring.keys.wait_empty(it)
        k_dst = ring.k.index(s)
        if cfg.SCHEDULE.SOFTMAX_UNDER_PV:
            keys_then_values(cfg, sources, ring, table, rows, walk, col, it)
        elif it < cache_tiles:
            if cfg.LAYOUT.FP8_CACHE:
                if cfg.SCHEDULE.FP8_SCORES and not cfg.LAYOUT.SPLIT:
                    keys_to_ring(cfg, sources, table, kv_head, col, cache_start + it * cfg.BLOCK_N,
                                 ring.keys.ready.index(s), k_dst)
                ring.wait_landed(it)
                widen_tile(cfg, ring, s)
                # The stores are ordered before the consumers' MMA reads, and every warp is done with the FP8
                # slot before the next tile's copies overwrite it.
                fence_async_shared()
                gl.thread_barrier()
                if it + cfg.TILE.STAGES < cache_tiles:
                    fp8_cached_tile(cfg, sources, table, kv_head, col,
                                    cache_start + (it + cfg.TILE.STAGES) * cfg.BLOCK_N, ring.ready8.index(s),
                                    ring.k8.index(s), ring.v8.index(s))
                mbarrier.arrive(ring.keys.ready.index(s), count=1)
            elif cfg.LAYOUT.SPLIT:
                split_cached_tile(cfg, sources, table, kv_head, col, cache_start + it * cfg.BLOCK_N,
                                  ring.keys.ready.index(s), k_dst, ring.vt.index(s), False, False, k_dst)
            else:
                cached_boxes(cfg, sources.k_cache, sources.v_cache, table, kv_head, col,
                             cache_start + it * cfg.BLOCK_N, ring.keys.ready.index(s), ring.k8.index(s),
                             ring.v8.index(s))
        else:
            row = rows.seq_row0 + walk.new_start + (it - cache_tiles) * cfg.BLOCK_N
            mbarrier.expect(ring.keys.ready.index(s), 2 * cfg.tile_bytes(k_new.dtype))
            if cfg.SCHEDULE.VALUES_FIRST:  # the second of the two arrivals the ring's barriers take then
                mbarrier.arrive(ring.keys.ready.index(s), count=1)
            copy_rows(cfg, k_new, row, kv_head, col, ring.keys.ready.index(s), k_dst, 0, cfg.BLOCK_N)
            copy_rows(cfg, v_new, row, kv_head, col, ring.keys.ready.index(s), ring.v.index(s), 0, cfg.BLOCK_N)

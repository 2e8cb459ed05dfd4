"""The Hopper (sm90) prefix-prefill kernel: warp-specialised, TMA-fed, warpgroup MMA.

One program computes the same tile as core's portable kernel (``BLOCK_M`` rows of (new token, query
head) pairs, ``HEADS_PER_TILE`` heads of one KV group packed together), with the work split by role:

* a **producer** warp with few registers reads the block table and brings each key tile's K and V into a
  ring of ``STAGES`` shared-memory buffers with the tensor-memory accelerator (TMA): one box per cache
  page (or one per tile when a page holds several tiles), one box per tile of new tokens. In the split
  layout the cached keys come by 16-byte asynchronous copies instead (no TMA view fits their
  ``[D / x, block, x]`` pages) and the cached values as V^T pages (``[D, block]``) into a ring of their
  own. An FP8 cache lands in FP8 buffers of its own (in the split layout its values by 16-byte copies too),
  which the producer (``PRODUCER_WIDENS``) or each consumer (NHD only) widens to 16 bits before the MMAs. A
  head size that is not a power of two (96) runs on the next power of two, its boxes and copies reading the
  columns past the head as zeros. Each buffer has a ``ready`` barrier (the copies have landed) and an
  ``empty`` barrier (the consumers are done);
* the **consumer** warpgroups run ``S = Q K^T`` and ``O += P V`` as warpgroup MMAs straight from shared
  memory and the online softmax in registers, never waiting for a load the producer could have issued
  earlier, and with no CTA-wide barrier in the key loop. With ``HEAVY_FIRST`` each sequence's last query
  tiles (the most keys under a causal mask) are scheduled first. With ``PINGPONG`` each of the two consumer
  warpgroups is a partition of its own with half of the tile's rows (each computes where its rows are), so
  the two no longer wait for each other at every key tile and one's softmax can run under the other's MMAs.

Both roles walk the same schedule (:func:`_key_tiles`): the cached prefix from the first tile the window
reaches, then the new tokens up to the causal diagonal. Every TMA box is bounds-checked by the hardware
against the tensor it was described on (rows outside read as zeros), table columns and block numbers are
clamped, and query rows outside ``q`` are masked, so inconsistent metadata cannot read or write outside
the caller's tensors.

The scalar helpers (tile location, masks, softcap, sinks, FP8 rounding) are core's building blocks from
:mod:`pagedprefill.triton.blocks`; only the data movement and the MMAs are Hopper-specific.
"""

from pagedprefill.triton.blocks import (
    LOG2E,
    aligned,
    finish_rows,
    round_to_fp8_e4m3,
    scalar_or_load,
    soft_cap,
    tile_rows,
    tile_sequence,
    visible,
)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def _key_tiles(ctx_len, q_len, tok0, tok_last, window, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
               WINDOW: gl.constexpr, NEW_KV_IN_CACHE: gl.constexpr):
    """The key tiles one query tile visits: ``(cache_start, cache_tiles, new_start, new_tiles)``.

    Cached tiles start at ``cache_start`` (a multiple of ``BLOCK_N``, the first tile the window reaches);
    new-token tiles start at ``new_start`` (an index among the sequence's new tokens). With the new tokens'
    K/V already in the cache (``NEW_KV_IN_CACHE``) the cached walk covers them too and there is no second
    walk.
    """
    pos_first = ctx_len + tok0
    pos_last = ctx_len + tok_last
    lo = 0
    if WINDOW:
        lo = gl.maximum(pos_first - window + 1, 0)
    cache_start = (lo // BLOCK_N) * BLOCK_N
    if NEW_KV_IN_CACHE:
        if CAUSAL:
            cache_end = pos_last + 1
        else:
            cache_end = ctx_len + q_len
    else:
        cache_end = ctx_len
    cache_tiles = gl.cdiv(gl.maximum(cache_end - cache_start, 0), BLOCK_N)
    new_start = 0
    new_tiles = 0
    if not NEW_KV_IN_CACHE:
        new_start = (gl.maximum(lo - ctx_len, 0) // BLOCK_N) * BLOCK_N
        if CAUSAL:
            new_end = tok_last + 1
        else:
            new_end = q_len
        new_tiles = gl.cdiv(gl.maximum(new_end - new_start, 0), BLOCK_N)
    return cache_start, cache_tiles, new_start, new_tiles


@gluon.jit
def _pages(table, pos, PAGE: gl.constexpr):
    """The cache blocks that hold key positions ``pos`` (a tensor or a scalar), from the sequence's block-table
    row (``table`` is the row, the table's width and the cache's block count): columns clamped to the table and
    block numbers outside the cache replaced by 0, so a corrupt table reads a wrong page, never outside the
    cache."""
    table_row, table_width, num_blocks = table
    cols = gl.maximum(gl.minimum(pos // PAGE, table_width - 1), 0)
    pages = gl.load(table_row + cols)
    return gl.where((pages >= 0) & (pages < num_blocks), pages, 0)


@gluon.jit
def _split_key_pointers(split_keys, table, kv_head, n0, ROWS: gl.constexpr, HEAD_SIZE: gl.constexpr,
                        PAGE: gl.constexpr, X: gl.constexpr, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
    """Pointers to ``ROWS`` cached keys from position ``n0`` in the split layout ``[blocks, Hkv, D / X, PAGE, X]``,
    as a ``[ROWS, HEAD_SIZE]`` tile in ``layout``, and the mask of the columns inside the head (all true unless
    ``HEAD_DIM`` < ``HEAD_SIZE``). ``split_keys`` is ``(K_cache, stride_block, stride_head, stride_group)``,
    strides multiples of ``X``."""
    K_cache, stride_kb, stride_kh, stride_kd = split_keys
    offs_n = gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    offs_d = gl.arange(0, HEAD_SIZE, gl.SliceLayout(0, layout))
    pos = n0 + offs_n
    pages = _pages(table, pos, PAGE).to(gl.int64)
    row_off = pages * aligned(stride_kb, X) + kv_head.to(gl.int64) * aligned(stride_kh, X) + (pos % PAGE) * X
    col_off = (offs_d // X) * aligned(stride_kd, X) + offs_d % X
    ptrs = K_cache + gl.expand_dims(row_off, 1) + gl.expand_dims(col_off, 0)
    # The mask takes the pointers' 2-D shape and layout: the always-true key term only broadcasts it.
    in_head = gl.expand_dims(offs_n >= 0, 1) & gl.expand_dims(offs_d < HEAD_DIM, 0)
    return ptrs, in_head


@gluon.jit
def _split_keys_async(split_keys, k_dst, table, kv_head, n0,
                      HEAD_SIZE: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, X: gl.constexpr,
                      WARPS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Copy one tile of cached keys from the split layout into the ``[BLOCK_N, D]`` tile the QK^T MMA reads,
    16 bytes (one ``X`` vector) per asynchronous copy.

    The split layout has no 2-D view a TMA box could take, so the producer's ``WARPS`` warps copy: their lanes
    walk along the slots of a page, where consecutive ``X`` vectors of one ``d // X`` group are contiguous.
    A head of ``HEAD_DIM`` < ``HEAD_SIZE`` columns (96 on a 128-wide tile) fills the columns past it with zeros
    (masked copies read nothing there), so that they add nothing to the scores.
    """
    LANES_N: gl.constexpr = 16 if BLOCK_N >= 16 else BLOCK_N
    k_ld: gl.constexpr = gl.BlockedLayout([1, X], [LANES_N, 32 // LANES_N], [WARPS, 1], [0, 1])
    ptrs, in_head = _split_key_pointers(split_keys, table, kv_head, n0, BLOCK_N, HEAD_SIZE, PAGE, X, HEAD_DIM, k_ld)
    if HEAD_DIM < HEAD_SIZE:
        async_copy.async_copy_global_to_shared(k_dst, ptrs, mask=in_head)
    else:
        async_copy.async_copy_global_to_shared(k_dst, ptrs)


@gluon.jit
def _load_in_head(ptrs, in_head, PADDED: gl.constexpr):
    """Load a tile of keys; columns past a padded head (``PADDED``) read as zeros."""
    if PADDED:
        return gl.load(ptrs, mask=in_head, other=0.0)
    else:
        return gl.load(ptrs)


@gluon.jit
def _split_keys_loaded(split_keys, k_dst, table, kv_head, n0,
                       HEAD_SIZE: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, X: gl.constexpr,
                       WARPS: gl.constexpr, HEAD_DIM: gl.constexpr, CHUNK: gl.constexpr):
    """The same tile as :func:`_split_keys_async`, through registers: ordinary 16-byte loads, which the L1 merges
    into one L2 request per 128-byte line (a 16-byte asynchronous copy is an L2 request of its own: on the split
    layout those requests, not the bytes, bound the L2), stored into ``k_dst``. ``CHUNK`` keys at a time (32 or
    64, at most ``BLOCK_N``), the next chunk's loads issued before this chunk's stores. ``WARPS`` is 4 (a
    producer warpgroup); the stores are complete when this returns."""
    keys = _split_key_chunk(split_keys, table, kv_head, n0, HEAD_SIZE, PAGE, X, WARPS, HEAD_DIM, CHUNK)
    for c in gl.static_range(1, BLOCK_N // CHUNK):
        following = _split_key_chunk(split_keys, table, kv_head, n0 + c * CHUNK, HEAD_SIZE, PAGE, X, WARPS, HEAD_DIM,
                                     CHUNK)
        k_dst.slice((c - 1) * CHUNK, CHUNK).store(keys)
        keys = following
    k_dst.slice(BLOCK_N - CHUNK, CHUNK).store(keys)


@gluon.jit
def _split_key_chunk(split_keys, table, kv_head, n0, HEAD_SIZE: gl.constexpr, PAGE: gl.constexpr, X: gl.constexpr,
                     WARPS: gl.constexpr, HEAD_DIM: gl.constexpr, CHUNK: gl.constexpr):
    """``CHUNK`` cached keys from position ``n0`` of the split layout, loaded into the producer warpgroup's
    registers (``WARPS`` = 4) as a ``[CHUNK, HEAD_SIZE]`` tile."""
    k_ld: gl.constexpr = gl.BlockedLayout([1, X], [16, 2], [2, WARPS // 2], [0, 1])
    ptrs, in_head = _split_key_pointers(split_keys, table, kv_head, n0, CHUNK, HEAD_SIZE, PAGE, X, HEAD_DIM, k_ld)
    return _load_in_head(ptrs, in_head, HEAD_DIM < HEAD_SIZE)


@gluon.jit
def _split_tile_keys(split_keys, table, kv_head, n0, HEAD_SIZE: gl.constexpr, PAGE: gl.constexpr,
                     BLOCK_N: gl.constexpr, X: gl.constexpr, WARPS: gl.constexpr, HEAD_DIM: gl.constexpr,
                     CHUNK: gl.constexpr):
    """A whole tile of cached keys in registers, as its one or two chunks of ``CHUNK`` keys (the second repeats
    the first when the tile is one chunk)."""
    first = _split_key_chunk(split_keys, table, kv_head, n0, HEAD_SIZE, PAGE, X, WARPS, HEAD_DIM, CHUNK)
    second = first
    if BLOCK_N > CHUNK:
        second = _split_key_chunk(split_keys, table, kv_head, n0 + CHUNK, HEAD_SIZE, PAGE, X, WARPS, HEAD_DIM,
                                  CHUNK)
    return first, second


@gluon.jit
def _split_values_async(split_values, vt_dst, table, kv_head, n0,
                        HEAD_SIZE: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, WARPS: gl.constexpr,
                        HEAD_DIM: gl.constexpr):
    """Copy one tile of cached values from the split layout (``[blocks, Hkv, D, PAGE]``: a page of one head is
    ``D`` rows of ``PAGE`` slots) into ``vt_dst`` (``[D, BLOCK_N]``, V^T in the MMA's own swizzle, or an FP8
    cache's V^T buffer), 16 bytes of consecutive slots per asynchronous copy. ``split_values`` is
    ``(V_cache, rows per block, row stride)``: the cache seen as ``[blocks x Hkv x D, PAGE]`` rows, as its TMA
    view is. Rows past a padded head (``HEAD_DIM`` < ``HEAD_SIZE``) are masked: the copies fill them with zeros
    and read nothing."""
    V_cache, rows_per_block, stride_row = split_values
    # 16 bytes of values (8 16-bit or 16 FP8 ones); PAGE >= 16 keeps a vector inside one page.
    VEC: gl.constexpr = 128 // V_cache.dtype.element_ty.primitive_bitwidth
    LANES_N: gl.constexpr = BLOCK_N // VEC
    v_ld: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // LANES_N, LANES_N], [WARPS, 1], [1, 0])
    offs_d = gl.arange(0, HEAD_SIZE, gl.SliceLayout(1, v_ld))
    offs_n = gl.arange(0, BLOCK_N, gl.SliceLayout(0, v_ld))
    pos = n0 + offs_n
    pages = _pages(table, pos, PAGE).to(gl.int64)
    rows = pages * rows_per_block + kv_head.to(gl.int64) * HEAD_DIM
    slots = gl.max_contiguous(gl.multiple_of(pos % PAGE, VEC), VEC)  # n0 is a multiple of BLOCK_N
    offs = (gl.expand_dims(rows, 0) + gl.expand_dims(offs_d, 1)) * aligned(stride_row, VEC) + gl.expand_dims(slots, 0)
    if HEAD_DIM < HEAD_SIZE:
        in_head = gl.expand_dims(offs_d < HEAD_DIM, 1) & gl.expand_dims(offs_n >= 0, 0)
        async_copy.async_copy_global_to_shared(vt_dst, V_cache + offs, mask=in_head)
    else:
        async_copy.async_copy_global_to_shared(vt_dst, V_cache + offs)


@gluon.jit
def _new_values_transposed(new_values, vt_dst, row0, kv_head, num_tokens, HEAD_SIZE: gl.constexpr,
                           BLOCK_N: gl.constexpr, WARPS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """One tile of the new tokens' values, rows ``row0 .. row0 + BLOCK_N`` of ``v``, stored transposed into the
    V^T buffer ``vt_dst`` (``[D, BLOCK_N]``) that the cached tiles' values take, so that the split layout needs
    no ring of its own for them. ``new_values`` is ``(V_new, stride_token, stride_head)``.

    Each thread loads a block of four tokens by eight head columns (four 16-byte loads) and stores it as eight
    8-byte pieces of V^T rows: the transposition happens in its registers. (Eight tokens per thread would store
    16 bytes at a time, but the producer holds its key loads' state beside them and spilled.) Rows past the last
    token and columns past a padded head read as zeros. The producer's ``WARPS`` warps take ``CHUNK`` tokens at a
    time."""
    V_new, stride_vt, stride_vh = new_values
    COL_LANES: gl.constexpr = HEAD_SIZE // 8 if HEAD_SIZE // 8 < 32 else 32
    ROW_LANES: gl.constexpr = 32 // COL_LANES
    TOKENS_PER_THREAD: gl.constexpr = 4
    CHUNK: gl.constexpr = (TOKENS_PER_THREAD * ROW_LANES * WARPS if TOKENS_PER_THREAD * ROW_LANES * WARPS < BLOCK_N
                           else BLOCK_N)
    v_ld: gl.constexpr = gl.BlockedLayout([TOKENS_PER_THREAD, 8], [ROW_LANES, COL_LANES], [WARPS, 1], [1, 0])
    offs_d = gl.arange(0, HEAD_SIZE, gl.SliceLayout(0, v_ld))
    # One 64-bit base for the tile, 32-bit offsets within it (the launch checks that a tile's rows span less
    # than 2**31 elements): fewer registers in the producer, which holds them beside its key loads' state.
    tile_values = V_new + (row0.to(gl.int64) * stride_vt + kv_head.to(gl.int64) * stride_vh)
    vt_rows = vt_dst.permute((1, 0))  # [BLOCK_N, D]: a token's values are a column of V^T
    offs_n = gl.arange(0, CHUNK, gl.SliceLayout(1, v_ld))
    # The next chunk's loads go out before this chunk is stored, so that a tile waits for about half its
    # chunks' latencies instead of each in turn.
    held = _new_value_chunk(tile_values, offs_n, offs_d, row0, num_tokens, stride_vt, HEAD_DIM)
    for c in gl.static_range(CHUNK, BLOCK_N + CHUNK, CHUNK):
        if c < BLOCK_N:
            following = _new_value_chunk(tile_values, c + offs_n, offs_d, row0, num_tokens, stride_vt, HEAD_DIM)
        vt_rows.slice(c - CHUNK, CHUNK).store(held)
        if c < BLOCK_N:
            held = following


@gluon.jit
def _new_value_chunk(tile_values, offs_n, offs_d, row0, num_tokens, stride_vt, HEAD_DIM: gl.constexpr):
    """The new tokens' values at rows ``offs_n`` of the tile at ``tile_values`` (zeros past the last token and
    past a padded head), for :func:`_new_values_transposed`."""
    ptrs = tile_values + gl.expand_dims(offs_n * stride_vt, 1) + gl.expand_dims(offs_d, 0)
    ok = gl.expand_dims(row0 + offs_n < num_tokens, 1) & gl.expand_dims(offs_d < HEAD_DIM, 0)
    return gl.load(ptrs, mask=ok, other=0.0)


@gluon.jit
def _copy_rows(desc, row, kv_head, col, barrier, tile, start, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_SIZE: gl.constexpr, PADDED: gl.constexpr):
    """One TMA box of ``ROWS`` rows of one head into rows ``start ..`` of ``tile`` (``[BLOCK_N, HEAD_SIZE]``):
    from the 2-D view ``[rows, heads x head size]`` at column ``col``, or (``PADDED``) from the rank-3 view at
    ``kv_head`` (the buffer seen as ``[BLOCK_N, 1, HEAD_SIZE]`` first: a slice cannot be reshaped)."""
    if PADDED:
        dst3 = tile.reshape([BLOCK_N, 1, HEAD_SIZE])
        if ROWS < BLOCK_N:
            dst3 = dst3.slice(start, ROWS)
        tma.async_copy_global_to_shared(desc, [row, kv_head, 0], barrier, dst3)
    elif ROWS < BLOCK_N:
        tma.async_copy_global_to_shared(desc, [row, col], barrier, tile.slice(start, ROWS))
    else:
        tma.async_copy_global_to_shared(desc, [row, col], barrier, tile)


@gluon.jit
def _cached_boxes(k_cache, v_cache, table, kv_head, col, n0, barrier, k_dst, v_dst, TILE_BYTES: gl.constexpr,
                  PAGE: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_SIZE: gl.constexpr, PADDED: gl.constexpr):
    """One NHD tile of cached keys and values by TMA into ``k_dst``/``v_dst``, one box per page (or per tile
    when a page holds several), counted in bytes by ``barrier`` (``TILE_BYTES`` for K and V together)."""
    BOX: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
    mbarrier.expect(barrier, TILE_BYTES)
    for b in gl.static_range(BLOCK_N // BOX):
        pos = n0 + b * BOX
        row = _pages(table, pos, PAGE) * PAGE + pos % PAGE
        _copy_rows(k_cache, row, kv_head, col, barrier, k_dst, b * BOX, BOX, BLOCK_N, HEAD_SIZE, PADDED)
        _copy_rows(v_cache, row, kv_head, col, barrier, v_dst, b * BOX, BOX, BLOCK_N, HEAD_SIZE, PADDED)


@gluon.jit
def _split_value_boxes(v_cache_t, table, kv_head, col, n0, v_rows_per_block, barrier, vt_dst,
                       HEAD_SIZE: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                       PAGE_BLOCKS: gl.constexpr = False):
    """One split-layout tile of cached values into ``vt_dst`` as V^T (``[D, BLOCK_N]``), one TMA box per page,
    counted in bytes by ``barrier``. ``PAGE_BLOCKS`` (``FP8_BOXES``): ``vt_dst`` holds the pages' ``[D, box]``
    blocks one after another (``[BLOCK_N / box x D, box]``, :func:`_widen`'s ``BLOCK_WIDTH``), so that every box
    lands on a whole block; a column slice of an unswizzled ``[D, BLOCK_N]`` tile is not contiguous, and a TMA
    destination must be (and 128-byte aligned)."""
    BOX: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
    for b in gl.static_range(BLOCK_N // BOX):
        pos = n0 + b * BOX
        # A page's values of one head are one [D, PAGE] block: V^T, one box per page.
        if HEAD_DIM < HEAD_SIZE:
            # The rank-3 view [blocks x heads, HEAD_DIM, PAGE]: a box of HEAD_SIZE rows reads the rows past the
            # head as zeros (outside the view, never another head's values).
            page_row = _pages(table, pos, PAGE) * (v_rows_per_block // HEAD_DIM) + kv_head
            vt3 = vt_dst.reshape([1, HEAD_SIZE, BLOCK_N]).slice(b * BOX, BOX, dim=2)
            tma.async_copy_global_to_shared(v_cache_t, [page_row, 0, pos % PAGE], barrier, vt3)
        else:
            row = _pages(table, pos, PAGE) * v_rows_per_block + col
            if PAGE_BLOCKS:
                page_dst = vt_dst.slice(b * HEAD_SIZE, HEAD_SIZE)
            else:
                page_dst = vt_dst.slice(b * BOX, BOX, dim=1)
            tma.async_copy_global_to_shared(v_cache_t, [row, pos % PAGE], barrier, page_dst)


@gluon.jit
def _split_boxed_tile(k_desc, split_keys, v_cache_t, table, kv_head, col, n0, v_rows_per_block, barrier, k_dst, vt_dst,
                      HEAD_SIZE: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, X: gl.constexpr):
    """One split-layout tile of cached keys and values by TMA alone (``FP8_BOXES``), counted in bytes by
    ``barrier``: a page's keys of one head are ``D / X`` contiguous ``[PAGE, X]`` blocks, together one box
    ``[D / X, box, X]`` into ``k_dst``'s block of that page (``[BLOCK_N / box x D / X x box, X]``: the pages one
    after another), and its values one V^T box into ``vt_dst``'s block of that page (:func:`_split_value_boxes`).
    ``k_desc`` describes the key cache as ``[pages x heads x D / X, PAGE, X]``. (A 16-bit K tile read by the MMAs
    cannot take this: Triton 3.6's warpgroup MMA takes no unswizzled K; an FP8 tile is only read by the
    producer's widening.)"""
    _, stride_kb, stride_kh, _ = split_keys
    mbarrier.expect(barrier, 2 * BLOCK_N * HEAD_SIZE * k_dst.dtype.primitive_bitwidth // 8)
    BOX: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
    COLUMNS: gl.constexpr = HEAD_SIZE // X
    for b in gl.static_range(BLOCK_N // BOX):
        pos = n0 + b * BOX
        # The first column of (page, head) among the cache's [PAGE, X] blocks (the launch checked that the
        # cache is contiguous from its block dimension in, so the head's D / X columns follow it, and that they
        # fit TMA's 32-bit coordinates).
        first = _pages(table, pos, PAGE) * (stride_kb // (PAGE * X)) + kv_head * (stride_kh // (PAGE * X))
        page_dst = k_dst.slice(b * COLUMNS * BOX, COLUMNS * BOX)._reinterpret(k_dst.dtype, [COLUMNS, BOX, X],
                                                                              k_desc.layout)
        tma.async_copy_global_to_shared(k_desc, [first, pos % PAGE, 0], barrier, page_dst)
    _split_value_boxes(v_cache_t, table, kv_head, col, n0, v_rows_per_block, barrier, vt_dst, HEAD_SIZE, PAGE,
                       BLOCK_N, HEAD_SIZE, True)


@gluon.jit
def _split_cached_tile(split_keys, split_values, v_cache_t, table, kv_head, col, n0, v_rows_per_block, barrier,
                       k_dst, vt_dst, HEAD_SIZE: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                       X: gl.constexpr, WARPS: gl.constexpr, HEAD_DIM: gl.constexpr, VALUE_COPIES: gl.constexpr,
                       KEY_LOADS: gl.constexpr, VALUES_FIRST: gl.constexpr, EARLY_KEYS: gl.constexpr, loaded):
    """One split-layout tile of cached keys into ``k_dst`` (``[BLOCK_N, D]``, 16-byte copies, or with
    ``KEY_LOADS`` loads and stores, ``KEY_LOADS`` keys per chunk) and of its values into ``vt_dst`` as V^T
    (``[D, BLOCK_N]``): one TMA box per page, or with ``VALUE_COPIES`` 16-byte copies. ``barrier`` completes
    once every copy has landed. ``VALUES_FIRST`` (with ``KEY_LOADS`` and value boxes): the boxes are issued
    before the keys are loaded, and ``barrier`` takes two arrivals, the boxes' expect and one after the keys'
    stores. ``EARLY_KEYS`` (with ``KEY_LOADS``): the keys were loaded before the buffer was free, ``loaded``
    (:func:`_split_tile_keys`; any value otherwise, unread); only their stores are left."""
    VALUE_BYTES: gl.constexpr = BLOCK_N * HEAD_SIZE * v_cache_t.dtype.primitive_bitwidth // 8
    if VALUES_FIRST:
        mbarrier.expect(barrier, VALUE_BYTES)
        _split_value_boxes(v_cache_t, table, kv_head, col, n0, v_rows_per_block, barrier, vt_dst, HEAD_SIZE, PAGE,
                           BLOCK_N, HEAD_DIM)
    if EARLY_KEYS:
        first, second = loaded
        k_dst.slice(0, KEY_LOADS).store(first)
        if BLOCK_N > KEY_LOADS:
            k_dst.slice(KEY_LOADS, KEY_LOADS).store(second)
    elif KEY_LOADS:
        _split_keys_loaded(split_keys, k_dst, table, kv_head, n0, HEAD_SIZE, PAGE, BLOCK_N, X, WARPS, HEAD_DIM,
                           KEY_LOADS)
    else:
        _split_keys_async(split_keys, k_dst, table, kv_head, n0, HEAD_SIZE, PAGE, BLOCK_N, X, WARPS, HEAD_DIM)
    if VALUE_COPIES:
        _split_values_async(split_values, vt_dst, table, kv_head, n0, HEAD_SIZE, PAGE, BLOCK_N, WARPS, HEAD_DIM)
    # Arrives once this lane's copies have landed; issued before the TMA's expect, so the barrier cannot
    # complete on the value bytes alone.
    async_copy.mbarrier_arrive(barrier)
    if KEY_LOADS:
        # The keys are ordinary stores: ordered before the MMA's reads, and every producer warp's done before
        # the one arrival below.
        fence_async_shared()
        gl.thread_barrier()
    if VALUE_COPIES or VALUES_FIRST:
        mbarrier.arrive(barrier, count=1)
    else:
        mbarrier.expect(barrier, VALUE_BYTES)
        _split_value_boxes(v_cache_t, table, kv_head, col, n0, v_rows_per_block, barrier, vt_dst, HEAD_SIZE, PAGE,
                           BLOCK_N, HEAD_DIM)


@gluon.jit
def _cached_tile(loads, table, kv_head, col, n0, v_rows_per_block, barrier, k_dst, v_dst, TILE_BYTES: gl.constexpr,
                 HEAD_SIZE: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, SPLIT: gl.constexpr,
                 X: gl.constexpr, WARPS: gl.constexpr, HEAD_DIM: gl.constexpr, BOXES: gl.constexpr,
                 KEY_LOADS: gl.constexpr):
    """One FP8 tile of cached keys and values into ``k_dst`` and ``v_dst`` (V^T in the split layout), completing
    ``barrier``: TMA boxes per page (NHD, ``TILE_BYTES`` for K and V), the split layout's 16-byte copies, or
    (``BOXES``) its TMA boxes (:func:`_split_boxed_tile`)."""
    k_cache, v_cache, _, _, v_cache_t, split_keys, split_values = loads
    if SPLIT and BOXES:
        _split_boxed_tile(k_cache, split_keys, v_cache_t, table, kv_head, col, n0, v_rows_per_block, barrier, k_dst,
                          v_dst, HEAD_SIZE, PAGE, BLOCK_N, X)
    elif SPLIT:
        _split_cached_tile(split_keys, split_values, v_cache_t, table, kv_head, col, n0, v_rows_per_block, barrier,
                           k_dst, v_dst, HEAD_SIZE, PAGE, BLOCK_N, X, WARPS, HEAD_DIM, True, KEY_LOADS, False,
                           False, k_dst)
    else:
        _cached_boxes(k_cache, v_cache, table, kv_head, col, n0, barrier, k_dst, v_dst, TILE_BYTES, PAGE, BLOCK_N,
                      HEAD_SIZE, HEAD_DIM < HEAD_SIZE)


@gluon.jit
def _producer(loads, ring, ready8, table, kv_head, seq_row0, v_rows_per_block, walk, new_values, num_tokens,
              HEAD_SIZE: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              SPLIT: gl.constexpr, X: gl.constexpr, HEAD_DIM: gl.constexpr, VT_COPIES: gl.constexpr,
              WARPS: gl.constexpr, PRODUCER_WIDENS: gl.constexpr, KEY_LOADS: gl.constexpr,
              VALUES_FIRST: gl.constexpr, EARLY_KEYS: gl.constexpr, F32_WIDENING: gl.constexpr,
              NEW_VALUES_T: gl.constexpr, FP8_BOXES: gl.constexpr, WIDEN_TO_V: gl.constexpr):
    """Fill the ring: for each key tile, wait until its buffer is free, then issue the copies of K and V and
    let the ``ready`` barrier count their bytes (TMA) and their completion (asynchronous copies).

    ``loads`` are the sources (TMA descriptors, and the split layout's keys with their strides), ``ring`` the
    buffers and barriers, ``table`` the sequence's block-table row with the table's width and the cache's
    block count, ``walk`` the key tiles (:func:`_key_tiles`; the consumers' row positions are not used here).
    A head size ``HEAD_DIM`` below the tile's width ``HEAD_SIZE`` (NHD; not a power of two) comes through rank-3
    descriptors (``[rows, heads, head size]``), whose boxes of ``HEAD_SIZE`` columns read the columns past the
    head as zeros. ``WARPS``: the producer partition's warps, which share the split layout's 16-byte copies
    (``KEY_LOADS``: its keys' loads and stores). ``VALUES_FIRST``: the split layout's cached value boxes go out
    before its keys are loaded, and every ``ready`` barrier takes two arrivals. ``EARLY_KEYS`` (split layout,
    ``KEY_LOADS``, a tile of one or two chunks): a cached tile's keys are loaded into registers before the wait
    for its buffer, so that their latency passes while the consumers still hold the buffer.

    ``PRODUCER_WIDENS`` (an FP8 cache): the cached tiles land in the FP8 ring (``k8_smem``/``v8_smem``, counted by
    ``ready8``; NHD by TMA, the split layout by 16-byte copies, its values as V^T), up to ``STAGES`` tiles
    ahead; the producer's warps widen each into the 16-bit ring once, for both consumers, then signal ``ready``
    (``F32_WIDENING``: through float32, see :func:`_widen`).

    ``NEW_VALUES_T`` (split layout): the new tokens' values are loaded by the producer's warps and stored
    transposed into the V^T ring (``new_values``: the pointer and strides of ``v``; rows from ``num_tokens`` on
    read as zeros), before the tile's key box is issued; there is no V ring. ``FP8_BOXES`` (split layout,
    FP8 cache): the cached keys and values come into the FP8 ring by unswizzled TMA boxes instead of 16-byte
    copies (:func:`_split_boxed_tile`). ``WIDEN_TO_V`` (split layout, FP8 cache): the cached values are widened
    into the V ring, transposed, where the new tokens' values land; there is no V^T ring.
    """
    gl.static_assert(not EARLY_KEYS or (SPLIT and KEY_LOADS > 0 and not PRODUCER_WIDENS and BLOCK_N <= 2 * KEY_LOADS),
                     "EARLY_KEYS: the split layout's 16-bit key loads, a tile of one or two chunks")
    PADDED: gl.constexpr = HEAD_DIM < HEAD_SIZE
    k_cache, v_cache, k_new, v_new, v_cache_t, split_keys, split_values = loads
    k_smem, v_smem, vt_smem, k8_smem, v8_smem, ready, empty = ring
    cache_start, cache_tiles, new_start, new_tiles, _, _ = walk
    HALF_BYTES: gl.constexpr = BLOCK_N * HEAD_SIZE * k_new.dtype.primitive_bitwidth // 8
    # Cached tiles in the cache's own element type (FP8 caches land in their own ring, k8_smem / v8_smem).
    CACHE_HALF_BYTES: gl.constexpr = BLOCK_N * HEAD_SIZE * v_cache_t.dtype.primitive_bitwidth // 8
    col = kv_head * HEAD_DIM
    if PRODUCER_WIDENS:  # the first FP8 tiles in flight before any 16-bit buffer is free
        for j in range(gl.minimum(cache_tiles, STAGES)):
            # (The split layout's FP8 keys and values come by 16-byte copies, or by unswizzled TMA boxes with
            # FP8_BOXES: a page of 16 FP8 slots is narrower than the narrowest swizzle, 32 bytes.)
            _cached_tile(loads, table, kv_head, col, cache_start + j * BLOCK_N, v_rows_per_block, ready8.index(j),
                         k8_smem.index(j), v8_smem.index(j), 2 * CACHE_HALF_BYTES, HEAD_SIZE, PAGE, BLOCK_N, SPLIT, X,
                         WARPS, HEAD_DIM, FP8_BOXES, KEY_LOADS)
    first_new = 0
    if EARLY_KEYS:
        # The cached tiles first, each one's keys loaded before its buffer is free; then the new tokens' tiles.
        for it in range(cache_tiles):
            s = it % STAGES
            n0 = cache_start + it * BLOCK_N
            loaded = _split_tile_keys(split_keys, table, kv_head, n0, HEAD_SIZE, PAGE, BLOCK_N, X, WARPS, HEAD_DIM,
                                      KEY_LOADS)
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            _split_cached_tile(split_keys, split_values, v_cache_t, table, kv_head, col, n0, v_rows_per_block,
                               ready.index(s), k_smem.index(s), vt_smem.index(s), HEAD_SIZE, PAGE, BLOCK_N, X, WARPS,
                               HEAD_DIM, VT_COPIES, KEY_LOADS, VALUES_FIRST, True, loaded)
        first_new = cache_tiles
    for it in range(first_new, cache_tiles + new_tiles):
        s = it % STAGES
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        k_dst = k_smem.index(s)
        if it < cache_tiles:
            if PRODUCER_WIDENS:
                mbarrier.wait(ready8.index(s), (it // STAGES) & 1)
                # FP8_BOXES: from the boxes' blocks, the keys by pages of 16-byte columns, V^T by pages.
                VALUE_BLOCK: gl.constexpr = (PAGE if PAGE < BLOCK_N else BLOCK_N) if FP8_BOXES else 0
                if FP8_BOXES:
                    _widen(k8_smem.index(s), k_dst, HEAD_SIZE, WARPS, F32_WIDENING, X, BLOCK_N // VALUE_BLOCK)
                else:
                    _widen(k8_smem.index(s), k_dst, HEAD_SIZE, WARPS, F32_WIDENING)
                if WIDEN_TO_V:  # V^T in FP8, V in the 16-bit ring
                    _widen(v8_smem.index(s), v_smem.index(s), BLOCK_N, WARPS, F32_WIDENING, VALUE_BLOCK, 1, True)
                elif SPLIT:  # V^T, [D, BLOCK_N]
                    _widen(v8_smem.index(s), vt_smem.index(s), BLOCK_N, WARPS, F32_WIDENING, VALUE_BLOCK)
                else:
                    _widen(v8_smem.index(s), v_smem.index(s), HEAD_SIZE, WARPS, F32_WIDENING)
                # The stores are ordered before the consumers' MMA reads, and every warp is done with the FP8
                # slot before the next tile's copies overwrite it.
                fence_async_shared()
                gl.thread_barrier()
                if it + STAGES < cache_tiles:
                    _cached_tile(loads, table, kv_head, col, cache_start + (it + STAGES) * BLOCK_N, v_rows_per_block,
                                 ready8.index(s), k8_smem.index(s), v8_smem.index(s), 2 * CACHE_HALF_BYTES, HEAD_SIZE,
                                 PAGE, BLOCK_N, SPLIT, X, WARPS, HEAD_DIM, FP8_BOXES, KEY_LOADS)
                mbarrier.arrive(ready.index(s), count=1)
            elif SPLIT:
                _split_cached_tile(split_keys, split_values, v_cache_t, table, kv_head, col,
                                   cache_start + it * BLOCK_N, v_rows_per_block, ready.index(s), k_dst,
                                   vt_smem.index(s), HEAD_SIZE, PAGE, BLOCK_N, X, WARPS, HEAD_DIM, VT_COPIES,
                                   KEY_LOADS, VALUES_FIRST, False, k_dst)
            else:
                _cached_boxes(k_cache, v_cache, table, kv_head, col, cache_start + it * BLOCK_N, ready.index(s),
                              k8_smem.index(s), v8_smem.index(s), 2 * CACHE_HALF_BYTES, PAGE, BLOCK_N, HEAD_SIZE,
                              PADDED)
        else:
            row = seq_row0 + new_start + (it - cache_tiles) * BLOCK_N
            if NEW_VALUES_T:
                # The values first: their stores are done and fenced before the keys' expect arrives.
                _new_values_transposed(new_values, vt_smem.index(s), row, kv_head, num_tokens, HEAD_SIZE, BLOCK_N,
                                       WARPS, HEAD_DIM)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.expect(ready.index(s), HALF_BYTES)
            else:
                mbarrier.expect(ready.index(s), 2 * HALF_BYTES)
            if VALUES_FIRST:  # the second of the two arrivals the ring's barriers take then
                mbarrier.arrive(ready.index(s), count=1)
            _copy_rows(k_new, row, kv_head, col, ready.index(s), k_dst, 0, BLOCK_N, BLOCK_N, HEAD_SIZE, PADDED)
            if not NEW_VALUES_T:
                _copy_rows(v_new, row, kv_head, col, ready.index(s), v_smem.index(s), 0, BLOCK_N, BLOCK_N, HEAD_SIZE,
                           PADDED)


@gluon.jit
def _wait_tile(ready, it, from_cache, WRITTEN: gl.constexpr, STAGES: gl.constexpr, NEW_WRITTEN: gl.constexpr):
    """Wait until key tile ``it`` has landed in its buffer. Cached tiles the producer wrote with its own
    instructions (``WRITTEN``: the split layout's asynchronous copies, widened FP8 tiles) are ordinary
    shared-memory writes: fenced before the MMA's reads; with ``NEW_WRITTEN`` (the new tokens' values stored
    transposed by the producer) every tile is."""
    mbarrier.wait(ready.index(it % STAGES), (it // STAGES) & 1)
    if NEW_WRITTEN:
        fence_async_shared()
    elif WRITTEN:
        if from_cache:
            fence_async_shared()


@gluon.jit
def _widen(src, dst, COLS: gl.constexpr, NUM_WARPS: gl.constexpr, VIA_F32: gl.constexpr,
           BLOCK_WIDTH: gl.constexpr = 0, ROW_BLOCKS: gl.constexpr = 1, TRANSPOSED: gl.constexpr = False):
    """Copy an FP8 key or value tile ``src`` (``COLS`` columns: the head size, or the keys of a V^T tile) into
    ``dst`` in the MMA's 16-bit type, exactly (every FP8 value is a bfloat16 and a float16 value; the cache's
    scales are folded into the logits and the output instead). Each thread moves 16 bytes of FP8 at a time.

    ``VIA_F32`` (a bfloat16 ``dst``): through float16 and float32, every step exact. The direct conversion
    compiles for sm90 to a packed FP8-to-float16 conversion and then one scalar float16-to-bfloat16 conversion
    (``F2F``) per element, which issues on the pipe the softmax's exponentials take; this way the second step is
    two packed float16-to-float32 additions and one packed float32-to-bfloat16 conversion per pair of elements.

    ``BLOCK_WIDTH`` (``FP8_BOXES``' unswizzled boxes): ``src`` holds the tile in blocks of ``BLOCK_WIDTH``
    columns, one after another, and those of ``ROW_BLOCKS`` row blocks after one another (``[ROW_BLOCKS x COLS /
    BLOCK_WIDTH x rows / ROW_BLOCKS, BLOCK_WIDTH]``). A warp's lanes take consecutive rows of a block, which lie
    back to back in shared memory, and the registers are put in the tile's order.

    ``TRANSPOSED`` (``WIDEN_TO_V``): ``dst`` holds the tile transposed (V from a V^T tile). Each thread takes four
    consecutive rows of ``src``, so that it stores four consecutive elements of a ``dst`` row at a time."""
    if TRANSPOSED:
        target = dst.permute((1, 0))
        ROWS_PER_THREAD: gl.constexpr = 4
    else:
        target = dst
        ROWS_PER_THREAD: gl.constexpr = 1
    ROWS: gl.constexpr = target.shape[0]
    if BLOCK_WIDTH:
        BLOCK_LANES: gl.constexpr = BLOCK_WIDTH // 16
        blocks: gl.constexpr = gl.BlockedLayout([ROWS_PER_THREAD, 16], [32 // BLOCK_LANES, BLOCK_LANES],
                                                [NUM_WARPS, 1], [1, 0])
        tile = src.load(blocks).reshape([ROW_BLOCKS, COLS // BLOCK_WIDTH, ROWS // ROW_BLOCKS, BLOCK_WIDTH])
        tile = tile.permute((0, 2, 1, 3)).reshape([ROWS, COLS])
    else:
        LANES: gl.constexpr = COLS // 16
        layout: gl.constexpr = gl.BlockedLayout([ROWS_PER_THREAD, 16], [32 // LANES, LANES], [NUM_WARPS, 1], [1, 0])
        tile = src.load(layout)
    if VIA_F32:
        tile = tile.to(gl.float16).to(gl.float32)
    target.store(tile.to(dst.dtype))


@gluon.jit
def _softmax_tile(scores, m_i, l_i, it, q_pos, alibi2, offs_n, ctx_len, q_len, kv_len, window, softcap, qk_scale,
                  cache_start, cache_tiles, new_start, pos_first, full_from, p_layout: gl.constexpr,
                  p_dtype: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                  SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, NEW_KV_IN_CACHE: gl.constexpr,
                  FUSED_SCALE: gl.constexpr):
    """One online-softmax step on the raw scores of key tile ``it``: log2-domain logits (scale, softcap,
    ALiBi), masks only where the tile needs them, the running max and sum, and P as the next MMA's operand.
    ``FUSED_SCALE`` (without softcap and ALiBi, which need the scaled scores): the row maximum is taken on the
    raw scores and scaled once per row (``qk_scale`` is positive, so it is the same maximum), and each key's
    scale and subtraction of the maximum are one fused multiply-add, where they were a multiply and an add.

    Returns ``(P, alpha, m, l)``; the caller rescales its accumulator by ``alpha``. Rows that have seen no key
    yet keep ``m = -inf`` and contribute nothing (no NaN).
    """
    if it < cache_tiles:
        n0 = cache_start + it * BLOCK_N
        key_end = kv_len
        needs_mask = n0 + BLOCK_N > kv_len
        if NEW_KV_IN_CACHE and CAUSAL:
            needs_mask = needs_mask | (n0 + BLOCK_N - 1 > pos_first)
    else:
        n0 = ctx_len + new_start + (it - cache_tiles) * BLOCK_N
        key_end = ctx_len + q_len
        needs_mask = n0 + BLOCK_N > key_end
        if CAUSAL:
            needs_mask = needs_mask | (n0 + BLOCK_N - 1 > pos_first)
    if WINDOW:
        needs_mask = needs_mask | (n0 < full_from)
    k_pos = n0 + offs_n
    SCALE_IN_EXP: gl.constexpr = FUSED_SCALE and not SOFTCAP and not ALIBI
    if SOFTCAP:
        scores = soft_cap(scores * qk_scale, softcap) * LOG2E
    elif not SCALE_IN_EXP:
        scores = scores * qk_scale
    if ALIBI:
        scores += gl.expand_dims(alibi2, 1) * (gl.expand_dims(k_pos, 0) - gl.expand_dims(q_pos, 1)).to(gl.float32)
    if needs_mask:
        scores = gl.where(visible(q_pos, k_pos, k_pos < key_end, window, CAUSAL, WINDOW), scores, float("-inf"))
    row_max = gl.max(scores, 1)
    if SCALE_IN_EXP:
        row_max = row_max * qk_scale
    m_new = gl.maximum(m_i, row_max)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    if SCALE_IN_EXP:
        p = gl.exp2(scores * qk_scale - gl.expand_dims(m_use, 1))  # a masked key: -inf * scale - m = -inf
    else:
        p = gl.exp2(scores - gl.expand_dims(m_use, 1))
    l_i = l_i * alpha + gl.sum(p, 1)
    return gl.convert_layout(p.to(p_dtype), p_layout), alpha, m_new, l_i


@gluon.jit
def _hand_back(empty, THREAD_ARRIVALS: gl.constexpr):
    """Hand a ring buffer back to the producer once this consumer's MMAs on it are complete (each thread has
    waited for them). ``THREAD_ARRIVALS``: every thread arrives on its own (``empty`` counts each consumer's
    threads), so the warps of a consumer need not meet first; otherwise its warps meet at a barrier and one
    thread arrives for all of them."""
    if THREAD_ARRIVALS:
        # An asynchronous-copy arrival without the count's increment: one arrival per thread, issued as soon as
        # this thread's copies are done, and a consumer issues none.
        async_copy.mbarrier_arrive(empty, increment_count=False)
    else:
        gl.thread_barrier()
        mbarrier.arrive(empty, count=1)


@gluon.jit
def _consumer(q_smem, ring, output, rows, walk, features, turns, widened, kv_scales,
              HEAD_SIZE: gl.constexpr, ROW0: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HEADS_PER_TILE: gl.constexpr, TOKENS_PER_TILE: gl.constexpr, STAGES: gl.constexpr,
              NUM_WARPS: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr,
              ALIBI: gl.constexpr, SINKS: gl.constexpr, NEW_KV_IN_CACHE: gl.constexpr,
              OUT_SCALE: gl.constexpr, OUT_SCALE_PTR: gl.constexpr, OUT_MAX: gl.constexpr,
              SPLIT: gl.constexpr, TURNS: gl.constexpr, OVERLAP: gl.constexpr, FP8_CACHE: gl.constexpr,
              K_SCALE_PTR: gl.constexpr, V_SCALE_PTR: gl.constexpr, HEAD_DIM: gl.constexpr,
              PRODUCER_WIDENS: gl.constexpr, THREAD_ARRIVALS: gl.constexpr, NEW_VALUES_T: gl.constexpr,
              WIDEN_TO_V: gl.constexpr, FUSED_SCALE: gl.constexpr):
    """Consume the ring for rows ``ROW0 .. ROW0 + BLOCK_M`` of the tile (``q_smem`` holds those rows):
    scores, online softmax and ``P V`` per key tile; then normalise and store.

    The arguments come grouped as the kernel builds them: ``ring`` (the K/V buffers and their barriers),
    ``output`` (out and its scale), ``rows`` (where the tile's rows are), ``walk`` (its key tiles,
    :func:`_key_tiles`) and ``features`` (per-call feature values); then the constexprs. With ``TURNS``,
    ``turns`` is ``(mine, other)``: this consumer issues a tile's ``Q K^T`` only when ``mine`` says it is its
    turn, then hands the turn to the other consumer, so the two take the tensor cores in alternation (with
    ``OVERLAP``, the turn covers the next tile's ``Q K^T`` and this tile's ``P V``, issued together).

    ``FP8_CACHE``: cached tiles arrive in FP8 (``k8_smem``/``v8_smem`` of the ring); this consumer widens each
    into ``widened`` (its own 16-bit K and V buffers), hands the FP8 buffer back at once, and runs its MMAs on
    the widened copy. ``kv_scales`` (``k_scale``, ``v_scale`` and their tensor forms) are folded as in the
    portable kernel: ``k_scale`` into the cached tiles' logit scale, ``v_scale`` into the accumulator once the
    cached tiles are done (they come first). With ``PRODUCER_WIDENS`` the producer has widened the cached tiles
    into the 16-bit ring already: this consumer reads them there, and only folds the scales. ``NEW_VALUES_T``
    (split layout): every tile's values are in the V^T ring, the new tokens' too. ``WIDEN_TO_V`` (split layout,
    FP8 cache): every tile's values are in the V ring, the cached ones widened into it by the producer.
    """
    k_smem, v_smem, vt_smem, k8_smem, v8_smem, ready, empty = ring
    kc_smem, vc_smem = widened
    Out, stride_ot, stride_oh, out_scale, out_scale_ptr = output
    tok0, kv_head, chunk, group_size, seq_row0, num_tokens, ctx_len, q_len = rows
    cache_start, cache_tiles, new_start, new_tiles, pos_first, full_from = walk
    alibi_slopes, sinks, window, softcap, qk_scale = features
    gl.static_assert(not (FP8_CACHE and (OVERLAP or (SPLIT and not PRODUCER_WIDENS))),
                     "FP8 caches: not with OVERLAP; in the split layout, widened by the producer")
    WIDENS: gl.constexpr = FP8_CACHE and not PRODUCER_WIDENS  # this consumer widens the FP8 tiles itself
    gl.static_assert(not (THREAD_ARRIVALS and WIDENS), "THREAD_ARRIVALS: not with the consumers' own widening")
    WRITTEN: gl.constexpr = SPLIT or PRODUCER_WIDENS  # cached tiles written by the producer's own stores
    CACHED_VT: gl.constexpr = SPLIT and not WIDEN_TO_V  # cached values in the V^T ring
    qk_scale_cache = qk_scale
    v_scale = 1.0
    if FP8_CACHE:
        k_scale_value, v_scale_value, k_scale_ptr, v_scale_ptr = kv_scales
        qk_scale_cache = qk_scale * scalar_or_load(k_scale_value, k_scale_ptr, K_SCALE_PTR)
        v_scale = scalar_or_load(v_scale_value, v_scale_ptr, V_SCALE_PTR)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, HEAD_SIZE, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    key_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    head, out_rows, row_ok, q_pos = tile_rows(ROW0 + gl.arange(0, BLOCK_M, row_s), tok0, kv_head, chunk, group_size,
                                              seq_row0, ctx_len, q_len, num_tokens, HEADS_PER_TILE, TOKENS_PER_TILE)
    alibi2 = gl.zeros([BLOCK_M], gl.float32, row_s)
    if ALIBI:
        alibi2 = gl.load(alibi_slopes + head, mask=row_ok, other=0.0).to(gl.float32) * LOG2E
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, HEAD_SIZE], gl.float32, o_layout)
    offs_n = gl.arange(0, BLOCK_N, key_s)
    if NEW_KV_IN_CACHE:
        kv_len = ctx_len + q_len
    else:
        kv_len = ctx_len

    total = cache_tiles + new_tiles
    if OVERLAP:
        # Q K^T of tile it + 1 and P V of tile it are issued back to back, and the softmax of tile it + 1 runs
        # while P V of tile it is still on the tensor cores. The last iteration issues a spare Q K^T on its own
        # (still held) buffer rather than a conditional one.
        scores = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        p_op = gl.zeros([BLOCK_M, BLOCK_N], q_smem.dtype, p_layout)
        alpha = gl.full([BLOCK_M], 1.0, gl.float32, row_s)
        if total > 0:
            _wait_tile(ready, 0, 0 < cache_tiles, WRITTEN, STAGES, NEW_VALUES_T)
            scores = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), scores, use_acc=False)
            p_op, alpha, m_i, l_i = _softmax_tile(
                scores, m_i, l_i, 0, q_pos, alibi2, offs_n, ctx_len, q_len, kv_len, window, softcap, qk_scale,
                cache_start, cache_tiles, new_start, pos_first, full_from, p_layout, q_smem.dtype, BLOCK_N, CAUSAL,
                WINDOW, SOFTCAP, ALIBI, NEW_KV_IN_CACHE, FUSED_SCALE)
        for it in range(total):
            s = it % STAGES
            has_next = it + 1 < total
            s_next = gl.where(has_next, (it + 1) % STAGES, s)
            if has_next:
                _wait_tile(ready, it + 1, it + 1 < cache_tiles, WRITTEN, STAGES, NEW_VALUES_T)
            if TURNS:
                mbarrier.wait(turns[0], it & 1)
            next_token = warpgroup_mma(q_smem, k_smem.index(s_next).permute((1, 0)),
                                       gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False,
                                       is_async=True)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            if CACHED_VT:
                # Which ring holds tile it's values is known at run time only: P V stays synchronous here.
                if NEW_VALUES_T or it < cache_tiles:
                    acc = warpgroup_mma(p_op, vt_smem.index(s).permute((1, 0)), acc)
                else:
                    acc = warpgroup_mma(p_op, v_smem.index(s), acc)
                if TURNS:
                    mbarrier.arrive(turns[1], count=1)
                scores = warpgroup_mma_wait(0, deps=[next_token])
            else:
                acc_token = warpgroup_mma(p_op, v_smem.index(s), acc, is_async=True)
                if TURNS:
                    mbarrier.arrive(turns[1], count=1)
                scores = warpgroup_mma_wait(1, deps=[next_token])  # Q K^T went first: done; P V may run on
            # P V reads P from registers until it completes: P stays alive (a dependency of the wait below), so
            # the next tile's P cannot be computed into the registers the running MMA is still reading.
            p_in_flight = p_op
            if has_next:
                p_op, alpha, m_i, l_i = _softmax_tile(
                    scores, m_i, l_i, it + 1, q_pos, alibi2, offs_n, ctx_len, q_len, kv_len, window, softcap,
                    qk_scale, cache_start, cache_tiles, new_start, pos_first, full_from, p_layout, q_smem.dtype,
                    BLOCK_N, CAUSAL, WINDOW, SOFTCAP, ALIBI, NEW_KV_IN_CACHE, FUSED_SCALE)
            if not CACHED_VT:
                acc, p_in_flight = warpgroup_mma_wait(0, deps=[acc_token, p_in_flight])
            _hand_back(empty.index(s), THREAD_ARRIVALS)
    else:
        for it in range(total):
            s = it % STAGES
            from_cache = it < cache_tiles
            _wait_tile(ready, it, from_cache, WRITTEN, STAGES, NEW_VALUES_T)
            if FP8_CACHE:
                if it == cache_tiles:  # the cached tiles are done: their values' scale, once
                    acc = acc * v_scale
            if WIDENS:
                if from_cache:
                    # Widened into this consumer's own buffers (the last tile's MMAs on them are complete: they
                    # are synchronous), then the FP8 buffer goes back to the producer.
                    _widen(k8_smem.index(s), kc_smem, HEAD_SIZE, NUM_WARPS, False)
                    _widen(v8_smem.index(s), vc_smem, HEAD_SIZE, NUM_WARPS, False)
                    fence_async_shared()
                    gl.thread_barrier()
                    mbarrier.arrive(empty.index(s), count=1)
            if TURNS:
                mbarrier.wait(turns[0], it & 1)
            zeros = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
            if WIDENS and from_cache:
                scores = warpgroup_mma(q_smem, kc_smem.permute((1, 0)), zeros, use_acc=False)
            else:
                scores = warpgroup_mma(q_smem, k_smem.index(s).permute((1, 0)), zeros, use_acc=False)
            if TURNS:
                mbarrier.arrive(turns[1], count=1)
            tile_scale = qk_scale
            if FP8_CACHE and from_cache:
                tile_scale = qk_scale_cache
            p_op, alpha, m_i, l_i = _softmax_tile(
                scores, m_i, l_i, it, q_pos, alibi2, offs_n, ctx_len, q_len, kv_len, window, softcap, tile_scale,
                cache_start, cache_tiles, new_start, pos_first, full_from, p_layout, q_smem.dtype, BLOCK_N, CAUSAL,
                WINDOW, SOFTCAP, ALIBI, NEW_KV_IN_CACHE, FUSED_SCALE)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            if WIDENS and from_cache:
                acc = warpgroup_mma(p_op, vc_smem, acc)
            elif CACHED_VT and (from_cache or NEW_VALUES_T):
                # Cached values arrive transposed (V^T pages) in their own ring, new tokens' values as rows (or
                # transposed by the producer into the same ring, NEW_VALUES_T).
                acc = warpgroup_mma(p_op, vt_smem.index(s).permute((1, 0)), acc)
            else:
                acc = warpgroup_mma(p_op, v_smem.index(s), acc)
            if not (WIDENS and from_cache):
                _hand_back(empty.index(s), THREAD_ARRIVALS)
        if FP8_CACHE:
            if new_tiles == 0:  # no new tile followed the cached ones
                acc = acc * v_scale

    sink2 = gl.zeros([BLOCK_M], gl.float32, row_o)
    if SINKS:
        sink2 = gl.load(sinks + gl.convert_layout(head, row_o), mask=gl.convert_layout(row_ok, row_o),
                        other=0.0).to(gl.float32) * LOG2E
    inv_out_scale = 1.0
    if OUT_SCALE:
        inv_out_scale = 1.0 / scalar_or_load(out_scale, out_scale_ptr, OUT_SCALE_PTR)
    out = finish_rows(acc, gl.convert_layout(m_i, row_o), gl.convert_layout(l_i, row_o), sink2, inv_out_scale,
                      SINKS)
    if OUT_SCALE:
        out = round_to_fp8_e4m3(out, OUT_MAX)
    offs_d = gl.arange(0, HEAD_SIZE, gl.SliceLayout(0, o_layout))
    rows = gl.convert_layout(out_rows, row_o)
    heads = gl.convert_layout(head, row_o)
    ok = gl.convert_layout(row_ok, row_o)
    o_off = (gl.expand_dims(rows.to(gl.int64) * stride_ot + heads.to(gl.int64) * stride_oh, 1)
             + gl.expand_dims(offs_d, 0))
    store_ok = gl.expand_dims(ok, 1)
    if HEAD_DIM < HEAD_SIZE:  # not the columns of a padded head
        store_ok = store_ok & gl.expand_dims(offs_d < HEAD_DIM, 0)
    gl.store(Out + o_off, out.to(Out.dtype.element_ty), mask=store_ok)


@gluon.jit
def hopper_prefill_kernel(
    Q, Out, k_cache, v_cache, k_new, v_new, v_cache_t, K_cache, V_cache, V_new, block_table, query_start, seq_lens,
    ctx_lens,
    alibi_slopes, sinks, out_scale_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, out_scale, k_scale, v_scale, softcap, window, num_seqs, num_tokens, num_blocks, table_width,
    group_size,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table_seq,
    stride_kb, stride_kh, stride_kd, v_rows_per_block, stride_v_row, stride_vt, stride_vh,
    HEAD_SIZE: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    HEADS_PER_TILE: gl.constexpr, HEAD_CHUNKS: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
    CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, SINKS: gl.constexpr,
    SKIP_DECODE: gl.constexpr, NEW_KV_IN_CACHE: gl.constexpr, OUT_SCALE: gl.constexpr,
    OUT_SCALE_PTR: gl.constexpr, OUT_MAX: gl.constexpr, HEAVY_FIRST: gl.constexpr,
    SPLIT: gl.constexpr, X: gl.constexpr, PINGPONG: gl.constexpr, TURNS: gl.constexpr, OVERLAP: gl.constexpr,
    FP8_CACHE: gl.constexpr, K_SCALE_PTR: gl.constexpr, V_SCALE_PTR: gl.constexpr, HEAD_DIM: gl.constexpr,
    VT_COPIES: gl.constexpr, WIDE_PRODUCER: gl.constexpr, PRODUCER_WIDENS: gl.constexpr,
    KEY_LOADS: gl.constexpr, VALUES_FIRST: gl.constexpr, EARLY_KEYS: gl.constexpr, F32_WIDENING: gl.constexpr,
    THREAD_ARRIVALS: gl.constexpr, NEW_VALUES_T: gl.constexpr, FP8_BOXES: gl.constexpr, WIDEN_TO_V: gl.constexpr,
    FUSED_SCALE: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
    """Prefix-prefill attention of one query tile on sm90 (see the module docstring).

    NHD cache: ``k_cache``/``v_cache`` are TMA descriptors over the cache viewed as ``[blocks * PAGE, Hkv * D]``.
    Split cache (``SPLIT``): ``K_cache`` is the key cache itself with its block, head and ``d // X`` strides,
    copied 16 bytes at a time, and ``v_cache_t`` a TMA descriptor over the value cache viewed as
    ``[blocks * Hkv * D, PAGE]`` (``v_rows_per_block = Hkv * D`` rows per block). ``k_new``/``v_new`` are
    descriptors over the new tokens' K/V viewed as ``[T, Hkv * D]``. Arguments a layout or feature does not
    use are placeholders. ``qk_scale`` has ``log2(e)`` folded in unless ``SOFTCAP``.

    ``PINGPONG``: the tile's two halves go to two consumer partitions of one warpgroup each (launched with 4
    warps), which run their MMAs and softmaxes independently, so one's softmax can overlap the other's MMAs;
    otherwise one consumer partition of ``NUM_WARPS`` warps runs the whole tile in lockstep. ``TURNS`` (with
    ``PINGPONG``) makes the two consumers issue their ``Q K^T`` in strict alternation, the first one first.
    ``OVERLAP`` issues each tile's ``Q K^T`` before the previous tile's softmax is done with (see _consumer).
    ``FP8_CACHE`` (NHD): ``k_cache``/``v_cache`` describe the FP8 cache; its tiles land in FP8 buffers of their
    own and each consumer widens them to 16 bits before its MMAs; ``k_scale``/``v_scale`` (or the tensors behind
    ``k_scale_ptr``/``v_scale_ptr``) are folded into the logits and the output. ``WIDE_PRODUCER`` (split
    layout) gives the producer a warpgroup instead of one warp, so that four warps share its 16-byte copies.
    ``PRODUCER_WIDENS`` (FP8 cache): a producer warpgroup widens each cached tile once into the 16-bit ring,
    instead of each consumer into its own copy. ``KEY_LOADS`` (split layout; 0 for off): the producer warpgroup
    reads the cached keys with loads and stores instead of asynchronous copies, ``KEY_LOADS`` keys (32 or 64) per
    chunk; ``VALUES_FIRST`` (with it) issues each cached tile's value boxes before loading its keys;
    ``EARLY_KEYS`` (with it) loads each cached tile's keys before waiting for its buffer. ``F32_WIDENING``
    (with ``PRODUCER_WIDENS``, a bfloat16 call) widens FP8 tiles through float32 (:func:`_widen`).
    ``THREAD_ARRIVALS`` (not with the consumers' own widening): each consumer thread hands a buffer back by an
    arrival of its own, without a barrier among the consumer's warps first (:func:`_hand_back`).
    ``NEW_VALUES_T`` (split layout, 16-bit cache): the producer stores the new tokens' values transposed into the
    V^T ring (``V_new`` is ``v`` itself, with its token and head strides ``stride_vt``/``stride_vh``), so there is
    no V ring (:func:`_new_values_transposed`). ``FP8_BOXES`` (split layout, FP8 cache, a head size that is a
    power of two): the cached keys and values come by unswizzled TMA boxes instead of 16-byte copies, ``k_cache``
    describing the key cache as ``[pages x heads x D / X, PAGE, X]`` and ``v_cache_t`` the value cache.
    ``WIDEN_TO_V`` (split layout, FP8 cache): the producer widens the cached values into the V ring, transposed,
    so that every tile's values are in one ring as in NHD and there is no V^T ring.
    """
    TOKENS_PER_TILE: gl.constexpr = BLOCK_M // HEADS_PER_TILE
    tile = gl.program_id(0)
    if HEAVY_FIRST:
        # Programs start in index order: the last tiles of each sequence (the most keys under a causal mask)
        # go first, so the lightest ones fill the end of the launch.
        tile = gl.num_programs(0) - 1 - tile
    seq, tok0, seq_row0, ctx_len, q_len, done = tile_sequence(tile, query_start, seq_lens, ctx_lens, num_seqs,
                                                              TOKENS_PER_TILE, SKIP_DECODE)
    if done:
        return
    kv_head = gl.program_id(1) // HEAD_CHUNKS
    chunk = gl.program_id(1) % HEAD_CHUNKS

    # Rows of the tile: (token, head) pairs, read from q with ordinary loads (any strides, any packing).
    LAUNCH_WARPS: gl.constexpr = NUM_WARPS // 2 if PINGPONG else NUM_WARPS
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LAUNCH_WARPS, 1], [1, 0])
    offs_m = gl.arange(0, BLOCK_M, gl.SliceLayout(1, load_layout))
    offs_d = gl.arange(0, HEAD_SIZE, gl.SliceLayout(0, load_layout))
    head, q_rows, row_ok, _ = tile_rows(offs_m, tok0, kv_head, chunk, group_size, seq_row0, ctx_len, q_len,
                                        num_tokens, HEADS_PER_TILE, TOKENS_PER_TILE)
    q_off = (gl.expand_dims(q_rows.to(gl.int64) * stride_qt + head.to(gl.int64) * stride_qh, 1)
             + gl.expand_dims(offs_d, 0))
    q_ok = gl.expand_dims(row_ok, 1)
    if HEAD_DIM < HEAD_SIZE:
        # Columns past a padded head are zeros: the keys' columns there (zeros too) add nothing to the scores.
        q_ok = q_ok & gl.expand_dims(offs_d < HEAD_DIM, 0)
    q = gl.load(Q + q_off, mask=q_ok, other=0.0)

    tok_last = gl.minimum(tok0 + TOKENS_PER_TILE, q_len) - 1
    cache_start, cache_tiles, new_start, new_tiles = _key_tiles(ctx_len, q_len, tok0, tok_last, window, BLOCK_N,
                                                                CAUSAL, WINDOW, NEW_KV_IN_CACHE)
    # A table without columns or a cache without blocks holds nothing to read, whatever ctx_len claims.
    cache_tiles = gl.where((table_width > 0) & (num_blocks > 0), cache_tiles, 0)
    full_from = 0  # keys every row of the tile sees without a window mask start here
    if WINDOW:
        full_from = gl.maximum(ctx_len + tok_last - window + 1, 0)

    dtype: gl.constexpr = Q.dtype.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_SIZE],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_SIZE], dtype), q)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_SIZE], dtype)
    gl.static_assert(not NEW_VALUES_T or (SPLIT and not FP8_CACHE),
                     "NEW_VALUES_T: the split layout's 16-bit cache")
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_SIZE], kv_layout)
    if not NEW_VALUES_T:  # (every tile's values go to the V^T ring otherwise)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_SIZE], kv_layout)
    gl.static_assert(not WIDEN_TO_V or (SPLIT and FP8_CACHE and PRODUCER_WIDENS),
                     "WIDEN_TO_V: the split layout's FP8 cache, widened by the producer")
    if SPLIT and WIDEN_TO_V:
        vt_smem = v_smem  # not read: every tile's values are widened or copied into the V ring
    elif SPLIT:
        if VT_COPIES or FP8_CACHE:  # copied (or widened) by the producer into the layout the MMA reads best
            vt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_SIZE, BLOCK_N], dtype)
        elif HEAD_DIM < HEAD_SIZE:  # the boxes' rank-3 layout, seen as the [D, BLOCK_N] tile it fills
            vt_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=v_cache_t.layout.swizzle_byte_width,
                                                           element_bitwidth=dtype.primitive_bitwidth, rank=2)
        else:  # cached values as V^T pages by TMA: [D, BLOCK_N], each page a column block of the box's swizzle
            vt_layout: gl.constexpr = v_cache_t.layout
        vt_smem = gl.allocate_shared_memory(dtype, [STAGES, HEAD_SIZE, BLOCK_N], vt_layout)
        if NEW_VALUES_T:
            v_smem = vt_smem  # not read: a placeholder in the ring's tuple
    else:
        vt_smem = v_smem
    CONSUMERS: gl.constexpr = 2 if PINGPONG else 1
    if FP8_CACHE:
        # Cached tiles in FP8 as they arrive, and each consumer's own 16-bit copy of the tile it works on.
        c_dtype: gl.constexpr = k_cache.dtype
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_SIZE], c_dtype)
        gl.static_assert(not FP8_BOXES or (SPLIT and HEAD_DIM == HEAD_SIZE),
                         "FP8_BOXES: the split layout's FP8 cache at a head size that is a power of two")
        if FP8_BOXES:
            # One whole block per box, the pages one after another: the keys' [D / X, box, X] (seen as rows of X)
            # and the values' V^T [D, box].
            VALUE_BOX: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
            k8_smem = gl.allocate_shared_memory(c_dtype, [STAGES, HEAD_SIZE // X * BLOCK_N, X],
                                                gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2))
            v8_smem = gl.allocate_shared_memory(c_dtype, [STAGES, BLOCK_N // VALUE_BOX * HEAD_SIZE, VALUE_BOX],
                                                v_cache_t.layout)
        else:
            k8_smem = gl.allocate_shared_memory(c_dtype, [STAGES, BLOCK_N, HEAD_SIZE], c_layout)
            if SPLIT:  # the values as V^T pages, [D, BLOCK_N], by 16-byte copies
                v8_smem = gl.allocate_shared_memory(c_dtype, [STAGES, HEAD_SIZE, BLOCK_N],
                                                    gl.NVMMASharedLayout.get_default_for([HEAD_SIZE, BLOCK_N], c_dtype))
            else:
                v8_smem = gl.allocate_shared_memory(c_dtype, [STAGES, BLOCK_N, HEAD_SIZE], c_layout)
        if PRODUCER_WIDENS:  # widened once, into the 16-bit ring: no copies of the consumers' own
            kc_smem = k_smem
            vc_smem = v_smem
        else:
            kc_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_N, HEAD_SIZE], kv_layout)
            vc_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_N, HEAD_SIZE], kv_layout)
    else:
        k8_smem = k_smem
        v8_smem = v_smem
        kc_smem = k_smem  # unused
        vc_smem = v_smem
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # Value boxes issued before the keys' loads: a cached tile's barrier then waits for the boxes' expect and for
    # an arrival after the keys' stores (a new-token tile's arrives twice at once).
    EARLY_VALUES: gl.constexpr = VALUES_FIRST and KEY_LOADS and SPLIT and not VT_COPIES and not FP8_CACHE
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=2 if EARLY_VALUES else 1)
        # Every consumer hands the buffer back: one arrival each, or one per thread (THREAD_ARRIVALS).
        mbarrier.init(empty.index(i), count=CONSUMERS * LAUNCH_WARPS * 32 if THREAD_ARRIVALS else CONSUMERS)
    ready8 = ready  # PRODUCER_WIDENS: the FP8 ring's own barriers (its bytes landed), seen by the producer only
    if PRODUCER_WIDENS:
        ready8 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready8.index(i), count=1)
    # Whose turn it is to issue Q K^T (TURNS): the first consumer's barrier starts completed.
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if TURNS:
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
    fence_async_shared()
    if TURNS:
        mbarrier.arrive(turn.index(0), count=1)
    table_row = block_table + seq.to(gl.int64) * stride_table_seq

    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    # The consumers' arguments, grouped (see _consumer); both walk the same key tiles.
    ring = (k_smem, v_smem, vt_smem, k8_smem, v8_smem, ready, empty)
    kv_scales = (k_scale, v_scale, k_scale_ptr, v_scale_ptr)
    output = (Out, stride_ot, stride_oh, out_scale, out_scale_ptr)
    rows = (tok0, kv_head, chunk, group_size, seq_row0, num_tokens, ctx_len, q_len)
    walk = (cache_start, cache_tiles, new_start, new_tiles, ctx_len + tok0, full_from)
    features = (alibi_slopes, sinks, window, softcap, qk_scale)
    # (Constexprs are written out in each partition's list: a tuple variable would not keep them constexpr.)
    loads = (k_cache, v_cache, k_new, v_new, v_cache_t, (K_cache, stride_kb, stride_kh, stride_kd),
             (V_cache, v_rows_per_block, stride_v_row))
    table = (table_row, table_width, num_blocks)
    new_values = (V_new, stride_vt, stride_vh)
    PRODUCER_WARPS: gl.constexpr = 4 if ((WIDE_PRODUCER or KEY_LOADS or NEW_VALUES_T) and SPLIT) or PRODUCER_WIDENS \
        else 1
    if PINGPONG:
        gl.warp_specialize([
            (_consumer, (q_smem.slice(0, ROWS), ring, output, rows, walk, features, (turn.index(0), turn.index(1)),
                         (kc_smem.index(0), vc_smem.index(0)), kv_scales,
                         HEAD_SIZE, 0, ROWS, BLOCK_N, HEADS_PER_TILE, TOKENS_PER_TILE, STAGES, LAUNCH_WARPS, CAUSAL,
                         WINDOW, SOFTCAP, ALIBI, SINKS, NEW_KV_IN_CACHE, OUT_SCALE, OUT_SCALE_PTR, OUT_MAX, SPLIT,
                         TURNS, OVERLAP, FP8_CACHE, K_SCALE_PTR, V_SCALE_PTR, HEAD_DIM, PRODUCER_WIDENS,
                         THREAD_ARRIVALS, NEW_VALUES_T, WIDEN_TO_V, FUSED_SCALE)),
            (_consumer, (q_smem.slice(ROWS, ROWS), ring, output, rows, walk, features, (turn.index(1), turn.index(0)),
                         (kc_smem.index(CONSUMERS - 1), vc_smem.index(CONSUMERS - 1)), kv_scales,
                         HEAD_SIZE, ROWS, ROWS, BLOCK_N, HEADS_PER_TILE, TOKENS_PER_TILE, STAGES, LAUNCH_WARPS, CAUSAL,
                         WINDOW, SOFTCAP, ALIBI, SINKS, NEW_KV_IN_CACHE, OUT_SCALE, OUT_SCALE_PTR, OUT_MAX, SPLIT,
                         TURNS, OVERLAP, FP8_CACHE, K_SCALE_PTR, V_SCALE_PTR, HEAD_DIM, PRODUCER_WIDENS,
                         THREAD_ARRIVALS, NEW_VALUES_T, WIDEN_TO_V, FUSED_SCALE)),
            (_producer, (loads, ring, ready8, table, kv_head, seq_row0, v_rows_per_block, walk, new_values,
                         num_tokens, HEAD_SIZE, PAGE, BLOCK_N, STAGES, SPLIT, X, HEAD_DIM, VT_COPIES, PRODUCER_WARPS,
                         PRODUCER_WIDENS, KEY_LOADS, EARLY_VALUES, EARLY_KEYS, F32_WIDENING, NEW_VALUES_T,
                         FP8_BOXES, WIDEN_TO_V)),
        ], [LAUNCH_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (q_smem, ring, output, rows, walk, features, (turn.index(0), turn.index(1)),
                         (kc_smem.index(0), vc_smem.index(0)), kv_scales,
                         HEAD_SIZE, 0, ROWS, BLOCK_N, HEADS_PER_TILE, TOKENS_PER_TILE, STAGES, LAUNCH_WARPS, CAUSAL,
                         WINDOW, SOFTCAP, ALIBI, SINKS, NEW_KV_IN_CACHE, OUT_SCALE, OUT_SCALE_PTR, OUT_MAX, SPLIT,
                         False, OVERLAP, FP8_CACHE, K_SCALE_PTR, V_SCALE_PTR, HEAD_DIM, PRODUCER_WIDENS,
                         THREAD_ARRIVALS, NEW_VALUES_T, WIDEN_TO_V, FUSED_SCALE)),
            (_producer, (loads, ring, ready8, table, kv_head, seq_row0, v_rows_per_block, walk, new_values,
                         num_tokens, HEAD_SIZE, PAGE, BLOCK_N, STAGES, SPLIT, X, HEAD_DIM, VT_COPIES, PRODUCER_WARPS,
                         PRODUCER_WIDENS, KEY_LOADS, EARLY_VALUES, EARLY_KEYS, F32_WIDENING, NEW_VALUES_T,
                         FP8_BOXES, WIDEN_TO_V)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])

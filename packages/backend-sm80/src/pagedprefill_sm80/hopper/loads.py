"""How the Hopper kernel's producer moves key tiles into shared memory, per cache layout.

NHD: one TMA box per cache page (or per tile when a page holds several tiles) for the cached K and V, one box
per tile of new tokens (:func:`copy_rows`, :func:`cached_boxes`). Split layout: no TMA view fits its keys'
``[D / x, block, x]`` pages, so they come by 16-byte asynchronous copies (:func:`split_keys_async`) or by a
producer warpgroup's loads and stores (:func:`split_keys_loaded`), and its values as V^T pages, one TMA box per
page (:func:`split_value_boxes`) or, from an FP8 cache, by 16-byte copies (:func:`split_values_async`) or page
boxes with its keys (:func:`split_boxed_tile`). FP8 tiles are widened to 16 bits in shared memory
(:func:`widen`). Every TMA box is bounds-checked by the hardware against the tensor it was described on (rows
outside read as zeros) and table columns and block numbers are clamped (:func:`page_blocks`): inconsistent metadata
cannot read outside the caller's tensors.
"""

from pagedprefill.triton.blocks import aligned
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, mbarrier, tma


@gluon.jit
def page_blocks(cfg, table, pos):
    """The cache blocks that hold key positions ``pos`` (a tensor or a scalar), from the sequence's block-table
    row (``table`` is the row, the table's width and the cache's block count): columns clamped to the table and
    block numbers outside the cache replaced by 0, so a corrupt table reads a wrong page, never outside the
    cache."""
    table_row, table_width, num_blocks = table
    cols = gl.maximum(gl.minimum(pos // cfg.LAYOUT.PAGE, table_width - 1), 0)
    pages = gl.load(table_row + cols)
    return gl.where((pages >= 0) & (pages < num_blocks), pages, 0)


@gluon.jit
def split_key_pointers(cfg, split_keys, table, kv_head, n0, ROWS: gl.constexpr, layout: gl.constexpr):
    """Pointers to ``ROWS`` cached keys from position ``n0`` in the split layout ``[blocks, Hkv, D / X, PAGE, X]``,
    as a ``[ROWS, HEAD_SIZE]`` tile in ``layout``, and the mask of the columns inside the head (all true unless
    ``PADDED``). ``split_keys`` is ``(K_cache, stride_block, stride_head, stride_group)``, strides multiples of
    ``X``. ``ROWS`` and ``layout`` are the caller's: a whole tile of copies, or a chunk of loads."""
    K_cache, stride_kb, stride_kh, stride_kd = split_keys
    offs_n = gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    offs_d = gl.arange(0, cfg.HEAD_SIZE, gl.SliceLayout(0, layout))
    pos = n0 + offs_n
    pages = page_blocks(cfg, table, pos).to(gl.int64)
    row_off = (pages * aligned(stride_kb, cfg.LAYOUT.X) + kv_head.to(gl.int64) * aligned(stride_kh, cfg.LAYOUT.X)
               + (pos % cfg.LAYOUT.PAGE) * cfg.LAYOUT.X)
    col_off = (offs_d // cfg.LAYOUT.X) * aligned(stride_kd, cfg.LAYOUT.X) + offs_d % cfg.LAYOUT.X
    ptrs = K_cache + gl.expand_dims(row_off, 1) + gl.expand_dims(col_off, 0)
    # The mask takes the pointers' 2-D shape and layout: the always-true key term only broadcasts it.
    in_head = gl.expand_dims(offs_n >= 0, 1) & gl.expand_dims(offs_d < cfg.LAYOUT.HEAD_DIM, 0)
    return ptrs, in_head


@gluon.jit
def split_keys_async(cfg, split_keys, k_dst, table, kv_head, n0):
    """Copy one tile of cached keys from the split layout into the ``[BLOCK_N, D]`` tile the QK^T MMA reads,
    16 bytes (one ``X`` vector) per asynchronous copy.

    The split layout has no 2-D view a TMA box could take, so the producer's ``PRODUCER_WARPS`` warps copy: their
    lanes walk along the slots of a page, where consecutive ``X`` vectors of one ``d // X`` group are contiguous.
    A head of ``HEAD_DIM`` < ``HEAD_SIZE`` columns (96 on a 128-wide tile) fills the columns past it with zeros
    (masked copies read nothing there), so that they add nothing to the scores.
    """
    LANES_N: gl.constexpr = 16 if cfg.BLOCK_N >= 16 else cfg.BLOCK_N
    k_ld: gl.constexpr = gl.BlockedLayout([1, cfg.LAYOUT.X], [LANES_N, 32 // LANES_N],
                                          [cfg.SCHEDULE.PRODUCER_WARPS, 1], [0, 1])
    ptrs, in_head = split_key_pointers(cfg, split_keys, table, kv_head, n0, cfg.BLOCK_N, k_ld)
    if cfg.PADDED:
        async_copy.async_copy_global_to_shared(k_dst, ptrs, mask=in_head)
    else:
        async_copy.async_copy_global_to_shared(k_dst, ptrs)


@gluon.jit
def load_in_head(cfg, ptrs, in_head):
    """Load a tile of keys; columns past a padded head (``PADDED``) read as zeros."""
    if cfg.PADDED:
        return gl.load(ptrs, mask=in_head, other=0.0)
    else:
        return gl.load(ptrs)


@gluon.jit
def split_keys_loaded(cfg, split_keys, k_dst, table, kv_head, n0):
    """The same tile as :func:`split_keys_async`, through registers: ordinary 16-byte loads, which the L1 merges
    into one L2 request per 128-byte line (a 16-byte asynchronous copy is an L2 request of its own: on the split
    layout those requests, not the bytes, bound the L2), stored into ``k_dst``. The schedule's ``KEY_LOADS`` keys
    at a time (32 or 64, at most ``BLOCK_N``), the next chunk's loads issued before this chunk's stores. The
    producer is a warpgroup (``PRODUCER_WARPS`` = 4); the stores are complete when this returns."""
    keys = split_key_chunk(cfg, split_keys, table, kv_head, n0)
    for c in gl.static_range(1, cfg.BLOCK_N // cfg.SCHEDULE.KEY_LOADS):
        following = split_key_chunk(cfg, split_keys, table, kv_head, n0 + c * cfg.SCHEDULE.KEY_LOADS)
        k_dst.slice((c - 1) * cfg.SCHEDULE.KEY_LOADS, cfg.SCHEDULE.KEY_LOADS).store(keys)
        keys = following
    k_dst.slice(cfg.BLOCK_N - cfg.SCHEDULE.KEY_LOADS, cfg.SCHEDULE.KEY_LOADS).store(keys)


@gluon.jit
def split_key_chunk(cfg, split_keys, table, kv_head, n0):
    """``KEY_LOADS`` cached keys from position ``n0`` of the split layout, loaded into the producer warpgroup's
    registers (``PRODUCER_WARPS`` = 4) as a ``[KEY_LOADS, HEAD_SIZE]`` tile."""
    k_ld: gl.constexpr = gl.BlockedLayout([1, cfg.LAYOUT.X], [16, 2], [2, cfg.SCHEDULE.PRODUCER_WARPS // 2], [0, 1])
    ptrs, in_head = split_key_pointers(cfg, split_keys, table, kv_head, n0, cfg.SCHEDULE.KEY_LOADS, k_ld)
    return load_in_head(cfg, ptrs, in_head)


@gluon.jit
def split_tile_keys(cfg, split_keys, table, kv_head, n0):
    """A whole tile of cached keys in registers, as its one or two chunks of ``KEY_LOADS`` keys (the second
    repeats the first when the tile is one chunk)."""
    first = split_key_chunk(cfg, split_keys, table, kv_head, n0)
    second = first
    if cfg.BLOCK_N > cfg.SCHEDULE.KEY_LOADS:
        second = split_key_chunk(cfg, split_keys, table, kv_head, n0 + cfg.SCHEDULE.KEY_LOADS)
    return first, second


@gluon.jit
def split_values_async(cfg, split_values, vt_dst, table, kv_head, n0):
    """Copy one tile of cached values from the split layout (``[blocks, Hkv, D, PAGE]``: a page of one head is
    ``D`` rows of ``PAGE`` slots) into an FP8 cache's V^T buffer ``vt_dst`` (``[D, BLOCK_N]``), 16 bytes of
    consecutive slots per asynchronous copy (a page of 16 FP8 slots is narrower than the narrowest
    swizzle). ``split_values`` is
    ``(V_cache, rows per block, row stride)``: the cache seen as ``[blocks x Hkv x D, PAGE]`` rows, as its TMA
    view is. Rows past a padded head (``HEAD_DIM`` < ``HEAD_SIZE``) are masked: the copies fill them with zeros
    and read nothing."""
    V_cache, rows_per_block, stride_row = split_values
    # 16 bytes of values (8 16-bit or 16 FP8 ones); PAGE >= 16 keeps a vector inside one page.
    VEC: gl.constexpr = 128 // V_cache.dtype.element_ty.primitive_bitwidth
    LANES_N: gl.constexpr = cfg.BLOCK_N // VEC
    v_ld: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // LANES_N, LANES_N], [cfg.SCHEDULE.PRODUCER_WARPS, 1],
                                          [1, 0])
    offs_d = gl.arange(0, cfg.HEAD_SIZE, gl.SliceLayout(1, v_ld))
    offs_n = gl.arange(0, cfg.BLOCK_N, gl.SliceLayout(0, v_ld))
    pos = n0 + offs_n
    pages = page_blocks(cfg, table, pos).to(gl.int64)
    rows = pages * rows_per_block + kv_head.to(gl.int64) * cfg.LAYOUT.HEAD_DIM
    slots = gl.max_contiguous(gl.multiple_of(pos % cfg.LAYOUT.PAGE, VEC), VEC)  # n0 is a multiple of BLOCK_N
    offs = (gl.expand_dims(rows, 0) + gl.expand_dims(offs_d, 1)) * aligned(stride_row, VEC) + gl.expand_dims(slots, 0)
    if cfg.PADDED:
        in_head = gl.expand_dims(offs_d < cfg.LAYOUT.HEAD_DIM, 1) & gl.expand_dims(offs_n >= 0, 0)
        async_copy.async_copy_global_to_shared(vt_dst, V_cache + offs, mask=in_head)
    else:
        async_copy.async_copy_global_to_shared(vt_dst, V_cache + offs)


@gluon.jit
def copy_rows(cfg, desc, row, kv_head, col, barrier, tile, start, ROWS: gl.constexpr):
    """One TMA box of ``ROWS`` rows of one head into rows ``start ..`` of ``tile`` (``[BLOCK_N, HEAD_SIZE]``):
    from the 2-D view ``[rows, heads x head size]`` at column ``col`` (under ``WIDE_BOXES`` a padded head's box
    too, its columns past the head the next head's), or (``PADDED``) from the rank-3 view at ``kv_head`` (the
    buffer seen as ``[BLOCK_N, 1, HEAD_SIZE]`` first: a slice cannot be reshaped). ``ROWS`` is the caller's: a
    cached tile's box (``BOX``), or a whole tile of new tokens."""
    if cfg.PADDED and not cfg.SCHEDULE.WIDE_BOXES:
        dst3 = tile.reshape([cfg.BLOCK_N, 1, cfg.HEAD_SIZE])
        if ROWS < cfg.BLOCK_N:
            dst3 = dst3.slice(start, ROWS)
        tma.async_copy_global_to_shared(desc, [row, kv_head, 0], barrier, dst3)
    elif ROWS < cfg.BLOCK_N:
        tma.async_copy_global_to_shared(desc, [row, col], barrier, tile.slice(start, ROWS))
    else:
        tma.async_copy_global_to_shared(desc, [row, col], barrier, tile)


@gluon.jit
def cached_boxes(cfg, k_cache, v_cache, table, kv_head, col, n0, barrier, k_dst, v_dst,
                 KEYS: gl.constexpr = True, VALUES: gl.constexpr = True):
    """One NHD tile of cached keys and values by TMA into ``k_dst``/``v_dst``, one box per page (or per tile
    when a page holds several: ``BOX`` keys), counted in bytes by ``barrier`` (a tile of ``k_dst``'s type for the
    keys, of ``v_dst``'s for the values); the keys alone (``VALUES`` off) or the values alone (``KEYS`` off) where
    they go to different rings."""
    KEY_BYTES: gl.constexpr = cfg.tile_bytes(k_dst.dtype) if KEYS else 0
    VALUE_BYTES: gl.constexpr = cfg.tile_bytes(v_dst.dtype) if VALUES else 0
    mbarrier.expect(barrier, KEY_BYTES + VALUE_BYTES)
    for b in gl.static_range(cfg.BLOCK_N // cfg.BOX):
        pos = n0 + b * cfg.BOX
        row = page_blocks(cfg, table, pos) * cfg.LAYOUT.PAGE + pos % cfg.LAYOUT.PAGE
        if KEYS:
            copy_rows(cfg, k_cache, row, kv_head, col, barrier, k_dst, b * cfg.BOX, cfg.BOX)
        if VALUES:
            copy_rows(cfg, v_cache, row, kv_head, col, barrier, v_dst, b * cfg.BOX, cfg.BOX)


@gluon.jit
def split_value_boxes(cfg, v_cache_t, table, kv_head, col, n0, v_rows_per_block, barrier, vt_dst,
                      PAGE_BLOCKS: gl.constexpr = False):
    """One split-layout tile of cached values into ``vt_dst`` as V^T (``[D, BLOCK_N]``), one TMA box per page,
    counted in bytes by ``barrier``. ``PAGE_BLOCKS`` (``FP8_BOXES``): ``vt_dst`` holds the pages' ``[D, box]``
    blocks one after another (``[BLOCK_N / box x D, box]``, :func:`widen`'s ``BLOCK_WIDTH``), so that every box
    lands on a whole block; a column slice of an unswizzled ``[D, BLOCK_N]`` tile is not contiguous, and a TMA
    destination must be (and 128-byte aligned)."""
    for b in gl.static_range(cfg.BLOCK_N // cfg.BOX):
        pos = n0 + b * cfg.BOX
        # A page's values of one head are one [D, PAGE] block: V^T, one box per page.
        if cfg.PADDED:
            # The rank-3 view [blocks x heads, HEAD_DIM, PAGE]: a box of HEAD_SIZE rows reads the rows past the
            # head as zeros (outside the view, never another head's values).
            page_row = page_blocks(cfg, table, pos) * (v_rows_per_block // cfg.LAYOUT.HEAD_DIM) + kv_head
            vt3 = vt_dst.reshape([1, cfg.HEAD_SIZE, cfg.BLOCK_N]).slice(b * cfg.BOX, cfg.BOX, dim=2)
            tma.async_copy_global_to_shared(v_cache_t, [page_row, 0, pos % cfg.LAYOUT.PAGE], barrier, vt3)
        else:
            row = page_blocks(cfg, table, pos) * v_rows_per_block + col
            if PAGE_BLOCKS:
                page_dst = vt_dst.slice(b * cfg.HEAD_SIZE, cfg.HEAD_SIZE)
            else:
                page_dst = vt_dst.slice(b * cfg.BOX, cfg.BOX, dim=1)
            tma.async_copy_global_to_shared(v_cache_t, [row, pos % cfg.LAYOUT.PAGE], barrier, page_dst)


@gluon.jit
def split_boxed_tile(cfg, k_desc, split_keys, v_cache_t, table, kv_head, col, n0, v_rows_per_block, barrier, k_dst,
                     vt_dst):
    """One split-layout tile of cached keys and values by TMA alone (``FP8_BOXES``), counted in bytes by
    ``barrier``: a page's keys of one head are ``D / X`` contiguous ``[PAGE, X]`` blocks, together one box
    ``[D / X, box, X]`` into ``k_dst``'s block of that page (``[BLOCK_N / box x D / X x box, X]``: the pages one
    after another), and its values one V^T box into ``vt_dst``'s block of that page (:func:`split_value_boxes`).
    ``k_desc`` describes the key cache as ``[pages x heads x D / X, PAGE, X]``. (A 16-bit K tile read by the MMAs
    cannot take this: Triton 3.6's warpgroup MMA takes no unswizzled K; an FP8 tile is only read by the
    producer's widening.) Only for a head that fills the tile (``allocate_ring`` asserts it for ``FP8_BOXES``):
    the values take :func:`split_value_boxes`' boxes of a whole head."""
    gl.static_assert(not cfg.PADDED, "FP8_BOXES: a head size that is a power of two")
    _, stride_kb, stride_kh, _ = split_keys
    mbarrier.expect(barrier, 2 * cfg.tile_bytes(k_dst.dtype))
    COLUMNS: gl.constexpr = cfg.HEAD_SIZE // cfg.LAYOUT.X
    BLOCK: gl.constexpr = cfg.LAYOUT.PAGE * cfg.LAYOUT.X  # the elements of one [PAGE, X] block
    for b in gl.static_range(cfg.BLOCK_N // cfg.BOX):
        pos = n0 + b * cfg.BOX
        # The first column of (page, head) among the cache's [PAGE, X] blocks (the launch checked that the
        # cache is contiguous from its block dimension in, so the head's D / X columns follow it, and that they
        # fit TMA's 32-bit coordinates).
        first = page_blocks(cfg, table, pos) * (stride_kb // BLOCK) + kv_head * (stride_kh // BLOCK)
        page_dst = k_dst.slice(b * COLUMNS * cfg.BOX, COLUMNS * cfg.BOX)._reinterpret(
            k_dst.dtype, [COLUMNS, cfg.BOX, cfg.LAYOUT.X], k_desc.layout)
        tma.async_copy_global_to_shared(k_desc, [first, pos % cfg.LAYOUT.PAGE, 0], barrier, page_dst)
    split_value_boxes(cfg, v_cache_t, table, kv_head, col, n0, v_rows_per_block, barrier, vt_dst, True)


@gluon.jit
def widen(cfg, src, dst, COLS: gl.constexpr, VIA_F32: gl.constexpr, BLOCK_WIDTH: gl.constexpr = 0,
          ROW_BLOCKS: gl.constexpr = 1, TRANSPOSED: gl.constexpr = False):
    """Copy an FP8 key or value tile ``src`` (``COLS`` columns: the head size, or the keys of a V^T tile) into
    ``dst`` in the MMA's 16-bit type, exactly (every FP8 value is a bfloat16 and a float16 value; the cache's
    scales are folded into the logits and the output instead), or in FP8 as it is, laid out for an FP8 MMA
    (the split layout's keys under ``FP8_SCORES``), by the producer's ``PRODUCER_WARPS`` warps. Each thread moves
    16 bytes of FP8 at a time. ``COLS`` and the flags below are the tile's own: a key and a value tile differ in them.

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
                                                [cfg.SCHEDULE.PRODUCER_WARPS, 1], [1, 0])
        tile = src.load(blocks).reshape([ROW_BLOCKS, COLS // BLOCK_WIDTH, ROWS // ROW_BLOCKS, BLOCK_WIDTH])
        tile = tile.permute((0, 2, 1, 3)).reshape([ROWS, COLS])
    else:
        LANES: gl.constexpr = COLS // 16
        layout: gl.constexpr = gl.BlockedLayout([ROWS_PER_THREAD, 16], [32 // LANES, LANES],
                                                [cfg.SCHEDULE.PRODUCER_WARPS, 1], [1, 0])
        tile = src.load(layout)
    if VIA_F32:
        tile = tile.to(gl.float16).to(gl.float32)
    target.store(tile.to(dst.dtype))

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
def page_blocks(table, pos, PAGE: gl.constexpr):
    """The cache blocks that hold key positions ``pos`` (a tensor or a scalar), from the sequence's block-table
    row (``table`` is the row, the table's width and the cache's block count): columns clamped to the table and
    block numbers outside the cache replaced by 0, so a corrupt table reads a wrong page, never outside the
    cache."""
    table_row, table_width, num_blocks = table
    cols = gl.maximum(gl.minimum(pos // PAGE, table_width - 1), 0)
    pages = gl.load(table_row + cols)
    return gl.where((pages >= 0) & (pages < num_blocks), pages, 0)


@gluon.jit
def split_key_pointers(split_keys, table, kv_head, n0, ROWS: gl.constexpr, HEAD_SIZE: gl.constexpr,
                       PAGE: gl.constexpr, X: gl.constexpr, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
    """Pointers to ``ROWS`` cached keys from position ``n0`` in the split layout ``[blocks, Hkv, D / X, PAGE, X]``,
    as a ``[ROWS, HEAD_SIZE]`` tile in ``layout``, and the mask of the columns inside the head (all true unless
    ``HEAD_DIM`` < ``HEAD_SIZE``). ``split_keys`` is ``(K_cache, stride_block, stride_head, stride_group)``,
    strides multiples of ``X``."""
    K_cache, stride_kb, stride_kh, stride_kd = split_keys
    offs_n = gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    offs_d = gl.arange(0, HEAD_SIZE, gl.SliceLayout(0, layout))
    pos = n0 + offs_n
    pages = page_blocks(table, pos, PAGE).to(gl.int64)
    row_off = pages * aligned(stride_kb, X) + kv_head.to(gl.int64) * aligned(stride_kh, X) + (pos % PAGE) * X
    col_off = (offs_d // X) * aligned(stride_kd, X) + offs_d % X
    ptrs = K_cache + gl.expand_dims(row_off, 1) + gl.expand_dims(col_off, 0)
    # The mask takes the pointers' 2-D shape and layout: the always-true key term only broadcasts it.
    in_head = gl.expand_dims(offs_n >= 0, 1) & gl.expand_dims(offs_d < HEAD_DIM, 0)
    return ptrs, in_head


@gluon.jit
def split_keys_async(split_keys, k_dst, table, kv_head, n0,
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
    ptrs, in_head = split_key_pointers(split_keys, table, kv_head, n0, BLOCK_N, HEAD_SIZE, PAGE, X, HEAD_DIM, k_ld)
    if HEAD_DIM < HEAD_SIZE:
        async_copy.async_copy_global_to_shared(k_dst, ptrs, mask=in_head)
    else:
        async_copy.async_copy_global_to_shared(k_dst, ptrs)


@gluon.jit
def load_in_head(ptrs, in_head, PADDED: gl.constexpr):
    """Load a tile of keys; columns past a padded head (``PADDED``) read as zeros."""
    if PADDED:
        return gl.load(ptrs, mask=in_head, other=0.0)
    else:
        return gl.load(ptrs)


@gluon.jit
def split_keys_loaded(split_keys, k_dst, table, kv_head, n0,
                      HEAD_SIZE: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, X: gl.constexpr,
                      WARPS: gl.constexpr, HEAD_DIM: gl.constexpr, CHUNK: gl.constexpr):
    """The same tile as :func:`split_keys_async`, through registers: ordinary 16-byte loads, which the L1 merges
    into one L2 request per 128-byte line (a 16-byte asynchronous copy is an L2 request of its own: on the split
    layout those requests, not the bytes, bound the L2), stored into ``k_dst``. ``CHUNK`` keys at a time (32 or
    64, at most ``BLOCK_N``), the next chunk's loads issued before this chunk's stores. ``WARPS`` is 4 (a
    producer warpgroup); the stores are complete when this returns."""
    keys = split_key_chunk(split_keys, table, kv_head, n0, HEAD_SIZE, PAGE, X, WARPS, HEAD_DIM, CHUNK)
    for c in gl.static_range(1, BLOCK_N // CHUNK):
        following = split_key_chunk(split_keys, table, kv_head, n0 + c * CHUNK, HEAD_SIZE, PAGE, X, WARPS, HEAD_DIM,
                                    CHUNK)
        k_dst.slice((c - 1) * CHUNK, CHUNK).store(keys)
        keys = following
    k_dst.slice(BLOCK_N - CHUNK, CHUNK).store(keys)


@gluon.jit
def split_key_chunk(split_keys, table, kv_head, n0, HEAD_SIZE: gl.constexpr, PAGE: gl.constexpr, X: gl.constexpr,
                    WARPS: gl.constexpr, HEAD_DIM: gl.constexpr, CHUNK: gl.constexpr):
    """``CHUNK`` cached keys from position ``n0`` of the split layout, loaded into the producer warpgroup's
    registers (``WARPS`` = 4) as a ``[CHUNK, HEAD_SIZE]`` tile."""
    k_ld: gl.constexpr = gl.BlockedLayout([1, X], [16, 2], [2, WARPS // 2], [0, 1])
    ptrs, in_head = split_key_pointers(split_keys, table, kv_head, n0, CHUNK, HEAD_SIZE, PAGE, X, HEAD_DIM, k_ld)
    return load_in_head(ptrs, in_head, HEAD_DIM < HEAD_SIZE)


@gluon.jit
def split_tile_keys(split_keys, table, kv_head, n0, HEAD_SIZE: gl.constexpr, PAGE: gl.constexpr,
                    BLOCK_N: gl.constexpr, X: gl.constexpr, WARPS: gl.constexpr, HEAD_DIM: gl.constexpr,
                    CHUNK: gl.constexpr):
    """A whole tile of cached keys in registers, as its one or two chunks of ``CHUNK`` keys (the second repeats
    the first when the tile is one chunk)."""
    first = split_key_chunk(split_keys, table, kv_head, n0, HEAD_SIZE, PAGE, X, WARPS, HEAD_DIM, CHUNK)
    second = first
    if BLOCK_N > CHUNK:
        second = split_key_chunk(split_keys, table, kv_head, n0 + CHUNK, HEAD_SIZE, PAGE, X, WARPS, HEAD_DIM,
                                 CHUNK)
    return first, second


@gluon.jit
def split_values_async(split_values, vt_dst, table, kv_head, n0,
                       HEAD_SIZE: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, WARPS: gl.constexpr,
                       HEAD_DIM: gl.constexpr):
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
    LANES_N: gl.constexpr = BLOCK_N // VEC
    v_ld: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // LANES_N, LANES_N], [WARPS, 1], [1, 0])
    offs_d = gl.arange(0, HEAD_SIZE, gl.SliceLayout(1, v_ld))
    offs_n = gl.arange(0, BLOCK_N, gl.SliceLayout(0, v_ld))
    pos = n0 + offs_n
    pages = page_blocks(table, pos, PAGE).to(gl.int64)
    rows = pages * rows_per_block + kv_head.to(gl.int64) * HEAD_DIM
    slots = gl.max_contiguous(gl.multiple_of(pos % PAGE, VEC), VEC)  # n0 is a multiple of BLOCK_N
    offs = (gl.expand_dims(rows, 0) + gl.expand_dims(offs_d, 1)) * aligned(stride_row, VEC) + gl.expand_dims(slots, 0)
    if HEAD_DIM < HEAD_SIZE:
        in_head = gl.expand_dims(offs_d < HEAD_DIM, 1) & gl.expand_dims(offs_n >= 0, 0)
        async_copy.async_copy_global_to_shared(vt_dst, V_cache + offs, mask=in_head)
    else:
        async_copy.async_copy_global_to_shared(vt_dst, V_cache + offs)


@gluon.jit
def copy_rows(desc, row, kv_head, col, barrier, tile, start, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
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
def cached_boxes(k_cache, v_cache, table, kv_head, col, n0, barrier, k_dst, v_dst, TILE_BYTES: gl.constexpr,
                 PAGE: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_SIZE: gl.constexpr, PADDED: gl.constexpr,
                 KEYS: gl.constexpr = True, VALUES: gl.constexpr = True):
    """One NHD tile of cached keys and values by TMA into ``k_dst``/``v_dst``, one box per page (or per tile
    when a page holds several), counted in bytes by ``barrier`` (``TILE_BYTES`` for what it copies); the keys
    alone (``VALUES`` off) or the values alone (``KEYS`` off) where they go to different rings."""
    BOX: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
    mbarrier.expect(barrier, TILE_BYTES)
    for b in gl.static_range(BLOCK_N // BOX):
        pos = n0 + b * BOX
        row = page_blocks(table, pos, PAGE) * PAGE + pos % PAGE
        if KEYS:
            copy_rows(k_cache, row, kv_head, col, barrier, k_dst, b * BOX, BOX, BLOCK_N, HEAD_SIZE, PADDED)
        if VALUES:
            copy_rows(v_cache, row, kv_head, col, barrier, v_dst, b * BOX, BOX, BLOCK_N, HEAD_SIZE, PADDED)


@gluon.jit
def split_value_boxes(v_cache_t, table, kv_head, col, n0, v_rows_per_block, barrier, vt_dst,
                      HEAD_SIZE: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                      PAGE_BLOCKS: gl.constexpr = False):
    """One split-layout tile of cached values into ``vt_dst`` as V^T (``[D, BLOCK_N]``), one TMA box per page,
    counted in bytes by ``barrier``. ``PAGE_BLOCKS`` (``FP8_BOXES``): ``vt_dst`` holds the pages' ``[D, box]``
    blocks one after another (``[BLOCK_N / box x D, box]``, :func:`widen`'s ``BLOCK_WIDTH``), so that every box
    lands on a whole block; a column slice of an unswizzled ``[D, BLOCK_N]`` tile is not contiguous, and a TMA
    destination must be (and 128-byte aligned)."""
    BOX: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
    for b in gl.static_range(BLOCK_N // BOX):
        pos = n0 + b * BOX
        # A page's values of one head are one [D, PAGE] block: V^T, one box per page.
        if HEAD_DIM < HEAD_SIZE:
            # The rank-3 view [blocks x heads, HEAD_DIM, PAGE]: a box of HEAD_SIZE rows reads the rows past the
            # head as zeros (outside the view, never another head's values).
            page_row = page_blocks(table, pos, PAGE) * (v_rows_per_block // HEAD_DIM) + kv_head
            vt3 = vt_dst.reshape([1, HEAD_SIZE, BLOCK_N]).slice(b * BOX, BOX, dim=2)
            tma.async_copy_global_to_shared(v_cache_t, [page_row, 0, pos % PAGE], barrier, vt3)
        else:
            row = page_blocks(table, pos, PAGE) * v_rows_per_block + col
            if PAGE_BLOCKS:
                page_dst = vt_dst.slice(b * HEAD_SIZE, HEAD_SIZE)
            else:
                page_dst = vt_dst.slice(b * BOX, BOX, dim=1)
            tma.async_copy_global_to_shared(v_cache_t, [row, pos % PAGE], barrier, page_dst)


@gluon.jit
def split_boxed_tile(k_desc, split_keys, v_cache_t, table, kv_head, col, n0, v_rows_per_block, barrier, k_dst, vt_dst,
                     HEAD_SIZE: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, X: gl.constexpr):
    """One split-layout tile of cached keys and values by TMA alone (``FP8_BOXES``), counted in bytes by
    ``barrier``: a page's keys of one head are ``D / X`` contiguous ``[PAGE, X]`` blocks, together one box
    ``[D / X, box, X]`` into ``k_dst``'s block of that page (``[BLOCK_N / box x D / X x box, X]``: the pages one
    after another), and its values one V^T box into ``vt_dst``'s block of that page (:func:`split_value_boxes`).
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
        first = page_blocks(table, pos, PAGE) * (stride_kb // (PAGE * X)) + kv_head * (stride_kh // (PAGE * X))
        page_dst = k_dst.slice(b * COLUMNS * BOX, COLUMNS * BOX)._reinterpret(k_dst.dtype, [COLUMNS, BOX, X],
                                                                              k_desc.layout)
        tma.async_copy_global_to_shared(k_desc, [first, pos % PAGE, 0], barrier, page_dst)
    split_value_boxes(v_cache_t, table, kv_head, col, n0, v_rows_per_block, barrier, vt_dst, HEAD_SIZE, PAGE,
                      BLOCK_N, HEAD_SIZE, True)


@gluon.jit
def widen(src, dst, COLS: gl.constexpr, NUM_WARPS: gl.constexpr, VIA_F32: gl.constexpr,
          BLOCK_WIDTH: gl.constexpr = 0, ROW_BLOCKS: gl.constexpr = 1, TRANSPOSED: gl.constexpr = False):
    """Copy an FP8 key or value tile ``src`` (``COLS`` columns: the head size, or the keys of a V^T tile) into
    ``dst`` in the MMA's 16-bit type, exactly (every FP8 value is a bfloat16 and a float16 value; the cache's
    scales are folded into the logits and the output instead), or in FP8 as it is, laid out for an FP8 MMA
    (the split layout's keys under ``FP8_SCORES``). Each thread moves 16 bytes of FP8 at a time.

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

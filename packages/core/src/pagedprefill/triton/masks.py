"""Which keys a query tile sees, in one place for every kernel: the key tiles it visits, its share of them under
split keys, which of those tiles need an element mask, and the element mask itself.

Positions: a sequence of ``ctx_len`` cached tokens and ``q_len`` new ones has keys at positions
``[0, ctx_len + q_len)``, its new token ``t`` being both the query at position ``ctx_len + t`` and the key there.
Query ``p`` sees key ``k`` when the key exists, ``k <= p`` (causal; without it every key), and
``p - k < window`` (with a window; a key after ``p`` is inside it). A query tile is the sequence's tokens
``tok0 .. tok_last`` (``0 <= tok0 <= tok_last < q_len``); its rows are those tokens.

The walk: the cached keys (through the block table; with the new tokens' K/V in the cache, those too) then,
when their K/V are read from k/v, the new tokens, indexed from 0 among them. Each part is a half-open range
``[start, end)`` walked ``BLOCK_N`` keys at a time from ``start``: the cached part from the tile of
``BLOCK_N``-aligned positions holding the window's lowest key, the new part from the tile of aligned indices
holding it, so tiles line up with the cache's pages. Every key any row of the tile sees lies in a visited tile,
and keys in a visited tile past the range, or that no row sees, are masked.

The rule for masks, in two forms: :func:`split_range` (the mask-free middle of a range, for kernels that run it
as a loop of its own) and :func:`walk_tile` (per tile, for a kernel with one loop over its tiles). Both
judge a tile mask-free only when every row of the tile sees every key in it, so skipping :func:`visible` there
changes nothing; both may judge a tile masked when every pair is visible after all (a mask then costs time,
never a result).

The kernels turn the ranges into tiles themselves (the first cached tile ``(lo // BLOCK_N) * BLOCK_N``, tile
counts): one more inlined function there changes their compiled code even where its PTX instructions are the
same, as ``ptxas`` schedules around the line-information labels each inlined call adds.
"""

import triton
import triton.language as tl


@triton.jit
def cached_length(ctx_len, q_len, NEW_KV_IN_CACHE: tl.constexpr):
    """How many key positions the cache holds for a sequence: its context, and its new tokens too when their
    K/V were written to the cache before the call (``NEW_KV_IN_CACHE``)."""
    if NEW_KV_IN_CACHE:
        return ctx_len + q_len
    else:
        return ctx_len


@triton.jit
def visible_keys(ctx_len, q_len, tok0, tok_last, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                 NEW_KV_IN_CACHE: tl.constexpr):
    """The key positions a query tile of tokens ``tok0 .. tok_last`` (within its sequence) can see:
    ``(lo, full_from, cache_end, cache_full_to, kv_len)``.

    ``lo`` is the lowest key any row sees (0, or the window's start for the first row: keys below it are never
    visited) and ``full_from`` the lowest one every row sees without a window mask (the window's start for the
    last row). The cached walk covers ``[lo, cache_end)`` and holds every cached key any row sees (none when
    ``cache_end <= lo``); every row sees all of ``[full_from, cache_full_to)`` in it. ``kv_len`` is how many
    positions the cache holds for the sequence (:func:`cached_length`). With the new tokens' K/V already in the
    cache (``NEW_KV_IN_CACHE``) the cached walk covers them too, up to the last row's causal diagonal;
    otherwise it ends at the context and the new tokens are a walk of their own (:func:`new_token_keys`). The
    cached walk runs from the ``BLOCK_N``-aligned tile holding ``lo``: when ``lo`` is at or past ``cache_end`` but
    in the same tile (a window that starts after the context, within the context's last tile), that tile is
    visited and no row sees any of its keys.
    """
    pos_first = ctx_len + tok0
    pos_last = ctx_len + tok_last
    lo = 0
    full_from = 0
    if WINDOW:
        lo = tl.maximum(pos_first - window + 1, 0)
        full_from = tl.maximum(pos_last - window + 1, 0)
    kv_len = cached_length(ctx_len, q_len, NEW_KV_IN_CACHE)
    if NEW_KV_IN_CACHE:
        if CAUSAL:
            cache_end = pos_last + 1
            cache_full_to = pos_first + 1
        else:
            cache_end = kv_len
            cache_full_to = kv_len
    else:
        cache_end = ctx_len
        cache_full_to = ctx_len
    return lo, full_from, cache_end, cache_full_to, kv_len


@triton.jit
def new_token_keys(lo, ctx_len, q_len, tok0, tok_last, seq_row0, num_tokens, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, NEW_KV_IN_CACHE: tl.constexpr, IN_TENSORS: tl.constexpr = True):
    """The new tokens' keys a tile visits, indexed from 0 within the sequence: ``(start, end, full_to,
    in_bounds_len)``, a tile loop ``[start, end)`` from the ``BLOCK_N``-aligned tile holding key ``lo``
    (:func:`visible_keys`; index 0 when ``lo`` is in the context) up to the tile's last token ``tok_last``
    (causal) or to the last new token; none when their K/V are read from the cache. Every row sees the keys of
    ``[0, full_to)`` but for the window: they need no causal mask.

    Whatever the metadata says, the keys read lie inside k/v: the rows from the sequence's first one to the
    tensors' end (none for a negative start), and the sequence's own count at most (``in_bounds_len``). Every
    loop over them starts at 0 or later and ends there, so each key index is in ``[0, in_bounds_len + BLOCK_N)``
    (no int32 overflow: q would not fit in memory first) and one compare per key masks the rest. Without
    ``IN_TENSORS`` the end is the metadata's, not cut to the tensors: for a kernel whose loads of new tokens are
    bounded by the hardware (the Hopper kernel's TMA boxes).
    """
    start = (tl.maximum(lo - ctx_len, 0) // BLOCK_N) * BLOCK_N
    in_tensors = tl.where(seq_row0 >= 0, num_tokens - seq_row0, 0)
    in_bounds_len = tl.maximum(tl.minimum(q_len, in_tensors), 0)
    if NEW_KV_IN_CACHE:
        end = start
        full_to = start
    elif CAUSAL:
        if IN_TENSORS:
            end = tl.minimum(tl.maximum(tok_last + 1, 0), in_bounds_len)
        else:
            end = tok_last + 1
        full_to = tl.minimum(tok0 + 1, in_tensors)
    else:
        if IN_TENSORS:
            end = in_bounds_len
        else:
            end = q_len
        full_to = tl.minimum(q_len, in_tensors)
    return start, end, full_to, in_bounds_len


@triton.jit
def split_tiles(cache_tiles, new_tiles, split, KEY_SPLITS: tl.constexpr):
    """The key tiles that split ``split`` of ``KEY_SPLITS`` visits, of a walk of ``cache_tiles`` cached tiles
    followed by ``new_tiles`` tiles of new tokens (both >= 0): the same number (rounded up) for each split, in
    walk order, so that the last splits of a short walk get none. Returns ``(cache_first, cache_count,
    new_first, new_count)``: the first tile and how many, in each of the two parts. The splits' shares are
    disjoint and together the whole walk."""
    total = cache_tiles + new_tiles
    per = tl.cdiv(total, KEY_SPLITS)
    first = tl.minimum(split * per, total)
    last = tl.minimum(first + per, total)
    cache_first = tl.minimum(first, cache_tiles)
    cache_count = tl.minimum(last, cache_tiles) - cache_first
    new_first = tl.maximum(first - cache_tiles, 0)
    new_count = tl.maximum(last - cache_tiles, 0) - new_first
    return cache_first, cache_count, new_first, new_count


@triton.jit
def split_range(start, end, full_lo, full_hi, BLOCK_N: tl.constexpr):
    """Split the tile loop ``[start, end)`` (``start >= 0``, aligned to ``BLOCK_N``) around its mask-free middle.

    ``full_lo``/``full_hi`` bound the keys every row sees without masking (``[full_from, cache_full_to)`` of
    :func:`visible_keys` for the cached walk; ``full_from - ctx_len`` and ``full_to`` of :func:`new_token_keys`
    for the new tokens); they are rounded inwards to tile boundaries. Returns ``(free_start, free_end)``: tiles in
    ``[start, free_start)`` and ``[free_end, end)`` need masks, ``[free_start, free_end)`` do not: every key of
    those tiles lies in ``[full_lo, full_hi)``, which every row sees. Both lie in ``[start, max(start, end)]`` whatever the bounds
    are: every difference below is taken between values already clamped into that range, so corrupt lengths near
    2**31 cannot wrap a bound negative and start a loop at a negative key.
    """
    end = tl.maximum(end, start)
    top = tl.minimum(tl.maximum(full_hi, start), end)
    hi = start + ((top - start) // BLOCK_N) * BLOCK_N
    lo = start + tl.cdiv(tl.minimum(tl.maximum(full_lo, start) - start, hi - start), BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit
def walk_tile(it, cache_start, cache_tiles, new_start, ctx_len, q_len, kv_len, pos_first, full_from,
              BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, NEW_KV_IN_CACHE: tl.constexpr):
    """Tile ``it`` of a walk counted in tiles (``cache_tiles`` cached ones from position ``cache_start``, then
    tiles of new tokens from index ``new_start`` among them), for a kernel that walks both in one loop:
    ``(n0, key_end, needs_mask)``. Its keys are at positions ``[n0, n0 + BLOCK_N)``, those from ``key_end`` on
    do not exist (``kv_len``, :func:`cached_length`, for a cached tile; the sequence's end for a new one).

    ``needs_mask`` says the tile needs :func:`visible`: it reaches past ``key_end``, crosses the causal diagonal
    of the tile's first query, at position ``pos_first`` (a key after it: only among the new tokens, or in a
    cached walk that holds them), or starts below ``full_from``, the lowest key every row sees
    (:func:`visible_keys`). A tile judged mask-free has every key below ``key_end``, inside every row's window
    and, under a causal mask, at or before every row's position: every row sees all of it. The rule is
    :func:`split_range`'s, per tile.
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
    return n0, key_end, needs_mask


@triton.jit
def visible(q_pos, k_pos, k_valid, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """``[M, N]`` mask of the keys each row may see: the key is valid (``k_valid``), the row exists (``q_pos >= 0``;
    -1 marks a row that does not), the key is at or before the row (``CAUSAL``: bottom-right, positions counted
    over context and new tokens alike) and inside the window (``WINDOW``: ``q_pos - k_pos < window``)."""
    mask = k_valid[None, :] & (q_pos[:, None] >= 0)
    if CAUSAL:
        mask = mask & (k_pos[None, :] <= q_pos[:, None])
    if WINDOW:
        mask = mask & (q_pos[:, None] - k_pos[None, :] < window)
    return mask

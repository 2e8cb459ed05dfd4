"""Triton building blocks of prefix-prefill attention, shared by every backend.

Each function is one job: locate the program's work, address either cache layout, load a K/V tile from the
paged cache or from the new tokens, turn raw scores into log2-domain logits, take one online-softmax step,
finish a row (sinks, normalisation, FP8 value scale), and hand a split's rows to the combine. Which keys a tile
visits and which it masks are :mod:`.masks`'.

Conventions: logits are kept in the log2 domain (``exp2`` with ``log2(e)`` folded into the scale); rows are
(token, query head) pairs; every address is formed in 64-bit and clamped or masked by the tensor extents,
so inconsistent metadata can never read or write out of bounds.
"""

import triton
import triton.language as tl

from .arguments import KeyStrides, ValueStrides

LOG2E = tl.constexpr(1.4426950408889634)
#: Largest finite FP8 e4m3 value: a quantised output saturates there.
FP8_E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def scalar_or_load(value, ptr, FROM_PTR: tl.constexpr):
    """A float argument, or the float behind a device pointer (scales given as tensors: no host sync)."""
    if FROM_PTR:
        return tl.load(ptr).to(tl.float32)
    else:
        return value


@triton.jit
def widen_query(q, QUERY_WIDENED_TO: tl.constexpr):
    """A query tile in the 16-bit type the call computes in: an FP8 tile widened exactly (every e4m3 value is a
    float16 and a bfloat16 one; its descale is folded into the logits' scale), another as it is."""
    if QUERY_WIDENED_TO == "float16":
        return q.to(tl.float16)
    elif QUERY_WIDENED_TO == "bfloat16":
        return q.to(tl.bfloat16)
    else:
        return q


@triton.jit
def program_tile(program, num_programs, HEAVY_FIRST: tl.constexpr):
    """The query tile (the flat index :func:`tile_sequence` reads) that program ``program`` of the launch's
    ``num_programs`` along its first axis takes.

    Programs start in index order. In index order each takes the tile of its own index; under ``HEAVY_FIRST``
    the order is reversed, so each sequence's last tiles (the most keys under a causal mask) go first and the
    lightest ones fill the end of the launch. Either way every tile is taken by exactly one program.
    :func:`pagedprefill.tiling.launch_order` is the host's account of the same order.
    """
    tile = program
    if HEAVY_FIRST:
        tile = num_programs - 1 - program
    return tile


@triton.jit
def locate_tile(tile, query_start_ptr, num_seqs, TOKENS_PER_TILE: tl.constexpr):
    """Map a flat tile index to (sequence, first token of the tile within the sequence).

    Sequence ``s`` owns tiles ``[start[s] // TPT + s, start[s + 1] // TPT + s + 1)``, always at least
    ``ceil(q_len / TPT)`` of them, so a grid of ``num_tokens // TPT + num_seqs`` tiles covers any batch
    without reading lengths on the host. Binary search over ``start``.
    """
    lo = num_seqs * 0
    hi = num_seqs + 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = tl.load(query_start_ptr + mid) // TOKENS_PER_TILE + mid
        lo = tl.where(first <= tile, mid, lo)
        hi = tl.where(first <= tile, hi, mid)
    first = tl.load(query_start_ptr + lo) // TOKENS_PER_TILE + lo
    return lo, (tile - first) * TOKENS_PER_TILE


@triton.jit
def tile_sequence(tile, query_start_ptr, seq_lens_ptr, ctx_lens_ptr, num_seqs, TOKENS_PER_TILE: tl.constexpr,
                  SKIP_DECODE: tl.constexpr, CONTEXT_FROM_STARTS: tl.constexpr):
    """The sequence of a tile and its lengths: ``(seq, tok0, seq_row0, ctx_len, q_len, done)``.

    ``tok0`` is the tile's first token within the sequence, ``seq_row0`` the sequence's first row in q/o;
    ``done`` says the tile has nothing to compute (past its sequence's tokens, or a single-token decode
    sequence when ``SKIP_DECODE``: those rows belong to a decode kernel and are left untouched).
    With ``CONTEXT_FROM_STARTS`` the new tokens are the difference of consecutive starts (``num_seqs + 1`` of
    them) and the context is the rest of the sequence; ``ctx_lens_ptr`` is not read.
    """
    seq, tok0 = locate_tile(tile, query_start_ptr, num_seqs, TOKENS_PER_TILE)
    seq_row0 = tl.load(query_start_ptr + seq)
    if CONTEXT_FROM_STARTS:
        q_len = tl.load(query_start_ptr + seq + 1) - seq_row0
        ctx_len = tl.load(seq_lens_ptr + seq) - q_len
    else:
        ctx_len = tl.load(ctx_lens_ptr + seq)
        q_len = tl.load(seq_lens_ptr + seq) - ctx_len
    done = tok0 >= q_len
    if SKIP_DECODE:
        done = done | (q_len == 1)
    return seq, tok0, seq_row0, ctx_len, q_len, done


@triton.jit
def tile_rows(offs_m, tok0, kv_head, chunk, group_size, seq_row0, ctx_len, q_len, num_tokens,
              HEADS_PER_TILE: tl.constexpr, TOKENS_PER_TILE: tl.constexpr):
    """What each row ``offs_m`` of a tile is: ``(head, q_rows, row_ok, q_pos)``.

    Row ``m`` is token ``tok0 + m // HEADS_PER_TILE`` of the sequence and query head ``m % HEADS_PER_TILE`` of
    this program's chunk of the KV group; ``q_rows`` is its row in q/o, ``row_ok`` whether it exists (rows past
    the packed heads, the sequence's tokens, the group or q itself do not), ``q_pos`` its key position (-1 when
    it does not exist).
    """
    tok = tok0 + offs_m // HEADS_PER_TILE
    head_in_group = chunk * HEADS_PER_TILE + offs_m % HEADS_PER_TILE
    head = kv_head * group_size + head_in_group
    q_rows = seq_row0 + tok
    # Rows past TOKENS_PER_TILE * HEADS_PER_TILE (when the packed heads do not divide BLOCK_M) belong to no token.
    row_ok = (offs_m < TOKENS_PER_TILE * HEADS_PER_TILE) & (tok < q_len) & (head_in_group < group_size)
    row_ok = row_ok & (q_rows >= 0) & (q_rows < num_tokens)
    q_pos = tl.where(row_ok, ctx_len + tok, -1)
    return head, q_rows, row_ok, q_pos




@triton.jit
def aligned(stride, ALIGN: tl.constexpr):
    """``stride``, known by the launcher to be a multiple of ``ALIGN`` elements, said so to the compiler.

    Triton only knows a run-time stride's alignment when it is a multiple of 16; the split layout's slot
    stride is ``x`` (8 for 16-bit data), so without this its key loads fall back to scalar loads that the
    pipeliner cannot turn into asynchronous copies.
    """
    if ALIGN > 1:
        stride = (stride // ALIGN) * ALIGN
    return stride


@triton.jit
def aligned_cache_strides(strides, LAYOUT: tl.constexpr):
    """``(KeyStrides, ValueStrides)`` of ``strides`` (:class:`~pagedprefill.triton.arguments.CacheStrides`)
    with every non-unit stride :func:`aligned` to ``LAYOUT.KEY_ALIGN`` / ``LAYOUT.VALUE_ALIGN``, as the launcher
    guarantees (the unit strides, keys' ``dim`` and values' ``slot`` (split) or ``dim`` (NHD), stay as they are).
    """
    k, v = strides.key, strides.value
    KA: tl.constexpr = LAYOUT.KEY_ALIGN
    VA: tl.constexpr = LAYOUT.VALUE_ALIGN
    keys = KeyStrides(aligned(k.block, KA), aligned(k.head, KA), aligned(k.chunk, KA), aligned(k.slot, KA), k.dim)
    if LAYOUT.SPLIT:
        values = ValueStrides(aligned(v.block, VA), aligned(v.head, VA), aligned(v.dim, VA), v.slot)
    else:
        values = ValueStrides(aligned(v.block, VA), aligned(v.head, VA), v.dim, aligned(v.slot, VA))
    return keys, values


@triton.jit
def tile_pages(paged, n0, BLOCK_N: tl.constexpr, LAYOUT: tl.constexpr):
    """Physical cache block of each key ``n0 + [0, BLOCK_N)``, as an int64 ``[BLOCK_N]`` vector.

    ``paged`` is the kernel's view of the cache (its table row, width, block count and page size).
    ``LAYOUT.PAGEWISE`` (the block size, ``LAYOUT.PAGE_SIZE``, divides ``BLOCK_N`` or is a multiple of it)
    reads one table entry per page and broadcasts it to the page's keys; otherwise one entry is read per key,
    which serves any block size. Out-of-range table columns and block numbers are clamped to the nearest valid
    one: the keys they address are masked by the caller or belong to invalid metadata, and are never read out
    of bounds. Pages are read one tile ahead, also past the last tile, so a table without columns is not read
    at all. Block numbers are clamped with a minimum and a maximum in the table's own type (int32 for vLLM's)
    and widened after: in every key tile that costs a few instructions, where a range check and a select
    cost about 25 (sm90 SASS, head size 64).
    """
    table_width, last_block = paged.table_width, tl.maximum(paged.num_blocks - 1, 0)
    has_cols = table_width > 0
    if not LAYOUT.PAGEWISE:
        pos = n0 + tl.arange(0, BLOCK_N)
        cols = tl.maximum(tl.minimum(pos // paged.page_size, table_width - 1), 0)
        pages = tl.load(paged.table_row + cols * paged.table_col_stride, mask=has_cols, other=0)
        pages = tl.minimum(tl.maximum(pages, 0), last_block).to(tl.int64)
    elif LAYOUT.PAGE_SIZE >= BLOCK_N:
        PAGE_SIZE: tl.constexpr = LAYOUT.PAGE_SIZE
        col = tl.maximum(tl.minimum(n0 // PAGE_SIZE, table_width - 1), 0)
        page = tl.load(paged.table_row + col * paged.table_col_stride, mask=has_cols, other=0)
        page = tl.minimum(tl.maximum(page, 0), last_block).to(tl.int64)
        pages = tl.full([BLOCK_N], 0, tl.int64) + page
    else:
        PAGE_SIZE: tl.constexpr = LAYOUT.PAGE_SIZE
        PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE
        cols = tl.maximum(tl.minimum(n0 // PAGE_SIZE + tl.arange(0, PAGES), table_width - 1), 0)
        per_page = tl.load(paged.table_row + cols * paged.table_col_stride, mask=has_cols, other=0)
        per_page = tl.minimum(tl.maximum(per_page, 0), last_block).to(tl.int64)
        pages = tl.reshape(tl.broadcast_to(per_page[:, None], [PAGES, PAGE_SIZE]), [BLOCK_N])
        # The reshape hides that each page's keys share one block; the split layout's value loads need to
        # know it to stay vectorised along the slots.
        pages = tl.max_constancy(pages, PAGE_SIZE)
    return pages


@triton.jit
def cache_kv_offsets(pages, pos, paged, kv_head, offs_d, LAYOUT: tl.constexpr):
    """64-bit element offsets of cached keys (``[D, N]``, transposed for the dot) and values (``[N, D]``).

    ``pages`` holds each key's physical block (:func:`tile_pages`), ``paged`` the page size and the
    (:func:`aligned_cache_strides`) strides. Split-layout keys are ``block, head, d // x, slot, d % x``, NHD
    keys ``block, slot, head, d``; values are addressed by their strides alone in both layouts.
    """
    ks, vs = paged.key_strides, paged.value_strides
    slot = (pos % paged.page_size).to(tl.int64)
    head = kv_head.to(tl.int64)
    d = offs_d.to(tl.int64)
    if LAYOUT.SPLIT:
        CHUNK: tl.constexpr = LAYOUT.CHUNK
        k_off = (pages[None, :] * ks.block + head * ks.head + (d[:, None] // CHUNK) * ks.chunk
                 + slot[None, :] * ks.slot + (d[:, None] % CHUNK) * ks.dim)
    else:
        k_off = pages[None, :] * ks.block + head * ks.head + slot[None, :] * ks.slot + d[:, None] * ks.dim
    v_off = pages[:, None] * vs.block + head * vs.head + d[None, :] * vs.dim + slot[:, None] * vs.slot
    return k_off, v_off


@triton.jit
def new_kv_offsets(rows, kv_head, offs_d, k_strides, v_strides):
    """64-bit offsets of the new tokens' keys (``[D, N]``) and values (``[N, D]``) at packed ``rows``
    (:class:`~pagedprefill.triton.arguments.RowStrides` of k and v)."""
    r = rows.to(tl.int64)
    head = kv_head.to(tl.int64)
    d = offs_d.to(tl.int64)
    k_off = r[None, :] * k_strides.token + head * k_strides.head + d[:, None]
    v_off = r[:, None] * v_strides.token + head * v_strides.head + d[None, :]
    return k_off, v_off


@triton.jit
def load_keys(ptrs, k_valid, d_mask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """A ``[D, N]`` key tile; masked on keys only in edge tiles and on the head dim only when it is padded."""
    if MASKED:
        if EVEN_D:
            return tl.load(ptrs, mask=k_valid[None, :], other=0.0)
        return tl.load(ptrs, mask=d_mask[:, None] & k_valid[None, :], other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=d_mask[:, None], other=0.0)


@triton.jit
def load_values(ptrs, k_valid, d_mask, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
                ZERO_AFTER_LOAD: tl.constexpr = False):
    """An ``[N, D]`` value tile, masked like :func:`load_keys`.

    ``ZERO_AFTER_LOAD`` (for tiles whose every address is known to be inside the tensor) loads the whole
    tile and zeroes the invalid keys afterwards: a key mask varies along the slots, which in the split layout
    is the contiguous direction, and would turn the copy into element-wise loads that are not pipelined.
    """
    if MASKED:
        if EVEN_D:
            if ZERO_AFTER_LOAD:
                return tl.where(k_valid[:, None], tl.load(ptrs), 0.0)
            return tl.load(ptrs, mask=k_valid[:, None], other=0.0)
        return tl.load(ptrs, mask=k_valid[:, None] & d_mask[None, :], other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=d_mask[None, :], other=0.0)


@triton.jit
def soft_cap(s, cap):
    """``cap * tanh(s / cap)``, written with ``exp2`` so it runs on every Triton target."""
    e = tl.exp2(s * (2.0 * LOG2E / cap))
    return cap - 2.0 * cap / (e + 1.0)


@triton.jit
def scale_logits(s, k_pos, q_pos, alibi_slope_log2, qk_scale, softcap, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                 SCALE_IN_EXP: tl.constexpr = False):
    """Raw scores ``s`` (``[M, N]``, keys at positions ``k_pos``, rows at ``q_pos``) as log2-domain logits: scale,
    softcap and ALiBi applied.

    ``qk_scale`` is ``sm_scale * k_scale * log2(e)`` without softcap, ``sm_scale * k_scale`` with it;
    ``alibi_slope_log2`` is each row's slope times ``log2(e)``. ``SCALE_IN_EXP`` (no softcap, no ALiBi: both need
    the scaled scores) leaves the scale to :func:`softmax_step`, which folds it into each key's exponent.
    """
    if SOFTCAP:
        s = soft_cap(s * qk_scale, softcap) * LOG2E
    elif not SCALE_IN_EXP:
        s = s * qk_scale
    if ALIBI:
        s += alibi_slope_log2[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
    return s


@triton.jit
def logits(query, k, k_pos, scoring, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Scores of the query tile (``query.q``, ``[M, D]``) with keys ``k`` (``[D, N]``, at positions ``k_pos``)
    as log2-domain logits (:func:`scale_logits`)."""
    s = tl.dot(query.q, k, input_precision=DOT_PRECISION)
    return scale_logits(s, k_pos, query.pos, query.alibi_slope_log2, scoring.qk_scale, scoring.softcap, SOFTCAP,
                        ALIBI)



@triton.jit
def softmax_step(s, m_i, l_i, qk_scale, SCALE_IN_EXP: tl.constexpr = False, MAX_GROWTH: tl.constexpr = 0.0):
    """One online-softmax step on a tile of log2 logits ``s`` (:func:`scale_logits`): ``(p, alpha, m, l)``, the
    unnormalised probabilities, the factor the accumulator is rescaled by, and the running max and sum.

    ``SCALE_IN_EXP``: ``s`` holds raw scores and ``qk_scale`` (positive) is applied here: each row's maximum is
    taken on the raw scores and scaled once (the same maximum), and each key's scale and subtraction of the
    maximum are one fused multiply-add. Rows whose logits so far are all ``-inf`` keep ``m = -inf`` and
    contribute nothing (no NaN; a masked key's ``-inf * scale - m`` stays ``-inf``).

    ``MAX_GROWTH`` > 0: a row's running max moves only when the tile's maximum exceeds it by more than that many
    log2 units, so that ``alpha`` is exactly 1 on most tiles and a caller can skip the rescale; the
    probabilities then reach at most ``2 ** MAX_GROWTH``, which the 16-bit ``P`` and the float32 sums hold
    exactly as well as 1 (the result is the same up to rounding: ``m`` is only the reference of both).
    """
    row_max = tl.max(s, 1)
    if SCALE_IN_EXP:
        row_max = row_max * qk_scale
    m_new = tl.maximum(m_i, row_max)
    if MAX_GROWTH > 0:
        m_new = tl.where(m_new > m_i + MAX_GROWTH, m_new, m_i)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    if SCALE_IN_EXP:
        p = tl.exp2(s * qk_scale - m_use[:, None])
    else:
        p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def online_softmax_step(s, v, state, DOT_PRECISION: tl.constexpr):
    """Fold one tile of log2 logits ``s`` and values ``v`` into the running ``state`` ``(acc, max, sum)``;
    unnormalised (:func:`softmax_step`)."""
    acc, m_i, l_i = state
    p, alpha, m_new, l_i = softmax_step(s, m_i, l_i, 1.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def finish_rows(acc, m_i, l_i, sink_log2, out_scale, SINKS: tl.constexpr):
    """Normalise the accumulator; add the sink's mass (``sink_log2``: each row's sink logit times
    ``log2(e)``) to the denominator; apply the FP8 value scale.

    A row with nothing visible (and no sink mass) is written as zeros.
    """
    if SINKS:
        m_fin = tl.maximum(m_i, sink_log2)
        rescale = tl.exp2(m_i - m_fin)
        l_i = l_i * rescale + tl.exp2(sink_log2 - m_fin)
        acc = acc * rescale[:, None]
    inv = tl.where(l_i > 0.0, out_scale / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
    return acc * inv[:, None]


@triton.jit
def round_to_fp8_e4m3(x, FP8_MAX: tl.constexpr):
    """``x`` saturated to ``FP8_MAX`` and rounded to the nearest FP8 e4m3 value (ties to even), in float32.

    The store's conversion then only has exactly representable values to convert, so every target gives
    the same bits as torch's own conversion (the CPU interpreter's FP8 rounding is not exact on its own).
    The step between e4m3 values is ``2 ** (exponent - 3)``, and ``2 ** -9`` below the smallest normal.
    """
    a = tl.minimum(tl.abs(x), FP8_MAX)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    # Adding and removing 1.5 * 2**23 rounds a float32 below 2**22 to an integer, ties to even.
    rounded = ((a / step + 12582912.0) - 12582912.0) * step
    return tl.where(x < 0, -rounded, rounded)




@triton.jit
def partial_rows(acc, m_i, l_i):
    """One split's rows for :class:`~.arguments.Partials`: the accumulator normalised by the split's own sum,
    and the split's log2-domain log-sum-exp (``-inf`` where it saw no key; its row is then zeros)."""
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    return acc * tl.where(seen, 1.0 / l_safe, 0.0)[:, None], tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))


@triton.jit
def partial_index(split, q_rows, head, num_tokens, num_heads):
    """Where row ``(split, q_rows, head)`` is in :class:`~.arguments.Partials`: the ``lse`` element (times the
    padded head size: the first element of its ``out`` row), in 64 bits."""
    rows = q_rows.to(tl.int64)
    return ((rows * 0 + split) * num_tokens + rows) * num_heads + head.to(tl.int64)  # split: a number or a scalar

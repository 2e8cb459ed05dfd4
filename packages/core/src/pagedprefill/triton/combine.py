"""The second launch of a call with split keys: merge each row's partial rows into its output.

A launch whose tile sets ``KEY_SPLITS`` > 1 runs every query tile as that many programs, each attending to one
run of the tile's key tiles (:func:`~.masks.split_tiles`) and writing, per row, its output normalised by its
own softmax sum and its log2-domain log-sum-exp (:class:`~.arguments.Partials`). This kernel weighs the
partial rows by ``2 ** (lse_s - max)``, adds the sinks' mass, applies the FP8 output scale and stores the rows
with the output's strides. Its programs are the first launch's tiles (the same tile schedule, so it writes
exactly the rows an unsplit launch writes, and none that ``skip_decode`` leaves to a decode kernel); both
the kernel that attends (core's or a backend's own) and the output agree on it through :class:`Tile`.
"""

import triton
import triton.language as tl

from .arguments import VARYING_EXTENTS
from .blocks import LOG2E, partial_index, round_to_fp8_e4m3, scalar_or_load, tile_rows, tile_sequence


@triton.jit(do_not_specialize=VARYING_EXTENTS)
def combine_splits_kernel(
    tokens, batch, per_head, scale_tensors, partials,
    out_scale, num_seqs, num_tokens, num_blocks, table_width, block_size, group_size, out_strides,
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr, TILE: tl.constexpr, FEATURES: tl.constexpr,
    OUT_SCALE_FROM_TENSOR: tl.constexpr, OUT_MAX: tl.constexpr,
):
    """Merge the ``TILE.KEY_SPLITS`` partial rows of one tile's rows into ``tokens.out`` (see the module
    docstring). ``out_scale``: the FP8 output scale as a number (``scale_tensors.out`` holds it under
    ``OUT_SCALE_FROM_TENSOR``); ``OUT_MAX``: the FP8 output's largest finite value."""
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    HEADS_PER_TILE: tl.constexpr = TILE.HEADS_PER_TILE
    TOKENS_PER_TILE: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    KEY_SPLITS: tl.constexpr = TILE.KEY_SPLITS
    seq, tok0, seq_row0, ctx_len, q_len, done = tile_sequence(tl.program_id(0), batch.query_start, batch.seq_lens,
                                                              batch.context_lens, num_seqs, TOKENS_PER_TILE,
                                                              FEATURES.SKIP_DECODE, FEATURES.CONTEXT_FROM_STARTS)
    if done:
        return
    kv_head = tl.program_id(1) // TILE.HEAD_CHUNKS
    chunk = tl.program_id(1) % TILE.HEAD_CHUNKS
    offs_m = tl.arange(0, BLOCK_M)
    head, q_rows, row_ok, _ = tile_rows(offs_m, tok0, kv_head, chunk, group_size, seq_row0, ctx_len, q_len,
                                        num_tokens, HEADS_PER_TILE, TOKENS_PER_TILE)
    row_ok = row_ok & (seq_row0 >= 0)
    num_heads = (tl.num_programs(1) // TILE.HEAD_CHUNKS) * group_size

    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for split in range(KEY_SPLITS):
        lse = tl.load(partials.lse + partial_index(split, q_rows, head, num_tokens, num_heads), mask=row_ok,
                      other=float("-inf"))
        top = tl.maximum(top, lse)
    sink_log2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    if FEATURES.SINKS:
        sink_log2 = tl.load(per_head.sinks + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        top = tl.maximum(top, sink_log2)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row without keys or sinks: every weight below is 0

    total = tl.exp2(sink_log2 - top)
    for split in range(KEY_SPLITS):
        lse = tl.load(partials.lse + partial_index(split, q_rows, head, num_tokens, num_heads), mask=row_ok,
                      other=float("-inf"))
        total += tl.exp2(lse - top)
    inv_out_scale = 1.0
    if FEATURES.OUT_SCALE:
        inv_out_scale = 1.0 / scalar_or_load(out_scale, scale_tensors.out, OUT_SCALE_FROM_TENSOR)
    scale = tl.where(total > 0.0, inv_out_scale / tl.where(total > 0.0, total, 1.0), 0.0)
    # The head in chunks of at most 128 columns: a whole wide head's accumulator beside the partial row being read
    # would not fit the registers.
    COLUMNS: tl.constexpr = HEAD_SIZE_PADDED if HEAD_SIZE_PADDED < 128 else 128
    offs_d = tl.arange(0, COLUMNS)
    out_ptr = tokens.out
    o_rows = q_rows.to(tl.int64)[:, None] * out_strides.token + head.to(tl.int64)[:, None] * out_strides.head
    for c in tl.static_range(HEAD_SIZE_PADDED // COLUMNS):
        cols = c * COLUMNS + offs_d
        acc = tl.zeros([BLOCK_M, COLUMNS], tl.float32)
        for split in range(KEY_SPLITS):
            index = partial_index(split, q_rows, head, num_tokens, num_heads)
            weight = tl.exp2(tl.load(partials.lse + index, mask=row_ok, other=float("-inf")) - top)
            part = tl.load(partials.out + index[:, None] * HEAD_SIZE_PADDED + cols[None, :], mask=row_ok[:, None],
                           other=0.0)
            acc += part * weight[:, None]
        out = acc * scale[:, None]
        if FEATURES.OUT_SCALE:
            out = round_to_fp8_e4m3(out, OUT_MAX)  # quantised output saturates
        tl.store(out_ptr + o_rows + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols < HEAD_SIZE)[None, :])

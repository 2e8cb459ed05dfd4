"""The Hopper kernel's epilogue: each consumer normalises its rows (sinks, the FP8 output scale) and stores them
where they belong in ``out``, with the portable kernel's building blocks. With split keys each consumer stores
its partial rows, and the last of a tile's splits to finish merges them (:func:`merge_if_last`), so that a call
with split keys is one launch: no combine kernel waits for the host to launch it.
"""

from pagedprefill.triton.blocks import (
    LOG2E,
    finish_rows,
    partial_index,
    partial_rows,
    round_to_fp8_e4m3,
    scalar_or_load,
)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def store_rows(cfg, acc, m_i, l_i, head, out_rows, row_ok, per_head, scales, output, o_layout: gl.constexpr):
    """Normalise the accumulator ``acc`` (rows ``out_rows`` of heads ``head``, in ``o_layout``; running max
    ``m_i`` and sum ``l_i``), add the sinks' mass, quantise to FP8 under ``OUT_SCALE``, and store the rows that
    exist (``row_ok``), not the columns past a padded head."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    values, tensors = scales
    out_ptr, out_strides, _, _ = output
    sink2 = gl.zeros([acc.shape[0]], gl.float32, row_o)
    if cfg.FEATURES.SINKS:
        sink2 = gl.load(per_head[1] + gl.convert_layout(head, row_o), mask=gl.convert_layout(row_ok, row_o),
                        other=0.0).to(gl.float32) * LOG2E
    inv_out_scale = 1.0
    if cfg.FEATURES.OUT_SCALE:
        inv_out_scale = 1.0 / scalar_or_load(values.out, tensors.out, cfg.SCALE_FROM_TENSOR.OUT)
    out = finish_rows(acc, gl.convert_layout(m_i, row_o), gl.convert_layout(l_i, row_o), sink2, inv_out_scale,
                      cfg.FEATURES.SINKS)
    if cfg.FEATURES.OUT_SCALE:
        out = round_to_fp8_e4m3(out, cfg.LAYOUT.OUT_MAX)
    offs_d = gl.arange(0, cfg.HEAD_SIZE, gl.SliceLayout(0, o_layout))
    rows = gl.convert_layout(out_rows, row_o)
    heads = gl.convert_layout(head, row_o)
    ok = gl.convert_layout(row_ok, row_o)
    o_off = (gl.expand_dims(rows.to(gl.int64) * out_strides.token + heads.to(gl.int64) * out_strides.head, 1)
             + gl.expand_dims(offs_d, 0))
    store_ok = gl.expand_dims(ok, 1)
    if cfg.PADDED:  # not the columns of a padded head
        store_ok = store_ok & gl.expand_dims(offs_d < cfg.LAYOUT.HEAD_DIM, 0)
    gl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=store_ok)


@gluon.jit
def store_partials(cfg, acc, m_i, l_i, head, out_rows, row_ok, rows, output, o_layout: gl.constexpr):
    """Split keys: store this program's partial rows (core's ``Partials``: the accumulator normalised by its own
    sum, over the tile's whole width, and the log-sum-exp), which :func:`merge_if_last` merges, sinks and output
    scale included. ``rows`` is the tile's :class:`~.state.TileRows`."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    _, _, partials, _ = output
    part, lse = partial_rows(acc, gl.convert_layout(m_i, row_o), gl.convert_layout(l_i, row_o))
    num_heads = (gl.num_programs(1) // cfg.TILE.HEAD_CHUNKS) * rows.group_size
    ok = gl.convert_layout(row_ok, row_o)
    index = partial_index(gl.program_id(2), gl.convert_layout(out_rows, row_o), gl.convert_layout(head, row_o),
                          rows.num_tokens, num_heads)
    gl.store(partials[1] + index, lse, mask=ok)
    offs_d = gl.arange(0, cfg.HEAD_SIZE, gl.SliceLayout(0, o_layout))
    gl.store(partials[0] + gl.expand_dims(index, 1) * cfg.HEAD_SIZE + gl.expand_dims(offs_d, 0), part,
             mask=gl.expand_dims(ok, 1))


@gluon.jit
def merge_if_last(cfg, head, out_rows, row_ok, rows, per_head, scales, output, o_layout: gl.constexpr,
                  CONSUMER: gl.constexpr):
    """Split keys, after :func:`store_partials`: count this consumer's arrival at its rows of the tile, and if it
    is the last of the tile's ``KEY_SPLITS`` programs to arrive, merge every split's partial rows (each weighed by
    ``2 ** (lse - max)``, as core's combine does) and store them with :func:`store_rows`.

    ``output[3]`` holds one arrival counter per (tile, head chunk, consumer), zero when the launch starts; the last
    arrival sets it back to zero, so a counter is zero again when its launch ends. The consumer's warps meet at a
    barrier after their stores, and the count is an acquire-release atomic at GPU scope: the last program sees
    every other program's partial rows, which it reads from L2 (``.cg``)."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    _, _, partials, arrivals = output
    gl.thread_barrier()  # every warp of this consumer has stored its partial rows
    slot = (gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)) * cfg.CONSUMERS + CONSUMER
    arrived = gl.atomic_add(arrivals + slot, 1, sem="acq_rel", scope="gpu")
    if arrived == cfg.TILE.KEY_SPLITS - 1:
        gl.store(arrivals + slot, 0)
        num_heads = (gl.num_programs(1) // cfg.TILE.HEAD_CHUNKS) * rows.group_size
        ok = gl.convert_layout(row_ok, row_o)
        q_rows = gl.convert_layout(out_rows, row_o)
        heads = gl.convert_layout(head, row_o)
        top = gl.full([cfg.ROWS], float("-inf"), gl.float32, row_o)
        for split in range(cfg.TILE.KEY_SPLITS):
            index = partial_index(split, q_rows, heads, rows.num_tokens, num_heads)
            top = gl.maximum(top, gl.load(partials[1] + index, mask=ok, other=float("-inf"), cache_modifier=".cg"))
        top = gl.where(top == float("-inf"), 0.0, top)  # a row no split saw a key of: every weight is 0
        total = gl.zeros([cfg.ROWS], gl.float32, row_o)
        acc = gl.zeros([cfg.ROWS, cfg.HEAD_SIZE], gl.float32, o_layout)
        offs_d = gl.arange(0, cfg.HEAD_SIZE, gl.SliceLayout(0, o_layout))
        for split in range(cfg.TILE.KEY_SPLITS):
            index = partial_index(split, q_rows, heads, rows.num_tokens, num_heads)
            weight = gl.exp2(gl.load(partials[1] + index, mask=ok, other=float("-inf"), cache_modifier=".cg") - top)
            total += weight
            part = gl.load(partials[0] + gl.expand_dims(index, 1) * cfg.HEAD_SIZE + gl.expand_dims(offs_d, 0),
                           mask=gl.expand_dims(ok, 1), other=0.0, cache_modifier=".cg")
            acc += part * gl.expand_dims(weight, 1)
        store_rows(cfg, acc, top, total, head, out_rows, row_ok, per_head, scales, output, o_layout)

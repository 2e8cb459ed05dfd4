"""The Hopper kernel's epilogue: each consumer normalises its rows (sinks, the FP8 output scale) and stores them
where they belong in ``out``, with the portable kernel's building blocks; under ``HEAD_PANELS`` a padded head's two
accumulator panels (``WIDE`` and ``NARROW`` columns, :class:`~.state.KernelConfig`) one after the other. With split
keys each consumer stores its partial rows, and the last of a tile's splits to finish merges them
(:func:`merge_if_last`), so that a call with split keys is one launch: no combine kernel waits for the host to
launch it.
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
def store_rows(cfg, acc, COL0: gl.constexpr, m_i, l_i, head, out_rows, row_ok, per_head, scales, output,
               o_layout: gl.constexpr):
    """Normalise the accumulator ``acc`` (columns ``COL0 ..`` of rows ``out_rows`` of heads ``head``, in
    ``o_layout``; running max ``m_i`` and sum ``l_i``), add the sinks' mass, quantise to FP8 under ``OUT_SCALE``,
    and store the rows that exist (``row_ok``), not the columns past a padded head."""
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
    offs_d = COL0 + gl.arange(0, acc.shape[1], gl.SliceLayout(0, o_layout))
    rows = gl.convert_layout(out_rows, row_o)
    heads = gl.convert_layout(head, row_o)
    ok = gl.convert_layout(row_ok, row_o)
    o_off = (gl.expand_dims(rows.to(gl.int64) * out_strides.token + heads.to(gl.int64) * out_strides.head, 1)
             + gl.expand_dims(offs_d, 0))
    store_ok = gl.expand_dims(ok, 1)
    if COL0 + acc.shape[1] > cfg.LAYOUT.HEAD_DIM:  # not the columns past a padded head (a tile-wide accumulator)
        store_ok = store_ok & gl.expand_dims(offs_d < cfg.LAYOUT.HEAD_DIM, 0)
    gl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=store_ok)


@gluon.jit
def store_partials(cfg, acc, COL0: gl.constexpr, m_i, l_i, head, out_rows, row_ok, rows, output,
                   o_layout: gl.constexpr):
    """Split keys: store this program's partial rows (core's ``Partials``: the accumulator normalised by its own
    sum, columns ``COL0 ..`` of rows as wide as the tile, and with the first columns the log-sum-exp), which
    :func:`merge_if_last` merges, sinks and output scale included. ``rows`` is the tile's
    :class:`~.state.TileRows`."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    _, _, partials, _ = output
    part, lse = partial_rows(acc, gl.convert_layout(m_i, row_o), gl.convert_layout(l_i, row_o))
    num_heads = (gl.num_programs(1) // cfg.TILE.HEAD_CHUNKS) * rows.group_size
    ok = gl.convert_layout(row_ok, row_o)
    index = partial_index(gl.program_id(2), gl.convert_layout(out_rows, row_o), gl.convert_layout(head, row_o),
                          rows.num_tokens, num_heads)
    if COL0 == 0:
        gl.store(partials[1] + index, lse, mask=ok)
    offs_d = COL0 + gl.arange(0, acc.shape[1], gl.SliceLayout(0, o_layout))
    gl.store(partials[0] + gl.expand_dims(index, 1) * cfg.HEAD_SIZE + gl.expand_dims(offs_d, 0), part,
             mask=gl.expand_dims(ok, 1))


@gluon.jit
def merge_panel(cfg, COL0: gl.constexpr, WIDTH: gl.constexpr, top, q_rows, heads, ok, head, out_rows, row_ok, rows,
                per_head, scales, output, o_layout: gl.constexpr):
    """Columns ``COL0 .. COL0 + WIDTH`` of :func:`merge_if_last`: every split's partial rows weighed by
    ``2 ** (lse - top)``, normalised by the weights' sum and stored with :func:`store_rows`."""
    _, _, partials, _ = output
    num_heads = (gl.num_programs(1) // cfg.TILE.HEAD_CHUNKS) * rows.group_size
    total = gl.zeros([cfg.ROWS], gl.float32, gl.SliceLayout(1, o_layout))
    acc = gl.zeros([cfg.ROWS, WIDTH], gl.float32, o_layout)
    offs_d = COL0 + gl.arange(0, WIDTH, gl.SliceLayout(0, o_layout))
    for split in range(cfg.TILE.KEY_SPLITS):
        index = partial_index(split, q_rows, heads, rows.num_tokens, num_heads)
        weight = gl.exp2(gl.load(partials[1] + index, mask=ok, other=float("-inf"), cache_modifier=".cg") - top)
        total += weight
        part = gl.load(partials[0] + gl.expand_dims(index, 1) * cfg.HEAD_SIZE + gl.expand_dims(offs_d, 0),
                       mask=gl.expand_dims(ok, 1), other=0.0, cache_modifier=".cg")
        acc += part * gl.expand_dims(weight, 1)
    store_rows(cfg, acc, COL0, top, total, head, out_rows, row_ok, per_head, scales, output, o_layout)


@gluon.jit
def merge_if_last(cfg, head, out_rows, row_ok, rows, per_head, scales, output, o_layout: gl.constexpr,
                  on_layout: gl.constexpr, CONSUMER: gl.constexpr):
    """Split keys, after :func:`store_partials`: count this consumer's arrival at its rows of the tile, and if it
    is the last of the tile's ``KEY_SPLITS`` programs to arrive, merge every split's partial rows (each weighed by
    ``2 ** (lse - max)``, as core's combine does) and store them (:func:`merge_panel`; ``o_layout`` and
    ``on_layout`` are the accumulator panels' layouts).

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
        merge_panel(cfg, 0, cfg.WIDE, top, q_rows, heads, ok, head, out_rows, row_ok, rows, per_head, scales, output,
                    o_layout)
        if cfg.PANELS:
            n_row: gl.constexpr = gl.SliceLayout(1, on_layout)
            merge_panel(cfg, cfg.WIDE, cfg.NARROW, gl.convert_layout(top, n_row), gl.convert_layout(q_rows, n_row),
                        gl.convert_layout(heads, n_row), gl.convert_layout(ok, n_row), head, out_rows, row_ok, rows,
                        per_head, scales, output, on_layout)

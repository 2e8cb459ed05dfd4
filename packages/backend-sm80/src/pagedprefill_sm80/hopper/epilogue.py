"""The Hopper kernel's epilogue: each consumer normalises its rows (sinks, the FP8 output scale) and stores them
where they belong in ``out``, or with split keys stores its partial rows for core's combine, with the portable
kernel's building blocks."""

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
    HEAD_SIZE: gl.constexpr = cfg.LAYOUT.HEAD_SIZE
    SINKS: gl.constexpr = cfg.FEATURES.SINKS
    OUT_SCALE: gl.constexpr = cfg.FEATURES.OUT_SCALE
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    values, tensors = scales
    out_ptr, out_strides, _ = output
    sink2 = gl.zeros([acc.shape[0]], gl.float32, row_o)
    if SINKS:
        sink2 = gl.load(per_head[1] + gl.convert_layout(head, row_o), mask=gl.convert_layout(row_ok, row_o),
                        other=0.0).to(gl.float32) * LOG2E
    inv_out_scale = 1.0
    if OUT_SCALE:
        inv_out_scale = 1.0 / scalar_or_load(values.out, tensors.out, cfg.SCALE_FROM_TENSOR.OUT)
    out = finish_rows(acc, gl.convert_layout(m_i, row_o), gl.convert_layout(l_i, row_o), sink2, inv_out_scale,
                      SINKS)
    if OUT_SCALE:
        out = round_to_fp8_e4m3(out, cfg.LAYOUT.OUT_MAX)
    offs_d = gl.arange(0, HEAD_SIZE, gl.SliceLayout(0, o_layout))
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
    sum, over the tile's whole width, and the log-sum-exp), which core's combine merges, sinks and output scale
    included. ``rows`` is the tile's :class:`~.state.TileRows`."""
    HEAD_SIZE: gl.constexpr = cfg.LAYOUT.HEAD_SIZE
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    _, _, partials = output
    part, lse = partial_rows(acc, gl.convert_layout(m_i, row_o), gl.convert_layout(l_i, row_o))
    num_heads = (gl.num_programs(1) // cfg.TILE.HEAD_CHUNKS) * rows.group_size
    ok = gl.convert_layout(row_ok, row_o)
    index = partial_index(gl.program_id(2), gl.convert_layout(out_rows, row_o), gl.convert_layout(head, row_o),
                          rows.num_tokens, num_heads)
    gl.store(partials[1] + index, lse, mask=ok)
    offs_d = gl.arange(0, HEAD_SIZE, gl.SliceLayout(0, o_layout))
    gl.store(partials[0] + gl.expand_dims(index, 1) * HEAD_SIZE + gl.expand_dims(offs_d, 0), part,
             mask=gl.expand_dims(ok, 1))

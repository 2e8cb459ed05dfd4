"""Host side of the Triton kernel: turn a validated problem and a TileConfig into one launch.

No device-to-host synchronisation and no allocation: the grid comes from tensor shapes
(``num_tokens // tokens_per_tile + num_seqs`` tiles, programs past their sequence's end exit at once),
scales given as tensors are read on the device, and the launch happens on the tensors' device whatever the
current device is.
"""

from __future__ import annotations

import contextlib

import torch
import triton

from ..tiling import TileConfig, padded_head_size
from ..types import KVLayout, PrefillProblem
from .kernel import prefix_prefill_kernel


def _vector_alignment(strides, unit: int, element_size: int) -> int:
    """Largest power of two (at most 16 bytes of elements) dividing every stride but ``strides[unit]``,
    which must be 1 for any alignment to help; 1 when nothing is known."""
    if strides[unit] != 1:
        return 1
    align = max(1, 16 // element_size)
    while align > 1 and any(s % align for i, s in enumerate(strides) if i != unit):
        align //= 2
    return align


def _cache_geometry(problem: PrefillProblem, head_size_padded: int):
    """Cache tensors (FP8 bytes viewed as float8), ``X``, the strides of the unified address formula and
    the alignments (in elements) the kernel may assume for them."""
    c = problem.cache
    key, value = c.key, c.value
    if c.dtype.is_fp8 and key.dtype == torch.uint8:
        key, value = key.view(c.dtype.torch_dtype), value.view(c.dtype.torch_dtype)
    if c.layout is KVLayout.SPLIT:
        x = key.shape[4]
        k_strides = (key.stride(0), key.stride(1), key.stride(2), key.stride(3), key.stride(4))
        v_strides = (value.stride(0), value.stride(1), value.stride(2), value.stride(3))
        v_unit = 3  # slots are contiguous
    else:  # [blocks, slot, head, d]: no d // X term, X beyond any head dim
        x = 2 * head_size_padded
        k_strides = (key.stride(0), key.stride(2), 0, key.stride(1), key.stride(3))
        v_strides = (value.stride(0), value.stride(2), value.stride(3), value.stride(1))
        v_unit = 2  # the head dim is contiguous
    k_align = _vector_alignment(k_strides, 4, key.element_size())
    v_align = _vector_alignment(v_strides, v_unit, value.element_size())
    return key, value, x, k_strides, v_strides, k_align, v_align


def _scale_arg(scale, fp8: bool, fallback: torch.Tensor):
    """(float value, pointer tensor, read-from-pointer flag) for one dequantisation scale."""
    if not fp8:
        return 1.0, fallback, False
    if isinstance(scale, torch.Tensor):
        return 1.0, scale, True
    return float(scale), fallback, False


def kernel_call(problem: PrefillProblem, config: TileConfig):
    """``(grid, positional arguments, keyword arguments)`` of the kernel launch for ``problem``, or None when
    there is nothing to launch. The keyword arguments hold the constexprs and the compile options."""
    p = problem
    q, out = p.q, p.out
    T, H, D = q.shape
    B = p.batch.num_seqs
    if T == 0 or B == 0 or H == 0:
        return None
    group = H // p.num_kv_heads
    heads_per_tile = min(config.heads_per_tile, group)
    tokens_per_tile = config.block_m // heads_per_tile
    head_chunks = triton.cdiv(group, heads_per_tile)
    d_pad = padded_head_size(D)
    key, value, x, ks, vs, k_align, v_align = _cache_geometry(p, d_pad)
    fp8 = p.cache.dtype.is_fp8
    k_scale, k_scale_ptr, k_from_ptr = _scale_arg(p.cache.k_scale, fp8, q)
    v_scale, v_scale_ptr, v_from_ptr = _scale_arg(p.cache.v_scale, fp8, q)
    opts = p.options
    causal = getattr(opts, "causal", True)
    skip_decode = getattr(opts, "skip_decode", False)
    out_scale = getattr(opts, "fp8_out_scale", None)
    new_kv_in_cache = p.k is None
    table = p.batch.block_table
    grid = (T // tokens_per_tile + B, p.num_kv_heads * head_chunks)
    bs = p.cache.block_size
    pagewise = config.pagewise and bs & (bs - 1) == 0 and (config.block_n % bs == 0 or bs % config.block_n == 0)
    new_strides = (0, 0, 0, 0) if new_kv_in_cache else (p.k.stride(0), p.k.stride(1), p.v.stride(0), p.v.stride(1))
    args = (
            q, q if new_kv_in_cache else p.k, q if new_kv_in_cache else p.v, out, key, value, table,
            p.batch.query_start, p.batch.seq_lens, p.batch.context_lens,
            opts.alibi_slopes if opts.alibi_slopes is not None else q,
            opts.sinks if opts.sinks is not None else q,
            k_scale_ptr, v_scale_ptr, out_scale if out_scale is not None else q,
            p.sm_scale, k_scale, v_scale, float(opts.softcap), opts.window,
            B, T, p.cache.num_blocks, table.shape[1], p.cache.block_size, group,
            q.stride(0), q.stride(1), *new_strides,
            out.stride(0), out.stride(1),
            *ks, *vs,
            table.stride(0), table.stride(1))
    kwargs = dict(
            HEAD_SIZE=D, HEAD_SIZE_PADDED=d_pad, X=x,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEADS_PER_TILE=heads_per_tile,
            HEAD_CHUNKS=head_chunks, SPLIT_MASKS=config.split_masks, WINDOW=opts.window > 0,
            SOFTCAP=opts.softcap > 0, ALIBI=opts.alibi_slopes is not None, SINKS=opts.sinks is not None,
            K_SCALE_PTR=k_from_ptr, V_SCALE_PTR=v_from_ptr, PAGE_SIZE=bs if pagewise else 0,
            SPLIT_CACHE=p.cache.layout is KVLayout.SPLIT, K_ALIGN=k_align, V_ALIGN=v_align,
            CAUSAL=causal, SKIP_DECODE=skip_decode, NEW_KV_IN_CACHE=new_kv_in_cache,
            OUT_SCALE=out_scale is not None, OUT_MAX=448.0,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return grid, args, kwargs


def launch_prefill(problem: PrefillProblem, config: TileConfig):
    """Run the prefix-prefill kernel for ``problem`` (already validated) with ``config``.

    Returns Triton's compiled-kernel handle (its ``metadata.shared`` is the shared memory it uses), or None
    when there was nothing to launch.
    """
    call = kernel_call(problem, config)
    if call is None:
        return None
    grid, args, kwargs = call
    q = problem.q
    device_ctx = torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext()
    with device_ctx:
        return prefix_prefill_kernel[grid](*args, **kwargs)

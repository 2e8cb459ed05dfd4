"""Host side of the Triton kernel: turn a validated problem and a TileConfig into one launch.

No device-to-host synchronisation and no allocation: the grid comes from tensor shapes
(``num_tokens // tokens_per_tile + num_seqs`` tiles, programs past their sequence's end exit at once),
scales given as tensors are read on the device, and the launch happens on the tensors' device whatever the
current device is.
"""

from __future__ import annotations

import torch
import triton

from ..accelerator import device_guard
from ..tiling import TileConfig, padded_head_size
from ..types import KVLayout, PrefillProblem
from .kernel import prefix_prefill_kernel


def _cache_geometry(problem: PrefillProblem, head_size_padded: int):
    """Cache tensors (FP8 bytes viewed as float8), ``X`` and the strides of the unified address formula."""
    c = problem.cache
    key, value = c.key, c.value
    if c.dtype.is_fp8 and key.dtype == torch.uint8:
        key, value = key.view(c.dtype.torch_dtype), value.view(c.dtype.torch_dtype)
    if c.layout is KVLayout.SPLIT:
        x = key.shape[4]
        k_strides = (key.stride(0), key.stride(1), key.stride(2), key.stride(3), key.stride(4))
        v_strides = (value.stride(0), value.stride(1), value.stride(2), value.stride(3))
    else:  # [blocks, slot, head, d]: no d // X term, X beyond any head dim
        x = 2 * head_size_padded
        k_strides = (key.stride(0), key.stride(2), 0, key.stride(1), key.stride(3))
        v_strides = (value.stride(0), value.stride(2), value.stride(3), value.stride(1))
    return key, value, x, k_strides, v_strides


def _scale_arg(scale, fp8: bool, fallback: torch.Tensor):
    """(float value, pointer tensor, read-from-pointer flag) for one dequantisation scale."""
    if not fp8:
        return 1.0, fallback, False
    if isinstance(scale, torch.Tensor):
        return 1.0, scale, True
    return float(scale), fallback, False


def launch_prefill(problem: PrefillProblem, config: TileConfig):
    """Run the prefix-prefill kernel for ``problem`` (already validated) with ``config``.

    Returns Triton's compiled-kernel handle (its ``metadata.shared`` is the shared memory it uses), or None
    when there was nothing to launch.
    """
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
    key, value, x, ks, vs = _cache_geometry(p, d_pad)
    fp8 = p.cache.dtype.is_fp8
    k_scale, k_scale_ptr, k_from_ptr = _scale_arg(p.cache.k_scale, fp8, q)
    v_scale, v_scale_ptr, v_from_ptr = _scale_arg(p.cache.v_scale, fp8, q)
    opts = p.options
    table = p.batch.block_table
    grid = (T // tokens_per_tile + B, p.num_kv_heads * head_chunks)
    bs = p.cache.block_size
    pagewise = config.pagewise and bs & (bs - 1) == 0 and (config.block_n % bs == 0 or bs % config.block_n == 0)
    with device_guard(q.device):
        return prefix_prefill_kernel[grid](
            q, p.k, p.v, out, key, value, table, p.batch.query_start, p.batch.seq_lens, p.batch.context_lens,
            opts.alibi_slopes if opts.alibi_slopes is not None else q,
            opts.sinks if opts.sinks is not None else q,
            k_scale_ptr, v_scale_ptr,
            p.sm_scale, k_scale, v_scale, float(opts.softcap), opts.window,
            B, T, p.cache.num_blocks, table.shape[1], p.cache.block_size, group,
            q.stride(0), q.stride(1), p.k.stride(0), p.k.stride(1), p.v.stride(0), p.v.stride(1),
            out.stride(0), out.stride(1),
            *ks, *vs,
            table.stride(0), table.stride(1),
            HEAD_SIZE=D, HEAD_SIZE_PADDED=d_pad, X=x,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEADS_PER_TILE=heads_per_tile,
            HEAD_CHUNKS=head_chunks, SPLIT_MASKS=config.split_masks, WINDOW=opts.window > 0,
            SOFTCAP=opts.softcap > 0, ALIBI=opts.alibi_slopes is not None, SINKS=opts.sinks is not None,
            K_SCALE_PTR=k_from_ptr, V_SCALE_PTR=v_from_ptr, PAGE_SIZE=bs if pagewise else 0,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=config.num_warps, num_stages=config.num_stages,
        )

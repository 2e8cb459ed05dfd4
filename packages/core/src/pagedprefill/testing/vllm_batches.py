"""Batches built the way vLLM's prefix-prefill kernel tests build them, with N(0, 1) data, for the
:mod:`pagedprefill.vllm` drop-in, plus an independent float64 SDPA reference.

The construction: dense keys/values of every token of every sequence; a staging cache
``[num_blocks, block_size, Hkv, D]`` of the cache dtype into which each sequence's context tokens are
copied through a block table of shuffled blocks; then K split into ``x``-element chunks
(``view(-1, block_size, Hkv, D // x, x).permute(0, 2, 3, 1, 4).contiguous()``) with ``x = 8`` whatever the
dtype, and V ``permute(0, 2, 3, 1).contiguous()``. FP8 caches are ``uint8`` (quantised bytes), or a
``float8`` tensor split the same way and then viewed ``.view(torch.uint8)`` (``fp8_storage="float8_view"``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..cache import fp8_scale_for, quantize_fp8
from ..types import KVCacheDType

__all__ = ["sdpa_reference", "vllm_batch"]


def vllm_batch(
    query_lens: Sequence[int],
    ctx_lens: Sequence[int],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 32,
    dtype: torch.dtype = torch.float16,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    x: int = 8,
    fp8_storage: str = "uint8",
    spare_blocks: int = 5,
    device="cpu",
    seed: int = 0,
) -> dict:
    """The arguments of :func:`pagedprefill.vllm.context_attention_fwd` (by name, ``o`` NaN-poisoned), plus
    ``key``/``value``: the dense ``[sum(seq_lens), Hkv, D]`` float64 values the cache holds (dequantised)
    and the new tokens, in sequence order, for :func:`sdpa_reference`."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    B = len(query_lens)
    seq_lens = [q + c for q, c in zip(query_lens, ctx_lens)]
    T = sum(query_lens)
    H, Hkv, D, bs = num_heads, num_kv_heads, head_size, block_size
    blocks = [-(-c // bs) for c in ctx_lens]
    num_blocks = sum(blocks) + spare_blocks
    width = max(blocks + [1])
    kv_dtype = KVCacheDType.parse("auto" if kv_cache_dtype in ("float16", "bfloat16", "float32") else kv_cache_dtype)

    key = randn(sum(seq_lens), Hkv, D).to(dtype)
    value = randn(sum(seq_lens), Hkv, D).to(dtype)
    # staging cache: every slot holds data (unused slots too), so wrong indexing shows
    k_stage = randn(num_blocks, bs, Hkv, D)
    v_stage = randn(num_blocks, bs, Hkv, D)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (B, width), generator=gen, dtype=torch.int32)
    q_start = [0]
    seq_start = [0]
    used = 0
    new_k, new_v = [], []
    for i, (n, c) in enumerate(zip(query_lens, ctx_lens)):
        table[i, :blocks[i]] = perm[used:used + blocks[i]].to(torch.int32)
        used += blocks[i]
        s0 = seq_start[-1]
        for pos in range(c):
            blk, off = int(table[i, pos // bs]), pos % bs
            k_stage[blk, off] = key[s0 + pos].float()
            v_stage[blk, off] = value[s0 + pos].float()
        new_k.append(key[s0 + c:s0 + c + n])
        new_v.append(value[s0 + c:s0 + c + n])
        q_start.append(q_start[-1] + n)
        seq_start.append(s0 + c + n)

    k_scale = v_scale = 1.0
    if kv_dtype.is_fp8:
        k_scale, v_scale = fp8_scale_for(k_stage, kv_dtype), fp8_scale_for(v_stage, kv_dtype)
        k_bytes, v_bytes = quantize_fp8(k_stage, k_scale, kv_dtype), quantize_fp8(v_stage, v_scale, kv_dtype)
        if fp8_storage == "float8_view":  # build the split layout in the float8 dtype, then view the bytes
            k_bytes, v_bytes = k_bytes.view(kv_dtype.torch_dtype), v_bytes.view(kv_dtype.torch_dtype)
        elif fp8_storage != "uint8":
            raise ValueError(f"fp8_storage: expected 'uint8' or 'float8_view', got {fp8_storage!r}")
        k_cache, v_cache = k_bytes, v_bytes
        k_values = k_bytes.view(kv_dtype.torch_dtype).double() * k_scale
        v_values = v_bytes.view(kv_dtype.torch_dtype).double() * v_scale
    else:
        k_cache, v_cache = k_stage.to(dtype), v_stage.to(dtype)
        k_values, v_values = k_cache.double(), v_cache.double()
    k_cache = k_cache.view(-1, bs, Hkv, D // x, x).permute(0, 2, 3, 1, 4).contiguous()
    v_cache = v_cache.view(-1, bs, Hkv, D).permute(0, 2, 3, 1).contiguous()
    if k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)

    # what the kernel must see: context tokens as stored (dequantised), new tokens as given
    dense_k, dense_v = key.double().clone(), value.double().clone()
    for i, c in enumerate(ctx_lens):
        for pos in range(c):
            blk, off = int(table[i, pos // bs]), pos % bs
            dense_k[seq_start[i] + pos] = k_values[blk, off]
            dense_v[seq_start[i] + pos] = v_values[blk, off]

    to = dict(device=device)
    q = randn(T, H, D).to(dtype)
    return dict(
        q=q.to(**to), k=torch.cat(new_k).to(**to), v=torch.cat(new_v).to(**to),
        o=torch.full((T, H, D), float("nan"), dtype=dtype, device=device),
        kv_cache_dtype=kv_cache_dtype, k_cache=k_cache.to(**to), v_cache=v_cache.to(**to), b_loc=table.to(**to),
        b_start_loc=torch.tensor(q_start, dtype=torch.int32, device=device),
        b_seq_len=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_seq_len=max(seq_lens), max_input_len=max(query_lens),
        k_scale=torch.tensor(k_scale, dtype=torch.float32, device=device),
        v_scale=torch.tensor(v_scale, dtype=torch.float32, device=device),
        key=dense_k, value=dense_v,
    )


def sdpa_reference(batch: dict, sliding_window: int = 0, sm_scale: Optional[float] = None) -> torch.Tensor:
    """Float64 output ``[T, H, D]`` from torch's SDPA per sequence on ``batch``'s dense keys/values, with the
    bottom-right causal mask and an optional sliding window (``query_pos - key_pos < sliding_window``)."""
    q = batch["q"].double().cpu()
    H = q.shape[1]
    seq_lens = batch["b_seq_len"].tolist()
    starts = batch["b_start_loc"].tolist()
    out = torch.empty_like(q)
    s0 = 0
    for i, seq in enumerate(seq_lens):
        n = starts[i + 1] - starts[i]
        k = batch["key"][s0:s0 + seq]
        v = batch["value"][s0:s0 + seq]
        group = H // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        query_pos = torch.arange(seq - n, seq)[:, None]
        key_pos = torch.arange(seq)[None, :]
        mask = key_pos <= query_pos
        if sliding_window > 0:
            mask &= query_pos - key_pos < sliding_window
        part = torch.nn.functional.scaled_dot_product_attention(
            q[starts[i]:starts[i] + n].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
            scale=sm_scale)
        out[starts[i]:starts[i] + n] = part.transpose(0, 1)
        s0 += seq
    return out

"""Paged KV-cache utilities: allocate a cache, write new tokens into it, quantise to FP8, read it back.

These are the operations an engine performs around the attention call. ``write_to_cache`` is what serving
engines call ``reshape_and_cache``: token ``t`` of ``key``/``value`` goes to slot ``slot_mapping[t]``, i.e.
block ``slot // block_size``, offset ``slot % block_size``; a negative slot skips the token (padding).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .placement import require_device
from .types import KVCacheDType, KVLayout, PagedKVCache, ScaleLike
from .validation import dtype_name, expected_x

DeviceLike = Union[str, torch.device, None]


def allocate_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype = torch.float16,
    *,
    layout: Union[KVLayout, str] = KVLayout.NHD,
    kv_cache_dtype: Union[KVCacheDType, str] = KVCacheDType.AUTO,
    k_scale: ScaleLike = 1.0,
    v_scale: ScaleLike = 1.0,
    device: DeviceLike = None,
    fill: Optional[float] = None,
    x: Optional[int] = None,
) -> PagedKVCache:
    """Allocate an (uninitialised, or filled with ``fill``) paged KV cache.

    Args:
        num_blocks, block_size, num_kv_heads, head_size: cache geometry (``block_size`` needs not be a
            power of two).
        dtype: model dtype, used as the storage dtype when ``kv_cache_dtype`` is ``auto``.
        layout: :class:`KVLayout` ``"nhd"`` or ``"split"``.
        kv_cache_dtype: ``auto`` or an FP8 format; FP8 caches are stored as ``uint8``.
        k_scale, v_scale: FP8 dequantisation scales carried by the returned descriptor.
        device: where to allocate (default: torch's default device); one this process can use, else
            :class:`~pagedprefill.DeviceUnavailableError` names it.
        fill: a value for every element (default: uninitialised).
        x: elements per innermost K chunk of the split layout; default: those making 16 bytes (reduced to
            divide ``head_size``). Any ``x >= 1`` dividing ``head_size`` is valid.
    """
    layout = KVLayout(layout)
    kv_dtype = KVCacheDType.parse(kv_cache_dtype)
    for name, value, low in (("num_blocks", num_blocks, 1), ("block_size", block_size, 1),
                             ("num_kv_heads", num_kv_heads, 1), ("head_size", head_size, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    if device is not None:
        device = require_device("device", device)
    storage = torch.uint8 if kv_dtype.is_fp8 else dtype
    if layout is KVLayout.SPLIT:
        if x is None:
            x = expected_x(head_size, torch.empty((), dtype=storage).element_size())
        elif not isinstance(x, int) or isinstance(x, bool) or x < 1 or head_size % x:
            raise ValueError(f"x: expected an int >= 1 dividing head_size {head_size}, got {x!r}")
        k_shape = (num_blocks, num_kv_heads, head_size // x, block_size, x)
        v_shape = (num_blocks, num_kv_heads, head_size, block_size)
    else:
        k_shape = v_shape = (num_blocks, block_size, num_kv_heads, head_size)
    key = torch.empty(k_shape, dtype=storage, device=device)
    value = torch.empty(v_shape, dtype=storage, device=device)
    if fill is not None:
        for t in (key, value):
            as_stored_type(t, kv_dtype).fill_(fill)
    return PagedKVCache(key, value, layout, kv_dtype, k_scale, v_scale)


def as_stored_type(t: torch.Tensor, kv_dtype: KVCacheDType) -> torch.Tensor:
    """Cache tensor ``t`` seen as the type its elements hold: FP8 bytes (``uint8``) as the FP8 type of
    ``kv_dtype``, anything else as it is (the same memory either way)."""
    return t.view(kv_dtype.torch_dtype) if kv_dtype.is_fp8 and t.dtype == torch.uint8 else t


def scale_value(scale: ScaleLike) -> Union[float, torch.Tensor]:
    """A scale given as a float or a 1-element tensor, as a float or a 0-d float32 tensor (no host sync), to
    multiply or divide a tensor by."""
    return scale.reshape(()).float() if isinstance(scale, torch.Tensor) else float(scale)


def quantize_fp8(
    x: torch.Tensor, scale: ScaleLike, kv_cache_dtype: Union[KVCacheDType, str] = KVCacheDType.FP8_E4M3
) -> torch.Tensor:
    """Quantise ``x / scale`` to FP8 (saturating to the format's range) and return the ``uint8`` bytes."""
    kv_dtype = KVCacheDType.parse(kv_cache_dtype)
    if not kv_dtype.is_fp8:
        raise ValueError(f"kv_cache_dtype: expected an FP8 format for quantize_fp8, got {kv_dtype.value!r}")
    fp8 = kv_dtype.torch_dtype
    limit = torch.finfo(fp8).max
    y = (x.float() / scale_value(scale)).clamp(-limit, limit)
    return y.to(fp8).view(torch.uint8)


def fp8_scale_for(x: torch.Tensor, kv_cache_dtype: Union[KVCacheDType, str] = KVCacheDType.FP8_E4M3) -> float:
    """A per-tensor scale that maps ``max(|x|)`` to the FP8 format's largest value (host sync)."""
    fp8 = KVCacheDType.parse(kv_cache_dtype).torch_dtype
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    return max(amax, 1e-12) / torch.finfo(fp8).max


def write_to_cache(
    cache: PagedKVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` (``[tokens, Hkv, D]``, model dtype) into ``cache`` at ``slot_mapping``.

    FP8 caches quantise with the descriptor's ``k_scale``/``v_scale``. Slots must be ``< num_blocks *
    block_size``; negative slots are skipped. Runs as a few vectorised PyTorch ops on the cache's device.
    """
    if key.dim() != 3 or tuple(value.shape) != tuple(key.shape):
        raise ValueError(
            f"key/value: expected two [tokens, num_kv_heads, head_size] tensors of one shape, got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key.shape[1] != cache.num_kv_heads or key.shape[2] != cache.head_size:
        raise ValueError(
            f"key: expected [tokens, {cache.num_kv_heads}, {cache.head_size}] to match the cache, got "
            f"{tuple(key.shape)}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping: expected shape [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping: expected dtype int32 or int64, got {dtype_name(slot_mapping.dtype)}")
    slots = slot_mapping.to(device=cache.key.device, dtype=torch.int64)
    keep = slots >= 0
    slots, key, value = slots[keep], key[keep], value[keep]
    bs = cache.block_size
    block, offset = slots // bs, slots % bs
    if cache.dtype.is_fp8:
        k_new = quantize_fp8(key, cache.k_scale, cache.dtype)
        v_new = quantize_fp8(value, cache.v_scale, cache.dtype)
        if cache.key.dtype != torch.uint8:
            k_new, v_new = k_new.view(cache.key.dtype), v_new.view(cache.key.dtype)
    else:
        k_new, v_new = key.to(cache.key.dtype), value.to(cache.value.dtype)
    if cache.layout is KVLayout.NHD:
        cache.key[block, offset] = k_new
        cache.value[block, offset] = v_new
    else:
        x = cache.x
        n, hkv, d = k_new.shape
        # K: [nb, Hkv, D/x, bs, x] indexed by (block, :, :, offset, :) -> [n, Hkv, D/x, x]
        cache.key[block, :, :, offset, :] = k_new.reshape(n, hkv, d // x, x)
        # V: [nb, Hkv, D, bs] indexed by (block, :, :, offset) -> [n, Hkv, D]
        cache.value[block, :, :, offset] = v_new


def gather_kv(
    cache: PagedKVCache, block_table_row: torch.Tensor, length: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the first ``length`` cached tokens of one sequence as contiguous ``[length, Hkv, D]`` K and V.

    FP8 values are dequantised with the descriptor's scales. Used by the reference implementation and by
    benchmarks that feed peers contiguous tensors; kernels never gather.
    """
    bs = cache.block_size
    n_blocks = -(-length // bs)
    blocks = block_table_row[:n_blocks].to(device=cache.key.device, dtype=torch.int64)
    k = as_stored_type(cache.key, cache.dtype)[blocks]
    v = as_stored_type(cache.value, cache.dtype)[blocks]
    if cache.layout is KVLayout.SPLIT:
        nb, hkv, dx, _, x = k.shape
        k = k.permute(0, 3, 1, 2, 4).reshape(nb * bs, hkv, dx * x)
        v = v.permute(0, 3, 1, 2).reshape(nb * bs, hkv, v.shape[2])
    else:
        k = k.reshape(-1, k.shape[2], k.shape[3])
        v = v.reshape(-1, v.shape[2], v.shape[3])
    k, v = k[:length].to(dtype), v[:length].to(dtype)
    if cache.dtype.is_fp8:
        k = k * scale_value(cache.k_scale)
        v = v * scale_value(cache.v_scale)
    return k, v

"""Tiling policy of ``mybackend``: ``(ProblemShape, DeviceInfo) -> TileConfig``.

A policy decides from the shape of a call (never its data) and the device. This one:

* ``block_n``: 64 keys for head sizes up to 64, 32 above (K/V tiles grow with the head size);
* ``block_m``: 128 query rows for long prefills, 64 for short (decode-like) batches, halved for float32;
* ``num_warps``: 8 for 128-row tiles, else 4 (on 64-wide warps, half as many);
* ``num_stages``: 2 when the device has shared memory for double buffering, else 1;
* query heads of one KV group packed into a tile (up to ``block_m / 16``), so K/V tiles are read once;
* finally :func:`pagedprefill.tiling.shrink_to_fit`, so no tile exceeds the device's shared memory.

Replace the rules with measurements on your hardware; keep ``shrink_to_fit`` as the last step.
"""

from __future__ import annotations

from pagedprefill.device import DeviceInfo
from pagedprefill.tiling import ProblemShape, TileConfig, shrink_to_fit

#: Shared memory assumed when the device description does not say (bytes).
DEFAULT_SHARED_MEM = 48 * 1024


def my_policy(shape: ProblemShape, device: DeviceInfo) -> TileConfig:
    """Pick the tile for ``shape`` on ``device``."""
    budget = device.max_shared_mem or DEFAULT_SHARED_MEM
    block_n = 64 if shape.head_size_padded <= 64 else 32
    block_m = 128 if shape.workload == "long" else 64
    if shape.element_size >= 4:
        block_m //= 2
    num_warps = 8 if block_m >= 128 else 4
    if device.warp_size >= 64:
        num_warps = max(1, num_warps // 2)
    num_stages = 2 if budget >= 96 * 1024 else 1
    heads = max(1, min(shape.group_size, block_m // 16))
    config = TileConfig(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                        heads_per_tile=heads, split_masks=True)
    return shrink_to_fit(config, shape, device, budget)
